import dataclasses

import pytest
import torch

from planner.api import pose_problem
from planner.capture import capture
from planner.plan import Plan, SolverStatus
from planner.problem import Region, Schedule
from planner.rewrite import CheckpointRegion, apply_plan
from tests.helpers import assert_same_training, training_step


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Dropout(0.2))
            for _ in range(4)])
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.blocks(x).mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def convnet():
    torch.manual_seed(0)
    model = ConvNet().train()
    x = torch.randn(8, 8, 16, 16)
    captured = capture(model, (x,))
    problem, stage_nodes = pose_problem(captured, loss_fn=lambda out: out.square().mean(), profile_repeats=1)
    return model, x, captured, problem, stage_nodes


def _planned(convnet, schedule):
    model, x, captured, problem, stage_nodes = convnet
    plan = Plan.from_schedule(problem, schedule, solver="test", status=SolverStatus.HEURISTIC)
    return apply_plan(captured.graph_module, dataclasses.replace(plan, stage_nodes=stage_nodes))


def _loss(x):
    return lambda m: m(x).square().mean()


@pytest.mark.parametrize("schedule", [
    Schedule.uniform(4), Schedule.from_segments([(0, 3)]), Schedule((Region(1, 3, (1, 1)),)),
], ids=["uniform", "one-region", "selective"])
def test_planned_module_trains_exactly_like_eager(convnet, schedule):
    model, x, *_ = convnet
    eager = training_step(model, _loss(x), (x,))
    planned = _planned(convnet, schedule)
    result = training_step(planned, _loss(x), (x,), owner=model)
    assert_same_training(eager, result, atol=0)  # bit for bit: dropout masks and BatchNorm statistics included


def test_batchnorm_statistics_move_exactly_once_per_step(convnet):
    model, x, *_ = convnet
    planned = _planned(convnet, Schedule.uniform(4))
    before = model.blocks[0][1].num_batches_tracked.item()
    torch.manual_seed(0)
    planned(x).square().mean().backward()
    assert model.blocks[0][1].num_batches_tracked.item() == before + 1
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.reset_running_stats()
    for p in model.parameters():
        p.grad = None


def test_planned_module_shares_the_callers_parameters(convnet):
    model, *_ = convnet
    planned = _planned(convnet, Schedule.uniform(4))
    ours = {id(p) for p in model.parameters()}
    assert {id(p) for p in planned.parameters()} == ours


def test_code_shows_where_regions_start_and_end(convnet):
    planned = _planned(convnet, Schedule((Region(0, 2), Region(2, 3, (1,)))))
    assert "self.region_0(" in planned.code and "self.region_1(" in planned.code
    assert "region_2" not in planned.code
    assert isinstance(planned.region_0, CheckpointRegion)
    assert "stages=[blocks.0 .. blocks.1]" in repr(planned.region_0)
    assert "planner_cache_on" in planned.region_1.body.code
    assert "planner_batch_norm" in planned.region_0.body.code
    assert "add_" not in planned.region_0.body.code  # num_batches_tracked moves outside the region


def test_store_all_plan_runs_the_graph_unchanged(convnet):
    model, x, *_ = convnet
    planned = _planned(convnet, Schedule())
    assert "region" not in planned.code
    assert_same_training(training_step(model, _loss(x), (x,)), training_step(planned, _loss(x), (x,), owner=model),
                         atol=0)
