"""An exact mixed-integer program over the execution model of :func:`~planner.problem.simulate`.

Decisions (binary):

* ``x[k,o]``: stage ``k`` is recomputed with option ``o``; ``r[k] = sum_o x[k,o] <= 1`` (0 means stored);
* ``s[k]``: stages ``k`` and ``k+1`` share a region (``s[k] <= r[k]``, ``s[k] <= r[k+1]``).

Derived, continuous but exact once the decisions are integral:

* ``w[a,b]`` (``a < b``): ``a .. b`` lie in one region, ``w[a,a+1] = s[a]``, ``w[a,b] = w[a,b-1] * s[b-1]``
  linearised with both upper (``w <= w[a,b-1]``, ``w <= s[b-1]``) and lower (``w >= w[a,b-1] + s[b-1] - 1``)
  bounds; ``w[a,a] = r[a]``. A region ends at ``k`` when ``e[k] = r[k] - s[k]`` is 1.
* ``c[t] = sum of x[p,o]`` over the options of ``t``'s producer ``p`` that cache ``t``'s node.

Memory (continuous, only bounded from below, since they appear only on the left of ``<= budget``):

* ``start[t,k] >=`` each reason ``t`` is alive when the backward of ``k`` starts (a holder ``h <= k``, or the
  recomputation consumed the cached ``t`` before ``k``): a stored saver ``s <= k`` (``1 - r[s]``); a reader ``c`` in
  another region starting at or before ``k`` (``r[c] - w[p,c]`` once ``k >= c``, ``w[k,c] - w[p,c]`` for
  ``p < k < c``); the cache (``c[t]`` once ``k`` reaches the first saver, ``c[t] - w[p,k]`` before it: consumed when
  the region ended before ``k``). ``start[t,k] >= start[t,k-1]``.
* ``after[t,k]``, alive once the backward of ``k`` is done, is ``start[t,k-1]``, or for cached tensors
  ``>= start[t,k-1]`` and ``>= c[t] - w[p, min(first saver, k)]``; the recomputation at ``k`` sees ``after[t,k+1]``
  (alive at the start, or consumed right then).
* ``held[t] >=`` each of ``1 - r[s]``, ``r[c] - w[p,c]``, ``c[t]``: something holds or consumes ``t``, which keeps
  it alive to the end of the forward.
* ``copies[p,k] >= sum_t nbytes(t) * (w[p,k] - c[t])`` over tensors of ``p`` whose first saver is ``<= k`` (alive
  when ``k`` starts), or ``<= k-1`` (still needed after ``k``): the recomputed copies.
* the re-run of a region, stage by stage (``problem._recompute_peak``): ``caches[j] >=`` each caching option of
  ``j`` and ``caches[j-1] + s[j-1] - 1`` (some stage of ``j``'s region up to ``j`` caches);
  ``kept_before[j] >= kept_before[j-1] + kept(j-1) - freed(j-1) - M (1 - s[j-1])`` (what the region's stages
  before ``j`` keep, less what the re-runs up to ``j-1`` read last and free: ``freed(j-1)`` sums each such group's
  ``freed[g] <= w[p,j-1]``, ``<= 1 - c[g]``, at most 1); ``inside_from[j] >= inside(j) + inside_from[j+1]
  - M (1 - s[j])`` (caches that the re-runs of ``j`` and the later stages of its region consume themselves, and
  those of earlier stages that nothing saves and no stage of the region after them reads: ``dies[g,j]``,
  :meth:`Encoding._cached_dying`);
  ``through[j] >= kept_before[j] + kept(j) + workspace(j) + inside_from[j] - saving(j)`` (the moment ``j``
  re-runs, when the re-run goes on past it; ``saving(j)`` sums, over ``j``'s options ``o`` and its
  ``Stage.input_savings`` from the latest ``since``, what each adds to the ones before times
  ``input_saving[j,o,i] <= w[since,j]``, ``<= x[j,o]``: ``problem.input_saving``; here, with a later stage of
  the region after ``j``, ``InputSaving.through_bytes``). ``rerun[k] >= through[j] +
  output_grad_bytes(k) - M (2 - w[j,k] - e[k])`` for every ``j < k``, and ``>=`` the moment of ``k`` itself
  ``- M (1 - e[k])``: as ``through[k]``, but when its region caches nothing it stops after ``k``'s last saving op
  (``Stage.stopped_rerun``; ``runs_on[k] >= gap(k) (caches[k] + x[k,o] - 1)`` adds the rest when the region
  caches after all).
  ``kept(j)``, ``inside(j)``, ``workspace(j)``, ``gap(j)`` are sums over ``j``'s options of constants times
  ``x[j,o]``; each ``M`` is the most its bound can reach.

Events (each ``<= budget``, or ``<= peak`` when minimising the peak), as ``simulate`` lists them: the forward of
every stage (with ``held_inputs[k]``: :meth:`Encoding._held_inputs`); per stage from the last, the recomputation
(fixed + later gradients + ``after[.,k+1]`` (``start[.,k]`` for a cached tensor that only its own stage reads:
``rerun[k]`` counts it while it lives) + ``rerun[k]``; where ``k`` ends no region this is at most the backward
start), the backward start (fixed + later gradients + ``start`` + copies) and the backward once done (fixed +
gradients so far + backward workspace + ``after`` + copies still needed; one per ``Stage.backward_epochs``, less
the epoch's distance below the workspace and the tensors alive in it whose ``after[g,k]`` is 1). Objective: the
recompute seconds of the chosen options, ``Problem.region_seconds`` per region (``sum_k e[k]``), less what a region
that caches nothing skips by stopping early in its last stage ``k`` (``Stage.stopped_seconds``: ``stops[k] <=
e[k]``, ``stops[k] <= 1 - caches[k]``, rewarded), and ``Problem.caching_region_seconds`` per region that caches
(``caching_end[k] >= e[k] + caches[k] - 1``). Tensors with identical rules are summed into one group, and tensors
whose liveness no decision changes (model outputs, tensors nothing can hold) are constants.

:func:`encoded_peak` evaluates this encoding on a given schedule without a solver; the tests check it equals
``simulate`` on random schedules, and :func:`solve_ilp` checks it on every solution.

>>> from planner.problem import Problem, Stage, TensorInfo
>>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(4))
>>> inner = tuple(TensorInfo(f"a{i}", 100, i, frozenset({i}), frozenset({i})) for i in range(4))
>>> edges = tuple(TensorInfo(f"x{i}", 10, i, frozenset({i + 1}), frozenset({i + 1})) for i in range(3))
>>> problem = Problem(stages, inner + edges)
>>> plan = solve_ilp(problem, 250)
>>> plan.status.value, plan.predicted_recompute_seconds, plan.predicted_peak_bytes <= 250
('optimal', 2.0, True)
>>> min_peak_ilp(problem).predicted_peak_bytes
130
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

import pulp

from ..errors import PlannerError
from ..plan import Plan, SolverStatus, relative_gap
from ..problem import (Phase, Problem, Region, Schedule, TensorInfo, backward_releasers, dies_after_readers, keeps,
                       last_rerun_reader, liveness, recompute_seconds, simulate)
from .baselines import chen_sqrt, fewest_blocks, infeasible_budget_error, store_all, uniform

Expr = pulp.LpAffineExpression


def new_variable(model: pulp.LpProblem, name: str, low: float | None = None, up: float | None = None,
                 cat: str = "Continuous") -> pulp.LpVariable:
    """A variable of ``model``: made by the model where PuLP can (3.3 on; 4.0 drops ``LpVariable(name, ...)``,
    which 3.3 deprecates with a warning on every variable), directly before.

    >>> model = pulp.LpProblem("example", pulp.LpMinimize)
    >>> new_variable(model, "x", 0, 1, cat="Binary").cat
    'Integer'
    """
    if hasattr(model, "add_variable"):
        return model.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, lowBound=low, upBound=up, cat=cat)


# --- tensors, grouped by the rules that decide their liveness ---------------------------------------------------

@dataclass(frozen=True)
class TensorGroup:
    """Tensors of one producer that the execution model treats alike, with their bytes summed."""

    producer: int
    consumers: frozenset[int]
    savers: frozenset[int]
    caching_options: frozenset[int]  # options of the producer that cache these tensors' node
    is_output: bool
    returned: bool  # a model output the caller may let go (see TensorInfo)
    unheld_forward_until: int  # last forward stage they are alive at when nothing holds them
    nbytes: int

    @property
    def first_saver(self) -> int | None:
        return min(self.savers) if self.savers else None


def unheld_forward_until(problem: Problem, tensor: TensorInfo) -> int:
    """The last forward stage ``tensor`` is alive at when nothing holds it, as :func:`liveness` decides."""
    alone = dataclasses.replace(tensor, savers=frozenset(), is_output=False)
    return liveness(problem, Schedule(), alone).forward_until


def _group_key(problem: Problem, t: TensorInfo) -> tuple:
    options = problem.stages[t.producer].recompute_options
    caching = frozenset(o for o, option in enumerate(options) if t.node in option.cached_nodes)
    return t.producer, t.consumers, t.savers, caching, t.is_output, t.returned, unheld_forward_until(problem, t)


def _grouping(problem: Problem) -> tuple[tuple[TensorGroup, ...], dict[str, int]]:
    """The tensor groups in producer order, and each tensor's group (by name: index)."""
    key_of = {t.name: _group_key(problem, t) for t in problem.tensors}
    sizes: dict[tuple, int] = defaultdict(int)
    for t in problem.tensors:
        sizes[key_of[t.name]] += t.nbytes
    ordered = sorted(sizes.items(), key=lambda kv: kv[0][0])
    index = {key: i for i, (key, _) in enumerate(ordered)}
    return tuple(TensorGroup(*key, nbytes) for key, nbytes in ordered), {n: index[k] for n, k in key_of.items()}


