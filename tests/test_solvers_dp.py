"""The DP: exact on chains (brute force, the ILP), feasible and verified everywhere else."""

from __future__ import annotations

import dataclasses
import math
import random
import time

import pytest

from planner.errors import InfeasibleBudgetError
from planner.plan import SolverStatus
from planner.problem import Problem, Schedule, Stage, TensorInfo, recompute_seconds, simulate
from planner.solvers import dp as dp_module
from planner.solvers.dp import (_bound_unit, _deepening, _Deepened, _focused, _natural_unit, _relaxed_seconds,
                                _relaxed_optimum, _repeats, _Search, _tables, _unit, _within_budget,
                                chain_relaxation, lower_bound, minimum_peak, relative_gap, solve_dp)
from planner.solvers.ilp import solve_ilp
from tests.solver_problems import (bn_relu_conv, brute_force_best, brute_force_table, cached_head_input,
                                   held_layer_chain, held_norm_output, layered_chain, random_chain, random_dag,
                                   random_schedule)

# (5, 6, 2): a cached tensor that only the next stage reads and nothing saves is gone once that stage has
# re-run (problem.cached_dies_with); counted to the region's end, the program missed the best plan at 4 budgets.
# (4, 27, 3): a cached tensor that the next stage saves last counts once in that stage's backward
# (Stage.backward_epochs); counted twice, the program missed the best plan at 2 budgets
CHAINS = [(4, 0, 2), (4, 3, 2), (4, 9, 3), (5, 1, 2), (5, 4, 3), (5, 12, 2), (5, 6, 2), (4, 27, 3)]


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


def test_dp_frees_what_the_next_stage_re_runs_last_at_every_budget():
    """A BatchNorm's output that only the next stage reads dies in the re-run once that stage re-ran; the program
    counted it to the region's end and missed the best plan at the two smallest budgets (9 s instead of 6 and 5)."""
    problem = bn_relu_conv(blocks=2, conv_workspace=50)
    assert problem.is_chain()
    table = brute_force_table(problem)
    for budget in sorted({peak for peak, _, _ in table}):
        plan = solve_dp(problem, budget)
        assert plan.status == SolverStatus.OPTIMAL
        assert plan.predicted_recompute_seconds == brute_force_best(table, budget)


@pytest.mark.parametrize("through_only,conv_workspace,held", [(False, 50, 100), (True, 50, 100), (True, 300, 200)],
                         ids=["anywhere", "through-only", "through-only-wide"])
def test_dp_counts_a_held_input_only_where_the_region_did_not_make_it(through_only, conv_workspace, held):
    """The ReLU's recompute workspace holds the BatchNorm's output as a region's input would be held; where its own
    region made it, it dies inside the ReLU as in the eager step (``Stage.input_savings``). Without it
    the program missed the best plan at 2 of the 8 budgets. ``through_only``: only where the convolution follows
    in the region (``InputSaving.through_bytes``); counted nowhere, the program missed 2 budgets of the first of
    those; counted where the ReLU ends its region too, 2 of the second."""
    problem = bn_relu_conv(blocks=2, conv_workspace=conv_workspace, relu_held_input=held, through_only=through_only)
    table = brute_force_table(problem)
    for budget in sorted({peak for peak, _, _ in table}):
        assert solve_dp(problem, budget).predicted_recompute_seconds == brute_force_best(table, budget)


@pytest.mark.parametrize("layer_region_forward", [None, 300], ids=["stage-workspace", "own-region-workspace"])
def test_dp_adds_what_a_held_input_costs_the_forward_of_the_stage_that_reads_it_last(layer_region_forward):
    """The layer's forward needs more while the norm's output, which eager frees inside it, is held: by a region
    starting at the layer (its input) or by the norm's cache, the layer stored or in the same region
    (``Stage.held_inputs``), less what the layer's forward workspace in a region covers. The program counts it
    exactly where ``simulate`` does: its own search (no bound, no second try at a tighter budget) finds the best
    plan at every budget; leaving out any of the three cases, counting it always, or covering none or twice as
    much of it in a region, it missed at one budget or more."""
    _assert_own_search_best_at_every_peak(held_norm_output(layer_region_forward=layer_region_forward))


