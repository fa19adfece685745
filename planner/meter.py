"""Measure memory for real: count the tensor storages alive while a step runs.

:class:`LiveMemoryMeter` is a ``TorchDispatchMode``. Every op output whose storage is new (not shared with an input:
views are not allocations) is counted until Python frees that storage. It sees what autograd saves, what
selective checkpointing caches, gradients and temporaries alike, on any device (on the meta device, what the
tensors would take). Storages that existed before the meter started (parameters, inputs) are not counted: add them
with :func:`storage_bytes`. A ``FakeTensor`` (what ``torch.export`` traces with, when a planned module captures a
new input shape inside the meter) holds nothing and is not counted.

>>> import torch
>>> w = torch.randn(256, 256, requires_grad=True)
>>> with LiveMemoryMeter() as meter:
...     y = (torch.randn(128, 256) @ w).relu().sum()
...     y.backward()
>>> meter.peak_bytes >= 128 * 256 * 4 * 2
True
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .dropout import workspace_bytes

_aten = torch.ops.aten
_IN_PLACE_PROMOTING = frozenset({_aten.add_.Tensor, _aten.sub_.Tensor, _aten.mul_.Tensor, _aten.div_.Tensor})
_PROMOTING = _IN_PLACE_PROMOTING | {_aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor}


def converted_operand_bytes(func, args: tuple) -> int:
    """What a CPU arithmetic op on two tensors of different types holds while it runs, out of a dispatch mode's
    sight: ATen's ``TensorIterator`` converts an operand whose type is not the result's into a temporary copy (on
    the CPU only; CUDA converts as it loads), which lives beside the output until the op returns. So
    ``x.mul(mask.view(torch.uint8))`` (:func:`planner.dropout.apply_mask`) holds the mask converted to ``x``'s
    type and its output; the in-place form, the copy alone. 0 for other ops, same types, 0-d operands.

    >>> import torch
    >>> x, mask = torch.zeros(10), torch.ones(10, dtype=torch.uint8)
    >>> aten = torch.ops.aten
    >>> converted_operand_bytes(aten.mul.Tensor, (x, mask)), converted_operand_bytes(aten.mul_.Tensor, (x, mask))
    (80, 40)
    >>> converted_operand_bytes(aten.mul.Tensor, (x, x)), converted_operand_bytes(aten.mul.Tensor, (x, 2.0))
    (0, 0)
    """
    if func not in _PROMOTING or len(args) < 2:
        return 0
    a, b = args[0], args[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.device.type != "cpu":
        return 0
    dtype = torch.result_type(a, b)
    itemsize = dtype.itemsize
    copies = sum(t.numel() * itemsize for t in (a, b) if t.dtype != dtype and t.dim() > 0)
    if not copies or func in _IN_PLACE_PROMOTING:
        return copies
    return copies + torch.broadcast_shapes(a.shape, b.shape).numel() * itemsize


def hidden_bytes(func, args: tuple) -> int:
    """The most bytes ``func`` holds at once while it runs that a dispatch mode does not see it allocate: the
    dropout ops' own (:func:`planner.dropout.workspace_bytes`) and converted operands
    (:func:`converted_operand_bytes`)."""
    return workspace_bytes(func, args) + converted_operand_bytes(func, args)


def _storage_key(storage: torch.UntypedStorage) -> tuple[int, int]:
    if storage.device.type == "meta":  # meta storages all have data_ptr 0: the storage itself is the identity
        return (storage._cdata, -1)
    return (storage.data_ptr(), storage.nbytes())


def storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold ``tensor``'s data: its own, or for a sparse tensor those of its indices and values
    (a sparse gradient: ``nn.Embedding(sparse=True)``).

    >>> import torch
    >>> [s.nbytes() for s in storages_of(torch.zeros(3))]
    [12]
    >>> sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (5,), check_invariants=True)
    >>> [s.nbytes() for s in storages_of(sparse)]
    [16, 8]
    """
    if tensor.layout is torch.strided:  # first: the meter asks for every tensor every op makes
        return [tensor.untyped_storage()]
    if tensor.layout is torch.sparse_coo:
        return [tensor._indices().untyped_storage(), tensor._values().untyped_storage()]
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [s.untyped_storage() for s in (tensor.crow_indices(), tensor.col_indices(), tensor.values())]
    if tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [s.untyped_storage() for s in (tensor.ccol_indices(), tensor.row_indices(), tensor.values())]
    return [tensor.untyped_storage()]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied tensors count once).

    >>> import torch
    >>> x = torch.zeros(10)
    >>> storage_bytes([x, x[2:], x.view(2, 5)])
    40
    >>> m = torch.empty(10, device="meta")   # no data, but a storage of 40 bytes
    >>> storage_bytes([m, m[2:], torch.empty(10, device="meta")])
    80
    """
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for st in storages_of(t):
                seen[_storage_key(st)] = st.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class Sample:
    """Live bytes at one op's busiest (just after it ran, or while it held what a dispatch mode cannot see it
    allocate: :func:`hidden_bytes`), and the segment it ran in (an index into ``segments``; -1 before any mark)."""

    op: str
    segment: int
    live_bytes: int


@dataclass(frozen=True)
class Release:
    """A labelled storage freed (see :meth:`LiveMemoryMeter.expect`): its label, and the most bytes that were live
    since the segment began or the release before this one in it, up to this one."""

    label: str
    peak_before_bytes: int


@dataclass
class Segment:
    """The part of a run between two marks: memory when it began and the most it reached; the labelled storages
    freed in it, in order (``releases``), and the most bytes live since the last of them (``tail_peak_bytes``)."""

    label: str
    start_bytes: int
    peak_bytes: int
    releases: list[Release] = field(default_factory=list)
    tail_peak_bytes: int = 0


class LiveMemoryMeter(TorchDispatchMode):
    """Counts bytes of storages allocated inside the mode and still alive; tracks the peak and labelled segments.

    With ``record=True`` it also keeps a :class:`Sample` after every op: a per-op memory timeline, whose highest
    sample is the peak.

    >>> import torch
    >>> with LiveMemoryMeter(record=True) as meter:
    ...     meter.mark("forward")
    ...     y = torch.ones(1000).exp()
    ...     meter.mark("backward")
    ...     del y
    ...     z = torch.ones(10)
    >>> [(s.op, meter.segments[s.segment].label, s.live_bytes) for s in meter.samples]
    [('aten.ones.default', 'forward', 4000), ('aten.exp.default', 'forward', 8000), ('aten.ones.default', 'backward', 40)]
    >>> max(s.live_bytes for s in meter.samples) == meter.peak_bytes
    True

    A storage given a label (:meth:`expect`) is reported when it is freed, with the peak before, so that a
    segment's peak can be told apart by what was still alive (``Segment.releases``):

    >>> with LiveMemoryMeter() as meter:
    ...     meter.expect([("x", 4000)])
    ...     x = torch.ones(1000)
    ...     meter.settle()
    ...     meter.mark("backward")
    ...     y = x.exp()
    ...     del x
    ...     z = torch.ones(100)
    >>> meter.segments[0].releases, meter.segments[0].tail_peak_bytes, meter.segments[0].peak_bytes
    ([Release(label='x', peak_before_bytes=8000)], 4400, 8000)

    ``resizable`` returns tensors whose storage is grown and shrunk in place (``untyped_storage().resize_``, which
    no op dispatch sees: FSDP2's unsharded parameters); their current size counts as live at every op.

    >>> held = torch.empty(0)
    >>> with LiveMemoryMeter(resizable=lambda: [held]) as meter:
    ...     _ = held.untyped_storage().resize_(4000)
    ...     y = torch.ones(10)
    ...     _ = held.untyped_storage().resize_(0)
    ...     z = torch.ones(10)
    >>> meter.peak_bytes, meter.live_bytes
    (4040, 80)
    """

    def __init__(self, record: bool = False, resizable: Callable[[], Iterable[torch.Tensor]] | None = None):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.segments: list[Segment] = []
        self.record = record
        self.samples: list[Sample] = []
        self._refs: dict[int, weakref.ref] = {}
        self._sizes: dict[int, int] = {}
        self._labels: dict[int, str] = {}  # labelled storages (see expect): their labels
        self._expected: list[tuple[str | None, int]] | None = None
        self._made: list[tuple[int, int]] | None = None  # storages allocated since expect(): key, bytes
        self._resizable = resizable
        self._resized_bytes = 0  # the resizable storages' bytes, as last counted into live_bytes

    def mark(self, label: str) -> None:
        """Start a new segment (for example, the forward of one stage)."""
        self.segments.append(Segment(label, self.live_bytes, self.live_bytes, tail_peak_bytes=self.live_bytes))

    def expect(self, labels: Sequence[tuple[str | None, int]]) -> None:
        """Label the storages allocated from now until :meth:`settle`, in order, as ``labels`` says (a label or
        None, and the bytes expected), if they match it in number and size: each labelled one is reported when it
        is freed (``Segment.releases``)."""
        self._expected, self._made = list(labels), []

    def settle(self) -> None:
        """Give the storages allocated since :meth:`expect` their labels, where they match what it expected."""
        expected, made = self._expected, self._made
        self._expected = self._made = None
        if expected is None or made is None or len(made) != len(expected) or \
                any(nbytes != size for (_, nbytes), (_, size) in zip(made, expected)):
            return
        for (key, _), (label, _) in zip(made, expected):
            if label is not None and key in self._refs:
                self._labels[key] = label

    def _release(self, key: int, nbytes: int) -> None:
        if self._refs.pop(key, None) is not None:
            self._sizes.pop(key, None)
            self.live_bytes -= nbytes
            label = self._labels.pop(key, None)
            if label is not None and self.segments:
                segment = self.segments[-1]
                segment.releases.append(Release(label, segment.tail_peak_bytes))
                segment.tail_peak_bytes = self.live_bytes

    def _track(self, storage: torch.UntypedStorage, skip: set[int]) -> None:
        key = id(storage)
        if key in self._refs or key in skip:
            return
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self._refs[key] = weakref.ref(storage, lambda _r, k=key, n=nbytes: self._release(k, n))
        if self._made is not None:
            self._made.append((key, nbytes))
        self.live_bytes += nbytes
        self._note_peak()

    def _count_resizable(self) -> set[int]:
        """Count the resizable storages at their size now; forget any this meter tracked as an allocation."""
        if self._resizable is None:
            return set()
        storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in self._resizable()}
        for key in storages.keys() & self._refs.keys():
            self._refs.pop(key)
            self._labels.pop(key, None)
            self.live_bytes -= self._sizes.pop(key)
        now = sum(storages.values())
        self.live_bytes += now - self._resized_bytes
        self._resized_bytes = now
        self._note_peak()
        return set(storages)

    def _note_peak(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if self.segments:
            segment = self.segments[-1]
            segment.peak_bytes = max(segment.peak_bytes, self.live_bytes)
            segment.tail_peak_bytes = max(segment.tail_peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        hidden = hidden_bytes(func, args)  # what the op holds at its busiest, out of this mode's sight
        busiest = self.live_bytes + hidden
        if hidden:
            self.live_bytes += hidden
            self._note_peak()
            self.live_bytes -= hidden
        out = func(*args, **(kwargs or {}))
        resizable = self._count_resizable()
        inputs = {id(s) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for s in storages_of(t)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):  # a fake holds nothing (export's)
                for storage in storages_of(t):
                    if id(storage) not in inputs and storage.nbytes() > 0:
                        self._track(storage, resizable)
        if self.record:
            self.samples.append(Sample(str(func), len(self.segments) - 1, max(self.live_bytes, busiest)))
        return out


def measure_step_peak(step, *persistent: Iterable[torch.Tensor]) -> int:
    """Peak bytes of one call of ``step()``: what it allocates plus the storages of ``persistent`` tensors."""
    fixed = storage_bytes(t for group in persistent for t in group)
    with LiveMemoryMeter() as meter:
        step()
    return fixed + meter.peak_bytes


def device_allocator_peak_bytes(step: Callable[[], object], device_type: str) -> int:
    """Peak bytes the allocator of ``device_type`` holds during ``step()`` beyond what it held before: CUDA's
    ``max_memory_allocated``, else the CPU allocator's profiler events (:func:`allocator_peak_bytes`). Both see
    what ``torch.compile``'s generated code allocates.

    >>> import torch
    >>> w = torch.randn(64, 64, requires_grad=True)
    >>> device_allocator_peak_bytes(lambda: (torch.randn(32, 64) @ w).sum().backward(), "cpu") > 0
    True
    """
    if device_type != "cuda":
        return allocator_peak_bytes(step)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def allocator_peak_bytes(step: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator holds during ``step()`` beyond what it held before, from the memory events of
    ``torch.profiler.profile(profile_memory=True)``.

    Unlike :class:`LiveMemoryMeter`, which sees the ops that reach the dispatcher, it also sees code that
    ``torch.compile`` generated; on eager code the two agree.

    >>> import torch
    >>> w = torch.randn(64, 64, requires_grad=True)
    >>> def step():
    ...     (torch.randn(32, 64) @ w).relu().sum().backward()
    >>> allocator_peak_bytes(step) == measure_step_peak(step)
    True
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
