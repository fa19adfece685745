"""The memory timeline of one training step, predicted and measured, stage by stage: the data behind
:func:`planner.viz.plot_timeline`.

A step is laid out as *slots*: the forward of each stage in order, then, from the last stage back to the first, the
recomputation of a checkpoint region (when its last stage's backward begins) and the backward of each stage.
:func:`predicted_timeline` places :func:`~planner.problem.simulate`'s events in those slots; :func:`measure_timeline`
runs a real training step of a captured or planned graph under a recording
:class:`~planner.meter.LiveMemoryMeter`, with a mark each time a stage starts its forward, is recomputed, or starts
its backward, and places every op's live bytes in the slot it ran in.

>>> from planner.problem import Problem, Region, Schedule, Stage, TensorInfo
>>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(3))
>>> tensors = tuple(TensorInfo(f"t{i}", 100, producer=i, consumers=frozenset({i + 1}) if i < 2 else frozenset(),
...                            savers=frozenset({i, i + 1}) if i < 2 else frozenset({i})) for i in range(3))
>>> problem = Problem(stages, tensors, fixed_bytes=1000)
>>> [f"{s.phase.value}:{s.stage}" for s in step_slots(3, Schedule((Region(1, 3),)))]
['forward:0', 'forward:1', 'forward:2', 'recompute:2', 'backward:2', 'backward:1', 'backward:0']
>>> timeline = predicted_timeline(problem, Schedule.uniform(3), label="uniform")
>>> timeline.predicted_peak_bytes == simulate(problem, Schedule.uniform(3)).peak_bytes
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx

from .capture import CapturedGraph, casts_uncached, flat_call_args, outside_autocast
from .errors import PlannerError
from .meter import LiveMemoryMeter, storage_bytes
from .problem import Phase, Problem, Schedule, simulate
from .profile import BackwardMarker, FreeingInterpreter, default_loss, fixed_tensors, preserved_training_state

__all__ = ["Slot", "TimelinePoint", "StepTimeline", "step_slots", "predicted_timeline", "measure_timeline",
           "step_timelines"]


@dataclass(frozen=True)
class Slot:
    """One place on a step's time axis: a stage's forward, a region's recomputation (``stage`` is the region's
    last stage) or a stage's backward."""

    phase: Phase
    stage: int


@dataclass(frozen=True)
class TimelinePoint:
    """Memory in use from ``x`` to ``x + width`` on the slot axis (slot ``i`` spans ``[i, i + 1)``)."""

    x: float
    width: float
    phase: Phase
    stage: int
    total_bytes: int


@dataclass(frozen=True)
class StepTimeline:
    """One training step's memory, predicted by the execution model and (when run) measured op by op."""

    label: str
    stage_names: tuple[str, ...]
    slots: tuple[Slot, ...]
    predicted: tuple[TimelinePoint, ...]
    measured: tuple[TimelinePoint, ...] = ()
    budget_bytes: int | None = None

    @property
    def predicted_peak(self) -> TimelinePoint:
        return max(self.predicted, key=lambda p: p.total_bytes)

    @property
    def measured_peak(self) -> TimelinePoint | None:
        return max(self.measured, key=lambda p: p.total_bytes) if self.measured else None

    @property
    def predicted_peak_bytes(self) -> int:
        return self.predicted_peak.total_bytes

    @property
    def measured_peak_bytes(self) -> int | None:
        peak = self.measured_peak
        return None if peak is None else peak.total_bytes

    def measured_stage_peaks(self, phase: Phase) -> dict[int, int]:
        """Highest measured bytes per stage in ``phase`` (stages with no op in that phase are absent)."""
        peaks: dict[int, int] = {}
        for p in self.measured:
            if p.phase is phase:
                peaks[p.stage] = max(peaks.get(p.stage, 0), p.total_bytes)
        return peaks