def group_tensors(problem: Problem) -> tuple[TensorGroup, ...]:
    """Sum tensors that share producer, readers, savers, caching options and output flags."""
    return _grouping(problem)[0]


@dataclass(frozen=True)
class _StageRerun:
    """Per option of a stage, what its re-run keeps, consumes of its own caches, saves itself, and its workspace."""

    kept: list[int]
    inside: list[int]
    stopped: list[int]  # what it adds at its highest when its region caches nothing and stops after it
    workspace: list[int]
    caching: list[bool]

    @property
    def through(self) -> list[int]:
        """What the stage adds at its highest when its re-run goes on past it (or, caching, to its end); ``gap``
        more than ``stopped`` (the region caches after all)."""
        return [k + w for k, w in zip(self.kept, self.workspace)]

    @property
    def gap(self) -> list[int]:
        return [t - s for t, s in zip(self.through, self.stopped)]


# --- the encoding --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """One memory event: its bytes as a linear expression of the encoding's variables."""

    phase: Phase
    stage: int
    bytes: Expr


@dataclass(frozen=True)
class _GroupLiveness:
    """A group's liveness variables: alive when a backward starts, and once it is done."""

    group: TensorGroup
    start: dict[int, pulp.LpVariable]  # from min(start) on; constant past max(start)
    after: dict[int, pulp.LpVariable]  # where consumption by a recomputation makes "after k" differ from "start k-1"
    held_at_all: pulp.LpVariable | None

    def start_at(self, k: int) -> pulp.LpVariable | None:
        if not self.start or k < min(self.start):
            return None
        return self.start[min(k, max(self.start))]

    def after_at(self, k: int) -> pulp.LpVariable | None:
        """Alive once stage ``k``'s backward is done (``k = n``: at the recomputation before the last stage)."""
        return self.after[k] if k in self.after else self.start_at(k - 1)


class _EventTerms:
    """Per stage, the terms each kind of event sums (tensors only; copies, gradients and workspaces come later)."""

    def __init__(self, n: int, problem: Problem, group_of: dict[str, int]):
        self.forward: list[list] = [[problem.fixed_bytes + s.forward_workspace_bytes] for s in problem.stages]
        self.start: list[list] = [[] for _ in range(n)]
        self.after: list[list] = [[] for _ in range(n)]
        self.recompute: list[list] = [[] for _ in range(n)]  # alive at the start, or consumed by this recomputation
        self.held: dict[int, pulp.LpVariable] = {}  # held[g] by group index, where something can hold it
        # alive once stage k's backward is done, by (group index, k), for the tensors of Stage.backward_epochs
        self.kept_after: dict[tuple[int, int], pulp.LpVariable | int] = {}
        self.releasing = {(group_of[name], k) for name, k in backward_releasers(problem).items() if name in group_of}


