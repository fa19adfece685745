"""Random planning problems and brute force over every schedule, for the solver tests (torch-free).

``random_chain`` builds problems where :meth:`Problem.is_chain` holds; ``random_dag`` adds tensors with several
consumers far ahead (skip connections), savers that are not readers, outputs and shared nodes. Both return some
tensors that the caller lets go (``TensorInfo.returned``: alive to the end of the forward, kept by a re-run to its
end; a chain's from its last two stages). Option 0 of every
stage recomputes everything at the stage's forward time (less what half the stages skip when their region caches
nothing and stops early after them); later options cache some of the stage's nodes.

>>> problem = random_chain(4, seed=1)
>>> problem.is_chain(), problem.num_stages
(True, 4)
>>> len(all_schedules(problem)) > 100
True
"""

from __future__ import annotations

import dataclasses
import itertools
import random

from planner.problem import (BackwardEpoch, HeldInputs, InputSaving, Problem, RecomputeOption, Region, Schedule,
                             Stage, TensorInfo, last_rerun_reader, simulate)


def _options(rng: random.Random, stage: int, forward_seconds: float, nodes: list[str],
             num_options: int, unit: int) -> tuple[RecomputeOption, ...]:
    """Option 0 recomputes everything; the others cache some nodes and, drawn apart (so that the problems the
    other draws make stay the same), carry a recompute workspace of their own or the stage's (None); each may
    need a forward workspace of its own inside a region."""
    options = [RecomputeOption("recompute_all", frozenset(), forward_seconds)]
    for o in range(1, num_options):
        cached = frozenset(rng.sample(nodes, rng.randint(1, len(nodes))))
        seconds = round(forward_seconds * rng.uniform(0.05, 0.9), 3)
        workspace = random.Random(f"{stage}/{o}/{seconds}/{sorted(cached)}").choice([None, 0, 3, 9, 25])
        options.append(RecomputeOption(f"cache{o}_s{stage}", cached, seconds,
                                       None if workspace is None else unit * workspace))
    # the forward workspace of each option inside a region, drawn apart (None: the stage's own)
    draws = random.Random(f"forward/{stage}/{forward_seconds}")
    return tuple(dataclasses.replace(option, forward_bytes=None if (extra := draws.choice([None, None, 2, 12, 30]))
                                     is None else unit * extra) for option in options)


_STAGE_FIELDS = {f.name for f in dataclasses.fields(Stage)}


def _stage(rng: random.Random, k: int, nodes: list[str], num_options: int, unit: int) -> Stage:
    forward = round(rng.uniform(0.5, 3.0), 3)
    optional = {"output_grad_bytes": unit * rng.choice([0, 0, 2, 5]),
                "backward_start_workspace_bytes": unit * rng.choice([0, 0, 3, 10])}
    # drawn apart, so that the other draws stay as they were: what the re-run holds when its region stops after it
    stopped = random.Random(f"stopped/{k}/{forward}").choice([None, None, 0, 5, 15, 40])
    optional["stopped_rerun_bytes"] = None if stopped is None else unit * stopped
    # what its re-run skips when its region caches nothing and stops after it: none, some, or all of its forward
    optional["early_stop_seconds"] = random.Random(f"early/{k}/{forward}").choice([0.0, 0.0, 0.3, 1.0]) * forward
    extra = {name: value for name, value in optional.items() if name in _STAGE_FIELDS}
    stage = Stage(f"s{k}", forward_seconds=forward, backward_seconds=round(2 * forward, 3),
                  grad_bytes=unit * rng.choice([0, 0, 1, 3]),
                  forward_workspace_bytes=unit * rng.choice([0, 1, 4, 12]),
                  backward_workspace_bytes=unit * rng.choice([0, 2, 8]),
                  recompute_workspace_bytes=rng.choice([None, unit * rng.choice([0, 6, 20])]),
                  options=_options(rng, k, forward, nodes, num_options, unit), **extra)
    return stage


