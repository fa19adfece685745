"""Memory budgets as users write them, and byte counts as people read them.

Units follow the ecosystem: ``GB``/``MB``/``kB`` are powers of 10, ``GiB``/``MiB``/``KiB`` powers of 2, a bare
int is bytes and ``"60%"`` is a share of the eager (no recomputation) peak.

>>> parse_budget("8GB")
Budget(text='8GB', absolute_bytes=8000000000, fraction_of_eager=None)
>>> parse_budget("512MiB").absolute_bytes
536870912
>>> parse_budget("60%").resolve(eager_peak_bytes=1000)
600
>>> format_bytes(1536 * 1024)
'1.50 MiB'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import PlannerError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*|%)\s*$")
_HINT = "write an int of bytes, a size such as '8GB', '512MiB', '1.5GiB', or a share of the eager peak such as '60%'"


@dataclass(frozen=True)
class Budget:
    """A budget as given: either absolute bytes or a fraction of the eager peak."""

    text: str
    absolute_bytes: int | None = None
    fraction_of_eager: float | None = None

    def resolve(self, eager_peak_bytes: int) -> int:
        """Bytes this budget allows for a model whose eager peak is ``eager_peak_bytes``."""
        if self.absolute_bytes is not None:
            return self.absolute_bytes
        assert self.fraction_of_eager is not None
        return int(self.fraction_of_eager * eager_peak_bytes)


def parse_budget(budget: int | float | str | Budget) -> Budget:
    """Read a budget from an int of bytes or a string such as ``"8GB"``, ``"512MiB"`` or ``"60%"``.

    >>> parse_budget(1024).absolute_bytes
    1024
    >>> parse_budget("1.5 GiB").absolute_bytes
    1610612736
    >>> parse_budget("eight gigs")
    Traceback (most recent call last):
    ...
    planner.errors.PlannerError: budget 'eight gigs' is not a size. Hint: write an int of bytes, a size such as '8GB', '512MiB', '1.5GiB', or a share of the eager peak such as '60%'
    """
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise PlannerError(f"budget {budget!r} of type {type(budget).__name__} is not a size", hint=_HINT)
    if isinstance(budget, (int, float)):
        if budget <= 0 or budget != budget:
            raise PlannerError(f"budget {budget!r} must be a positive number of bytes", hint=_HINT)
        return Budget(text=str(budget), absolute_bytes=int(budget))
    match = _PATTERN.match(budget)
    if match is None:
        raise PlannerError(f"budget {budget!r} is not a size", hint=_HINT)
    number, unit = float(match.group(1)), match.group(2)
    if unit == "%":
        if not 0 < number <= 1000:
            raise PlannerError(f"budget {budget!r} must be a share above 0%", hint=_HINT)
        return Budget(text=budget, fraction_of_eager=number / 100)
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise PlannerError(f"budget {budget!r} has an unknown unit {unit!r}", hint=_HINT)
    if number <= 0:
        raise PlannerError(f"budget {budget!r} must be positive", hint=_HINT)
    return Budget(text=budget, absolute_bytes=int(round(number * scale)))


def format_bytes(nbytes: float) -> str:
    """Bytes in binary units with two decimals, as memory tools print them.

    >>> format_bytes(0)
    '0 B'
    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
    """
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_bytes_apart(first: float, second: float) -> tuple[str, str]:
    """Two sizes as :func:`format_bytes` prints them, each with its exact byte count where those prints are equal
    (a budget a few bytes short of what it must be reads as short).

    >>> format_bytes_apart(1_974_000, 1_975_304)
    ('1.88 MiB (1,974,000 B)', '1.88 MiB (1,975,304 B)')
    >>> format_bytes_apart(1_000_000, 1_975_304)
    ('976.56 KiB', '1.88 MiB')
    """
    printed = format_bytes(first), format_bytes(second)
    if printed[0] != printed[1] or first == second:
        return printed
    return f"{printed[0]} ({first:,.0f} B)", f"{printed[1]} ({second:,.0f} B)"