class Encoding:
    """Variables and constraints of the execution model of one problem, without budget or objective."""

    def __init__(self, problem: Problem):
        self.problem = problem
        n = problem.num_stages
        self.model = pulp.LpProblem("checkpoint_plan", pulp.LpMinimize)
        self.lower_bounds: dict[str, list[Expr]] = {}  # name of each bounded-below variable -> its bounds
        self.upper_bounds: dict[str, list[Expr]] = {}  # name of each variable in [0, 1] bounded above -> its bounds
        self._derived: list[str] = []  # the names of both kinds, in the order they were made (bounds use earlier ones)
        self.choose = [[new_variable(self.model, f"x_{k}_{o}", cat="Binary")
                        for o in range(len(stage.recompute_options))] for k, stage in enumerate(problem.stages)]
        self.share = [new_variable(self.model, f"s_{k}", cat="Binary") for k in range(n - 1)]
        self._same: dict[tuple[int, int], pulp.LpVariable] = {}
        for k in range(n):
            self.model += pulp.lpSum(self.choose[k]) <= 1, f"one_option_{k}"
        for k in range(n - 1):
            self.model += self.share[k] <= self.recomputed(k), f"share_left_{k}"
            self.model += self.share[k] <= self.recomputed(k + 1), f"share_right_{k}"
        self.groups, self.group_of = _grouping(problem)  # group_of: tensor name -> group index
        self.nbytes = {t.name: t.nbytes for t in problem.tensors}
        self.caches: list = []  # caches[k]: whether k's region caches, up to k (set with the re-run peaks)
        self._stops: dict[int, pulp.LpVariable] = {}
        self.events = self._events()

    # decisions and what follows from them
    def recomputed(self, k: int) -> Expr:
        return pulp.lpSum(self.choose[k])

    def region_end(self, k: int) -> Expr:
        if k == self.problem.num_stages - 1:
            return self.recomputed(k)
        return self.recomputed(k) - self.share[k]

    def same_region(self, a: int, b: int) -> Expr | pulp.LpVariable | int:
        """1 when stages ``a <= b`` are all recomputed in one region (0 past the last stage)."""
        if b >= self.problem.num_stages:
            return 0
        if a == b:
            return self.recomputed(a)
        if b == a + 1:
            return self.share[a]
        if (a, b) not in self._same:
            shorter, link = self.same_region(a, b - 1), self.share[b - 1]
            w = self.at_least(f"w_{a}_{b}", [shorter + link - 1])
            self.model += w <= shorter, f"w_le_left_{a}_{b}"
            self.model += w <= link, f"w_le_link_{a}_{b}"
            self.model += w <= self.same_region(a + 1, b), f"w_le_right_{a}_{b}"  # redundant when integral
            self._same[a, b] = w
        return self._same[a, b]

    def cached(self, group: TensorGroup) -> Expr:
        return pulp.lpSum(self.choose[group.producer][o] for o in group.caching_options)

    def at_least(self, name: str, bounds: Iterable[Expr]) -> pulp.LpVariable:
        """A continuous variable >= 0 and >= every bound; the memory constraints push it down to their maximum."""
        var = new_variable(self.model, name, 0)
        kept = [pulp.LpAffineExpression(b) for b in bounds]
        for i, bound in enumerate(kept):
            self.model += var >= bound, f"{name}_lb{i}"
        self.lower_bounds[name] = kept
        self._derived.append(name)
        return var

    def at_most(self, name: str, bounds: Iterable[Expr]) -> pulp.LpVariable:
        """A continuous variable in [0, 1] and <= every bound; an objective or a memory constraint that gains from
        it pushes it up to their minimum."""
        var = new_variable(self.model, name, 0, 1)
        kept = [pulp.LpAffineExpression(b) for b in bounds]
        for i, bound in enumerate(kept):
            self.model += var <= bound, f"{name}_ub{i}"
        self.upper_bounds[name] = kept
        self._derived.append(name)
        return var

    # liveness of one group
    def _consumed_by(self, g: TensorGroup, k: int) -> Expr:
        """Lower bound of "cached, no saver in the region, and the region's recomputation ran before ``k``"."""
        first = g.first_saver if g.first_saver is not None else self.problem.num_stages
        return self.cached(g) - self.same_region(g.producer, min(first, k))

    def _held_conditions(self, g: TensorGroup) -> dict[int, list[Expr]]:
        """For each backward stage ``k``, the new reasons ``g`` is alive when ``k``'s backward starts."""
        n, p = self.problem.num_stages, g.producer
        conditions: dict[int, list[Expr]] = defaultdict(list)
        for s in g.savers:
            conditions[s].append(1 - self.recomputed(s))
        for c in g.consumers - {p}:
            conditions[c].append(self.recomputed(c) - self.same_region(p, c))
            for k in range(p + 1, c):
                conditions[k].append(self.same_region(k, c) - self.same_region(p, c))
        if g.caching_options:  # held from the first saver in the region, else until the recomputation consumes it
            first = g.first_saver if g.first_saver is not None else n
            for k in range(p + 1, min(first, n - 1) + 1):
                conditions[k].append(self._consumed_by(g, k))
            if first < n:
                conditions[first].append(self.cached(g))
        return conditions

    def _liveness(self, index: int, g: TensorGroup) -> "_GroupLiveness":
        conditions = self._held_conditions(g)
        start: dict[int, pulp.LpVariable] = {}
        if conditions:
            for k in range(min(conditions), max(conditions) + 1):
                earlier = [start[k - 1]] if k - 1 in start else []
                start[k] = self.at_least(f"start_{index}_{k}", earlier + conditions.get(k, []))
        after: dict[int, pulp.LpVariable] = {}
        if g.caching_options:  # consumed by a recomputation at k - 1: gone when k starts, but not yet after k-1
            n, p = self.problem.num_stages, g.producer
            last = min(g.first_saver if g.first_saver is not None else n, n)
            for k in range(p + 1, last + 1):
                before = [start[min(k - 1, max(start))]] if start and k - 1 >= min(start) else []
                after[k] = self.at_least(f"after_{index}_{k}", before + [self._consumed_by(g, k)])
        return _GroupLiveness(g, start, after, self._held_at_all(index, g))

    def _held_at_all(self, index: int, g: TensorGroup) -> pulp.LpVariable | None:
        """1 when anything holds ``g`` or a recomputation consumes it: then it lives to the end of the forward."""
        p = g.producer
        ways = [1 - self.recomputed(s) for s in g.savers]
        ways += [self.recomputed(c) - self.same_region(p, c) for c in g.consumers - {p}]
        ways += [self.cached(g)] if g.caching_options else []
        return self.at_least(f"held_{index}", ways) if ways else None

    # copies
    def _copies(self, p: int, k: int, saved_before: int) -> pulp.LpVariable | None:
        """Bytes of ``p``'s tensors whose first saver is ``<= saved_before``, recomputed again, if ``p .. k`` share a
        region."""
        groups = [g for g in self.groups if g.producer == p and g.savers and g.first_saver <= saved_before]
        if not groups:
            return None
        terms = [g.nbytes * (self.same_region(p, k) - self.cached(g)) for g in groups]
        return self.at_least(f"copies_{p}_{k}_{saved_before}", [pulp.lpSum(terms)])

    def _copy_terms(self) -> tuple[list[list], list[list]]:
        """Copies alive when each stage's backward starts, and those still needed after it (saved earlier)."""
        n = self.problem.num_stages
        at_start: list[list] = [[] for _ in range(n)]
        after: list[list] = [[] for _ in range(n)]
        for p in range(n):
            for k in range(p, n):
                var = self._copies(p, k, k)
                if var is not None:
                    at_start[k].append(var)
                if k > p:
                    newly = any(g.producer == p and g.first_saver == k for g in self.groups)
                    var = self._copies(p, k, k - 1) if newly else var
                    if var is not None:
                        after[k].append(var)
        return at_start, after

    def _rerun_bytes(self, k: int) -> _StageRerun:
        """Stage ``k``'s re-run per option, from its groups (``problem._rerun_bytes``)."""
        stage = self.problem.stages[k]
        options = range(len(stage.recompute_options))
        kept, inside, saved_self = [0] * len(options), [0] * len(options), [0] * len(options)
        for g in self.groups:
            if g.producer != k:
                continue
            kept_past = keeps(g)
            for o in options:
                if o in g.caching_options:
                    inside[o] += 0 if kept_past else g.nbytes
                else:
                    kept[o] += g.nbytes if kept_past else 0
                    saved_self[o] += g.nbytes if k in g.savers else 0
        return _StageRerun(kept, inside, [stage.stopped_rerun(o, kept[o], saved_self[o]) for o in options],
                           [stage.recompute_workspace_of(o) for o in options],
                           [bool(option.cached_nodes) for option in stage.recompute_options])

    def _over_options(self, k: int, values: list[int]) -> Expr | int:
        """``sum_o values[o] * x[k,o]``: the value of the option stage ``k`` runs with (0 when stored)."""
        return pulp.lpSum(v * x for v, x in zip(values, self.choose[k]) if v) if any(values) else 0

    def _at_least_or_zero(self, name: str, bounds: list) -> pulp.LpVariable | int:
        bounds = [b for b in bounds if not isinstance(b, (int, float)) or b > 0]
        return self.at_least(name, bounds) if bounds else 0

    def _caches_so_far(self, reruns: list[_StageRerun]) -> list:
        """``caches[j]``: 1 when some stage of ``j``'s region, up to ``j``, caches."""
        caches: list = []
        for j, rerun in enumerate(reruns):
            bounds = [self._over_options(j, [int(c) for c in rerun.caching])]
            if j and not isinstance(caches[j - 1], int):
                bounds.append(caches[j - 1] + self.share[j - 1] - 1)
            caches.append(self._at_least_or_zero(f"caches_{j}", bounds))
        return caches

    def _freed_after(self) -> list[Expr | int]:
        """Per stage ``j``, bytes that the stages of ``j``'s region before ``j`` keep and ``j``'s re-run reads
        last, so that they die (:func:`~planner.problem.last_rerun_reader`): each group's ``freed[g] <= w[p,j]``
        and ``<= 1 - c[g]`` (recomputed in ``j``'s region, not cached), which a smaller ``kept_before`` pushes up to
        that."""
        terms: list[list] = [[] for _ in range(self.problem.num_stages)]
        for index, g in enumerate(self.groups):
            if (j := last_rerun_reader(g)) is not None:
                bounds = [self.same_region(g.producer, j)] + ([1 - self.cached(g)] if g.caching_options else [])
                terms[j].append(g.nbytes * self.at_most(f"freed_{index}", bounds))
        return [pulp.lpSum(t) if t else 0 for t in terms]

    def _kept_before(self, reruns: list[_StageRerun]) -> tuple[list, list[int]]:
        """``kept_before[j]``: what the stages of ``j``'s region before ``j`` keep and its re-run still holds; and
        the most it can be."""
        most = [sum(max(r.kept) for r in reruns[:j]) for j in range(len(reruns))]
        freed = self._freed_after()
        kept_before: list = [0]
        for j in range(1, len(reruns)):
            link = kept_before[j - 1] + self._over_options(j - 1, reruns[j - 1].kept) - freed[j - 1]
            bounds = [link - most[j] * (1 - self.share[j - 1])] if most[j] else []
            kept_before.append(self._at_least_or_zero(f"kept_before_{j}", bounds))
        return kept_before, most

    def _cached_dying(self) -> tuple[list[list], list[int]]:
        """Per stage ``j``, the caches of its region's earlier stages (or its own) that nothing saves and that are
        gone once ``j`` has re-run (:func:`~planner.problem.cached_dies_with`): at the last reader ``m`` of group
        ``g``, ``dies[g,m] >= c[g] + w[p,m] - 1``, or, where the region ends first, at its end ``e``:
        ``dies[g,e] >= c[g] + w[p,e] + end[e] - 2``; and the most each stage's can be."""
        n = self.problem.num_stages
        terms: list[list] = [[] for _ in range(n)]
        most = [0] * n
        for index, g in enumerate(self.groups):
            last = max(g.consumers | {g.producer})
            if not g.caching_options or last == g.producer or not dies_after_readers(g):
                continue  # read by no later stage: its own stage's re-run consumes it (inside(j))
            p, cached = g.producer, self.cached(g)
            for e in range(p, last + 1):
                bound = cached + self.same_region(p, e) - 1 - (0 if e == last else 1 - self.region_end(e))
                terms[e].append(g.nbytes * self.at_least(f"dies_{index}_{e}", [bound]))
                most[e] += g.nbytes
        return terms, most

    def _inside_from(self, reruns: list[_StageRerun]) -> tuple[list, list[int]]:
        """``inside_from[j]``: the caches that the re-runs of ``j`` and the later stages of its region consume
        themselves, or after which nothing in the region reads them (:meth:`_cached_dying`); and the most it can
        be."""
        n = len(reruns)
        dying, most_dying = self._cached_dying()
        most = [sum(max(r.inside) + d for r, d in zip(reruns[j:], most_dying[j:])) for j in range(n + 1)]
        inside_from: list = [0] * (n + 1)
        for j in reversed(range(n)):
            own = self._over_options(j, reruns[j].inside) + pulp.lpSum(dying[j])
            bounds = [own]
            if j + 1 < n and most[j + 1]:
                bounds.append(own + inside_from[j + 1] - most[j] * (1 - self.share[j]))
            inside_from[j] = self._at_least_or_zero(f"inside_from_{j}", bounds)
        return inside_from, most

    def _rerun_peaks(self) -> list[pulp.LpVariable]:
        """``rerun[k]``: what the re-run of a region ending at ``k`` adds at its highest, stage by stage."""
        n = self.problem.num_stages
        reruns = [self._rerun_bytes(k) for k in range(n)]
        caches = self._caches_so_far(reruns)
        self.caches = caches
        kept_before, most_before = self._kept_before(reruns)
        inside_from, most_inside = self._inside_from(reruns)
        saving = [self._input_saving(k) for k in range(n)]
        saving_through = [self._input_saving(k, through=True) for k in range(n)]
        through = [self._at_least_or_zero(f"through_{j}", [kept_before[j] + self._over_options(j, r.through)
                                                          + inside_from[j] - saving_through[j]])
                   for j, r in enumerate(reruns)]
        most_through = [b + max(0, max(r.through)) + i for b, r, i in zip(most_before, reruns, most_inside)]
        peaks = []
        for k, last in enumerate(reruns):
            runs_on = self._at_least_or_zero(f"runs_on_{k}", [] if isinstance(caches[k], int) or not any(last.gap)
                                              else [pulp.lpSum(g * (caches[k] + x - 1)
                                                               for g, x in zip(last.gap, self.choose[k]) if g)])
            output_grads = self.problem.stages[k].output_grad_bytes
            ends = kept_before[k] + self._over_options(k, last.stopped) + runs_on + inside_from[k] - saving[k]
            most = most_before[k] + max(0, max(last.stopped) + max(last.gap)) + most_inside[k] + output_grads
            bounds = [ends + output_grads - most * (1 - self.region_end(k))]
            for j in range(k):  # the moments of the region's earlier stages, when j .. k is a region
                together = self.same_region(j, k) + self.region_end(k) - 1
                bounds.append(through[j] + output_grads - (most_through[j] + output_grads) * (1 - together))
            peaks.append(self.at_least(f"rerun_{k}", bounds))
        return peaks

    def _input_saving(self, k: int, through: bool = False) -> Expr | int:
        """What stage ``k``'s re-run holds less because its region made inputs it frees (``Stage.input_savings``,
        :func:`~planner.problem.input_saving`: the most of those its region starts early enough for): per option
        and saving, from the latest ``since``, what it adds to the ones before, times a variable ``<= w[since,k]``
        and ``<= x[k,o]``, which a smaller re-run moment pushes up to that. ``through``: as a stage that a later
        one of its region follows (``InputSaving.through_bytes``), in the moments of the stages before the last."""
        savings = sorted(self.problem.stages[k].input_savings, key=lambda saving: -saving.since)
        terms, kind = [], "through_" if through else ""
        for o, chosen in enumerate(self.choose[k]):
            most = 0
            for index, saving in enumerate(savings):
                if saving.of(o, through) > most:
                    bounds = [self.same_region(saving.since, k), chosen]
                    variable = self.at_most(f"input_saving_{kind}{k}_{o}_{index}", bounds)
                    terms.append((saving.of(o, through) - most) * variable)
                    most = saving.of(o, through)
        return pulp.lpSum(terms) if terms else 0

    def stops_early(self, k: int) -> pulp.LpVariable | Expr:
        """At most 1 when a region that caches nothing ends at ``k`` (its re-run stops early there), else at most
        0: an objective that rewards it pushes it up to that."""
        if k not in self._stops:
            plain = [] if isinstance(self.caches[k], int) else [1 - self.caches[k]]
            self._stops[k] = self.at_most(f"stops_{k}", [self.region_end(k)] + plain)
        return self._stops[k]

    def caching_end(self, k: int) -> pulp.LpVariable | int:
        """At least 1 when a region that caches ends at ``k`` (0 when no option up to ``k`` can cache): an
        objective that charges it pushes it down to that."""
        if isinstance(self.caches[k], int):
            return self.caches[k]
        return self.at_least(f"caching_end_{k}", [self.region_end(k) + self.caches[k] - 1])

    # events
    def _events(self) -> tuple[Event, ...]:
        problem, n = self.problem, self.problem.num_stages
        terms = _EventTerms(n, problem, self.group_of)
        for index, g in enumerate(self.groups):
            self._add_group(index, g, terms)
        copies_start, copies_after = self._copy_terms()
        reruns = self._rerun_peaks()
        for k, stage in enumerate(problem.stages):  # a stage's first forward inside a region, with its option
            for o in range(len(stage.recompute_options)):
                extra = stage.forward_extra_of(o)
                if extra:
                    terms.forward[k].append(extra * self.choose[k][o])
            if (held_inputs := self._held_inputs(k, terms.held)) is not None:
                terms.forward[k].append(held_inputs)
        events = [Event(Phase.FORWARD, k, pulp.lpSum(terms.forward[k])) for k in range(n)]
        fixed, later_grads = problem.fixed_bytes, 0
        for k in reversed(range(n)):
            stage = problem.stages[k]
            start = pulp.lpSum(terms.start[k] + copies_start[k])
            events.append(Event(Phase.RECOMPUTE, k, fixed + later_grads + pulp.lpSum(terms.recompute[k]) + reruns[k]))
            events.append(Event(Phase.BACKWARD_START, k, fixed + later_grads + start
                                + stage.backward_start_workspace_bytes))
            later_grads += stage.grad_bytes
            after = fixed + later_grads + stage.backward_workspace_bytes + pulp.lpSum(terms.after[k] + copies_after[k])
            events += [Event(Phase.BACKWARD, k, after - relief) for relief in self._backward_reliefs(k, terms)]
        return tuple(events)

    def _backward_reliefs(self, k: int, terms: "_EventTerms") -> list:
        """What stage ``k``'s backward event needs less in each of its epochs
        (:meth:`~planner.problem.Stage.backward_workspace_with`): the epoch's distance below the workspace, and the
        bytes of the tensors alive in it that the step keeps alive past the stage anyway; one event per epoch."""
        epochs = self.problem.stages[k].backward_epochs
        if not epochs:
            return [0]
        kept = terms.kept_after
        return [epoch.below_bytes + pulp.lpSum(self.nbytes[name] * kept[self.group_of[name], k]
                                               for name in epoch.alive if (self.group_of.get(name), k) in kept)
                for epoch in epochs]

    def _held_inputs(self, k: int, held: dict[int, pulp.LpVariable]) -> pulp.LpVariable | None:
        """What stage ``k``'s forward needs more while tensors it reads last and nothing saves are held
        (:meth:`~planner.problem.Stage.held_input_forward`, less what its option's forward workspace in a region
        adds anyway): at least, for each ``HeldInputs`` set and each way to run ``k`` (stored, or an option), that
        times ``sum(held[g]) - (m - 1) + x - 1`` over the ``m`` groups of the set's tensors, ``x`` the way's
        indicator; None when no set can add anything."""
        stage, bounds = self.problem.stages[k], []
        ways = [(0, 1 - self.recomputed(k))] + [(stage.forward_extra_of(o), x) for o, x in enumerate(self.choose[k])]
        for entry in stage.held_inputs:
            extra = stage.held_input_forward(entry.tensors)
            groups = {self.group_of[name] for name in entry.tensors}
            if not all(g in held for g in groups):  # one of them is never held
                continue
            for covered, chosen in ways:
                if extra > covered:
                    bounds.append((extra - covered) * (pulp.lpSum(held[g] for g in groups) - len(groups) + chosen))
        return self.at_least(f"held_inputs_{k}", bounds) if bounds else None

    def _add_group(self, index: int, g: TensorGroup, terms: "_EventTerms") -> None:
        n, p, size = self.problem.num_stages, g.producer, g.nbytes
        for k in range(p, g.unheld_forward_until + 1):
            terms.forward[k].append(size)
        beyond = range(max(p, g.unheld_forward_until + 1), n)
        if g.is_output:  # the caller holds it throughout
            for k in beyond:
                terms.forward[k].append(size)
            for k in range(n):
                terms.start[k].append(size)
                terms.after[k].append(size)
                terms.recompute[k].append(size)
                if (index, k) in terms.releasing:
                    terms.kept_after[index, k] = 1
            return
        live = self._liveness(index, g)
        if live.held_at_all is None:
            return
        for k in beyond:
            terms.forward[k].append(size * live.held_at_all)
        terms.held[index] = live.held_at_all
        consumed_inside = g.caching_options and dies_after_readers(g)  # see rerun[k]
        for k in range(n):
            for bucket, var in ((terms.start, live.start_at(k)), (terms.after, live.after_at(k)),
                                (terms.recompute, live.start_at(k) if consumed_inside else live.after_at(k + 1))):
                if var is not None:
                    bucket[k].append(size * var)
            if (index, k) in terms.releasing and (var := live.after_at(k)) is not None:
                terms.kept_after[index, k] = var

    # evaluating the encoding on a schedule, without a solver
    def decision_values(self, schedule: Schedule) -> dict[str, float]:
        n = self.problem.num_stages
        owner = schedule.region_index(n)
        values = {v.name: 0.0 for row in self.choose for v in row}
        values.update({v.name: 0.0 for v in self.share})
        for r in schedule.regions:
            for k in r.stages:
                values[self.choose[k][r.option_of(k)].name] = 1.0
        for k in range(n - 1):
            if owner[k] is not None and owner[k] == owner[k + 1]:
                values[self.share[k].name] = 1.0
        return values

    def tight_values(self, schedule: Schedule) -> dict[str, float]:
        """Every variable's value for ``schedule``: decisions from it, the rest at the maximum of their bounds."""
        values = self.decision_values(schedule)
        for name in self._derived:  # in the order they were made: bounds only use earlier variables
            if name in self.lower_bounds:
                values[name] = max([0.0] + [_evaluate(b, values) for b in self.lower_bounds[name]])
            else:
                values[name] = max(0.0, min([1.0] + [_evaluate(b, values) for b in self.upper_bounds[name]]))
        return values

    def event_values(self, values: dict[str, float]) -> list[float]:
        return [_evaluate(e.bytes, values) for e in self.events]


