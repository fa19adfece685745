"""From a profiled graph to a :class:`~planner.problem.Problem`: stages, tensors, recompute options, calibration.

* Stages follow the model's own structure: one per repeated block (``transformer.h.3``, ``blocks.7``) and one per
  run of other modules, with light runs (embeddings, masks, views) merged into their neighbours, except the tail
  after the last block (``model.norm+lm_head``: final norm, head, loss), which is a stage of its own. No stage
  boundary falls between a value and an in-place op that writes it.
* Tensors are storages that outlive the node that made them; their readers and savers are stages.
* Recompute options are selective-checkpoint menus per stage: recompute everything, or cache the nodes that cost the
  most time per byte (matmuls and attention first), in growing shares of the stage's cacheable bytes. Random ops
  are never cached, so a recomputation draws the same random numbers in the same order; dropout masks drawn by
  :mod:`planner.dropout` are the exception (each replays from its own generator state, which every caching option
  keeps) when no other random op is in the graph (:func:`never_cached`). A stage that
  makes one of the model's outputs is only recomputed whole (see ``_stages_making_outputs``). A caching option's
  recompute workspace comes from a replay of its re-run, node by node (:func:`caching_workspace`): caches are
  alive until read, temporaries of composite ops (attention) at their busiest.
* Workspaces are calibrated: the memory a stage's forward or backward measured in an eager step, beyond what the
  execution model accounts for (activation gradients, temporaries). The backward peak is calibrated twice, seen
  from the stage's start (all it saved alive) and from its end (only what outlives it): the model then
  reproduces the eager step, and for other schedules takes the higher of the two readings.

>>> import torch
>>> from planner.capture import capture
>>> from planner.profile import profile_graph
>>> blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)])
>>> captured = capture(blocks, (torch.randn(16, 8),))
>>> stages = partition_stages(profile_graph(captured, repeats=1))
>>> [s.name for s in stages]
['0', '1', '2']
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import re
from collections import Counter
from dataclasses import dataclass
from typing import AbstractSet, Callable, Sequence

import torch.fx as fx

from .dropout import is_mask
from .errors import PlannerError
from .functions import calls_function
from .problem import (BackwardEpoch, HeldInputs, InputSaving, Phase, Problem, RecomputeOption, Schedule, Stage,
                      TensorInfo, keeps, last_rerun_reader, simulate)
from .profile import BackwardReleases, GraphProfile, NodeProfile, StageMeasurement

CACHE_SHARES = (0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class StageSpec:
    """A stage before measurement: its name and the nodes it runs."""

    name: str
    nodes: tuple[str, ...]


def _block_container(paths: Sequence[str]) -> str | None:
    """The module path whose numbered children ("h.0", "h.1", ...) run the most nodes: the repeated blocks.

    Most nodes first, then most children: the numbered layers inside one block (``blocks.0.layers.0 .. 4``)
    may outnumber the blocks (``blocks.0 .. 3``) but never run more nodes than all the blocks together. A container
    one of whose children runs most of its nodes (three quarters or more) is a wrapper, not repeated blocks
    (``nn.Sequential(backbone, head)``): the container inside that child is taken where there is one. Until
    2026-12-07 such a model was one stage, and no plan could shed anything.

    >>> paths = [f"0.layers.{i}.{j}" for i in range(4) for j in range(3)] + ["1"]
    >>> _block_container(paths)
    '0.layers'
    >>> _block_container([f"blocks.{i}.layers.{j}" for i in range(4) for j in range(5)])
    'blocks'
    """
    counts: Counter[str] = Counter()
    children: dict[str, Counter[str]] = {}
    for path in paths:
        parts = path.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                prefix = ".".join(parts[:i])
                children.setdefault(prefix, Counter())[part] += 1
                counts[prefix] += 1
    candidates = [p for p, kids in children.items() if len(kids) >= 2]
    if not candidates:
        return None
    best = max(candidates, key=lambda p: (counts[p], len(children[p])))
    while True:
        child, runs = children[best].most_common(1)[0]
        inside = f"{best}.{child}" if best else child
        nested = [p for p in candidates if p == inside or p.startswith(inside + ".")]
        if runs < 0.75 * counts[best] or not nested:
            return best
        best = max(nested, key=lambda p: (counts[p], len(children[p])))


def _key(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else ""


def _runs(nodes: Sequence[NodeProfile], depth: int) -> list[list[NodeProfile]]:
    runs: list[list[NodeProfile]] = []
    for n in nodes:
        if runs and _key(runs[-1][-1].module_path, depth) == _key(n.module_path, depth):
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


def _weight(run: Sequence[NodeProfile]) -> int:
    """Work of a run, from what does not vary between runs: FLOPs plus bytes written (memory-bound ops)."""
    return sum(n.flops + n.created_bytes for n in run)


class Granularity(enum.Enum):
    """Where stages may be cut, and so which checkpoints a plan can place: around whole repeated blocks
    (``transformer.h.3``), around their layers (``transformer.h.3.attn``, ``.mlp``, the norms and the residual
    adds between them), or around the layers' own modules (``transformer.h.3.mlp.c_fc``, ``.act``).

    Finer cuts let a plan recompute the part of a block that frees the most memory for the least time (the MLP's
    activation, attention's scores) and keep the rest; the problem has more stages, so it takes longer to solve.

    >>> Granularity("layer").levels_below_block
    1
    """

    BLOCK = "block"
    LAYER = "layer"
    SUBLAYER = "sublayer"

    @property
    def levels_below_block(self) -> int:
        return list(Granularity).index(self)

    @property
    def plan_extra(self) -> tuple[tuple[str, str], ...]:
        """What a plan records of it in ``Plan.extra`` (nothing for the default, whole blocks).

        >>> Granularity.BLOCK.plan_extra, Granularity.LAYER.plan_extra
        ((), (('granularity', 'layer'),))
        """
        return () if self is Granularity.BLOCK else (("granularity", self.value),)


def granularity_of(value: str | Granularity) -> Granularity:
    """``value`` as a :class:`Granularity`, or a :class:`~planner.errors.PlannerError` naming the choices.

    >>> granularity_of("layer") is Granularity.LAYER
    True
    >>> granularity_of("op")
    Traceback (most recent call last):
    ...
    planner.errors.PlannerError: unknown granularity 'op'. Hint: choose one of block, layer, sublayer
    """
    try:
        return Granularity(value)
    except ValueError:
        raise PlannerError(f"unknown granularity {value!r}",
                           hint=f"choose one of {', '.join(g.value for g in Granularity)}") from None


def partition_stages(profile: GraphProfile, *, max_stages: int = 64, min_share: float = 0.25,
                     granularity: Granularity = Granularity.BLOCK) -> list[StageSpec]:
    """Group nodes into stages: one per repeated block (or per layer of one, by ``granularity``), light runs merged
    into neighbours, the tail after the last block a stage of its own (see :func:`_tail_start`), no cut between a
    value and an in-place write to it (see :func:`_respect_in_place_writes`), at most ``max_stages``.

    Below the blocks, a run lighter than ``min_share`` of the typical one inside a block (a norm, a residual add,
    a view) joins the run before it in the same block, or else the one after it."""
    nodes = list(profile.nodes)
    container = _block_container([n.module_path for n in nodes])
    if container is not None:
        block_depth = len(container.split(".")) + 1 if container else 1
    else:
        block_depth = max(range(1, 8), key=lambda d: min(len(_runs(nodes, d)), max_stages))
    depth = block_depth + granularity.levels_below_block
    runs = _runs(nodes, depth)
    block_pattern = re.compile(rf"^{re.escape(container)}\.\d+$") if container else None
    is_block = [block_pattern is not None and bool(block_pattern.match(_key(r[0].module_path, block_depth)))
                for r in runs]
    weights = sorted(_weight(r) for r, block in zip(runs, is_block) if block or not any(is_block))
    typical = weights[len(weights) // 2] if weights else 0.0
    tail = _tail_start(runs, is_block)
    whole_blocks = granularity is Granularity.BLOCK

    def is_light(i: int) -> bool:
        return not (is_block[i] and whole_blocks) and i != tail and _weight(runs[i]) < min_share * typical

    block_of = [_key(r[0].module_path, block_depth) if block else None for r, block in zip(runs, is_block)]
    merged: list[list[NodeProfile]] = []
    merged_block: str | None = None  # the block of the last run in merged[-1]
    pending: list[NodeProfile] = []
    for i, run in enumerate(runs):
        if is_light(i) and merged and (block_of[i] is None or block_of[i] == merged_block):
            merged[-1].extend(run)  # a block's light run stays in its block: finer stages nest in the blocks
        elif is_light(i):
            pending.extend(run)
        else:
            merged.append(pending + run)
            pending = []
            merged_block = block_of[i]
    if pending:
        merged.append(pending)
    tail_nodes = {n.name for run in runs[tail:] for n in run} if tail is not None else set()
    merged = _merge_lightest_pairs(_respect_in_place_writes(merged), max_stages)
    return [StageSpec(_tail_name(run, depth) if run[-1].name in tail_nodes and run[0].name in tail_nodes
                      else _stage_name(run, depth), tuple(n.name for n in run)) for run in merged]


def refinement(coarse: Sequence[StageSpec], fine: Sequence[StageSpec]) -> tuple[tuple[int, int], ...] | None:
    """For each of the ``coarse`` stages, the ``[start, stop)`` range of the ``fine`` stages that make it up; None
    when a fine stage straddles a coarse boundary (the same nodes, cut in other places).

    >>> spec = lambda *nodes: StageSpec("", nodes)
    >>> refinement([spec("a", "b"), spec("c")], [spec("a"), spec("b"), spec("c")])
    ((0, 2), (2, 3))
    >>> refinement([spec("a", "b"), spec("c")], [spec("a"), spec("b", "c")]) is None
    True
    """
    ranges, position = [], 0
    for stage in coarse:
        start, covered = position, 0
        while covered < len(stage.nodes) and position < len(fine):
            covered += len(fine[position].nodes)
            position += 1
        if covered != len(stage.nodes) or [n for f in fine[start:position] for n in f.nodes] != list(stage.nodes):
            return None
        ranges.append((start, position))
    return tuple(ranges) if position == len(fine) else None


def _tail_start(runs: Sequence[Sequence[NodeProfile]], is_block: Sequence[bool]) -> int | None:
    """The first run after the last repeated block, when what follows the blocks allocates memory (a final norm,
    a head, a loss): it starts a stage of its own, so a plan can recompute the last block and keep the head's
    tensors, as checkpointing every block does. Views and reshapes alone stay with the last block."""
    if not any(is_block):
        return None
    start = max(i for i, block in enumerate(is_block) if block) + 1
    allocates = any(n.created_bytes for run in runs[start:] for n in run)
    return start if allocates else None


def _merge_lightest_pairs(runs: list[list[NodeProfile]], max_stages: int) -> list[list[NodeProfile]]:
    """Merge the adjacent pair of runs with the least total weight (the leftmost on ties) until at most
    ``max_stages`` remain; a heap over pairs keeps it ``n log n`` on graphs of many thousand runs."""
    weights = [_weight(run) for run in runs]  # integers: merged weights add up exactly
    following = list(range(1, len(runs) + 1))
    preceding = list(range(-1, len(runs) - 1))
    version = [0] * len(runs)  # bumped when a run grows or goes, so stale pairs are skipped
    heap = [(weights[i] + weights[i + 1], i, 0, 0) for i in range(len(runs) - 1)]
    heapq.heapify(heap)
    remaining = len(runs)
    while remaining > max_stages:
        _, i, version_i, version_j = heapq.heappop(heap)
        j = following[i]
        if version[i] != version_i or j >= len(runs) or version[j] != version_j:
            continue
        runs[i].extend(runs[j])
        weights[i] += weights[j]
        version[i] += 1
        version[j] = -1
        following[i] = following[j]
        if following[j] < len(runs):
            preceding[following[j]] = i
        remaining -= 1
        if preceding[i] >= 0:
            heapq.heappush(heap, (weights[preceding[i]] + weights[i], preceding[i], version[preceding[i]], version[i]))
        if following[i] < len(runs):
            heapq.heappush(heap, (weights[i] + weights[following[i]], i, version[i], version[following[i]]))
    return [run for run, v in zip(runs, version) if v >= 0]


def _stage_name(run: Sequence[NodeProfile], depth: int) -> str:
    keys = Counter(_key(n.module_path, depth) for n in run)
    heaviest = max(keys, key=lambda k: _weight([n for n in run if _key(n.module_path, depth) == k]))
    return heaviest or "<root>"


def _tail_name(run: Sequence[NodeProfile], depth: int) -> str:
    """The tail stage by its modules in order (``model.norm+lm_head``), or their common path
    (``cls.predictions``); modules that hold another of them (``transformer`` of ``transformer.ln_f``) are left out.

    >>> profile = lambda path: NodeProfile("n", path, 0.0, 0, (), frozenset(), frozenset(), frozenset(), False)
    >>> _tail_name([profile(p) for p in ("model.norm", "", "lm_head", "")], 3)
    'model.norm+lm_head'
    >>> _tail_name([profile(p) for p in ("cls.predictions.transform.dense", "cls.predictions.decoder")], 4)
    'cls.predictions'
    """
    keys = list(dict.fromkeys(_key(n.module_path, depth) for n in run if n.module_path))
    common = _common_path(keys)
    if common or not keys:
        return common or "<root>"
    innermost = [k for k in keys if not any(other.startswith(k + ".") for other in keys)]
    return "+".join(innermost[:3]) + ("+..." if len(innermost) > 3 else "")


def _common_path(paths: Sequence[str]) -> str:
    """The longest dotted path every one of ``paths`` is in ("" when none)."""
    split = [p.split(".") for p in paths]
    common = []
    for parts in zip(*split):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _respect_in_place_writes(stages: list[list[NodeProfile]]) -> list[list[NodeProfile]]:
    """Stages moved so that an in-place op runs in the stage that made what it reads (``h.relu_()`` on a block's
    output joins that block): a stage that wrote an earlier stage's tensor in place could be measured only through
    views of it, and recomputed it would write it again. A cut that would fall between a value and a write to it
    moves to just after the write (the write and what precedes it join the earlier stage), or goes.

    >>> from planner.profile import StorageRecord
    >>> def node(name, made=(), reads=(), writes=()):
    ...     return NodeProfile(name, "", 1.0, 0, tuple(StorageRecord(k, 4, True) for k in made), frozenset(reads),
    ...                        frozenset(), frozenset(), not made, writes=frozenset(writes))
    >>> stages = [[node("mm", [1])], [node("relu_", reads=[1], writes=[1]), node("mm_1", [2], reads=[1])]]
    >>> [[n.name for n in stage] for stage in _respect_in_place_writes(stages)]
    [['mm', 'relu_'], ['mm_1']]
    """
    nodes = [n for stage in stages for n in stage]
    made_at = {record.key: i for i, n in enumerate(nodes) for record in n.created}
    reach = list(range(len(nodes)))  # reach[i]: no cut may fall in (reach[i], i]
    for i, n in enumerate(nodes):
        reach[i] = min([i] + [made_at[k] for k in n.writes if k in made_at])
    earliest_after = reach[:]  # earliest_after[i] = min(reach[i:])
    for i in range(len(nodes) - 2, -1, -1):
        earliest_after[i] = min(earliest_after[i], earliest_after[i + 1])
    cuts, position = [], 0
    for stage in stages[:-1]:
        position += len(stage)
        cut = position
        while cut < len(nodes) and earliest_after[cut] < cut:
            cut += 1
        if cut < len(nodes) and (not cuts or cut > cuts[-1]):
            cuts.append(cut)
    bounds = [0, *cuts, len(nodes)]
    return [nodes[a:b] for a, b in zip(bounds, bounds[1:])]


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (dropout, rand...), so caching it would shift the recomputed RNG."""
    import torch
    target = node.target
    if not hasattr(target, "tags") or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if target is torch.ops.aten.scaled_dot_product_attention.default:
        dropout_p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return bool(dropout_p)
    return True


def never_cached(nodes: Sequence[fx.Node]) -> set[str]:
    """The nodes among ``nodes`` that no region may cache: the calls of the user's autograd.Functions
    (:mod:`planner.functions`), and the random nodes: all of them, but for the dropout masks of
    :mod:`planner.dropout` when they are the only random nodes. A kept mask draws nothing while its region is
    recomputed; each other mask replays from its own generator state, but a plain random op after it would draw
    from the wrong state.

    >>> import torch
    >>> from planner.capture import capture
    >>> captured = capture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)), (torch.randn(2, 4),))
    >>> never_cached(list(captured.compute_nodes()))
    set()
    """
    functions = {n.name for n in nodes if calls_function(n)}  # a cache of one would hold every op of its forward
    random = [n for n in nodes if is_random(n)]
    if all(is_mask(n) for n in random):
        return functions
    return functions | {n.name for n in random}


def passes_gradient_through(node: fx.Node) -> bool:
    """Whether ``node`` adds two tensors of its own shape and dtype with no scaling (a residual connection): its
    backward hands the one incoming gradient to both inputs, without a copy.

    >>> import torch
    >>> from planner.capture import capture
    >>> class Residual(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.linear = torch.nn.Linear(4, 4)
    ...     def forward(self, x):
    ...         return x + self.linear(x) + torch.ones(4)
    >>> nodes = capture(Residual(), (torch.randn(2, 4),)).compute_nodes()
    >>> [n.name for n in nodes if passes_gradient_through(n)]   # the second add broadcasts a vector
    ['add']
    """
    import torch
    if node.target is not torch.ops.aten.add.Tensor or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return False
    values = [getattr(a, "meta", {}).get("val") for a in (*node.args, node)]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return False
    return all(v.shape == values[-1].shape and v.dtype == values[-1].dtype for v in values[:-1])


def _cache_candidates(stage_nodes: Sequence[NodeProfile], random_nodes: set[str],
                      always_kept: AbstractSet[str]) -> list[NodeProfile]:
    usable = [n for n in stage_nodes if n.created and n.transient_bytes == 0 and not n.output_is_view
              and not n.mutates_created and n.name not in random_nodes and n.name not in always_kept and n.seconds > 0]
    return sorted(usable, key=lambda n: n.seconds / n.created_bytes, reverse=True)


def recompute_options(stage_nodes: Sequence[NodeProfile], random_nodes: set[str],
                      always_kept: AbstractSet[str] = frozenset(),
                      masks: AbstractSet[str] = frozenset()) -> tuple[RecomputeOption, ...]:
    """Selective-checkpoint menu for one stage: nothing cached; its dropout ``masks`` alone (one byte per element
    that spares the re-run its random draws); its matmuls; then the best time-per-byte nodes in growing shares.
    ``always_kept``: nodes every option that caches anything keeps too (the generator states of dropout masks)."""
    forward = sum(n.seconds for n in stage_nodes)
    options = [RecomputeOption("recompute_all", frozenset(), forward)]
    candidates = _cache_candidates(stage_nodes, random_nodes, always_kept)
    kept = frozenset(n.name for n in stage_nodes if n.name in always_kept)
    total = sum(n.created_bytes for n in candidates)
    seen: set[frozenset[str]] = {frozenset()}
    matmuls = frozenset(n.name for n in candidates if n.flops > 0)
    menus = [("cache_masks", frozenset(n.name for n in candidates if n.name in masks)), ("cache_matmuls", matmuls)]
    for share in CACHE_SHARES:
        chosen, acc = [], 0
        for n in candidates:
            if acc >= share * total:
                break
            chosen.append(n.name)
            acc += n.created_bytes
        menus.append((f"cache_{int(share * 100)}pct", frozenset(chosen)))
    by_name = {n.name: n for n in stage_nodes}
    for name, cached in menus:
        if cached and cached not in seen:
            seen.add(cached)
            cached |= kept
            options.append(RecomputeOption(name, cached, max(0.0, forward - sum(by_name[c].seconds for c in cached))))
    return tuple(options)


def tensor_name(node: str, key: int) -> str:
    """The name of the tensor (``TensorInfo.name``) that ``node`` allocated as the profile's storage ``key``."""
    return f"{node}#{key}"


def created_tensors(profile: GraphProfile) -> dict[str, tuple[tuple[str | None, int], ...]]:
    """Per node, what it allocates, in order: the name of each tensor the problem keeps of it (None for one it
    frees itself) and its bytes: what :func:`~planner.profile.measure_stages` names the storages of its step by.

    >>> from planner.profile import NodeProfile, StorageRecord
    >>> norm = NodeProfile("norm", "", 0.0, 0, (StorageRecord(7, 400, True), StorageRecord(8, 16, False)),
    ...                    frozenset(), frozenset(), frozenset(), False)
    >>> created_tensors(GraphProfile((norm,), frozenset(), {}, 0))
    {'norm': (('norm#7', 400), (None, 16))}
    """
    return {n.name: tuple((tensor_name(n.name, r.key) if r.survives else None, r.nbytes) for r in n.created)
            for n in profile.nodes}


def build_problem(profile: GraphProfile, stages: Sequence[StageSpec], *, random_nodes: set[str],
                  extra_fixed_bytes: int = 0, name: str = "", hold_outputs: bool = True,
                  always_kept: AbstractSet[str] = frozenset(), masks: AbstractSet[str] = frozenset(),
                  pass_through: AbstractSet[str] = frozenset(), gradients_held: bool = False) -> Problem:
    """Tensors, stages and options of ``profile`` cut into ``stages``; workspaces are zero until calibrated.
    ``random_nodes`` are never cached; ``always_kept`` are cached by every option that caches anything; ``masks``
    (dropout masks) make an option of their own (see :func:`recompute_options`); ``pass_through`` nodes hand one
    gradient to both their inputs (:func:`passes_gradient_through`, :func:`_crossing_gradient_bytes`).

    ``hold_outputs``: the caller keeps the model's outputs alive through the backward (see ``measure_stages``).
    Nodes whose backward never runs (cut off by a ``no_grad`` block: ``NodeProfile.in_backward``) save nothing
    for it, send no gradients back and give their parameters none. ``gradients_held``: the step begins with the
    parameters holding their gradients (gradient accumulation; ``extra_fixed_bytes`` counts them), so no stage's
    backward makes any that stays (``Stage.grad_bytes`` 0; ``Stage.largest_grad_bytes`` as without).
    """
    stage_of = {node: i for i, spec in enumerate(stages) for node in spec.nodes}
    by_name = {n.name: n for n in profile.nodes}
    readers: dict[int, set[int]] = {}
    savers: dict[int, set[int]] = {}
    for n in profile.nodes:
        for key in n.reads:
            readers.setdefault(key, set()).add(stage_of[n.name])
        for key in n.saved if n.in_backward else ():
            savers.setdefault(key, set()).add(stage_of[n.name])
    tensors = []
    released: list[dict[int, int]] = [{} for _ in stages]  # per stage: storages it reads last, nothing saves
    made: dict[int, TensorInfo] = {}  # storage key -> its tensor
    for n in profile.nodes:
        producer = stage_of[n.name]
        for record in n.created:
            if not record.survives:
                continue
            tensors.append(TensorInfo(
                name=tensor_name(n.name, record.key), nbytes=record.nbytes, producer=producer, node=n.name,
                seconds=n.seconds, module_path=n.module_path,
                consumers=frozenset(readers.get(record.key, set()) - {producer}),
                savers=frozenset(savers.get(record.key, set())),
                is_output=hold_outputs and record.key in profile.output_keys,
                returned=record.key in profile.output_keys))
            made[record.key] = tensors[-1]
            if (reader := last_rerun_reader(tensors[-1])) is not None:
                released[reader][record.key] = record.nbytes
    grads = [0] * len(stages) if gradients_held else stage_gradient_bytes(profile, stage_of, len(stages))
    largest_grads = largest_stage_gradient_bytes(profile, stage_of, len(stages))
    output_grads = _crossing_gradient_bytes(profile, stage_of, readers, pass_through)
    makes_output = _stages_making_outputs(profile, stage_of)
    built = []
    for i, spec in enumerate(stages):
        nodes = [by_name[x] for x in spec.nodes]
        options = recompute_options(nodes, random_nodes, always_kept, masks)
        built.append(Stage(spec.name, forward_seconds=sum(n.seconds for n in nodes), backward_seconds=0.0,
                           grad_bytes=grads[i], largest_grad_bytes=largest_grads[i],
                           output_grad_bytes=output_grads[i],
                           options=options[:1] if i in makes_output else options,
                           early_stop_seconds=early_stop_seconds(nodes),
                           saves_nothing=not any(n.in_backward and (n.saved or n.made_by_last_save is not None)
                                                 for n in nodes)))
    problem = Problem(tuple(built), tuple(tensors), profile.fixed_bytes + extra_fixed_bytes, name)
    last_use = {key: max(readers.get(key, set()) | savers.get(key, set())) for key in readers.keys() | savers.keys()}
    return _with_replayed_workspaces(problem, [[by_name[x] for x in spec.nodes] for spec in stages], released,
                                     made, lambda key, k: last_use.get(key, -1) > k or key in profile.output_keys)


def stage_gradient_bytes(profile: GraphProfile, stage_of: dict[str, int], num_stages: int) -> list[int]:
    """Per stage, the bytes of the parameter gradients its backward makes (``profile.param_grad_bytes``): each
    parameter's, at the last stage that reads it (whose backward finishes it)."""
    grads = [0] * num_stages
    for param, stage in _finishing_stages(profile, stage_of).items():
        grads[stage] += profile.param_grad_bytes.get(param, 0)
    return grads


def largest_stage_gradient_bytes(profile: GraphProfile, stage_of: dict[str, int], num_stages: int) -> list[int]:
    """Per stage, the largest of the parameter gradients its backward finishes (see :func:`stage_gradient_bytes`),
    0 where it finishes none (``Stage.largest_grad_bytes``)."""
    largest = [0] * num_stages
    for param, stage in _finishing_stages(profile, stage_of).items():
        largest[stage] = max(largest[stage], profile.param_grad_bytes.get(param, 0))
    return largest


def _finishing_stages(profile: GraphProfile, stage_of: dict[str, int]) -> dict[str, int]:
    """Each parameter the backward reaches, and the last stage that reads it (whose backward finishes its
    gradient)."""
    finishing: dict[str, int] = {}
    for n in profile.nodes:
        for param in n.param_reads if n.in_backward else ():
            finishing[param] = max(finishing.get(param, -1), stage_of[n.name])
    return finishing


def _crossing_gradient_bytes(profile: GraphProfile, stage_of: dict[str, int], readers: dict[int, set[int]],
                             pass_through: AbstractSet[str] = frozenset()) -> Counter:
    """Per stage ``k``: bytes of the activation gradients alive when its backward starts, before it runs: those of
    every tensor made by stage ``k`` or an earlier one that a later stage reads (its gradient is made by the
    backward of its last reader, summed by the others', and consumed by its maker's). On a chain these are the
    gradients of ``k``'s own outputs; T5's position bias, made in the first block and read by every other, or an
    encoder's output, read by every cross-attention, count at every stage in between.

    A residual add (one of ``pass_through``) that is the last reader of both its inputs hands them one gradient,
    without a copy: the input made later is not counted again. At ``sublayer`` granularity, ResNet's recomputed
    blocks were predicted one feature map above what they measured while both counted (4.3% over at the smallest
    peak)."""
    made = {record.key: (stage_of[n.name], record.nbytes) for n in profile.nodes for record in n.created}
    shared: set[int] = set()
    for n in profile.nodes:
        inputs = sorted(n.reads & made.keys(), key=lambda key: made[key][0])
        if n.name in pass_through and len(inputs) == 2 and made[inputs[0]][1] == made[inputs[1]][1] \
                and all(max(readers.get(key, {-1})) == stage_of[n.name] for key in inputs):
            shared.add(inputs[1])
    crossing = Counter()
    for n in profile.nodes:
        if not n.in_backward:
            continue
        producer = stage_of[n.name]
        for record in n.created:
            if record.requires_grad and record.key not in shared:
                for k in range(producer, max(readers.get(record.key, set()), default=producer)):
                    crossing[k] += record.nbytes
    return crossing


def _with_replayed_workspaces(problem: Problem, stage_nodes: Sequence[Sequence[NodeProfile]],
                              released: Sequence[dict[int, int]], made: dict[int, TensorInfo],
                              outlives: Callable[[int, int], bool]) -> Problem:
    """``problem`` with what replays of its stages' re-runs tell: the recompute workspace of every caching option
    (see :func:`caching_workspace`), the forward workspace of every option inside a region
    (:func:`checkpointed_forward_peak`), a re-run's working set when its region stops early after it
    (:func:`stopped_rerun_peak`), and what holding the storages each stage frees (``released[k]``, by key, with
    their bytes; ``made[key]``: its tensor) adds to it, per set of them that can be held apart and all of them
    held (:func:`held_input_sets`), and how much of that is not there when its region made some of them
    (:func:`input_savings`). ``outlives(key, k)``: whether a
    storage of stage ``k`` is read or saved by a later stage, or is an output. Options that cache nothing keep the
    calibrated forward workspace: a region that caches nothing stops its re-run early, and until then repeats the
    eager forward."""
    own: list[list[TensorInfo]] = [[] for _ in problem.stages]
    for t in problem.tensors:
        own[t.producer].append(t)
    stages = []
    for k, (stage, nodes) in enumerate(zip(problem.stages, stage_nodes)):
        def outlives_k(key: int, k: int = k) -> bool:
            return outlives(key, k)
        options = tuple(dataclasses.replace(
            o, forward_bytes=checkpointed_forward_peak(nodes, o.cached_nodes, outlives_k),
            workspace_bytes=caching_workspace(nodes, own[k], o.cached_nodes, outlives_k) if o.cached_nodes else None)
            for o in stage.recompute_options)
        held = held_input_sets(nodes, released[k], made, outlives_k)
        made_by = {key: made[key].producer for key in released[k]}
        savings = input_savings(nodes, [o.cached_nodes for o in stage.recompute_options], released[k], made_by,
                                outlives_k)
        stage = dataclasses.replace(stage, stopped_rerun_bytes=stopped_rerun_peak(nodes, outlives_k),
                                    held_input_bytes=max((h.excess_bytes for h in held), default=0),
                                    held_inputs=held, input_savings=savings)
        stages.append(dataclasses.replace(stage, options=options) if stage.options else stage)
    return dataclasses.replace(problem, stages=tuple(stages))


def _stop_index(nodes: Sequence[NodeProfile]) -> int | None:
    """The index of the last of ``nodes`` that saves a tensor for the backward (None when none does)."""
    return max((i for i, n in enumerate(nodes) if n.in_backward and (n.saved or n.made_by_last_save is not None)),
               default=None)


def early_stop_seconds(nodes: Sequence[NodeProfile]) -> float:
    """The forward time the re-run of ``nodes`` (one stage, in order) skips as the last stage of a region that
    caches nothing: non-reentrant checkpoint stops the re-run when the op that saves the last tensor the backward
    needs saves it, so the ops after it never run, nor does that op itself when it had made nothing by then
    (autograd saves an op's inputs before the op runs: a convolution or a linear layer ending a stage is not run
    again). All of them when the stage saves nothing; nothing when it is unknown what the last op had made.

    At sublayer granularity on ResNet (test size, one thread), a convolution checkpointed alone re-ran in 0.06 ms
    against its forward's 0.76 ms, and plans of many such regions were predicted up to 1 ms a step over measured.

    >>> from planner.profile import StorageRecord
    >>> def node(name, seconds, saved=(), made=None):
    ...     record = (StorageRecord(7, 100, True),)
    ...     return NodeProfile(name, "", seconds, 0, record, frozenset(), frozenset(saved), frozenset(), False,
    ...                        made_by_last_save=made)
    >>> early_stop_seconds([node("relu", 1.0, saved={7}, made=1), node("conv", 2.0, made=0)])  # conv saves its input
    2.0
    >>> early_stop_seconds([node("conv", 2.0, made=0), node("relu", 1.0, saved={7}, made=1), node("view", 0.5)])
    0.5
    """
    stop = _stop_index(nodes)
    if stop is None:
        return sum(n.seconds for n in nodes)
    skipped = sum(n.seconds for n in nodes[stop + 1:])
    return skipped + (nodes[stop].seconds if nodes[stop].made_by_last_save == 0 else 0.0)


def stopped_rerun_peak(nodes: Sequence[NodeProfile], outlives: Callable[[int], bool]) -> int | None:
    """The most bytes of storages made by ``nodes`` (one stage, in order) alive at once while the stage re-runs as
    the last of a checkpoint region that caches nothing: non-reentrant checkpoint stops the re-run after the op
    that saves the last tensor the backward needs (``early_stop``), and until then what the stage made is alive
    when a node saves it, when a later node of the stage still reads it, or when ``outlives(key)`` (the body
    returns it); each node adds what it frees again before it returns. Of the node it stops at, only what it had
    made when it saved its last tensor counts: autograd saves an op's inputs before the op runs (a linear layer
    stops before making its output), its outputs after. None when the stage saves nothing.

    >>> from planner.profile import StorageRecord
    >>> def node(name, made, reads=(), saved=()):
    ...     records = tuple(StorageRecord(key, size, True) for key, size in made)
    ...     return NodeProfile(name, "", 1.0, 0, records, frozenset(reads), frozenset(saved), frozenset(), False)
    >>> nodes = [node("mm", [(1, 100)]), node("relu", [(2, 100)], {1}, {2}), node("add", [(3, 100)], {1, 2})]
    >>> stopped_rerun_peak(nodes, lambda key: key == 3)   # stops after relu, 1 still to be read by add
    200
    """
    stopped = _stopped_run(nodes)
    if stopped is None:
        return None
    run, read_later = stopped
    return replayed_recompute_peak(run, frozenset(), lambda key: outlives(key) or key in read_later)


def _stopped_run(nodes: Sequence[NodeProfile]) -> tuple[list[NodeProfile], set[int]] | None:
    """What the re-run of ``nodes`` runs when its region stops early after them (see :func:`stopped_rerun_peak`),
    and the storages read from the node it stops at on, alive until it stops; None when they save nothing."""
    stop = _stop_index(nodes)
    if stop is None:
        return None
    read_later = {key for n in nodes[stop:] for key in n.reads}
    last = nodes[stop]
    if last.made_by_last_save is not None:
        last = dataclasses.replace(last, created=last.created[:last.made_by_last_save], busiest_bytes=None)
    return [*nodes[:stop], last], read_later


HELD_INPUT_GROUPS = 4  # sets of held inputs told apart per stage (every union of them); past that, any of them held
# counts as all of them


def held_input_sets(nodes: Sequence[NodeProfile], inputs: dict[int, int], made: dict[int, TensorInfo],
                    outlives: Callable[[int], bool]) -> tuple[HeldInputs, ...]:
    """What a stage's replayed forward peak (its ``nodes``, replayed node by node, nothing cached) rises by while
    some of its ``inputs`` (storages of earlier stages it reads last and nothing saves, by key, with their bytes;
    ``made[key]``: each one's tensor) stay alive throughout it, as a checkpoint region's inputs or a cache keep
    them, over when each dies after its last reader, as in the eager step: the calibrated forward workspace
    already has them where they are alive at the stage's busiest moment. For every union of the groups that are
    held or not together (same producer, readers and node: the same region input, the same cache); over
    ``HELD_INPUT_GROUPS`` groups, what holding them all adds for each group alone. Only the sets that add more
    than every set within them: the most any adds is what holding all of them adds (``Stage.held_input_bytes``).

    A ReLU reading a BatchNorm's output makes its own output while the input is alive: nothing more (ResNet's
    sublayer re-runs were one feature map over when all of the input was added). T5's cross-attention bias, read
    at the start of each decoder block, is freed before the attention's peak in the last one: all of it.

    >>> from planner.profile import StorageRecord
    >>> def node(name, made, reads=()):
    ...     records = tuple(StorageRecord(key, size, True) for key, size in made)
    ...     return NodeProfile(name, "", 1.0, 0, records, frozenset(reads), frozenset(), frozenset(), False)
    >>> bn = {1: TensorInfo("bn", 100, 0, frozenset({1}))}
    >>> held_input_sets([node("relu", [(2, 100)], {1})], {1: 100}, bn, lambda key: key == 2)
    ()
    >>> bias = {1: TensorInfo("bias", 48, 0, frozenset({1}))}
    >>> held_input_sets([node("add", [(2, 10)], {1}), node("attention", [(3, 500)], {2})], {1: 48}, bias,
    ...                 lambda key: key == 3)
    (HeldInputs(tensors=frozenset({'bias'}), excess_bytes=48),)
    >>> stage = [node("add", [(3, 50)], {1}), node("softmax", [(4, 400)], {2, 3})]   # frees 1, then 2
    >>> made = {1: TensorInfo("bias", 100, 0, frozenset({2})), 2: TensorInfo("mask", 10, 1, frozenset({2}))}
    >>> sets = held_input_sets(stage, {1: 100, 2: 10}, made, lambda key: key == 4)
    >>> [(sorted(h.tensors), h.excess_bytes) for h in sets]   # the mask is alive at the softmax anyway
    [(['bias'], 100)]
    """
    if not inputs:
        return ()
    groups: dict[tuple, set[int]] = {}
    for key in inputs:
        t = made[key]
        groups.setdefault((t.producer, t.consumers, t.node), set()).add(key)
    alive = _replayed_alive(nodes, frozenset(), outlives)
    last_reader = {key: i for i, n in enumerate(nodes) for key in n.reads if key in inputs}
    eager = _held_peak(alive, last_reader, inputs, set())

    def excess(keys: AbstractSet[int]) -> int:
        return _held_peak(alive, last_reader, inputs, keys) - eager

    def named(keys: AbstractSet[int]) -> frozenset[str]:
        return frozenset(made[key].name for key in keys)

    parts = list(groups.values())
    if len(parts) > HELD_INPUT_GROUPS:
        most = excess(inputs.keys())
        return tuple(HeldInputs(named(part), most) for part in parts) if most > 0 else ()
    sets: list[HeldInputs] = []
    for size in range(1, len(parts) + 1):
        for combination in itertools.combinations(parts, size):
            keys = set().union(*combination)
            extra, names = excess(keys), named(keys)
            if extra > max((h.excess_bytes for h in sets if h.tensors <= names), default=0):
                sets.append(HeldInputs(names, extra))
    return tuple(sets)


def input_savings(nodes: Sequence[NodeProfile], options: Sequence[frozenset[str]], inputs: dict[int, int],
                  made_by: dict[int, int], outlives: Callable[[int], bool]) -> tuple[InputSaving, ...]:
    """What a stage's re-run (its ``nodes``) with each option (the nodes it caches) holds less than its working
    set counts when its region made some of its ``inputs`` (storages of earlier stages it reads last, which
    nothing saves; ``made_by[key]``: the stage that makes each): those die inside it, as in the eager step, where
    the working set holds all of them as a region holds its inputs; the rest are the region's inputs. One
    :class:`~planner.problem.InputSaving` for each stage that makes some, from the latest: a region starting
    there or earlier made those and the later ones. An option that caches nothing counts the least of that for
    a re-run that runs through and one that stops early after the stage (inputs read from the node it stops at
    on stay alive until it stops), so that neither is under-counted; one that caches, its own replay. Where a
    later stage of the region follows, the re-run runs through: what that saves is kept apart where it is more
    (``InputSaving.through_bytes``). BART's residual add after the cross-attention reads the attention's output
    last, and its re-run stops at the dropout that reads it: no saving there, 12,288 bytes running through, and a
    region over the whole decoder layer's first half measured that much under its prediction until it counted.

    T5's last decoder block frees the cross-attention bias and the position bias, made by the first decoder
    block, and the encoder's padding mask, made by the encoder's last block: a region from the first decoder
    block made the first two, and its re-run of the last block measured 61,440 bytes under its prediction until
    they counted; a block caching its matmuls, 61,488 bytes.

    >>> from planner.profile import StorageRecord
    >>> def node(name, made, reads=(), saved=()):
    ...     records = tuple(StorageRecord(key, size, True) for key, size in made)
    ...     return NodeProfile(name, "", 1.0, 0, records, frozenset(reads), frozenset(saved), frozenset(), False,
    ...                        made_by_last_save=len(made) if saved else None)
    >>> stage = [node("add", [(3, 100)], {1, 2}), node("mm", [(4, 500)], {3}, saved={3})]
    >>> savings = input_savings(stage, [frozenset(), frozenset({"add"})], {1: 40, 2: 60}, {1: 0, 2: 1},
    ...                         lambda key: key == 4)
    >>> [(s.since, s.option_bytes) for s in savings]   # the mm's peak comes after the add freed both inputs
    [(1, (60, 60)), (0, (100, 100))]
    """
    sinces = sorted({made_by[key] for key in inputs}, reverse=True)
    if not sinces:
        return ()
    last_reader = {key: i for i, n in enumerate(nodes) for key in n.reads if key in inputs}
    stopped = _stopped_run(nodes)
    if stopped is not None:
        run, read_later = stopped
        stop_alive = _replayed_alive(run, frozenset(), lambda key: outlives(key) or key in read_later)
        early = {key: size for key, size in inputs.items() if key not in read_later}
    alives = [_replayed_alive(nodes, cached, outlives) for cached in options]
    savings, most, most_through = [], [0] * len(options), [0] * len(options)
    for since in sinces:
        held = {key for key in inputs if made_by[key] < since}
        for o, (cached, alive) in enumerate(zip(options, alives)):
            through = _held_peak(alive, last_reader, inputs, inputs.keys()) \
                - _held_peak(alive, last_reader, inputs, held)
            saving = through
            if not cached and stopped is not None:
                saving = min(saving, _held_peak(stop_alive, last_reader, early, early.keys())
                             - _held_peak(stop_alive, last_reader, early, held))
            most[o] = max(most[o], saving)  # a region starting earlier made more: it never holds more
            most_through[o] = max(most_through[o], through)
        savings.append(InputSaving(since, tuple(most), tuple(most_through) if most_through != most else ()))
    return tuple(s for s in savings if any(s.option_bytes) or any(s.through_bytes))


def _held_peak(alive: Sequence[int], last_reader: dict[int, int], inputs: dict[int, int],
               held: AbstractSet[int]) -> int:
    """The most bytes alive while a stage runs node by node (``alive``: its own storages, per node), with its
    ``inputs`` (by key, with their bytes) alive until their last reader, but ``held`` ones to its end."""
    return max((own + sum(size for key, size in inputs.items() if key in held or last_reader.get(key, -1) >= i)
                for i, own in enumerate(alive)), default=0)


def checkpointed_forward_peak(nodes: Sequence[NodeProfile], cached: frozenset[str],
                              outlives: Callable[[int], bool]) -> int:
    """The forward workspace of a stage (its ``nodes``, in order) inside a checkpoint region: the most bytes its
    storages hold at once as its forward runs, less those :func:`~planner.problem.simulate` counts on their own
    all through that forward (cached ones, and those that ``outlives(key)``: read by a later stage or a model
    output), which appear one by one. The checkpoint keeps nothing the stage saves, so every other storage dies
    after its last reader in the stage; each node adds what it frees again before it returns
    (:func:`intra_node_excess`). Possibly negative: counted storages made late are not alive at the peak.

    >>> from planner.profile import StorageRecord
    >>> def node(name, made, reads=(), saved=()):
    ...     records = tuple(StorageRecord(key, size, True) for key, size in made)
    ...     return NodeProfile(name, "", 1.0, 0, records, frozenset(reads), frozenset(saved), frozenset(), False)
    >>> nodes = [node("mm", [(1, 100)]), node("relu", [(2, 100)], {1}, {2}), node("mm2", [(3, 10)], {2})]
    >>> checkpointed_forward_peak(nodes, frozenset(), lambda key: key == 3)   # 1 and 2 meet at relu; 3 counted
    190
    >>> checkpointed_forward_peak(nodes, frozenset({"relu"}), lambda key: key == 3)   # 2 is cached: counted
    90
    """
    last_reader = {key: i for i, n in enumerate(nodes) for key in n.reads}
    change = [0] * (len(nodes) + 1)
    counted = 0
    for i, n in enumerate(nodes):
        for record in n.created:
            if not record.survives:
                continue
            change[i] += record.nbytes
            if n.name in cached or outlives(record.key):
                counted += record.nbytes
            else:
                change[max(i, last_reader.get(record.key, i)) + 1] -= record.nbytes
    alive = peak = 0
    for i, n in enumerate(nodes):
        alive += change[i]
        peak = max(peak, alive + intra_node_excess(n))
    return peak - counted


def caching_workspace(nodes: Sequence[NodeProfile], tensors: Sequence[TensorInfo], cached: frozenset[str],
                      outlives: Callable[[int], bool]) -> int:
    """The recompute workspace of a stage (its ``nodes`` and ``tensors``) that caches ``cached``: the replayed
    peak of its re-run (:func:`replayed_recompute_peak`) beyond the tensors that
    :func:`~planner.problem.simulate` counts on their own all through the re-run, its cached and its kept ones
    (:func:`~planner.problem.keeps`). Possibly negative: a cache consumed early is not alive at the peak."""
    counted = sum(t.nbytes for t in tensors if t.node in cached or keeps(t))
    return replayed_recompute_peak(nodes, cached, outlives) - counted


def replayed_recompute_peak(nodes: Sequence[NodeProfile], cached: frozenset[str],
                            outlives: Callable[[int], bool]) -> int:
    """The most bytes of storages made by ``nodes`` (one stage, in order) alive at once while a selective-checkpoint
    region recomputes them with ``cached`` nodes cached, node by node, as the region's body runs it.

    Cached outputs are alive from the start (the forward left them in the cache) and cost nothing to make; every
    other node allocates its outputs, plus what it frees again before it returns (:func:`intra_node_excess`).
    A storage stays alive to the end once a node of the stage saves it for the backward (a recomputed copy) or
    ``outlives(key)`` (a later stage reads or saves it, so the body returns it; a caching region runs its body to
    the end); any other is freed after its last reader in the stage.

    >>> from planner.profile import StorageRecord
    >>> def node(name, made, reads=(), saved=()):
    ...     records = tuple(StorageRecord(key, size, True) for key, size in made)
    ...     return NodeProfile(name, "", 1.0, 0, records, frozenset(reads), frozenset(saved), frozenset(), False)
    >>> nodes = [node("mm", [(1, 100)]), node("relu", [(2, 100)], {1}, {2}), node("mm2", [(3, 10)], {2})]
    >>> replayed_recompute_peak(nodes, frozenset(), lambda key: key == 3)   # 1 freed once relu ran
    200
    >>> replayed_recompute_peak(nodes, frozenset({"mm2"}), lambda key: key == 3)   # 3 cached from the start
    210
    """
    return max(_replayed_alive(nodes, cached, outlives), default=0)


def _replayed_alive(nodes: Sequence[NodeProfile], cached: frozenset[str], outlives: Callable[[int], bool]) -> list[int]:
    """Per node, the bytes of storages made by ``nodes`` alive while it runs (see :func:`replayed_recompute_peak`)."""
    last_reader = {key: i for i, n in enumerate(nodes) for key in n.reads}  # nodes come in order: the last wins
    saved = {key for n in nodes if n.in_backward for key in n.saved}
    change = [0] * (len(nodes) + 1)  # bytes that become alive at node i, less those freed after node i - 1
    for i, n in enumerate(nodes):
        first = 0 if n.name in cached else i
        for record in n.created:
            if record.survives:
                kept = record.key in saved or outlives(record.key)
                change[first] += record.nbytes
                change[len(nodes) if kept else max(i, last_reader.get(record.key, i)) + 1] -= record.nbytes
    alive, by_node = 0, []
    for i, n in enumerate(nodes):
        alive += change[i]
        by_node.append(max(0, alive + (0 if n.name in cached else intra_node_excess(n))))
    return by_node


def intra_node_excess(node: NodeProfile) -> int:
    """Bytes a node holds at its busiest beyond the storages it leaves behind: the temporaries of a composite op
    (the math path of ``scaled_dot_product_attention`` makes a float mask, a scaled query, the scores and their
    masked sum on its way to the saved probabilities and the output).

    The profiler measures the busiest moment (``busiest_bytes``). A profile without it (built by hand) says in
    which order a node made its storages and which outlived it, not when the others were freed, so the op is
    taken to run as a chain: temporaries made before its first lasting storage (inputs it converts or scales)
    live to its end, and every later one until the next storage is made (the step that consumes it).

    >>> from planner.profile import StorageRecord
    >>> made = [(50, False), (100, True), (400, False), (400, False), (100, True)]   # (bytes, outlives the node)
    >>> records = tuple(StorageRecord(key, size, lasting) for key, (size, lasting) in enumerate(made))
    >>> intra_node_excess(NodeProfile("attention", "", 1.0, 0, records, frozenset(), frozenset(), frozenset(), False))
    750
    >>> intra_node_excess(NodeProfile("attention", "", 1.0, 0, records, frozenset(), frozenset(), frozenset(), False,
    ...                               busiest_bytes=700))   # measured: the scores were freed sooner
    500
    """
    if node.busiest_bytes is not None:
        return max(0, node.busiest_bytes - sum(r.nbytes for r in node.created if r.survives))
    setup = lasting = previous = busiest = 0  # previous: the temporary made last, alive while the next is made
    for record in node.created:
        size = record.nbytes
        if record.survives:
            lasting += size
            busiest = max(busiest, setup + lasting + previous)
            previous = 0
        elif not lasting:
            setup += size
            busiest = max(busiest, setup)
        else:
            busiest = max(busiest, setup + lasting + previous + size)
            previous = size
    return busiest - lasting


def _stages_making_outputs(profile: GraphProfile, stage_of: dict[str, int]) -> set[int]:
    """Stages that allocate one of the model's outputs: they are recomputed whole or not at all. A region that caches
    runs its recomputation to its end (so it consumes every cached value), which makes the output again beside the
    one the caller holds; one that caches nothing stops early."""
    return {stage_of[n.name] for n in profile.nodes if any(r.key in profile.output_keys for r in n.created)}


def calibrate(problem: Problem, measured: StageMeasurement) -> Problem:
    """Set workspaces and backward times so that the model reproduces the measured eager step stage by stage. A stage's
    recompute workspace is its forward workspace and what the eager step frees inside it that a region may hold
    through its re-run adds to it (``Stage.held_input_bytes``, :func:`held_input_sets`; where unknown, all of it:
    :func:`_released_in_reader`). Where the model counts more in a stage's forward than its measured peak (those
    inputs, counted all through it), the forward workspace is 0 and the difference is the forward's over-count,
    which holding those inputs takes back first (``Stage.forward_overcount_bytes``,
    :meth:`~planner.problem.Stage.held_input_forward`): T5's last decoder block frees the position and
    cross-attention biases early, and its forward measured 49,152 bytes over the prediction with the block before it
    checkpointed, which holds them as its inputs. What a stage's backward makes before it first reads a saved tensor
    (``StageMeasurement.before_first_unpack``) is alive while a region ending there is recomputed: it joins the
    gradients sent back past the stage (``Stage.output_grad_bytes``), as do the loss and the gradient the backward
    starts from (``StageMeasurement.loss_bytes``), which the measured backward workspaces hold already. A stage's
    backward peak is told apart by which tensors of earlier stages that it saves last were still alive
    (``Stage.backward_epochs``, :func:`backward_epochs`): T5's last stage (the final norm and the head) saves the
    last decoder block's output, and a region of that block caching it kept it alive through the stage's backward,
    where the model counted it twice (beside a workspace measured while it was still alive) and predicted the step
    24,576 bytes above its measurement."""
    events = simulate(problem, Schedule.store_all(problem.num_stages)).events
    forward = {e.stage: e for e in events if e.phase is Phase.FORWARD}
    backward = {e.stage: e for e in events if e.phase is Phase.BACKWARD}
    started = {e.stage: e for e in events if e.phase is Phase.BACKWARD_START}
    released = _released_in_reader(problem)  # where the profile does not say what holding them adds
    held = [released[k] if stage.held_input_bytes is None else stage.held_input_bytes
            for k, stage in enumerate(problem.stages)]
    before_rerun = measured.before_first_unpack or [0] * problem.num_stages
    releases = measured.backward_releases or [None] * problem.num_stages
    stages = []
    for k, stage in enumerate(problem.stages):
        fwd_ws = max(0, measured.forward_peak[k] - forward[k].activation_bytes)
        # the model counts the inputs the eager step frees before the stage's peak through all of it
        overcount = max(0, forward[k].activation_bytes - measured.forward_peak[k])
        counted = backward[k].activation_bytes + backward[k].gradient_bytes
        bwd_ws = max(0, measured.backward_peak[k] - counted)
        # the same measured peak seen from the stage's start (its own gradients then count as workspace)
        start_ws = max(0, measured.backward_peak[k] - started[k].activation_bytes - started[k].gradient_bytes)
        stages.append(dataclasses.replace(stage, forward_workspace_bytes=fwd_ws, backward_workspace_bytes=bwd_ws,
                                          forward_overcount_bytes=overcount,
                                          backward_start_workspace_bytes=start_ws,
                                          recompute_workspace_bytes=fwd_ws + held[k],
                                          output_grad_bytes=stage.output_grad_bytes + before_rerun[k]
                                          + measured.loss_bytes,
                                          backward_epochs=backward_epochs(problem, k, releases[k], counted, bwd_ws),
                                          backward_seconds=measured.backward_seconds[k]))
    return dataclasses.replace(problem, stages=tuple(stages))


def backward_epochs(problem: Problem, k: int, releases: BackwardReleases | None, counted_bytes: int,
                    workspace_bytes: int) -> tuple[BackwardEpoch, ...]:
    """Stage ``k``'s measured eager backward cut where it frees a tensor of an earlier stage that it saves last
    (one a schedule may keep alive past it: a cache, a region holding its inputs), from the frees the meter saw
    in it (``releases``; None where its backward shares a segment: no cut). Each epoch names those still alive in
    it and how far its peak is below the stage's (``workspace_bytes`` above ``counted_bytes``, what its backward
    event counts). An epoch that another needing no more whatever is kept makes idle is left out; so are all of
    them when they tell nothing apart, or would take more than the workspace off.

    >>> from planner.meter import Release
    >>> stages = (Stage("block", 1.0, 2.0), Stage("head", 1.0, 2.0))
    >>> x = TensorInfo("x#1", 400, 0, frozenset({1}), frozenset({1}), node="x")
    >>> seen = BackwardReleases((Release("logits#2", 1000), Release("x#1", 900), Release("grad#3", 600)), 700)
    >>> backward_epochs(Problem(stages, (x,)), 1, seen, 400, 600)
    (BackwardEpoch(alive=frozenset({'x#1'}), below_bytes=0), BackwardEpoch(alive=frozenset(), below_bytes=300))
    """
    if releases is None:
        return ()
    candidates = {t.name: t.nbytes for t in problem.tensors
                  if t.producer < k and t.savers and min(t.savers) == k and not t.is_output}
    alive = {r.label for r in releases.releases if r.label in candidates}
    epochs, peak = [], 0
    for release in releases.releases:
        peak = max(peak, release.peak_before_bytes)
        if release.label in alive:
            epochs.append((frozenset(alive), peak))
            alive.discard(release.label)
            peak = 0
    epochs.append((frozenset(alive), max(peak, releases.tail_peak_bytes)))
    below = [BackwardEpoch(names, workspace_bytes - max(0, peak - counted_bytes)) for names, peak in epochs]
    if any(e.below_bytes < 0 or e.below_bytes + sum(candidates[n] for n in e.alive) > workspace_bytes
           for e in below):
        return ()  # a peak above the stage's, or more taken off than its workspace: the meter missed something
    distinct = list(dict.fromkeys(below))
    kept = [e for e in distinct if not any(_needs_no_more(e, other, candidates) for other in distinct)]
    return tuple(kept) if any(e.alive for e in kept) else ()


def _needs_no_more(epoch: BackwardEpoch, other: BackwardEpoch, sizes: dict[str, int]) -> bool:
    """Whether ``epoch`` (not ``other``) is never busier than ``other``, whatever is kept alive: it is further below
    the peak by at least the bytes of ``other``'s tensors that are gone in it (``sizes``), the most a kept tensor
    can add to it and not to ``other``."""
    gone = sum(sizes[name] for name in other.alive - epoch.alive)
    return epoch != other and epoch.below_bytes - other.below_bytes >= gone


def _released_in_reader(problem: Problem) -> list[int]:
    """Per stage: bytes of the tensors made by earlier stages that it reads last and that nothing holds in an eager
    step. The eager step frees them inside the stage, so its measured forward workspace is what the stage needs
    with them gone; the re-run of a region that holds them (its inputs, which the checkpoint keeps) needs them
    too: T5's cross-attention bias (zeros, 48 KB at test size), made in the first decoder block and read by each,
    made the re-run of the last one 48 KB heavier than predicted.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(3))
    >>> bias = TensorInfo("bias", 48, 0, consumers=frozenset({1, 2}))
    >>> saved = TensorInfo("x", 8, 0, consumers=frozenset({2}), savers=frozenset({2}))
    >>> _released_in_reader(Problem(stages, (bias, saved)))
    [0, 0, 48]
    """
    released = [0] * problem.num_stages
    for t in problem.tensors:
        if (reader := last_rerun_reader(t)) is not None:
            released[reader] += t.nbytes
    return released


def scale_seconds(problem: Problem, factor: float) -> Problem:
    """Every time in ``problem`` (forward, backward, recomputation) times ``factor``: node and stage timings taken
    as the fastest of a few runs, scaled so that their eager step matches a typical measured one.

    >>> stages = (Stage("s", forward_seconds=1.0, backward_seconds=2.0),)
    >>> scaled = scale_seconds(Problem(stages, ()), 1.5).stages[0]
    >>> scaled.forward_seconds, scaled.backward_seconds, scaled.recompute_options[0].recompute_seconds
    (1.5, 3.0, 1.5)
    """
    return _retimed(problem, problem, lambda own, _: own * factor)


def _retimed(problem: Problem, source: Problem, seconds: Callable[[float, float], float]) -> Problem:
    """``problem`` with each of its stages' and tensors' times (forward, backward, early stop, each option's
    recomputation, each tensor's op) replaced by ``seconds(its own, source's)``, ``source`` having the same stages,
    options and tensors: the one list of what is a time, for :func:`scale_seconds` and :func:`with_seconds_of`."""
    stages = tuple(dataclasses.replace(
        s, forward_seconds=seconds(s.forward_seconds, t.forward_seconds),
        backward_seconds=seconds(s.backward_seconds, t.backward_seconds),
        early_stop_seconds=seconds(s.early_stop_seconds, t.early_stop_seconds),
        options=tuple(dataclasses.replace(o, recompute_seconds=seconds(o.recompute_seconds, to.recompute_seconds))
                      for o, to in zip(s.recompute_options, t.recompute_options)))
        for s, t in zip(problem.stages, source.stages))
    tensors = tuple(dataclasses.replace(x, seconds=seconds(x.seconds, t.seconds))
                    for x, t in zip(problem.tensors, source.tensors))
    return dataclasses.replace(problem, stages=stages, tensors=tensors)


def with_seconds_of(problem: Problem, timed: Problem) -> Problem:
    """``problem`` with every time of ``timed``, a problem posed for the same stages and recompute options (the
    same graph, its memory measured another way: with gradients held): forward, backward and recomputation times,
    the checkpoint machinery's costs; its memory stays its own. Raises ``ValueError`` where the two differ in
    stages or options.

    >>> memory = Problem((Stage("s", 1.0, 2.0, grad_bytes=0),), (), fixed_bytes=500)
    >>> times = Problem((Stage("s", 1.5, 2.5, grad_bytes=100),), (), region_seconds=0.25)
    >>> both = with_seconds_of(memory, times)
    >>> both.stages[0].forward_seconds, both.stages[0].grad_bytes, both.fixed_bytes, both.region_seconds
    (1.5, 0, 500, 0.25)
    """
    def shape(p: Problem) -> list:
        return [(s.name, [o.name for o in s.recompute_options]) for s in p.stages] + [t.name for t in p.tensors]
    if shape(problem) != shape(timed):
        raise ValueError("the problems differ in their stages, options or tensors")
    return dataclasses.replace(_retimed(problem, timed, lambda _, theirs: theirs),
                               region_seconds=timed.region_seconds, per_step_seconds=timed.per_step_seconds,
                               caching_region_seconds=timed.caching_region_seconds)


def add_checkpoint_overheads(problem: Problem, checkpoint_seconds: Sequence[float | Sequence[float]],
                             selective_seconds: Sequence[float | Sequence[float]]) -> Problem:
    """Charge each way of recomputing a stage what the checkpoint machinery costs beyond the recomputation itself:
    ``checkpoint_seconds[k]`` for running stage ``k`` in a region (saved-tensor hooks, the recomputation's
    bookkeeping) and ``selective_seconds[k]`` more when the option caches nodes (a dispatch mode sees every op).
    Each is one number for all of the stage's options, or one per option (the selective one ignored at index 0,
    which caches nothing). A correction may be negative (the sum of the nodes' own times over-counted); no option
    costs below zero, and what an early stop skips (``Stage.early_stop_seconds``, node time) shrinks with the
    first option's.

    >>> stage = Stage("s", 1.0, 2.0, early_stop_seconds=0.5)
    >>> [(s.recompute_options[0].recompute_seconds, s.early_stop_seconds)
    ...  for c in (0.25, -0.5) for s in add_checkpoint_overheads(Problem((stage,), ()), [c], [0.0]).stages]
    [(1.25, 0.5), (0.5, 0.25)]
    """
    stages = []
    for stage, hooks, selective in zip(problem.stages, checkpoint_seconds, selective_seconds):
        count = len(stage.recompute_options)
        options = tuple(dataclasses.replace(o, recompute_seconds=max(0.0, o.recompute_seconds + hook
                                                                     + (extra if o.cached_nodes else 0.0)))
                        for o, hook, extra in zip(stage.recompute_options, _per_option(hooks, count),
                                                  _per_option(selective, count)))
        before, after = stage.recompute_options[0].recompute_seconds, options[0].recompute_seconds
        skipped = stage.early_stop_seconds * (after / before if 0 < after < before else 1.0 if after else 0.0)
        stages.append(dataclasses.replace(stage, options=options, early_stop_seconds=min(skipped, after)))
    return dataclasses.replace(problem, stages=tuple(stages))


def _per_option(charge: float | Sequence[float], count: int) -> list[float]:
    return [charge] * count if isinstance(charge, (int, float)) else list(charge)
