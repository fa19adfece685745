import dataclasses

import pytest
import torch

from planner.api import pose_problem
from planner.capture import capture, module_path
from planner import dropout
from planner.dropout import dropout_mask, is_mask, is_state, replayable_dropout, rng_state, workspace_bytes
from planner.meter import LiveMemoryMeter, allocator_peak_bytes, converted_operand_bytes
from planner.plan import Plan, PlannedRegion, SolverStatus
from planner.problem import Region, Schedule
from planner.rewrite import apply_plan
from tests.helpers import assert_same_training, training_step


class Attention(torch.nn.Module):
    def __init__(self, mask: str | None = None, is_causal: bool = False, scale: float | None = None):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)
        self.mask, self.is_causal, self.scale = mask, is_causal, scale

    def forward(self, x):
        q, k, v = self.proj(x).view(2, 8, 3, 4, 4).permute(2, 0, 3, 1, 4)
        mask = None
        if self.mask == "float":
            mask = torch.linspace(-1.0, 1.0, 64).view(8, 8)
        elif self.mask == "bool":
            mask = torch.ones(8, 8, dtype=torch.bool).triu(-2)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.3, is_causal=self.is_causal, scale=self.scale)


def _exported(model, x):
    return torch.export.export(model, (x,), strict=False).module()


def _step_and_state(model, x):
    torch.manual_seed(3)
    out = model(x)
    grads = torch.autograd.grad(out.square().sum(), [x])
    return out, grads[0], torch.get_rng_state()


@pytest.mark.parametrize("kind", [dict(), dict(mask="float"), dict(mask="bool"), dict(is_causal=True),
                                  dict(scale=0.3), dict(scale=-0.3)],
                         ids=["plain", "float-mask", "bool-mask", "causal", "scale", "negative-scale"])
def test_spelled_out_attention_matches_the_op_bit_for_bit(kind):
    torch.manual_seed(0)
    model, x = Attention(**kind), torch.randn(2, 8, 16, requires_grad=True)
    graph_module = _exported(model, x)
    assert replayable_dropout(graph_module) == 1
    assert not any(n.target is torch.ops.aten.scaled_dot_product_attention.default for n in graph_module.graph.nodes)
    expected, ours = _step_and_state(model, x), _step_and_state(graph_module, x)
    for a, b in zip(expected, ours):  # output, input gradient, generator state after
        assert torch.equal(a, b)


def test_dropout_keeps_its_name_and_module_and_draws_like_eager():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.4))
    x = torch.randn(4, 16, requires_grad=True)
    graph_module = _exported(model, x)
    assert replayable_dropout(graph_module) == 1
    names = {n.name: n for n in graph_module.graph.nodes}
    assert is_state(names["dropout_state"]) and is_mask(names["dropout_mask"])
    assert module_path(names["dropout_mask"]) == module_path(names["dropout"]) == "1"
    for a, b in zip(_step_and_state(model, x), _step_and_state(graph_module, x)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("model, x", [
    (torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.0)), torch.randn(2, 4)),
    (torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.3)).eval(), torch.randn(2, 4)),
    (torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout2d(0.3)), torch.randn(2, 4, 3, 3).transpose(1, 3)),
], ids=["p=0", "eval", "feature-dropout"])
def test_dropouts_that_draw_nothing_or_draw_otherwise_stay(model, x):
    assert replayable_dropout(_exported(model, x)) == 0