def _evaluate(expr: Expr, values: dict[str, float]) -> float:
    return sum(coefficient * values[var.name] for var, coefficient in expr.items()) + expr.constant


def encoded_peak(problem: Problem, schedule: Schedule) -> int:
    """The peak the encoding assigns to ``schedule``; equals ``simulate(problem, schedule).peak_bytes``.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> problem = Problem((Stage("a", 1.0, 2.0), Stage("b", 1.0, 2.0)),
    ...                   (TensorInfo("x", 10, 0, frozenset({1}), frozenset({0, 1})),))
    >>> schedule = Schedule.uniform(2)
    >>> encoded_peak(problem, schedule) == simulate(problem, schedule).peak_bytes == 10
    True
    """
    encoding = Encoding(problem)
    return round(max(encoding.event_values(encoding.tight_values(schedule)), default=0))


# --- solving ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Outcome:
    schedule: Schedule | None  # None when infeasible or no solution found in time
    proven: bool  # optimal (within the requested gap) or infeasible, proven by the solver
    gap: float | None  # relative gap from the best bound, where known
    infeasible: bool


def _memory_unit(problem: Problem) -> int:
    """A power of two that scales bytes to at most about a million, so solver tolerances stay below a byte."""
    eager = simulate(problem, store_all(problem)).peak_bytes
    return 2 ** max(0, math.ceil(math.log2(max(eager, 1) / 1e6)))


