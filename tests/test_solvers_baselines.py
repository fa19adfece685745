"""Baselines (structure, timings, budgets), the infeasible-budget message, and ``solvers.solve`` dispatch."""

from __future__ import annotations

import math

import pytest

from planner import solvers
from planner.errors import InfeasibleBudgetError, PlannerError
from planner.plan import SolverStatus
from planner.problem import Problem, Schedule, Stage, TensorInfo, simulate
from planner.solvers.baselines import (checkpoint_prefix, chen_sqrt, fewest_blocks, infeasible_budget_error,
                                       solve_baseline, store_all, uniform, whole)
from tests.solver_problems import random_chain, random_dag


@pytest.mark.parametrize("n", range(1, 40))
def test_chen_sqrt_checkpoints_equal_segments_and_stores_the_last(n):
    problem = random_chain(n, seed=n)
    size = math.ceil(math.sqrt(n))
    regions = chen_sqrt(problem).regions
    assert [(r.start, r.stop) for r in regions] == [(k * size, (k + 1) * size) for k in range(len(regions))]
    tail = n - (regions[-1].stop if regions else 0)
    assert 1 <= tail <= size
    assert all(r.options == () for r in regions)


@pytest.mark.parametrize("maker", [random_chain, random_dag])
def test_whole_is_one_region_that_holds_no_activation_into_the_backward(maker):
    """What a part of a model planned in parts keeps while the other parts run: nothing it made, once its
    forward is done; its last stage begins the backward with the whole region made again."""
    problem = maker(8, seed=3)
    assert [(r.start, r.stop, r.options) for r in whole(problem).regions] == [(0, 8, ())]
    stored = simulate(problem, store_all(problem)).events
    checkpointed = simulate(problem, whole(problem)).events
    last_forward = [e for e in checkpointed if e.phase.value == "forward"][-1]
    assert last_forward.activation_bytes <= [e for e in stored if e.phase.value == "forward"][-1].activation_bytes
    assert solve_baseline(problem, "whole").predicted_recompute_seconds > 0
    assert whole(random_chain(0, seed=0)).regions == ()


@pytest.mark.parametrize("maker", [random_chain, random_dag])
def test_uniform_recomputes_every_stage_at_its_forward_time(maker):
    """Each stage's forward again, stopped early (each region caches nothing), and what each of the nine regions
    costs itself."""
    problem = maker(9, seed=3)
    schedule = uniform(problem)
    assert [(r.start, r.stop) for r in schedule.regions] == [(k, k + 1) for k in range(9)]
    evaluation = simulate(problem, schedule)
    stopped = [s.forward_seconds - min(s.early_stop_seconds, s.forward_seconds) for s in problem.stages]
    assert any(s.early_stop_seconds for s in problem.stages)
    assert evaluation.recompute_seconds == pytest.approx(sum(stopped) + 9 * problem.region_seconds)


def test_store_all_recomputes_nothing():
    problem = random_dag(6, seed=1)
    assert store_all(problem) == Schedule()
    plan = solve_baseline(problem, "store_all")
    assert plan.predicted_recompute_seconds == 0
    assert plan.predicted_peak_bytes == plan.eager_peak_bytes


@pytest.mark.parametrize("seed", range(6))
def test_fewest_blocks_takes_the_shortest_fitting_prefix(seed):
    problem = random_chain(8, seed=seed)
    peaks = [simulate(problem, checkpoint_prefix(problem, m)).peak_bytes for m in range(9)]
    for budget in sorted(set(peaks)):
        schedule = fewest_blocks(problem, budget)
        count = len(schedule.regions)
        assert schedule == checkpoint_prefix(problem, count)
        assert peaks[count] <= budget
        assert all(peak > budget for peak in peaks[:count])
    assert fewest_blocks(problem, min(peaks) - 1) is None


def test_solve_baseline_wraps_rules_as_heuristic_plans():
    problem = random_chain(7, seed=2)
    for name in ("store_all", "uniform", "chen_sqrt"):
        plan = solve_baseline(problem, name, budget_bytes=123)
        assert plan.solver == name and plan.status == SolverStatus.HEURISTIC and plan.budget_bytes == 123
        rule = {"store_all": store_all, "uniform": uniform, "chen_sqrt": chen_sqrt}[name]
        assert [(r.start, r.stop) for r in plan.schedule.regions] == [(r.start, r.stop) for r in rule(problem).regions]
        assert all(o == 0 for r in plan.regions for o in r.options)


