"""planner.compiled: the search for a plan whose compiled step fits (on hand-built plans: tuples, no tensors), and
``planner.optimize(..., compile=True)`` on a real model."""

from __future__ import annotations

import pytest
import torch

import planner
from planner.compiled import COMPILED_SLACK, fit_compiled, next_target
from planner.errors import InfeasibleBudgetError
from planner.meter import allocator_peak_bytes, storage_bytes
from tests.helpers import Dropping, StepResult, assert_same_training


class Plans:
    """A solver over hand-built plans: each is (predicted peak, compiled peak); for a target it returns the plan
    predicted at the most memory within it, as the real solver returns the least recomputation that fits."""

    def __init__(self, *plans: tuple[int, int]):
        self.plans = sorted(plans)
        self.targets: list[int] = []
        self.measured: list[tuple[int, int]] = []

    def solve(self, target: int) -> tuple[int, int]:
        self.targets.append(target)
        fitting = [p for p in self.plans if p[0] <= target]
        if not fitting:
            raise InfeasibleBudgetError("below every plan", minimum_budget_bytes=self.plans[0][0])
        return fitting[-1]

    def measure(self, plan: tuple[int, int]) -> tuple[int, str]:
        self.measured.append(plan)
        return plan[1], f"compiled {plan}"

    def fit(self, budget: int, **options):
        return fit_compiled(self.solve, self.measure, budget, predicted_peak=lambda plan: plan[0], **options)


def test_a_plan_that_fits_compiled_within_the_slack_is_kept_at_once():
    plans = Plans((600, 500), (1000, 990))
    fit = plans.fit(1000)
    assert fit.kept.plan == (1000, 990) and fit.kept.payload == "compiled (1000, 990)"
    assert fit.solves == 1 and plans.measured == [(1000, 990)]


def test_a_plan_over_the_budget_compiled_is_planned_again_for_less():
    plans = Plans((500, 480), (800, 850), (900, 1100), (1000, 1300))
    fit = plans.fit(1000)
    assert fit.kept.plan == (800, 850)  # the most memory whose compiled step fits
    assert all(m.peak_bytes > 1000 for m in fit.tried if m.plan[0] > 800)  # each plan for more memory exceeded
    assert plans.targets[0] == 1000 and plans.targets[1] < 1000


def test_a_plan_far_under_the_budget_compiled_is_planned_again_for_more():
    """Inductor mostly saves more than eager: a plan predicted at the budget then peaks well under it, and one
    predicted above the budget may fit."""
    plans = Plans((700, 600), (1000, 800), (1200, 985), (1400, 1200))
    fit = plans.fit(1000)
    assert fit.kept.plan == (1200, 985) and fit.kept.peak_bytes >= (1 - COMPILED_SLACK) * 1000
    assert fit.kept.target_bytes > 1000


def test_no_plan_fitting_compiled_leaves_nothing_kept_after_trying_the_least_memory():
    plans = Plans((700, 1050), (1000, 1200))
    fit = plans.fit(1000)
    assert fit.kept is None and fit.smallest_peak_bytes == 1050
    assert (700, 1050) in plans.measured  # the least memory any plan needs was tried
    assert len(plans.measured) == 2


def test_a_budget_no_plan_reaches_even_before_compiling_raises_the_solvers_error():
    plans = Plans((700, 600))
    with pytest.raises(InfeasibleBudgetError) as info:
        plans.fit(500)
    assert info.value.minimum_budget_bytes == 700 and plans.measured == []


def test_each_plan_is_compiled_once_and_the_search_stops_at_the_replan_limit():
    plans = Plans(*[(100 * k, 100 * k + 150) for k in range(1, 11)])
    fit = plans.fit(1000, replans=2)
    assert len(plans.measured) == len(set(plans.measured)) == 3 == len(fit.tried)
    assert fit.kept is not None and fit.kept.peak_bytes <= 1000


def test_a_plan_recomputing_nothing_that_fits_ends_the_search():
    plans = Plans((600, 400))
    fit = plans.fit(1000, recomputes=lambda plan: False)
    assert fit.kept.plan == (600, 400) and fit.solves == 1


