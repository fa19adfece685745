"""Profile a captured graph: what every node allocates, reads and leaves for the backward, its FLOPs and its time.

:class:`ProfilingInterpreter` is an ``fx.Interpreter`` (in the manner of torch.fx's ``ShapeProp``) that runs one
training forward with real tensors and writes a :class:`NodeProfile` into ``node.meta["planner"]``. Storages are
identified by object (views share one), so a tensor saved by several ops or read through views counts once.

:func:`measure_stages` then runs whole training steps with stage markers: it returns, per stage, the measured peak of
live memory during its forward and its backward (from :class:`~planner.meter.LiveMemoryMeter`) and its backward time.

>>> import torch
>>> from planner.capture import capture
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
>>> captured = capture(model, (torch.randn(4, 8),))
>>> profile = profile_graph(captured, repeats=1)
>>> [(p.name, p.created_bytes, p.flops) for p in profile.nodes]
[('linear', 512, 2048), ('relu', 512, 0), ('linear_1', 128, 2048)]
>>> profile.nodes[1].saved == {profile.nodes[1].created[0].key}   # relu saves its output
True
"""

from __future__ import annotations

from contextlib import contextmanager
import dataclasses
import statistics
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from .capture import CapturedGraph, casts_uncached, flat_call_args, module_path, outside_autocast, written_inputs
from .meter import LiveMemoryMeter, Release, Segment, hidden_bytes, storage_bytes, storages_of
from .timing import Estimate, Stopwatch, WallStopwatch, interleaved_rounds, median_standard_error

Kernels = dict  # graph target -> what to call instead while profiling (see planner.meta.target_kernels)


@dataclass(frozen=True)
class StorageRecord:
    """A storage a node allocated: its id within the profile, its size, and whether it outlived the node."""

    key: int
    nbytes: int
    survives: bool
    requires_grad: bool = False


@dataclass(frozen=True)
class NodeProfile:
    """What one node does, measured."""

    name: str
    module_path: str
    seconds: float
    flops: int
    created: tuple[StorageRecord, ...]
    reads: frozenset[int]
    saved: frozenset[int]
    param_reads: frozenset[str]
    output_is_view: bool
    in_backward: bool = True  # some output's grad_fn is reachable from the graph's outputs (see _backward_nodes)
    writes: frozenset[int] = frozenset()  # storages it writes in place (by its ATen schema), among those it reads
    busiest_bytes: int | None = None  # the most bytes of its own storages alive at once while it ran (None: unknown)
    # an op inside it wrote in place to a storage it created (selective checkpointing cannot cache such a node: it
    # keeps the storage as the first op left it, and refuses the write after)
    mutates_created: bool = False
    # how many of ``created`` it had made when it last saved a tensor for the backward (autograd saves an op's inputs
    # before the op runs, its outputs after): what a re-run stopped at this node has made of it. None when it saved
    # nothing, parameters and inputs included, which ``saved`` leaves out (or when unknown: a profile built by hand)
    made_by_last_save: int | None = None

    @property
    def created_bytes(self) -> int:
        return sum(s.nbytes for s in self.created)

    @property
    def transient_bytes(self) -> int:
        return sum(s.nbytes for s in self.created if not s.survives)


@dataclass(frozen=True)
class GraphProfile:
    """Profiles of all computing nodes in order, plus what the graph holds from outside."""

    nodes: tuple[NodeProfile, ...]
    output_keys: frozenset[int]
    param_grad_bytes: dict[str, int]
    fixed_bytes: int

    def node(self, name: str) -> NodeProfile:
        return next(n for n in self.nodes if n.name == name)