@functools.cache
def _has_highs() -> bool:
    """Whether PuLP can run HiGHS (``highspy`` imported when PuLP was)."""
    return bool(pulp.HiGHS(msg=False).available())


@functools.cache
def _highs_banner_shown() -> None:
    """Make HiGHS's first model with standard output muted: each process's first ``highspy.Highs()`` prints two
    lines of banner to it, before any option could silence them."""
    import highspy

    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _run(model: pulp.LpProblem, time_limit: float, gap: float,
         cutoff: float | None) -> tuple[int, int, float | None]:
    """Solve ``model``; return PuLP's status, solution status and the best bound when the solver reports one.
    ``cutoff``: search only for solutions whose objective is below it (a known schedule's), so that a search
    that finds none is "infeasible" when it proves there is none, "not solved" when its time ran out.

    HiGHS (a dependency) solves it; CBC, PuLP's own, where ``highspy`` does not import. HiGHS proved a U-Net's
    least peak (28 stages, skips across) in 7 s, where CBC took 40-59 s or stopped at its 60 s limit 3% above it,
    by the run; planned at half its eager peak (``solve``, the DP then the ILP), optimal in 16 s, where CBC's plan
    at the 60 s limit recomputed 4% more, 26% from its bound. On that problem and three random DAGs of 20-40
    stages, least peak and two budgets each, the ILP alone took 81 s in all against CBC's 253 s (1.4-8x faster
    each, the same optima; 2-core AMD EPYC, 2026-12-07).

    Each solver takes the known schedule as this cutoff (HiGHS: ``objective_bound``), not as a MIP start: given
    some starts, CBC's "reduced search" ran 64 s past a 30 s limit (GPT-2 at GPU size, uniform checkpointing's
    budget), and the cutoff prunes as well.
    """
    threads = min(os.cpu_count() or 1, 8)
    if _has_highs():
        _highs_banner_shown()
        bound = {} if cutoff is None else {"objective_bound": cutoff}
        solver = pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=gap, threads=threads, **bound)
        model.solve(solver)
        info = model.solverModel.getInfo() if hasattr(model, "solverModel") else None
        return model.status, model.sol_status, getattr(info, "mip_dual_bound", None)
    handle, log_path = tempfile.mkstemp(suffix=".log", prefix="planner_cbc_")
    os.close(handle)
    try:
        with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC, our fallback where HiGHS is not
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap, logPath=log_path,
                                       threads=threads, options=[] if cutoff is None else [f"cutoff {cutoff!r}"])
        try:
            model.solve(solver)
        except pulp.PulpSolverError:  # CBC crashed (2.10 did, on a 50-stage Llama problem): the caller keeps its start
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound, None
        with open(log_path) as log:
            bound = _cbc_bound(log.read())
    finally:
        os.unlink(log_path)
    return model.status, model.sol_status, bound


