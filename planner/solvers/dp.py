"""A dynamic program over stages for chains (Rotor-style), exact there and conservative elsewhere.

The program walks the stages left to right. Each step chooses the next *segment*: a stored stage, or a region
``i .. e`` with one recompute option per stage. The state at position ``i`` is

* ``H``: bytes that decisions so far keep alive for the whole rest of the step (tensors of stages ``<= i-2`` that
  something holds or a recomputation consumes): they count in every later forward, recompute and backward event;
* how stage ``i-1`` ran (stored, or its option when it ended a region), and whether the segment at ``i`` is a region:
  together they decide whether stage ``i-1``'s tensors are held by stage ``i`` (``simulate``'s holders).

A transition checks every forward, backward-start, backward and recompute event of the new segment against the
budget. Inside a region the options are chosen by an inner dynamic program whose state is the bytes the region has
cached so far, what its stages keep through its re-run (less the caches each re-run consumes itself, and what a
re-run reads last and frees: what the last stage left to the next one alone is apart), the highest moment of its
re-run so far, whether it caches (then its re-run goes to its end) and the recomputed copies of model
outputs; it keeps the Pareto front of (bytes, requirement, seconds).

``H`` is discretised into ``buckets`` steps of ``unit`` bytes: what a segment adds to it is rounded *up* to whole
units (every other byte count is exact), so memory is never under-estimated and each segment loses less than one
unit. When every tensor size is a multiple of the unit (``unit`` = the sizes' gcd whenever
``budget / gcd <= buckets``) and the problem :meth:`is a chain
<planner.problem.Problem.is_chain>`, the program is exact: it returns an optimal schedule of ``simulate``'s model.

On other problems tensors that reach past the next stage are assumed held from their producer on (only model
outputs really are), which over-estimates memory: the program stays feasible but may miss better plans (status
``FEASIBLE``); with more than ``PINNED_LIMIT`` of them it plans on :func:`chain_restriction` instead. Every
returned plan is checked with ``simulate``.

Search: passes keep only partial plans within a ceiling on recompute seconds (growing until a pass's plan is
within its ceiling, which proves it the program's optimum); a quick search with regions of at most
``SHORT_REGIONS`` stages runs first, then a search with regions of any length over only the options its plan
uses (:func:`_focused`), and later searches deepen the longest region step by step. Steps of memory are fitted
to the byte counts the program rounds (:func:`_fitted_unit`, :func:`_bound_unit`). Bound:
:func:`lower_bound` solves :func:`chain_relaxation` with byte counts rounded down and fronts never cut (past a
limit, runs of points merge into their ideal point), so every plan carries a proven ``gap`` and
``lower_bound_seconds``; when the relaxation's optimal schedule fits the problem itself, it is the plan, proven
optimal. A bound's search solves the regions of repeated blocks once for all their starts (:class:`_Repeat`).
The program's state arrays hold no back-pointers: schedules are read back by matching values.

>>> from planner.problem import Problem, Stage, TensorInfo
>>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(4))
>>> inner = tuple(TensorInfo(f"a{i}", 100, i, frozenset({i}), frozenset({i})) for i in range(4))
>>> edges = tuple(TensorInfo(f"x{i}", 10, i, frozenset({i + 1}), frozenset({i + 1})) for i in range(3))
>>> problem = Problem(stages, inner + edges)
>>> plan = solve_dp(problem, 250)
>>> plan.status.value, plan.predicted_recompute_seconds, plan.predicted_peak_bytes <= 250
('optimal', 2.0, True)
>>> minimum_peak(problem)
130
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from dataclasses import dataclass
from collections import Counter
from functools import lru_cache, reduce
from typing import Callable, NamedTuple, Sequence

import numpy as np

from ..errors import PlannerError
from ..plan import Plan, SolverStatus, relative_gap
from ..problem import Problem, Region, Schedule, Stage, TensorInfo, backward_releasers, last_rerun_reader, \
    recompute_seconds, simulate, stage_recompute_seconds
from .baselines import chen_sqrt, infeasible_budget_error, store_all, uniform
from .ilp import unheld_forward_until

STORED = -1  # how a stage ran, in place of an option index
NO_RERUN = -(1 << 62)  # the highest re-run moment of no stage yet
NO_STAGE = -2  # before the first stage
KINDS = ("stored", "region")  # what the next segment is
NONE = "none"  # no next segment (past the last stage)


# --- tables: what each stage's tensors add to each event, per decision --------------------------------------------

@dataclass(frozen=True)
class _Local:
    """A tensor read and saved only by its producer ``p`` and ``p+1`` (every tensor of a chain, but outputs)."""

    nbytes: int
    saved_self: bool
    saved_next: bool
    read_next: bool
    forward_self: bool  # alive in p's forward even when nothing holds it
    forward_next: bool  # alive in p+1's forward even when nothing holds it
    caching: frozenset[int]
    returned: bool = False  # a model output the caller lets go: its region's re-run keeps it to the end

    def held_next(self, kind: str) -> bool:
        """Whether a following segment of ``kind`` holds it (from ``p+1`` on)."""
        return (kind == "stored" and self.saved_next) or (kind == "region" and self.read_next)

    def own(self, how: int) -> bool:
        """Held or consumed by its own stage's decision ``how`` (STORED or an option)."""
        return self.saved_self if how == STORED else how in self.caching

    @property
    def keeps(self) -> bool:
        """Kept past its stage by a re-run (see :func:`~planner.problem.keeps`), unless cached."""
        return self.saved_self or self.saved_next or self.read_next or self.returned

    @property
    def freed_by_next(self) -> bool:
        """Kept by a re-run only until the next stage of its region has re-run: that stage reads it and nothing saves
        it (see :func:`~planner.problem.last_rerun_reader`)."""
        return self.read_next and not (self.saved_self or self.saved_next or self.returned)


@dataclass(frozen=True)
class _Pinned:
    """A model output (held throughout), or on non-chains a tensor assumed held from its producer on."""

    producer: int
    nbytes: int
    first_saver: int | None
    caching: frozenset[int]
    is_output: bool


def _is_local(t: TensorInfo, num_stages: int) -> bool:
    """Read, saved and (when returned, to the end of the forward) alive only in its producer and the next stage."""
    return not t.is_output and max(t.consumers | t.savers | {t.producer}) <= t.producer + 1 and \
        (not t.returned or t.producer >= num_stages - 2)


@dataclass(frozen=True)
class _StageSums:
    """Bytes of one stage's local tensors that each event counts, per option (index) or following kind (key)."""

    saved_self: int  # saved by the stage itself
    saved_any: int  # saved by the stage or the next
    cached: tuple[int, ...]
    forward_inner: tuple[int, ...]  # alive in its forward inside a region, not at its end
    forward_from_prev: tuple[int, ...]  # alive in the next stage's forward, inside a region
    forward_end: dict[tuple[int, str], int]  # alive in its forward when it ends a region, by option and next kind
    forward_stored: dict[str, int]  # alive in its forward when stored, by next kind
    next_holder_matters: bool  # whether a next-stage holder can add to its forward
    rerun: "_Rerun"


@dataclass(frozen=True)
class _Rerun:
    """Per option, what a stage's re-run adds at its highest (``problem._recompute_peak``): when it runs through
    (what it keeps, plus its workspace), when its region stops early after it (what it saves itself, plus its
    workspace), what it leaves to the later stages of its region past the next (what it keeps, less the caches it
    consumes and what the next stage's re-run frees) and what the next stage's re-run reads last and frees."""

    through: tuple[int, ...]
    stopped: tuple[int, ...]
    left: tuple[int, ...]
    caching: tuple[bool, ...]  # whether the option caches anything (its region then runs through)
    freed_by_next: tuple[int, ...]
    # what its re-run holds less, per option, when its region starts at least ``back`` stages before it and so made
    # inputs it frees: (back, per-option bytes, per-option bytes where a later stage of the region follows)
    # triples, from Stage.input_savings (relative: repeated blocks match)
    input_saving: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]


def _rerun(tensors: tuple[_Local, ...], pinned: tuple[_Pinned, ...], stage: Stage, k: int) -> _Rerun:
    through, stopped, left, caching, freed = [], [], [], [], []
    for o, option in enumerate(stage.recompute_options):
        kept = sum(t.nbytes for t in tensors if o not in t.caching and t.keeps) \
            + sum(x.nbytes for x in pinned if o not in x.caching)  # outputs and far-reaching tensors: all kept
        saved = sum(t.nbytes for t in tensors if o not in t.caching and t.saved_self) \
            + sum(x.nbytes for x in pinned if o not in x.caching and x.first_saver == k)
        consumed = sum(t.nbytes for t in tensors if o in t.caching and not t.keeps)
        # what the next stage's re-run frees: read last by it, saved by none (a cached one, counted among the
        # caches until then, off the caches after it: problem.cached_dies_with)
        freed_next = sum(t.nbytes for t in tensors if t.freed_by_next)
        workspace = stage.recompute_workspace_of(o)
        through.append(kept + workspace)
        stopped.append(stage.stopped_rerun(o, kept, saved))
        left.append(kept - consumed - freed_next)
        caching.append(bool(option.cached_nodes))
        freed.append(freed_next)
    options = range(len(stage.recompute_options))
    saving = tuple((k - s.since, tuple(s.of(o) for o in options), tuple(s.of(o, through=True) for o in options))
                   for s in stage.input_savings)
    return _Rerun(tuple(through), tuple(stopped), tuple(left), tuple(caching), tuple(freed), saving)


def _stage_sums(tensors: tuple[_Local, ...], stage: Stage, rerun: _Rerun) -> _StageSums:
    def total(keep) -> int:
        return sum(t.nbytes for t in tensors if keep(t))
    kinds = (*KINDS, NONE)
    options = range(len(stage.recompute_options))
    # a stage's forward inside a region may need more workspace than stored (what it saves dies early, but lives)
    extra = [stage.forward_extra_of(o) for o in options]
    return _StageSums(
        total(lambda t: t.saved_self), total(lambda t: t.saved_self or t.saved_next),
        tuple(total(lambda t: o in t.caching) for o in options),
        tuple(extra[o] + total(lambda t: t.forward_self or o in t.caching) for o in options),
        tuple(total(lambda t: t.forward_next or o in t.caching) for o in options),
        {(o, kind): extra[o] + total(lambda t: t.forward_self or o in t.caching or t.held_next(kind))
         for o in options for kind in kinds},
        {kind: total(lambda t: t.forward_self or t.saved_self or t.held_next(kind)) for kind in kinds},
        any(t.saved_next and not t.forward_self for t in tensors), rerun)