def step_slots(num_stages: int, schedule: Schedule) -> tuple[Slot, ...]:
    """The slots of one step under ``schedule``, in the order they run."""
    ends = {r.stop - 1 for r in schedule.regions}
    slots = [Slot(Phase.FORWARD, k) for k in range(num_stages)]
    for k in reversed(range(num_stages)):
        if k in ends:
            slots.append(Slot(Phase.RECOMPUTE, k))
        slots.append(Slot(Phase.BACKWARD, k))
    return tuple(slots)


def predicted_timeline(problem: Problem, schedule: Schedule, *, label: str = "", budget_bytes: int | None = None,
                       slots: tuple[Slot, ...] | None = None) -> StepTimeline:
    """:func:`~planner.problem.simulate`'s events for ``schedule`` placed on the step's slots: a forward or
    recomputation fills its slot, a backward's start and its end take half of it each.

    ``slots``: lay the step out on these (by default ``step_slots(n, schedule)``), so that an eager timeline can
    share a plot with a planned one; they must include every slot ``schedule`` runs.
    """
    slots = slots if slots is not None else step_slots(problem.num_stages, schedule)
    missing = set(step_slots(problem.num_stages, schedule)) - set(slots)
    if missing:
        raise PlannerError(f"the slots given lack {sorted(f'{s.phase.value}:{s.stage}' for s in missing)}",
                           hint="lay out the step with step_slots(num_stages, schedule)")
    index = {slot: i for i, slot in enumerate(slots)}
    points = []
    for e in simulate(problem, schedule).events:
        if e.phase is Phase.BACKWARD_START:
            x, width, phase = index[Slot(Phase.BACKWARD, e.stage)], 0.5, Phase.BACKWARD
        elif e.phase is Phase.BACKWARD:
            x, width, phase = index[Slot(Phase.BACKWARD, e.stage)] + 0.5, 0.5, Phase.BACKWARD
        else:
            x, width, phase = index[Slot(e.phase, e.stage)], 1.0, e.phase
        points.append(TimelinePoint(float(x), width, phase, e.stage, e.total_bytes))
    points.sort(key=lambda p: p.x)
    return StepTimeline(label, tuple(s.name for s in problem.stages), slots, tuple(points),
                        budget_bytes=budget_bytes)


# --- measuring ---------------------------------------------------------------------------------------------------

class _Recorder:
    """Marks the meter with ``"<phase>:<stage>"`` as stages start, are recomputed and finish their backward."""

    def __init__(self, meter: LiveMemoryMeter):
        self.meter = meter
        self.in_backward = False
        self.label = ""

    def mark(self, phase: Phase, stage: int) -> None:
        self.label = f"{phase.value}:{stage}"
        self.meter.mark(self.label)

    def stage_starts(self, stage: int) -> None:
        self.mark(Phase.RECOMPUTE if self.in_backward else Phase.FORWARD, stage)

    def backward_done(self, stage: int) -> None:
        self.mark(Phase.BACKWARD, max(stage - 1, 0))

    def backward_starts(self, last_stage: int) -> None:
        self.in_backward = True
        self.mark(Phase.BACKWARD, last_stage)


class _StageInterpreter(FreeingInterpreter):
    """Runs a graph, telling the recorder when a stage starts and wrapping the tensors a stage reads from earlier
    stages in a marker whose backward says that stage's backward is done."""

    def __init__(self, gm: fx.GraphModule, stage_of: dict[str, int], recorder: _Recorder):
        super().__init__(gm)
        self.stage_of = stage_of
        self.recorder = recorder
        self.current: int | None = None

    def _stage(self, n: fx.Node) -> int | None:
        if n.op not in ("call_function", "call_method") or n.name not in self.stage_of:
            return None
        if n.target is operator.getitem and n.args and getattr(n.args[0], "op", None) == "call_module":
            return None  # an output of a region: the region's body marks its own stages
        return self.stage_of[n.name]

    def run_node(self, n: fx.Node) -> Any:
        stage = self._stage(n)
        if stage is not None and stage != self.current:
            self.current = stage
            self._mark_inputs(stage)
            self.recorder.stage_starts(stage)
        return super().run_node(n)

    def _mark_inputs(self, stage: int) -> None:
        external: list[fx.Node] = []
        for n in self.module.graph.nodes:
            if self._stage(n) != stage:
                continue
            for src in n.all_input_nodes:
                value = self.env.get(src)
                if self.stage_of.get(src.name, stage) < stage and src not in external \
                        and isinstance(value, torch.Tensor) and value.requires_grad:
                    external.append(src)
        if external:
            recorder = self.recorder  # not self: the marker must not keep this interpreter's values alive
            marked = BackwardMarker.apply(lambda: recorder.backward_done(stage),
                                           *[self.env[s] for s in external])
            for src, value in zip(external, marked):
                self.env[src] = value


