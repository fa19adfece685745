import dataclasses

import pytest
import torch

from planner.api import pose_problem
from planner.capture import capture
from planner.errors import PlannerError
from planner.plan import Plan, PlannedRegion, SolverStatus
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
    assert "planner_cached_" in planned.region_1.body.code
    assert "planner_batch_norm" in planned.region_0.body.code
    assert "add_" not in planned.region_0.body.code  # num_batches_tracked moves outside the region


def test_store_all_plan_runs_the_graph_unchanged(convnet):
    model, x, *_ = convnet
    planned = _planned(convnet, Schedule())
    assert "region" not in planned.code
    assert_same_training(training_step(model, _loss(x), (x,)), training_step(planned, _loss(x), (x,), owner=model),
                         atol=0)


class MutatedBetweenBlocks(torch.nn.Module):
    """Two blocks; the second stage starts by writing the first block's output in place."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)) for _ in range(2))

    def forward(self, x):
        h = self.blocks[0](x)
        getattr(h, self.op)(*(() if self.op == "relu_" else (1.0,)))
        return self.blocks[1](h)


@pytest.mark.parametrize("op", ["relu_", "add_"])
@pytest.mark.parametrize("regions", [((0, 1),), ((1, 2),), ((0, 1), (1, 2)), ((0, 2),)],
                         ids=["producer", "mutator", "both", "one"])
def test_in_place_op_on_the_previous_stages_output_trains_exactly(op, regions):
    """Stages cut right before the in-place op (as stage lists made elsewhere may): whichever side is recomputed,
    the step matches eager bit for bit; a region that would write its own input has the write run before it."""
    torch.manual_seed(0)
    model = MutatedBetweenBlocks(op).train()
    x = torch.randn(4, 8)
    captured = capture(model, (x,))
    names = [n.name for n in captured.compute_nodes()]
    cut = names.index(op)
    plan = Plan(("blocks.0", "blocks.1"), tuple(PlannedRegion(a, b) for a, b in regions), 0, 0, 0.0, 0.0, "test",
                SolverStatus.HEURISTIC, stage_nodes=(tuple(names[:cut]), tuple(names[cut:])))
    planned = apply_plan(captured.graph_module, plan)
    eager = training_step(model, _loss(x), (x,))
    assert_same_training(eager, training_step(planned, _loss(x), (x,), owner=model), atol=0)
    for region in planned.children():
        if isinstance(region, CheckpointRegion) and "blocks.0" not in region.stage_names:  # it writes its input
            assert getattr(torch.ops.aten, op) not in {getattr(n.target, "overloadpacket", None)
                                                       for n in region.body.graph.nodes}


class ShiftedInsideABlock(torch.nn.Module):
    """A block that builds a tensor by writing into slices of it (as T5's ``_shift_right`` builds the decoder's
    inputs): writes whose results nothing reads, whose effect the ops after them read."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        h = self.blocks[0](x)
        shifted = h.new_zeros(h.shape)
        shifted[:, 1:] = h[:, :-1]
        shifted[:, 0] = 1.0
        shifted.masked_fill_(shifted > 0.5, 0.5)
        h = self.blocks[1](shifted + h)
        return self.blocks[2](h)


@pytest.mark.parametrize("regions", [((0, 1),), ((1, 2),), ((0, 2),), ((0, 1), (1, 2))],
                         ids=["writer", "after", "one", "both"])
def test_writes_into_a_value_the_region_makes_stay_inside_it(regions):
    """The slice writes run inside the region, in order, forward and recomputation alike: hoisted out of it,
    they ran after the ops that read what they write (T5's decoder read all zeros)."""
    torch.manual_seed(0)
    model = ShiftedInsideABlock().train()
    x = torch.randn(4, 8)
    captured = capture(model, (x,))
    names = [n.name for n in captured.compute_nodes()]
    cut = names.index("linear_1")
    plan = Plan(("blocks.0", "blocks.1"), tuple(PlannedRegion(a, b) for a, b in regions), 0, 0, 0.0, 0.0, "test",
                SolverStatus.HEURISTIC, stage_nodes=(tuple(names[:cut]), tuple(names[cut:])))
    planned = apply_plan(captured.graph_module, plan)
    for region in planned.children():
        if isinstance(region, CheckpointRegion) and "blocks.0" in region.stage_names:
            ops = {getattr(n.target, "overloadpacket", None) for n in region.body.graph.nodes}
            assert {torch.ops.aten.copy_, torch.ops.aten.fill_, torch.ops.aten.masked_fill_} <= ops
    eager = training_step(model, _loss(x), (x,))
    assert_same_training(eager, training_step(planned, _loss(x), (x,), owner=model), atol=0)