def test_capture_under_autocast_leaves_attention_whole():
    model, x = Attention(), torch.randn(2, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        captured = capture(model, (x,))
    assert any(n.target is torch.ops.aten.scaled_dot_product_attention.default for n in captured.compute_nodes())
    assert not any(is_mask(n) for n in captured.compute_nodes())


def test_a_mask_replays_from_its_state_whatever_was_drawn_since():
    x = torch.randn(1000)
    state = rng_state(x)
    first = dropout_mask(x, 0.3, state)
    torch.rand(50)  # the generator moves on
    assert torch.equal(dropout_mask(x, 0.3, state), first)
    assert first.dtype == torch.bool and 0.6 < first.float().mean() < 0.8


def test_what_the_ops_hold_out_of_the_meters_sight_is_what_the_allocator_holds():
    """Both meters add what a dropout op allocates inside itself; the CPU allocator (the profiler's memory events)
    sees it all: the mask's draw (and its integer buffer, where ATen draws through MKL), and the apply's product,
    which holds the mask converted to floats beside its output (in two passes, for a large tensor, the output is written
    over it). Not counted: the generator's state a draw compares with its own (5 KiB, gone before the draw, smaller
    than it here)."""
    x = torch.randn(16384)
    state = rng_state(x)
    mask = dropout_mask(x, 0.1, state)
    draw = lambda: torch.ops.planner.dropout_mask(x, 0.1, state)  # noqa: E731
    assert allocator_peak_bytes(draw) == workspace_bytes(torch.ops.planner.dropout_mask.default, (x, 0.1, state))
    across = x.view(128, 128).t()  # not contiguous: the same two tensors
    for x_, mask_ in ((x, mask), (across, mask.view(128, 128))):
        apply = lambda: torch.ops.planner.apply_mask(x_, mask_, 0.1)  # noqa: E731
        product = converted_operand_bytes(torch.ops.aten.mul.Tensor, (x_, mask_.view(torch.uint8)))
        assert product == 2 * 16384 * 4 == allocator_peak_bytes(apply)
        with LiveMemoryMeter() as meter:
            applied = apply()
        assert meter.peak_bytes == product and meter.live_bytes == applied.untyped_storage().nbytes() == 16384 * 4
    large = torch.randn(dropout.TWO_PASS_ELEMENTS)  # two passes: the output is written over the converted mask
    mask = dropout_mask(large, 0.1, rng_state(large))
    with LiveMemoryMeter() as meter:
        applied = torch.ops.planner.apply_mask(large, mask, 0.1)
    assert applied.untyped_storage().nbytes() == large.numel() * 4
    assert 0 <= meter.peak_bytes - large.numel() * 4 <= 8  # and the 0-d -0 its product adds to
    assert allocator_peak_bytes(lambda: torch.ops.planner.apply_mask(large, mask, 0.1)) <= large.numel() * 4 + 64


def test_measuring_the_draw_buffer_leaves_the_callers_generator_where_it_was():
    """The meter measures what ``bernoulli_`` holds the first time it meets a mask, inside a step: drawing from the
    default generator there moved every later dropout of the step, and T5's captured graph measured under the meter
    trained apart from eager (losses 4.79 against 4.89)."""
    dropout._measured_draw_buffer_bytes.cache_clear()
    torch.manual_seed(0)
    with LiveMemoryMeter():
        state = torch.get_rng_state()
        dropout.draw_buffer_bytes()
    assert dropout._measured_draw_buffer_bytes.cache_info().currsize == 1
    assert torch.equal(torch.get_rng_state(), state)


def test_applying_a_mask_saves_the_mask_alone_and_runs_no_python_in_the_backward():
    """The product's autograd (C++) saves the one-byte mask as ``uint8``, not ``x``, and the backward is two
    ATen nodes (no ``autograd.Function``), the one that reads the mask first."""
    x = torch.randn(32, 8, requires_grad=True)
    mask = dropout_mask(x, 0.3, rng_state(x))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = torch.ops.planner.apply_mask(x, mask, 0.3)
    assert [(t.dtype, t.untyped_storage().data_ptr()) for t in saved] == [(torch.uint8, mask.data_ptr())]
    masked, scaled = out.grad_fn, out.grad_fn.next_functions[0][0]  # the mask's node comes first in the backward
    assert [type(f).__name__ for f in (masked, scaled)] == ["MulBackward0", "MulBackward0"]
    assert scaled.next_functions[0][0].variable is x and masked._saved_other.dtype == torch.uint8


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj, self.fc = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 4, 4).permute(2, 0, 3, 1, 4)
        attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
        x = x + self.drop(self.proj(attention.transpose(1, 2).reshape(2, 8, 16)))
        return x + self.drop(self.fc(x).relu())


