"""Benchmarks against the alternatives, side by side in one run.

For each example model, every method runs one training step (forward + backward) and is measured: its peak memory,
its step time as a ratio to eager (per round of interleaved repeats, median and quartiles), and the time it took to
set up (planning, searching, compiling). Methods:

* ``eager``: no recomputation, the reference.
* ``uniform``: every block checkpointed, the way users do it: ``gradient_checkpointing_enable(use_reentrant=False)``
  on Hugging Face models, non-reentrant ``torch.utils.checkpoint`` around each block otherwise.
* ``prefix``: what a careful user does by hand: checkpoint the first k blocks, the smallest k whose measured peak
  fits the budget (found by measuring k = 0, 1, ...), at each budget of ``--budgets`` (shares of eager's peak).
* ``chen_sqrt``: Chen et al.'s sqrt(n) segments of whole blocks, run through the planner's rewrite.
* ``compile``: ``torch.compile`` (inductor, CPU) at each ``torch._functorch.config.activation_memory_budget`` of
  ``--compile-ratios``; that setting is a share of saved-activation bytes, so the peak it reaches is measured
  from the CPU allocator's profiler memory events (:func:`planner.meter.allocator_peak_bytes`).
* ``planner``: planned at each budget share, and at the measured peak of every other method (equal memory); against
  a compiled method, the plan is compiled the same way (``torch.compile`` of the planned module). Its stages are
  cut at ``--granularity`` (default ``block``, where each block's menu of caching options, dropout masks kept
  included, is solved exactly in seconds; ``sublayer`` lets checkpoints go around any module inside a block), each
  solve limited to ``--solve-seconds``. Its stages nest in the blocks, so ``chen_sqrt`` and the cost model's view of
  the hand placements are schedules of whole blocks over the same stages (one profile, one calibration).

Eager-mode peaks come from the live-storage meter (``Example.measured_step``), compiled peaks from the allocator;
both add parameters, buffers and inputs. Prints a Markdown table and a summary computed from it, and writes both to
``benchmarks/RESULTS.md`` with a description of the machine.

    python -m benchmarks.run [--models gpt2 bert] [--methods eager uniform planner] [--repeats 7]
                             [--size test|demo] [--budgets 0.5] [--compile-ratios 0.5 0.1] [--quick] [--out PATH]
                             [--granularity block|layer|sublayer] [--solve-seconds 15]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from examples.common import EXAMPLES, Example, build_example, hugging_face_checkpointing
from planner import solvers
from planner.api import planned_module, pose as pose_captured
from planner.budget import format_bytes
from planner.costmodel import Granularity
from planner.capture import capture
from planner.compiled import fit_plans
from planner.errors import InfeasibleBudgetError
from planner.meter import allocator_peak_bytes, storage_bytes
from planner.plan import Plan, SolverStatus
from planner.problem import Schedule
from planner.timing import Estimate, interleaved_rounds, keep_freed_memory, paired_ratios
from planner.solvers.baselines import block_checkpoints

METHODS = ("eager", "uniform", "prefix", "chen_sqrt", "compile", "planner")
HAND = ("uniform", "prefix", "chen_sqrt")  # block checkpoints placed by a rule or by hand
BUDGETS = (0.5,)
COMPILE_RATIOS = (0.5, 0.1)
HALF = 0.5
GRANULARITY = "block"
SOLVE_SECONDS = 15.0  # the solver's time limit per plan: the DP's plan of the first seconds is within 1% of later ones
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


@dataclass(frozen=True)
class Row:
    """One method on one model, measured.

    peak_bytes: measured peak of one step (None when the method could not run at all, see ``note``).
    budget_bytes: the budget the method was set up for (None for fixed rules).
    matches: for a planner row, the label of the row whose measured peak is its budget (or ``"50% of eager"``).
    time_ratio, ratio_low, ratio_high: step time over eager's in the same round: median and quartiles.
    fastest_ratio: the fastest step over eager's fastest (load on the machine only adds time).
    setup_seconds: planning (capture, profile, solve), searching or compiling before the first step.
    predicted_overhead, hand_predicted_overhead: for eager-mode planner rows, the cost model's overhead for the
    plan and for the best hand placement within the same budget (:func:`best_hand_overhead`).
    """

    model: str
    method: str
    setting: str
    compiled: bool
    peak_bytes: int | None
    budget_bytes: int | None
    matches: str
    time_ratio: float | None
    ratio_low: float | None
    ratio_high: float | None
    fastest_ratio: float | None
    setup_seconds: float
    note: str = ""
    seconds: tuple[float, ...] = ()  # the step's time in each round, for paired comparisons
    predicted_overhead: float | None = None  # planner rows: what the cost model predicted for the plan
    hand_predicted_overhead: float | None = None  # planner rows: best_hand_overhead at the same budget

    @property
    def label(self) -> str:
        return f"{self.method} ({self.setting})"

    @property
    def overhead(self) -> float | None:
        return None if self.time_ratio is None else self.time_ratio - 1


@dataclass(frozen=True)
class Candidate:
    """A method set up and ready to time: ``step()`` runs one forward + backward and clears the gradients."""

    method: str
    setting: str
    step: Callable[[], None] | None
    peak_bytes: int | None
    setup_seconds: float = 0.0
    compiled: bool = False
    budget_bytes: int | None = None
    matches: str = ""
    note: str = ""
    predicted_overhead: float | None = None
    hand_predicted_overhead: float | None = None

    @property
    def label(self) -> str:
        return f"{self.method} ({self.setting})"


# --------------------------------------------------------------------------- the methods


def step_of(example: Example, module: torch.nn.Module, owner: torch.nn.Module) -> Callable[[], None]:
    """One forward + backward of ``module``, whose parameters are ``owner``'s; gradients cleared afterwards."""
    def step() -> None:
        example.run(module).backward()
        owner.zero_grad(set_to_none=True)
    return step


