"""The ILP: its encoding reproduces ``simulate``, and its optimum equals brute force over every schedule."""

from __future__ import annotations

import pathlib
import random
import subprocess
import sys

import pytest

from planner.errors import InfeasibleBudgetError, PlannerError
from planner.plan import SolverStatus
from planner.problem import Schedule, simulate
from planner.solvers.ilp import Encoding, _cbc_bound, encoded_peak, group_tensors, min_peak_ilp, solve_ilp
from tests.solver_problems import (bn_relu_conv, brute_force_best, brute_force_table, layered_chain, random_chain,
                                   random_dag, random_schedule)

TINY = [(random_chain, 4, 0), (random_chain, 4, 5), (random_chain, 5, 7), (random_dag, 4, 1), (random_dag, 4, 6),
        (random_dag, 5, 3)]


@pytest.mark.parametrize("problem", [random_chain(9, 1), random_dag(8, 2), random_dag(10, 4, reach=6),
                                     random_dag(7, 5, num_options=3), layered_chain(12, 1)],
                         ids=lambda p: p.name)
def test_encoding_gives_every_schedule_the_simulated_peak(problem):
    encoding = Encoding(problem)
    rng = random.Random(0)
    for _ in range(60):
        schedule = random_schedule(problem, rng, recompute_share=rng.choice([0.3, 0.7, 1.0]))
        encoded = max(encoding.event_values(encoding.tight_values(schedule)))
        assert round(encoded) == simulate(problem, schedule).peak_bytes, schedule


@pytest.mark.parametrize("problem", [random_dag(6, 8), random_chain(7, 3), random_dag(7, 11, reach=5)],
                         ids=lambda p: p.name)
def test_encoding_event_values_match_simulate_event_by_event(problem):
    encoding = Encoding(problem)
    rng = random.Random(3)
    for _ in range(20):
        schedule = random_schedule(problem, rng, recompute_share=rng.choice([0.5, 0.8, 1.0]))
        values = encoding.event_values(encoding.tight_values(schedule))
        simulated = {(e.phase, e.stage): e.total_bytes for e in simulate(problem, schedule).events}
        encoded: dict = {}  # a stage's backward is one event per epoch (Stage.backward_epochs): the busiest counts
        for event, value in zip(encoding.events, values):
            encoded[event.phase, event.stage] = max(encoded.get((event.phase, event.stage), value), value)
        for (phase, stage), value in encoded.items():
            if (phase, stage) in simulated:
                assert round(value) == simulated[phase, stage], (phase, stage, schedule)
            else:  # a recomputation where no region ends: never above the backward start
                assert phase.value == "recompute"


def test_groups_sum_tensors_with_identical_rules():
    problem = layered_chain(4, 0)
    groups = group_tensors(problem)
    assert sum(g.nbytes for g in groups) == sum(t.nbytes for t in problem.tensors)
    assert len(groups) < len(problem.tensors)


