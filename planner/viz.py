"""Pictures: where the memory of a training step goes, and what a plan changes. Needs matplotlib
(``pip install planner[viz]``), imported only when a picture is drawn.

* :func:`plot_timeline`: memory over one step (forward, then backward), eager and planned, predicted by the
  execution model and measured op by op, with the budget as a line and each peak marked
  (data: :func:`planner.timeline.step_timelines`);
* :func:`plot_frontier`: peak memory against step-time overhead for the planner, uniform checkpointing, Chen's
  sqrt(n) and ``torch.compile``'s activation memory budget (data: :mod:`planner.frontier`);
* :func:`plot_stages`: one cell per stage (per layer, for transformers) coloured by the plan's decision, with the
  checkpoint regions bracketed (data: :func:`stage_decisions`).

Each function draws on ``ax`` when given one, else on a new figure, and returns the figure.

>>> import matplotlib
>>> matplotlib.use("Agg")
>>> from planner.plan import Plan, SolverStatus
>>> from planner.problem import Problem, Region, Schedule, Stage, TensorInfo
>>> stages = tuple(Stage(f"h.{i}", 1.0, 2.0) for i in range(4))
>>> tensors = tuple(TensorInfo(f"t{i}", 100, producer=i, consumers=frozenset({i + 1}) if i < 3 else frozenset(),
...                            savers=frozenset({i, i + 1}) if i < 3 else frozenset({i})) for i in range(4))
>>> problem = Problem(stages, tensors, fixed_bytes=1000)
>>> plan = Plan.from_schedule(problem, Schedule((Region(0, 2),)), solver="dp", status=SolverStatus.OPTIMAL)
>>> [(d.name, d.decision.value, d.region) for d in stage_decisions(plan)]
[('h.0', 'recomputed', 0), ('h.1', 'recomputed', 0), ('h.2', 'kept', None), ('h.3', 'kept', None)]
>>> figure = plot_stages(plan)
>>> [p.get_label() for p in figure.axes[0].patches if p.get_label()][:2]
['h.0: recomputed', 'h.1: recomputed']
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from .budget import format_bytes
from .errors import PlannerError
from .frontier import FrontierPoint, Method
from .plan import Plan
from .problem import Phase
from .timeline import StepTimeline

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Decision", "StageDecision", "stage_decisions", "plot_timeline", "plot_frontier", "plot_stages"]

COLORS = {"eager": "#7f7f7f", "planned": "#1f77b4", "budget": "#d62728"}
DECISION_COLORS = {"kept": "#9ecae1", "recomputed": "#fdae6b", "cached": "#74c476"}
METHOD_STYLES = {Method.EAGER: ("#7f7f7f", "s"), Method.UNIFORM: ("#ff7f0e", "^"), Method.CHEN_SQRT: ("#9467bd", "D"),
                 Method.PLANNER: ("#1f77b4", "o"), Method.TORCH_COMPILE: ("#2ca02c", "v")}


def _matplotlib() -> Any:
    try:
        import matplotlib
        import matplotlib.figure  # noqa: F401
    except ImportError as exc:
        raise PlannerError("planner's pictures need matplotlib, which is not installed",
                           hint="pip install planner[viz]") from exc
    return matplotlib


def _axes(ax: "Axes | None", figsize: tuple[float, float]) -> "Axes":
    if ax is not None:
        return ax
    figure = _matplotlib().figure.Figure(figsize=figsize, layout="constrained")
    return figure.add_subplot()


def _mib(nbytes: float) -> float:
    return nbytes / 2**20


# --- timeline ----------------------------------------------------------------------------------------------------

def _steps(points) -> tuple[list[float], list[float]]:
    """Each point as a flat step over its width; a gap (an empty slot) breaks the line."""
    xs, ys = [], []
    for p in points:
        if xs and p.x > xs[-1] + 1e-9:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs += [p.x, p.x + p.width]
        ys += [_mib(p.total_bytes)] * 2
    return xs, ys


def _midpoints(points) -> tuple[list[float], list[float]]:
    """Each point at the middle of its width; an empty slot between two points breaks the line."""
    xs, ys, end = [], [], None
    for p in points:
        if end is not None and p.x > end + 1e-9 and int(p.x) > int(end):
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(p.x + p.width / 2)
        ys.append(_mib(p.total_bytes))
        end = p.x + p.width
    return xs, ys


def _draw_timeline(ax: "Axes", timeline: StepTimeline, color: str) -> None:
    xs, ys = _steps(timeline.predicted)
    ax.plot(xs, ys, color=color, linestyle="--", linewidth=1.5, label=f"{timeline.label} predicted")
    peak = timeline.predicted_peak
    ax.plot([peak.x + peak.width / 2], [_mib(peak.total_bytes)], marker="v", color=color, markersize=8,
            linestyle="none")
    ax.annotate(f"{format_bytes(peak.total_bytes)}", (peak.x + peak.width / 2, _mib(peak.total_bytes)),
                textcoords="offset points", xytext=(4, 8), color=color, fontsize=8)
    if timeline.measured:
        xs, ys = _midpoints(timeline.measured)
        ax.plot(xs, ys, color=color, linewidth=0.8, alpha=0.8, label=f"{timeline.label} measured")
        top = timeline.measured_peak
        ax.plot([top.x + top.width / 2], [_mib(top.total_bytes)], marker="*", color=color, markersize=10,
                linestyle="none")


def _slot_axis(ax: "Axes", timeline: StepTimeline) -> None:
    slots = timeline.slots
    backward_from = next((i for i, s in enumerate(slots) if s.phase is not Phase.FORWARD), len(slots))
    ax.axvline(backward_from, color="black", linewidth=0.6)
    for i, s in enumerate(slots):
        if s.phase is Phase.RECOMPUTE:
            ax.axvspan(i, i + 1, color=DECISION_COLORS["recomputed"], alpha=0.25, linewidth=0)
    step = max(1, len(slots) // 16)
    ax.set_xticks([i + 0.5 for i in range(0, len(slots), step)])
    ax.set_xticklabels([f"{s.phase.value[0].upper()}{s.stage}" for s in slots[::step]], fontsize=7)
    ax.set_xlim(0, len(slots))
    ax.set_xlabel("forward (F) then backward (B) per stage; R: a region recomputed (shaded)")


def plot_timeline(timelines: Sequence[StepTimeline], *, ax: "Axes | None" = None, title: str | None = None) -> "Figure":
    """Memory over one training step for each timeline (typically eager and planned).

    Dashed: the execution model's prediction per stage and phase (▼ its peak); solid: the bytes alive after
    every op of a real step (★ its peak); red: the budget. The x axis is the step's slots: the forward of each
    stage, then, last stage first, each region's recomputation and each stage's backward (see
    :func:`planner.timeline.step_slots`); measured ops are spread evenly across the slot they ran in.

    Parameters
    ----------
    timelines : from :func:`planner.timeline.step_timelines` (eager, planned) or
        :func:`planner.timeline.predicted_timeline`. Their slots should agree when they share a plot; the
        first one's label the x axis.
    ax : a matplotlib ``Axes`` to draw on; by default a new figure.
    title : the axes title; by default the peaks, predicted and measured.

    Returns
    -------
    matplotlib.figure.Figure

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> from planner.problem import Problem, Schedule, Stage, TensorInfo
    >>> from planner.timeline import predicted_timeline
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(3))
    >>> tensors = tuple(TensorInfo(f"t{i}", 2**20, producer=i, savers=frozenset({i})) for i in range(3))
    >>> problem = Problem(stages, tensors, fixed_bytes=2**20)
    >>> eager = predicted_timeline(problem, Schedule.store_all(3), label="eager", budget_bytes=3 * 2**20)
    >>> planned = predicted_timeline(problem, Schedule.uniform(3), label="planned", budget_bytes=3 * 2**20)
    >>> figure = plot_timeline([eager, planned])
    >>> [line.get_label() for line in figure.axes[0].get_lines() if not line.get_label().startswith("_")]
    ['eager predicted', 'planned predicted', 'budget 3.00 MiB']
    """
    if not timelines:
        raise PlannerError("plot_timeline needs at least one timeline", hint="pass step_timelines(optimized)")
    ax = _axes(ax, (9, 4))
    palette = [COLORS.get(t.label, f"C{i}") for i, t in enumerate(timelines)]
    for timeline, color in zip(timelines, palette):
        _draw_timeline(ax, timeline, color)
    budget = next((t.budget_bytes for t in timelines if t.budget_bytes), None)
    if budget:
        ax.axhline(_mib(budget), color=COLORS["budget"], linewidth=1.2, label=f"budget {format_bytes(budget)}")
    _slot_axis(ax, timelines[0])
    ax.set_ylabel("memory in use (MiB)")
    top = max(max(p.total_bytes for p in [*t.predicted, *t.measured]) for t in timelines)
    ax.set_ylim(0, 1.15 * _mib(max(top, budget or 0)))
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.set_title(title if title is not None else _timeline_title(timelines), fontsize=9)
    return ax.figure


def _timeline_title(timelines: Sequence[StepTimeline]) -> str:
    parts = []
    for t in timelines:
        measured = f", measured {format_bytes(t.measured_peak_bytes)}" if t.measured else ""
        parts.append(f"{t.label}: predicted peak {format_bytes(t.predicted_peak_bytes)}{measured}")
    return "; ".join(parts)


# --- frontier ----------------------------------------------------------------------------------------------------

def plot_frontier(points: Sequence[FrontierPoint], *, ax: "Axes | None" = None,
                  budget_bytes: int | None = None) -> "Figure":
    """Peak memory (x) against extra step time (y), one series per method; hollow markers are measured.

    The planner's points are joined as a staircase: the least overhead it predicts within a given memory.
    ``torch.compile`` points are labelled with their ``activation_memory_budget``.

    Parameters
    ----------
    points : from :func:`planner.frontier.planner_frontier` and :func:`planner.frontier.compile_frontier`.
    ax : a matplotlib ``Axes`` to draw on; by default a new figure.
    budget_bytes : draw this budget as a vertical line.

    Returns
    -------
    matplotlib.figure.Figure

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> from planner.frontier import FrontierPoint, Method
    >>> figure = plot_frontier([FrontierPoint(Method.EAGER, "store all", 2**22, 0.0),
    ...                         FrontierPoint(Method.PLANNER, "budget 2 MiB", 2**21, 0.1),
    ...                         FrontierPoint(Method.PLANNER, "budget 3 MiB", 3 * 2**20, 0.02)])
    >>> [(line.get_label(), [float(x) for x in line.get_xdata()]) for line in figure.axes[0].get_lines()]
    [('eager', [4.0]), ('planner', [2.0, 3.0])]
    """
    if not points:
        raise PlannerError("plot_frontier needs at least one point", hint="pass planner_frontier(problem)")
    ax = _axes(ax, (6, 4))
    for method in Method:
        series = sorted((p for p in points if p.method is method), key=lambda p: p.peak_bytes)
        if not series:
            continue
        color, marker = METHOD_STYLES[method]
        measured = all(p.measured for p in series)
        ax.plot([_mib(p.peak_bytes) for p in series], [100 * p.overhead for p in series], marker=marker,
                color=color, label=method.value + (" (measured)" if measured else ""),
                markerfacecolor="white" if measured else color, drawstyle="steps-post",
                linestyle="-" if method is Method.PLANNER else "none")
        if method is Method.TORCH_COMPILE:
            for p in series:
                ax.annotate(p.setting.split("=")[-1], (_mib(p.peak_bytes), 100 * p.overhead), fontsize=7,
                            textcoords="offset points", xytext=(4, -10), color=color)
    if budget_bytes:
        ax.axvline(_mib(budget_bytes), color=COLORS["budget"], linewidth=1, linestyle=":")
    ax.set_xlabel("peak memory of one step (MiB)")
    ax.set_ylabel("extra step time (%)")
    ax.set_ylim(bottom=min(0.0, min(100 * p.overhead for p in points) - 2))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax.figure


# --- per-stage strip ---------------------------------------------------------------------------------------------

class Decision(enum.Enum):
    KEPT = "kept"  # stored: autograd keeps what its backward needs
    RECOMPUTED = "recomputed"  # inside a checkpoint region, recomputed entirely
    CACHED = "cached"  # inside a region, some of its nodes' outputs cached (selective checkpointing)


@dataclass(frozen=True)
class StageDecision:
    """What ``plan`` does with one stage; byte counts come from the plan's stage summaries (None without)."""

    stage: int
    name: str
    decision: Decision
    region: int | None
    cached_nodes: tuple[str, ...] = ()
    saved_bytes_eager: int | None = None
    saved_bytes_planned: int | None = None


