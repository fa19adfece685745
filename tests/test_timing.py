import subprocess
import sys
import textwrap

import pytest
import torch

from planner.devices import DeviceSpec, Precision, device_spec
from planner.errors import PlannerError
from planner.timing import (AnalyticClock, AnalyticStopwatch, CudaStopwatch, Estimate, WallStopwatch,
                            interleaved_rounds, launches_kernel, median_standard_error, paired_ratios, precision_of,
                            stopwatch_for)

TOY = DeviceSpec("toy", fp32_flops=1e12, tf32_flops=2e12, half_flops=4e12, memory_bandwidth=1e12,
                 memory_bytes=2**30, launch_seconds=1e-6)


def _clocked(fn):
    clock = AnalyticClock(TOY)
    with clock:
        fn()
    return clock


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_matmul_costs_its_flops_at_peak(device):
    a = torch.empty(512, 1024, device=device)
    b = torch.empty(1024, 256, device=device)
    clock = _clocked(lambda: a @ b)
    assert clock.kernels == 1
    assert clock.seconds == pytest.approx(2 * 512 * 1024 * 256 / 1e12 + 1e-6)
    half = _clocked(lambda: a.bfloat16() @ b.bfloat16())  # two conversions (memory bound) and a 4x faster matmul
    convert = (512 * 1024 + 1024 * 256) * (4 + 2) / 1e12 + 2e-6
    assert half.seconds == pytest.approx(2 * 512 * 1024 * 256 / 4e12 + 1e-6 + convert)


def test_memory_bound_ops_cost_bytes_read_and_written_and_views_cost_nothing():
    x = torch.empty(1000, 1000, device="meta")
    clock = _clocked(lambda: (x.t(), x.reshape(-1)[:10], x.view(10, -1), x.detach(), torch.empty_like(x)))
    assert clock.kernels == 0 and clock.seconds == 0.0
    assert _clocked(lambda: x.t().reshape(-1)).kernels == 1  # a reshape that must copy is a kernel
    clock = _clocked(lambda: x + x)
    assert clock.seconds == pytest.approx(8e6 / 1e12 + 1e-6)  # reads x once (the same tensor), writes 4 MB
    y = torch.empty(1000, 1000, device="meta")
    assert _clocked(lambda: x.add_(y)).seconds == pytest.approx(12e6 / 1e12 + 1e-6)


def test_precision_follows_dtype_and_torch_tf32_switches():
    mm = torch.ops.aten.mm.default
    x32, x16 = torch.empty(2, 2, device="meta"), torch.empty(2, 2, device="meta", dtype=torch.float16)
    assert precision_of(mm, [x16]) is Precision.HALF
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert precision_of(mm, [x32]) is Precision.FP32
        torch.backends.cuda.matmul.allow_tf32 = True
        assert precision_of(mm, [x32]) is Precision.TF32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert launches_kernel(torch.ops.aten.empty.memory_format, [], [x32]) is False


def test_analytic_stopwatch_measures_between_stamps_in_one_run():
    watch = AnalyticStopwatch(TOY)
    a = torch.empty(100, 100, device="meta")
    with watch:
        t0 = watch.stamp()
        a.exp()
        t1 = watch.stamp()
        a @ a
        t2 = watch.stamp()
    assert watch.seconds(t0, t1) == pytest.approx(8e4 / 1e12 + 1e-6)
    assert watch.seconds(t1, t2) == pytest.approx(2e6 / 1e12 + 1e-6)
    assert watch.runs(5) == [True] and watch.name == "analytic:toy"


def test_stopwatch_choice():
    assert isinstance(stopwatch_for("cpu", None), WallStopwatch)
    assert isinstance(stopwatch_for("cuda", None), CudaStopwatch)
    assert isinstance(stopwatch_for("cpu", device_spec("a100")), AnalyticStopwatch)
    with pytest.raises(PlannerError, match="pass device="):
        stopwatch_for("meta", None)
    wall = WallStopwatch()
    assert wall.runs(3) == [False, True, True, True] and wall.runs(0) == [True]
    assert CudaStopwatch().combine([5.0, 1.0, 2.0, 100.0, 3.0]) == 3.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_time_kernels_where_they_run():
    watch = CudaStopwatch()
    a = torch.randn(4096, 4096, device="cuda")
    a @ a  # warm-up
    start = watch.stamp()
    for _ in range(10):
        a @ a
    end = watch.stamp()
    seconds = watch.seconds(start, end)
    assert 0 < seconds < 10
    flops = 10 * 2 * 4096**3
    assert flops / seconds < 2e15  # no GPU runs fp32 this fast: the events saw the kernels, not their launch


