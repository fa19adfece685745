import pytest
import torch

import planner.timing
from planner.capture import capture
from planner.dropout import draw_buffer_bytes
from planner.meter import LiveMemoryMeter, storage_bytes
from planner.profile import default_loss, measure_stages, paired_step_seconds, preserved_training_state, profile_graph
from tests.helpers import training_step


def _mlp(dropout=0.0):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(64, 16)]
    return torch.nn.Sequential(*layers)


def test_nodes_record_allocations_reads_saved_tensors_and_flops():
    model = _mlp(dropout=0.5)
    x = torch.randn(32, 16)
    profile = profile_graph(capture(model, (x,)), repeats=1)
    by_target = {p.name: p for p in profile.nodes}
    linear, relu, mask, dropout, linear_1 = (
        by_target[n] for n in ("linear", "relu", "dropout_mask", "dropout", "linear_1"))
    assert linear.created_bytes == 32 * 64 * 4 and linear.flops == 2 * 32 * 16 * 64
    assert linear.param_reads == {"0.weight", "0.bias"}
    assert relu.saved == {relu.created[0].key}  # relu saves its output
    assert relu.created[0].key in dropout.reads and relu.created[0].key in mask.reads
    # the mask keeps a byte per element (where ATen draws through MKL, the integers it draws first are its busiest
    # moment); applying it scales x, then masks that in place, the mask converted to floats beside it
    assert mask.created_bytes == 32 * 64 and mask.busiest_bytes == 32 * 64 * (1 + draw_buffer_bytes())
    assert dropout.saved == {mask.created[0].key}  # applying the mask saves the mask, not float noise
    assert dropout.created_bytes == 32 * 64 * 4 and dropout.busiest_bytes == 2 * dropout.created_bytes
    assert dropout.mutates_created and not any(p.mutates_created for p in profile.nodes if p is not dropout)
    assert dropout.created[0].key in linear_1.saved  # linear saves its input
    assert profile.output_keys == {linear_1.created[0].key}
    assert profile.fixed_bytes == storage_bytes(list(model.parameters()) + [x])
    assert all(p.seconds >= 0 for p in profile.nodes)


def test_results_are_written_into_node_meta():
    captured = capture(_mlp(), (torch.randn(4, 16),))
    profile = profile_graph(captured, repeats=1)
    metas = [n.meta["planner"] for n in captured.compute_nodes()]
    assert [m.name for m in metas] == [p.name for p in profile.nodes]


def test_profiling_keeps_no_tensor_of_its_run_alive():
    """The profiled run's autograd graph dies with it: an op that saves its own output (tanh, softmax) made a
    cycle through its grad_fn when the saved-tensor hook returned the tensor itself, and a step's saved activations
    stayed allocated after planning (on an H200, 11.7 GiB of GPT-2's beside a 13.7 GiB step)."""
    import gc

    def with_history():  # what other tests of this worker left may die meanwhile: profiling must add nothing
        gc.collect()
        return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None}

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Softmax(dim=-1), torch.nn.Linear(64, 16))
    captured = capture(model, (torch.randn(32, 16),))
    before = with_history()
    profile = profile_graph(captured, repeats=1)
    assert with_history() <= before
    assert any(p.saved & {r.key for r in p.created} for p in profile.nodes)  # some op saved its own output