def fixed_bytes(example: Example, owner: torch.nn.Module) -> int:
    """Parameters, buffers and inputs: what is alive before the step starts."""
    return storage_bytes(list(owner.parameters()) + list(owner.buffers())
                         + [t for t in example.example_inputs if isinstance(t, torch.Tensor)])


def eager_mode(example: Example, method: str, setting: str, module: torch.nn.Module, owner: torch.nn.Module,
               **fields) -> Candidate:
    """A candidate run without compiling, its peak measured with the live-storage meter."""
    peak, _ = dataclasses.replace(example, model=owner).measured_step(module)
    return Candidate(method, setting, step_of(example, module, owner), peak, **fields)


def inductor_at(ratio: float | None) -> Callable:
    """An inductor backend that partitions under ``activation_memory_budget=ratio`` (None: the default).

    Binding the setting to the backend, rather than to the global config, lets several compiled copies coexist
    (dynamo guards on the backend), so their steps can be timed interleaved.
    """
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        if ratio is None:
            return compile_fx(gm, example_inputs)
        with torch._functorch.config.patch(activation_memory_budget=ratio):
            return compile_fx(gm, example_inputs)
    return backend


def compiled(example: Example, method: str, setting: str, module: torch.nn.Module, owner: torch.nn.Module,
             ratio: float | None = None, setup_seconds: float = 0.0, **fields) -> Candidate:
    """``torch.compile(module)`` with inductor; the first step compiles; the peak comes from the allocator."""
    step = step_of(example, torch.compile(module, backend=inductor_at(ratio)), owner)
    start = time.perf_counter()
    step()
    setup_seconds += time.perf_counter() - start
    peak = fixed_bytes(example, owner) + allocator_peak_bytes(step)
    return Candidate(method, setting, step, peak, setup_seconds, compiled=True, **fields)


def is_hugging_face(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "supports_gradient_checkpointing", False))


def _checkpointed(forward: Callable) -> Callable:
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def first_blocks_checkpointed(example: Example, count: int) -> torch.nn.Module:
    """A copy of the model with its first ``count`` blocks each under non-reentrant ``torch.utils.checkpoint``."""
    model = copy.deepcopy(example.model)
    for block in list(model.get_submodule(example.block_path))[:count]:
        block.forward = _checkpointed(block.forward)
    return model


