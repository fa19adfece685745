"""Property-based tests of the public solver entry point over random layered DAG problems (pure data, no torch).

For any problem and budget: a returned plan fits in its own execution model, is never slower than the best
baseline that fits, infeasible budgets raise :class:`InfeasibleBudgetError` naming the exact smallest peak (from
brute force over every schedule), and a solver cut short by its time limit still returns a feasible plan with its
gap. Example counts are small: the whole file runs in seconds.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.errors import InfeasibleBudgetError
from planner.plan import SolverStatus
from planner.problem import Schedule, simulate
from planner.solvers import solve
from planner.solvers.baselines import BASELINES
from tests.solver_problems import brute_force_table, random_chain, random_dag

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw, max_stages: int = 4):
    """A random layered DAG (or chain) problem small enough to brute-force."""
    n = draw(st.integers(2, max_stages))
    seed = draw(st.integers(0, 10_000))
    options = draw(st.integers(1, 2))
    if draw(st.booleans()):
        return random_dag(n, seed, num_options=options, reach=draw(st.integers(1, 3)))
    return random_chain(n, seed, num_options=options)


def _range(problem) -> tuple[int, int]:
    table = brute_force_table(problem)
    return min(peak for peak, _, _ in table), simulate(problem, Schedule.store_all(problem.num_stages)).peak_bytes


def _best_feasible_baseline(problem, budget: int) -> float | None:
    seconds = []
    for name in BASELINES:
        try:
            plan = solve(problem, budget, method=name)
        except InfeasibleBudgetError:
            continue
        if plan.predicted_peak_bytes <= budget:
            seconds.append(plan.predicted_recompute_seconds)
    return min(seconds) if seconds else None


@SETTINGS
@given(problem=problems(), share=st.floats(0.0, 1.0), method=st.sampled_from(["auto", "ilp", "dp"]))
def test_plans_fit_their_own_model_and_beat_every_feasible_baseline(problem, share, method):
    smallest, eager = _range(problem)
    budget = int(smallest + share * (eager - smallest))
    try:
        plan = solve(problem, budget, method=method)
    except InfeasibleBudgetError:
        assert method == "dp" and not problem.is_chain(), "only the DP off chains may miss a feasible budget"
        return
    evaluation = simulate(problem, plan.schedule)
    assert evaluation.peak_bytes == plan.predicted_peak_bytes <= budget
    assert evaluation.recompute_seconds == pytest.approx(plan.predicted_recompute_seconds)
    best = _best_feasible_baseline(problem, budget)
    if best is not None and (method != "dp" or problem.is_chain()):
        assert plan.predicted_recompute_seconds <= best + 1e-9, (plan.solver, best)


@SETTINGS
@given(problem=problems(), below=st.integers(1, 10_000), method=st.sampled_from(["auto", "ilp"]))
def test_infeasible_budgets_raise_with_the_exact_minimum(problem, below, method):
    smallest, _ = _range(problem)
    budget = max(0, smallest - below)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(problem, budget, method=method)
    assert info.value.minimum_budget_bytes == smallest


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), share=st.floats(0.2, 0.8))
def test_a_time_limited_solve_returns_a_feasible_plan_and_its_gap(seed, share):
    problem = random_dag(12, seed, num_options=3, reach=4)
    eager = simulate(problem, Schedule.store_all(problem.num_stages)).peak_bytes
    uniform = simulate(problem, Schedule.uniform(problem.num_stages)).peak_bytes
    budget = int(min(uniform, eager) + share * abs(eager - uniform))
    plan = solve(problem, budget, method="ilp", time_limit=0.5)
    assert simulate(problem, plan.schedule).peak_bytes == plan.predicted_peak_bytes <= budget
    if plan.status is SolverStatus.OPTIMAL:
        assert not plan.gap
    else:
        assert plan.status is SolverStatus.FEASIBLE and plan.gap is not None and plan.gap >= 0