def _cbc_bound(log: str) -> float | None:
    match = re.search(r"^Lower bound:\s*(\S+)", log, re.MULTILINE)
    try:
        return float(match.group(1)) if match else None
    except ValueError:
        return None


def _schedule_from_solution(encoding: Encoding) -> Schedule:
    n = encoding.problem.num_stages
    pick = [next((o for o, v in enumerate(row) if (v.value() or 0) > 0.5), None) for row in encoding.choose]
    joined = [(encoding.share[k].value() or 0) > 0.5 for k in range(n - 1)]
    regions, start = [], None
    for k in range(n):
        if pick[k] is None:
            continue
        start = k if start is None else start
        if k == n - 1 or not joined[k] or pick[k + 1] is None:
            regions.append(Region(start, k + 1, tuple(pick[start:k + 1])))
            start = None
    return Schedule(tuple(regions))


def _cutoff(encoding: Encoding, schedule: Schedule | None) -> float | None:
    """The objective ``schedule`` reaches in ``encoding`` (its values are set on the variables to evaluate it),
    raised by a hair so that the search may return it: the cutoff below which the solver looks for better (None
    without a schedule or when its objective is not known)."""
    if schedule is None:
        return None
    variables = encoding.model.variablesDict()
    for name, value in encoding.tight_values(schedule).items():
        if name in variables:
            variables[name].setInitialValue(value)
    objective = pulp.value(encoding.model.objective)
    return None if objective is None else objective + 1e-6 * max(1.0, abs(objective))