def uniform(example: Example) -> Candidate:
    """Every block checkpointed, as users do it for this kind of model."""
    if is_hugging_face(example.model):
        model = copy.deepcopy(example.model)
        hugging_face_checkpointing(model, True)
        setting = "every block: gradient_checkpointing_enable"
    else:
        model = first_blocks_checkpointed(example, len(example.blocks()))
        setting = "every block: torch.utils.checkpoint"
    return eager_mode(example, "uniform", setting, model, model)


def prefix(example: Example, budget: int, share: float) -> Candidate:
    """The first k blocks checkpointed, the smallest k whose measured peak fits ``budget``."""
    start = time.perf_counter()
    blocks = len(example.blocks())
    for count in range(blocks + 1):
        model = first_blocks_checkpointed(example, count)
        candidate = eager_mode(example, "prefix", f"first {count} of {blocks} blocks, {share:.0%} of eager", model,
                               model, budget_bytes=budget)
        if candidate.peak_bytes <= budget:
            return dataclasses.replace(candidate, setup_seconds=time.perf_counter() - start)
    return Candidate("prefix", f"{share:.0%} of eager", None, None, time.perf_counter() - start, budget_bytes=budget,
                     note=f"no prefix fits; all {blocks} blocks reach {format_bytes(candidate.peak_bytes)}")


@dataclass(frozen=True)
class Posed:
    """The planner's captured graph and problem for one model, and the seconds capture and profiling took."""

    example: Example
    captured: object
    problem: object
    stage_nodes: tuple
    seconds: float
    block_ranges: tuple | None = None  # the [start, stop) of each whole block's stages (see planner.api.Posed)

    def hand_schedules(self) -> list[Schedule]:
        """Block checkpoints as users place them, over this problem's stages: the first k blocks (k = 0 .. n),
        each its own region, and Chen's sqrt(n) segments of blocks (:func:`block_checkpoints`)."""
        return block_checkpoints(self.block_ranges or tuple((k, k + 1) for k in range(self.problem.num_stages)))


def pose(example: Example, profile_repeats: int, granularity: str = "block", compiled: bool = False) -> Posed:
    """Capture and profile ``example`` as the planner does, for eager steps or (``compiled``) compiled ones."""
    start = time.perf_counter()
    captured = capture(example.model, example.example_inputs, example.example_kwargs)
    posed = pose_captured(captured, loss_fn=example.loss_fn, hold_outputs=False, profile_repeats=profile_repeats,
                          granularity=granularity, compiled=compiled)
    return Posed(example, captured, posed.problem, posed.stage_nodes, time.perf_counter() - start,
                 posed.block_ranges)


def chen(posed: Posed) -> Candidate:
    """Chen's sqrt(n) segments of whole blocks, run by the planner's rewrite."""
    plan = Plan.from_schedule(posed.problem, posed.hand_schedules()[-1], solver="chen_sqrt",
                              status=SolverStatus.HEURISTIC)
    module = planned_module(posed.captured, plan, posed.stage_nodes)
    blocks = len(posed.block_ranges or posed.problem.stages)
    return eager_mode(posed.example, "chen_sqrt", f"{len(plan.schedule.regions)} checkpointed "
                      f"segment(s) of {blocks} block-level stages", module, posed.example.model)


def best_hand_overhead(posed: Posed, budget: int) -> float | None:
    """The cost model's overhead for the best hand placement of block checkpoints that fits ``budget``: the first
    blocks, each its own region (what a careful user does by hand, every block being uniform), or Chen's sqrt(n)
    segments (:meth:`Posed.hand_schedules`); None when none fits. The planner searches a superset of these
    schedules (its stages nest in the blocks), so its plan's prediction is never above this; how far below is what
    the schedule space offers on this machine.

    >>> from tests.solver_problems import random_chain
    >>> problem = random_chain(6, 1)
    >>> posed = Posed(None, None, problem, (), 0.0)
    >>> every = Plan.from_schedule(problem, Schedule.uniform(6), solver="", status=SolverStatus.HEURISTIC)
    >>> 0 < best_hand_overhead(posed, every.predicted_peak_bytes) <= every.predicted_overhead
    True
    >>> best_hand_overhead(posed, 1) is None
    True
    """
    plans = [Plan.from_schedule(posed.problem, s, solver="hand", status=SolverStatus.HEURISTIC)
             for s in posed.hand_schedules()]
    return min((p.predicted_overhead for p in plans if p.predicted_peak_bytes <= budget), default=None)