@dataclass(frozen=True)
class _Tables:
    """Per-stage sums over tensors in bytes, and the step ``unit`` of H; see the module docstring for the events."""

    problem: Problem
    unit: int
    locals: tuple[tuple[_Local, ...], ...]
    pinned: tuple[tuple[_Pinned, ...], ...]
    fwd_base: tuple[int, ...]  # fixed + forward workspace + pinned tensors alive in the forward
    start_base: tuple[int, ...]  # fixed + gradients of later stages + start workspace + pinned, as a backward starts
    after_base: tuple[int, ...]  # fixed + gradients so far + backward workspace + pinned, after a backward
    rec_base: tuple[int, ...]  # fixed + gradients of later stages + output gradients + pinned, at a recomputation
    sums: tuple[_StageSums, ...]
    pending: dict[tuple[int, int, str], "_Pending"]  # (i, how stage i-1 ran, kind at i) -> stage i-1's tensors
    option_seconds: tuple[tuple[float, ...], ...]
    stop_skips: tuple[tuple[float, ...], ...]  # per option: what a region that caches nothing saves ending there
    # per stage, what its forward needs more (Stage.held_input_forward, less what its option's forward workspace in
    # a region adds anyway) by (how the stage before ran, its own option or STORED): None as the first stage of a
    # region (which holds the tensors of the stage before that it reads last as its inputs), STORED, or an option
    # (which may cache some of them); tensors from further back, pinned, count as held
    held_forward: tuple[dict[tuple[int | None, int], int], ...]
    # per stage, what its backward event needs less when the stage before ended a region with an option (by option)
    # that caches tensors the stage saves last: alive past its backward, they count once (Stage.backward_workspace_with;
    # tensors from further back, pinned, are counted as held and their workspace whole: conservative)
    backward_relief: tuple[dict[int, int], ...]
    optimistic: bool = False  # round what H gains down instead of up: a relaxation, for lower bounds

    def units(self, nbytes):
        """Whole units of H standing for ``nbytes`` (an int or an array): rounded up, or down when optimistic."""
        return nbytes // self.unit if self.optimistic else -(-nbytes // self.unit)

    def options(self, k: int) -> range:
        return range(len(self.problem.stages[k].recompute_options))

    def seconds(self, k: int, option: int) -> float:
        return self.option_seconds[k][option]

    def input_saving(self, k: int, option: int, start: int, through: bool = False) -> int:
        """What stage ``k``'s re-run with ``option`` holds less in a region from ``start`` (see
        :func:`~planner.problem.input_saving`); ``through``: where a later stage of the region follows."""
        column = 2 if through else 1
        return max((entry[column][option] for entry in self.sums[k].rerun.input_saving if k - start >= entry[0]),
                   default=0)

    def held_input_forward(self, k: int, how: int | None, option: int) -> int:
        """What stage ``k``'s forward needs more, stored (``option`` STORED) or in a region with ``option``, as the
        first stage of a region (``how`` None) or after stage ``k-1`` ran as ``how`` (STORED or an option)."""
        return self.held_forward[k].get((how, option), 0)

    def relief(self, k: int, how: int) -> int:
        """What stage ``k``'s backward event needs less after stage ``k-1`` ran as ``how`` (STORED or an option: see
        ``_Tables.backward_relief``)."""
        return self.backward_relief[k].get(how, 0)

    def stop_skip(self, k: int, option: int) -> float:
        """What a region that caches nothing saves when it ends at stage ``k`` run with ``option`` (see
        ``Stage.stopped_seconds``; 0 for an option that caches)."""
        return self.stop_skips[k][option]


def _tables(problem: Problem, unit: int, optimistic: bool = False) -> _Tables:
    n = problem.num_stages
    locals_: list[list[_Local]] = [[] for _ in range(n)]
    pinned: list[list[_Pinned]] = [[] for _ in range(n)]
    for t in problem.tensors:
        p, size = t.producer, t.nbytes
        options = problem.stages[p].recompute_options
        caching = frozenset(o for o, option in enumerate(options) if t.node in option.cached_nodes)
        if _is_local(t, n):
            until = unheld_forward_until(problem, t)
            locals_[p].append(_Local(size, p in t.savers, p + 1 in t.savers, p + 1 in t.consumers,
                                     until >= p, until >= p + 1, caching, t.returned))
        else:
            pinned[p].append(_Pinned(p, size, min(t.savers) if t.savers else None, caching, t.is_output))
    pinned_forward = [sum(x.nbytes for q in range(k + 1) for x in pinned[q]) for k in range(n)]
    outputs = sum(x.nbytes for q in range(n) for x in pinned[q] if x.is_output)
    pinned_backward = [outputs + sum(x.nbytes for q in range(k + 1) for x in pinned[q] if not x.is_output)
                       for k in range(n)]
    grads_after = [sum(s.grad_bytes for s in problem.stages[k + 1:]) for k in range(n)]
    fixed, stages = problem.fixed_bytes, problem.stages
    options = [range(len(s.recompute_options)) for s in stages]
    pending = {(i, how, kind): _pending(locals_[i - 1], how, kind)
               for i in range(1, n) for how in [STORED, *options[i - 1]] for kind in KINDS}
    return _Tables(
        problem, unit, tuple(map(tuple, locals_)), tuple(map(tuple, pinned)),
        tuple(fixed + stages[k].forward_workspace_bytes + pinned_forward[k] for k in range(n)),
        tuple(fixed + grads_after[k] + stages[k].backward_start_workspace_bytes + pinned_backward[k]
              for k in range(n)),
        tuple(fixed + grads_after[k] + stages[k].grad_bytes + stages[k].backward_workspace_bytes
              + pinned_backward[k] for k in range(n)),
        tuple(fixed + grads_after[k] + getattr(stages[k], "output_grad_bytes", 0) + pinned_backward[k]
              for k in range(n)),
        tuple(_quantized(_stage_sums(tuple(locals_[k]), stages[k],
                                     _rerun(tuple(locals_[k]), tuple(pinned[k]), stages[k], k)), unit, optimistic)
              for k in range(n)),
        pending, tuple(tuple(o.recompute_seconds for o in s.recompute_options) for s in stages),
        tuple(tuple(s.stop_saving(o) for o in range(len(s.recompute_options))) for s in stages),
        _held_forward(problem, optimistic), _backward_relief(problem), optimistic)


def _backward_relief(problem: Problem) -> tuple[dict[int, int], ...]:
    """Per stage, what its backward event needs less by the option the stage before ended a region with (see
    ``_Tables.backward_relief``)."""
    n = problem.num_stages
    releasing = backward_releasers(problem)
    local: list[list[TensorInfo]] = [[] for _ in range(n)]  # per stage, those the stage before makes
    for t in problem.tensors:
        if (k := releasing.get(t.name)) is not None and t.producer == k - 1 and _is_local(t, n):
            local[k].append(t)
    reliefs = []
    for k, stage in enumerate(problem.stages):
        relief = [stage.backward_workspace_bytes - stage.backward_workspace_with(cached)
                  for cached in _cached_before(problem, k, local[k])] if local[k] else []
        reliefs.append({o: r for o, r in enumerate(relief) if r})
    return tuple(reliefs)


def _cached_before(problem: Problem, k: int, tensors: Sequence[TensorInfo]) -> list[dict[str, int]]:
    """Per option of stage ``k - 1``, those of ``tensors`` (its own) that it caches: their names and bytes."""
    return [{t.name: t.nbytes for t in tensors if t.node in option.cached_nodes}
            for option in problem.stages[k - 1].recompute_options]


def _held_forward(problem: Problem, optimistic: bool) -> tuple[dict[tuple[int | None, int], int], ...]:
    """Per stage, what its forward needs more by how the stage before ran and its own option (see
    ``_Tables.held_forward``, ``simulate``); a relaxation (``optimistic``) takes the least over the options of the
    stage before."""
    n = problem.num_stages
    local: list[list[TensorInfo]] = [[] for _ in range(n)]
    far: list[set[str]] = [set() for _ in range(n)]
    for t in problem.tensors:
        if (reader := last_rerun_reader(t)) is not None:
            if _is_local(t, n):
                local[reader].append(t)
            else:
                far[reader].add(t.name)
    tables = []
    for k, stage in enumerate(problem.stages):
        if not stage.held_inputs or k == 0:
            tables.append({})
            continue
        by_option = [stage.held_input_forward(far[k] | set(cached)) for cached in _cached_before(problem, k, local[k])]
        if optimistic:
            by_option = [min(by_option)] * len(by_option)
        by_how = {None: stage.held_input_forward(far[k] | {t.name for t in local[k]}),
                  STORED: stage.held_input_forward(far[k]), **dict(enumerate(by_option))}
        own = {STORED: 0, **{o: stage.forward_extra_of(o) for o in range(len(stage.recompute_options))}}
        tables.append({(how, o): held - extra for how, held in by_how.items() for o, extra in own.items()
                       if held > extra})
    return tuple(tables)