def stage_decisions(plan: Plan) -> tuple[StageDecision, ...]:
    """One :class:`StageDecision` per stage of ``plan``, in order."""
    owner: list[int | None] = [None] * len(plan.stage_names)
    for i, r in enumerate(plan.regions):
        for k in range(r.start, r.stop):
            owner[k] = i
    decisions = []
    for k, name in enumerate(plan.stage_names):
        summary = plan.stage_summaries[k] if plan.stage_summaries else None
        cached = summary.cached_nodes if summary and owner[k] is not None else ()
        decision = Decision.KEPT if owner[k] is None else Decision.CACHED if cached else Decision.RECOMPUTED
        decisions.append(StageDecision(k, name, decision, owner[k], cached,
                                       summary.saved_bytes_eager if summary else None,
                                       summary.saved_bytes_planned if summary else None))
    return tuple(decisions)


def plot_stages(plan: Plan, *, ax: "Axes | None" = None) -> "Figure":
    """A strip of one cell per stage coloured by decision (kept, recomputed, recomputed with some outputs cached),
    a bracket over each checkpoint region, and, when the plan records them, bars of the bytes each stage keeps
    for its backward, eager (grey outline) and planned (filled).

    Parameters
    ----------
    plan : any plan (from :func:`planner.optimize`'s ``.plan``, a solver, or JSON).
    ax : a matplotlib ``Axes`` to draw on; by default a new figure.

    Returns
    -------
    matplotlib.figure.Figure

    Examples
    --------
    See the module's example.
    """
    decisions = stage_decisions(plan)
    ax = _axes(ax, (max(6.0, 0.35 * len(decisions) + 2), 3))
    rects = _matplotlib().patches
    kept = [d.saved_bytes_planned for d in decisions]
    eager = [d.saved_bytes_eager for d in decisions]
    scale = max([b for b in eager + kept if b] or [1])
    for d in decisions:
        ax.add_patch(rects.Rectangle((d.stage, -0.35), 0.9, 0.3, color=DECISION_COLORS[d.decision.value],
                                     label=f"{d.name}: {d.decision.value}"))
        if d.saved_bytes_eager is not None:
            ax.add_patch(rects.Rectangle((d.stage + 0.1, 0), 0.7, d.saved_bytes_eager / scale, fill=False,
                                         edgecolor=COLORS["eager"], linewidth=0.8))
        if d.saved_bytes_planned is not None:
            ax.add_patch(rects.Rectangle((d.stage + 0.1, 0), 0.7, d.saved_bytes_planned / scale,
                                         color=DECISION_COLORS[d.decision.value]))
    for i, r in enumerate(plan.regions):
        ax.plot([r.start, r.start, r.stop - 0.1, r.stop - 0.1], [-0.4, -0.45, -0.45, -0.4], color="black",
                linewidth=1.2)
        ax.text((r.start + r.stop - 0.1) / 2, -0.55, f"region {i}", ha="center", va="top", fontsize=7)
    _stage_axis(ax, decisions, scale)
    return ax.figure


def _stage_axis(ax: "Axes", decisions: Sequence[StageDecision], scale: int) -> None:
    rects = _matplotlib().patches
    ax.set_xlim(-0.2, len(decisions) + 0.1)
    ax.set_ylim(-0.75, 1.1)
    step = max(1, len(decisions) // 24)
    ax.set_xticks([d.stage + 0.45 for d in decisions[::step]])
    ax.set_xticklabels([d.name for d in decisions[::step]], rotation=60, ha="right", fontsize=7)
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["0", format_bytes(scale)], fontsize=7)
    ax.set_ylabel("kept for backward", fontsize=8)
    handles = [rects.Patch(color=c, label=name) for name, c in DECISION_COLORS.items()]
    handles.append(rects.Patch(fill=False, edgecolor=COLORS["eager"], label="kept in eager"))
    ax.legend(handles=handles, fontsize=7, ncol=4, loc="upper right")