def planner_at(posed: Posed, budget: int, matches: str, compile_it: bool = False, *,
               solve_seconds: float | None = None) -> Candidate:
    """The planner's plan for ``budget`` (compiled when ``compile_it``); setup counts capture, profile and solve
    (each solve limited to ``solve_seconds``).

    Inductor fuses and reorders what the plan's peak was predicted for, so a compiled plan is measured and planned
    again by the search ``planner.optimize(..., compile=True)`` runs (:func:`planner.compiled.fit_plans`), its
    compiled candidates timed interleaved with the others; that time counts as setup too."""
    example, setting = posed.example, f"budget {format_bytes(budget)}"
    start = time.perf_counter()

    def solve(target: int) -> Plan:
        return solvers.solve(posed.problem, target, known=posed.hand_schedules(),
                             **({} if solve_seconds is None else {"time_limit": solve_seconds}))

    def measure(plan: Plan) -> tuple[int, Candidate]:
        found = compiled(example, "planner", setting, planned_module(posed.captured, plan, posed.stage_nodes),
                         example.model, budget_bytes=budget, matches=matches)
        return found.peak_bytes, found

    try:
        if not compile_it:
            plan = solve(budget)
            return eager_mode(example, "planner", setting, planned_module(posed.captured, plan, posed.stage_nodes),
                              example.model, setup_seconds=posed.seconds + time.perf_counter() - start,
                              budget_bytes=budget, matches=matches, predicted_overhead=plan.predicted_overhead,
                              hand_predicted_overhead=best_hand_overhead(posed, budget))
        fit = fit_plans(solve, measure, budget)
    except InfeasibleBudgetError as error:
        return Candidate("planner", setting, None, None, posed.seconds, compile_it, budget, matches,
                         note=f"infeasible: the smallest peak it plans is "
                              f"{format_bytes(error.minimum_budget_bytes or 0)}")
    kept = fit.kept or min(fit.tried, key=lambda m: m.peak_bytes)  # none fits: the least memory, shown over budget
    note = f"planned {fit.solves} times, {len(fit.tried)} compiled, measuring each peak" if fit.solves > 1 else ""
    return dataclasses.replace(kept.payload, setup_seconds=posed.seconds + time.perf_counter() - start, note=note)


def compile_settings(example: Example, ratios: Sequence[float]) -> list[Candidate]:
    """``torch.compile`` of a copy of the model at each activation memory budget."""
    out = []
    for ratio in ratios:
        model = copy.deepcopy(example.model)
        out.append(compiled(example, "compile", f"activation_memory_budget={ratio:g}", model, model, ratio))
    return out


# --------------------------------------------------------------------------- running and timing