def test_profiling_leaves_rng_buffers_and_grads_untouched():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.3))
    x = torch.randn(16, 8)
    captured = capture(model, (x,))
    state = torch.get_rng_state()
    stats = model[1].running_mean.clone(), model[1].num_batches_tracked.clone()
    profile_graph(captured, repeats=2)
    measure_stages(captured, {n.name: 0 for n in captured.compute_nodes()}, 1, repeats=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(model[1].running_mean, stats[0]) and torch.equal(model[1].num_batches_tracked, stats[1])
    assert all(p.grad is None for p in model.parameters())


def test_measured_stage_peaks_cover_the_eager_step():
    model = _mlp()
    x = torch.randn(256, 16)
    captured = capture(model, (x,))
    stage_of = {n.name: (0 if n.name in ("linear", "relu") else 1) for n in captured.compute_nodes()}
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731
    measured = measure_stages(captured, stage_of, 2, loss_fn=loss_fn, repeats=1, hold_outputs=False)
    eager = training_step(model, lambda m: loss_fn(m(x)), (x,))
    fixed = storage_bytes(list(model.parameters()) + [x])
    assert fixed + measured.total_peak == eager.peak_bytes
    held = measure_stages(captured, stage_of, 2, loss_fn=loss_fn, repeats=1)  # a caller keeping ``out``
    assert held.total_peak - measured.total_peak == 256 * 16 * 4
    assert max(measured.forward_peak + measured.backward_peak) == measured.total_peak
    assert len(measured.backward_seconds) == 2 and measured.step_seconds > 0


def test_a_stage_backward_reports_when_it_frees_the_tensors_it_saves_of_earlier_stages():
    """Stage 1 (GELU and the second linear layer) saves the first layer's output, which nothing else keeps: the
    metered step names it as the profile does and reports it freed inside stage 1's backward, after the peak of
    stage 1's backward up to then."""
    from planner.costmodel import created_tensors

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(256, 16)
    captured = capture(model, (x,))
    stage_of = {n.name: (0 if n.name == "linear" else 1) for n in captured.compute_nodes()}
    created = created_tensors(profile_graph(captured, repeats=0))
    (first_layer, nbytes), = created["linear"]
    assert nbytes == 256 * 64 * 4
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731
    measured = measure_stages(captured, stage_of, 2, loss_fn=loss_fn, repeats=0, hold_outputs=False,
                              created=created)
    head = measured.backward_releases[1]
    freed = {r.label: r.peak_before_bytes for r in head.releases}
    assert nbytes <= freed[first_layer] <= measured.backward_peak[1]
    assert first_layer not in {r.label for r in measured.backward_releases[0].releases}
    unnamed = measure_stages(captured, stage_of, 2, loss_fn=loss_fn, repeats=0, hold_outputs=False)
    assert unnamed.backward_peak == measured.backward_peak and not unnamed.backward_releases[1].releases


def test_default_loss_prefers_a_scalar_output():
    loss = torch.tensor(2.0, requires_grad=True)
    assert default_loss({"loss": loss, "logits": torch.ones(3, requires_grad=True)}) is loss
    summed = default_loss((torch.ones(2, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)))
    assert summed.item() == 1.0 + 4.0  # a stand-in that keeps its inputs and makes their gradients whole


class _Clock:
    """A stand-in for ``time`` in ``planner.timing``: steps advance it, so their times are exact (a 1 ms sleep
    took a median 2.1 ms on a loaded CI machine)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(planner.timing, "time", fake)
    return fake


def _varying_step(clock: _Clock, seconds: list[float]):
    """A step that takes the next of ``seconds`` in turn on ``clock`` and counts its calls."""
    calls = []

    def step():
        clock.now += seconds[len(calls) % len(seconds)]
        calls.append(1)
    return step, calls


def test_paired_step_seconds_stops_once_the_medians_are_precise_enough(clock):
    eager, eager_calls = _varying_step(clock, [0.001])
    slow, _ = _varying_step(clock, [0.003, 0.004, 0.005])
    # a loose tolerance is met after the minimum rounds (3, after one warm-up)
    paired_step_seconds({"eager": eager, "slow": slow}, 3, "eager", tolerance=10.0, max_rounds=12)
    assert len(eager_calls) == 4


def test_paired_step_seconds_adds_rounds_while_the_medians_are_noisy(clock):
    eager, eager_calls = _varying_step(clock, [0.001])
    slow, _ = _varying_step(clock, [0.003, 0.004, 0.005])
    # an unreachable tolerance runs to max_rounds; the baseline maps to its median, the other to its median excess
    seconds = paired_step_seconds({"eager": eager, "slow": slow}, 3, "eager", tolerance=1e-9, max_rounds=7)
    assert len(eager_calls) == 8
    assert 0.001 <= seconds["eager"].median < 0.002 and 0.002 < seconds["slow"].median < 0.006
    assert seconds["slow"].clearly_above(0) and seconds["slow"].standard_error > 0


def test_paired_step_seconds_gives_up_at_its_time_limit(clock):
    eager, eager_calls = _varying_step(clock, [0.001])
    slow, _ = _varying_step(clock, [0.003, 0.004, 0.005])
    paired_step_seconds({"eager": eager, "slow": slow}, 2, "eager", tolerance=1e-9, max_rounds=50, max_seconds=0.0)
    assert len(eager_calls) == 3  # the minimum rounds run, then the time is up


def test_paired_step_seconds_times_a_step_against_the_one_it_is_paired_with(clock):
    eager, _ = _varying_step(clock, [0.010, 0.020])  # a machine whose speed drifts between rounds
    plain, _ = _varying_step(clock, [0.013, 0.026])
    cached, _ = _varying_step(clock, [0.012, 0.024])
    seconds = paired_step_seconds({"eager": eager, "plain": plain, "cached": cached}, 4, "eager",
                                  paired_with={"cached": "plain"})
    assert seconds["plain"].median == pytest.approx(0.0045)  # beyond eager in the same round: 3 and 6 ms
    assert seconds["cached"].median == pytest.approx(-0.0015)  # beyond plain: -1 and -2 ms, not beyond eager


class _InPlaceAttention(torch.nn.Module):
    """A linear, an in-place ReLU on its output, then attention with dropout: the ReLU writes what the linear
    made, and attention (with dropout, the CPU takes the math path) frees temporaries before it returns."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x):
        h = self.proj(x).relu_()
        q, k, v = h.view(2, 8, 3, 4, 4).permute(2, 0, 3, 1, 4)
        attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        return torch.nn.functional.cosine_similarity(attention, q, dim=-1)


def test_nodes_record_what_they_write_in_place_and_their_busiest_moment():
    torch.manual_seed(0)
    profile = profile_graph(capture(_InPlaceAttention(), (torch.randn(2, 8, 16),)), repeats=1)
    linear = profile.node("linear")
    relu = next(p for p in profile.nodes if p.name.startswith("relu_"))
    assert relu.writes == {linear.created[0].key} and not linear.writes
    assert all(not p.writes for p in profile.nodes if p is not relu)
    similarity = profile.node("cosine_similarity")
    lasting = sum(r.nbytes for r in similarity.created if r.survives)
    assert similarity.busiest_bytes > lasting  # temporaries (the norms) lived and died inside the composite op
    assert similarity.busiest_bytes <= similarity.created_bytes  # never more than everything it made at once
    mask = profile.node("scaled_dot_product_attention_mask")  # one byte per element kept (integers drawn first
    assert mask.busiest_bytes == (1 + draw_buffer_bytes()) * mask.created_bytes  # where ATen draws through MKL)
    assert mask.created_bytes == 2 * 4 * 8 * 8
    dropped = profile.node("scaled_dot_product_attention_dropped")  # its output and the mask as floats
    assert dropped.busiest_bytes == 2 * dropped.created_bytes == 2 * 4 * 2 * 4 * 8 * 8
    assert linear.busiest_bytes == linear.created_bytes  # a plain op: its output is its busiest moment


class _UnreadView(torch.nn.Module):
    """Makes a view nothing reads (as BART's embeddings do): its base must not outlive its last real reader."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        h = self.first(x)
        h[:, 0]  # noqa: B018  (read by nothing: export keeps the select)
        return self.second(h.relu())


def test_measured_steps_free_a_value_nothing_reads_as_the_module_does():
    """``fx.Interpreter`` keeps the value of a node nothing reads until its run ends; the code a ``GraphModule``
    generates frees it at once. Kept, the unread view held ``h`` (and, on BART, 33 KB) through a measured step that
    the module itself does not hold, and calibration took it for workspace."""
    model = _UnreadView()
    x = torch.randn(256, 16)
    captured = capture(model, (x,))
    assert any(not n.users for n in captured.compute_nodes())
    stage_of = {n.name: 0 for n in captured.compute_nodes()}
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731
    measured = measure_stages(captured, stage_of, 1, loss_fn=loss_fn, repeats=1, hold_outputs=False)
    with LiveMemoryMeter() as meter:
        captured.graph_module(x)
    assert measured.forward_peak == [meter.peak_bytes] == [2 * 256 * 64 * 4]  # h and its relu; kept, h outlived relu


def test_what_a_backward_makes_before_it_reads_a_saved_tensor_is_measured():
    """Under autocast the residual add ending each stage casts the incoming gradient for its bf16 branch before
    the stage's first saved tensor is read: a region ending there is recomputed with that copy alive."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                                     torch.nn.Linear(64, 16)) for _ in range(2))

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = blocks

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x

    x = torch.randn(256, 16)
    loss_fn = lambda out: out.float().pow(2).mean()  # noqa: E731
    # stage 1's add sends its fp32 gradient on to stage 0 and a bf16 copy into its block; stage 0's add has no
    # residual gradient to send (the input needs none), so the copy replaces the gradient there
    for dtype, expected in ((None, [0, 0]), (torch.bfloat16, [0, 256 * 16 * 2])):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            captured = capture(Residual(), (x,))
            nodes = list(captured.compute_nodes())
            first_add = next(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.add.Tensor)
            stage_of = {n.name: int(i > first_add) for i, n in enumerate(nodes)}  # a block and its residual add
            measured = measure_stages(captured, stage_of, 2, loss_fn=loss_fn, repeats=0, hold_outputs=False)
        assert measured.before_first_unpack == expected, (dtype, measured.before_first_unpack)
        assert measured.loss_bytes == 2 * 4  # the fp32 loss and the gradient the backward starts from


def test_steps_run_while_training_state_is_preserved_leave_a_held_gradient_as_it_was():
    """A backward adds into a gradient in place: inside, the parameters hold none, and theirs are put back."""
    model = torch.nn.Linear(4, 2)
    model(torch.ones(3, 4)).sum().backward()
    grad, before = model.weight.grad, model.weight.grad.clone()
    with preserved_training_state(model):
        assert model.weight.grad is None
        model(torch.randn(3, 4)).sum().backward()
    assert model.weight.grad is grad and torch.equal(grad, before)