@pytest.mark.parametrize("head_workspace", [0, 2000])
def test_dp_adds_a_held_input_to_the_first_forward_of_a_longer_region(head_workspace):
    """``held_layer_chain``: a region of the layer and the middle stage holds the norm's output through the
    layer's forward, its first (``Stage.held_inputs``), as a region of the layer alone does. The program's own
    search finds the best plan at every budget; leaving that out of a longer region's first forward, it missed 2
    budgets (head workspace 0), counting it twice, 3 (head workspace 2,000)."""
    _assert_own_search_best_at_every_peak(held_layer_chain(head_workspace))


def test_dp_counts_a_cached_tensor_the_next_stage_saves_last_once_in_its_backward():
    """``cached_head_input``: the block's cache of ``x`` keeps it past the layer's backward, whose workspace held it
    at its peak (``Stage.backward_epochs``); the program takes the layer's backward event 200 bytes lower after
    that cache, stored or the first stage of a region, as ``simulate`` does, and finds the best plan at every
    budget. Counting ``x`` twice after either move, it missed at one budget (each)."""
    _assert_own_search_best_at_every_peak(cached_head_input())


def _assert_own_search_best_at_every_peak(problem):
    """The program's own search (no bound, no second try at a tighter budget) finds the best plan of a chain at
    every peak some schedule has, and its least peak is the least of them."""
    assert problem.is_chain()
    table = brute_force_table(problem)
    peaks = sorted({peak for peak, _, _ in table})
    assert minimum_peak(problem) == peaks[0]
    for budget in peaks:
        schedule, exact = _within_budget(problem, _Search(budget, 2000, 64))
        assert exact and simulate(problem, schedule).peak_bytes <= budget
        assert recompute_seconds(problem, schedule) == pytest.approx(brute_force_best(table, budget), abs=1e-9)


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


@pytest.mark.parametrize("seed", range(4))
def test_quick_least_peak_schedules_recompute_whole_stages_and_the_ilp_keeps_the_best(seed):
    """On non-chains the smallest peak comes from the ILP, started from the program's quick least-peak schedules
    (regions of whole stages): however little time the ILP has, it returns none that peaks higher."""
    from planner.solvers.ilp import min_peak_schedule

    problem = random_dag(14, seed, num_options=3)
    quick = dp_module._low_peak_schedules(problem)
    assert quick and all(region.option_of(k) == 0 for s in quick for region in s.regions for k in region.stages)
    best = min(simulate(problem, s).peak_bytes for s in quick)
    rushed, _ = min_peak_schedule(problem, time_limit=0.01, candidates=quick)
    assert simulate(problem, rushed).peak_bytes <= best
    assert minimum_peak(problem) <= best


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
    stopping = random_chain(14, 4, num_options=3)
    # a relaxation lets every region whose last option caches nothing stop early: its bound stays below the optimum
    budget = minimum_peak(stopping) + (simulate(stopping, Schedule()).peak_bytes - minimum_peak(stopping)) // 4
    bounded = solve_dp(stopping, budget, front_limit=2)
    assert bounded.lower_bound_seconds <= solve_dp(stopping, budget).predicted_recompute_seconds + 1e-9
    # without an early stop or a charge for caching, the relaxation's optimum is the problem's here
    problem = dataclasses.replace(stopping, caching_region_seconds=0.0,
                                  stages=tuple(dataclasses.replace(s, early_stop_seconds=0.0) for s in stopping.stages))
    smallest = minimum_peak(problem)
    budget = smallest + (simulate(problem, Schedule()).peak_bytes - smallest) // 4
    full, cut = solve_dp(problem, budget), solve_dp(problem, budget, front_limit=2, bound=False)
    assert full.status == SolverStatus.OPTIMAL and cut.status == SolverStatus.FEASIBLE
    assert cut.predicted_peak_bytes <= budget
    assert cut.predicted_recompute_seconds >= full.predicted_recompute_seconds - 1e-9
    # with the bound, a plan is proven optimal even when the search cut its fronts: the relaxation's own
    # optimal schedule fits the problem here, and nothing is faster than the bound
    proven = solve_dp(problem, budget, front_limit=2)
    assert proven.status == SolverStatus.OPTIMAL and proven.gap == 0.0
    assert proven.predicted_recompute_seconds == pytest.approx(full.predicted_recompute_seconds, abs=1e-9)


# --- proven bounds, the classic case, time limits -------------------------------------------------------------------

def uniform_state_chain(n: int) -> Problem:
    """Griewank's setting: every stage reads and saves one state (one byte) made by the stage before."""
    stages = tuple(Stage(f"s{k}", 1.0, 2.0) for k in range(n))
    states = tuple(TensorInfo(f"x{k}", 1, k, frozenset({k + 1}), frozenset({k + 1})) for k in range(n - 1))
    return Problem(stages, states)


