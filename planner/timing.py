"""Where the times of a profile come from: the wall clock, CUDA events, or the roofline model of a device.

A :class:`Stopwatch` marks points in a run (``stamp()``) and reports the seconds between two marks; profiling runs
the graph ``runs(repeats)`` times and combines the samples of each node or stage with ``combine``:

* :class:`WallStopwatch`: ``time.perf_counter`` on the CPU; one warm-up run, then the fastest run (load on the
  machine only ever adds time).
* :class:`CudaStopwatch`: CUDA events on the current stream, so kernels are timed where they run rather than where
  they are launched; one warm-up run, then the median of the repeats.
* :class:`AnalyticStopwatch`: no clock at all. While it runs, an :class:`AnalyticClock` (a dispatch mode) adds up
  the roofline time (:meth:`~planner.devices.DeviceSpec.op_seconds`) of every kernel the step dispatches, from its
  FLOPs (``torch.utils.flop_counter``'s formulas) and the bytes it reads and writes. Views and allocations launch
  nothing and cost nothing. It works on meta tensors, so a model too large for this machine is timed for a device
  it does not have, and one run is exact.

>>> import torch
>>> from planner.devices import device_spec
>>> stopwatch = AnalyticStopwatch(device_spec("h100"))
>>> a = torch.randn(1024, 1024, device="meta")
>>> with stopwatch:
...     start = stopwatch.stamp()
...     b = (a @ a).relu()
...     end = stopwatch.stamp()
>>> round(stopwatch.seconds(start, end) * 1e6, 1)  # matmul: 2*1024**3 / 67e12 + 5us; relu: 8 MiB / 3.35e12 + 5us
44.6
"""

from __future__ import annotations

import ctypes
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from .devices import DEVICES, DeviceSpec, Precision, device_spec  # noqa: F401 (the doctests use device_spec)
from .errors import PlannerError

_HALF = (torch.float16, torch.bfloat16)
_CONVOLUTIONS = {"convolution", "_convolution", "cudnn_convolution", "convolution_backward",
                 "convolution_overrideable", "_slow_conv2d_forward"}
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_assert_tensor_metadata",
                "lift_fresh", "detach", "alias", "_unsafe_view", "sym_size", "sym_stride", "sym_numel"}


def _writes_an_argument(func) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def launches_kernel(func, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> bool:
    """Whether ``func`` runs a kernel: not a view, an allocation or a metadata op.

    >>> x = torch.empty(4, 4, device="meta")
    >>> launches_kernel(torch.ops.aten.t.default, [x], [x.t()]), launches_kernel(torch.ops.aten.relu.default, [x], [x.relu()])
    (False, True)
    """
    packet = getattr(func, "overloadpacket", None)
    if packet is not None and packet.__name__ in _ALLOCATIONS:
        return False
    if getattr(func, "is_view", False):
        return False
    if outputs and not _writes_an_argument(func):
        storages = {t.untyped_storage()._cdata for t in inputs}
        if all(t.untyped_storage()._cdata in storages for t in outputs):
            return False  # returns (views of) its inputs: reshape-like composites, aliases
    return True


def precision_of(func, inputs: Sequence[torch.Tensor]) -> Precision:
    """The peak an op with FLOPs runs at: half precision on 16-bit inputs, TF32 on float32 where torch allows it.

    >>> precision_of(torch.ops.aten.mm.default, [torch.empty(2, 2, dtype=torch.bfloat16, device="meta")])
    <Precision.HALF: 'bf16/fp16'>
    """
    floating = [t.dtype for t in inputs if t.is_floating_point()]
    if any(d in _HALF for d in floating):
        return Precision.HALF
    packet = getattr(func, "overloadpacket", None)
    is_conv = packet is not None and packet.__name__ in _CONVOLUTIONS
    tf32 = torch.backends.cudnn.allow_tf32 if is_conv else torch.backends.cuda.matmul.allow_tf32
    return Precision.TF32 if tf32 else Precision.FP32


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one dispatched op by ``torch.utils.flop_counter``'s formulas (0 for ops it has none for)."""
    formula = flop_registry.get(getattr(func, "overloadpacket", None))
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def _tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


class AnalyticClock(TorchDispatchMode):
    """Adds up the roofline time on ``device`` of every kernel dispatched while it is active, in ``seconds``."""

    def __init__(self, device: DeviceSpec):
        super().__init__()
        self.device = device
        self.seconds = 0.0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if launches_kernel(func, inputs, outputs):
            flops = op_flops(func, args, kwargs, out)
            precision = precision_of(func, inputs) if flops else Precision.FP32
            self.seconds += self.device.op_seconds(flops, _tensor_bytes(inputs) + _tensor_bytes(outputs), precision)
            self.kernels += 1
        return out


class Stopwatch:
    """Marks points in a run and measures between them; ``with stopwatch:`` around the runs it times."""

    name = "wall_clock"
    warmup = 1

    def __enter__(self) -> "Stopwatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def stamp(self) -> Any:
        raise NotImplementedError

    def seconds(self, start: Any, end: Any) -> float:
        raise NotImplementedError

    def runs(self, repeats: int) -> list[bool]:
        """Whether each run counts (False for warm-up runs): ``warmup`` runs, then ``repeats`` (one run when < 1)."""
        return [False] * self.warmup + [True] * repeats if repeats >= 1 else [True]

    def combine(self, samples: Sequence[float]) -> float:
        return min(samples)


class WallStopwatch(Stopwatch):
    """``time.perf_counter``; the fastest of the repeats.

    >>> watch = WallStopwatch()
    >>> watch.runs(2), watch.combine([0.3, 0.2, 0.4])
    ([False, True, True], 0.2)
    """

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaStopwatch(Stopwatch):
    """CUDA events on the current stream; the median of the repeats (GPU timings are steady, outliers are not).

    >>> CudaStopwatch.combine(CudaStopwatch, [3.0, 1.0, 2.0])
    2.0
    """

    name = "cuda_events"

    def stamp(self) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: "torch.cuda.Event", end: "torch.cuda.Event") -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def combine(self, samples: Sequence[float]) -> float:
        return statistics.median(samples)