class _StorageTracker(TorchDispatchMode):
    """Gives every storage allocated inside it a stable key while it lives."""

    def __init__(self):
        super().__init__()
        self.keys: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.created: list[int] = []
        self.written: set[int] = set()  # keys of storages ops wrote in place (by their ATen schema)
        self._refs: dict[int, weakref.ref] = {}
        self._next = 0
        self.live_bytes = 0  # of the storages it tracks
        self.high_water = 0  # of live_bytes since the last mark()

    def mark(self) -> int:
        """Restart the high-water mark from the bytes alive now, and return them."""
        self.high_water = self.live_bytes
        return self.live_bytes

    def key_of(self, tensor: torch.Tensor) -> int | None:
        return self.keys.get(id(tensor.untyped_storage()))

    def alive(self, key: int) -> bool:
        return any(k == key for k in self.keys.values())

    def _forget(self, storage_id: int) -> None:
        key = self.keys.pop(storage_id, None)
        if key is not None:
            self.live_bytes -= self.sizes[key]
        self._refs.pop(storage_id, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.high_water = max(self.high_water, self.live_bytes + hidden_bytes(func, args))
        out = func(*args, **(kwargs or {}))
        written = tree_leaves(written_inputs(func, args, kwargs or {}))
        keys = (self.key_of(t) for t in written if isinstance(t, torch.Tensor))
        self.written.update(k for k in keys if k is not None)
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                sid = id(storage)
                if sid in inputs or sid in self.keys or storage.nbytes() == 0:
                    continue
                self.keys[sid] = self._next
                self.sizes[self._next] = storage.nbytes()
                self._refs[sid] = weakref.ref(storage, lambda _r, s=sid: self._forget(s))
                self.created.append(self._next)
                self._next += 1
                self.live_bytes += storage.nbytes()
                self.high_water = max(self.high_water, self.live_bytes)
        return out


class FreeingInterpreter(fx.Interpreter):
    """An ``fx.Interpreter`` that frees a node's value right after it runs when no node reads it, as the code a
    ``GraphModule`` generates does (``Interpreter`` keeps such values until the run ends). Unread nodes are
    common in exported graphs: Hugging Face's BART builds a view of its scaled embeddings and mask ranges nothing
    reads; kept, they held 33 KB through a measured step that the planned module does not hold, which the
    calibration took for stage workspace (a plan checkpointing BART's encoder was predicted 2-3% over)."""

    def __init__(self, gm: fx.GraphModule, *args: Any, **kwargs: Any):
        super().__init__(gm, *args, **kwargs)
        if self.garbage_collect_values:
            for node in self.graph.nodes:
                if not node.users and node.op not in ("placeholder", "output"):
                    self.user_to_last_uses.setdefault(node, []).append(node)


class ProfilingInterpreter(FreeingInterpreter):
    """Runs the graph once, recording per node allocations, reads, saved tensors and FLOPs into ``node.meta``."""

    def __init__(self, gm: fx.GraphModule, param_storages: dict[int, str], kernels: Kernels | None = None):
        super().__init__(gm)
        self.param_storages = param_storages
        self.kernels = kernels or {}
        self.tracker = _StorageTracker()
        self.profiles: list[NodeProfile] = []
        self.grad_fns: dict[str, list[Any]] = {}  # per node, the grad_fns of its outputs (held until the end)

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        in_tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        saved: set[int] = set()
        packed = []

        def pack(t: torch.Tensor):
            key = self.tracker.key_of(t)
            if key is not None:
                saved.add(key)
            packed.append(len(self.tracker.created) - start)
            # not t itself: an op that saves its own output would hold it through its grad_fn, a cycle through
            # autograd that gc cannot see, which kept a step's saved activations alive after planning (on an
            # H200, GPT-2's eager step measured 25.4 GiB where 13.7 were predicted; the extra was this)
            return t.detach()

        start = len(self.tracker.created)
        alive_before = self.tracker.mark()
        self.tracker.written = set()
        flop_counter = FlopCounterMode(display=False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), flop_counter, self.tracker:
            out = self.kernels.get(n.target, n.target)(*args, **kwargs)
        new_keys = self.tracker.created[start:]
        alive = set(self.tracker.keys.values())
        differentiable = {self.tracker.key_of(t) for t in tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.requires_grad}
        created = tuple(StorageRecord(k, self.tracker.sizes[k], k in alive, k in differentiable) for k in new_keys)
        reads = frozenset(k for k in (self.tracker.key_of(t) for t in in_tensors) if k is not None)
        params = frozenset(self.param_storages[id(t.untyped_storage())] for t in in_tensors
                           if id(t.untyped_storage()) in self.param_storages)
        out_tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_ids = {id(t.untyped_storage()) for t in in_tensors}
        output_is_view = bool(out_tensors) and all(id(t.untyped_storage()) in in_ids for t in out_tensors)
        written = {self.tracker.key_of(t) for t in tree_leaves(written_inputs(n.target, args, kwargs))
                   if isinstance(t, torch.Tensor)}
        profile = NodeProfile(n.name, module_path(n), 0.0, flop_counter.get_total_flops(), created, reads,
                              frozenset(saved), params, output_is_view, writes=frozenset(written & reads),
                              busiest_bytes=self.tracker.high_water - alive_before,
                              mutates_created=bool(self.tracker.written.intersection(new_keys)),
                              made_by_last_save=packed[-1] if packed else None)
        n.meta["planner"] = profile
        self.profiles.append(profile)
        self.grad_fns[n.name] = [t.grad_fn for t in out_tensors if t.grad_fn is not None]
        return out


class _TimingInterpreter(FreeingInterpreter):
    def __init__(self, gm: fx.GraphModule, stopwatch: Stopwatch, kernels: Kernels | None = None):
        super().__init__(gm)
        self.stopwatch = stopwatch
        self.kernels = kernels or {}
        self.stamps: dict[str, tuple[Any, Any]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        start = self.stopwatch.stamp()
        out = self.kernels.get(n.target, n.target)(*args, **kwargs)
        self.stamps[n.name] = (start, self.stopwatch.stamp())
        return out

    def seconds(self) -> dict[str, float]:
        return {name: self.stopwatch.seconds(a, b) for name, (a, b) in self.stamps.items()}


def _backward_nodes(interp: ProfilingInterpreter, outputs: Any) -> set[str]:
    """Names of the nodes whose backward can run: an output's grad_fn is reachable from the graph's outputs.

    A ``torch.no_grad`` block inside forward cuts the autograd graph: what ran before it and feeds only the block
    (the block itself too) never gets a gradient, so what it saves dies with the forward's last reference to it,
    and the parameters it reads get no gradient. Counting those tensors as held until their stage's backward
    made the eager step look bigger than it is, which hid the real backward workspace of later stages
    (``calibrate`` subtracts the held tensors from the measured peak).
    """
    seen: set[Any] = set()
    todo = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return {name for name, fns in interp.grad_fns.items() if any(fn in seen for fn in fns)}


def _param_storages(gm: fx.GraphModule) -> tuple[dict[int, str], dict[str, int]]:
    storages: dict[int, str] = {}
    grad_bytes: dict[str, int] = {}
    for name, p in gm.named_parameters(remove_duplicate=True):
        sid = id(p.untyped_storage())
        if sid not in storages:
            storages[sid] = name
            if p.requires_grad:
                grad_bytes[name] = p.untyped_storage().nbytes()
    return storages, grad_bytes


@contextmanager
def preserved_training_state(gm: fx.GraphModule) -> Iterator[None]:
    """Profiling runs leave no trace: RNG state, buffers (BatchNorm statistics) and ``.grad`` are restored. The
    parameters run without their gradients meanwhile: a backward adds into a gradient in place, so putting the
    tensor back did not undo it, and a plan made between the micro-batches of gradient accumulation (Hugging Face
    GPT-2 under ``Trainer`` with ``gradient_accumulation_steps=2``) changed every accumulated gradient, until
    2026-12-07."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
    grads = {p: p.grad for p in gm.parameters()}
    for p in grads:
        p.grad = None
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with torch.no_grad():
            for name, b in gm.named_buffers():
                b.copy_(buffers[name])
        for p, g in grads.items():
            p.grad = g


def sparse_gradient_bytes(gm: fx.GraphModule, flat_args: Sequence[Any]) -> dict[str, int]:
    """Per parameter of ``gm`` whose ``.grad`` is sparse (an ``nn.Embedding(sparse=True)``'s, after a backward):
    the bytes its storages hold beyond the fixed tensors (:func:`fixed_tensors`): a dense gradient's size says
    nothing of it. An embedding's sparse gradient holds one row per id looked up (its values may be the gradient
    that reached the lookup, kept) and the ids as 64-bit indices (they may view the input).

    >>> import torch
    >>> gm = fx.symbolic_trace(torch.nn.Embedding(1000, 8, sparse=True))
    >>> ids = torch.tensor([[1, 2, 3, 1]])
    >>> gm(ids).sum().backward()
    >>> sparse_gradient_bytes(gm, [ids])  # 4 rows of 8 floats (128 bytes) and 4 indices (32)
    {'weight': 160}
    """
    fixed = {id(s) for t in fixed_tensors(gm, flat_args) for s in storages_of(t)}
    sizes = {}
    for name, p in gm.named_parameters():
        if p.grad is not None and p.grad.layout is not torch.strided:
            sizes[name] = sum(s.nbytes() for s in {id(s): s for s in storages_of(p.grad)}.values()
                              if id(s) not in fixed)
    return sizes


def annotated(gm: fx.GraphModule, profile: GraphProfile) -> GraphProfile:
    """``profile`` (of a graph with the same nodes) written into ``gm``'s nodes' ``meta["planner"]``, as
    :func:`profile_graph` writes it; returns it."""
    by_name = {p.name: p for p in profile.nodes}
    for n in gm.graph.nodes:
        if n.name in by_name:
            n.meta["planner"] = by_name[n.name]
    return profile


def fixed_tensors(gm: fx.GraphModule, flat_args: Sequence[Any]) -> list[torch.Tensor]:
    """Tensors alive throughout a step that the graph does not allocate: parameters, buffers, inputs."""
    tensors = list(gm.parameters()) + list(gm.buffers())
    return tensors + [t for t in flat_args if isinstance(t, torch.Tensor)]


def profile_graph(captured: CapturedGraph, *, repeats: int = 3, stopwatch: Stopwatch | None = None,
                  kernels: Kernels | None = None) -> GraphProfile:
    """Run the captured graph once to record storages and saved tensors, then time its nodes.

    ``stopwatch`` (default :class:`~planner.timing.WallStopwatch`) says how many runs time the nodes and how their
    samples combine (the fastest of ``repeats`` after a warm-up on the CPU, the median of CUDA events, one run of
    the roofline model); ``kernels`` replaces graph targets while profiling (:func:`planner.meta.target_kernels`).
    """
    gm = captured.graph_module
    flat = flat_call_args(captured, captured.example_args, captured.example_kwargs)
    param_storages, grad_bytes = _param_storages(gm)
    stopwatch = stopwatch or WallStopwatch()
    timings: dict[str, list[float]] = {}
    with preserved_training_state(gm), casts_uncached():  # as the planned module runs
        interp = ProfilingInterpreter(gm, param_storages, kernels)
        outputs = interp.run(*flat)
        output_keys = frozenset(k for k in (interp.tracker.key_of(t) for t in tree_leaves(outputs)
                                            if isinstance(t, torch.Tensor)) if k is not None)
        in_backward = _backward_nodes(interp, outputs)
        interp.grad_fns.clear()
        interp.env.clear()  # it holds the outputs, whose autograd graph holds ``pack``, which holds the interpreter
        del outputs
        with stopwatch:
            for counted in stopwatch.runs(repeats):
                timer = _TimingInterpreter(gm, stopwatch, kernels)
                timer.run(*flat)
                if counted:
                    for name, s in timer.seconds().items():
                        timings.setdefault(name, []).append(s)
    nodes = []
    for p in interp.profiles:
        seconds = stopwatch.combine(timings.get(p.name, [0.0]))
        nodes.append(dataclasses.replace(p, seconds=seconds, in_backward=p.name in in_backward))
    return annotated(gm, GraphProfile(tuple(nodes), output_keys, grad_bytes, storage_bytes(fixed_tensors(gm, flat))))


# --- measured steps with stage markers --------------------------------------------------------------------------

class BackwardMarker(torch.autograd.Function):
    """Identity on tensors; calls ``callback`` when the backward has passed through all of them."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


@dataclass(frozen=True)
class BackwardReleases:
    """The named tensors freed in one stage's eager backward, in order (:class:`~planner.meter.Release`: its label
    is the tensor's name), and the most bytes live after the last of them."""

    releases: tuple[Release, ...]
    tail_peak_bytes: int


@dataclass
class StageMeasurement:
    """Measured per stage over one eager step: peak live bytes (beyond fixed) in its forward and backward."""

    forward_peak: list[int]
    backward_peak: list[int]
    backward_seconds: list[float]
    step_seconds: float
    total_peak: int = 0
    device_peak_bytes: int | None = None  # torch.cuda.max_memory_allocated over the metered step (CUDA only)
    device_reserved_bytes: int | None = None  # torch.cuda.memory_reserved after it: what the allocator holds
    # per stage: what its backward has made, and holds, when it first reads a tensor the stage saved (where a region
    # ending at the stage begins its recomputation); 0 where not seen. Under autocast a residual add's backward
    # casts the gradient for its bf16 branch before any saved tensor is read: 16 KB at test size
    before_first_unpack: list[int] | None = None
    # the loss and the gradient the backward starts from, held through the whole backward (outside every stage)
    loss_bytes: int = 0
    # per stage whose backward has a segment of the meter to itself: the named tensors freed in it, in order, each
    # with the peak before it (since the segment began or the free before), and the peak after the last; None for
    # the others. A stage's measured peak, told apart by which tensors it saves of earlier stages are still alive
    backward_releases: list[BackwardReleases | None] | None = None
    # per parameter whose gradient is sparse (``nn.Embedding(sparse=True)``): the bytes it holds beyond the fixed
    # tensors (its values keep the gradient that reached the lookup, its indices may view the input)
    sparse_grad_bytes: dict[str, int] = field(default_factory=dict)


class _MarkingInterpreter(FreeingInterpreter):
    def __init__(self, gm: fx.GraphModule, stage_of: dict[str, int], on_forward: Callable[[int], None],
                 on_backward_done: Callable[[int], None], kernels: Kernels | None = None,
                 on_first_unpack: Callable[[int], None] | None = None,
                 labelling: Callable[[str], Any] | None = None):
        super().__init__(gm)
        self.kernels = kernels or {}
        self.labelling = labelling  # node name -> a context its op runs in
        self.stage_of = stage_of
        self.on_forward = on_forward
        self.on_backward_done = on_backward_done
        self.on_first_unpack = on_first_unpack
        self.current = -1

    def run(self, *args: Any) -> Any:
        if self.on_first_unpack is None:
            return super().run(*args)
        unpacked: set[int] = set()

        def pack(t: torch.Tensor) -> tuple[int, torch.Tensor]:
            return self.current, t.detach()  # detached: an op saving its own output must not hold it in a cycle

        def unpack(saved: tuple[int, torch.Tensor]) -> torch.Tensor:
            stage, t = saved
            if stage not in unpacked:
                unpacked.add(stage)
                self.on_first_unpack(stage)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return super().run(*args)

    def run_node(self, n: fx.Node) -> Any:
        stage = self.stage_of.get(n.name)
        if stage is not None and stage != self.current:
            self.current = stage
            self._mark_inputs(stage)
            self.on_forward(stage)
        if self.labelling is None:
            return super().run_node(n)
        with self.labelling(n.name):
            return super().run_node(n)

    def call_function(self, target, args, kwargs) -> Any:
        return self.kernels.get(target, target)(*args, **kwargs)

    def _mark_inputs(self, stage: int) -> None:
        external = []
        for n in self.module.graph.nodes:
            if self.stage_of.get(n.name) != stage:
                continue
            for src in n.all_input_nodes:
                src_stage = self.stage_of.get(src.name)
                if src_stage is not None and src_stage < stage and src not in external:
                    value = self.env.get(src)
                    if isinstance(value, torch.Tensor) and value.requires_grad:
                        external.append(src)
        if external:
            marked = BackwardMarker.apply(lambda: self.on_backward_done(stage), *[self.env[s] for s in external])
            for src, value in zip(external, marked):
                self.env[src] = value


def default_loss(outputs: Any) -> torch.Tensor:
    """The first scalar output that requires grad (the ``loss`` of a Hugging Face model given ``labels``), else a
    stand-in for the loss the caller computes from the outputs: the mean of their squares, in fp32. As a squared
    error does, it keeps an output-sized tensor from its forward to its backward and makes each output's gradient
    whole (cross-entropy needs one output-sized tensor less at its peak, so it fits with room to spare). Until
    2026-12-08 the stand-in was the outputs' sum, whose gradient is a broadcast scalar: a model returning logits,
    planned without ``loss_fn`` and trained with cross-entropy, measured 35.7 MB against a 19.7 MB budget (a
    4-layer encoder over 2,048 classes, 8 x 128 tokens). ``loss_fn`` plans for the caller's own loss exactly.

    >>> import torch
    >>> logits = torch.ones(2, 3, requires_grad=True)
    >>> default_loss(logits).backward()
    >>> logits.grad.stride()   # whole, as cross-entropy's
    (3, 1)
    """
    scalar, leaves = trained_outputs(outputs)
    if scalar is not None:
        return scalar
    if not leaves:
        raise ValueError("the model returns no tensor that requires grad, so there is nothing to train")
    return sum(t.float().square().mean() for t in leaves)


def trained_outputs(outputs: Any) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The first scalar among ``outputs`` that requires grad (a loss, which :func:`default_loss` takes), or None,
    and all of them that require grad (what a stand-in loss is made of where there is no scalar).

    >>> import torch
    >>> scalar, leaves = trained_outputs({"loss": torch.ones((), requires_grad=True), "logits": torch.ones(2)})
    >>> scalar.dim(), len(leaves)
    (0, 1)
    """
    leaves = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    return next((t for t in leaves if t.dim() == 0), None), leaves


def measure_stages(captured: CapturedGraph, stage_of: dict[str, int], num_stages: int, *,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 3,
                   hold_outputs: bool = True, stopwatch: Stopwatch | None = None,
                   kernels: Kernels | None = None,
                   resizable: Callable[[], Sequence[torch.Tensor]] | None = None,
                   created: Mapping[str, Sequence[tuple[str | None, int]]] | None = None,
                   grads_held: bool = False) -> StageMeasurement:
    """Run eager training steps of the captured graph with stage markers; measure memory once and time ``repeats``.

    ``hold_outputs``: whether the model's outputs stay referenced through the backward, as in
    ``out = model(x); out.loss.backward()`` (``loss_fn(model(x)).backward()`` lets them go).
    ``stopwatch`` and ``kernels``: as for :func:`profile_graph`. On CUDA tensors the metered step also reads the
    caching allocator's peak (``torch.cuda.max_memory_allocated``) and what it reserves. ``resizable``: storages
    grown in place that the meter counts too (see :class:`~planner.meter.LiveMemoryMeter`). ``created``: per node,
    the name (or None) and bytes of each storage it allocates, in order (:func:`~planner.costmodel.created_tensors`):
    the metered step names them so, where they match, to tell which were freed where in each stage's backward
    (``StageMeasurement.backward_releases``). ``grads_held``: every trained parameter holds a gradient when the
    step begins, as in gradient accumulation's later micro-batches (allocated before the meter starts, so not
    counted: the caller counts them as fixed); the backward adds into them, each new gradient a temporary.
    """
    gm = captured.graph_module
    flat = flat_call_args(captured, captured.example_args, captured.example_kwargs)
    loss_of = loss_fn or default_loss
    held = held_gradients(gm.parameters()) if grads_held else {}
    sparse: dict[str, int] | None = None  # what sparse gradients hold, read once (in the metered step, not a timed one)

    def one_step(on_forward, on_backward_start, on_backward_done, on_first_unpack=None, labelling=None):
        nonlocal sparse
        with casts_uncached():  # as the planned module runs
            interp = _MarkingInterpreter(gm, stage_of, on_forward, on_backward_done, kernels, on_first_unpack,
                                         labelling)
            outputs = interp.run(*flat)
        loss = loss_of(outputs)
        held_outputs = {id(t.untyped_storage()) for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)} \
            if hold_outputs else set()
        if not hold_outputs:
            del outputs
            interp.env.clear()
        # the loss and the gradient the backward starts from (what ``loss.backward()`` makes, made here before the
        # backward's mark so that no stage counts it) are alive through the backward; a loss that is an output the
        # caller holds is counted as one already
        seed = torch.ones_like(loss)
        with outside_autocast():
            on_backward_start()
            loss.backward(seed)
        if sparse is None:
            sparse = sparse_gradient_bytes(gm, flat)
        for p in gm.parameters():
            p.grad = held.get(p)
        forget_input_gradients(flat)  # each step's inputs come without one, as a batch does
        return storage_bytes([seed]) + (0 if id(loss.untyped_storage()) in held_outputs else storage_bytes([loss]))

    on_cuda = any(t.is_cuda for t in list(gm.parameters()) + [x for x in flat if isinstance(x, torch.Tensor)])
    with preserved_training_state(gm):
        for p, grad in held.items():
            p.grad = grad
        measured = _measure(one_step, num_stages, repeats, stopwatch or WallStopwatch(), on_cuda, resizable, created)
    return dataclasses.replace(measured, sparse_grad_bytes=sparse or {})


def forget_input_gradients(inputs: Iterable[Any]) -> None:
    """Drop the gradients a step left on its tensor ``inputs`` (those requiring them): a caller's batch comes
    without one each step, where a step that finds one adds into it; and a plan would keep an input's worth on the
    inputs it was captured with."""
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.grad is not None:
            x.grad = None


def held_gradients(parameters: Iterable[torch.nn.Parameter]) -> dict[torch.nn.Parameter, torch.Tensor]:
    """A zero gradient for each of ``parameters`` that trains: what a step of gradient accumulation after the
    first begins with (``grads_held``), to set as their ``.grad`` before it.

    >>> w, frozen = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2), requires_grad=False)
    >>> [tuple(g.shape) for g in held_gradients([w, frozen]).values()]
    [(2,)]
    """
    return {p: torch.zeros_like(p) for p in parameters if p.requires_grad}


def _measure(one_step, num_stages: int, repeats: int, stopwatch: Stopwatch, on_cuda: bool = False, resizable=None,
             created: Mapping[str, Sequence[tuple[str | None, int]]] | None = None) -> StageMeasurement:
    meter = LiveMemoryMeter(resizable=resizable)
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before_first_unpack = [0] * num_stages

    def first_unpack(k: int) -> None:
        """Stage ``k``'s backward reads its first saved tensor: what it made since it began (the last mark was
        ``b`` for the last stage, else the end of stage ``k + 1``'s; another mark means stages overlap: unknown)."""
        segment = meter.segments[-1] if meter.segments else None
        if segment is not None and segment.label == ("b" if k == num_stages - 1 else f"d{k + 1}"):
            before_first_unpack[k] = max(0, meter.live_bytes - segment.start_bytes)

    @contextmanager
    def labelling(node: str) -> Iterator[None]:
        """The storages ``node`` allocates get the names of its tensors (``created``), where they match."""
        expected = (created or {}).get(node)
        if expected:
            meter.expect(expected)
        try:
            yield
        finally:
            if expected:
                meter.settle()

    with meter:
        loss_bytes = one_step(lambda k: meter.mark(f"f{k}"), lambda: meter.mark("b"), lambda k: meter.mark(f"d{k}"),
                              first_unpack, labelling)
    device_peak = device_reserved = None
    if on_cuda:
        torch.cuda.synchronize()
        device_peak, device_reserved = torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved()
    forward_peak = [0] * num_stages
    backward_peak = [0] * num_stages
    for seg in meter.segments:
        if seg.label.startswith("f"):
            forward_peak[int(seg.label[1:])] = max(forward_peak[int(seg.label[1:])], seg.peak_bytes)
    backward_segments = [s for s in meter.segments if not s.label.startswith("f")]
    # a segment that starts at "b" or "d{k}" covers the backward of the stages down to the next "d{j}" mark
    covering: list[list[Segment | None]] = [[] for _ in range(num_stages)]  # per stage, its segments (None: shared)
    for seg, nxt in zip(backward_segments, backward_segments[1:] + [None]):
        low = int(nxt.label[1:]) if nxt is not None else 0
        high = int(seg.label[1:]) - 1 if seg.label.startswith("d") else num_stages - 1
        for k in range(low, high + 1):
            backward_peak[k] = max(backward_peak[k], seg.peak_bytes)
            covering[k].append(seg if low == high else None)
    releases = [BackwardReleases(tuple(c[0].releases), c[0].tail_peak_bytes) if len(c) == 1 and c[0] else None
                for c in covering]

    times: list[list[float]] = [[] for _ in range(num_stages)]
    steps: list[float] = []
    with stopwatch:
        for counted in stopwatch.runs(repeats):
            stamps: list[tuple[str, int, Any]] = []
            start = stopwatch.stamp()
            one_step(lambda k: None, lambda: stamps.append(("b", num_stages, stopwatch.stamp())),
                     lambda k: stamps.append(("d", k, stopwatch.stamp())))
            end = stopwatch.stamp()
            if not counted:
                continue
            steps.append(stopwatch.seconds(start, end))
            marks = stamps + [("d", 0, end)]
            per_stage = [0.0] * num_stages
            for (_, hi, t0), (_, lo, t1) in zip(marks, marks[1:]):
                covered = list(range(lo, hi)) or [lo]
                for k in covered:
                    per_stage[k] += stopwatch.seconds(t0, t1) / len(covered)
            for k in range(num_stages):
                times[k].append(per_stage[k])
    backward_seconds = [stopwatch.combine(t) for t in times]
    return StageMeasurement(forward_peak, backward_peak, backward_seconds, stopwatch.combine(steps),
                            total_peak=meter.peak_bytes, device_peak_bytes=device_peak,
                            device_reserved_bytes=device_reserved, before_first_unpack=before_first_unpack,
                            loss_bytes=loss_bytes, backward_releases=releases)


