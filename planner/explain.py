"""What a plan keeps and what it recomputes, stage by stage, in the spirit of JAX's ``print_saved_residuals``.

>>> from planner.plan import Plan, SolverStatus
>>> from planner.problem import Problem, RecomputeOption, Region, Schedule, Stage, TensorInfo
>>> options = (RecomputeOption("all", frozenset(), 0.002), RecomputeOption("keep_mm", frozenset({"mm1"}), 0.0005))
>>> stages = tuple(Stage(f"layers.{i}", 0.002, 0.004, options=options) for i in range(3))
>>> tensors = tuple(t for i in range(3) for t in (
...     TensorInfo(f"h{i}", 16384, producer=i, savers=frozenset({i}), node=f"mm{i}"),
...     TensorInfo(f"x{i}", 4096, producer=i, consumers=frozenset({i + 1} if i < 2 else ()),
...                savers=frozenset({i + 1} if i < 2 else ()), node=f"out{i}")))
>>> problem = Problem(stages, tensors, fixed_bytes=10_000)
>>> plan = Plan.from_schedule(problem, Schedule((Region(0, 2, (0, 1)),)), solver="ilp",
...                           status=SolverStatus.OPTIMAL, gap=0.0)
>>> print(explain(plan, show_nodes=True, show_tensors=True))
plan by ilp (optimal): 2 of 3 stages recomputed in 1 region(s)
stage     decision                                kept (plan)  kept (eager)  recompute
--------  --------------------------------------  -----------  ------------  ---------
layers.0  recomputed in region 0                          0 B     16.00 KiB    2.00 ms
    recomputed     16.00 KiB  h0
    recomputed      4.00 KiB  x0
    recomputing frees 20.00 KiB between the forward and the backward
layers.1  recomputed in region 0, caching 1 node    16.00 KiB     20.00 KiB   500.0 us
    caches mm1
    cached         16.00 KiB  h1
    kept            4.00 KiB  x1
layers.2  stored                                    20.00 KiB     20.00 KiB          0
    kept           16.00 KiB  h2
--------  --------------------------------------  -----------  ------------  ---------
total     2 of 3 recomputed                         36.00 KiB     56.00 KiB    2.50 ms
predicted peak 49.77 KiB (76% of eager 65.77 KiB), +13.9% step time
kept: bytes a stage holds from its forward for its backward; a checkpoint region's inputs count for its first
stage, and a tensor that two stages save counts for both. recompute: what the stage's forward costs again;
a region's first stage also counts what the region's checkpoint costs itself; the last stage of a region with no
cached node re-runs only up to its last op that saves a tensor, and that of a region with one counts what caching
costs the region.
tensors: listed under the stage that makes them, largest first, with the module and the time of the op that
makes them; a region input is held by the checkpoint of a later region that reads it; cached ones are held,
and the recomputation takes them instead of remaking them.
"""

from __future__ import annotations

from typing import Any

from .budget import format_bytes
from .errors import PlannerError
from .plan import Plan, StageSummary, TensorFate, TensorSummary

__all__ = ["explain", "format_seconds"]

_COLUMNS = ("stage", "decision", "kept (plan)", "kept (eager)", "recompute")
_RIGHT = (False, False, True, True, True)
_NOTE = ("kept: bytes a stage holds from its forward for its backward; a checkpoint region's inputs count for its "
         "first\nstage, and a tensor that two stages save counts for both. recompute: what the stage's forward "
         "costs again;\na region's first stage also counts what the region's checkpoint costs itself; the "
         "last stage of a region with no\ncached node re-runs only up to its last op that saves a tensor, and "
         "that of a region with one counts what caching\ncosts the region.")
_FATE_WIDTH = max(len(f.value) for f in TensorFate)
_TENSOR_NOTE = ("tensors: listed under the stage that makes them, largest first, with the module and the time of "
                "the op that\nmakes them; a region input is held by the checkpoint of a later region that reads it; "
                "cached ones are held,\nand the recomputation takes them instead of remaking them.")


def format_seconds(seconds: float | None) -> str:
    """A duration as people read it: ``"0"``, ``"12.0 us"``, ``"3.40 ms"``, ``"1.25 s"``; ``"?"`` for None.

    >>> [format_seconds(s) for s in (0.0, 1.2e-5, 0.0034, 1.25, None)]
    ['0', '12.0 us', '3.40 ms', '1.25 s', '?']
    """
    if seconds is None:
        return "?"
    if seconds == 0:
        return "0"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _bytes(nbytes: int | None) -> str:
    return "?" if nbytes is None else format_bytes(nbytes)