@pytest.fixture(scope="module")
def blocks():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), Block()).train()
    x = torch.randn(2, 8, 16)
    captured = capture(model, (x,))
    problem, stage_nodes = pose_problem(captured, loss_fn=lambda out: out.square().mean(), profile_repeats=0)
    return model, x, captured, problem, stage_nodes


def _masks_of(captured, block: str) -> tuple[str, ...]:
    return tuple(n.name for n in captured.compute_nodes() if is_mask(n) and module_path(n).startswith(block))


def _planned(blocks, *regions: PlannedRegion):
    """The captured blocks run by a plan of exactly ``regions`` (each with the nodes it caches)."""
    model, x, captured, problem, stage_nodes = blocks
    plan = Plan.from_schedule(problem, Schedule(tuple(Region(r.start, r.stop) for r in regions)), solver="test",
                              status=SolverStatus.HEURISTIC)
    return apply_plan(captured.graph_module, dataclasses.replace(plan, regions=regions, stage_nodes=stage_nodes))


def _assert_trains_like_eager(model, planned, x):
    """Loss, gradients and the generator's next numbers after a step of ``planned`` are eager's, bit for bit."""
    run = lambda m: m(x).square().mean()  # noqa: E731
    eager = training_step(model, run, (x,))
    eager_next = torch.rand(4)
    result = training_step(planned, run, (x,), owner=model)
    assert torch.equal(torch.rand(4), eager_next)
    assert_same_training(eager, result, atol=0)


@pytest.mark.parametrize("kept", [("0",), ("1",), ("0", "1"), ()], ids=["first", "second", "both", "none"])
def test_regions_that_keep_some_masks_and_redraw_others_train_bit_for_bit(blocks, kept):
    """One region over the first two blocks keeps the masks of some blocks and re-draws the others (after or
    before a kept one), caching a matmul so that selective checkpointing runs: loss, gradients and the generator
    state afterwards are eager's."""
    model, x, captured, problem, stage_nodes = blocks
    assert problem.num_stages == 3
    cached = sum((_masks_of(captured, block) for block in kept), ())
    cached += tuple(n.name for n in captured.compute_nodes() if n.name == "linear")  # the first qkv projection
    planned = _planned(blocks, PlannedRegion(0, 2, cached_nodes=cached))
    _assert_trains_like_eager(model, planned, x)


def test_a_region_keeps_the_states_of_the_masks_it_keeps_and_no_other(blocks):
    """A region over the first two blocks keeps the first block's masks (and their states, as the option says)
    and recomputes the second block whole, drawing its masks again from states it recomputes too: the replay of
    each kept mask moves the generator on as its draw did. It once kept every state of a caching region, 5 KiB
    each that the execution model did not count (T5 cut at its sublayers measured 3.6 KB over its
    smallest-peak budget)."""
    model, x, captured, problem, stage_nodes = blocks
    (option,) = [o for o, opt in enumerate(problem.stages[0].recompute_options) if opt.name == "cache_masks"]
    states = {n.name for n in captured.compute_nodes() if is_state(n)}
    plan = Plan.from_schedule(problem, Schedule((Region(0, 2, (option, 0)),)), solver="test",
                              status=SolverStatus.HEURISTIC)
    planned = apply_plan(captured.graph_module, dataclasses.replace(plan, stage_nodes=stage_nodes))
    body = planned.get_submodule("region_0").body
    kept = {n.name for n in body.graph.nodes if n.op == "call_function" and "planner_cached" in n.target.__name__}
    assert kept & states == states & set(stage_nodes[0]) == set(plan.regions[0].cached_nodes) & states
    assert not kept & states & set(stage_nodes[1])
    _assert_trains_like_eager(model, planned, x)
    measured = training_step(planned, lambda m: m(x).square().mean(), (x,), owner=model).peak_bytes
    assert measured <= plan.predicted_peak_bytes