@contextlib.contextmanager
def compile_config() -> Iterator[None]:
    """Compiled dropout draws what eager draws; no cached graphs (they would skip the partitioner); room for the
    several compiled copies of one model."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fallback_random=True, fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False), \
            torch._dynamo.config.patch(recompile_limit=64, cache_size_limit=64):
        try:
            yield
        finally:
            torch._dynamo.reset()


def candidates(example: Example, methods: Sequence[str], budgets: Sequence[float], ratios: Sequence[float],
               profile_repeats: int, log: Callable[[str], None], granularity: str = GRANULARITY,
               solve_seconds: float | None = SOLVE_SECONDS) -> list[Candidate]:
    """Set up every method on ``example``; planner candidates at each budget share and at every other peak."""
    model = example.model
    found = [eager_mode(example, "eager", "no recomputation", model, model)]
    eager_peak = found[0].peak_bytes
    posed = pose(example, profile_repeats, granularity) if {"planner", "chen_sqrt"} & set(methods) else None
    if posed is not None and posed.block_ranges is None:  # finer stages that do not nest in the blocks
        log(f"  {granularity} stages do not nest in the blocks: planning over whole blocks")
        granularity = "block"
        posed = pose(example, profile_repeats)
    if "uniform" in methods:
        found.append(uniform(example))
    if "prefix" in methods:
        found += [prefix(example, int(share * eager_peak), share) for share in budgets]
    if "chen_sqrt" in methods:
        found.append(chen(posed))
    if "compile" in methods:
        log(f"  compiling {len(ratios)} settings")
        found += compile_settings(example, ratios)
    if "planner" in methods:
        log("  planning")
        planned = functools.partial(planner_at, posed, solve_seconds=solve_seconds)
        found += [planned(int(share * eager_peak), f"{share:.0%} of eager") for share in budgets]
        others = [c for c in found if c.method != "planner" and c.method != "eager" and c.peak_bytes]
        found += [planned(c.peak_bytes, c.label) for c in others if not c.compiled]
        if any(c.compiled for c in others):  # compiled plans are priced without eager checkpointing's machinery
            compiled_posed = pose(example, profile_repeats, granularity, compiled=True)
            found += [planner_at(compiled_posed, c.peak_bytes, c.label, compile_it=True, solve_seconds=solve_seconds)
                      for c in others if c.compiled]
    return found


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    """Median and lower/upper quartiles (min/max below 4 samples)."""
    if len(samples) < 4:
        return statistics.median(samples), min(samples), max(samples)
    q = statistics.quantiles(samples, n=4)
    return statistics.median(samples), q[0], q[2]


def benchmark_model(name: str, *, size: str = "test", **options) -> list[Row]:
    """Every method on the registered example ``name`` at ``size``; see :func:`benchmark_example`."""
    return benchmark_example(build_example(name, size=size), **options)


def benchmark_example(example: Example, *, methods: Sequence[str] = METHODS, repeats: int = 7,
                      budgets: Sequence[float] = BUDGETS, ratios: Sequence[float] = COMPILE_RATIOS,
                      profile_repeats: int = 3, log: Callable[[str], None] = lambda line: None,
                      granularity: str = GRANULARITY, solve_seconds: float | None = SOLVE_SECONDS) -> list[Row]:
    """Every method on ``example``, measured and timed interleaved: one row each."""
    name = example.name
    with compile_config():
        found = candidates(example, methods, budgets, ratios, profile_repeats, log, granularity, solve_seconds)
        runnable = {i: c.step for i, c in enumerate(found) if c.step is not None}  # found[0] is eager
        log(f"  timing {len(runnable)} methods x {repeats} rounds")
        seconds = interleaved_rounds(runnable, repeats)
    rows = []
    for i, c in enumerate(found):
        median, low, high, fastest = (*quartiles(paired_ratios(seconds, i, 0)), min(seconds[i]) / min(seconds[0])) \
            if i in seconds else (None,) * 4
        rows.append(Row(name, c.method, c.setting, c.compiled, c.peak_bytes, c.budget_bytes, c.matches, median,
                        low, high, fastest, c.setup_seconds, c.note, tuple(seconds.get(i, ())),
                        c.predicted_overhead, c.hand_predicted_overhead))
    return rows


# --------------------------------------------------------------------------- reporting


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


def _ratio(row: Row) -> str:
    if row.time_ratio is None:
        return "-"
    return f"{row.time_ratio:.2f} [{row.ratio_low:.2f}-{row.ratio_high:.2f}]"


def table(rows: Sequence[Row]) -> str:
    """A Markdown table, one line per row."""
    eager = {r.model: r.peak_bytes for r in rows if r.method == "eager"}
    lines = ["| model | method | setting | compiled | budget MiB | peak MiB | peak / eager | time / eager, median "
             "[quartiles] | fastest / fastest eager | setup s | planned at the peak of | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = "-" if r.peak_bytes is None else f"{r.peak_bytes / eager[r.model]:.0%}"
        lines.append(f"| {r.model} | {r.method} | {r.setting} | {'yes' if r.compiled else 'no'} | "
                     f"{_mib(r.budget_bytes)} | {_mib(r.peak_bytes)} | {share} | {_ratio(r)} | "
                     f"{'-' if r.fastest_ratio is None else f'{r.fastest_ratio:.2f}'} | "
                     f"{r.setup_seconds:.1f} | {r.matches} | {r.note} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Comparison:
    """The planner against one method at that method's measured peak."""

    model: str
    baseline: Row
    planner: Row

    @property
    def reached(self) -> bool:
        """The planner's measured peak is within the baseline's."""
        return self.planner.peak_bytes is not None and self.planner.peak_bytes <= self.baseline.peak_bytes

    @property
    def held(self) -> bool:
        """The planner reached the memory, and the baseline is not measurably faster: the planner's step over the
        baseline's, paired round by round, has a median at most 1 or within two standard errors of it."""
        return self.reached and not self.paired_ratio.clearly_above(1)

    @property
    def paired_ratio(self) -> Estimate:
        """The median over rounds of the planner's step time over the baseline's in the same round, and its
        standard error (from the rounds' spread; infinite below three rounds).

        >>> row = lambda seconds: Row("m", "x", "", False, 1, 1, "", 1.0, 1.0, 1.0, 1.0, 0.0, seconds=seconds)
        >>> Comparison("m", row((1.0, 2.0, 1.0, 1.0)), row((1.1, 2.2, 1.1, 1.1))).paired_ratio
        Estimate(median=1.1, standard_error=0.0)
        """
        return Estimate.of(paired_ratios({"planner": self.planner.seconds, "baseline": self.baseline.seconds},
                                         "planner", "baseline"))

    @property
    def faster_by(self) -> float | None:
        """The planner's step time below the baseline's, as a share of the baseline's (paired by round)."""
        if self.planner.time_ratio is None:
            return None
        return 1 - self.paired_ratio.median

    @property
    def within_noise(self) -> bool:
        """Slower by the medians, but by less than two standard errors."""
        return self.paired_ratio.median > 1 and not self.paired_ratio.clearly_above(1)