@pytest.mark.parametrize("slots", [2, 3, 4, 5])
def test_longest_uniform_chain_per_memory_is_griewanks_binomial(slots):
    """With every stage recomputed at most once (two evaluations), ``slots`` states of memory reverse at most
    ``C(slots + 2, 2)`` steps (Griewank's beta(s, 2)); here the last stage's state is never stored, so the chain
    has one stage fewer. The DP's smallest peak finds that boundary exactly."""
    longest = math.comb(slots + 2, 2) - 1
    assert minimum_peak(uniform_state_chain(longest)) == slots
    assert minimum_peak(uniform_state_chain(longest + 1)) == slots + 1
    plan = solve_dp(uniform_state_chain(longest), slots)
    assert plan.status is SolverStatus.OPTIMAL and plan.predicted_peak_bytes == slots


def test_uniform_chain_matches_brute_force_at_every_budget():
    problem = uniform_state_chain(7)
    table = brute_force_table(problem)
    for budget in sorted({peak for peak, _, _ in table}):
        plan = solve_dp(problem, budget)
        assert plan.predicted_recompute_seconds == brute_force_best(table, budget)
        assert plan.gap == 0.0 and plan.lower_bound_seconds == plan.predicted_recompute_seconds


@pytest.mark.parametrize("seed", range(6))
def test_chain_relaxation_never_raises_a_peak_nor_changes_the_time(seed):
    problem = random_dag(6, seed)
    relaxed = chain_relaxation(problem)
    assert relaxed.is_chain() and not problem.is_chain()
    rng = random.Random(seed)
    for _ in range(40):
        schedule = random_schedule(problem, rng, rng.random())
        exact, loose = simulate(problem, schedule), simulate(relaxed, schedule)
        assert loose.peak_bytes <= exact.peak_bytes
        assert loose.recompute_seconds == pytest.approx(exact.recompute_seconds)


