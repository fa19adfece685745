"""A plan: which stages to recompute and what to cache, with the prediction that justifies it. JSON, never pickle.

>>> from planner.problem import Problem, Stage, TensorInfo, Schedule
>>> problem = Problem((Stage("a", 1.0, 2.0), Stage("b", 1.0, 2.0)),
...                   (TensorInfo("x", 10, producer=0, consumers=frozenset({1}), savers=frozenset({1})),))
>>> plan = Plan.from_schedule(problem, Schedule.uniform(2), solver="uniform", status=SolverStatus.HEURISTIC)
>>> Plan.from_json(plan.to_json()) == plan
True
>>> plan.recomputed_stage_names
('a', 'b')
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any

from .budget import format_bytes
from .errors import PlannerError
from .problem import Problem, Region, Schedule, simulate

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
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_schedule(cls, problem: Problem, schedule: Schedule, *, solver: str, status: SolverStatus,
                      gap: float | None = None, solve_seconds: float = 0.0,
                      budget_bytes: int | None = None) -> "Plan":
        """Evaluate ``schedule`` on ``problem`` and record the prediction beside the decisions."""
        evaluation = simulate(problem, schedule)
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
            solver=solver, status=status, gap=gap, solve_seconds=solve_seconds, budget_bytes=budget_bytes)

    @property
    def schedule(self) -> Schedule:
        return Schedule(tuple(Region(r.start, r.stop, r.options) for r in self.regions))

    @property
    def recomputed_stage_names(self) -> tuple[str, ...]:
        return tuple(self.stage_names[k] for r in self.regions for k in range(r.start, r.stop))

    def summary(self) -> str:
        """A few lines for people: budget, peaks, overhead, solver and the regions."""
        lines = [
            f"planner plan ({self.solver}, {self.status.value}"
            + (f", gap {self.gap:.2%}" if self.gap is not None else "") + f", solved in {self.solve_seconds:.2f}s)",
            f"  budget          {format_bytes(self.budget_bytes) if self.budget_bytes else 'none'}"
            + (f" (given as {self.budget_text!r})" if self.budget_text else ""),
            f"  eager peak      {format_bytes(self.eager_peak_bytes)}",
            f"  predicted peak  {format_bytes(self.predicted_peak_bytes)}"
            f" ({self.predicted_peak_bytes / max(self.eager_peak_bytes, 1):.0%} of eager)",
            f"  overhead        +{self.predicted_overhead:.1%} step time (predicted)",
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
        data["extra"] = dict(self.extra)
        return data

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        try:
            if data.get("schema_version") != SCHEMA_VERSION:
                raise PlannerError(f"plan has schema_version {data.get('schema_version')!r}, this planner reads "
                                   f"{SCHEMA_VERSION}", hint="re-create the plan with this version of planner")
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = set(data) - fields
            if unknown:
                raise PlannerError(f"plan has unknown fields {sorted(unknown)}")
            values = dict(data)
            values["status"] = SolverStatus(data["status"])
            values["regions"] = tuple(PlannedRegion(r["start"], r["stop"], tuple(r.get("cached_nodes", ())),
                                                    tuple(r.get("options", ()))) for r in data["regions"])
            values["stage_names"] = tuple(data["stage_names"])
            values["stage_nodes"] = tuple(tuple(s) for s in data.get("stage_nodes", ()))
            values["extra"] = tuple(sorted(data.get("extra", {}).items()))
            plan = cls(**values)
            plan.schedule  # validates region order and bounds
            return plan
        except PlannerError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PlannerError(f"plan data is malformed: {exc}", hint="plans are written by Plan.to_json()") from exc

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlannerError(f"plan is not valid JSON: {exc}", hint="plans are written by Plan.to_json()") from exc
        if not isinstance(data, dict):
            raise PlannerError("plan JSON must be an object", hint="plans are written by Plan.to_json()")
        return cls.from_dict(data)