def _quantized(sums: _StageSums, unit: int, optimistic: bool) -> _StageSums:
    """Cached bytes in whole units of H (up, or down when optimistic): they end up in H anyway, and regions whose
    caches differ by less than a unit then compete on time alone, which keeps the Pareto fronts small."""
    def whole(nbytes: int) -> int:
        return (nbytes // unit if optimistic else -(-nbytes // unit)) * unit
    if optimistic:  # a relaxation may under-count freely: a region's first forward and its re-run are taken at
        # their least over the options (a re-run stopping early), which keeps the bound's fronts small
        least = {kind: min(sums.forward_end[o, kind] for o in range(len(sums.cached))) for kind in (*KINDS, NONE)}
        options = len(sums.cached)
        lowest = [(min(values),) * options for values in (sums.rerun.stopped, sums.rerun.stopped, sums.rerun.left)]
        most = max((max(ahead) for _, _, ahead in sums.rerun.input_saving), default=0)
        rerun = _Rerun(*lowest, (False,) * options, (min(sums.rerun.freed_by_next),) * options,
                       ((0, (most,) * options, (most,) * options),) if most else ())
        return dataclasses.replace(sums, cached=tuple(map(whole, sums.cached)),
                                   forward_inner=(min(sums.forward_inner),) * options,
                                   forward_end={key: least[key[1]] for key in sums.forward_end}, rerun=rerun)
    return dataclasses.replace(sums, cached=tuple(map(whole, sums.cached)))


@dataclass(frozen=True)
class _Pending:
    """Stage ``i-1``'s tensors as seen from the segment at ``i``."""

    own: int  # held or consumed by stage i-1's own decision: alive in every later event
    held_by_next: int  # held only by stage i: alive in every later event but the backward of i, once done
    read_only: int  # read by stage i, not held: alive in stage i's forward only


_NOTHING = _Pending(0, 0, 0)


def _pending(tensors: list[_Local], how: int, kind: str) -> _Pending:
    own = sum(t.nbytes for t in tensors if t.own(how))
    nxt = sum(t.nbytes for t in tensors if not t.own(how) and t.held_next(kind))
    read = sum(t.nbytes for t in tensors if not t.own(how) and not t.held_next(kind) and t.forward_next)
    return _Pending(own, nxt, read)


# --- the inner program: options inside one region -------------------------------------------------------------------

class _Open(NamedTuple):
    """A region ``i .. p`` still open at ``p``; every byte count excludes ``H`` and stage ``i-1``'s tensors.
    (A named tuple: the inner program makes millions of them.)"""

    cached: int  # bytes cached by stages i .. p-1: alive to the end once the region is left
    left: int  # what the re-runs of stages i .. p-1 leave to p's and later ones, less what p's frees (see _Rerun)
    reading: int  # what the re-run of p-1 leaves to p's only: p's re-run frees it
    rerun: int  # the highest moment of the re-runs of stages i .. p-1 (NO_RERUN when p = i)
    caches: bool  # whether some stage of i .. p caches: then the region's re-run goes to its end
    copies: int  # recomputed copies of pinned tensors alive at p's backward start
    future: tuple[tuple[int, int, bool], ...]  # pinned tensors (first saver > p, bytes, cached) not yet resolved
    need: int  # the largest event so far, forward of i excluded (in a shared program: forward events only)
    forward_now: int  # p's forward event, for a next-stage holder that may add to it (0 when none can)
    forward_first: int  # stage i's own tensors alive in its forward
    seconds: float
    options: tuple[int, ...]
    need_back: int = 0  # in a shared program (see _Repeat): the largest backward event so far, else 0

    def key(self) -> tuple:
        return self.options[-1], self.future

    def costs(self) -> tuple:  # a region that caches nothing stops its re-run early: never worse than one that does
        return (self.cached, self.left, self.reading, self.rerun, int(self.caches), self.copies, self.need,
                self.need_back, self.forward_now, self.forward_first, self.seconds)


@dataclass(frozen=True)
class _Closed:
    """A region ``i .. e`` with its options: what it adds to ``H`` and the largest event it needs besides ``H``."""

    adds: int
    need: int
    forward_first: int
    seconds: float
    options: tuple[int, ...]
    need_back: int = 0  # as in _Open


def _pareto(points: list[_Open], limit: int, optimistic: bool = False) -> tuple[list[_Open], bool]:
    """Drop points another point beats in every cost (each cost only ever adds to later events, so a point no
    worse in all of them serves every completion at least as well); keep at most ``limit``, spread from fastest
    to leanest (False when some were cut). ``optimistic`` (a bound's search): instead of dropping points, merge
    runs of them into their :func:`_ideal` point, which serves every completion at least as well as each of them,
    so the program's optimum stays a lower bound (but its schedule may not exist)."""
    groups: dict[tuple, list[_Open]] = {}
    for point in points:
        groups.setdefault((point.need, point.need_back, point.copies, point.forward_now, point.forward_first,
                           point.rerun, point.caches, point.reading), []).append(point)
    kept = [p for group in groups.values() for p in _staircase(group, lambda x: (x.seconds, x.cached, x.left))]
    if len(kept) > limit:
        kept = _nondominated(kept, _Open.costs)
    kept.sort(key=lambda x: x.seconds)
    if len(kept) <= limit:
        return kept, True
    if optimistic:
        cuts = [round(j * len(kept) / limit) for j in range(limit + 1)]
        return [_ideal(kept[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a], False
    step = (len(kept) - 1) / (limit - 1)
    return [kept[round(j * step)] for j in range(limit)], False


def _ideal(points: list[_Open]) -> _Open:
    """The least of every cost over ``points`` (of one key, fastest first), with the fastest point's options."""
    first = points[0]
    return first._replace(cached=min(p.cached for p in points), left=min(p.left for p in points),
                          reading=min(p.reading for p in points),
                          rerun=min(p.rerun for p in points), caches=min(p.caches for p in points),
                          copies=min(p.copies for p in points), need=min(p.need for p in points),
                          need_back=min(p.need_back for p in points),
                          forward_now=min(p.forward_now for p in points),
                          forward_first=min(p.forward_first for p in points))


def _staircase(items: list, costs) -> list:
    """Items not beaten in all three ``costs`` (a, b, c) by another: sort by a, keep a staircase over (b, c).

    >>> _staircase([(1, 5, 5), (2, 2, 2), (3, 3, 3), (1, 5, 5), (0, 9, 9)], lambda x: x)
    [(0, 9, 9), (1, 5, 5), (2, 2, 2)]
    """
    stairs_b: list = []  # increasing b
    stairs_c: list = []  # decreasing c
    kept = []
    for item in sorted(items, key=costs):
        _, b, c = costs(item)
        j = bisect.bisect_right(stairs_b, b)
        if j and stairs_c[j - 1] <= c:
            continue
        kept.append(item)
        stop = j
        while stop < len(stairs_b) and stairs_c[stop] >= c:
            stop += 1
        stairs_b[j:stop] = [b]
        stairs_c[j:stop] = [c]
    return kept


def _nondominated(items: list, costs) -> list:
    """The items no other item beats or equals in every one of ``costs`` (first cost first, ties broken by the
    rest), in increasing order of the first cost.

    >>> _nondominated([(1, 5), (2, 2), (3, 3), (1, 5), (0, 9)], lambda x: x)
    [(0, 9), (1, 5), (2, 2)]
    """
    if len(items) <= 1:
        return list(items)
    table = np.array([costs(item) for item in items], dtype=np.float64)
    order = np.lexsort(table.T[::-1])
    table = table[order]
    kept_rows = np.empty_like(table)
    kept: list[int] = []
    for row_index in range(len(table)):
        row = table[row_index]
        if kept and (kept_rows[:len(kept)] <= row).all(axis=1).any():
            continue
        kept_rows[len(kept)] = row
        kept.append(row_index)
    return [items[order[j]] for j in kept]


def _closed_front(closed: list[_Closed]) -> list[_Closed]:
    """Per last option and first forward, drop regions another beats in seconds, bytes added and need."""
    groups: dict[tuple, list[_Closed]] = {}
    for c in closed:
        groups.setdefault((c.options[-1], c.forward_first, c.need_back), []).append(c)
    return [c for group in groups.values() for c in _staircase(group, lambda x: (x.seconds, x.adds, x.need))]


def _resolve_pinned(tables: _Tables, stage: int, option: int, copies: int,
                    future: tuple[tuple[int, int, bool], ...]) -> tuple[int, tuple[tuple[int, int, bool], ...]]:
    """Move pinned tensors whose first saver is ``stage`` into copies, and add ``stage``'s own pinned tensors."""
    if not future and not tables.pinned[stage]:
        return copies, future
    n = tables.problem.num_stages
    entries = list(future)
    for x in tables.pinned[stage]:
        cached = option in x.caching
        if x.first_saver is not None or (cached and not x.is_output):  # the caller holds outputs: never consumed
            entries.append((x.first_saver if x.first_saver is not None else n, x.nbytes, cached))
    remaining = []
    for first, nbytes, cached in entries:
        if first == stage:
            copies += 0 if cached else nbytes
        else:
            remaining.append((first, nbytes, cached))
    return copies, tuple(sorted(remaining))


class _Region:
    """The inner program for regions starting at ``i``, closed at every ``e`` in turn.

    ``backward``: ``(cap, step)`` makes it a *shared* program (see :class:`_Repeat`), whose points keep forward
    events in ``need`` and backward events apart in ``need_back`` (at most ``cap``, rounded up to multiples of
    ``step`` below the budget), so that starts whose backward events lie a fixed number of bytes apart can all
    read it."""

    def __init__(self, tables: _Tables, i: int, budget: int | None, limit: int, track_time: bool,
                 ceiling: float = math.inf, backward: tuple[int, int] | None = None):
        self.tables, self.i, self.budget, self.limit = tables, i, budget, limit
        self.ceiling = ceiling  # regions slower than this cannot be part of a plan worth finding
        self.track_time = track_time  # False: seconds play no part (when minimising the peak)
        # an open region may still end where stopping early saves this much: kept while within the ceiling by that
        self.open_ceiling = ceiling + max((max(s) for s in tables.stop_skips[i:]), default=0.0) if track_time \
            else ceiling
        self.cap = budget if budget is not None else float("inf")
        self.backward = backward
        self.exact = True
        self.saved_before = [0]  # saved_before[m]: bytes saved by a stage, of stages i .. i+m-1
        for k in range(i, tables.problem.num_stages):
            self.saved_before.append(self.saved_before[-1] + tables.sums[k].saved_any)

    def _seconds(self, k: int, option: int) -> float:
        return self.tables.seconds(k, option) if self.track_time else 0.0

    def _first_seconds(self, option: int) -> float:
        """The region's first stage with ``option``, and the region's own cost (``Problem.region_seconds``)."""
        return self.tables.seconds(self.i, option) + self.tables.problem.region_seconds if self.track_time else 0.0

    def _fits(self, need: int) -> bool:
        return self.budget is None or need <= self.budget

    def _canonical(self, need: int) -> int:
        """The largest need with the same room left for H: the outer program sees no difference."""
        if self.budget is None or need > self.budget:
            return need
        unit = self.tables.unit
        return self.budget - (self.budget - need) // unit * unit

    def _shared_needs(self, forward: int, backward: int) -> tuple[int, int] | None:
        """A shared program's (need, need_back) for these events, or None when no start they serve fits them.
        Rounding up to the grid of ``step`` below the budget loses nothing: every start's grid of whole units
        of room lies on it. Nor does raising ``need_back`` to ``need``: no start sees backward events later
        than the first start does (shifts are at most 0), so below ``need`` they never decide a start's need."""
        cap, step = self.backward
        if forward > self.cap or backward > cap:
            return None
        forward = self._canonical(forward)
        return forward, max(forward, self.budget - (self.budget - backward) // step * step)

    def first(self) -> list[_Open]:
        t, i = self.tables, self.i
        points = []
        for o in t.options(i):
            copies, future = _resolve_pinned(t, i, o, 0, ())
            start = t.start_base[i] + t.sums[i].saved_self + copies
            forward_first = t.sums[i].forward_inner[o] + t.held_input_forward(i, None, o)
            seconds = self._first_seconds(o)
            if seconds > self.open_ceiling:
                continue
            caches = t.sums[i].rerun.caching[o]
            if self.backward is None:
                if self._fits(start):
                    points.append(_Open(0, 0, 0, NO_RERUN, caches, copies, future, start, 0, forward_first,
                                        seconds, (o,)))
            elif (needs := self._shared_needs(0, start)) is not None:
                points.append(_Open(0, 0, 0, NO_RERUN, caches, copies, future, needs[0], 0, forward_first,
                                    seconds, (o,), needs[1]))
        return self._prune(points)

    def extend(self, points: list[_Open], p: int) -> list[_Open]:
        """Add stage ``p + 1`` to every open region ``i .. p``."""
        t, i, k = self.tables, self.i, p + 1
        last, here = t.sums[p], t.sums[k]
        after_base = t.after_base[k] + self.saved_before[p - i] + last.saved_self
        start_base = t.start_base[k] + self.saved_before[k - i] + here.saved_self
        forward_bases = [t.fwd_base[k] + here.forward_inner[o2] for o2 in t.options(k)]
        held_forward = [[t.held_input_forward(k, o, o2) for o2 in t.options(k)] for o in t.options(p)]
        seconds = [self._seconds(k, o2) for o2 in t.options(k)]
        extra = here.next_holder_matters
        cap, budget, unit, ceiling, lean = self.cap, self.budget, t.unit, self.open_ceiling, t.optimistic
        simple = not t.pinned[k]
        shared = self.backward is not None
        out = []
        for point in points:
            o = point.options[-1]
            after = after_base + point.copies
            cached = point.cached + last.cached[o]
            if cached > cap:
                continue
            left = point.left + last.rerun.left[o]
            reading = last.rerun.freed_by_next[o]
            rerun = max(point.rerun, point.left + point.reading + last.rerun.through[o]
                        - t.input_saving(p, o, i, through=True))
            carried = point.cached + last.forward_from_prev[o]
            so_far = max(point.need, after)
            for o2, forward_base in enumerate(forward_bases):
                if point.seconds + seconds[o2] > ceiling:
                    continue
                if simple and not point.future:
                    copies, future = point.copies, ()
                else:
                    copies, future = _resolve_pinned(t, k, o2, point.copies, point.future)
                forward = forward_base + carried + held_forward[o][o2]
                need_back = 0
                if shared:
                    needs = self._shared_needs(max(point.need, forward),
                                               max(point.need_back, after, start_base + copies))
                    if needs is None:
                        continue
                    need, need_back = needs
                else:
                    need = max(so_far, start_base + copies, forward)
                    if budget is not None:
                        if need > budget:
                            continue
                        need = budget - (budget - need) // unit * unit  # canonical: the same room for H
                out.append(_Open(cached, left, reading, rerun, point.caches or here.rerun.caching[o2], copies, future,
                                 need, forward if extra and not lean else 0, point.forward_first,
                                 point.seconds + seconds[o2], point.options + (o2,), need_back))
        return self._prune(out)

    def close(self, points: list[_Open], e: int, kind: str) -> list[_Closed]:
        """End every open region at ``e``; ``kind`` is what follows (stored, region or none). A region that caches
        nothing stops its re-run early in ``e`` (``Stage.stopped_seconds``; in a relaxation, whose stages never
        cache for the re-run's bytes, every region whose last option caches nothing: :func:`_relaxed_seconds`); one
        that caches costs ``Problem.caching_region_seconds`` more."""
        t, i = self.tables, self.i
        closed = []
        for point in points:
            seconds = point.seconds
            if self.track_time and not point.caches:
                seconds -= t.stop_skip(e, point.options[-1])
            elif self.track_time:
                seconds += t.problem.caching_region_seconds
            o = point.options[-1]
            own = t.sums[e].rerun  # cached pinned tensors count once, as held from their producer on (rec_base)
            rerun = max(point.rerun, point.left + point.reading - t.input_saving(e, o, i)
                        + (own.through[o] if point.caches else own.stopped[o]))
            recompute = t.rec_base[e] + point.cached + t.sums[e].cached[o] + rerun
            own_forward = t.sums[e].forward_end[o, kind]
            forward = point.need
            forward_first = point.forward_first
            if e == i:
                forward_first = own_forward + t.held_input_forward(i, None, o)
            elif point.forward_now:
                forward = max(forward, point.forward_now + own_forward - t.sums[e].forward_inner[o])
            if self.backward is None:
                need = self._canonical(max(forward, recompute))
                if self._fits(need):
                    closed.append(_Closed(point.cached, need, self._canonical(forward_first), seconds,
                                          point.options))
            elif (needs := self._shared_needs(forward, max(point.need_back, recompute))) is not None:
                closed.append(_Closed(point.cached, needs[0], self._canonical(forward_first), seconds,
                                      point.options, needs[1]))
        return _closed_front(closed)

    def _prune(self, points: list[_Open]) -> list[_Open]:
        groups: dict[tuple, list[_Open]] = {}
        for point in points:
            groups.setdefault(point.key(), []).append(point)
        kept = []
        for group in groups.values():
            front, complete = _pareto(group, self.limit, self.tables.optimistic)
            self.exact &= complete
            kept += front
        return kept


def _region_ends(tables: _Tables, i: int, budget: int | None, limit: int, track_time: bool = True,
                 ceiling: float = math.inf, search: "_Search | None" = None):
    """Yield ``(e, kind, closed regions i .. e)`` for every end ``e`` and following kind, then ``(None, None,
    whether no Pareto front was cut)``."""
    region = _Region(tables, i, budget, limit, track_time, ceiling)
    yield from _continued(region, region.first(), i, search)


def _continued(region: _Region, points: list[_Open], e: int, search: "_Search | None"):
    """:func:`_region_ends` from ``e`` on, given the open regions ``i .. e`` (``points``)."""
    n, i = region.tables.problem.num_stages, region.i
    for e in range(e, n):
        if not points:
            break
        if search is not None:
            search.check_time()
            if search.longest_region is not None and e - i >= search.longest_region:
                region.exact = False  # longer regions were not considered
                break
        for kind in (KINDS if e + 1 < n else (NONE,)):
            yield e, kind, region.close(points, e, kind)
        if e + 1 < n:
            points = region.extend(points, e)
    yield None, None, region.exact


# --- structural sharing: repeated blocks solve their regions once ----------------------------------------------------

@dataclass(frozen=True)
class _Repeat:
    """Regions from ``start`` that end by stage ``last`` repeat those from ``first``: each stage ``k`` is stage
    ``k - start + first`` again (the same options, seconds and bytes), forward events are the same and backward
    events lie ``backward_shift`` bytes apart (the gradients of the stages between). One program from ``first``,
    keeping forward and backward needs apart, serves them all."""

    first: int
    start: int
    last: int
    backward_shift: int


def _signature(tables: _Tables, k: int) -> tuple | None:
    """What stage ``k``'s regions depend on besides the bases (None: it has far-reaching tensors, never shared).
    Seconds are compared to 12 digits: sums of the same times in another order differ in the last bits."""
    if tables.pinned[k]:
        return None
    return tables.sums[k], tuple(sorted(tables.held_forward[k].items(), key=str)), \
        tuple(float(f"{s:.12g}") for s in (*tables.option_seconds[k], *tables.stop_skips[k]))


def _repeats(tables: _Tables) -> dict[int, _Repeat]:
    """The starts whose regions repeat those of an earlier start (and those earlier starts), by start."""
    n = tables.problem.num_stages
    signatures = [_signature(tables, k) for k in range(n)]
    found: dict[int, _Repeat] = {}
    for start in range(1, n - 1):  # regions ending at the last stage are followed by nothing: never shared
        if signatures[start] is None or (first := signatures.index(signatures[start])) == start:
            continue
        shift = tables.start_base[start] - tables.start_base[first]
        last = start - 1
        for k in range(start, n - 1):
            j = k - start + first
            if signatures[k] != signatures[j] or tables.fwd_base[k] != tables.fwd_base[j] or any(
                    base[k] - base[j] != shift for base in (tables.start_base, tables.after_base, tables.rec_base)):
                break
            last = k
        if last >= start and shift <= 0:  # (gradients pile up towards the start; see _Region._shared_needs)
            found[start] = _Repeat(first, start, last, shift)
    for first in {r.first for r in found.values()}:  # its program runs as far as any start needs it
        found[first] = _Repeat(first, first, max(r.last for r in found.values() if r.first == first), 0)
    return found


@dataclass
class _Program:
    """A shared program's open and closed regions for every length, and whether it cut a front or its length."""

    lengths: list[tuple[list[_Open], dict[str, list[_Closed]]]]
    exact: bool
    limited: bool


class _Shared:
    """The shared programs of one pass (see :class:`_Repeat`), each run once, for the loosest of its starts'
    budgets and ceilings, when its first start needs it.

    Only a bound's search shares: a shared front is about the union of its starts' fronts (a point may serve
    only the starts whose backward events lie lower), so where fronts are cut, as in the search for a plan on
    long problems, each start would keep fewer of its own points and plans would get worse (Llama-7B: 0.02171 s
    instead of 0.02161 s). A bound's search merges instead of cutting, which stays a bound, and runs faster
    shared (Llama-7B at 2000 steps within a plan's 0.02112 s: 23-24 s instead of 32-34 s; 10 repeated blocks of
    GPT-2 small: a front of 1,044 points at 4 stages where start 1 alone keeps 612)."""

    def __init__(self, tables: _Tables, budget: int, limit: int, ceiling: float, search: "_Search | None"):
        self.tables, self.budget, self.limit, self.ceiling, self.search = tables, budget, limit, ceiling, search
        self.repeats = _repeats(tables) if tables.optimistic else {}
        self.programs: dict[int, _Program] = {}

    def _program(self, first: int) -> _Program:
        if first in self.programs:
            return self.programs[first]
        members = [r for r in self.repeats.values() if r.first == first]
        step = reduce(math.gcd, [r.backward_shift for r in members], self.tables.unit)

        def room(e: int) -> tuple[int, int]:
            """The loosest cap on backward events of the starts whose regions repeat ``first .. e``."""
            return max(self.budget - r.backward_shift for r in members if r.last - r.start >= e - first), step

        region = _Region(self.tables, first, self.budget, self.limit, True, self.ceiling, backward=room(first))
        program = _Program([], True, False)
        points = region.first()
        for e in range(first, self.repeats[first].last + 1):
            if not points:
                break
            if self.search is not None:
                self.search.check_time()
                if self.search.longest_region is not None and e - first >= self.search.longest_region:
                    program.limited = True
                    break
            region.backward = room(e)
            program.lengths.append((points, {kind: region.close(points, e, kind) for kind in KINDS}))
            if e < self.repeats[first].last:
                region.backward = room(e + 1)
                points = region.extend(points, e)
        program.exact = region.exact
        self.programs[first] = program
        return program

    def region_ends(self, i: int, budget: int, ceiling: float):
        """:func:`_region_ends` for start ``i``, read from its shared program up to its last repeated stage."""
        repeat = self.repeats[i]
        program = self._program(repeat.first)
        region = _Region(self.tables, i, budget, self.limit, True, ceiling)
        span = repeat.last - i + 1
        for length, (_, closed) in enumerate(program.lengths[:span]):
            for kind in KINDS:
                yield i + length, kind, _shifted_closed(closed[kind], repeat.backward_shift, region)
        region.exact = program.exact
        if len(program.lengths) < span:
            yield None, None, program.exact and not program.limited
            return
        points = _shifted_open(program.lengths[span - 1][0], repeat.backward_shift, region)
        yield from _continued(region, region.extend(points, repeat.last) if points else [], repeat.last + 1,
                              self.search)


def _shifted_need(point: _Open | _Closed, shift: int, region: _Region) -> int | None:
    """A shared program's point as ``region``'s start sees it (backward needs ``shift`` bytes apart): its need,
    or None when it does not fit that start's budget and ceiling (an open region's, which may still stop early)."""
    need = max(point.need, point.need_back + shift)
    ceiling = region.open_ceiling if isinstance(point, _Open) else region.ceiling
    return region._canonical(need) if region._fits(need) and point.seconds <= ceiling else None


def _shifted_closed(closed: list[_Closed], shift: int, region: _Region) -> list[_Closed]:
    """A shared program's closed regions as ``region``'s start sees them."""
    kept = []
    for c in closed:
        if (need := _shifted_need(c, shift, region)) is not None:
            kept.append(_Closed(c.adds, need, c.forward_first, c.seconds, c.options))
    return _closed_front(kept)


def _shifted_open(points: list[_Open], shift: int, region: _Region) -> list[_Open]:
    """A shared program's open regions as ``region``'s start sees them, to go on past the repeated stages."""
    kept = []
    for p in points:
        if (need := _shifted_need(p, shift, region)) is not None:
            kept.append(p._replace(need=need, need_back=0))
    return region._prune(kept)


# --- the outer program ---------------------------------------------------------------------------------------------------

def _stored_move(tables: _Tables, i: int, how: int, kind: str) -> tuple[int, int]:
    """(need, adds) for storing stage ``i`` followed by ``kind``; need excludes H."""
    pend = tables.pending.get((i, how, "stored"), _NOTHING)
    held = pend.own + pend.held_by_next
    forward = tables.fwd_base[i] + held + pend.read_only + tables.sums[i].forward_stored[kind] \
        + tables.held_input_forward(i, how, STORED)
    start = tables.start_base[i] + held + tables.sums[i].saved_self
    after = tables.after_base[i] + pend.own - tables.relief(i, how)
    return max(forward, start, after), held


def _cost_table(closed: list[_Closed]) -> np.ndarray:
    """Closed regions' (forward_first, need, adds), one row each."""
    return np.array([(c.forward_first, c.need, c.adds) for c in closed], dtype=np.int64).reshape(-1, 3)


def _region_needs(tables: _Tables, i: int, how: int, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(needs, adds) of closed regions at ``i`` (a :func:`_cost_table`) after stage ``i-1`` ran as ``how``; needs
    exclude H."""
    pend = tables.pending.get((i, how, "region"), _NOTHING)
    held = pend.own + pend.held_by_next
    forward = tables.fwd_base[i] + held + pend.read_only + table[:, 0]
    after = tables.after_base[i] + pend.own - tables.relief(i, how)
    return np.maximum(np.maximum(forward, after), held + table[:, 1]), held + table[:, 2]


def _unbeaten(key: np.ndarray, top: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Indices of the candidates that no other of the same ``key`` (a shift of H and the state reached) beats:
    none as fast or faster reaches as high an H (``top``) or higher. The others add nothing to any state.

    >>> _unbeaten(np.array([0, 0, 0, 1]), np.array([3, 1, 3, 2]), np.array([2.0, 1.0, 3.0, 3.0])).tolist()
    [1, 0, 3]
    """
    order = np.lexsort((-top, seconds, key))  # by key, fastest first, highest top first among equally fast
    ranked = key[order] * (int(top.max()) + 2) + top[order]  # a new key outranks every top before it
    higher = np.ones(len(order), dtype=bool)
    higher[1:] = ranked[1:] > np.maximum.accumulate(ranked)[:-1]
    return order[higher]


@dataclass(frozen=True)
class _Batch:
    """Transitions relaxed together: from ``source``, candidate ``j`` moves H up by ``shifts[j]`` units from any H
    up to ``tops[j]`` and costs ``seconds[j]``; its region's options are ``options[picks[j]]`` (``options`` None
    for a stored stage)."""

    source: tuple[int, int, str]
    shifts: np.ndarray
    tops: np.ndarray
    seconds: np.ndarray
    options: list[tuple[int, ...]] | None = None
    picks: np.ndarray | None = None


@dataclass(frozen=True)
class _Ends:
    """The closed regions of one start, end and following kind, as arrays."""

    costs: np.ndarray  # a _cost_table
    seconds: np.ndarray
    last: np.ndarray  # each region's last option: which state it reaches
    options: list[tuple[int, ...]]

    @classmethod
    def of(cls, closed: list[_Closed]) -> "_Ends":
        return cls(_cost_table(closed), np.array([c.seconds for c in closed], dtype=np.float64),
                   np.array([c.options[-1] for c in closed], dtype=np.int64), [c.options for c in closed])


_ONE = np.zeros(1, dtype=np.int64)  # the members of a one-candidate batch


def _stairs(times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The H (and seconds) at which ``times`` is faster than at every lower H: the points no other beats, since
    a lower H leaves every later event more room. Transitions from the others reach nothing better.

    >>> held, fastest = _stairs(np.array([np.inf, 3.0, 3.0, 1.0, 2.0, 0.5]))
    >>> held.tolist(), fastest.tolist()
    ([1, 3, 5], [3.0, 1.0, 0.5])
    """
    before = np.concatenate(([np.inf], np.minimum.accumulate(times)[:-1]))
    held = np.flatnonzero(times < before)
    return held, times[held]


class _Outer:
    """States ``(i, how stage i-1 ran, kind of segment at i)``, each an array over H (in units) of least seconds.

    No back-pointers are kept: a schedule is read back by finding, at each state, a transition whose source
    value plus its seconds equals the state's value (the same float sum, so equal exactly)."""

    def __init__(self, tables: _Tables, budget: int):
        self.tables, self.budget = tables, budget
        self.size = _span(tables.problem, budget) // tables.unit + 1
        self.times: dict[tuple[int, int, str], np.ndarray] = {}
        self.incoming: dict[tuple[int, int, str], list[tuple[_Batch, np.ndarray]]] = {}  # with its members
        self.lowest: dict[tuple[int, int, str], int] = {}  # first reachable H of each source state
        self.stairs: dict[tuple[int, int, str], tuple[np.ndarray, np.ndarray]] = {}  # see _stairs
        for kind in KINDS:
            self._state((0, NO_STAGE, kind))[0] = 0.0

    def _state(self, key: tuple[int, int, str]) -> np.ndarray:
        if key not in self.times:
            self.times[key] = np.full(self.size, np.inf)
            self.incoming[key] = []
        return self.times[key]

    def relax_stored(self, source: tuple[int, int, str], need: int, adds: int,
                     target: tuple[int, int, str]) -> None:
        """Store stage ``source[0]``: H grows by ``adds`` (rounded up to units); every event needs ``need`` + H."""
        unit = self.tables.unit
        shift = self.tables.units(adds)  # rounded up: H in units never holds less than the bytes it stands for
        top = min((self.budget - need) // unit, self.size - 1 - shift)
        if top < self.lowest[source]:
            return
        dest = self._state(target)
        window = dest[shift:shift + top + 1]
        np.minimum(window, self.times[source][:top + 1], out=window)
        self.incoming[target].append((_Batch(source, np.array([shift]), np.array([top]), np.zeros(1)), _ONE))

    def relax_regions(self, source: tuple[int, int, str], ends: _Ends, e: int, kind: str) -> None:
        """Relax every closed region of one start, end and following kind at once: each reaches the state of
        its last option."""
        unit = self.tables.unit
        need, adds = _region_needs(self.tables, source[0], source[1], ends.costs)
        shift = self.tables.units(adds)
        top = np.minimum((self.budget - need) // unit, self.size - 1 - shift)
        lowest = self.lowest[source]
        keep = np.flatnonzero(top >= lowest)
        if not len(keep):
            return
        useful = keep[_unbeaten(ends.last[keep] * (self.size + 1) + shift[keep], top[keep], ends.seconds[keep])]
        shift, top, last, seconds = shift[useful], top[useful], ends.last[useful], ends.seconds[useful]
        held, fastest = self.stairs[source]
        batch = _Batch(source, shift, top, seconds, ends.options, useful)
        for option in np.unique(last).tolist():
            members = np.flatnonzero(last == option)
            reaches = held[None, :] <= top[members, None]  # which of the source's points each region leaves room for
            targets = (held[None, :] + shift[members, None])[reaches]
            arrived = (fastest[None, :] + seconds[members, None])[reaches]
            np.minimum.at(self._state((e + 1, option, kind)), targets, arrived)
            self.incoming[(e + 1, option, kind)].append((batch, members))

    def sources(self, i: int) -> list[tuple[int, int, str]]:
        """The reachable states at position ``i`` (final once the program is there)."""
        keys = [key for key in self.times if key[0] == i and np.isfinite(self.times[key]).any()]
        for key in keys:
            self.lowest[key] = int(np.argmax(np.isfinite(self.times[key])))
            self.stairs[key] = _stairs(self.times[key])
        return keys

    def best(self, n: int) -> tuple[tuple[int, int, str], int] | None:
        finals = [(float(self.times[key].min()), key) for key in self.times if key[0] == n]
        finals = [(value, key) for value, key in finals if np.isfinite(value)]
        if not finals:
            return None
        _, key = min(finals, key=lambda f: f[0])
        return key, int(np.argmin(self.times[key]))

    def schedule(self, key: tuple[int, int, str], h: int) -> Schedule:
        regions = []
        while key[0] > 0:
            batch, j = self._arrival(key, h)
            if batch.options is not None:
                regions.append(Region(batch.source[0], key[0], batch.options[batch.picks[j]]))
            key, h = batch.source, h - int(batch.shifts[j])
        return Schedule(tuple(reversed(regions)))

    def _arrival(self, key: tuple[int, int, str], h: int) -> tuple[_Batch, int]:
        """A transition (batch, candidate) that gives state ``key`` its value at ``h``."""
        value = self.times[key][h]
        for batch, members in self.incoming[key]:
            start = h - batch.shifts[members]
            valid = (start >= 0) & (start <= batch.tops[members])
            arrived = self.times[batch.source][np.where(valid, start, 0)] + batch.seconds[members]
            match = np.flatnonzero(valid & (arrived == value))
            if len(match):
                return batch, int(members[match[0]])
        raise AssertionError(f"no transition reaches state {key} at H={h}")


def _least_seconds(tables: _Tables, budget: int, limit: int, ceiling: float = math.inf,
                   search: "_Search | None" = None) -> tuple[Schedule | None, bool]:
    """The time-optimal schedule of the DP's model within ``budget`` (None if none), and whether no front was cut.

    Given a ``ceiling`` (the recompute seconds of a known plan), partial plans already slower are dropped: the
    result is the same when some plan at most that slow exists, and the work far smaller at loose budgets."""
    n = tables.problem.num_stages
    outer = _Outer(tables, budget)
    shared = _Shared(tables, budget, limit, ceiling, search)
    exact = True
    for i in range(n):
        if search is not None:
            search.check(f"{search.label}: stage {i + 1}/{n}"
                         + (f", ceiling {ceiling:.4g}s" if ceiling < math.inf else ""))
        sources = outer.sources(i)
        for source in [s for s in sources if s[2] == "stored"]:
            for kind in (KINDS if i + 1 < n else (NONE,)):
                need, adds = _stored_move(tables, i, source[1], kind)
                outer.relax_stored(source, need, adds, (i + 1, STORED, kind))
        region_sources = [s for s in sources if s[2] == "region"]
        if not region_sources:
            continue
        held = min(outer.lowest[s] for s in region_sources)  # H every region starting here adds to
        fastest = min(float(outer.times[s].min()) for s in region_sources)
        if i in shared.repeats:
            ends = shared.region_ends(i, budget - held * tables.unit, ceiling - fastest)
        else:
            ends = _region_ends(tables, i, budget - held * tables.unit, limit, ceiling=ceiling - fastest,
                                search=search)
        for e, kind, closed in ends:
            if e is None:
                exact &= closed
                continue
            if closed:
                ends = _Ends.of(closed)
                for source in region_sources:
                    outer.relax_regions(source, ends, e, kind)
    found = outer.best(n)
    return (outer.schedule(*found) if found else None), exact


def _least_peak(tables: _Tables, limit: int) -> tuple[Schedule, bool]:
    """A schedule with the least peak in the DP's model (exact bytes when ``unit`` is 1), and whether no front was
    cut. Each state keeps the Pareto front of (H, peak so far)."""
    n = tables.problem.num_stages
    fronts: dict[tuple[int, int, str], list[tuple[int, int, tuple | None]]] = {
        (0, NO_STAGE, kind): [(0, 0, None)] for kind in KINDS}
    exact = True

    def push(source, entry, need: int, adds: int, region, target) -> None:
        h, peak, _ = entry
        fronts.setdefault(target, []).append((h + adds, max(peak, h + need), (source, entry, region)))

    for i in range(n):
        sources = [key for key in fronts if key[0] == i]
        for key in sources:
            fronts[key] = _front(fronts[key])
        for source in [s for s in sources if s[2] == "stored"]:
            for kind in (KINDS if i + 1 < n else (NONE,)):
                need, adds = _stored_move(tables, i, source[1], kind)
                for entry in fronts[source]:
                    push(source, entry, need, adds, None, (i + 1, STORED, kind))
        region_sources = [s for s in sources if s[2] == "region"]
        if not region_sources:
            continue
        for e, kind, closed in _region_ends(tables, i, None, limit, track_time=False):
            if e is None:
                exact &= closed
                continue
            table = _cost_table(closed)
            for source in region_sources:
                needs, adds = _region_needs(tables, i, source[1], table)
                for c, need, added in zip(closed, needs.tolist(), adds.tolist()):
                    for entry in fronts[source]:
                        push(source, entry, need, added, Region(i, e + 1, c.options), (e + 1, c.options[-1], kind))
    finals = [entry for key in fronts if key[0] == n for entry in fronts[key]]
    entry = min(finals, key=lambda x: x[1])
    regions = []
    while entry[2] is not None:
        _, entry, region = entry[2]
        if region is not None:
            regions.append(region)
    return Schedule(tuple(reversed(regions))), exact


def _front(entries: list[tuple[int, int, tuple | None]]) -> list[tuple[int, int, tuple | None]]:
    """Entries no other entry beats in both H and peak."""
    kept: list[tuple[int, int, tuple | None]] = []
    for entry in sorted(entries, key=lambda x: (x[0], x[1])):
        if not kept or entry[1] < kept[-1][1]:
            kept.append(entry)
    return kept


def _span(problem: Problem, budget_bytes: int) -> int:
    """The bytes H can range over: every event counts the fixed memory besides H."""
    return max(budget_bytes - problem.fixed_bytes, 1)


def _unit(problem: Problem, budget_bytes: int, buckets: int) -> tuple[int, bool]:
    """The bytes per step of H, and whether every tensor size is a multiple of it (no rounding).

    The sizes' gcd when the budget above the fixed memory spans at most ``buckets`` of it; else the largest power
    of two that gives at least ``buckets`` steps (fewer than twice as many): tensor sizes are mostly multiples of
    large powers of two, so sums of them round to whole steps with little or no loss.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> problem = Problem((Stage("a", 1.0, 1.0),), (TensorInfo("x", 3 << 20, 0),), fixed_bytes=1 << 30)
    >>> _unit(problem, (1 << 30) + (100 << 20), 50), _unit(problem, (1 << 30) + (100 << 20), 10)
    ((3145728, True), (8388608, False))
    """
    sizes = [t.nbytes for t in problem.tensors if t.nbytes > 0]
    gcd = reduce(math.gcd, sizes, 0) or 1
    span = _span(problem, budget_bytes)
    if span // gcd <= buckets:
        return gcd, True
    unit = 1 << max(0, (span // buckets).bit_length() - 1)
    return unit, all(size % unit == 0 for size in sizes)


NATURAL_STEPS = 8  # a plan's search may take up to this many times its steps for a unit that rounds almost nothing
ROUNDING_SHARE = 0.002  # ... when the sizes' remainders are at most this share of all tensor bytes


def _natural_unit(problem: Problem, budget_bytes: int, buckets: int) -> tuple[int, bool]:
    """:func:`_unit`, or a finer power of two when it rounds tensor sizes far less, then stretched to the step
    that rounds the program's byte counts up the least (:func:`_fitted_unit`): Llama-7B's 86 MiB activations are
    43 steps of 2 MiB, but 10.75 of the 8 MiB that 2000 steps give, and rounding each region's bytes up by most of
    a step made its plans 2.4% slower (0.02161 s against 0.02111 s at 2 MiB).

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> tensors = (TensorInfo("x", 43 << 21, 0), TensorInfo("loss", 4, 0))
    >>> problem = Problem((Stage("a", 1.0, 1.0),), tensors, fixed_bytes=1 << 30)
    >>> _unit(problem, (1 << 30) + (800 << 20), 50), _natural_unit(problem, (1 << 30) + (800 << 20), 50)
    ((16777216, False), (2097152, False))
    """
    unit, exact = _unit(problem, budget_bytes, buckets)
    sizes = [t.nbytes for t in problem.tensors if t.nbytes > 0]
    limit = ROUNDING_SHARE * sum(sizes)
    span = _span(problem, budget_bytes)
    finer = unit
    while not exact and span // finer <= NATURAL_STEPS * buckets:
        if sum(size % finer for size in sizes) <= limit:
            unit, exact = finer, all(size % finer == 0 for size in sizes)
            break
        finer //= 2
    return (unit, exact) if exact else (_fitted_unit(problem, unit), False)


FITTED_VALUES = 256  # the most frequent byte counts a fitted step is judged on
FITTED_SOURCES = 16  # ... and the most frequent ones it is fitted to


def _decision_bytes(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """The byte counts the program rounds to steps, most frequent first, and how often each occurs: what each
    stage caches with each option, and what a stored stage or a region's last stage leaves held."""
    tables = _tables(problem, 1)
    counts = Counter(v for sums in tables.sums for v in sums.cached if v > 0)
    counts.update(v for p in tables.pending.values() for v in {p.own, p.own + p.held_by_next} if v > 0)
    common = counts.most_common(FITTED_VALUES)
    return np.array([v for v, _ in common], dtype=np.int64), np.array([c for _, c in common], dtype=np.int64)


def _fitted_unit(problem: Problem, unit: int) -> int:
    """The step from ``unit`` up to (not including) twice it that rounds :func:`_decision_bytes` up the least
    (weighted by how often each occurs; ties: the longer step): a step slightly longer than a power of two can
    hold a repeated block's bytes almost exactly. Llama-7B's blocks store 760.53 MiB, 762 MiB in steps of 2 MiB;
    with steps of 2.012 MiB (the step chosen) its counts round up far less, and the plan search finds a plan 0.5%
    faster (0.020974 s against 0.021074 s with the same options), which peaks 9 MiB under the budget.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(3))
    >>> saved = tuple(TensorInfo(f"a{i}", 1030, i, savers=frozenset({i})) for i in range(3))
    >>> _fitted_unit(Problem(stages, saved), 512)  # 1030 bytes: 3 steps of 512 (1536), 2 of 515
    515
    """
    values, counts = _decision_bytes(problem)
    if not len(values):
        return unit
    steps = _candidate_steps(values, unit, 2 * unit - 1, up=True)
    losses = [int(((-values) % step * counts).sum()) for step in steps]
    return steps[losses.index(min(losses))]


def _bound_unit(problem: Problem, budget_bytes: int, buckets: int) -> int:
    """The step of a bound's program: :func:`_unit`, or a step down to half of it that rounds
    :func:`_decision_bytes` down less than half as much (weighted by how often each occurs). Rounded down, a
    bound loses what every segment's bytes lose: Llama-7B's blocks cache 332 MiB with one option, 41.5 steps of
    8 MiB, 83 of 4 MiB, and its bound at 4 MiB is 0.020869 s against 0.020688 s at 8 MiB, in about the same time
    (22 s against 20 s within a plan's 0.020974 s).

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(3))
    >>> saved = tuple(TensorInfo(f"a{i}", 1534, i, savers=frozenset({i})) for i in range(3))
    >>> problem = Problem(stages, saved + (TensorInfo("loss", 1, 2),))  # sizes' gcd 1: steps of a power of two
    >>> _unit(problem, 1 << 20, 1000)[0], _bound_unit(problem, 1 << 20, 1000)  # 1534 bytes: 2 steps of 767
    (1024, 767)
    """
    unit, exact = _unit(problem, budget_bytes, buckets)
    if exact:
        return unit
    values, counts = _decision_bytes(problem)
    if not len(values):
        return unit
    steps = _candidate_steps(values, max(1, unit // 2), unit, up=False)
    losses = [int((values % step * counts).sum()) for step in steps]
    best = steps[losses.index(min(losses))]
    return best if 2 * min(losses) <= losses[steps.index(unit)] else unit


def _candidate_steps(values: np.ndarray, low: int, high: int, up: bool) -> list[int]:
    """Steps from ``low`` to ``high`` that hold one of the most frequent ``values`` in whole steps (rounding it
    up, or down), with both ends; the longest first."""
    steps = {low, high}
    for value in values[:FITTED_SOURCES].tolist():
        for count in range(max(1, value // high), value // low + 1):
            step = -(-value // count) if up else value // count
            if low <= step <= high:
                steps.add(step)
    return sorted(steps, reverse=True)


FRONT_LIMIT = 256  # most Pareto points kept per inner state; fewer on long problems, see _front_limit


def _front_limit(problem: Problem) -> int:
    """Fronts are cut (and the result marked FEASIBLE) only past this size: all of it on short problems, less on
    long ones, where the work grows with stages squared times the front."""
    return max(16, min(FRONT_LIMIT, 2 ** 17 // max(problem.num_stages, 1) ** 2))


@lru_cache(maxsize=8)
def minimum_peak_schedule(problem: Problem) -> Schedule:
    """A schedule reaching the smallest peak any schedule reaches: by this DP on chains, else by the ILP, started
    from :func:`_low_peak_schedules`.

    Exact unless a Pareto front had to be cut (long chains with many options), where it is a schedule whose peak
    is an upper bound of the smallest, or the ILP ran out of time. Remembered per problem: a time-limited ILP may
    answer differently each time, and a budget set from :func:`minimum_peak` must stay feasible for the solvers
    (a Llama's 0% fidelity point was 13.09 MiB by one call and 13.50 MiB by the next)."""
    if problem.is_chain():
        schedule, _ = _least_peak(_tables(problem, 1), _front_limit(problem))
        return schedule
    from .ilp import min_peak_schedule
    return min_peak_schedule(problem, candidates=_low_peak_schedules(problem))[0]


LOW_PEAK_BUCKETS = 2000  # steps of H in the quick least-peak searches that start the ILP


def _low_peak_schedules(problem: Problem) -> list[Schedule]:
    """Schedules of a low peak on a non-chain, found in well under a second where the ILP may take its whole time
    limit: this program's least-peak schedules over regions that recompute whole stages, on
    :func:`chain_restriction` and (with at most ``PINNED_LIMIT`` far-reaching tensors) with them pinned, in steps
    of H rounded up. On BART at layer granularity (49 stages), the ILP alone stopped at its 60 s limit with a peak
    of 980,552 bytes, or 920,056 in another run; started from these, 837,368 bytes.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(3))
    >>> skip = TensorInfo("skip", 100, 0, frozenset({2}), frozenset({2}))
    >>> problem = Problem(stages, (skip,) + tuple(TensorInfo(f"a{i}", 50, i, savers=frozenset({i})) for i in range(3)))
    >>> [simulate(problem, s).peak_bytes for s in _low_peak_schedules(problem)], minimum_peak(problem)
    ([150, 150], 150)
    """
    whole = dataclasses.replace(problem, stages=tuple(
        dataclasses.replace(stage, options=stage.recompute_options[:1]) for stage in problem.stages))
    eager = simulate(problem, store_all(problem)).peak_bytes
    unit = max(1, (eager - problem.fixed_bytes) // LOW_PEAK_BUCKETS)
    limit = _front_limit(problem)
    found = [_least_peak(_tables(chain_restriction(whole), unit), limit)[0]]
    if _far_reaching(whole) <= PINNED_LIMIT:
        found.append(_least_peak(_tables(whole, unit), limit)[0])
    return found


def minimum_peak(problem: Problem) -> int:
    """The smallest peak (bytes) any schedule reaches; the least budget any solver can meet.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> problem = Problem((Stage("a", 1.0, 2.0), Stage("b", 1.0, 2.0)),
    ...                   (TensorInfo("x", 10, 0, frozenset({1}), frozenset({0, 1})),
    ...                    TensorInfo("y", 50, 0, frozenset(), frozenset({0}))), fixed_bytes=100)
    >>> minimum_peak(problem)
    160
    """
    return simulate(problem, minimum_peak_schedule(problem)).peak_bytes


def _split_far(problem: Problem) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """The tensors a chain keeps (model outputs lose their readers, which changes nothing: the caller holds them
    throughout) and the far-reaching ones, read or saved past the next stage."""
    kept, far = [], []
    for t in problem.tensors:
        if t.is_output:
            kept.append(dataclasses.replace(t, consumers=frozenset()))
        elif _is_local(t, problem.num_stages):
            kept.append(t)
        else:
            far.append(t)
    return kept, far


def chain_relaxation(problem: Problem) -> Problem:
    """A chain on which every schedule peaks no higher than on ``problem``: its optimum is a lower bound.

    A tensor read or saved past the next stage (or returned from earlier than the last two stages) is dropped;
    the forward bytes it occupies whatever the schedule (from its producer to its last forward reader, or to the
    end when returned) move into those stages' forward workspaces, and the ``Stage.held_inputs`` sets that name it
    go (as if it were never held). Model outputs lose their readers, which changes nothing (the caller holds them
    throughout). On a chain it returns ``problem`` itself.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(3))
    >>> mask = TensorInfo("mask", 8, 0, frozenset({1, 2}), frozenset({2}))
    >>> relaxed = chain_relaxation(Problem(stages, (mask,)))
    >>> relaxed.is_chain(), [s.forward_workspace_bytes for s in relaxed.stages], relaxed.tensors
    (True, [8, 8, 8], ())
    """
    if problem.is_chain():
        return problem
    kept, far = _split_far(problem)
    dropped = {t.name for t in far}
    extra = [0] * problem.num_stages
    for t in far:  # one that dies inside its stage forces nothing
        for k in range(t.producer, unheld_forward_until(problem, t) + 1):
            extra[k] += t.nbytes
    stages = tuple(dataclasses.replace(s.plus_forward_bytes(extra[k]), held_inputs=tuple(
        h for h in s.held_inputs if not h.tensors & dropped)) for k, s in enumerate(problem.stages))
    return dataclasses.replace(problem, stages=stages, tensors=tuple(kept), name=f"{problem.name} (chain relaxation)")


class SolverTimeout(Exception):
    """Raised inside the dynamic program when its deadline passes."""


@dataclass(frozen=True)
class _Search:
    """What every pass of the program shares: the budget, discretisation, front limit, deadline, progress."""

    budget: int
    buckets: int
    limit: int
    deadline: float | None = None
    progress: Callable[[str], None] | None = None
    longest_region: int | None = None  # stages; None: any (a bound's search must not cap them)
    label: str = "dp"  # what progress lines start with

    def check(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)
        self.check_time(message)

    def check_time(self, message: str = "") -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise SolverTimeout(message)


def _first_ceiling(problem: Problem) -> float:
    """The fastest single recomputation: no plan that recomputes anything is faster."""
    positive = [s for stage in problem.stages for o in range(len(stage.recompute_options))
                if (s := stage.stopped_seconds(o)) > 0]
    return min(positive, default=0.0)


ROUGH_BUCKETS, ROUGH_FRONT = 150, 4  # the first bound of long, time-limited problems: seconds on thousands of ops
SHORT_REGIONS = 2  # stages per region in the quick first search
LONG_PROBLEM = 16  # stages from which a time-limited solve takes a rough bound, then better plans, first
EARLY_SEARCH_SHARE = 0.4  # of the time left, what those better plans get before the bound: on Llama-7B a
# 2.3% faster plan (0.02111 s) cut the bound's search at 2000 steps from about 45 s to 23 s
EARLY_LONGEST = 8  # ... with regions of at most this many stages (longer searches rarely finish in that time)
FOCUS_SHARE = 0.25  # of the time left, what a search over the options of a plan (_focused) may take
FINE_BOUND_SHARE = 0.95  # of the time left, what the bound at the full steps gets (better plans, the rest)
FINE_BOUND_COST = 15  # that bound takes about this many times the rough one (a 1k-op DAG 21-29x), less where
# repeated blocks share their regions (see _fine_bound_cost; Llama-7B: 7-8x); given less time, it merges fronts
# sooner (DAG: 16 s for 0.0503 s instead of 87 s for 0.0609 s)


def _passes(problem: Problem, search: _Search, first_ceiling: float) -> tuple[Schedule | None, bool]:
    """Passes that keep only partial plans within a ceiling on recompute seconds, growing threefold: early passes
    (and the one that succeeds at loose budgets) are cheap. A pass whose plan is within its ceiling found the
    optimum (no partial plan of a faster one was dropped); a plan over it still bounds the optimum, so it becomes
    the next ceiling."""
    unit, exact_unit = _natural_unit(problem, search.budget, search.buckets)
    tables = _tables(problem, unit)
    ceiling = first_ceiling * (1 + 1e-9)
    slowest = sum(max(o.recompute_seconds for o in stage.recompute_options) for stage in problem.stages)
    best: Schedule | None = None  # a plan over its pass's ceiling: not proven fastest, but a plan
    while True:
        if ceiling > slowest:
            ceiling = math.inf  # as good as none, and the pass that follows is the last
        try:
            schedule, complete = _least_seconds(tables, search.budget, search.limit, ceiling, search)
        except SolverTimeout:
            if best is None:
                raise
            return best, False
        if schedule is None and ceiling == math.inf:
            return None, False
        seconds = math.inf if schedule is None else recompute_seconds(problem, schedule)
        if seconds <= ceiling:
            return schedule, complete and exact_unit and problem.is_chain()
        best = schedule
        ceiling = min(ceiling * 3 if ceiling > 0 else math.inf, seconds * (1 + 1e-9))


def lower_bound(problem: Problem, budget_bytes: int, *, ceiling: float = math.inf, buckets: int = 2000,
                deadline: float | None = None) -> float | None:
    """A proven lower bound on the recompute seconds of every schedule of ``problem`` within ``budget_bytes``.

    The program runs on :func:`chain_relaxation` with byte counts rounded *down* and no Pareto front cut: every
    schedule fits there when it fits ``problem``, so the fastest it finds is no slower than the true optimum.
    Returns ``ceiling`` when no schedule within ``ceiling`` seconds fits (pass a known plan's seconds to bound the
    work), and None when ``deadline`` passes first.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(4))
    >>> inner = tuple(TensorInfo(f"a{i}", 100, i, frozenset({i}), frozenset({i})) for i in range(4))
    >>> edges = tuple(TensorInfo(f"x{i}", 10, i, frozenset({i + 1}), frozenset({i + 1})) for i in range(3))
    >>> lower_bound(Problem(stages, inner + edges), 250)
    2.0
    """
    return _relaxed_optimum(problem, budget_bytes, _Search(budget_bytes, buckets, 1 << 62, deadline), ceiling)[0]


def _relaxed_optimum(problem: Problem, budget_bytes: int, search: _Search,
                     ceiling: float) -> tuple[float | None, Schedule | None]:
    """:func:`lower_bound`, with the relaxation's optimal schedule (None when none is within ``ceiling``). When
    that schedule also fits ``problem``, it is optimal there: nothing is faster than the bound."""
    relaxed = chain_relaxation(problem)
    unit = _bound_unit(relaxed, budget_bytes, search.buckets)
    tables = _tables(relaxed, unit, optimistic=True)
    try:
        schedule, _ = _least_seconds(tables, budget_bytes, search.limit, ceiling, search)
    except SolverTimeout:
        return None, None
    if schedule is None:
        return ceiling, None
    # with merged points the schedule's memory may be optimistic, but its seconds are the program's optimum
    # (a merged point keeps its fastest member's options and seconds); the caller checks that it fits
    return _relaxed_seconds(relaxed, schedule), schedule


def _relaxed_seconds(problem: Problem, schedule: Schedule) -> float:
    """``schedule``'s recompute seconds as a relaxation's program counts them: its stages never cache for the
    re-run's bytes, so every region whose last option caches nothing stops early (never more than the seconds
    the schedule takes, so its optimum stays a lower bound).

    >>> from planner.problem import RecomputeOption, Stage
    >>> options = (RecomputeOption("recompute_all", frozenset(), 2.0), RecomputeOption("c", frozenset("a"), 1.0))
    >>> problem = Problem(tuple(Stage(f"s{i}", 2.0, 4.0, options=options, early_stop_seconds=0.5)
    ...                         for i in range(2)), ())
    >>> schedule = Schedule((Region(0, 2, (1, 0)),))
    >>> _relaxed_seconds(problem, schedule), recompute_seconds(problem, schedule)
    (2.5, 3.0)
    """
    return sum(stage_recompute_seconds(problem, r, k, caches=False) for r in schedule.regions for k in r.stages)


FINISHING_SIMULATIONS = 12  # what a solve keeps back from its time limit, in simulations of the problem

GAP_TOLERANCE = 1e-9  # gaps below this are rounding in the float sums: reported as optimal


def solve_dp(problem: Problem, budget_bytes: int, *, buckets: int = 2000, front_limit: int | None = None,
             time_limit: float | None = None, progress: Callable[[str], None] | None = None,
             bound: bool = True, target_gap: float = 0.01, refinements: int = 2) -> Plan:
    """The schedule with the least recompute time within ``budget_bytes``, by dynamic programming, with its
    optimality gap against :func:`lower_bound`.

    The plan's ``gap`` is proven: the lower bound is the optimum of a relaxation. Status ``OPTIMAL`` when the gap
    is zero, else ``FEASIBLE``. ``front_limit`` caps the Pareto points kept per inner state of the search for a
    plan (default: all of them up to 256, fewer on long problems); the bound's search merges points into ideal
    ones past ``BOUND_FRONTS`` times that, which keeps it a bound. ``time_limit`` (seconds) stops the search: the
    best plan found so far is returned (a baseline if none), with the gap when a bound finished; ``progress``
    receives a line per stage. ``bound=False`` skips the bound (gap None unless exact).

    The order: a quick search with regions of at most ``SHORT_REGIONS`` stages gives a first plan, and a search
    with regions of any length over the options that plan uses (:func:`_focused`, ``FOCUS_SHARE`` of the time
    left) a better one (long, time-limited problems then take a rough bound of ``ROUGH_BUCKETS`` steps, in case
    the time runs out, and, when the focused search found nothing, search for better plans with regions of up to
    ``EARLY_LONGEST`` stages within ``EARLY_SEARCH_SHARE`` of the time left: a faster plan makes the bound's
    search far smaller); the bound's search follows, within the best
    plan's seconds (merging fronts sooner when the time left looks too short for it), and when the relaxation's
    optimal schedule also fits the problem it is returned, proven optimal. Else searches within the best plan's
    seconds go on deepening the longest region until any length is allowed, each plan they find focused again.
    While the gap exceeds
    ``target_gap`` (rounding to ``buckets`` steps of memory is what usually opens it), up to ``refinements``
    more rounds run with four times finer steps, keeping the best plan and bound; a round searches for plans only
    when its finer bound rose (else the rounding did not hold the bound, and searches at finer steps rarely
    beat the plan: on Llama-7B they took 18 s a round and found nothing, where two rounds of bounds, 15 s, proved
    the optimum).
    Raises :class:`~planner.errors.InfeasibleBudgetError` with the smallest achievable peak when no schedule fits.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> problem = Problem((Stage("a", 1.0, 2.0),), (TensorInfo("x", 100, 0, savers=frozenset({0})),),
    ...                   fixed_bytes=1000)
    >>> solve_dp(problem, 1050)
    Traceback (most recent call last):
    ...
    planner.errors.InfeasibleBudgetError: budget 1.03 KiB is below the smallest peak any plan reaches, 1.07 KiB ...
    """
    started = time.perf_counter()
    deadline = None if time_limit is None else started + time_limit

    def plan(schedule: Schedule, lower: float | None, exact: bool = False) -> Plan:
        seconds = recompute_seconds(problem, schedule)
        gap = 0.0 if exact else relative_gap(seconds, lower)
        status = SolverStatus.OPTIMAL if gap is not None and gap <= GAP_TOLERANCE else SolverStatus.FEASIBLE
        return Plan.from_schedule(problem, schedule, solver="dp", status=status, gap=gap,
                                  lower_bound_seconds=seconds if exact else lower,
                                  solve_seconds=time.perf_counter() - started, budget_bytes=budget_bytes)

    if simulate(problem, store_all(problem)).peak_bytes <= budget_bytes:
        return plan(store_all(problem), 0.0)
    if budget_bytes <= 0:
        raise infeasible_budget_error(problem, budget_bytes, minimum_peak_schedule(problem))
    if deadline is not None:  # leave time to check and describe the plan (a few simulations) within the limit
        deadline = max(started, deadline - FINISHING_SIMULATIONS * (time.perf_counter() - started))
    search = _Search(budget_bytes, buckets, front_limit or _front_limit(problem), deadline, progress)
    try:
        schedule, exact = _within_budget(problem, dataclasses.replace(search, longest_region=SHORT_REGIONS))
    except SolverTimeout:
        schedule = _best_baseline(problem, budget_bytes)
        if schedule is None:
            raise PlannerError(f"the dynamic program found no plan within its time limit of {time_limit:g}s",
                               hint="raise time_limit, or use solver='ilp'") from None
        return plan(schedule, None)
    focused = None if exact else _focused(problem, _sharing(search, FOCUS_SHARE), schedule)
    schedule = focused or schedule
    seconds = recompute_seconds(problem, schedule)
    lower = None
    longest: int | None = 2 * SHORT_REGIONS  # where the search for better plans goes on (None: done)
    level_seconds = 0.0  # what its last finished level took
    rough_seconds = 0.0  # what the rough bound took: the fine one takes about FINE_BOUND_COST times as long
    if bound and not exact and deadline is not None and problem.num_stages >= LONG_PROBLEM:
        rough_started = time.perf_counter()
        lower = _relaxed_optimum(problem, budget_bytes, _bound_search(search, ROUGH_BUCKETS, 1 / 4, limit=ROUGH_FRONT),
                                 seconds * (1 + 1e-9))[0]
        rough_seconds = time.perf_counter() - rough_started
        if focused is None:  # else the bound already searches within a plan that longer regions rarely beat
            deepened = _deepening(problem, _sharing(search, EARLY_SEARCH_SHARE), seconds, up_to=EARLY_LONGEST)
            exact, longest, level_seconds = deepened.exact, deepened.longest, deepened.level_seconds
            if deepened.schedule is not None:
                schedule, seconds = _refocused(problem, search, deepened.schedule)
    for round_ in range(refinements + 1):
        if exact or (bound and (relative_gap(seconds, lower) or 0.0) <= target_gap and lower is not None):
            break
        if round_:
            if bound and _natural_unit(problem, budget_bytes, search.buckets)[1] and \
                    _unit(chain_relaxation(problem), budget_bytes, search.buckets)[1]:
                break  # nothing was rounded: finer steps change nothing
            search = dataclasses.replace(search, buckets=search.buckets * 4)
            longest, level_seconds = 2 * SHORT_REGIONS, 0.0
        coarser = lower
        if bound:
            fronts = BOUND_FRONTS
            if deadline is not None and \
                    FINE_BOUND_SHARE * (deadline - time.perf_counter()) < _fine_bound_cost(problem) * rough_seconds:
                fronts = 1  # fronts merged four times sooner: about a quarter of the time, a looser bound
            found, relaxed_plan = _relaxed_optimum(problem, budget_bytes,
                                                   _bound_search(search, search.buckets, FINE_BOUND_SHARE, fronts),
                                                   seconds * (1 + 1e-9))
            lower = _higher_bound(lower, found)
            if relaxed_plan is not None and recompute_seconds(problem, relaxed_plan) <= seconds \
                    and simulate(problem, relaxed_plan).peak_bytes <= budget_bytes:
                schedule, seconds = relaxed_plan, recompute_seconds(problem, relaxed_plan)
            if lower is not None and (relative_gap(seconds, lower) or 0.0) <= target_gap:
                break
        rose = lower != coarser  # lower keeps the higher bound: it moves only when this round's finer one is higher
        if longest is not None and (not round_ or not bound or rose):
            deepened = _deepening(problem, search, seconds, longest, level_seconds=level_seconds)
            exact, longest, level_seconds = deepened.exact, deepened.longest, deepened.level_seconds
            if deepened.schedule is not None:
                schedule, seconds = deepened.schedule, recompute_seconds(problem, deepened.schedule)
                if not exact:
                    schedule, seconds = _refocused(problem, search, schedule)
        if not bound or (deadline is not None and time.perf_counter() > deadline):
            break
    return plan(schedule, lower, exact)


def _fine_bound_cost(problem: Problem) -> float:
    """About how many times the rough bound's time the fine one takes: ``FINE_BOUND_COST``, down to half of it
    as more of the relaxation's stages repeat an earlier one (their regions are solved once for all)."""
    tables = _tables(chain_relaxation(problem), 1, optimistic=True)
    signatures = [_signature(tables, k) for k in range(problem.num_stages)]
    repeated = sum(1 for k, sig in enumerate(signatures) if sig is not None and signatures.index(sig) < k)
    return FINE_BOUND_COST * (1 - repeated / max(1, problem.num_stages) / 2)


def _refocused(problem: Problem, search: _Search, schedule: Schedule) -> tuple[Schedule, float]:
    """``schedule``, or the faster plan :func:`_focused` finds from it, with its recompute seconds."""
    schedule = _focused(problem, _sharing(search, FOCUS_SHARE), schedule) or schedule
    return schedule, recompute_seconds(problem, schedule)


def _higher_bound(bound: float | None, other: float | None) -> float | None:
    """The better of two lower bounds, either of which may be missing (None).

    >>> _higher_bound(None, 2.0), _higher_bound(3.0, None), _higher_bound(3.0, 2.0)
    (2.0, 3.0, 3.0)
    """
    if bound is None or (other is not None and other > bound):
        return other
    return bound


@dataclass(frozen=True)
class _Deepened:
    """What :func:`_deepening` found: a faster plan (or None), whether the last, unlimited search was exact, the
    longest regions of the search that did not run or finish (None once the unlimited one finished), and the
    seconds the last finished search took."""

    schedule: Schedule | None
    exact: bool
    longest: int | None
    level_seconds: float


LEVEL_GROWTH = 3  # doubling the longest region multiplies a search's time by about 4 (Llama-7B: 3.6 s, then
# 14.6 s); one that looks like needing more than this many times the last is not begun: cut off, it finds nothing


def _deepening(problem: Problem, search: _Search, seconds: float, longest: int = 2 * SHORT_REGIONS,
               up_to: int | None = None, level_seconds: float = 0.0) -> _Deepened:
    """Searches within ``seconds`` (a known plan's) with regions of at most ``longest`` stages, then twice as
    long, until any length (or past ``up_to``, or when the time left looks too short for the next): each is
    cheaper than the next, so a time limit still leaves the best plan found so far. ``level_seconds``: what the
    last search took."""
    best = None
    while True:
        too_short = search.deadline is not None and \
            search.deadline - time.perf_counter() < LEVEL_GROWTH * level_seconds
        if (up_to is not None and longest > up_to) or too_short:
            return _Deepened(best, False, longest, level_seconds)
        unlimited = longest >= problem.num_stages
        started = time.perf_counter()
        try:
            found, exact = _within_budget(problem, dataclasses.replace(
                search, longest_region=None if unlimited else longest), seconds)
        except SolverTimeout:
            return _Deepened(best, False, longest, level_seconds)
        level_seconds = time.perf_counter() - started
        if recompute_seconds(problem, found) < seconds:
            best, seconds = found, recompute_seconds(problem, found)
        if unlimited:
            return _Deepened(best, exact, None, level_seconds)
        longest *= 2


def _focused(problem: Problem, search: _Search, schedule: Schedule) -> Schedule | None:
    """A faster plan than ``schedule`` (which fits), searched with regions of any length but each stage's options
    cut to those ``schedule`` uses anywhere; None when there is none (or the time runs out).

    With fewer options the Pareto fronts stay within the front limit where the full search cuts them: on Llama-7B
    the full search (regions of up to 8 blocks, 17 s) finds 0.021079 s, and the search over the three options
    that plan uses finds 0.020974 s in 5 s, with an 11-block region."""
    used = sorted({region.option_of(k) for region in schedule.regions for k in region.stages})
    kept = [[o for o in used if o < len(stage.recompute_options)] or [0] for stage in problem.stages]
    narrowed = dataclasses.replace(problem, stages=tuple(
        dataclasses.replace(stage, options=tuple(stage.recompute_options[o] for o in options))
        for stage, options in zip(problem.stages, kept)))
    if _far_reaching(narrowed) > PINNED_LIMIT:
        narrowed = chain_restriction(narrowed)
    seconds = recompute_seconds(problem, schedule)
    try:
        found, _ = _passes(narrowed, dataclasses.replace(search, longest_region=None), seconds * (1 + 1e-9))
    except SolverTimeout:
        return None
    if found is None:
        return None
    widened = Schedule(tuple(Region(r.start, r.stop, tuple(kept[k][r.option_of(k)] for k in r.stages))
                             for r in found.regions))
    if recompute_seconds(problem, widened) < seconds and simulate(problem, widened).peak_bytes <= search.budget:
        return widened
    return None


def _sharing(search: _Search, share: float) -> _Search:
    """``search`` with at most ``share`` of the time it has left."""
    if search.deadline is None:
        return search
    now = time.perf_counter()
    return dataclasses.replace(search, deadline=now + (search.deadline - now) * share)


BOUND_FRONTS = 4  # a bound's search merges points past this many times the plan search's front limit


def _bound_search(search: _Search, buckets: int, share: float, fronts: int = BOUND_FRONTS,
                  limit: int | None = None) -> _Search:
    """The search of a bound: ``buckets`` steps, fronts merged (never cut) past ``limit`` points (default
    ``fronts`` times the search's limit), at most ``share`` of the time left."""
    return _Search(search.budget, buckets, limit or search.limit * fronts, _sharing(search, share).deadline,
                   search.progress, label="bound")


PINNED_LIMIT = 16  # far-reaching tensors the program tracks one by one; beyond, it plans on chain_restriction


def chain_restriction(problem: Problem) -> Problem:
    """A chain on which every schedule peaks at least as high as on ``problem``: a plan that fits it fits
    ``problem`` (the partner of :func:`chain_relaxation`, for problems with many far-reaching tensors).

    A tensor read or saved past the next stage is dropped, and counted instead as alive from its producer to the end
    of the forward (its last reader's forward as when it is held: ``Stage.held_inputs``), and twice (the tensor and
    a recomputed copy) in every backward event from its producer down; nothing holds it before its producer. On a
    chain it returns ``problem`` itself.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(3))
    >>> skip = TensorInfo("skip", 8, 0, frozenset({2}), frozenset({2}))
    >>> tight = chain_restriction(Problem(stages, (skip,)))
    >>> tight.is_chain(), [s.forward_workspace_bytes for s in tight.stages], tight.stages[1].backward_workspace_bytes
    (True, [8, 8, 8], 16)
    """
    if problem.is_chain():
        return problem
    kept, far = _split_far(problem)
    forward = [0] * problem.num_stages
    backward = [0] * problem.num_stages
    for t in far:
        for k in range(t.producer, problem.num_stages):
            forward[k] += t.nbytes
            backward[k] += 2 * t.nbytes
    dropped = {t.name for t in far}  # taken as held: their held-input sets hold without them
    stages = tuple(dataclasses.replace(
        s.plus_forward_bytes(forward[k]), backward_workspace_bytes=s.backward_workspace_bytes + backward[k],
        held_inputs=tuple(dataclasses.replace(h, tensors=h.tensors - dropped) for h in s.held_inputs),
        backward_start_workspace_bytes=s.backward_start_workspace_bytes + backward[k],
        output_grad_bytes=s.output_grad_bytes + backward[k]) for k, s in enumerate(problem.stages))
    return dataclasses.replace(problem, stages=stages, tensors=tuple(kept), name=f"{problem.name} (chain restriction)")


def _far_reaching(problem: Problem) -> int:
    return len(_split_far(problem)[1])


def _within_budget(problem: Problem, search: _Search, ceiling: float | None = None) -> tuple[Schedule, bool]:
    """The program's plan, checked with ``simulate`` (tightening the budget if its model ever under-estimated),
    or the least-peak schedule when rounding hid every plan; raises when no schedule fits at all. Problems with
    more than ``PINNED_LIMIT`` far-reaching tensors are planned on :func:`chain_restriction`. ``ceiling``: the
    recompute seconds of a known plan, the first ceiling of the search (default: the fastest recomputation)."""
    first_ceiling = _first_ceiling(problem) if ceiling is None else ceiling
    if _far_reaching(problem) > PINNED_LIMIT:
        schedule, _ = _passes(chain_restriction(problem), search, first_ceiling)
        if schedule is not None and simulate(problem, schedule).peak_bytes <= search.budget:
            return schedule, False
    target = search.budget
    for attempt in range(3):  # the model over-estimates memory, so one pass suffices; tighten if it ever does not
        schedule, exact = _passes(problem, dataclasses.replace(search, budget=target), first_ceiling)
        if schedule is None:
            break
        peak = simulate(problem, schedule).peak_bytes
        if peak <= search.budget:
            return schedule, exact and attempt == 0
        target -= peak - search.budget
    minimum = minimum_peak_schedule(problem)
    if simulate(problem, minimum).peak_bytes > search.budget:
        raise infeasible_budget_error(problem, search.budget, minimum)
    return minimum, False  # rounding or a non-chain hid every plan the program could see


def _best_baseline(problem: Problem, budget_bytes: int) -> Schedule | None:
    """The fastest baseline schedule within the budget, if any (what a timed-out search falls back to)."""
    candidates = (uniform(problem), chen_sqrt(problem))
    fitting = [s for s in candidates if s is not None and simulate(problem, s).peak_bytes <= budget_bytes]
    return min(fitting, key=lambda s: recompute_seconds(problem, s), default=None)
