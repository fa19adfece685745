"""The one error type of :mod:`planner`.

Every failure a user can cause (a malformed budget, a budget below what any plan reaches, a model that does not
capture, inputs that do not match) raises :class:`PlannerError` with the cause and a hint of what would work.

>>> raise PlannerError("budget '8 bananas' is not a size", hint="write 8GB, 512MiB, an int of bytes or '60%'")
Traceback (most recent call last):
...
planner.errors.PlannerError: budget '8 bananas' is not a size. Hint: write 8GB, 512MiB, an int of bytes or '60%'
"""

from __future__ import annotations


class PlannerError(Exception):
    """A problem with what the user asked for, stated with what would work instead."""

    def __init__(self, message: str, *, hint: str | None = None, minimum_budget_bytes: int | None = None):
        self.message = message
        self.hint = hint
        self.minimum_budget_bytes = minimum_budget_bytes
        super().__init__(message if hint is None else f"{message}. Hint: {hint}")


class InfeasibleBudgetError(PlannerError):
    """The budget is below the smallest peak any plan reaches; ``minimum_budget_bytes`` holds that peak."""