def _region_of(plan: Plan) -> list[int | None]:
    owner: list[int | None] = [None] * len(plan.stage_names)
    for i, r in enumerate(plan.regions):
        for k in range(r.start, min(r.stop, len(owner))):
            owner[k] = i
    return owner


def _decision(region: int | None, summary: StageSummary | None) -> str:
    if region is None:
        return "stored"
    cached = len(summary.cached_nodes) if summary else 0
    caching = f", caching {cached} node{'s' if cached != 1 else ''}" if cached else ""
    return f"recomputed in region {region}{caching}"


def _stage_row(plan: Plan, k: int, region: int | None) -> tuple[str, ...]:
    summary = plan.stage_summaries[k] if plan.stage_summaries else None
    if summary is None:
        return (plan.stage_names[k], _decision(region, None), "?", "?", "?")
    return (summary.name, _decision(region, summary), _bytes(summary.saved_bytes_planned),
            _bytes(summary.saved_bytes_eager), format_seconds(summary.recompute_seconds))


def _total_row(plan: Plan) -> tuple[str, ...]:
    summaries = plan.stage_summaries
    recomputed = f"{len(plan.recomputed_stage_names)} of {len(plan.stage_names)} recomputed"
    if not summaries:
        return ("total", recomputed, "?", "?", format_seconds(plan.predicted_recompute_seconds))
    planned = [s.saved_bytes_planned for s in summaries]
    kept = None if None in planned else sum(planned)
    return ("total", recomputed, _bytes(kept), _bytes(sum(s.saved_bytes_eager for s in summaries)),
            format_seconds(plan.predicted_recompute_seconds))


def _once_a_step(plan: Plan) -> list[str]:
    """A line for what the total counts beside the stages: checkpointing's cost once a step
    (``Problem.per_step_seconds``), when the plan has one.

    >>> from planner.plan import SolverStatus
    >>> from planner.problem import Problem, Schedule, Stage
    >>> problem = Problem((Stage("a", 0.001, 0.002),), (), per_step_seconds=0.0002)
    >>> _once_a_step(Plan.from_schedule(problem, Schedule.uniform(1), solver="uniform", status=SolverStatus.HEURISTIC))
    ['the total also counts 200.0 us that checkpointing costs once a step, whichever stages it recomputes']
    """
    if not plan.stage_summaries:
        return []
    once = plan.predicted_recompute_seconds - sum(s.recompute_seconds for s in plan.stage_summaries)
    if once <= 1e-9 * max(plan.predicted_recompute_seconds, 1e-9):
        return []
    return [f"the total also counts {format_seconds(once)} that checkpointing costs once a step, whichever stages "
            "it recomputes"]