@pytest.mark.parametrize("target,predicted,peak,fits_at,exceeds_at,expected", [
    (1000, 1000, 1250, 0, float("inf"), 800),  # over by a fifth: a fifth less
    (1000, 900, 1100, 0, float("inf"), 818),  # over: from the lower prediction
    (1000, 1000, 1001, 0, float("inf"), 990),  # over by a hair: at least 1% less
    (800, 800, 500, 0, float("inf"), 1600),  # far under, nothing exceeded yet: scale up
    (800, 800, 500, 800, 1000, 900),  # far under, but a plan predicted at 1000 exceeded: halve the bracket
])
def test_next_target_scales_by_the_miss_within_the_bracket(target, predicted, peak, fits_at, exceeds_at, expected):
    assert next_target(target, predicted, peak, 1000, fits_at, exceeds_at) == expected


# --- planner.optimize(..., compile=True) ---------------------------------------------------------------------------

WIDTH = 32
X = torch.randn(256, WIDTH)


def _square_mean(out):
    return out.pow(2).mean()


def _compiled_step(module, model):
    def step():
        out = module(X)  # held through the backward, as the plan was made for (hold_outputs=True)
        _square_mean(out).backward()
        model.zero_grad(set_to_none=True)
    return step


def test_optimize_with_compile_measures_the_compiled_step_within_budget_and_trains_like_compiled_eager(
        fallback_random):
    torch.manual_seed(0)
    model = Dropping()
    rng = torch.get_rng_state()
    opt = planner.optimize(model, "60%", example_inputs=(X,), loss_fn=_square_mean, profile_repeats=1, compile=True)
    assert torch.equal(torch.get_rng_state(), rng)  # planning, compiled steps included, leaves no trace
    assert "plans=1, compile=True" in repr(opt)
    assert all(p.grad is None for p in model.parameters())
    extra = dict(opt.plan.extra)
    assert extra["compiled_peak_bytes"] <= opt.plan.budget_bytes and extra["compiled_plans_measured"] >= 1
    assert opt.plan.regions, "60% of the eager peak needs recomputation"
    problem = opt.planned.problem  # priced for compiled steps: no eager checkpoint machinery
    assert problem.region_seconds == problem.per_step_seconds == problem.caching_region_seconds == 0
    fixed = storage_bytes(list(model.parameters()) + [X])
    measured = fixed + allocator_peak_bytes(_compiled_step(opt, model))
    assert measured == extra["compiled_peak_bytes"], "the module returned is the one the search measured"
    loaded = planner.Plan.from_json(opt.plan.to_json())
    assert loaded.compiled_peak_bytes == extra["compiled_peak_bytes"]
    assert "compiled peak" in loaded.summary() and "compiled, its step measured" in planner.explain(loaded)
    assert "the recomputed ops at their eager times" in loaded.summary()
    assert "measured under torch.compile(), " in loaded.summary()  # compile=True: torch.compile's defaults

    results = {}
    for name, module in [("eager", torch.compile(model)), ("planned", opt)]:
        torch.manual_seed(0)
        loss = _square_mean(module(X))
        loss.backward()
        results[name] = StepResult(loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}, {}, 0)
        model.zero_grad(set_to_none=True)
    assert_same_training(results["eager"], results["planned"], atol=0)


@pytest.mark.parametrize("options,match", [
    (dict(compile="yes"), "neither a bool nor a dict"),
    (dict(compile=True, device="h100"), "roofline"),
])
def test_optimize_with_compile_names_what_it_cannot_do(options, match):
    with pytest.raises(planner.PlannerError, match=match):
        planner.optimize(Dropping(), "60%", example_inputs=(X,), **options)


def test_compile_on_a_model_on_the_meta_device_says_it_has_nothing_to_measure():
    with torch.device("meta"):
        model, x = Dropping(), torch.randn(256, WIDTH)
    with pytest.raises(planner.PlannerError, match="meta device"):
        planner.plan(model, "60%", example_inputs=(x,), compile=True, profile_repeats=0)


class DataDependent(torch.nn.Module):
    """Branches on a tensor's value, so it captures only in parts."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        self.decoder = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)])

    def forward(self, x):
        h = self.encoder(x)
        return self.decoder(h * 2 if h.mean() > 0 else h)


def test_compile_on_a_model_captured_only_in_parts_says_to_compile_the_result_instead():
    with pytest.raises(planner.PlannerError, match="captures as a whole.*DataDependent does not") as info:
        planner.optimize(DataDependent(), "70%", example_inputs=(X,), compile=True, profile_repeats=1)
    assert "torch.compile the module optimize() returns" in str(info.value)