def paired_step_seconds(steps: dict[str, Callable[[], None]], repeats: int, baseline: str, *,
                        paired_with: Mapping[str, str] | None = None, tolerance: float = 0.0, max_rounds: int = 0,
                        max_seconds: float = float("inf")) -> dict[str, Estimate]:
    """Seconds each step function takes beyond ``baseline``'s (or beyond the step ``paired_with`` names for it):
    the median over interleaved rounds (:func:`~planner.timing.interleaved_rounds`) of the difference within each
    round, so that drifts in the machine's speed between rounds cancel, with its standard error; ``baseline``
    itself maps to its median.

    After ``repeats`` rounds, more rounds follow (up to ``max_rounds`` in all, within ``max_seconds``) while the
    standard error of any median difference exceeds ``tolerance`` times the baseline's median.

    >>> import time
    >>> steps = {"eager": lambda: None, "slow": lambda: time.sleep(0.002), "slower": lambda: time.sleep(0.006)}
    >>> seconds = paired_step_seconds(steps, 3, "eager", paired_with={"slower": "slow"})
    >>> seconds["eager"].median < 0.001 < 0.0019 < seconds["slow"].median < 0.05
    True
    >>> 0.002 < seconds["slower"].median < 0.05  # beyond "slow"
    True
    """
    against = paired_with or {}

    def differences(samples: dict[str, list[float]]) -> dict[str, list[float]]:
        return {name: [a - b for a, b in zip(values, samples[against.get(name, baseline)])]
                for name, values in samples.items() if name != baseline}

    def precise(samples: dict[str, list[float]]) -> bool:
        limit = tolerance * statistics.median(samples[baseline])
        return all(median_standard_error(d) <= limit for d in differences(samples).values())

    samples = interleaved_rounds(steps, repeats, enough=precise, max_rounds=max_rounds, max_seconds=max_seconds)
    return {baseline: Estimate.of(samples[baseline]),
            **{name: Estimate.of(d) for name, d in differences(samples).items()}}