def comparisons(rows: Sequence[Row]) -> list[Comparison]:
    """Every planner row planned at another row's measured peak, paired with that row."""
    by_label = {(r.model, r.label): r for r in rows}
    return [Comparison(r.model, by_label[(r.model, r.matches)], r) for r in rows
            if r.method == "planner" and (r.model, r.matches) in by_label]


def _faster_or_slower(share: float) -> str:
    return f"faster by {share:.1%}" if share >= 0 else f"SLOWER by {-share:.1%}"


def _describe(c: Comparison) -> str:
    b, p = c.baseline, c.planner
    if p.peak_bytes is None:
        return f"{b.label}: planner cannot reach {_mib(b.peak_bytes)} MiB ({p.note})"
    memory = (f"{_mib(p.peak_bytes)} vs {_mib(b.peak_bytes)} MiB"
              + ("" if p.peak_bytes <= b.peak_bytes else f", OVER by {p.peak_bytes / b.peak_bytes - 1:.1%}"))
    ratio = c.paired_ratio
    speed = (f"planner {_faster_or_slower(c.faster_by)} (paired per round: {ratio.median:.3f} ± "
             f"{ratio.standard_error:.3f}"
             f"{', within noise' if c.within_noise else ''}; {p.time_ratio:.2f}x vs {b.time_ratio:.2f}x eager; "
             f"fastest steps {p.fastest_ratio:.2f}x vs {b.fastest_ratio:.2f}x)")
    return f"{b.label}: {speed}; {memory}"


def half_budget_lines(rows: Sequence[Row]) -> list[str]:
    """Per model: the planner's overhead at half the eager peak against the best hand placement that fits."""
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        eager = next(r for r in mine if r.method == "eager").peak_bytes
        planned = next((r for r in mine if r.method == "planner" and r.matches == f"{HALF:.0%} of eager"), None)
        hand = [r for r in mine if r.method in HAND and r.peak_bytes is not None and r.peak_bytes <= HALF * eager
                and r.time_ratio is not None]
        if planned is None or planned.overhead is None:
            lowest = min((r for r in mine if r.method in HAND and r.peak_bytes), key=lambda r: r.peak_bytes,
                         default=None)
            reached = f"; the lowest hand placement, {lowest.label}, reaches {lowest.peak_bytes / eager:.0%}" \
                if lowest is not None else ""
            lines.append(f"- {model}: nothing compared: planner " + (planned.note if planned else "not run")
                         + f" ({HALF:.0%} of eager is {_mib(int(HALF * eager))} MiB){reached}")
            continue
        if not hand:
            lines.append(f"- {model}: planner overhead {planned.overhead:.1%}; no hand placement of block "
                         f"checkpoints fits {HALF:.0%} of eager (target met by default)")
            continue
        best = min(hand, key=lambda r: r.overhead)
        smaller = 1 - planned.overhead / best.overhead if best.overhead > 0 else float("-inf")
        relation = (f"{smaller:.0%} smaller" if smaller >= 0 else f"{-smaller:.0%} LARGER") \
            if best.overhead > 0 else "the hand placement measured no overhead"
        verdict = "met" if smaller >= 0.3 else f"MISSED by {0.3 - smaller:.0%} points" if best.overhead > 0 else \
            "MISSED"
        lines.append(f"- {model}: planner overhead {planned.overhead:.1%} (peak {_mib(planned.peak_bytes)} MiB) vs "
                     f"best hand placement {best.label} {best.overhead:.1%} (peak {_mib(best.peak_bytes)} MiB): "
                     f"{relation}; target (>= 30% smaller) {verdict}{_predicted_gap(planned)}")
    return lines