def _recorder(log: list, name: str):
    return lambda: log.append(name)


def test_interleaved_rounds_warm_up_once_then_draw_each_rounds_order():
    log: list[str] = []
    samples = interleaved_rounds({k: _recorder(log, k) for k in "abcd"}, 12)
    assert [len(s) for s in samples.values()] == [12] * 4
    rounds = ["".join(log[i:i + 4]) for i in range(0, len(log), 4)]
    assert rounds[0] == "abcd" and all(sorted(r) == list("abcd") for r in rounds)  # round 0 warms up in order
    assert len(set(rounds[1:])) > 3
    followed = {(a, b) for a, b in zip(log, log[1:]) if a != b}
    assert len(followed) == 12  # every step timed right after every other one at some point
    again: list[str] = []
    interleaved_rounds({k: _recorder(again, k) for k in "abcd"}, 12)
    assert again == log  # the same orders each time (a seed), so a report can be run again as it was


def test_interleaved_rounds_add_rounds_until_enough_or_out_of_time():
    log: list[str] = []
    steps = {"a": _recorder(log, "a")}
    assert len(interleaved_rounds(steps, 2, enough=lambda s: len(s["a"]) >= 6, max_rounds=10)["a"]) == 6
    assert len(interleaved_rounds(steps, 2, enough=lambda s: False, max_rounds=4)["a"]) == 4
    assert len(interleaved_rounds(steps, 2, enough=lambda s: False, max_rounds=40, max_seconds=0.0)["a"]) == 2
    assert len(interleaved_rounds(steps, 2, max_rounds=40)["a"]) == 2  # no judge of enough: the rounds asked for


def test_paired_ratios_pair_rounds():
    assert paired_ratios({"p": [2.0, 3.0], "b": [1.0, 2.0]}, "p", "b") == [2.0, 1.5]


def test_median_standard_error_needs_three_samples_and_falls_with_more():
    assert median_standard_error([1.0, 2.0]) == float("inf")
    few = median_standard_error([1.0, 2.0, 3.0, 4.0])
    assert 0 < median_standard_error([1.0, 2.0, 3.0, 4.0] * 4) < few


def test_estimate_is_clearly_above_or_below_only_beyond_two_standard_errors():
    estimate = Estimate(1.1, 0.04)
    assert estimate.clearly_above(1.0) and estimate.clearly_below(1.2) and not estimate.clearly_below(1.15)
    assert not Estimate(1.1, 0.06).clearly_above(1.0)
    assert Estimate.of([1.0, 1.0, 1.0, 1.0]) == Estimate(1.0, 0.0)
    assert Estimate.of([1.0, 2.0]).standard_error == float("inf")


FAULTS_OF_A_SIXTH_STEP = textwrap.dedent("""
    import resource, sys, torch
    from planner.timing import keep_freed_memory
    if sys.argv[1] == "kept":
        assert keep_freed_memory()
    def step():  # a peak of 64 MiB, freed at the end
        x = torch.ones(16 * 2**20)
        del x
    for _ in range(5):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_kept_freed_memory_spares_later_steps_their_page_faults():
    """With malloc's defaults every 64 MiB step hands its memory back and faults all of it in again (16,384 pages
    of 4 KiB); kept, the heap has grown to the step's peak within a few steps (placement decides: two or three
    alone, four with the thread HiGHS starts when PuLP imports it, so the fourth step faulted in 4 of 10 runs), and
    later steps reuse it: the sixth faulted in none of 10."""
    def faults(heap):
        done = subprocess.run([sys.executable, "-c", FAULTS_OF_A_SIXTH_STEP, heap], capture_output=True, text=True,
                              check=True)
        return int(done.stdout.split()[-1])

    assert faults("glibc") >= 16_000
    assert faults("kept") < 1_000