def _solve_model(encoding: Encoding, time_limit: float, gap: float, warm: Schedule | None) -> _Outcome:
    """Search below ``warm``'s objective (a schedule that fits): when nothing better is found, the outcome is
    ``warm``, proven optimal when the search proved that nothing better exists."""
    cutoff = _cutoff(encoding, warm)
    status, solution, bound = _run(encoding.model, time_limit, gap, cutoff)
    found = solution in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    infeasible = status == pulp.LpStatusInfeasible or solution == pulp.LpSolutionInfeasible
    if cutoff is not None and not found:  # nothing below the cutoff: warm stands, proven best if infeasible
        return _Outcome(warm, infeasible, 0.0 if infeasible else _relative_gap(cutoff, bound), False)
    if infeasible:
        return _Outcome(None, True, None, True)
    if not found:
        return _Outcome(None, False, None, False)
    objective = pulp.value(encoding.model.objective) or 0.0
    if cutoff is not None and objective > cutoff:  # a guard: both solvers search below the cutoff
        return _Outcome(warm, False, _relative_gap(cutoff, bound), False)
    optimal = solution == pulp.LpSolutionOptimal and gap == 0.0  # proven, with no tolerance asked for
    relative = _relative_gap(objective, bound)
    if relative is None and optimal:
        relative = 0.0
    proven = optimal or (relative is not None and relative <= 1e-9)
    return _Outcome(_schedule_from_solution(encoding), proven, relative, False)


def _relative_gap(objective: float, bound: float | None) -> float | None:
    """:func:`~planner.plan.relative_gap` of a positive ``objective``; None otherwise, where the encoding's objective
    (recomputation less the stop-early credits) can be 0 or below and a relative gap says nothing.

    >>> _relative_gap(2.0, 1.5), _relative_gap(2.0, None), _relative_gap(0.0, -1.0)
    (0.25, None, None)
    """
    return relative_gap(objective, bound) if objective > 0 else None


def _budget_model(problem: Problem, budget_bytes: int) -> Encoding:
    encoding = Encoding(problem)
    unit = _memory_unit(problem)
    for i, event in enumerate(encoding.events):
        encoding.model += (1.0 / unit) * event.bytes <= budget_bytes / unit, f"budget_{i}"
    seconds = [o.recompute_seconds for s in problem.stages for o in s.recompute_options] + [
        problem.region_seconds, problem.caching_region_seconds]
    scale = max(max(seconds, default=1.0), 1e-12)
    skips = [s.stop_saving(0) for s in problem.stages]
    encoding.model += pulp.lpSum([o.recompute_seconds / scale * encoding.choose[k][i]
                                  for k, s in enumerate(problem.stages) for i, o in enumerate(s.recompute_options)]
                                 + [problem.region_seconds / scale * encoding.region_end(k)
                                    for k in range(problem.num_stages) if problem.region_seconds]
                                 + [-skip / scale * encoding.stops_early(k) for k, skip in enumerate(skips) if skip]
                                 + [problem.caching_region_seconds / scale * encoding.caching_end(k)
                                    for k in range(problem.num_stages) if problem.caching_region_seconds])
    return encoding