class _InterpretedBody(torch.nn.Module):
    """A checkpoint region's body run by a :class:`_StageInterpreter`; a recomputation restores the mark it
    interrupted."""

    def __init__(self, body: fx.GraphModule, stage_of: dict[str, int], recorder: _Recorder):
        super().__init__()
        self.body = body
        self.stage_of = stage_of
        self.recorder = recorder

    def forward(self, *args: Any) -> Any:
        interrupted = self.recorder.label
        try:
            return _StageInterpreter(self.body, self.stage_of, self.recorder).run(*args)
        finally:
            if self.recorder.in_backward and interrupted:
                self.recorder.meter.mark(interrupted)
                self.recorder.label = interrupted


@contextlib.contextmanager
def _interpreted_regions(gm: fx.GraphModule, stage_of: dict[str, int], recorder: _Recorder) -> Iterator[None]:
    from .rewrite import CheckpointRegion

    regions = [m for m in gm.modules() if isinstance(m, CheckpointRegion)]
    bodies = [r.body for r in regions]
    for region, body in zip(regions, bodies):
        region.body = _InterpretedBody(body, stage_of, recorder)
    try:
        yield
    finally:
        for region, body in zip(regions, bodies):
            region.body = body


def _run_marked_step(gm: fx.GraphModule, flat: list, stage_of: dict[str, int], num_stages: int,
                     loss_fn: Callable[[Any], torch.Tensor], hold_outputs: bool) -> LiveMemoryMeter:
    meter = LiveMemoryMeter(record=True)
    recorder = _Recorder(meter)
    with preserved_training_state(gm), _interpreted_regions(gm, stage_of, recorder), meter:
        interp = _StageInterpreter(gm, stage_of, recorder)
        with casts_uncached():  # as a planned module runs (an interpreter runs no module hooks)
            outputs = interp.run(*flat)
        loss = loss_fn(outputs)
        if not hold_outputs:
            del outputs
            interp.env.clear()
        with outside_autocast():
            recorder.backward_starts(num_stages - 1)
            loss.backward()
        del loss
        for p in gm.parameters():
            p.grad = None
    return meter


def _measured_points(meter: LiveMemoryMeter, slots: tuple[Slot, ...], schedule: Schedule, num_stages: int,
                     fixed_bytes: int) -> tuple[TimelinePoint, ...]:
    """Each sample in its slot, the samples of one slot spread evenly across it."""
    owner = schedule.region_index(num_stages)
    index = {slot: i for i, slot in enumerate(slots)}
    by_slot: dict[Slot, list[int]] = {}
    for sample in meter.samples:
        label = meter.segments[sample.segment].label if sample.segment >= 0 else "forward:0"
        phase_name, stage_text = label.split(":")
        phase, stage = Phase(phase_name), int(stage_text)
        if phase is Phase.RECOMPUTE:
            stage = schedule.regions[owner[stage]].stop - 1 if owner[stage] is not None else stage
        slot = Slot(phase, stage)
        if slot not in index:
            raise PlannerError(f"a measured step ran {label}, which schedule {schedule} has no slot for")
        by_slot.setdefault(slot, []).append(sample.live_bytes)
    points = []
    for slot, values in by_slot.items():
        width = 1.0 / len(values)
        points += [TimelinePoint(index[slot] + i * width, width, slot.phase, slot.stage, fixed_bytes + v)
                   for i, v in enumerate(values)]
    return tuple(sorted(points, key=lambda p: p.x))