@pytest.mark.parametrize("maker,n,seed", TINY)
def test_ilp_matches_brute_force_over_all_schedules(maker, n, seed):
    problem = maker(n, seed)
    table = brute_force_table(problem)
    peaks = sorted({peak for peak, _, _ in table})
    smallest = peaks[0]
    for budget in (smallest, peaks[len(peaks) // 6], peaks[len(peaks) // 3], peaks[len(peaks) // 2]):
        plan = solve_ilp(problem, budget)
        assert plan.status == SolverStatus.OPTIMAL and plan.solver == "ilp"
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_recompute_seconds == pytest.approx(brute_force_best(table, budget), abs=1e-9)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_ilp(problem, smallest - 1)
    assert info.value.minimum_budget_bytes == smallest
    assert min_peak_ilp(problem).predicted_peak_bytes == smallest


def test_ilp_frees_what_a_later_stage_re_runs_last():
    """``freed[g]`` takes a BatchNorm's output out of ``kept_before`` once the ReLU that reads it last re-ran (the
    DP's test of the same problem fails by 3 s at the two smallest budgets without it)."""
    problem = bn_relu_conv(blocks=2, conv_workspace=50)
    table = brute_force_table(problem)
    for budget in sorted({peak for peak, _, _ in table})[:3]:
        plan = solve_ilp(problem, budget)
        assert plan.status == SolverStatus.OPTIMAL
        assert plan.predicted_recompute_seconds == pytest.approx(brute_force_best(table, budget), abs=1e-9)
    assert all(encoded_peak(problem, schedule) == peak for peak, _, schedule in table)


def test_ilp_reported_peak_is_the_simulated_and_encoded_peak():
    problem = random_dag(9, 11)
    eager = simulate(problem, Schedule()).peak_bytes
    smallest = min_peak_ilp(problem).predicted_peak_bytes
    for budget in (smallest, (smallest + eager) // 2):
        plan = solve_ilp(problem, budget)
        peak = simulate(problem, plan.schedule).peak_bytes
        assert plan.predicted_peak_bytes == peak == encoded_peak(problem, plan.schedule)
        assert peak <= budget


def test_a_budget_the_eager_step_fits_needs_no_recomputation():
    problem = random_chain(6, 2)
    plan = solve_ilp(problem, simulate(problem, Schedule()).peak_bytes)
    assert plan.regions == () and plan.status == SolverStatus.OPTIMAL and plan.gap == 0.0


def test_infeasible_error_explains_the_minimum():
    problem = random_dag(5, 9)
    smallest = min_peak_ilp(problem).predicted_peak_bytes
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_ilp(problem, smallest // 2)
    text = str(info.value)
    assert info.value.minimum_budget_bytes == smallest
    assert "below the smallest peak" in text and "eager peak" in text and "fixed memory" in text


def test_a_short_time_limit_still_returns_a_plan_within_budget():
    problem = random_chain(16, 3)
    eager = simulate(problem, Schedule()).peak_bytes
    uniform = simulate(problem, Schedule.uniform(16)).peak_bytes
    budget = (eager + uniform) // 2
    try:
        plan = solve_ilp(problem, budget, time_limit=0.5)
    except PlannerError as error:  # no plan found in time: said so, not a wrong plan
        assert "within" in str(error)
        return
    assert plan.predicted_peak_bytes <= budget
    if plan.status == SolverStatus.FEASIBLE:
        assert plan.gap is None or plan.gap >= 0


def test_a_crashing_solver_leaves_the_warm_start(monkeypatch):
    """CBC 2.10 segfaulted on a 50-stage Llama problem: when the solver fails, the warm start (which fits) is the
    plan, not proven."""
    import pulp
    import planner.solvers.ilp as ilp

    monkeypatch.setattr(ilp, "_has_highs", lambda: False)

    class Crashing(pulp.PULP_CBC_CMD):
        def actualSolve(self, lp, **kwargs):
            raise pulp.PulpSolverError("Pulp: Error while trying to execute cbc")

    monkeypatch.setattr(pulp, "PULP_CBC_CMD", Crashing)
    problem = random_chain(6, 2)
    budget = simulate(problem, Schedule.uniform(6)).peak_bytes
    plan = solve_ilp(problem, budget, warm=Schedule.uniform(6))
    assert [(r.start, r.stop) for r in plan.schedule.regions] == [(k, k + 1) for k in range(6)]  # the start
    assert plan.status == SolverStatus.FEASIBLE and plan.gap is None


def _check_optimal_from_uniform_and_from_the_optimum(problem):
    """The ILP's plans halfway between uniform checkpointing's peak and eager's, started from uniform checkpointing,
    then from the plan that gave, are both the brute-force optimum, proven."""
    eager = simulate(problem, Schedule()).peak_bytes
    budget = (eager + simulate(problem, Schedule.uniform(problem.num_stages)).peak_bytes) // 2
    best = brute_force_best(brute_force_table(problem), budget)
    from_uniform = solve_ilp(problem, budget, warm=Schedule.uniform(problem.num_stages))
    from_best = solve_ilp(problem, budget, warm=from_uniform.schedule)
    for plan in (from_uniform, from_best):
        assert plan.status == SolverStatus.OPTIMAL and plan.gap == 0.0
        assert plan.predicted_recompute_seconds == pytest.approx(best)
    assert from_best.schedule == from_uniform.schedule


@pytest.mark.parametrize("problem", [random_chain(5, 7), random_dag(5, 3)], ids=lambda p: p.name)
def test_the_warm_start_is_a_cutoff_and_an_optimal_start_is_proven(monkeypatch, problem):
    """CBC gets the warm schedule as an objective cutoff, not a MIP start (whose "reduced search" overran a 30 s
    limit by 90 s): started from the optimum, the search finds nothing below it, and the plan is that start,
    proven optimal; started from uniform checkpointing, it finds the same optimum."""
    import pulp
    import planner.solvers.ilp as ilp

    monkeypatch.setattr(ilp, "_has_highs", lambda: False)
    calls: list[tuple] = []

    class Recording(pulp.PULP_CBC_CMD):
        def actualSolve(self, lp, **kwargs):
            calls.append((self.optionsDict.get("warmStart", False), list(self.options)))
            return super().actualSolve(lp, **kwargs)

    monkeypatch.setattr(pulp, "PULP_CBC_CMD", Recording)
    _check_optimal_from_uniform_and_from_the_optimum(problem)
    assert [start for start, _ in calls] == [False, False]
    assert all(len(options) == 1 and options[0].startswith("cutoff ") for _, options in calls)


@pytest.mark.parametrize("problem", [random_chain(5, 7), random_dag(5, 3)], ids=lambda p: p.name)
def test_highs_takes_the_warm_start_as_its_objective_bound_and_proves_an_optimal_start(monkeypatch, problem):
    """HiGHS, the solver where ``highspy`` imports (a dependency), gets the warm schedule's objective as
    ``objective_bound``: started from the optimum it finds nothing below, and the start is the plan, proven."""
    import pulp
    import planner.solvers.ilp as ilp

    assert ilp._has_highs()
    bounds: list[float | None] = []

    class Recording(pulp.HiGHS):
        def actualSolve(self, lp, **kwargs):
            bounds.append(self.optionsDict.get("objective_bound"))
            return super().actualSolve(lp, **kwargs)

    monkeypatch.setattr(pulp, "HiGHS", Recording)
    _check_optimal_from_uniform_and_from_the_optimum(problem)
    assert len(bounds) == 2 and all(isinstance(b, float) for b in bounds) and bounds[1] < bounds[0]


def test_highs_prints_nothing():
    """Each process's first HiGHS model prints a two-line banner to standard output, before any option could stop
    it: a fresh process plans and prints only its own line."""
    script = ("from planner.solvers.ilp import min_peak_ilp; from tests.solver_problems import random_dag; "
              "print(min_peak_ilp(random_dag(4, 1)).status.value)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          cwd=pathlib.Path(__file__).parent.parent)
    assert done.stdout == "optimal\n"


def test_cbc_log_bound_parsing():
    log = "Result - Stopped on time limit\n\nObjective value:                12.5\nLower bound:                    10.0\n"
    assert _cbc_bound(log) == 10.0
    assert _cbc_bound("Result - Optimal solution found\n") is None


def test_solving_warns_nothing(recwarn):
    """PuLP 3.3 deprecates ``LpVariable(name, ...)`` with a warning per variable, every plan's thousands, which
    reached users (and failed a test that asked for no warning) until 2026-12-07; variables are now made by the
    model (``new_variable``)."""
    problem = random_dag(6, 2)
    solve_ilp(problem, min_peak_ilp(problem, time_limit=10).predicted_peak_bytes + 1, time_limit=10)
    assert not [w for w in recwarn.list if issubclass(w.category, DeprecationWarning)], recwarn.list