def _with_input_savings(stages: list[Stage], tensors: tuple[TensorInfo, ...], unit: int, name: str) -> list[Stage]:
    """``stages`` with what each one's re-run holds less where its region made inputs it frees (tensors of earlier
    stages it reads last, which nothing saves): per stage making some, from the latest, per option, part of what
    its workspaces count (``costmodel.input_savings``), never less than a later start's; and what its forward
    needs more while something holds some of them (``Stage.held_inputs``, :func:`_held_inputs`); drawn apart."""
    if "input_savings" not in _STAGE_FIELDS:
        return stages
    makers: list[set[int]] = [set() for _ in stages]
    released: list[list[str]] = [[] for _ in stages]
    for t in tensors:
        if (reader := last_rerun_reader(t)) is not None:
            makers[reader].add(t.producer)
            released[reader].append(t.name)
    out = []
    for k, stage in enumerate(stages):
        rng = random.Random(f"inputs/{name}/{k}")
        ahead = random.Random(f"through/{name}/{k}")  # drawn apart: what running through saves more
        savings, most = [], [0] * len(stage.recompute_options)
        most_through = [0] * len(stage.recompute_options)
        for since in sorted(makers[k], reverse=True):
            for o, option in enumerate(stage.recompute_options):
                room = [stage.recompute_workspace_of(o)] + ([stage.stopped_rerun_bytes] if not option.cached_nodes
                                                            and stage.stopped_rerun_bytes is not None else [])
                most[o] = max(most[o], min(unit * rng.choice([0, 0, 1, 3]), *room))
                more = 0 if option.cached_nodes else unit * ahead.choice([0, 0, 2])
                most_through[o] = max(most_through[o], min(most[o] + more, stage.recompute_workspace_of(o)))
            savings.append(InputSaving(since, tuple(most), tuple(most_through) if most_through != most else ()))
        out.append(dataclasses.replace(stage, input_savings=tuple(s for s in savings
                                                                 if any(s.option_bytes) or any(s.through_bytes)),
                                       **_held_inputs(released[k], unit, f"held/{name}/{k}")))
    return out