def test_caching_options_may_keep_masks_and_keep_their_states(blocks):
    model, x, captured, problem, stage_nodes = blocks
    masks = {n.name for n in captured.compute_nodes() if is_mask(n)}
    states = {n.name for n in captured.compute_nodes() if is_state(n)}
    options = [o for stage in problem.stages for o in stage.recompute_options]
    assert any(o.cached_nodes & masks for o in options)  # a mask is the costliest node per byte kept
    for stage, nodes in zip(problem.stages, stage_nodes):
        own_states = states & set(nodes)
        assert own_states
        for option in stage.recompute_options:  # caching runs selective checkpointing, which keeps every state
            assert own_states <= option.cached_nodes if option.cached_nodes else not option.cached_nodes
        if len(stage.recompute_options) > 1:  # (the stage that makes the model's output is only recomputed whole)
            (just_masks,) = [o for o in stage.recompute_options if o.name == "cache_masks"]
            assert just_masks.cached_nodes == own_states | (masks & set(nodes))
    assert sum(len(stage.recompute_options) > 1 for stage in problem.stages) == 2


def test_regions_that_cache_nothing_and_stored_blocks_train_bit_for_bit(blocks):
    """A plan with a region keeping the first block's masks, one recomputing the second whole and the third block
    stored: every dropout runs as mask and apply, and training is eager's, bit for bit."""
    model, x, captured, problem, stage_nodes = blocks
    planned = _planned(blocks, PlannedRegion(0, 1, cached_nodes=_masks_of(captured, "0")), PlannedRegion(1, 2))
    for code in (planned.code, planned.get_submodule("region_0").body.code,
                 planned.get_submodule("region_1").body.code):
        assert "dropout_mask" in code and "aten.dropout" not in code and "aten.scaled_dot_product" not in code
    _assert_trains_like_eager(model, planned, x)


def test_dropout_saves_a_byte_per_element_for_the_backward_where_eager_saves_four():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Dropout(0.3), torch.nn.Linear(256, 8))
    x = torch.randn(32, 64)
    graph_module = capture(model, (x,)).graph_module
    kept = {}
    for name, module in (("eager", model), ("graph", graph_module)):
        torch.manual_seed(1)
        with LiveMemoryMeter() as meter:
            out = module(x)
        kept[name] = meter.live_bytes  # what the forward leaves alive for the backward, and the output
        torch.manual_seed(1)
        assert torch.equal(out, model(x))
        del out
    assert kept["eager"] - kept["graph"] == 32 * 256 * 3  # the noise (float) against the mask (bool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.07, 0.5])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("passes", ["aten", "two_pass"])
def test_applying_a_mask_is_eager_dropout_bit_for_bit_even_at_infinities_and_signed_zeros(dtype, p, layout, passes,
                                                                                         monkeypatch):
    """Dropped: inf, -inf, NaN, -0 and -1 (NaN, NaN, NaN, -0, -0 in eager); kept: 3, the largest finite value
    (overflows to inf when scaled) and the smallest subnormal; the output keeps eager's layout, transposed too.
    Both ways: the ATen product of small tensors, and the two passes of large ones."""
    if passes == "two_pass":
        monkeypatch.setattr(dropout, "TWO_PASS_ELEMENTS", 1)
    x = torch.randn(64, 64, dtype=dtype)
    tiny, largest = torch.finfo(dtype).smallest_normal / 4, torch.finfo(dtype).max
    x.view(-1)[:8] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, -1.0, 3.0, largest, tiny],
                                  dtype=dtype)
    torch.manual_seed(5)
    noise = torch.empty_like(x).bernoulli_(1 - p)
    noise.view(-1)[:8] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=dtype)
    mask = noise.bool()
    if layout == "transposed":
        x, noise, mask = x.t(), noise.t(), mask.t()
    eager = x * noise.div_(1 - p)  # at::dropout, op for op
    bits = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    ours = torch.ops.planner.apply_mask(x, mask, p)
    assert torch.equal(ours.view(bits), eager.view(bits)) and ours.stride() == eager.stride()
    grad = torch.randn_like(x)
    x.requires_grad_(True)
    (ours_grad,) = torch.autograd.grad(torch.ops.planner.apply_mask(x, mask, p), x, grad)
    assert torch.equal(ours_grad.view(bits), (grad * noise).view(bits))  # MulBackward: grad times the noise


