"""A plan: which stages to recompute and what to cache, with the prediction that justifies it. JSON, never pickle.

>>> from planner.problem import Problem, Stage, TensorInfo, Schedule
>>> problem = Problem((Stage("a", 1.0, 2.0), Stage("b", 1.0, 2.0)),
...                   (TensorInfo("x", 10, producer=0, consumers=frozenset({1}), savers=frozenset({1})),))
>>> plan = Plan.from_schedule(problem, Schedule.uniform(2), solver="uniform", status=SolverStatus.HEURISTIC)
>>> Plan.from_json(plan.to_json()) == plan
True
>>> plan.recomputed_stage_names
('a', 'b')
>>> plan.stage_summaries[1].saved_bytes_eager, plan.stage_summaries[1].saved_bytes_planned
(10, 10)
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from .budget import format_bytes
from .errors import PlannerError
from .problem import Problem, Region, Schedule, TensorInfo, simulate, stage_recompute_seconds
from .schema import plan_schema, validate

SCHEMA_VERSION = 1


class SolverStatus(enum.Enum):
    OPTIMAL = "optimal"  # proven optimal over the execution model
    FEASIBLE = "feasible"  # within budget, optimality gap reported
    HEURISTIC = "heuristic"  # a baseline rule, no optimality claim


@dataclass(frozen=True)
class PlannedRegion:
    """Stages ``start .. stop-1`` run in one checkpoint; ``cached_nodes`` are not recomputed."""

    start: int
    stop: int
    cached_nodes: tuple[str, ...] = ()
    options: tuple[int, ...] = ()


@dataclass(frozen=True)
class StageSummary:
    """One stage as the plan sees it: measured times, what it saves, and what the plan's decision costs.

    ``saved_bytes_eager`` sums the tensors whose ``savers`` include the stage (a tensor two stages save counts for
    both). ``recompute_seconds`` and ``cached_nodes`` describe the chosen recompute option (0 and ``()`` when the
    stage is stored). ``saved_bytes_planned`` is what the stage keeps from its forward for its backward under the
    plan: its saved tensors when stored; when recomputed, the outputs of its cached nodes, plus the region's
    inputs (which the checkpoint keeps) for the first stage of a region; None when not recorded.
    """

    name: str
    forward_seconds: float
    backward_seconds: float
    saved_bytes_eager: int
    recompute_seconds: float
    cached_nodes: tuple[str, ...]
    saved_bytes_planned: int | None = None


class TensorFate(enum.Enum):
    """What a plan does with a tensor that the backward, or a later checkpoint region, needs from the forward."""

    KEPT = "kept"  # held from the forward to the backward: a stored stage saves it
    REGION_INPUT = "region input"  # held by the checkpoint of a region that reads it, until the region re-runs
    CACHED = "cached"  # made inside a region and held; the region's recomputation takes it instead of remaking it
    RECOMPUTED = "recomputed"  # freed once the forward is done with it, made again when its region re-runs


@dataclass(frozen=True)
class TensorSummary:
    """One tensor that eager training holds for the backward (or that a region's checkpoint holds as an input),
    and its fate under the plan: ``stage`` makes it (``node``, an op of ``module_path`` that takes ``seconds``),
    ``nbytes`` is its storage."""

    name: str
    node: str
    stage: int
    nbytes: int
    fate: TensorFate
    seconds: float = 0.0
    module_path: str = ""


def _fate(tensor: TensorInfo, owner: list[int | None], cached: list[frozenset[str]]) -> TensorFate | None:
    region = owner[tensor.producer]
    if region is not None and tensor.node and tensor.node in cached[tensor.producer]:
        return TensorFate.CACHED
    if any(owner[s] is None for s in tensor.savers):
        return TensorFate.KEPT
    if any(owner[c] is not None and owner[c] != region for c in tensor.consumers):
        return TensorFate.REGION_INPUT
    return TensorFate.RECOMPUTED if tensor.savers else None


def tensor_summaries(problem: Problem, schedule: Schedule) -> tuple[TensorSummary, ...]:
    """Per tensor that some stage saves for its backward, or that a region reads from before it, in the order the
    forward makes them: its size and what ``schedule`` does with it (:class:`TensorFate`).

    >>> from planner.problem import Stage, TensorInfo
    >>> stages = tuple(Stage(s, 1.0, 2.0) for s in "abc")
    >>> problem = Problem(stages, (
    ...     TensorInfo("h", 40, producer=1, savers=frozenset({1}), node="mm"),
    ...     TensorInfo("x", 10, producer=0, consumers=frozenset({1}), savers=frozenset({1}), node="relu"),
    ...     TensorInfo("y", 10, producer=1, consumers=frozenset({2}), savers=frozenset({2}), node="add")))
    >>> [(t.name, t.fate.value) for t in tensor_summaries(problem, Schedule.from_segments([(1, 2)]))]
    [('h', 'recomputed'), ('x', 'region input'), ('y', 'kept')]
    """
    owner = schedule.region_index(problem.num_stages)
    cached = [frozenset() if owner[k] is None else
              stage.recompute_options[schedule.regions[owner[k]].option_of(k)].cached_nodes
              for k, stage in enumerate(problem.stages)]
    summaries = []
    for t in problem.tensors:
        fate = _fate(t, owner, cached)
        if fate is not None:
            summaries.append(TensorSummary(t.name, t.node, t.producer, t.nbytes, fate, t.seconds, t.module_path))
    return tuple(summaries)


def usable_bytes(budget_bytes: int, allocator_margin: float) -> int:
    """What a plan may use of ``budget_bytes`` when ``allocator_margin`` of it is left to the allocator.

    >>> usable_bytes(80 * 10**9, 0.05)
    76000000000
    """
    return int(budget_bytes * (1.0 - allocator_margin))


def budget_for_usable(usable: int, allocator_margin: float) -> int:
    """The smallest budget of which a plan may use ``usable`` bytes: the inverse of :func:`usable_bytes`.

    >>> budget_for_usable(76000000000, 0.05), usable_bytes(budget_for_usable(999, 0.07), 0.07) >= 999
    (80000000000, True)
    """
    budget = math.ceil(usable / (1.0 - allocator_margin))
    while usable_bytes(budget, allocator_margin) < usable:
        budget += 1
    return budget


def _saved_bytes(problem: Problem) -> list[int]:
    saved = [0] * problem.num_stages
    for t in problem.tensors:
        for k in t.savers:
            saved[k] += t.nbytes
    return saved


def _kept_in_region(problem: Problem, region: Region, stage: int, cached: frozenset[str]) -> int:
    kept = sum(t.nbytes for t in problem.tensors if t.producer == stage and t.node and t.node in cached)
    if stage == region.start:
        kept += sum(t.nbytes for t in problem.tensors
                    if t.producer < region.start and any(c in region.stages for c in t.consumers))
    return kept


def stage_summaries(problem: Problem, schedule: Schedule) -> tuple[StageSummary, ...]:
    """Per stage of ``problem``: times, bytes saved eagerly and under ``schedule``, and the recompute cost (with
    ``problem.region_seconds`` counted by the first stage of each region).

    >>> from planner.problem import Stage, TensorInfo
    >>> problem = Problem((Stage("a", 1.0, 2.0), Stage("b", 1.0, 2.0)),
    ...                   (TensorInfo("x", 10, producer=0, consumers=frozenset({1}), savers=frozenset({1})),))
    >>> [(s.name, s.saved_bytes_eager, s.saved_bytes_planned, s.recompute_seconds)
    ...  for s in stage_summaries(problem, Schedule.from_segments([(1, 2)]))]
    [('a', 0, 0, 0.0), ('b', 10, 10, 1.0)]
    """
    owner = schedule.region_index(problem.num_stages)
    eager = _saved_bytes(problem)
    summaries = []
    for k, stage in enumerate(problem.stages):
        recompute, cached, kept = 0.0, frozenset(), eager[k]
        if owner[k] is not None:
            region = schedule.regions[owner[k]]
            option = stage.recompute_options[region.option_of(k)]
            recompute, cached = stage_recompute_seconds(problem, region, k), option.cached_nodes
            kept = _kept_in_region(problem, region, k, cached)
        summaries.append(StageSummary(stage.name, stage.forward_seconds, stage.backward_seconds, eager[k],
                                      recompute, tuple(sorted(cached)), kept))
    return tuple(summaries)


def relative_gap(seconds: float, bound: float | None) -> float | None:
    """``(seconds - bound) / seconds``, 0 when both are 0; None without a bound.

    >>> relative_gap(2.0, 1.5), relative_gap(0.0, 0.0), relative_gap(1.0, None)
    (0.25, 0.0, None)
    """
    if bound is None:
        return None
    if seconds <= 0:
        return 0.0
    return max(0.0, (seconds - bound) / seconds)


@dataclass(frozen=True)
class Plan:
    """The decisions, the stages they refer to, and what the execution model predicts for them."""

    stage_names: tuple[str, ...]
    regions: tuple[PlannedRegion, ...]
    predicted_peak_bytes: int
    eager_peak_bytes: int
    predicted_recompute_seconds: float
    predicted_overhead: float
    solver: str
    status: SolverStatus
    gap: float | None = None
    solve_seconds: float = 0.0
    budget_bytes: int | None = None
    budget_text: str | None = None
    stage_nodes: tuple[tuple[str, ...], ...] = ()
    fingerprint: str = ""
    torch_version: str = ""
    device: str = ""
    stage_summaries: tuple[StageSummary, ...] = ()
    tensor_summaries: tuple[TensorSummary, ...] = ()
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    schema_version: int = SCHEMA_VERSION
    timing: str = ""  # where the times came from: "wall_clock", "cuda_events", "analytic:h100"
    allocator_margin: float = 0.0  # share of the budget left to the allocator: planned for budget * (1 - margin)
    lower_bound_seconds: float | None = None  # proven: no plan within the budget recomputes less (None: unknown)

    @property
    def reused_from(self) -> str | None:
        """The fingerprint of the plan this one reuses, made for the same graph on larger inputs (see
        ``planner.optimize(..., reuse_plans=True)``): its peaks and times are that plan's, upper bounds here."""
        return dict(self.extra).get("reused_from")

    @property
    def grads_held(self) -> bool:
        """Whether the plan is for steps that begin with every trained parameter holding its gradient (gradient
        accumulation; see ``planner.optimize(..., grads_held=)``): they count as fixed memory."""
        return bool(dict(self.extra).get("grads_held", False))

    @property
    def calls_per_step(self) -> int:
        """How many calls of the model each step makes before its backward (two views through one encoder, a
        discriminator on real and on fake samples): each call before the last holds what its forward keeps for the
        backward while the others run, and the peaks count that (see ``planner.optimize(..., calls_per_step=)``)."""
        return int(dict(self.extra).get("calls_per_step", 1))

    @property
    def planned_budget_bytes(self) -> int | None:
        """The bytes the solver planned against: the budget less the allocator margin.

        >>> Plan((), (), 0, 0, 0.0, 0.0, "dp", SolverStatus.OPTIMAL, budget_bytes=1000,
        ...      allocator_margin=0.05).planned_budget_bytes
        950
        """
        return usable_bytes(self.budget_bytes, self.allocator_margin) if self.budget_bytes is not None else None

    @classmethod
    def from_schedule(cls, problem: Problem, schedule: Schedule, *, solver: str, status: SolverStatus,
                      gap: float | None = None, solve_seconds: float = 0.0,
                      budget_bytes: int | None = None, lower_bound_seconds: float | None = None) -> "Plan":
        """Evaluate ``schedule`` on ``problem`` and record the prediction beside the decisions. A solver's
        ``lower_bound_seconds`` leaves out ``problem.per_step_seconds`` (as its objective does); it is added here
        for a schedule that checkpoints, as in the prediction, and the ``gap`` is then taken between the two."""
        evaluation = simulate(problem, schedule)
        if lower_bound_seconds is not None and schedule.regions and problem.per_step_seconds:
            lower_bound_seconds += problem.per_step_seconds
            if gap is not None:  # the gap between the prediction and the bound recorded with it
                gap = relative_gap(evaluation.recompute_seconds, lower_bound_seconds)
        eager = simulate(problem, Schedule.store_all(problem.num_stages))
        regions = tuple(
            PlannedRegion(r.start, r.stop, tuple(sorted(set().union(*(
                problem.stages[k].recompute_options[r.option_of(k)].cached_nodes for k in r.stages)))),
                tuple(r.option_of(k) for k in r.stages))
            for r in schedule.regions)
        eager_seconds = eager.step_seconds
        return cls(
            stage_names=tuple(s.name for s in problem.stages), regions=regions,
            predicted_peak_bytes=evaluation.peak_bytes, eager_peak_bytes=eager.peak_bytes,
            predicted_recompute_seconds=evaluation.recompute_seconds,
            predicted_overhead=evaluation.recompute_seconds / eager_seconds if eager_seconds > 0 else 0.0,
            solver=solver, status=status, gap=gap, solve_seconds=solve_seconds, budget_bytes=budget_bytes,
            stage_summaries=stage_summaries(problem, schedule), tensor_summaries=tensor_summaries(problem, schedule),
            lower_bound_seconds=lower_bound_seconds)

    @property
    def schedule(self) -> Schedule:
        return Schedule(tuple(Region(r.start, r.stop, r.options) for r in self.regions))

    @property
    def recomputed_stage_names(self) -> tuple[str, ...]:
        return tuple(self.stage_names[k] for r in self.regions for k in range(r.start, r.stop))

    @property
    def compiled_peak_bytes(self) -> int | None:
        """For a plan made with ``compile=``: the peak measured of its compiled training step (else None)."""
        return dict(self.extra).get("compiled_peak_bytes")

    def summary(self) -> str:
        """A few lines for people: budget, peaks, overhead, solver and the regions."""
        lines = [
            f"planner plan ({self.solver}, {self.status.value}"
            + (f", gap {self.gap:.2%}" if self.gap is not None else "") + f", solved in {self.solve_seconds:.2f}s)",
            f"  budget          {format_bytes(self.budget_bytes) if self.budget_bytes else 'none'}"
            + (f" (given as {self.budget_text!r})" if self.budget_text else "")
            + (f", planned for {format_bytes(self.planned_budget_bytes)} leaving {self.allocator_margin:.0%} to the "
               f"allocator" if self.allocator_margin and self.budget_bytes else ""),
            f"  eager peak      {format_bytes(self.eager_peak_bytes)}"
            + (" (steps that begin with the gradients held: gradient accumulation)" if self.grads_held else ""),
            f"  predicted peak  {format_bytes(self.predicted_peak_bytes)}"
            f" ({self.predicted_peak_bytes / max(self.eager_peak_bytes, 1):.0%} of eager)",
            *([f"  calls per step  {self.calls_per_step} before one backward (peaks count the tensors each call "
               f"holds for it while the others run)"] if self.calls_per_step > 1 else []),
            *([f"  reused          the plan for larger inputs ({self.reused_from}): these peaks and times are "
               f"upper bounds"] if self.reused_from else []),
            *([f"  compiled peak   {format_bytes(self.compiled_peak_bytes)} (measured under torch.compile("
               f"{dict(self.extra).get('compiled_with', '')}), {dict(self.extra).get('compiled_plans_measured')} "
               f"plan(s) compiled)"]
              if self.compiled_peak_bytes is not None else []),
            f"  overhead        +{self.predicted_overhead:.1%} step time (predicted"
            + (f", times {self.timing}" if self.timing else "")
            + (", the recomputed ops at their eager times" if self.compiled_peak_bytes is not None else "") + ")",
            f"  stages          {len(self.stage_names)}, recomputed {len(self.recomputed_stage_names)}"
            f" in {len(self.regions)} region(s)",
        ]
        for r in self.regions:
            names = self.stage_names[r.start] if r.stop - r.start == 1 else \
                f"{self.stage_names[r.start]} .. {self.stage_names[r.stop - 1]}"
            cached = f", caching {len(r.cached_nodes)} node(s)" if r.cached_nodes else ""
            lines.append(f"    checkpoint [{names}]{cached}")
        return "\n".join(lines)

    # --- JSON -------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        data["regions"] = [dataclasses.asdict(r) for r in self.regions]
        data["tensor_summaries"] = [{**dataclasses.asdict(t), "fate": t.fate.value} for t in self.tensor_summaries]
        data["extra"] = dict(self.extra)
        return data

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """Read a plan from :meth:`to_dict`'s output, checked against ``planner/plan.schema.json``.

        Raises :class:`~planner.errors.PlannerError` naming the JSON path of the first bad field.

        >>> Plan.from_dict({"schema_version": 1, "stage_names": ["a"], "regions": [{"start": 0, "stop": 2}],
        ...                 "predicted_peak_bytes": 10, "eager_peak_bytes": 20, "predicted_recompute_seconds": 0.1,
        ...                 "predicted_overhead": 0.05, "solver": "dp", "status": "optimal"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        planner.errors.PlannerError: plan data is malformed at $.regions[0].stop: region [0, 2) runs past the last ...
        """
        if not isinstance(data, dict):
            raise PlannerError("plan JSON must be an object", hint=_PLAN_HINT)
        if data.get("schema_version") != SCHEMA_VERSION:
            raise PlannerError(f"plan has schema_version {data.get('schema_version')!r}, this planner reads "
                               f"{SCHEMA_VERSION}", hint="re-create the plan with this version of planner")
        try:
            validate(data, plan_schema(), subject="plan")
            _check_consistency(data)
        except PlannerError as exc:
            raise PlannerError(exc.message, hint=_PLAN_HINT) from None
        values = dict(data)
        values["status"] = SolverStatus(data["status"])
        values["regions"] = tuple(PlannedRegion(r["start"], r["stop"], tuple(r.get("cached_nodes", ())),
                                                tuple(r.get("options", ()))) for r in data["regions"])
        values["stage_names"] = tuple(data["stage_names"])
        values["stage_nodes"] = tuple(tuple(s) for s in data.get("stage_nodes", ()))
        values["stage_summaries"] = tuple(StageSummary(**{**s, "cached_nodes": tuple(s["cached_nodes"])})
                                          for s in data.get("stage_summaries", ()))
        values["tensor_summaries"] = tuple(TensorSummary(**{**t, "fate": TensorFate(t["fate"])})
                                           for t in data.get("tensor_summaries", ()))
        values["extra"] = tuple(sorted(data.get("extra", {}).items()))
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlannerError(f"plan is not valid JSON: {exc}", hint=_PLAN_HINT) from exc
        return cls.from_dict(data)


_PLAN_HINT = "plans are written by Plan.to_json(); their schema is planner/plan.schema.json"


def _malformed(path: str, problem: str) -> PlannerError:
    return PlannerError(f"plan data is malformed at {path}: {problem}")


def _check_consistency(data: dict[str, Any]) -> None:
    """What the schema cannot say: regions in order within the stages, one entry per stage in the lists."""
    n = len(data["stage_names"])
    last = -1
    for i, r in enumerate(data["regions"]):
        path = f"$.regions[{i}]"
        if r["start"] <= last:
            raise _malformed(f"{path}.start", f"region starts at {r['start']}, inside or before the previous one")
        if r["stop"] <= r["start"]:
            raise _malformed(f"{path}.stop", f"region [{r['start']}, {r['stop']}) is empty")
        if r["stop"] > n:
            raise _malformed(f"{path}.stop", f"region [{r['start']}, {r['stop']}) runs past the last stage {n - 1}")
        if r.get("options") and len(r["options"]) != r["stop"] - r["start"]:
            raise _malformed(f"{path}.options", f"{len(r['options'])} options for {r['stop'] - r['start']} stages")
        last = r["stop"] - 1
    for key in ("stage_nodes", "stage_summaries"):
        if data.get(key) and len(data[key]) != n:
            raise _malformed(f"$.{key}", f"{len(data[key])} entries for {n} stages")
    for i, tensor in enumerate(data.get("tensor_summaries", ())):
        if tensor["stage"] >= n:
            raise _malformed(f"$.tensor_summaries[{i}].stage",
                             f"stage {tensor['stage']} is past the last stage {n - 1}")
    for k, summary in enumerate(data.get("stage_summaries", ())):
        if summary["name"] != data["stage_names"][k]:
            raise _malformed(f"$.stage_summaries[{k}].name",
                             f"{summary['name']!r} is not stage {k}, {data['stage_names'][k]!r}")
