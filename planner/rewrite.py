"""Turn a plan into a module that runs it: checkpoint regions carved out of the captured graph.

Each region of the plan becomes a :class:`CheckpointRegion` submodule: a small ``fx.GraphModule`` body (the region's
nodes, taking what it reads from outside as arguments) run under non-reentrant ``torch.utils.checkpoint``. The
top-level graph calls ``self.region_<i>(...)`` where the region's nodes were, so ``print(module.code)`` shows where
each region starts and ends. Inside a body, a node whose outputs are cached instead of recomputed calls its op
through :func:`cached_call` (``planner_cached_linear_default(...)``). Run eagerly, only those calls go through a
dispatch mode (:class:`_Recording` in the forward, :class:`_Replaying` in the recomputation), below autograd, so
the recomputation records the op and its saved inputs as the forward did but gets its output from the cache.
Selective checkpointing's own modes would see every op of the region, twice: at test size that cost more than
half a block's recomputation. Under ``torch.compile`` the cached ops are annotated, and selective checkpointing's
policy (:func:`_cache_policy`) tells the partitioner to save them.

Exactness: checkpoint restores the CPU/CUDA RNG and autocast state for the recomputation (the module runs with
autocast's cache of weight casts off, so both passes cast alike: :func:`_casts_uncached_before`), random ops are
never cached (so the recomputation draws the same numbers in the same order) but for the dropout masks of
:mod:`planner.dropout` (a kept mask keeps the generator's state after its draw, and its replay sets the generator
to it, so the masks drawn again after it draw what the forward drew), BatchNorm runs with momentum 0 while
recomputing (``running * 1 + batch * 0`` is the running value exactly) and in-place buffer updates such as
``num_batches_tracked += 1`` are hoisted out of regions, so BatchNorm statistics move exactly once per step. So is
an in-place write a region would make to one of its inputs (``h.relu_()`` on the stage before's output, where stage
lists cut there): it runs once, just before the region, which then starts from the written value.
"""

from __future__ import annotations

import copy
import functools
import operator
import threading
from contextlib import nullcontext
from functools import partial
from typing import AbstractSet, Any, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .capture import aliases_input, casts_uncached, returns_alias, written_arguments
from .dropout import MASK_OP, STATE_OP, advance_to, is_mask, write_state_after_draw
from .errors import PlannerError
from .plan import Plan, PlannedRegion

_STATE = threading.local()


def _flag(name: str) -> bool:
    return getattr(_STATE, name, False)


CACHED = "planner_cached"  # the fx annotation (node.meta["custom"]) of ops a compiled region caches


