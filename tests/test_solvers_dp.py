"""The DP: exact on chains (brute force, the ILP), feasible and verified everywhere else."""

from __future__ import annotations

import pytest

from planner.errors import InfeasibleBudgetError
from planner.plan import SolverStatus
from planner.problem import Schedule, simulate
from planner.solvers.dp import minimum_peak, solve_dp
from planner.solvers.ilp import solve_ilp
from tests.solver_problems import brute_force_best, brute_force_table, layered_chain, random_chain, random_dag

CHAINS = [(4, 0, 2), (4, 3, 2), (4, 9, 3), (5, 1, 2), (5, 4, 3), (5, 12, 2)]


@pytest.mark.parametrize("n,seed,options", CHAINS)
def test_dp_matches_brute_force_on_chains(n, seed, options):
    problem = random_chain(n, seed, num_options=options)
    assert problem.is_chain()
    table = brute_force_table(problem)
    peaks = sorted({peak for peak, _, _ in table})
    smallest = peaks[0]
    assert minimum_peak(problem) == smallest
    for budget in (smallest, peaks[len(peaks) // 8], peaks[len(peaks) // 4], peaks[len(peaks) // 2], peaks[-1]):
        plan = solve_dp(problem, budget)
        assert plan.status == SolverStatus.OPTIMAL and plan.solver == "dp"
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_recompute_seconds == pytest.approx(brute_force_best(table, budget), abs=1e-9)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_dp(problem, smallest - 1)
    assert info.value.minimum_budget_bytes == smallest


@pytest.mark.parametrize("n,seed", [(12, 0), (16, 5), (20, 2)])
def test_dp_agrees_with_the_ilp_on_longer_chains(n, seed):
    problem = random_chain(n, seed)
    eager = simulate(problem, Schedule()).peak_bytes
    smallest = minimum_peak(problem)
    budget = smallest + (eager - smallest) // 3
    dp, ilp = solve_dp(problem, budget, front_limit=2048), solve_ilp(problem, budget, time_limit=60)
    assert dp.status == ilp.status == SolverStatus.OPTIMAL
    assert dp.predicted_recompute_seconds == pytest.approx(ilp.predicted_recompute_seconds, abs=1e-9)
    assert dp.predicted_peak_bytes <= budget and ilp.predicted_peak_bytes <= budget


@pytest.mark.parametrize("seed", range(8))
def test_dp_stays_within_budget_on_non_chains(seed):
    problem = random_dag(4 + seed % 3, seed)
    table = brute_force_table(problem)
    peaks = sorted({peak for peak, _, _ in table})
    for budget in (peaks[0], peaks[len(peaks) // 4], peaks[len(peaks) // 2]):
        plan = solve_dp(problem, budget)
        assert plan.predicted_peak_bytes == simulate(problem, plan.schedule).peak_bytes <= budget
        assert plan.predicted_recompute_seconds >= brute_force_best(table, budget) - 1e-9
    assert minimum_peak(problem) == peaks[0]


def test_coarse_buckets_round_up_and_stay_feasible():
    problem = random_chain(10, 6)
    eager = simulate(problem, Schedule()).peak_bytes
    budget = (minimum_peak(problem) + eager) // 2
    exact = solve_dp(problem, budget)
    coarse = solve_dp(problem, budget, buckets=40)
    assert coarse.predicted_peak_bytes <= budget
    assert coarse.predicted_recompute_seconds >= exact.predicted_recompute_seconds - 1e-9
    assert coarse.status in (SolverStatus.OPTIMAL, SolverStatus.FEASIBLE)


def test_a_budget_the_eager_step_fits_needs_no_recomputation():
    problem = random_chain(7, 1)
    plan = solve_dp(problem, simulate(problem, Schedule()).peak_bytes)
    assert plan.regions == () and plan.status == SolverStatus.OPTIMAL


def test_dp_agrees_with_the_ilp_on_nested_option_menus():
    problem = layered_chain(8, 1)
    smallest = minimum_peak(problem)
    eager = simulate(problem, Schedule()).peak_bytes
    for budget in (smallest, smallest + (eager - smallest) // 10):
        dp, ilp = solve_dp(problem, budget), solve_ilp(problem, budget)
        assert dp.status == ilp.status == SolverStatus.OPTIMAL
        assert dp.predicted_recompute_seconds == pytest.approx(ilp.predicted_recompute_seconds, abs=1e-9)


def test_a_cut_pareto_front_is_reported_as_feasible_only():
    problem = random_chain(14, 4, num_options=3)
    smallest = minimum_peak(problem)
    budget = smallest + (simulate(problem, Schedule()).peak_bytes - smallest) // 4
    full, cut = solve_dp(problem, budget), solve_dp(problem, budget, front_limit=2)
    assert full.status == SolverStatus.OPTIMAL and cut.status == SolverStatus.FEASIBLE
    assert cut.predicted_peak_bytes <= budget
    assert cut.predicted_recompute_seconds >= full.predicted_recompute_seconds - 1e-9