def test_fewest_blocks_needs_a_budget_and_reports_its_own_minimum():
    problem = random_chain(6, seed=4)
    with pytest.raises(PlannerError, match="needs a budget"):
        solve_baseline(problem, "fewest_blocks")
    best = min(simulate(problem, checkpoint_prefix(problem, m)).peak_bytes for m in range(7))
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_baseline(problem, "fewest_blocks", budget_bytes=best - 1)
    assert info.value.minimum_budget_bytes == best
    assert solve_baseline(problem, "fewest_blocks", budget_bytes=best).predicted_peak_bytes <= best


def test_unknown_baseline_lists_the_known_ones():
    with pytest.raises(PlannerError, match="store_all, uniform, chen_sqrt, fewest_blocks"):
        solve_baseline(random_chain(3), "sqrt")


def test_infeasible_message_names_budget_eager_minimum_and_what_dominates():
    problem = random_dag(5, seed=2)
    minimum = min((checkpoint_prefix(problem, m) for m in range(6)), key=lambda s: simulate(problem, s).peak_bytes)
    error = infeasible_budget_error(problem, 100, minimum)
    peak = simulate(problem, minimum).peak_bytes
    assert error.minimum_budget_bytes == peak
    text = str(error)
    assert "budget 100 B" in text and "eager peak" in text and "fixed memory" in text and "gradients" in text
    assert "at least" in text


# --- solvers.solve -------------------------------------------------------------------------------------------------

def test_auto_proves_chains_with_the_dp_and_closes_dag_gaps_with_the_ilp():
    chain, dag = random_chain(5, seed=1), random_dag(5, seed=1)
    assert chain.is_chain() and not dag.is_chain()
    for problem in (chain, dag):
        eager = simulate(problem, Schedule()).peak_bytes
        budget = (eager + solvers.minimum_peak(problem)) // 2
        plan = solvers.solve(problem, budget)
        exact = solvers.solve(problem, budget, method="ilp")
        assert plan.status is SolverStatus.OPTIMAL and plan.gap == 0.0
        assert plan.predicted_recompute_seconds == pytest.approx(exact.predicted_recompute_seconds)
        assert plan.lower_bound_seconds == pytest.approx(plan.predicted_recompute_seconds)
    assert solvers.solve(chain, (simulate(chain, Schedule()).peak_bytes + solvers.minimum_peak(chain)) // 2
                         ).solver == "dp"


@pytest.mark.parametrize("method", ["ilp", "dp", "store_all", "uniform", "chen_sqrt", "fewest_blocks"])
def test_solve_dispatches_every_method(method):
    problem = random_chain(5, seed=3)
    eager = simulate(problem, Schedule()).peak_bytes
    plan = solvers.solve(problem, eager, method=method)
    assert plan.solver == method and plan.budget_bytes == eager


def test_solve_rejects_unknown_methods_and_stray_options():
    problem = random_chain(3)
    with pytest.raises(PlannerError, match="auto, ilp, dp, store_all, uniform, chen_sqrt, fewest_blocks"):
        solvers.solve(problem, 10**6, method="greedy")
    with pytest.raises(PlannerError, match="takes no options"):
        solvers.solve(problem, 10**6, method="uniform", time_limit=3)
    with pytest.raises(TypeError):
        solvers.solve(problem, 10**6, method="dp", gap=0.1)


def test_infeasible_message_tells_a_budget_a_few_bytes_short_from_the_minimum():
    problem = Problem((Stage("a", 1.0, 2.0, grad_bytes=300_000), Stage("b", 1.0, 2.0)),
                      (TensorInfo("x", 200_000, 0, frozenset({1}), frozenset({1})),), fixed_bytes=500_000)
    text = str(infeasible_budget_error(problem, 799_997, Schedule()))
    assert "budget 781.25 KiB (799,997 B) is below the smallest peak any plan reaches, 781.25 KiB (800,000 B)" in text
