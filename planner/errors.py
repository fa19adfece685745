"""The one error type of :mod:`planner`.

Every failure a user can cause (a malformed budget, a budget below what any plan reaches, a model that does not
capture, inputs that do not match) raises :class:`PlannerError` with the cause and a hint of what would work.

>>> raise PlannerError("budget '8 bananas' is not a size", hint="write 8GB, 512MiB, an int of bytes or '60%'")
Traceback (most recent call last):
...
planner.errors.PlannerError: budget '8 bananas' is not a size. Hint: write 8GB, 512MiB, an int of bytes or '60%'
"""

from __future__ import annotations

import os
import sys
import warnings


class PlannerError(Exception):
    """A problem with what the user asked for, stated with what would work instead."""

    def __init__(self, message: str, *, hint: str | None = None, minimum_budget_bytes: int | None = None):
        self.message = message
        self.hint = hint
        self.minimum_budget_bytes = minimum_budget_bytes
        super().__init__(message if hint is None else f"{message}. Hint: {hint}")


class InfeasibleBudgetError(PlannerError):
    """The budget is below the smallest peak any plan reaches; ``minimum_budget_bytes`` holds that peak."""


_PLANNER = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_at_callers_line(warning: Warning) -> None:
    """Issue ``warning`` where the user's code led to it: at the first frame outside the planner and torch (a call
    of the planned module reaches the planner through ``nn.Module.__call__``), so the message names the user's own
    line, and the default filter shows it once per such line.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_at_callers_line(UserWarning("look here"))
    >>> caught[0].filename.endswith("errors.py")
    False
    """
    torch = sys.modules.get("torch")
    libraries = (_PLANNER,) + ((os.path.dirname(torch.__file__) + os.sep,) if torch is not None else ())
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(libraries):
        frame, level = frame.f_back, level + 1
    warnings.warn(warning, stacklevel=level + 1)
