"""Solvers: from a :class:`~planner.problem.Problem` and a budget in bytes to a :class:`~planner.plan.Plan`.

* ``"ilp"``: exact mixed-integer program (:mod:`.ilp`), any problem;
* ``"dp"``: dynamic program (:mod:`.dp`), exact on chains, conservative elsewhere;
* ``"store_all"``, ``"uniform"``, ``"chen_sqrt"``, ``"fewest_blocks"``: baselines (:mod:`.baselines`);
* ``"auto"``: the DP when :meth:`Problem.is_chain() <planner.problem.Problem.is_chain>` (and the ILP too when the
  DP cannot prove its plan optimal), else the ILP.

>>> from planner.problem import Problem, Stage, TensorInfo
>>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(4))
>>> inner = tuple(TensorInfo(f"a{i}", 100, i, frozenset({i}), frozenset({i})) for i in range(4))
>>> edges = tuple(TensorInfo(f"x{i}", 10, i, frozenset({i + 1}), frozenset({i + 1})) for i in range(3))
>>> problem = Problem(stages, inner + edges)
>>> solve(problem, 250).solver, solve(problem, 250, method="ilp").predicted_recompute_seconds
('dp', 2.0)
>>> minimum_peak(problem)
130
>>> solve(problem, 250, method="magic")
Traceback (most recent call last):
...
planner.errors.PlannerError: unknown solver method 'magic'. Hint: choose one of auto, ilp, dp, store_all, uniform, chen_sqrt, fewest_blocks
"""

from __future__ import annotations

from ..errors import PlannerError
from ..plan import Plan, SolverStatus
from ..problem import Problem
from .baselines import BASELINES, solve_baseline
from .dp import minimum_peak, solve_dp
from .ilp import min_peak_ilp, solve_ilp

METHODS = ("auto", "ilp", "dp", *BASELINES)

__all__ = ["METHODS", "minimum_peak", "min_peak_ilp", "solve", "solve_baseline", "solve_dp", "solve_ilp"]


def solve(problem: Problem, budget_bytes: int, method: str = "auto", **options) -> Plan:
    """Plan ``problem`` under ``budget_bytes`` with ``method``; ``options`` go to the solver (``time_limit``,
    ``gap`` for the ILP, ``buckets`` for the DP)."""
    if method == "auto":
        return _solve_auto(problem, budget_bytes, **options)
    if method == "ilp":
        return solve_ilp(problem, budget_bytes, **options)
    if method == "dp":
        return solve_dp(problem, budget_bytes, **options)
    if method in BASELINES:
        if options:
            raise PlannerError(f"baseline {method!r} takes no options, got {sorted(options)}")
        return solve_baseline(problem, method, budget_bytes)
    raise PlannerError(f"unknown solver method {method!r}", hint=f"choose one of {', '.join(METHODS)}")


def _solve_auto(problem: Problem, budget_bytes: int, **options) -> Plan:
    """The DP on chains; the ILP where the DP cannot prove its plan optimal (non-chains, coarse discretisation or
    a cut Pareto front), keeping the faster of the two plans."""
    ilp_options = {k: v for k, v in options.items() if k in ("time_limit", "gap")}
    if not problem.is_chain():
        return solve_ilp(problem, budget_bytes, **ilp_options)
    plan = solve_dp(problem, budget_bytes, **{k: v for k, v in options.items() if k not in ilp_options})
    if plan.status is SolverStatus.OPTIMAL:
        return plan
    exact = solve_ilp(problem, budget_bytes, **ilp_options)
    return exact if exact.predicted_recompute_seconds <= plan.predicted_recompute_seconds else plan
