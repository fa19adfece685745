import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from planner.meter import LiveMemoryMeter, measure_step_peak, storage_bytes

MiB = 2**20


def test_counts_new_storages_and_forgets_freed_ones():
    with LiveMemoryMeter() as meter:
        a = torch.empty(MiB // 4)  # 1 MiB of float32
        b = torch.empty(MiB // 4)
        assert meter.live_bytes == 2 * MiB
        del a
        assert meter.live_bytes == MiB
        del b
    assert meter.live_bytes == 0 and meter.peak_bytes == 2 * MiB


def test_views_and_in_place_ops_are_not_allocations():
    x = torch.zeros(1024)
    with LiveMemoryMeter() as meter:
        v = x.view(32, 32).t()[1:]
        x.add_(1)
        x.relu_()
        del v
    assert meter.peak_bytes == 0


def test_sees_what_selective_checkpointing_caches():
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(512, 256)

    def body(x):
        return torch.relu(x @ w) @ w

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def after_forward(context_fn):
        with LiveMemoryMeter() as meter:
            out = checkpoint(body, x, use_reentrant=False, context_fn=context_fn)
            live = meter.live_bytes
        del out
        return live

    from torch.utils.checkpoint import noop_context_fn
    plain = after_forward(noop_context_fn)
    cached = after_forward(functools.partial(create_selective_checkpoint_contexts, policy))
    assert cached - plain >= 512 * 256 * 4  # the first mm output is cached, invisible to autograd's saved-tensor hooks


def test_segments_record_the_peak_between_marks():
    with LiveMemoryMeter() as meter:
        meter.mark("one")
        a = torch.empty(1000)
        del a
        meter.mark("two")
        b = torch.empty(10)
    assert [(s.label, s.peak_bytes) for s in meter.segments] == [("one", 4000), ("two", 40)]
    del b


def test_labelled_storages_report_when_they_are_freed_with_the_peak_before():
    with LiveMemoryMeter() as meter:
        meter.expect([("a", 4000), (None, 400), ("b", 40)])
        a, scratch, b = torch.empty(1000), torch.empty(100), torch.empty(10)
        meter.settle()
        meter.mark("backward")
        view = a[10:]  # a view of a keeps its storage alive
        del a, scratch
        c = torch.empty(2000)
        del view
        del b, c
    releases = meter.segments[0].releases
    assert [(r.label, r.peak_before_bytes) for r in releases] == [("a", 12040), ("b", 8040)]
    assert meter.segments[0].tail_peak_bytes == 8000 and meter.segments[0].peak_bytes == 12040


def test_storages_that_do_not_match_what_was_expected_get_no_labels():
    with LiveMemoryMeter() as meter:
        meter.expect([("a", 4000)])
        a, b = torch.empty(1000), torch.empty(10)  # one storage more than expected
        meter.settle()
        meter.expect([("c", 40)])
        c = torch.empty(1000)  # another size
        meter.settle()
        meter.mark("backward")
        del a, b, c
    assert meter.segments[0].releases == []


def test_backward_allocations_are_seen():
    w = torch.randn(64, 64, requires_grad=True)
    peak = measure_step_peak(lambda: (torch.randn(128, 64) @ w).sum().backward(), [w])
    assert peak >= storage_bytes([w]) * 2  # the weight and its gradient
    w.grad = None


def test_sparse_tensors_count_their_indices_and_values():
    """``nn.Embedding(sparse=True)`` makes its gradient a sparse tensor, which has no storage of its own: the meter
    raised ``NotImplementedError`` on it."""
    weight = torch.randn(1000, 16, requires_grad=True)
    ids = torch.randint(0, 1000, (64,))
    with LiveMemoryMeter() as meter:
        torch.nn.functional.embedding(ids, weight, sparse=True).pow(2).sum().backward()
        held = meter.live_bytes
    assert weight.grad.is_sparse and held == storage_bytes([weight.grad]) == 64 * 16 * 4 + 64 * 8
    assert storage_bytes([weight.grad, weight.grad._values()]) == held  # its values count once


def test_storage_bytes_counts_shared_storage_once():
    x = torch.zeros(100)
    assert storage_bytes([x, x.view(10, 10), x[5:], torch.zeros(3)]) == 400 + 12


def test_a_recorded_sample_holds_what_its_op_held_out_of_sight():
    """A mixed-type product converts its operand beside its output (``converted_operand_bytes``): the op's sample
    is taken at that moment, so a timeline's highest sample is the meter's peak (a timeline of T5's backward had
    read up to 196 KB under the peak the calibration measured)."""
    with LiveMemoryMeter(record=True) as meter:
        x, mask = torch.zeros(100), torch.ones(100, dtype=torch.uint8)
        x.mul(mask)
    assert meter.samples[-1].live_bytes == meter.peak_bytes == 400 + 100 + 400 + 400  # x, mask, converted, output


def test_fake_tensors_hold_nothing_and_meta_tensors_count_what_they_would_take():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with LiveMemoryMeter() as meter, FakeTensorMode() as fake:
        big = fake.from_tensor(torch.empty(256, 256)) * 2  # torch.export traces a model so
        del big
    assert meter.peak_bytes == 0
    weight = torch.empty(256, 256, device="meta")
    with LiveMemoryMeter() as meter:
        doubled = weight * 2  # how a model on the meta device is profiled
    assert meter.peak_bytes == 256 * 256 * 4 and doubled.device.type == "meta"