class AnalyticStopwatch(Stopwatch):
    """The roofline time on ``device`` of what ran between two stamps; one run, no warm-up (it is exact)."""

    warmup = 0

    def __init__(self, device: DeviceSpec):
        self.device = device
        self.name = f"analytic:{device.name}"
        self.clock = AnalyticClock(device)

    def __enter__(self) -> "AnalyticStopwatch":
        self.clock.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.clock.__exit__(*exc)

    def stamp(self) -> float:
        return self.clock.seconds

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def runs(self, repeats: int) -> list[bool]:
        return [True]


def stopwatch_for(device_type: str, device: DeviceSpec | None) -> Stopwatch:
    """The stopwatch for tensors on ``device_type`` ("cpu", "cuda", "meta"), analytic when ``device`` is given.

    >>> type(stopwatch_for("cpu", None)).__name__, stopwatch_for("meta", device_spec("h100")).name
    ('WallStopwatch', 'analytic:h100')
    """
    if device is not None:
        return AnalyticStopwatch(device)
    if device_type == "meta":
        raise PlannerError("a model on the meta device has no run time to measure",
                           hint=f"pass device= with the GPU to plan for ({', '.join(sorted(DEVICES))}), "
                                f"e.g. planner.plan(model, budget='80GB', example_inputs=..., device='h100')")
    if device_type == "cuda":
        return CudaStopwatch()
    return WallStopwatch()


# Whole training steps, timed against each other. A machine's speed drifts (other work, frequency, caches), so
# steps are compared within rounds that run each of them once, and the statistics are taken over the rounds.