def _table(rows: list[tuple[str, ...]], totals: tuple[str, ...]) -> list[str]:
    widths = [max(len(row[i]) for row in [_COLUMNS, *rows, totals]) for i in range(len(_COLUMNS))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if right else c.ljust(w)
                         for c, w, right in zip(cells, widths, _RIGHT)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    header = "  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths)).rstrip()
    return [header, rule, *map(line, rows), rule, line(totals)]


def _prediction(plan: Plan) -> str:
    share = plan.predicted_peak_bytes / max(plan.eager_peak_bytes, 1)
    budget = f" within a budget of {format_bytes(plan.budget_bytes)}" if plan.budget_bytes else ""
    compiled = (f"; compiled, its step measured {format_bytes(plan.compiled_peak_bytes)}"
                if plan.compiled_peak_bytes is not None else "")
    return (f"predicted peak {format_bytes(plan.predicted_peak_bytes)} ({share:.0%} of eager "
            f"{format_bytes(plan.eager_peak_bytes)}){budget}, +{plan.predicted_overhead:.1%} step time{compiled}")


def _the_plan(given: Any) -> Plan:
    """``given`` if it is a plan, else the plan it holds (the module :func:`planner.optimize` returned, or a model
    planned with ``in_place=True``, whose forward holds that module)."""
    if isinstance(given, Plan):
        return given
    installed = getattr(getattr(given, "forward", None), "optimized", None)
    held = getattr(given if installed is None else installed, "plan", None)
    if not isinstance(held, Plan):
        raise PlannerError(f"explain takes a Plan, the module planner.optimize returned or a model planned in "
                           f"place, not a {type(given).__name__}",
                           hint="pass opt.plan, or Plan.from_json(text) for a saved plan")
    return held


def explain(plan: Plan, *, show_nodes: bool = False, show_tensors: bool = False) -> str:
    """A table of what each stage keeps for the backward and what it recomputes under ``plan``.

    Parameters
    ----------
    plan : a plan, made by a solver or read with :meth:`Plan.from_json <planner.plan.Plan.from_json>`, the
        module :func:`planner.optimize` returned (its last plan), or a model it planned with ``in_place=True``.
    show_nodes : also list, under each recomputed stage, the graph nodes whose outputs it caches.
    show_tensors : also list, under each stage, the tensors it makes that eager training holds for the backward
        (or that a region holds as its input), largest first: kept, region input, cached or recomputed, their
        bytes, and the module and time of the op that makes each; then, for a stage that recomputes any, the bytes
        recomputing them frees (the stage's row has the time it costs).

    Returns
    -------
    str
        One row per stage (name; ``stored``, ``recomputed in region i`` or ``recomputed in region i, caching N
        nodes``; bytes kept for the backward under the plan and in eager mode; recompute time), the totals, and
        the predicted peak and overhead. Plans without stage summaries show ``?`` for the numbers.

    Examples
    --------
    >>> from planner.plan import Plan, SolverStatus
    >>> from planner.problem import Problem, Schedule, Stage, TensorInfo
    >>> problem = Problem((Stage("a", 0.001, 0.002), Stage("b", 0.001, 0.002)),
    ...                   (TensorInfo("x", 2048, producer=0, consumers=frozenset({1}), savers=frozenset({0, 1})),))
    >>> text = explain(Plan.from_schedule(problem, Schedule.uniform(2), solver="uniform",
    ...                                   status=SolverStatus.HEURISTIC))
    >>> print(text.splitlines()[4])
    b      recomputed in region 1     2.00 KiB      2.00 KiB    1.00 ms
    """
    plan = _the_plan(plan)
    owner = _region_of(plan)
    rows = [_stage_row(plan, k, owner[k]) for k in range(len(plan.stage_names))]
    lines = [f"plan by {plan.solver} ({plan.status.value}): {len(plan.recomputed_stage_names)} of "
             f"{len(plan.stage_names)} stages recomputed in {len(plan.regions)} region(s)"]
    if plan.reused_from:
        lines.append(f"reusing the plan for larger inputs ({plan.reused_from}): its bytes and times below are upper "
                     f"bounds for these")
    table = _table(rows, _total_row(plan))
    if show_nodes or show_tensors:
        table = _with_details(table, plan, nodes=show_nodes, tensors=show_tensors)
    notes = [_NOTE, _TENSOR_NOTE] if show_tensors and plan.tensor_summaries else [_NOTE]
    return "\n".join([*lines, *table, _prediction(plan), *_once_a_step(plan), *notes])


def _tensor_lines(plan: Plan, stage: int) -> list[str]:
    tensors = sorted((t for t in plan.tensor_summaries if t.stage == stage), key=lambda t: (-t.nbytes, t.name))
    lines = [f"    {t.fate.value:{_FATE_WIDTH}s}  {format_bytes(t.nbytes):>10s}  {t.name}{_made_by(t)}" for t in tensors]
    freed = sum(t.nbytes for t in tensors if t.fate is TensorFate.RECOMPUTED)
    if freed:
        lines.append(f"    recomputing frees {format_bytes(freed)} between the forward and the backward")
    return lines


def _made_by(tensor: TensorSummary) -> str:
    """Where ``tensor`` comes from, when the plan recorded it: the module whose op makes it, and the op's time.

    >>> _made_by(TensorSummary("relu#3", "relu", 0, 64, TensorFate.RECOMPUTED, 1.2e-5, "layers.0.act"))
    '  (layers.0.act, op 12.0 us)'
    >>> _made_by(TensorSummary("h", "mm", 0, 64, TensorFate.KEPT))
    ''
    """
    where = [tensor.module_path] if tensor.module_path else []
    if tensor.seconds:
        where.append(f"op {format_seconds(tensor.seconds)}")
    return f"  ({', '.join(where)})" if where else ""


def _with_details(table: list[str], plan: Plan, *, nodes: bool, tensors: bool) -> list[str]:
    """``table`` with, under each stage's row, the nodes it caches and the tensors it makes."""
    n = len(plan.stage_names)
    out = table[:2]
    for k, line in enumerate(table[2:2 + n]):
        out.append(line)
        summary = plan.stage_summaries[k] if plan.stage_summaries else None
        if nodes and summary is not None and summary.cached_nodes:
            out.append(f"    caches {', '.join(summary.cached_nodes)}")
        if tensors:
            out += _tensor_lines(plan, k)
    return out + table[2 + n:]