def _predicted_gap(planned: Row) -> str:
    """What the cost model expected of the planner's plan against the best hand placement in the same budget."""
    mine, hand = planned.predicted_overhead, planned.hand_predicted_overhead
    if mine is None or hand is None or hand <= 0:
        return ""
    return (f". The cost model predicted {mine:.1%} for the plan and {hand:.1%} for the best hand placement over "
            f"whole blocks ({1 - mine / hand:.0%} smaller): what the schedule space offers on this machine")


def summary(rows: Sequence[Row]) -> str:
    """The targets, judged from the rows."""
    pairs = comparisons(rows)
    lost = [c for c in pairs if not c.held]
    lines = ["### At equal memory (planner planned at each method's measured peak)", ""]
    for model in dict.fromkeys(c.model for c in pairs):
        mine = [c for c in pairs if c.model == model]
        worst = min((c for c in mine if c.faster_by is not None), key=lambda c: c.faster_by, default=None)
        head = f"- **{model}**" + (f": closest alternative {worst.baseline.label}, planner "
                                   f"{_faster_or_slower(worst.faster_by)}" if worst is not None else "")
        lines.append(head)
        lines += [f"  - {_describe(c)}" for c in mine]
    ties = [c for c in pairs if c.held and c.within_noise]
    verdict = ("met: no method is measurably faster than the planner at equal memory on any model" if not lost else
               f"MISSED in {len(lost)} of {len(pairs)} comparisons: "
               + "; ".join(f"{c.model} vs {c.baseline.label}" for c in lost))
    verdict += (f" ({len(ties)} of {len(pairs)} comparisons are slower by the medians but within two standard errors"
                f" of the paired ratio: {'; '.join(f'{c.model} vs {c.baseline.label}' for c in ties)})"
                if ties else "")
    lines += ["", f"Target 'no method faster than planner at equal memory': {verdict}.", "",
              f"### At {HALF:.0%} of the eager peak: planner against the best hand placement of block checkpoints",
              ""]
    lines += half_budget_lines(rows)
    over = [r for r in rows if r.method == "planner" and r.peak_bytes is not None and r.peak_bytes > r.budget_bytes]
    lines += ["", "Planner rows whose measured peak exceeds their budget: "
              + (", ".join(f"{r.model} {r.label} by {r.peak_bytes / r.budget_bytes - 1:.1%}" for r in over)
                 if over else "none") + "."]
    return "\n".join(lines)


PUBLISHED = """## Published figures (from the systems' papers and earlier runs; not rerun here)

| system | claim | source |
|---|---|---|
| Rockmate 2.0 (ICML 2023) | 2-5x less activation memory at 10-20% overhead | paper abstract |
| Rockmate on a 4-layer GPT, 2-core CPU, torch 2.13 | about 100 s to build a plan; measured memory exceeded its own plan by about 45% (13-15 MiB) at half budget | our earlier run (`../shared/anchors.md`) |
| MONeT | 3x less memory at 9-16% overhead | paper abstract |
| Chen et al. 2016 | O(sqrt(n)) memory for one extra forward (+30% time on a 1000-layer ResNet) | paper |
"""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; torch "
            f"{torch.__version__}, Python {platform.python_version()}; "
            f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; load average {load}")