@functools.cache
def cached_call(target: Any) -> Any:
    """``target`` with its outputs cached by the region: what a region's body calls for each node the plan caches.
    Run eagerly inside a region's checkpoint, it runs ``target`` under the region's cache mode (recording in the
    forward, replaying in the recomputation); traced by ``torch.compile``, which does not trace Python side
    effects, it annotates the ops it makes (``torch.fx.traceback.annotate``), and :func:`_cache_policy` reads the
    annotation of the node being traced."""

    def planner_cached(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            with fx_traceback.annotate({CACHED: True}):
                return target(*args, **kwargs)
        mode = getattr(_STATE, "cache_mode", None)
        if mode is None or mode.cache.spent:  # the body run by itself, or a recomputation after the first
            return target(*args, **kwargs)
        first = len(mode.cache.entries)
        with mode:
            out = target(*args, **kwargs)
        if isinstance(mode, _Recording):
            mode.cache.watch(first, out)
        return out

    name = getattr(target, "__name__", "op").replace(".", "_")
    planner_cached.__name__ = planner_cached.__qualname__ = f"planner_cached_{name}"
    return planner_cached


@functools.cache
def _is_cached(op) -> bool:
    """Whether a cached node's ATen op keeps its output: views (and in-place ops, which return their input) are
    free to recompute, and caching one would pin its base; ``detach`` runs a different number of times in the
    recomputation."""
    return not returns_alias(op) and op is not torch.ops.aten.detach.default


def _detached(value: Any) -> Any:
    """``value`` (an op's output: a tensor, a tuple or list of them, or anything else) with each tensor replaced
    by a new alias outside autograd; by hand, as pytree's maps cost more than the op at test size."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _versions(value: Any) -> tuple[int, ...]:
    return tuple(t._version for t in _tensors(value))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype)


def _watched(value: Any, visible: Sequence[torch.Tensor]) -> Any:
    """``value`` (a cached op's output, detached below autograd) with each tensor that is one of ``visible`` (the
    node's outputs as the graph sees them) detached from that one instead: an alias made below autograd has a
    version counter of its own, one made above shares the output's, so only it sees a later in-place write."""
    if isinstance(value, torch.Tensor):
        return next((v.detach() for v in visible if _same_view(v, value)), value)
    if isinstance(value, (tuple, list)):
        return type(value)(_watched(v, visible) for v in value)
    return value


class _RegionCache:
    """The outputs one call of a region caches, in the order its forward made them, each with the versions of its
    tensors (a later in-place write to one would make the replay wrong, so the replay checks them). The replay
    drops each entry as it hands it out, so the recomputation holds it only as long as what it recomputes does.
    A recomputation after the first (the backward run again) finds the cache spent and runs the cached ops again,
    holding for that pass what the cached ops make as well as what they would have cached."""

    def __init__(self) -> None:
        self.entries: list[tuple[Any, tuple[int, ...]] | None] = []
        self.replayed = 0
        self.spent = False

    def begin_replay(self) -> None:
        """A recomputation starts: the first replays the entries; any later one finds them spent."""
        self.spent = self.replayed > 0

    def record(self, out: Any) -> None:
        self.entries.append((_detached(out), _versions(out)))

    def watch(self, first: int, out: Any) -> None:
        """Bind the entries from ``first`` on (what one cached node's op recorded) to the node's outputs ``out``
        as the graph sees them, so that the replay's version check sees writes the forward makes to them later
        (``weights /= weights.sum()`` on ``topk``'s values)."""
        visible = _tensors(out)
        for i in range(first, len(self.entries)):
            value = _watched(self.entries[i][0], visible)
            self.entries[i] = (value, _versions(value))

    def replay(self, op) -> Any:
        if self.replayed >= len(self.entries):
            raise PlannerError(f"a region's recomputation called {op} more often than its forward did",
                               hint="a caching region's ops must not depend on state that changes between forward "
                                    "and backward")
        (out, versions), self.entries[self.replayed] = self.entries[self.replayed], None
        self.replayed += 1
        if _versions(out) != versions:
            raise PlannerError(f"a tensor a checkpoint region cached ({op}) was written in place after the region "
                               f"made it", hint="plan again: nodes whose outputs are written in place are never "
                                                "cached")
        return _detached(out)

    def after_draw(self, state: torch.Tensor, like: torch.Tensor) -> None:
        """A kept mask was just drawn from ``state``: its replay will not draw, so the cached ``state`` becomes
        the generator's state after the draw, for the replay to set (see :mod:`planner.dropout`)."""
        for i in reversed(range(len(self.entries))):
            value = self.entries[i][0]
            if isinstance(value, torch.Tensor) and _same_view(value, state):
                write_state_after_draw(value, like)
                self.entries[i] = (value, _versions(value))
                return
        raise PlannerError("internal error: a region kept a dropout mask but not the generator state it was drawn "
                           "from; please report this with the plan")


class _CacheMode(TorchDispatchMode):
    """A dispatch mode bound to one call's :class:`_RegionCache`."""

    def __init__(self, cache: _RegionCache) -> None:
        super().__init__()
        self.cache = cache


class _Recording(_CacheMode):
    """Entered around each cached node's op in a region's forward: runs it, and caches what it makes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is MASK_OP:
            self.cache.after_draw(args[2], args[0])
        if _is_cached(func):
            self.cache.record(out)
        return out


class _Replaying(_CacheMode):
    """Entered around each cached node's op in a region's recomputation: hands out what the forward cached
    instead of running it (autograd, above this mode, still records the op and what it saves)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _is_cached(func):
            return func(*args, **(kwargs or {}))
        out = self.cache.replay(func)
        if func is MASK_OP:  # the kept state is the generator's after the draw: move it on as the draw did
            advance_to(args[2], args[0])
        return out


def _caching() -> bool:
    """Whether the op being traced by ``torch.compile`` belongs to a cached node."""
    return bool((fx_traceback.get_current_meta().get("custom") or {}).get(CACHED))


def _cache_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Under ``torch.compile``: save what cached nodes allocate (see :func:`_is_cached`). Generator states of
    dropout masks are always saved: a mask re-drawn after a kept one must draw from its own state."""
    if _caching() and _is_cached(op) or op is STATE_OP:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def planner_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    """``aten.batch_norm`` that leaves running statistics untouched while a region is being recomputed."""
    if training and not torch.compiler.is_compiling() and _flag("recomputing"):
        momentum = 0.0
    return torch.ops.aten.batch_norm.default(input, weight, bias, running_mean, running_var, training, momentum,
                                             eps, cudnn_enabled)


class _RegionPass:
    """One pass of a region's body: its forward or (``recomputing``) its recomputation, with the mode its cached
    nodes run under (None: it caches nothing). Entered again each time the recomputation runs: a backward run twice
    over one forward (``retain_graph=True``; ``create_graph=True`` for a gradient penalty, whose second backward
    passes through the region again) recomputes the region each time, as plain checkpointing does."""

    def __init__(self, recomputing: bool, cache_mode: _CacheMode | None) -> None:
        self.recomputing, self.cache_mode = recomputing, cache_mode
        self._previous: list[tuple[bool, _CacheMode | None]] = []

    def __enter__(self) -> None:
        self._previous.append((_flag("recomputing"), getattr(_STATE, "cache_mode", None)))
        if self.recomputing and self.cache_mode is not None:
            self.cache_mode.cache.begin_replay()
        _STATE.recomputing, _STATE.cache_mode = self.recomputing, self.cache_mode

    def __exit__(self, *exc: Any) -> None:
        _STATE.recomputing, _STATE.cache_mode = self._previous.pop()


class CheckpointRegion(torch.nn.Module):
    """Runs ``body`` under non-reentrant checkpoint; nodes bracketed by cache calls are saved, the rest recomputed."""

    def __init__(self, body: fx.GraphModule, stage_names: Sequence[str], cached_nodes: Sequence[str]):
        super().__init__()
        self.body = body
        self.stage_names = tuple(stage_names)
        self.cached_nodes = tuple(cached_nodes)

    def _contexts(self):
        if not self.cached_nodes:
            return nullcontext(), _RegionPass(True, None)
        cache = _RegionCache()  # one per call: checkpoint asks for the contexts each time it runs the region
        return _RegionPass(False, _Recording(cache)), _RegionPass(True, _Replaying(cache))

    def forward(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            # torch.compile traces the region as one checkpoint whose partitioner keeps what the policy saves (the
            # annotated outputs of cached nodes, the generator states) and recomputes the rest in the backward
            return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=True,
                              context_fn=partial(create_selective_checkpoint_contexts, _cache_policy))
        # early_stop=False: the recomputation runs to the end of the region, so it consumes every cached value
        # (an early stop would leave cache entries alive through the region's backward). The body's forward is
        # called, not the body: an early stop raises through it, and a GraphModule's __call__ catches every
        # exception to extract its traceback before re-raising (70-140 us a region on this CPU, a quarter of what
        # checkpointing a small region cost).
        return checkpoint(self.body.forward, *args, use_reentrant=False, context_fn=self._contexts,
                          preserve_rng_state=True, early_stop=not self.cached_nodes)

    def extra_repr(self) -> str:
        span = self.stage_names[0] if len(self.stage_names) == 1 else \
            f"{self.stage_names[0]} .. {self.stage_names[-1]}"
        return f"stages=[{span}], cached_nodes={len(self.cached_nodes)}"


def _is_hoisted(node: fx.Node) -> bool:
    """In-place updates of buffers or inputs (``num_batches_tracked.add_(1)``, ``self.steps += 1``): run once,
    outside regions, as the recomputation must not repeat them (later readers read the update's own node, which
    the region then takes as an input). A write through a view is :func:`_writes_region_input`'s. A write to a
    value the region makes stays inside, even when nothing reads the write's result: later nodes read the value
    it wrote (``shifted[..., 1:] = ids[..., :-1]`` in T5's ``_shift_right``), and the recomputation makes the value
    again before writing it again."""
    written = written_arguments(node)
    if not written or node.target is torch.ops.aten.batch_norm.default:
        return False
    return any(isinstance(w, fx.Node) and w.op in ("get_attr", "placeholder") for w in written)


def _alias_base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` shares through views and in-place ops (``h`` for ``h.view(...)``)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and aliases_input(node):
        node = node.args[0]
    return node


def _writes_outside(node: fx.Node, inside: AbstractSet[fx.Node]) -> list[fx.Node]:
    """The values made before the region that ``node`` writes in place, directly or through a view."""
    return [w for w in written_arguments(node) if isinstance(w, fx.Node) and _alias_base(w) not in inside]


def _writes_region_input(node: fx.Node, inside: AbstractSet[fx.Node], bases_read: set[fx.Node]) -> bool:
    """Whether ``node`` writes in place a value made before the region (``h.relu_()`` on an earlier stage's
    output), needs nothing the region made, and comes before any region node reads that value or a view of it.
    Inside, the recomputation would write it again; run just before the region, it runs once, and the region's
    forward and recomputation both see the written value, as eager's later nodes do. Raises
    :class:`PlannerError` for a write to such a value that cannot move (it would change what the region computes).
    """
    written = _writes_outside(node, inside)
    if not written or node.target is torch.ops.aten.batch_norm.default:
        return False
    if inside.isdisjoint(node.all_input_nodes) and bases_read.isdisjoint(_alias_base(w) for w in written):
        return True
    base = _alias_base(written[0])
    if base.op in ("placeholder", "get_attr"):
        what = "the input" if base.op == "placeholder" else "the attribute"
        raise PlannerError(f"a checkpoint region would write {what} {base.name} in place through a view "
                           f"({node.name} into {written[0].name}): "
                           f"the region reads it first, so the write cannot run outside it, and its recomputation "
                           f"would write it twice",
                           hint="write into a copy in forward (x = x.clone() before the write)")
    raise PlannerError(f"a checkpoint region would write {written[0].name} in place ({node.name}), a value made "
                       f"before it, after reading it: its recomputation would write it twice",
                       hint="use stages from planner's own partition, which never cut between a value and an "
                            "in-place write to it")


def _copy_ahead(node: fx.Node, new: fx.Graph, env: dict[fx.Node, fx.Node]) -> None:
    """Copy ``node`` (an attribute or a hoisted update a region reads) and what it needs, before the region."""
    for src in node.all_input_nodes:
        if src not in env:
            _copy_ahead(src, new, env)
    env[node] = new.node_copy(node, lambda y: env[y])


def _region_nodes(graph: fx.Graph, stage_nodes: Sequence[Sequence[str]],
                  region: PlannedRegion) -> tuple[list[fx.Node], list[fx.Node]]:
    """The nodes the region runs, and the nodes of its stages that run outside it, before it
    (:func:`_is_hoisted`, :func:`_writes_region_input`)."""
    names = {name for k in range(region.start, region.stop) for name in stage_nodes[k]}
    inside: dict[fx.Node, None] = {}  # ordered
    bases_read: set[fx.Node] = set()
    hoisted: list[fx.Node] = []
    for n in graph.nodes:
        if n.name not in names:
            continue
        if _is_hoisted(n) or _writes_region_input(n, inside.keys(), bases_read):
            hoisted.append(n)
        else:
            inside[n] = None
            bases_read.update(_alias_base(src) for src in n.all_input_nodes)
    return list(inside), hoisted


def _with_mask_states(nodes: list[fx.Node], cached: AbstractSet[str]) -> set[str]:
    """``cached`` and the generator state of every cached dropout mask (a plan's caching options list them; a
    mask's replay sets the generator from it, see :mod:`planner.dropout`). Raises :class:`PlannerError` for a
    cached mask whose state the region does not make.

    No other state is kept (the execution model counts a stage's states only when its option caches): a mask drawn
    again reads the generator, which the checkpoint restored at the region's start and every mask before it, drawn
    again or replayed, moved on as in the forward."""
    inside = set(nodes)
    states = set()
    for n in nodes:
        if n.name in cached and is_mask(n):
            state = n.args[2]
            if state not in inside:
                raise PlannerError(f"a checkpoint region caches the dropout mask {n.name} but not its generator "
                                   f"state {state.name}, which is made outside it",
                                   hint="cut stages so that a mask and its state are in the same region "
                                        "(planner's own partition does)")
            states.add(state.name)
    return set(cached) | states


def _build_body(nodes: list[fx.Node], cached: set[str]) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    cached = _with_mask_states(nodes, cached)
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for src in n.all_input_nodes:
            if src not in inside and src not in inputs:
                inputs.append(src)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {src: body.placeholder(src.name) for src in inputs}
    for n in nodes:
        copied = body.node_copy(n, lambda x: env[x])
        if n.target is torch.ops.aten.batch_norm.default:
            copied.target = planner_batch_norm
        if n.name in cached:
            copied.target = cached_call(copied.target)
        env[n] = copied
    body.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(torch.nn.Module(), body, class_name="RegionBody"), inputs, outputs


def apply_plan(graph_module: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """A new ``GraphModule`` that runs ``plan`` on ``graph_module``'s graph and shares its parameters and buffers."""
    old = graph_module.graph
    regions, hoisted = [], set()
    for i, region in enumerate(plan.regions):
        nodes, outside = _region_nodes(old, plan.stage_nodes, region)
        hoisted.update(outside)
        if nodes:
            regions.append((i, region, nodes))
    first_of = {nodes[0]: (i, r, nodes) for i, r, nodes in regions}
    skipped = {n for _, _, nodes in regions for n in nodes}
    new = fx.Graph()
    new._codegen = copy.copy(old._codegen)  # immutable pytree specs (deep-copying them warns)
    env: dict[fx.Node, fx.Node] = {}
    holder = torch.nn.Module()
    for n in old.nodes:
        if n in first_of:
            i, region, nodes = first_of[n]
            body, inputs, outputs = _build_body(nodes, set(region.cached_nodes))
            for x in inputs:  # attributes (subgraphs of no_grad blocks) and hoisted updates the region reads
                if x not in env and (x.op == "get_attr" or x in hoisted):
                    _copy_ahead(x, new, env)
            name = f"region_{i}"
            setattr(holder, name, CheckpointRegion(body, plan.stage_names[region.start:region.stop],
                                                   region.cached_nodes))
            call = new.call_module(name, tuple(env[x] for x in inputs))
            for j, out in enumerate(outputs):
                env[out] = new.call_function(operator.getitem, (call, j))
                env[out]._rename(out.name)
                env[out].meta = dict(out.meta)
        elif n not in skipped and n not in env:
            env[n] = new.node_copy(n, lambda x: env[x])
    for name, region in holder.named_children():
        graph_module.add_submodule(name, region)
    try:
        result = fx.GraphModule(graph_module, new, class_name="PlannedModule")
    finally:
        for name, _ in holder.named_children():
            delattr(graph_module, name)
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(graph_module, attr):
            setattr(result, attr, getattr(graph_module, attr))
    result.recompile()
    result.register_forward_pre_hook(_casts_uncached_before)
    result.register_forward_hook(_casts_uncached_after, always_call=True)
    return result


def _casts_uncached_before(module: torch.nn.Module, args: tuple) -> None:
    """A planned module's forward runs inside :func:`planner.capture.casts_uncached` (autocast's cache of weight
    casts off): a checkpoint region then casts in its forward and its recomputation alike, and a cast lives as long
    as what reads or saves it, as the execution model says. Compiled code casts without the cache anyway."""
    if not torch.compiler.is_compiling():
        entered = casts_uncached()
        entered.__enter__()
        _STATE.__dict__.setdefault("uncached", []).append(entered)


def _casts_uncached_after(module: torch.nn.Module, args: tuple, output: Any) -> None:
    """Leaves what :func:`_casts_uncached_before` entered; it runs even when the forward raised (``always_call``)."""
    entered = _STATE.__dict__.get("uncached")
    if not torch.compiler.is_compiling() and entered:
        entered.pop().__exit__(None, None, None)
