"""Issue 2's acceptance: real models, several budgets, measured with a live-storage meter.

For each example model and each budget between the smallest feasible one and the eager peak:
measured peak <= budget, prediction within 5% of measurement, and loss, gradients and buffers after the step
equal to eager. At the memory uniform per-block checkpointing reaches, the plan recomputes no more than uniform.
"""

from __future__ import annotations

import pytest

from examples.common import build_example
from planner import solvers
from planner.api import planned_module, pose_problem
from planner.capture import capture
from planner.plan import Plan, SolverStatus
from planner.problem import Region, Schedule, simulate
from tests.helpers import assert_same_training, training_step

MODELS = ["largeblock", "gpt2", "llama", "resnet", "unet"]
BUDGET_POINTS = [0.0, 0.5, 0.9]  # share of the way from the smallest feasible peak to the eager peak


@pytest.fixture(scope="module", params=MODELS)
def posed(request):
    example = build_example(request.param, size="test")
    captured = capture(example.model, example.example_inputs, example.example_kwargs)
    problem, stage_nodes = pose_problem(captured, loss_fn=example.loss_fn, profile_repeats=1, hold_outputs=False)
    eager = training_step(example.model, example.run, example.example_inputs)
    return example, captured, problem, stage_nodes, eager


def _step(example, module):
    return training_step(module, lambda m: example.loss_fn(m(*example.example_inputs, **example.example_kwargs)),
                         example.example_inputs, owner=example.model)


def test_eager_prediction_matches_measurement(posed):
    """The captured graph run without recomputation: predicted as measured, and never above the model's eager
    step (on the CPU its dropouts save one-byte masks, where eager saves float noise)."""
    example, captured, problem, stage_nodes, eager = posed
    predicted = simulate(problem, Schedule.store_all(problem.num_stages)).peak_bytes
    graph = _step(example, captured.graph_module)
    assert predicted == pytest.approx(graph.peak_bytes, rel=0.05)
    assert graph.peak_bytes <= eager.peak_bytes
    assert_same_training(eager, graph)


@pytest.mark.parametrize("point", BUDGET_POINTS)
def test_plans_fit_the_budget_predict_memory_and_train_exactly(posed, point):
    example, captured, problem, stage_nodes, eager = posed
    smallest = solvers.minimum_peak(problem)
    eager_peak = simulate(problem, Schedule.store_all(problem.num_stages)).peak_bytes
    budget = int(smallest + point * (eager_peak - smallest))
    plan = solvers.solve(problem, budget, method="auto")
    assert plan.predicted_peak_bytes <= budget
    result = _step(example, planned_module(captured, plan, stage_nodes))
    assert result.peak_bytes <= budget, (result.peak_bytes, budget)
    assert plan.predicted_peak_bytes == pytest.approx(result.peak_bytes, rel=0.05)
    assert_same_training(eager, result)


def test_plan_at_uniform_memory_recomputes_no_more_than_uniform(posed):
    example, captured, problem, stage_nodes, eager = posed
    uniform = Plan.from_schedule(problem, Schedule.uniform(problem.num_stages), solver="uniform",
                                 status=SolverStatus.HEURISTIC)
    uniform_measured = _step(example, planned_module(captured, uniform, stage_nodes))
    assert_same_training(eager, uniform_measured)
    budget = max(uniform.predicted_peak_bytes, uniform_measured.peak_bytes)
    plan = solvers.solve(problem, budget, method="auto")
    assert plan.predicted_recompute_seconds <= uniform.predicted_recompute_seconds + 1e-12
    measured = _step(example, planned_module(captured, plan, stage_nodes))
    assert measured.peak_bytes <= budget
    assert_same_training(eager, measured)


def test_plans_cut_inside_the_blocks_fit_predict_memory_and_train_exactly():
    """At ``granularity="layer"`` a stage is a block's attention, MLP or norm; plans still fit, predict their peak
    and reproduce eager training (GPT-2: dropout inside attention and the MLP)."""
    example = build_example("gpt2", size="test")
    captured = capture(example.model, example.example_inputs, example.example_kwargs)
    problem, stage_nodes = pose_problem(captured, loss_fn=example.loss_fn, profile_repeats=1, hold_outputs=False,
                                        granularity="layer")
    assert any(name.endswith(".mlp") for name in (s.name for s in problem.stages))
    eager = training_step(example.model, example.run, example.example_inputs)
    # halfway from checkpointing every layer to eager (the smallest peak takes 17-61 s to prove on this problem)
    uniform_peak = simulate(problem, Schedule.uniform(problem.num_stages)).peak_bytes
    eager_peak = simulate(problem, Schedule.store_all(problem.num_stages)).peak_bytes
    budget = (uniform_peak + eager_peak) // 2
    plan = solvers.solve(problem, budget, method="auto", time_limit=10)
    recomputed = {k for r in plan.schedule.regions for k in range(r.start, r.stop)}
    blocks = {}
    for k, stage in enumerate(problem.stages):
        blocks.setdefault(".".join(stage.name.split(".")[:3]), set()).add(k)
    assert any(0 < len(ks & recomputed) < len(ks) for ks in blocks.values())  # parts of blocks recomputed
    result = _step(example, planned_module(captured, plan, stage_nodes))
    assert result.peak_bytes <= budget
    assert plan.predicted_peak_bytes == pytest.approx(result.peak_bytes, rel=0.05)
    assert_same_training(eager, result)


def test_regions_spanning_resnet_blocks_at_sublayer_granularity_are_predicted_exactly():
    """Each residual block recomputed as one region of its sublayers: a BatchNorm's output, read only by the next
    stage (its ReLU, or the residual add), dies inside that stage's re-run as in the eager step. Counted to the end
    of the re-run and again as a held input, the plan was predicted 13.10 MB against 11.00 MB measured; with only
    the first fixed, 12.05 MB."""
    example = build_example("resnet", size="test")
    captured = capture(example.model, example.example_inputs, example.example_kwargs)
    problem, stage_nodes = pose_problem(captured, loss_fn=example.loss_fn, profile_repeats=1, hold_outputs=False,
                                        granularity="sublayer")
    blocks: dict[str, list[int]] = {}
    for k, stage in enumerate(problem.stages):
        parts = stage.name.split(".")
        if parts[0] == "blocks":
            blocks.setdefault(parts[1], []).append(k)
    schedule = Schedule(tuple(Region(min(ks), max(ks) + 1) for ks in blocks.values()))
    assert len(schedule.regions) == 6 and all(r.stop - r.start >= 5 for r in schedule.regions)
    plan = Plan.from_schedule(problem, schedule, solver="blocks", status=SolverStatus.HEURISTIC)
    eager = training_step(example.model, example.run, example.example_inputs)
    result = _step(example, planned_module(captured, plan, stage_nodes))
    assert plan.predicted_peak_bytes == pytest.approx(result.peak_bytes, rel=0.005)
    assert_same_training(eager, result)
