"""Fitting a budget under ``torch.compile``: plan, compile, measure, plan again.

Inductor fuses and reorders the planned module's forward and backward, so a compiled plan's peak is not the one the
plan predicts for eager execution: mostly lower (the partitioner recomputes cheap ops of its own accord), sometimes
higher (a test-size BERT plan predicted at 14.49 MiB peaked at 20.86 MiB compiled, inductor having fused one layer's
recomputation into the next layer's backward kernel). No cost model of the compiled code is good enough to plan on,
so the search here measures: it compiles a plan, measures its step's peak, and plans again for a budget scaled by how
far the peak missed, until a compiled plan fits within a few percent of the budget.

The search is plain data and callbacks (no torch): ``solve(target)`` gives the plan for a target peak and
``measure(plan)`` compiles it and returns its measured peak with whatever the caller keeps of it (the compiled
module). :func:`planner.optimize` with ``compile=True`` and ``benchmarks/run.py`` both run it.

>>> from planner.errors import InfeasibleBudgetError
>>> def solve(target):  # a model whose plans each need a tenth more than predicted once compiled
...     if target < 50:
...         raise InfeasibleBudgetError("too small", minimum_budget_bytes=50)
...     return max(50, target - target % 10)  # a "plan": the peak it is predicted at
>>> fit = fit_compiled(solve, lambda plan: (plan * 11 // 10, f"module for {plan}"), 100, predicted_peak=int)
>>> fit.kept.peak_bytes, fit.kept.payload, [m.peak_bytes for m in fit.tried]
(99, 'module for 90', [110, 99])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from .errors import InfeasibleBudgetError

__all__ = ["CompiledPlan", "CompiledFit", "fit_compiled", "fit_plans", "next_target", "COMPILED_REPLANS",
           "COMPILED_SLACK"]

P = TypeVar("P")  # a plan
T = TypeVar("T")  # what the caller keeps of a compiled plan

COMPILED_REPLANS = 4  # plans compiled after the first, at most
COMPILED_SLACK = 0.03  # a compiled plan this far under its budget is planned again for more memory


@dataclass(frozen=True)
class CompiledPlan(Generic[P, T]):
    """One plan compiled and measured: the target it was solved for, its measured peak and the caller's payload."""

    plan: P
    target_bytes: int
    peak_bytes: int
    payload: T


@dataclass(frozen=True)
class CompiledFit(Generic[P, T]):
    """What the search found: ``kept``, the fitting plan solved for the most memory (the least recomputation; None
    when none fit), every plan compiled in the order measured, and how many times the solver ran."""

    budget_bytes: int
    kept: CompiledPlan[P, T] | None
    tried: tuple[CompiledPlan[P, T], ...]
    solves: int

    @property
    def smallest_peak_bytes(self) -> int:
        """The lowest compiled peak measured: a budget that one of the tried plans is known to fit."""
        return min(m.peak_bytes for m in self.tried)


def next_target(target: int, predicted: int, peak: int, budget: int, fits_at: int, exceeds_at: float) -> int:
    """The budget to plan for next, after a compiled plan planned for ``target`` (predicted to peak at
    ``predicted``) measured ``peak``: ``target`` scaled by how far ``peak`` missed ``budget`` (when over, from the
    prediction if lower, and at least 1% less), kept strictly between the highest target whose plan fit
    (``fits_at``, 0 for none) and the lowest predicted peak of a plan that exceeded (``exceeds_at``: the solver
    gives that plan again for any target above it): a step that leaves that bracket halves it instead, so the
    search closes in on the largest plan that fits rather than jumping across it.

    >>> next_target(100, 100, 110, 100, 0, 100)  # over by 10%: plan for 10% less
    90
    >>> next_target(80, 78, 80, 100, 80, 90)  # 20% under, but a plan predicted at 90 exceeded: halve [80, 90)
    85
    """
    missed_by = budget / peak
    proposal = int(target * missed_by) if peak <= budget else int(min(target, predicted) * min(missed_by, 0.99))
    if fits_at < proposal < exceeds_at:
        return proposal
    return int((fits_at + exceeds_at) / 2) if exceeds_at != float("inf") else proposal


def fit_compiled(solve: Callable[[int], P], measure: Callable[[P], tuple[int, T]], budget_bytes: int, *,
                 predicted_peak: Callable[[P], int], key: Callable[[P], object] = lambda plan: plan,
                 recomputes: Callable[[P], bool] = lambda plan: True,
                 replans: int = COMPILED_REPLANS, slack: float = COMPILED_SLACK) -> CompiledFit[P, T]:
    """Search for the plan solved for the most memory whose compiled step fits ``budget_bytes``.

    The first plan is solved for the budget itself. Each plan is measured (``measure``) unless one with the same
    ``key`` (its regions) already was; the next target comes from :func:`next_target`. The search stops when a
    fitting plan is within ``slack`` of the budget or recomputes nothing (``recomputes``), when no target is left
    between the fitting and the exceeding ones or the next target was solved for already, or after ``replans`` more
    plans were compiled. When the solver has no plan left below a target, the plan needing the least memory is
    tried once. The first solve's :class:`~planner.errors.InfeasibleBudgetError` propagates: no plan reaches the
    budget even before compiling.

    >>> def solve(target):  # plans land at multiples of 100; compiled, each needs 150 more
    ...     return min(1000, target - target % 100)
    >>> fit = fit_compiled(solve, lambda plan: (plan + 150, None), 1000, predicted_peak=int)
    >>> fit.kept.plan, fit.kept.peak_bytes, [m.plan for m in fit.tried], fit.solves
    (800, 950, [1000, 800, 900], 6)
    """
    target, kept, tried_least = budget_bytes, None, False
    fits_at, exceeds_at, solves = 0, float("inf"), 0
    measured: dict[object, CompiledPlan[P, T]] = {}
    solved_for: set[int] = set()
    while len(measured) <= replans and target not in solved_for:
        solves += 1
        solved_for.add(target)
        try:
            plan = solve(target)
        except InfeasibleBudgetError as error:
            if not measured:
                raise
            if kept is not None or tried_least or not error.minimum_budget_bytes:
                break
            target, tried_least = error.minimum_budget_bytes, True
            continue
        if key(plan) not in measured:
            peak, payload = measure(plan)
            measured[key(plan)] = CompiledPlan(plan, target, peak, payload)
        found = measured[key(plan)]
        if found.peak_bytes <= budget_bytes:
            if kept is None or target > fits_at:  # the most memory that fits: the least recomputation
                kept, fits_at = CompiledPlan(found.plan, target, found.peak_bytes, found.payload), target
            if found.peak_bytes >= (1 - slack) * budget_bytes or not recomputes(plan):
                break
        else:
            exceeds_at = min(exceeds_at, predicted_peak(plan))
        if exceeds_at - fits_at < 0.005 * budget_bytes:  # no plan left between them worth compiling
            break
        target = next_target(target, predicted_peak(plan), found.peak_bytes, budget_bytes, fits_at, exceeds_at)
    return CompiledFit(budget_bytes, kept, tuple(measured.values()), solves)


def fit_plans(solve: Callable[[int], P], measure: Callable[[P], tuple[int, T]],
              budget_bytes: int) -> CompiledFit[P, T]:
    """:func:`fit_compiled` over :class:`~planner.plan.Plan` objects: each predicted at its
    ``predicted_peak_bytes``, told apart by its ``regions``, recomputing something when it has any."""
    return fit_compiled(solve, measure, budget_bytes, predicted_peak=lambda plan: plan.predicted_peak_bytes,
                        key=lambda plan: plan.regions, recomputes=lambda plan: bool(plan.regions))