def interleaved_rounds(steps: dict[Any, Callable[[], Any]], rounds: int, *,
                       enough: Callable[[dict[Any, list[float]]], bool] | None = None, max_rounds: int = 0,
                       max_seconds: float = float("inf"), seed: int = 0) -> dict[Any, list[float]]:
    """Seconds of each step in each round: one warm-up round in the given order, then ``rounds`` rounds that run
    every step once, each in an order drawn afresh (from ``seed``), so that no step is always timed right after the
    same other one.

    What ran just before a step moves its time: rotated instead (each round starting one step later, so each step
    but the first followed the same one), test-size GPT-2's plan at a quarter of the way from the smallest peak to
    eager's, always timed after the checkpoint-everything plan, measured 26.7% over the captured graph (three runs
    of 30 rounds); in drawn orders, 30.5%; timed as training runs it, right after a step of its own, 29.6%. The
    plan at half the way measured 18.5%, 20.7% and 20.1%.

    When ``enough`` is given, more rounds follow while ``enough(samples)`` is false, up to ``max_rounds`` in all,
    within ``max_seconds`` (the warm-up included).

    >>> samples = interleaved_rounds({"fast": lambda: None, "slow": lambda: time.sleep(0.002)}, 3)
    >>> [len(s) for s in samples.values()], max(samples["fast"]) < 0.002 <= min(samples["slow"])
    ([3, 3], True)
    >>> more = interleaved_rounds({"a": lambda: None}, 2, enough=lambda s: len(s["a"]) >= 5, max_rounds=9)
    >>> len(more["a"])
    5
    """
    samples: dict[Any, list[float]] = {name: [] for name in steps}
    names = list(steps)
    order = random.Random(seed)
    started = time.perf_counter()
    for round_ in range(max(rounds, max_rounds if enough else 0) + 1):
        if round_ > rounds and (enough(samples) or time.perf_counter() - started > max_seconds):
            break
        for name in names:
            start = time.perf_counter()
            steps[name]()
            if round_:  # round 0 warms up
                samples[name].append(time.perf_counter() - start)
        order.shuffle(names)
    return samples


def paired_ratios(samples: dict[Any, list[float]], name: Any, baseline: Any) -> list[float]:
    """``name``'s step time over ``baseline``'s in the same round, round by round.

    >>> paired_ratios({"plan": [1.2, 2.4], "eager": [1.0, 2.0]}, "plan", "eager")
    [1.2, 1.2]
    """
    return [a / b for a, b in zip(samples[name], samples[baseline])]


def median_standard_error(samples: Sequence[float]) -> float:
    """The standard error of ``samples``' median, from their interquartile range (robust to the odd slow run):
    1.2533 σ/√n with σ = IQR/1.349; infinite below three samples.

    >>> round(median_standard_error([1.0, 2.0, 3.0, 4.0, 5.0]), 3)
    1.246
    """
    if len(samples) < 3:
        return float("inf")
    quartiles = statistics.quantiles(samples, n=4)
    return 1.2533 * (quartiles[2] - quartiles[0]) / 1.349 / len(samples) ** 0.5


@dataclass(frozen=True)
class Estimate:
    """A median over rounds and its standard error (:func:`median_standard_error`).

    >>> estimate = Estimate.of([1.1, 1.2, 1.0, 1.1])
    >>> estimate.median, round(estimate.standard_error, 4), estimate.clearly_above(1.0)
    (1.1, 0.0697, False)
    """

    median: float
    standard_error: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Estimate":
        return cls(round(statistics.median(samples), 12), median_standard_error(samples))

    def less(self, value: float) -> "Estimate":
        """The same measurement with ``value`` taken off its median (a known part of what it measured)."""
        return Estimate(self.median - value, self.standard_error)

    def clearly_above(self, value: float) -> bool:
        """Above ``value`` by more than two standard errors."""
        return self.median - 2 * self.standard_error > value

    def clearly_below(self, value: float) -> bool:
        """Below ``value`` by more than two standard errors."""
        return self.median + 2 * self.standard_error < value


# glibc's mallopt parameters
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep what a step frees for the next step, as PyTorch's CUDA caching allocator does:
    never give the top of the heap back to the kernel, and never map a large block by itself (it would be unmapped
    when freed). Otherwise the next step faults the memory in again, a zeroed page at a time, and a step pays in
    time for how far its peak rises above what the last step left. Returns whether it took (False where the C
    library is not glibc). It applies to the whole process, from the next allocation on.

    Left to glibc's defaults, the demo-size Llama's eager step (the captured graph, one thread) took 28,000 page
    faults a step (110 MiB) and 1.10 s, while its half-budget plan and its checkpoint-everything plan took none:
    eager ran about 15% slower than it computes, which shrank every overhead measured against it and, varying from
    step to step, tripled the spread of the ratios. Kept, eager took no faults and 0.93-0.95 s. In the fidelity
    report (test size, 15 rounds), the standard errors of the overheads fell from 1.4-7.0 points to 0.2-2.0.

    The benchmarks call it (``--heap kept``, their default); the planner never does, as it would change how the
    caller's process uses memory.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(M_MMAP_MAX, 0))