def _with_backward_epochs(stages: list[Stage], tensors: tuple[TensorInfo, ...], unit: int,
                          name: str) -> list[Stage]:
    """``stages`` with, for most of those that save tensors of earlier stages last, their backward told apart by
    which of them are still alive (``Stage.backward_epochs``): freed in a drawn order, the peak in a drawn epoch
    while some are alive, each other epoch a drawn distance below it, never more than the workspace, which grows to
    hold the tensors; drawn apart."""
    if "backward_epochs" not in _STAGE_FIELDS:
        return stages
    out = []
    for k, stage in enumerate(stages):
        rng = random.Random(f"epochs/{name}/{k}")
        releasing = [t for t in tensors if t.producer < k and t.savers and min(t.savers) == k and not t.is_output]
        if not releasing or rng.random() < 0.3:
            out.append(stage)
            continue
        order = rng.sample(releasing, rng.randint(1, len(releasing)))
        workspace = max(stage.backward_workspace_bytes, sum(t.nbytes for t in order) + unit * rng.choice([0, 2, 6]))
        alive = [order[i:] for i in range(len(order) + 1)]
        peak = rng.randrange(len(alive) - 1)  # while some are alive: at the end, nothing they keep would count
        epochs = tuple(BackwardEpoch(frozenset(t.name for t in names), 0 if i == peak else unit * rng.randint(
            0, (workspace - sum(t.nbytes for t in names)) // unit)) for i, names in enumerate(alive))
        out.append(dataclasses.replace(stage, backward_workspace_bytes=workspace, backward_epochs=epochs))
    return out


def _held_inputs(released: list[str], unit: int, seed: str) -> dict:
    """A stage's ``held_inputs`` over the tensors it reads last (``released``): up to three sets of them, each
    with what holding it adds to the forward, and the forward's over-count that holding takes back first."""
    rng = random.Random(seed)
    if not released or rng.random() < 0.3:
        return {}
    sets = [HeldInputs(frozenset(rng.sample(released, rng.randint(1, len(released)))), unit * rng.choice([1, 3, 8]))
            for _ in range(rng.randint(1, 3))]
    return {"held_inputs": tuple(sets), "forward_overcount_bytes": unit * rng.choice([0, 0, 2])}


def _region_seconds(kind: str, n: int, seed: int) -> dict[str, float]:
    """What each region costs beyond its stages, and each region that caches beyond that, drawn apart so that the
    problems' other draws stay as they were."""
    return {"region_seconds": random.Random(f"region/{kind}/{n}/{seed}").choice([0.0, 0.0, 0.4, 1.5]),
            "caching_region_seconds": random.Random(f"caching/{kind}/{n}/{seed}").choice([0.0, 0.0, 0.3, 1.2])}


def _returned(tensors: list[TensorInfo], kind: str, n: int, seed: int, since: int = 0) -> tuple[TensorInfo, ...]:
    """``tensors`` with about one in ten of those made from stage ``since`` on returned to a caller who lets it go
    (alive to the end of the forward), drawn apart so that the problems' other draws stay as they were."""
    rng = random.Random(f"returned/{kind}/{n}/{seed}")
    return tuple(dataclasses.replace(t, returned=True) if rng.random() < 0.1 and t.producer >= since else t
                 for t in tensors)


def random_chain(n: int, seed: int = 0, *, num_options: int = 2, unit: int = 8, outputs: bool = True) -> Problem:
    """A chain: every tensor is read and saved only by its producer and the next stage (outputs anywhere)."""
    rng = random.Random(seed)
    tensors: list[TensorInfo] = []
    stages: list[Stage] = []
    for p in range(n):
        nodes = [f"n{p}_{j}" for j in range(rng.randint(1, 3))]
        for j in range(rng.randint(1, 4)):
            nxt = {p + 1} if p + 1 < n else set()
            consumers = frozenset(s for s in {p} | nxt if rng.random() < 0.6)
            savers = frozenset(s for s in {p} | nxt if rng.random() < 0.5)
            tensors.append(TensorInfo(f"t{p}_{j}", unit * rng.randint(1, 25), p, consumers, savers,
                                      node=rng.choice(nodes)))
        if outputs and rng.random() < 0.15:
            savers = frozenset(rng.sample(range(p, n), rng.randint(0, min(2, n - p))))
            tensors.append(TensorInfo(f"out{p}", unit * rng.randint(1, 10), p, frozenset(), savers,
                                      node=rng.choice(nodes), is_output=True))
        stages.append(_stage(rng, p, nodes, num_options, unit))
    tensors = _returned(tensors, "chain", n, seed, since=n - 2)
    stages = _with_backward_epochs(_with_input_savings(stages, tensors, unit, f"chain{n}_{seed}"), tensors, unit,
                                   f"chain{n}_{seed}")
    return Problem(tuple(stages), tensors,
                   fixed_bytes=unit * rng.randint(0, 40), name=f"chain{n}_{seed}", **_region_seconds("chain", n, seed))


def random_dag(n: int, seed: int = 0, *, num_options: int = 2, unit: int = 8, reach: int = 3) -> Problem:
    """A DAG-like problem: tensors read and saved up to ``reach`` stages ahead, outputs with readers, shared nodes."""
    rng = random.Random(seed)
    tensors: list[TensorInfo] = []
    stages: list[Stage] = []
    for p in range(n):
        nodes = [f"n{p}_{j}" for j in range(rng.randint(1, 3))]
        ahead = list(range(p, min(n, p + reach + 1)))
        for j in range(rng.randint(1, 4)):
            consumers = frozenset(rng.sample(ahead, rng.randint(0, len(ahead))))
            savers = frozenset(rng.sample(ahead, rng.randint(0, min(2, len(ahead)))))
            tensors.append(TensorInfo(f"t{p}_{j}", unit * rng.randint(1, 25), p, consumers, savers,
                                      node=rng.choice(nodes), is_output=rng.random() < 0.05))
        stages.append(_stage(rng, p, nodes, num_options, unit))
    tensors = _returned(tensors, "dag", n, seed)
    stages = _with_backward_epochs(_with_input_savings(stages, tensors, unit, f"dag{n}_{seed}"), tensors, unit,
                                   f"dag{n}_{seed}")
    return Problem(tuple(stages), tensors,
                   fixed_bytes=unit * rng.randint(0, 40), name=f"dag{n}_{seed}", **_region_seconds("dag", n, seed))


def all_schedules(problem: Problem) -> list[Schedule]:
    """Every schedule: each stage stored or recomputed with one option, adjacent recomputed stages joined or not."""
    n = problem.num_stages
    choices = [[None, *range(len(s.recompute_options))] for s in problem.stages]
    schedules = []
    for picks in itertools.product(*choices):
        joinable = [k for k in range(n - 1) if picks[k] is not None and picks[k + 1] is not None]
        for joins in itertools.product((False, True), repeat=len(joinable)):
            schedules.append(_build(picks, dict(zip(joinable, joins))))
    return schedules


def _build(picks, joined: dict[int, bool]) -> Schedule:
    regions: list[Region] = []
    start = None
    for k, pick in enumerate(picks):
        if pick is None:
            continue
        if start is None:
            start = k
        if not joined.get(k, False) or k + 1 == len(picks) or picks[k + 1] is None:
            regions.append(Region(start, k + 1, tuple(picks[start:k + 1])))
            start = None
    return Schedule(tuple(regions))


def brute_force_table(problem: Problem) -> list[tuple[int, float, Schedule]]:
    """``(peak, recompute_seconds, schedule)`` for every schedule."""
    table = []
    for schedule in all_schedules(problem):
        evaluation = simulate(problem, schedule)
        table.append((evaluation.peak_bytes, evaluation.recompute_seconds, schedule))
    return table


def brute_force_best(table: list[tuple[int, float, Schedule]], budget: int) -> float | None:
    """Least recompute time among schedules within ``budget``; None when none fits."""
    fitting = [seconds for peak, seconds, _ in table if peak <= budget]
    return min(fitting) if fitting else None


def layered_chain(n: int, seed: int = 0, *, tensors_per_stage: int = 8, unit: int = 1 << 20,
                  repeated: bool = False) -> Problem:
    """A chain shaped like a stack of transformer blocks, with the planner's option menus.

    Each stage saves its own intermediate tensors and reads (and saves) its predecessor's output; options cache
    growing shares of the stage's nodes, best seconds-per-byte first (a nested menu, as ``costmodel`` builds).
    ``repeated``: every stage but the first and the last is the same block, as in a real transformer.
    """
    first_rng = random.Random(seed)
    tensors: list[TensorInfo] = []
    stages: list[Stage] = []
    for p in range(n):
        rng = random.Random(seed + 10_000) if repeated and 0 < p < n - 1 else first_rng
        nodes = [f"n{p}_{j}" for j in range(tensors_per_stage)]
        node_seconds = [rng.uniform(0.01, 0.2) for _ in nodes]
        for j, node in enumerate(nodes[:-1]):
            tensors.append(TensorInfo(f"t{p}_{j}", unit * rng.randint(1, 8), p, frozenset(), frozenset({p}), node))
        out_savers = frozenset({p + 1} if p + 1 < n else set()) | ({p} if rng.random() < 0.5 else set())
        tensors.append(TensorInfo(f"out{p}", unit * 4, p, frozenset({p + 1}) if p + 1 < n else frozenset(),
                                  out_savers, nodes[-1]))
        forward = sum(node_seconds)
        ranked = sorted(range(len(nodes)), key=lambda j: node_seconds[j], reverse=True)
        options = [RecomputeOption("recompute_all", frozenset(), forward)]
        for share in (0.25, 0.5, 0.75, 1.0):
            chosen = ranked[:max(1, round(share * len(ranked)))]
            options.append(RecomputeOption(f"cache_{int(share * 100)}pct", frozenset(nodes[j] for j in chosen),
                                           forward - sum(node_seconds[j] for j in chosen)))
        stages.append(Stage(f"block{p}", forward_seconds=forward, backward_seconds=2 * forward,
                            grad_bytes=unit * 2, forward_workspace_bytes=unit * 4,
                            backward_workspace_bytes=unit * 6, options=tuple(options)))
    return Problem(tuple(stages), tuple(tensors), fixed_bytes=unit * 64, name=f"layered{n}_{seed}")


def random_schedule(problem: Problem, rng: random.Random, recompute_share: float = 0.6) -> Schedule:
    """A random schedule: each stage recomputed with probability ``recompute_share``, random options and splits."""
    picks = [rng.randrange(len(s.recompute_options)) if rng.random() < recompute_share else None
             for s in problem.stages]
    joined = {k: rng.random() < 0.6 for k in range(problem.num_stages - 1)}
    return _build(picks, joined)


def bn_relu_conv(blocks=1, conv_workspace=300, relu_held_input=0, through_only=False):
    """Blocks of three stages, as ResNet at sublayer granularity: a BatchNorm whose output only the next stage's
    ReLU reads (nothing saves it), the ReLU (saved by itself and the convolution) and a convolution.
    ``relu_held_input``: what holding the BatchNorm's output adds to the ReLU's re-run (in its recompute workspace),
    not there when the region made it (``Stage.input_savings``); ``through_only``: only where the convolution
    follows in the region (``InputSaving.through_bytes``: a re-run stopping after the ReLU saves nothing)."""
    stages, tensors = [], []
    for b in range(blocks):
        k = 3 * b
        last = b == blocks - 1
        saving = InputSaving(k, (0,), (relu_held_input,)) if through_only else InputSaving(k, (relu_held_input,))
        stages += [Stage(f"bn{b}", 1.0, 2.0), Stage(f"relu{b}", 1.0, 2.0, recompute_workspace_bytes=relu_held_input,
                                                    input_savings=(saving,)),
                   Stage(f"conv{b}", 3.0, 6.0, forward_workspace_bytes=conv_workspace)]
        tensors += [TensorInfo(f"bn{b}", 100, k, frozenset({k + 1}), node=f"bn{b}"),
                    TensorInfo(f"relu{b}", 100, k + 1, frozenset({k + 2}), frozenset({k + 1, k + 2}),
                               node=f"relu{b}"),
                    TensorInfo(f"conv{b}", 40, k + 2, frozenset() if last else frozenset({k + 3}),
                               frozenset({k + 2} if last else {k + 2, k + 3}), node=f"conv{b}")]
    return Problem(tuple(stages), tuple(tensors))


def held_norm_output(held_forward=1200, layer_region_forward=None, head_saved=800):
    """Three stages: a norm whose output ``a`` only the next stage reads and nothing saves (eager frees it inside
    that stage), which may cache it; a layer that saves 300 bytes of its own; a head saving 800. Holding ``a``
    through the layer's forward (a region starting there, or the norm's cache) costs it ``held_forward`` more
    (``Stage.held_inputs``). Each region costs 0.5 s, so one region over both, the norm caching, is
    the fastest way under the eager peak, unless the held input makes its forward too high.
    ``layer_region_forward``: the layer's forward workspace inside a region, which covers that much of it."""
    norm = (RecomputeOption("recompute_all", frozenset(), 5.0), RecomputeOption("cache_a", frozenset({"a"}), 0.2))
    layer = Stage("layer", 1.0, 2.0, held_inputs=(HeldInputs(frozenset({"a"}), held_forward),),
                  options=(RecomputeOption("recompute_all", frozenset(), 1.0, forward_bytes=layer_region_forward),))
    stages = (Stage("norm", 5.0, 10.0, options=norm), layer, Stage("head", 1.0, 2.0))
    tensors = (TensorInfo("a", 100, 0, frozenset({1}), node="a"),
               TensorInfo("norm_saved", 500, 0, frozenset({0}), frozenset({0}), node="norm_saved"),
               TensorInfo("layer_saved", 300, 1, frozenset({1}), frozenset({1}), node="layer_saved"),
               TensorInfo("c", 10, 1, frozenset({2}), frozenset({2}), node="c"),
               TensorInfo("head_saved", head_saved, 2, frozenset({2}), frozenset({2}), node="head_saved"))
    return Problem(stages, tensors, region_seconds=0.5, name="held_norm_output")



def cached_head_input():
    """Three stages: a block whose output ``x`` (200 bytes) only the next stage reads and saves, which may cache
    it; a layer that saves ``x`` and 300 bytes of its own; a head saving 2,500. The layer's backward frees ``x``
    early: its workspace of 3,000 holds ``x`` at its peak, and once ``x`` is gone it needs 300 less
    (``Stage.backward_epochs``). A cache of ``x`` keeps it past the layer's backward, where it counts once, so
    the layer's backward event after that cache is 200 bytes lower than the workspace and ``x`` would make it.
    Each region costs 0.5 s."""
    block = (RecomputeOption("recompute_all", frozenset(), 5.0), RecomputeOption("cache_x", frozenset({"x"}), 0.2))
    epochs = (BackwardEpoch(frozenset({"x"})), BackwardEpoch(frozenset(), below_bytes=300))
    layer = Stage("layer", 1.0, 2.0, backward_workspace_bytes=3000, backward_epochs=epochs,
                  options=(RecomputeOption("recompute_all", frozenset(), 0.1),))
    stages = (Stage("block", 5.0, 10.0, options=block), layer, Stage("head", 1.0, 2.0))
    tensors = (TensorInfo("x", 200, 0, frozenset({1}), frozenset({1}), node="x"),
               TensorInfo("block_saved", 500, 0, frozenset({0}), frozenset({0}), node="block_saved"),
               TensorInfo("layer_saved", 300, 1, frozenset({1}), frozenset({1}), node="layer_saved"),
               TensorInfo("y", 10, 1, frozenset({2}), frozenset({2}), node="y"),
               TensorInfo("head_saved", 2500, 2, frozenset({2}), frozenset({2}), node="head_saved"))
    return Problem(stages, tensors, region_seconds=0.5, name="cached_head_input")


def held_layer_chain(head_workspace: int = 0):
    """Four stages: a norm whose output ``a`` only the layer reads and nothing saves; the layer, whose forward
    needs 1,200 bytes more while ``a`` is held through it (``Stage.held_inputs``: a region starting there holds it
    as its input); a cheap middle stage saving 300; a head saving 800 with ``head_workspace`` in its backward.
    Regions of the layer and the middle stage together start with the layer's forward holding ``a``: the
    region-start forward of a region longer than one stage. Each region costs 0.5 s."""
    layer = Stage("layer", 1.0, 2.0, held_inputs=(HeldInputs(frozenset({"a"}), 1200),))
    stages = (Stage("norm", 5.0, 10.0), layer, Stage("mid", 0.2, 0.4),
              Stage("head", 1.0, 2.0, backward_workspace_bytes=head_workspace))
    tensors = (TensorInfo("a", 100, 0, frozenset({1}), node="a"),
               TensorInfo("norm_saved", 500, 0, frozenset({0}), frozenset({0}), node="norm_saved"),
               TensorInfo("layer_saved", 300, 1, frozenset({1}), frozenset({1}), node="layer_saved"),
               TensorInfo("c", 10, 1, frozenset({2}), frozenset({2}), node="c"),
               TensorInfo("mid_saved", 300, 2, frozenset({2}), frozenset({2}), node="mid_saved"),
               TensorInfo("d", 10, 2, frozenset({3}), frozenset({3}), node="d"),
               TensorInfo("head_saved", 800, 3, frozenset({3}), frozenset({3}), node="head_saved"))
    return Problem(stages, tensors, region_seconds=0.5, name="held_layer_chain")