def _check_encoding(encoding: Encoding, schedule: Schedule) -> int:
    """Simulate ``schedule`` and insist the encoding agrees; return the peak."""
    peak = simulate(encoding.problem, schedule).peak_bytes
    encoded = round(max(encoding.event_values(encoding.tight_values(schedule)), default=0))
    if encoded != peak:
        raise RuntimeError(f"internal error: the ILP encoding gives schedule {schedule} a peak of {encoded} bytes but "
                           f"simulate gives {peak}; please report this with the problem")
    return peak


def solve_ilp(problem: Problem, budget_bytes: int, *, time_limit: float = 60.0, gap: float = 0.0,
              warm: Schedule | None = None) -> Plan:
    """The schedule with the least recompute time whose simulated peak fits ``budget_bytes``.

    Status ``OPTIMAL`` when the solver proves it, ``FEASIBLE`` when ``time_limit`` seconds ran out (or ``gap`` > 0
    stopped it) with a schedule in hand; ``gap`` in the plan is then the relative distance to the best bound, or
    None where the solver does not report one (``lower_bound_seconds`` likewise). ``warm`` is a schedule to start
    from (default: the fewest-blocks baseline); it must fit the budget to help. Raises :class:`~planner.errors.InfeasibleBudgetError` (with the
    smallest achievable peak) when no schedule fits, and :class:`~planner.errors.PlannerError` when the time ran
    out before any schedule was found.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> problem = Problem((Stage("a", 1.0, 2.0),), (TensorInfo("x", 100, 0, savers=frozenset({0})),),
    ...                   fixed_bytes=1000)
    >>> solve_ilp(problem, 1050)
    Traceback (most recent call last):
    ...
    planner.errors.InfeasibleBudgetError: budget 1.03 KiB is below the smallest peak any plan reaches, 1.07 KiB ...
    """
    started = time.perf_counter()
    if simulate(problem, store_all(problem)).peak_bytes <= budget_bytes:
        return Plan.from_schedule(problem, store_all(problem), solver="ilp", status=SolverStatus.OPTIMAL, gap=0.0,
                                  lower_bound_seconds=0.0, solve_seconds=time.perf_counter() - started, budget_bytes=budget_bytes)
    target = budget_bytes
    for _ in range(4):  # tighten when solver tolerances let a solution exceed the budget by a few bytes
        encoding = _budget_model(problem, target)
        start = warm if warm is not None and simulate(problem, warm).peak_bytes <= target \
            else fewest_blocks(problem, target)
        outcome = _solve_model(encoding, time_limit, gap, start)
        if outcome.infeasible:
            raise infeasible_budget_error(problem, budget_bytes, min_peak_schedule(problem, time_limit=time_limit)[0])
        if outcome.schedule is None and start is not None:  # nothing better found: the start fits
            outcome = dataclasses.replace(outcome, schedule=start)
        if outcome.schedule is None:
            raise PlannerError(f"the ILP found no plan within {time_limit:g} s for budget {budget_bytes} bytes",
                               hint="raise time_limit, or use method='dp' on chains")
        peak = _check_encoding(encoding, outcome.schedule)
        if peak <= budget_bytes:
            status = SolverStatus.OPTIMAL if outcome.proven else SolverStatus.FEASIBLE
            relative = 0.0 if outcome.proven else outcome.gap
            seconds = recompute_seconds(problem, outcome.schedule)
            return Plan.from_schedule(problem, outcome.schedule, solver="ilp", status=status, gap=relative,
                                      lower_bound_seconds=None if relative is None else seconds * (1 - relative),
                                      solve_seconds=time.perf_counter() - started, budget_bytes=budget_bytes)
        target -= peak - target
    raise RuntimeError("internal error: the ILP kept returning plans above the budget")


def min_peak_schedule(problem: Problem, *, time_limit: float = 60.0,
                      candidates: Sequence[Schedule] = ()) -> tuple[Schedule, bool]:
    """A schedule reaching the smallest peak any schedule reaches, and whether the solver proved it smallest.
    The solver starts from the schedule of least peak among the baselines and ``candidates``, and never returns
    one that peaks higher (it may run out of ``time_limit`` before it improves on it)."""
    encoding = Encoding(problem)
    unit = _memory_unit(problem)
    peak = new_variable(encoding.model, "peak", 0)
    for i, event in enumerate(encoding.events):
        encoding.model += (1.0 / unit) * event.bytes <= peak, f"peak_{i}"
    encoding.model += peak
    candidates = [store_all(problem), uniform(problem), chen_sqrt(problem), *candidates]
    warm = min(candidates, key=lambda s: simulate(problem, s).peak_bytes)
    peak.setInitialValue(max(encoding.event_values(encoding.tight_values(warm)), default=0) / unit)
    outcome = _solve_model(encoding, time_limit, 0.0, warm)
    if outcome.schedule is None:
        return warm, False
    _check_encoding(encoding, outcome.schedule)
    if simulate(problem, warm).peak_bytes < simulate(problem, outcome.schedule).peak_bytes:
        return warm, False
    return outcome.schedule, outcome.proven


def min_peak_ilp(problem: Problem, *, time_limit: float = 60.0) -> Plan:
    """The plan with the smallest achievable peak: status OPTIMAL when proven, else FEASIBLE.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> problem = Problem((Stage("a", 1.0, 2.0), Stage("b", 1.0, 2.0)),
    ...                   (TensorInfo("x", 10, 0, frozenset({1}), frozenset({0, 1})),
    ...                    TensorInfo("y", 50, 0, frozenset({0}), frozenset({0}))))
    >>> min_peak_ilp(problem).predicted_peak_bytes
    60
    """
    started = time.perf_counter()
    schedule, proven = min_peak_schedule(problem, time_limit=time_limit)
    status = SolverStatus.OPTIMAL if proven else SolverStatus.FEASIBLE
    return Plan.from_schedule(problem, schedule, solver="ilp-min-peak", status=status,
                              solve_seconds=time.perf_counter() - started)