def measure_timeline(timeline: StepTimeline, captured: CapturedGraph, module: fx.GraphModule,
                     stage_nodes: Sequence[Sequence[str]], schedule: Schedule, *,
                     loss_fn: Callable[[Any], torch.Tensor] | None = None,
                     hold_outputs: bool = True) -> StepTimeline:
    """``timeline`` with measured points: one real forward + backward of ``module`` (``captured.graph_module``
    for eager, or a planned module running ``schedule``) on ``captured``'s example inputs.

    Parameters, buffers, inputs and ``.grad``, the RNG state and BatchNorm statistics are restored afterwards.
    Measured bytes are the live storages the step allocates plus the parameters, buffers and inputs.
    """
    stage_of = {name: k for k, names in enumerate(stage_nodes) for name in names}
    flat = flat_call_args(captured, captured.example_args, captured.example_kwargs)
    num_stages = len(stage_nodes)
    meter = _run_marked_step(module, flat, stage_of, num_stages, loss_fn or default_loss, hold_outputs)
    fixed = storage_bytes(fixed_tensors(captured.graph_module, flat))
    points = _measured_points(meter, timeline.slots, schedule, num_stages, fixed)
    return dataclasses.replace(timeline, measured=points)


def step_timelines(optimized, *, measure: bool = True) -> tuple[StepTimeline, StepTimeline]:
    """Eager and planned timelines of the step ``optimized`` (from :func:`planner.optimize`) was last planned for.

    Both are predicted by the execution model the plan was solved against; with ``measure`` both are also run,
    once each, on the example inputs the plan was made for.

    >>> import torch, planner
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
    ...                                                   torch.nn.Linear(128, 32)) for _ in range(4)])
    >>> opt = planner.optimize(model, "60%", example_inputs=(torch.randn(256, 32),), profile_repeats=1)
    >>> eager, planned = step_timelines(opt)
    >>> planned.predicted_peak_bytes == opt.plan.predicted_peak_bytes, planned.budget_bytes == opt.plan.budget_bytes
    (True, True)
    >>> eager.slots == planned.slots
    True
    >>> planned.measured_peak_bytes < eager.measured_peak_bytes
    True
    """
    from .api import planned_module

    planned = optimized.planned
    plan, problem, captured = planned.plan, planned.problem, planned.captured
    if problem is None:
        raise PlannerError("this plan carries no profile to predict a timeline from: it was loaded from JSON, or "
                           "reuses the plan for larger inputs",
                           hint="plan the model with planner.optimize(model, budget, example_inputs) for these "
                                "inputs (reuse_plans=False plans each shape anew)")
    options = getattr(optimized, "_options", {})
    loss_fn, hold_outputs = options.get("loss_fn"), options.get("hold_outputs", True)
    store_all = Schedule.store_all(problem.num_stages)
    slots = step_slots(problem.num_stages, plan.schedule)  # eager on the same axis: its recompute slots stay empty
    eager = predicted_timeline(problem, store_all, label="eager", budget_bytes=plan.budget_bytes, slots=slots)
    planned_tl = predicted_timeline(problem, plan.schedule, label="planned", budget_bytes=plan.budget_bytes,
                                    slots=slots)
    if not measure:
        return eager, planned_tl
    module = planned_module(captured, plan, plan.stage_nodes)
    eager = measure_timeline(eager, captured, captured.graph_module, plan.stage_nodes, store_all,
                             loss_fn=loss_fn, hold_outputs=hold_outputs)
    planned_tl = measure_timeline(planned_tl, captured, module, plan.stage_nodes, plan.schedule,
                                  loss_fn=loss_fn, hold_outputs=hold_outputs)
    return eager, planned_tl