READING = """How to read it: peaks of eager-mode rows come from the live-storage meter, those of compiled rows from
the CPU allocator's profiler memory events; both include parameters, buffers and inputs. A planner row is planned at
the budget in its row: half the eager peak, or the measured peak of the row named in "planned at the peak of" (equal
memory); against a compiled row, the plan is compiled the same way. Time ratios are per round of interleaved steps
(each step against eager's step in the same round): median and quartiles; "fastest" divides the fastest steps
(load on a shared machine only adds time). Setup is the planner's capture, profile and solve; the hand search's
measuring steps; or compilation. `chen_sqrt` runs through the planner's graph rewrite (Hugging Face models call their
layers in a Python loop, so segments of several layers cannot be wrapped by hand); `uniform` and `prefix` wrap blocks
with `torch.utils.checkpoint` (on ResNet this updates BatchNorm statistics twice, which the planner avoids)."""


def report(rows: Sequence[Row], header: str) -> str:
    return (f"# Benchmarks against the alternatives\n\n{header}\n\n## Measured\n\n{READING}\n\n{table(rows)}\n\n"
            f"## Summary\n\n{summary(rows)}\n\n{PUBLISHED}")


def add_heap_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heap", default="kept", choices=["kept", "glibc"],
                        help="kept (default): freed memory stays with the process between steps, see "
                             "keep_freed_memory; glibc: malloc's defaults, which give it back to the kernel")


def heap_setting(heap: str) -> str:
    """Apply the ``--heap`` choice and say, for the report's machine line, what the heap did."""
    if heap == "kept" and keep_freed_memory():
        return "freed memory kept between steps (glibc mallopt: no trimming, no mmap)"
    return "malloc's defaults"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(EXAMPLES), choices=list(EXAMPLES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--size", default="test", choices=["test", "demo"])
    parser.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS),
                        help="shares of the eager peak for the prefix and planner methods")
    parser.add_argument("--compile-ratios", nargs="*", type=float, default=list(COMPILE_RATIOS),
                        help="torch._functorch.config.activation_memory_budget values")
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument("--granularity", default=GRANULARITY, choices=[g.value for g in Granularity],
                        help="where the planner may cut stages (chen_sqrt and the hand placements use blocks)")
    parser.add_argument("--solve-seconds", type=float, default=SOLVE_SECONDS, help="the solver's limit per plan")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (1 steadies timings on a machine shared with other work)")
    add_heap_argument(parser)
    parser.add_argument("--quick", action="store_true",
                        help="smoke mode: largeblock, eager/uniform/planner, 1 round, nothing written")
    parser.add_argument("--out", default=None, help=f"where to write the report (default {OUT}; none with --quick)")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.methods, args.repeats, args.profile_repeats = ["largeblock"], ["eager", "uniform",
                                                                                        "planner"], 1, 1
        args.granularity = "block"
    if args.out is None and not args.quick:
        args.out = OUT
    if HALF not in args.budgets:
        args.budgets.append(HALF)  # the half-budget target needs it
    return args


def main(argv=None) -> list[Row]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    heap = heap_setting(args.heap)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    header = (f"Machine: {machine()}; heap: {heap}.\n\nSize `{args.size}`, {args.repeats} interleaved rounds (time "
              f"ratios are per round, against eager's step in the same round), budgets {args.budgets} of the eager "
              f"peak, activation_memory_budget {args.compile_ratios}, planner stages cut at granularity "
              f"`{args.granularity}`, each solve limited to {args.solve_seconds:g} s. Command: "
              f"`python -m benchmarks.run {' '.join(argv if argv is not None else sys.argv[1:])}`.")
    rows: list[Row] = []
    for name in args.models:
        log(f"{name}:")
        start = time.perf_counter()
        rows += benchmark_model(name, size=args.size, methods=args.methods, repeats=args.repeats,
                                budgets=args.budgets, ratios=args.compile_ratios,
                                profile_repeats=args.profile_repeats, log=log, granularity=args.granularity,
                                solve_seconds=args.solve_seconds)
        log(f"  {time.perf_counter() - start:.0f} s")
        if args.out:
            with open(args.out, "w") as f:  # after each model, so a long run leaves what it has
                f.write(report(rows, header))
    print(report(rows, header))
    return rows


if __name__ == "__main__":
    main()