class ReadThenWritten(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        h = self.blocks[0](x)
        y = h * 2
        h.relu_()
        return self.blocks[1](h) + y


def test_a_region_that_reads_its_input_and_then_writes_it_in_place_is_refused():
    """The write cannot run before the region (``h * 2`` must see ``h`` unwritten), and inside, the recomputation
    would write it twice: a clear error instead of a wrong gradient or an autograd error in the backward."""
    model, x = ReadThenWritten(), torch.randn(4, 8)
    captured = capture(model, (x,))
    names = [n.name for n in captured.compute_nodes()]
    cut = names.index("mul")
    plan = Plan(("blocks.0", "blocks.1"), (PlannedRegion(1, 2),), 0, 0, 0.0, 0.0, "test", SolverStatus.HEURISTIC,
                stage_nodes=(tuple(names[:cut]), tuple(names[cut:])))
    with pytest.raises(PlannerError, match="write linear in place"):
        apply_plan(captured.graph_module, plan)


class _CountingMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("option, convolutions", [("recompute_all", 6), ("cache_matmuls", 4)])
def test_a_region_replays_its_cached_ops_instead_of_running_them(convnet, option, convolutions):
    """Blocks 1-2 in one region: recomputing everything runs their two convolutions again (6 in all); caching the
    matmuls hands the recomputation the forward's outputs (4, the forward's), and the step stays eager's."""
    model, x, captured, problem, stage_nodes = convnet
    options = [next(i for i, o in enumerate(problem.stages[k].recompute_options) if o.name == option) for k in (1, 2)]
    planned = _planned(convnet, Schedule((Region(1, 3, tuple(options)),)))
    eager = training_step(model, _loss(x), (x,))
    with _CountingMode(torch.ops.aten.convolution.default) as counting:
        result = training_step(planned, _loss(x), (x,), owner=model)
    assert counting.calls == convolutions
    assert_same_training(eager, result, atol=0)


def _backward_twice(x):
    def run(m):
        loss = m(x).square().mean()
        loss.backward(retain_graph=True)
        return loss
    return run


def _gradient_penalty(x):
    def run(m):
        inputs = x.clone().requires_grad_()
        loss = m(inputs).square().mean()
        grad, = torch.autograd.grad(loss, inputs, create_graph=True)
        return loss + grad.square().sum()
    return run


@pytest.mark.parametrize("option", ["recompute_all", "cache_masks", "cache_50pct"])
@pytest.mark.parametrize("step", [_backward_twice, _gradient_penalty], ids=["retain_graph", "create_graph"])
def test_a_region_recomputed_again_in_a_second_backward_trains_exactly(convnet, option, step):
    """A backward run twice over one forward (``retain_graph=True``), or a gradient penalty's backward through
    the first one's graph (``create_graph=True``), recomputes each region twice: the second recomputation finds
    the cache spent and runs the cached ops (dropout masks, BatchNorm) again. Gradients, BatchNorm statistics and
    the generator's state equal eager's bit for bit, as with plain checkpointing."""
    model, x, captured, problem, stage_nodes = convnet
    options = [next(i for i, o in enumerate(problem.stages[k].recompute_options) if o.name == option)
               for k in range(4)]
    planned = _planned(convnet, Schedule((Region(0, 2, tuple(options[:2])), Region(2, 4, tuple(options[2:])))))
    eager = training_step(model, step(x), (x,))
    eager_next = torch.rand(3)
    result = training_step(planned, step(x), (x,), owner=model)
    assert torch.equal(torch.rand(3), eager_next)
    assert_same_training(eager, result, atol=0)


def test_a_cached_tensor_written_in_place_after_caching_is_refused():
    from planner.rewrite import _RegionCache

    cache, made = _RegionCache(), torch.ones(3)
    cache.record(made)
    made.add_(1)
    with pytest.raises(PlannerError, match="written in place"):
        cache.replay(torch.ops.aten.mul.Tensor)
    fresh = _RegionCache()
    fresh.record((torch.ones(2), torch.zeros(2)))
    first, second = fresh.replay(torch.ops.aten.mul.Tensor)
    assert first.tolist() == [1.0, 1.0] and second.tolist() == [0.0, 0.0] and fresh.entries == [None]
    with pytest.raises(PlannerError, match="more often"):
        fresh.replay(torch.ops.aten.mul.Tensor)


class WritesItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        x[:, 0] = 0.5
        return self.blocks[1](self.blocks[0](x))


def test_a_region_that_writes_the_models_input_through_a_view_is_refused_with_the_way_out(monkeypatch):
    """``x[:, 0] = 0.5`` in the first stage: inside the region its recomputation would write ``x`` again, and
    moved out of it the write would come after the region's view of ``x``. Hoisted past the region, as writes
    nothing reads once were, the block read ``x`` unwritten. (Capture refuses such a graph now, so that
    ``optimize`` plans its parts: :func:`planner.capture.entangled_state`; the rewrite still guards itself.)"""
    model, x = WritesItsInput(), torch.randn(4, 8)
    with pytest.raises(PlannerError, match="writes x in place where it also reads it"):
        capture(model, (x.clone(),))
    monkeypatch.setattr("planner.capture.entangled_state", lambda graph: [])
    captured = capture(model, (x.clone(),))
    names = [n.name for n in captured.compute_nodes()]
    cut = names.index("linear_1")
    plan = Plan(("blocks.0", "blocks.1"), (PlannedRegion(0, 1),), 0, 0, 0.0, 0.0, "test", SolverStatus.HEURISTIC,
                stage_nodes=(tuple(names[:cut]), tuple(names[cut:])))
    with pytest.raises(PlannerError, match=r"write the input x in place through a view.*x = x.clone\(\)"):
        apply_plan(captured.graph_module, plan)


class NormalisedTopK(torch.nn.Module):
    """Mixtral's router: ``topk``'s values are normalised in place after the op made them."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        h = self.blocks[0](x)
        weights, chosen = torch.topk(self.blocks[1](h).softmax(-1), 2, dim=-1)
        weights /= weights.sum(-1, keepdim=True)
        h = h * weights[:, :1] + torch.nn.functional.one_hot(chosen[:, 0], 8).float()
        return self.blocks[2](h)


def test_caching_an_output_the_forward_later_writes_in_place_is_refused_in_the_backward():
    """A plan that caches ``topk`` anyway (made by hand: the planner's own never does, see
    :func:`planner.capture.mutated_nodes`) would hand the recomputation the normalised weights: the replay checks
    the versions of the outputs as the graph saw them and says so, where it used to train on wrong gradients."""
    torch.manual_seed(0)
    model = NormalisedTopK().train()
    x = torch.randn(16, 8)
    captured = capture(model, (x,))
    names = [n.name for n in captured.compute_nodes()]
    cuts = names.index("linear_1"), names.index("linear_2")
    stage_nodes = (tuple(names[:cuts[0]]), tuple(names[cuts[0]:cuts[1]]), tuple(names[cuts[1]:]))

    def planned(cached):
        return apply_plan(captured.graph_module, Plan(("b0", "b1", "b2"), (PlannedRegion(1, 2, cached),), 0, 0, 0.0,
                                                      0.0, "test", SolverStatus.HEURISTIC, stage_nodes=stage_nodes))

    eager = training_step(model, _loss(x), (x,))
    assert_same_training(eager, training_step(planned(("softmax",)), _loss(x), (x,), owner=model), atol=0)
    with pytest.raises(PlannerError, match=r"cached \(aten.topk.default\) was written in place"):
        training_step(planned(("topk",)), _loss(x), (x,), owner=model)


def test_an_early_stopped_recomputation_does_not_pass_through_the_bodys_module_call(convnet, monkeypatch):
    """A plain region's recomputation stops early by raising; called as a module, the body (a GraphModule) would
    catch that exception to extract its traceback before re-raising, on every region of every step. The region
    calls the body's forward instead: no traceback is extracted, and training is still eager's."""
    import traceback

    model, x, captured, problem, stage_nodes = convnet
    planned = _planned(convnet, Schedule.uniform(4))
    eager = training_step(model, _loss(x), (x,))
    walked = []  # the wrapper walks the exception's traceback (traceback.walk_tb) to extract it
    real = traceback.walk_tb
    monkeypatch.setattr(traceback, "walk_tb", lambda tb: walked.append(tb) or real(tb))
    result = training_step(planned, _loss(x), (x,), owner=model)
    assert walked == []
    assert_same_training(eager, result, atol=0)


def test_the_planned_forward_casts_without_autocasts_cache_and_restores_it_even_when_it_raises(convnet, monkeypatch):
    model, x, *_ = convnet
    planned = _planned(convnet, Schedule.uniform(4))
    seen = []
    monkeypatch.setattr(planned, "region_0", _Spy(planned.region_0, seen))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned(x).float().square().mean().backward()
        assert seen == [False] and torch.is_autocast_cache_enabled()
        with pytest.raises(AssertionError, match="Guard failed"):
            planned(x[:, :3])  # the captured graph's guards want 8 channels
        assert torch.is_autocast_cache_enabled()
    for p in model.parameters():
        p.grad = None


class _Spy(torch.nn.Module):
    """A region that records whether autocast's cache was on when it ran."""

    def __init__(self, region: torch.nn.Module, seen: list):
        super().__init__()
        self.region, self.seen = region, seen

    def forward(self, *args):
        self.seen.append(torch.is_autocast_cache_enabled())
        return self.region(*args)