def test_compiled_backward_converts_the_mask_from_booleans_and_matches_eager_bit_for_bit():
    """Inductor's C++ kernels reinterpret a bool tensor viewed as uint8 element by element (the test-size GPT-2's
    attention backward ran 8 times slower so): traced by torch.compile, the backward converts the bool mask."""
    from torch._dynamo.backends.common import aot_autograd

    backward_graphs = []

    def keep_backward(graph_module, example_inputs):
        backward_graphs.append(graph_module)
        return graph_module

    def through(module, x):
        torch.manual_seed(2)
        out = module(x)
        return out, torch.autograd.grad(out.square().sum(), x)[0]

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.3))
    x = torch.randn(8, 16, requires_grad=True)
    graph_module = _exported(model, x)
    assert replayable_dropout(graph_module) == 1
    try:
        compiled = torch.compile(graph_module, backend=aot_autograd(fw_compiler=lambda gm, _: gm,
                                                                    bw_compiler=keep_backward))
        for a, b in zip(through(model, x), through(compiled, x)):
            assert torch.equal(a, b)
    finally:
        torch._dynamo.reset()
    (backward,) = backward_graphs
    targets = [n.target for n in backward.graph.nodes if n.op == "call_function"]
    converted = [n.args[0].meta["val"].dtype for n in backward.graph.nodes
                 if n.target is torch.ops.aten._to_copy.default]
    assert torch.ops.aten.view.dtype not in targets and converted == [torch.bool]


@pytest.mark.parametrize("kept", [("0", "1"), ("0",), ()], ids=["both", "first", "none"])
def test_compiled_regions_keep_the_masks_the_plan_keeps(blocks, kept):
    """Under torch.compile a region keeps what the plan caches too (through annotations the policy reads): a
    region over the first two blocks that keeps the masks of ``kept`` draws only the others again. 3 blocks of 3
    dropouts draw 9 masks in the forward, and 3 more for each block whose masks the region does not keep; the step
    is compiled eager's, bit for bit."""
    import torch._inductor.config as inductor_config

    model, x, captured, problem, stage_nodes = blocks
    planned = _planned(blocks, PlannedRegion(0, 2, cached_nodes=sum((_masks_of(captured, b) for b in kept), ())))

    def step(module):
        torch.manual_seed(0)
        loss = module(x).square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return [loss.detach(), *grads, torch.get_rng_state()]

    try:
        with inductor_config.patch(fallback_random=True):
            compiled_model, compiled_plan = torch.compile(model), torch.compile(planned)
            expected, found = step(compiled_model), step(compiled_plan)
            with torch.profiler.profile() as prof:
                step(compiled_plan)
    finally:
        torch._dynamo.reset()
    draws = sum(e.count for e in prof.key_averages() if e.key == "planner::dropout_mask")
    assert draws == 9 + 3 * (2 - len(kept))
    assert all(torch.equal(a, b) for a, b in zip(expected, found))


class _TransposedDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 24)

    def forward(self, x):
        return torch.nn.functional.dropout(self.proj(x).transpose(1, 2), 0.3, True)


def test_a_transposed_input_draws_its_mask_in_memory_order_as_eager_does():
    """Eager's noise takes the input's layout and ``bernoulli_`` fills it in memory order; so does the mask."""
    model, x = _TransposedDropout(), torch.randn(4, 8, 16, requires_grad=True)
    graph_module = _exported(model, x)
    assert replayable_dropout(graph_module) == 1
    for a, b in zip(_step_and_state(model, x), _step_and_state(graph_module, x)):
        assert torch.equal(a, b)