@pytest.mark.parametrize("maker,seed", [(random_chain, 2), (random_chain, 7), (random_dag, 3), (random_dag, 8)])
def test_lower_bound_is_below_the_true_optimum_and_the_gap_is_honest(maker, seed):
    problem = maker(5, seed)
    table = brute_force_table(problem)
    peaks = sorted({peak for peak, _, _ in table})
    for budget in (peaks[0], peaks[len(peaks) // 4], peaks[len(peaks) // 2]):
        best = brute_force_best(table, budget)
        assert lower_bound(problem, budget) <= best + 1e-9
        plan = solve_dp(problem, budget)
        assert plan.lower_bound_seconds <= best + 1e-9 <= plan.predicted_recompute_seconds + 2e-9
        assert plan.gap == pytest.approx(relative_gap(plan.predicted_recompute_seconds, plan.lower_bound_seconds))
        assert (plan.status is SolverStatus.OPTIMAL) == (plan.gap <= 1e-9)


@pytest.mark.parametrize("maker,seed", [(random_chain, 3), (random_chain, 5), (random_dag, 8)])
def test_a_bound_with_merged_fronts_stays_below_the_true_optimum(maker, seed):
    problem = maker(5, seed)
    table = brute_force_table(problem)
    peaks = sorted({peak for peak, _, _ in table})
    loosened = False
    for budget in (peaks[0], peaks[len(peaks) // 3]):
        best = brute_force_best(table, budget)
        exact = lower_bound(problem, budget)
        for limit in (1, 2, 4):  # runs of points merge into their ideal point past this many per state
            merged, schedule = _relaxed_optimum(problem, budget, _Search(budget, 2000, limit), math.inf)
            assert merged <= exact + 1e-9 and merged <= best + 1e-9
            assert schedule is not None
            # the program's seconds of its schedule (regions ending with an option that caches nothing stop
            # early), never above what the schedule really takes
            assert _relaxed_seconds(problem, schedule) == pytest.approx(merged)
            assert simulate(problem, schedule).recompute_seconds >= merged - 1e-9
            loosened |= merged < exact - 1e-9
    assert loosened or maker is random_dag  # on the chains some merge really happened


def test_coarse_rounding_is_refined_until_the_gap_closes():
    problem = layered_chain(8, 1, unit=1_000_003)  # sizes no power of two divides: every step rounds
    eager = simulate(problem, Schedule()).peak_bytes
    budget = (simulate(problem, Schedule.uniform(8)).peak_bytes + eager) // 2
    coarse = solve_dp(problem, budget, buckets=50, refinements=0)
    refined = solve_dp(problem, budget, buckets=50, refinements=2)
    assert coarse.gap > refined.gap
    assert refined.predicted_recompute_seconds <= coarse.predicted_recompute_seconds
    assert refined.lower_bound_seconds >= coarse.lower_bound_seconds


def test_a_refinement_round_searches_for_plans_only_when_its_finer_bound_rose(monkeypatch):
    """On a DAG the relaxation, not the rounding, can hold the gap open: a round whose four times finer bound is no
    higher spends no time searching for plans at those steps (Llama-7B: 43 s to a proven optimum, not 59 s)."""
    problem = random_dag(8, 3, unit=1_000_003)
    budget = (simulate(problem, Schedule()).peak_bytes + simulate(problem, Schedule.uniform(8)).peak_bytes) // 2
    bounds, searched = {}, set()
    relaxed, within = dp_module._relaxed_optimum, dp_module._within_budget

    def bound(problem, budget, search, ceiling):
        found = relaxed(problem, budget, search, ceiling)
        bounds[search.buckets] = found[0]
        return found

    def plans(problem, search, *args):
        searched.add(search.buckets)
        return within(problem, search, *args)

    monkeypatch.setattr(dp_module, "_relaxed_optimum", bound)
    monkeypatch.setattr(dp_module, "_within_budget", plans)
    plan = solve_dp(problem, budget, buckets=50, refinements=2)
    assert plan.gap > 0.01 and sorted(bounds) == [50, 200, 800]  # the gap stays open: every round runs
    assert bounds[200] <= bounds[50] and searched == {50}  # no finer bound rose: no finer search
    assert plan.predicted_peak_bytes <= budget


@pytest.mark.parametrize("seed", range(4))
def test_fitted_steps_keep_plans_within_budget_and_bounds_below_the_optimum(seed):
    """Steps fitted to the program's byte counts (not a power of two) round plans' bytes up and bounds' down."""
    problem = layered_chain(6, seed, unit=1_000_003)
    loss = TensorInfo("loss", 1, 5, is_output=True)  # the sizes' gcd is 1: no step is exact
    problem = Problem(problem.stages, problem.tensors + (loss,), problem.fixed_bytes)
    budget = (simulate(problem, Schedule()).peak_bytes + minimum_peak(problem)) // 2
    relaxed = chain_relaxation(problem)
    assert _bound_unit(relaxed, budget, 50) != _unit(relaxed, budget, 50)[0]  # the fitted step is used
    assert _natural_unit(problem, budget, 50)[0] % 1024  # so is the plan's
    optimum = solve_ilp(problem, budget).predicted_recompute_seconds
    assert lower_bound(problem, budget, buckets=50) <= optimum + 1e-12
    plan = solve_dp(problem, budget, buckets=50, refinements=0, bound=False)
    assert plan.predicted_peak_bytes <= budget and plan.predicted_recompute_seconds >= optimum - 1e-12


@pytest.mark.parametrize("seed", [0, 2])
def test_a_focused_search_finds_a_faster_plan_among_the_options_a_plan_uses(seed):
    problem = layered_chain(14, seed, repeated=True)
    budget = minimum_peak(problem) + (simulate(problem, Schedule()).peak_bytes - minimum_peak(problem)) // 3
    single, _ = _within_budget(problem, _Search(budget, 2000, 64, longest_region=1))  # one-stage regions only
    focused = _focused(problem, _Search(budget, 2000, 4), single)
    assert focused is not None
    assert recompute_seconds(problem, focused) < recompute_seconds(problem, single)
    assert simulate(problem, focused).peak_bytes <= budget
    used = {region.option_of(k) for region in single.regions for k in region.stages}
    assert {region.option_of(k) for region in focused.regions for k in region.stages} <= used
    assert _focused(problem, _Search(budget, 2000, 64), solve_dp(problem, budget).schedule) is None  # optimal


def test_a_time_limit_returns_a_feasible_plan_and_progress_is_reported():
    problem = layered_chain(48, 0)
    eager = simulate(problem, Schedule()).peak_bytes
    budget = (simulate(problem, Schedule.uniform(48)).peak_bytes + eager) // 2
    lines: list[str] = []
    plan = solve_dp(problem, budget, time_limit=0.05, progress=lines.append)
    assert plan.predicted_peak_bytes <= budget == plan.budget_bytes
    assert plan.status is SolverStatus.FEASIBLE
    assert lines and lines[0].startswith("dp: stage 1/48")


def test_a_deepening_level_the_time_left_cannot_fit_is_not_begun():
    problem = layered_chain(12, 0)
    budget = (simulate(problem, Schedule.uniform(12)).peak_bytes + simulate(problem, Schedule()).peak_bytes) // 2
    hurried = _Search(budget, 2000, 64, deadline=time.perf_counter() + 5.0)
    assert _deepening(problem, hurried, math.inf, level_seconds=10.0) == _Deepened(None, False, 4, 10.0)
    unhurried = _deepening(problem, _Search(budget, 2000, 64), math.inf, level_seconds=10.0)
    assert unhurried.schedule is not None and unhurried.longest is None  # every level ran, up to any length
    assert simulate(problem, unhurried.schedule).peak_bytes <= budget


# --- structural sharing ------------------------------------------------------------------------------------------

def test_repeated_blocks_are_found_with_the_gradients_between_them():
    problem = layered_chain(10, 3, repeated=True)
    repeats = _repeats(_tables(problem, 1 << 20, optimistic=True))
    assert sorted(repeats) == list(range(1, 9))  # the first and last blocks differ; the last is never shared
    grad = problem.stages[1].grad_bytes
    for start, repeat in repeats.items():
        assert (repeat.first, repeat.start, repeat.last) == (1, start, 8)
        assert repeat.backward_shift == -(start - 1) * grad  # later blocks' backwards see fewer gradients
    assert _repeats(_tables(layered_chain(10, 3), 1 << 20, optimistic=True)) == {}


@pytest.mark.parametrize("n,seed", [(12, 3), (16, 2)])
def test_a_shared_program_bounds_exactly_as_one_program_per_start(n, seed, monkeypatch):
    problem = layered_chain(n, seed, repeated=True)
    eager = simulate(problem, Schedule()).peak_bytes
    lowest = simulate(problem, Schedule.uniform(n)).peak_bytes
    budgets = [lowest + (eager - lowest) * share // 10 for share in (1, 4, 7)]
    shared = [lower_bound(problem, budget) for budget in budgets]
    monkeypatch.setattr(dp_module, "_repeats", lambda tables: {})
    alone = [lower_bound(problem, budget) for budget in budgets]
    assert shared == pytest.approx(alone, abs=1e-12)
    for budget, bound in zip(budgets, shared):
        optimum = solve_dp(problem, budget, front_limit=4096)
        assert optimum.status is SolverStatus.OPTIMAL and bound <= optimum.predicted_recompute_seconds + 1e-9


def test_the_cost_per_step_is_predicted_but_leaves_the_choice_and_the_proof_alone():
    """``Problem.per_step_seconds`` is the same for every plan that checkpoints: the solvers choose and prove as
    without it, and their plans predict it (bound included)."""
    problem = random_chain(6, 2)
    once = dataclasses.replace(problem, per_step_seconds=0.75)
    budget = minimum_peak(problem) + (simulate(problem, Schedule()).peak_bytes - minimum_peak(problem)) // 3
    for solve in (solve_dp, solve_ilp):
        plain, charged = solve(problem, budget), solve(once, budget)
        assert charged.schedule == plain.schedule and charged.status == plain.status == SolverStatus.OPTIMAL
        assert charged.predicted_recompute_seconds == pytest.approx(plain.predicted_recompute_seconds + 0.75)
        assert charged.lower_bound_seconds == pytest.approx(charged.predicted_recompute_seconds)
    eager = solve_dp(once, simulate(problem, Schedule()).peak_bytes)
    assert not eager.regions and eager.predicted_recompute_seconds == 0.0


def test_a_plans_gap_is_taken_between_its_prediction_and_its_bound():
    """With a cost per step, a plan whose bound falls short still reports the gap between the two numbers it
    records (the solver's objective leaves the cost per step out of both)."""
    problem = dataclasses.replace(random_chain(14, 4, num_options=3), per_step_seconds=0.75)
    budget = minimum_peak(problem) + (simulate(problem, Schedule()).peak_bytes - minimum_peak(problem)) // 4
    cut = solve_dp(problem, budget, front_limit=2)
    assert cut.status == SolverStatus.FEASIBLE and cut.gap > 0
    assert cut.gap == pytest.approx(relative_gap(cut.predicted_recompute_seconds, cut.lower_bound_seconds), rel=1e-12)
