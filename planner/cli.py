"""The ``planner`` command: plan a model from a factory, explain a plan file, sweep budgets against the baselines.

.. code-block:: text

    planner plan model.py:build --budget 8GB -o plan.json     # or package.module:build; --json prints the plan
    planner plan model.py:build --budget 8GB --compile        # the budget holds for the torch.compile'd step
    planner plan model.py:build --budget 8GB --compile-mode max-autotune    # compiled with that mode
    planner explain plan.json
    planner sweep model.py:build --budgets 30%,50%,70%,100% --csv sweep.csv --png sweep.png

``build()`` returns ``(model, example_inputs)`` or ``(model, example_inputs, example_kwargs)``. Progress goes to
stderr (``--quiet`` silences it), results to stdout. Exit status: 0 done; 2 usage error (bad arguments, a missing
file or factory, a factory that raises, a model that does not capture, a malformed plan file); 3 infeasible budget
(the message names the smallest budget that works); 1 for an unexpected failure, whose traceback ``--traceback``
shows. Every error is one line on stderr: ``planner: error: ...``.

>>> main(["explain", "no/such/plan.json"])
2
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import importlib
import importlib.util
import io
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TextIO

import torch

from . import __version__, solvers
from .api import (Posed, _compile_options, _plan_captured, allocator_margin_for, capture_for, captured_device_type,
                  device_budget, fingerprint, pose)
from .attention import without_unmasking_mask
from .budget import Budget, format_bytes, format_bytes_apart, parse_budget
from .devices import device_spec
from .capture import CapturedGraph
from .costmodel import Granularity
from .errors import InfeasibleBudgetError, PlannerError
from .explain import explain
from .plan import Plan, budget_for_usable, usable_bytes
from .problem import Problem, Schedule, simulate
from .solvers.baselines import BASELINES

EXIT_OK, EXIT_USAGE, EXIT_INFEASIBLE = 0, 2, 3
SWEEP_METHODS = (("planner", "auto"), ("uniform", "uniform"), ("chen_sqrt", "chen_sqrt"),
                 ("fewest_blocks", "fewest_blocks"))
_FACTORY_HINT = "FACTORY() must return (model, example_inputs) or (model, example_inputs, example_kwargs)"


# --- progress -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Progress:
    """Announces each step on ``stream`` (``planner: profiling ... done in 1.2 s``); silent when not ``enabled``."""

    enabled: bool = True
    stream: TextIO | None = None  # None: sys.stderr at the time of writing

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Report ``what`` as it starts and how long it took (or that it failed) as it ends.

        >>> out = io.StringIO()
        >>> with Progress(stream=out).step("thinking"):
        ...     pass
        >>> out.getvalue().startswith("planner: thinking ... done in ")
        True
        """
        started = time.perf_counter()
        self.note(f"{what} ...", end="")
        try:
            yield
        except BaseException:
            self.note(" failed", prefix="")
            raise
        self.note(f" done in {time.perf_counter() - started:.1f} s", prefix="")

    def note(self, text: str, *, end: str = "\n", prefix: str = "planner: ") -> None:
        """Write one message (not an error) unless silenced."""
        if self.enabled:
            stream = self.stream or sys.stderr
            stream.write(f"{prefix}{text}{end}")
            stream.flush()


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Keep torch's own diagnostics off stderr: log warnings, the partial graph export prints on failure, and what
    its C++ side writes to file descriptor 2 (the profiler's start and stop lines, in some builds).

    >>> with quiet_torch():
    ...     print("lost", file=sys.stderr)
    """
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
        logger.setLevel(level)


# --- loading the model ----------------------------------------------------------------------------------------
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise PlannerError(f"no such file: {path}", hint="give the model as FILE.py:FACTORY")
    name = f"_planner_factory_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PlannerError(f"cannot import {path}", hint="give a Python file, FILE.py:FACTORY")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # the file may import its neighbours
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        raise PlannerError(f"importing {path} failed: {_first_line(exc)}") from None
    return module


def _import_module(name: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise PlannerError(f"no module named {name!r}",
                               hint="give FILE.py:FACTORY or an importable package.module:FACTORY") from None
        raise PlannerError(f"importing {name} failed: {_first_line(exc)}") from None
    except (Exception, SystemExit) as exc:
        raise PlannerError(f"importing {name} failed: {_first_line(exc)}") from None


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by ``FILE.py:FACTORY`` or ``package.module:FACTORY``.

    >>> load_factory("planner.budget:parse_budget").__name__
    'parse_budget'
    >>> load_factory("planner.budget:nothing_here")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    planner.errors.PlannerError: planner.budget has no factory 'nothing_here'. Hint: ...
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise PlannerError(f"model {spec!r} is not FILE.py:FACTORY or package.module:FACTORY",
                           hint="for example model.py:build")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    module = _import_file(Path(target)) if is_file else _import_module(target)
    factory: Any = module
    for part in name.split("."):
        factory = getattr(factory, part, None)
    if factory is None or not callable(factory):
        what = "no factory" if factory is None else "a non-callable"
        raise PlannerError(f"{target} has {what} {name!r}",
                           hint="give MODULE:FACTORY with a callable FACTORY defined there")
    return factory


def build_model(spec: str) -> tuple[torch.nn.Module, tuple, dict]:
    """Call the factory ``spec`` names and check that it returned ``(model, inputs[, kwargs])``."""
    factory = load_factory(spec)
    try:
        made = factory()
    except (Exception, SystemExit) as exc:
        raise PlannerError(f"factory {spec} raised {_first_line(exc)}") from None
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        raise PlannerError(f"factory {spec} returned {type(made).__name__}", hint=_FACTORY_HINT)
    model, inputs, kwargs = (*made, None)[:3]
    if not isinstance(model, torch.nn.Module):
        raise PlannerError(f"factory {spec} returned a {type(model).__name__} as the model", hint=_FACTORY_HINT)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise PlannerError(f"factory {spec} returned a {type(kwargs).__name__} as example_kwargs",
                           hint=_FACTORY_HINT)
    return model, inputs if isinstance(inputs, tuple) else (inputs,), dict(kwargs or {})


# --- posing the problem once ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Session:
    """A model captured and profiled once: everything needed to plan it under any budget."""

    model: torch.nn.Module
    captured: CapturedGraph
    posed: Posed  # the problem, its stages' nodes, where its times came from and where the stages were cut
    eager_peak_bytes: int
    allocator_margin: float = 0.0
    solver_options: dict = dataclasses.field(default_factory=dict)  # time limit and progress for auto, dp, ilp

    @property
    def problem(self) -> Problem:
        return self.posed.problem

    @property
    def stage_nodes(self) -> tuple[tuple[str, ...], ...]:
        return self.posed.stage_nodes

    @property
    def timing(self) -> str:
        return self.posed.timing

    @property
    def granularity(self) -> Granularity:
        return self.posed.granularity

    def usable(self, budget_bytes: int) -> int:
        """What a plan may use of ``budget_bytes``: the budget less the allocator margin."""
        return usable_bytes(budget_bytes, self.allocator_margin)

    def options_for(self, method: str) -> dict:
        """The solver options ``method`` takes: time limit and progress for auto and dp, the time limit for ilp."""
        options = self.solver_options if method in ("auto", "dp", "ilp") else {}
        return {k: v for k, v in options.items() if k == "time_limit"} if method == "ilp" else options

    def solve(self, budget: Budget, method: str) -> Plan:
        """Plan under ``budget`` with ``method`` and record where the plan comes from."""
        budget_bytes = budget.resolve(self.eager_peak_bytes)
        plan = solvers.solve(self.problem, self.usable(budget_bytes), method=method, **self.options_for(method))
        first = next(self.model.parameters(), None)
        return dataclasses.replace(plan, budget_bytes=budget_bytes, budget_text=budget.text,
                                   stage_nodes=self.stage_nodes, fingerprint=fingerprint(self.captured),
                                   torch_version=torch.__version__,
                                   device=first.device.type if first is not None else "cpu", timing=self.timing,
                                   allocator_margin=self.allocator_margin,
                                   extra=plan.extra + self.granularity.plan_extra)

    def solve_compiled(self, budget: Budget, method: str, compile_options: dict) -> Plan:
        """Plan under ``budget`` for the compiled step, as ``planner.optimize(..., compile=compile_options)``
        does: each plan is compiled with ``torch.compile(**compile_options)`` and one step measured
        (:mod:`planner.compiled`)."""
        return _plan_captured(self.model, self.captured, budget, loss_fn=None, optimizer=None, solver=method,
                              max_stages=self.problem.num_stages, profile_repeats=0,
                              solver_options=self.options_for(method), allocator_margin=self.allocator_margin,
                              posed=self.posed, granularity=self.granularity, compile=compile_options).plan


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_arguments(args: argparse.Namespace) -> dict | None:
    """``torch.compile``'s keyword arguments that ``--compile`` and ``--compile-mode`` ask to plan under, or None
    for the eager step.

    >>> compile_arguments(argparse.Namespace(compile=True, compile_mode=None))
    {}
    >>> compile_arguments(argparse.Namespace(compile=False, compile_mode="max-autotune"))
    {'mode': 'max-autotune'}
    >>> compile_arguments(argparse.Namespace()) is None  # a command without the options
    True
    """
    mode = getattr(args, "compile_mode", None)
    if mode is not None:
        return {"mode": mode}
    return {} if getattr(args, "compile", False) else None


def open_session(args: argparse.Namespace, progress: Progress) -> Session:
    """Build the model from ``args.model``, capture it and profile it."""
    with progress.step(f"building the model from {args.model}"):
        model, inputs, kwargs = build_model(args.model)
    with progress.step(f"capturing {type(model).__name__}"), quiet_torch():
        captured = capture_for(model, inputs, without_unmasking_mask(model, kwargs), args.device)  # as apply()
    timed = f"analytic times for {args.device}" if args.device else f"{args.profile_repeats} timed run(s)"
    with progress.step(f"profiling ({timed})"), quiet_torch():
        posed = pose(captured, max_stages=args.max_stages, profile_repeats=args.profile_repeats, device=args.device,
                     granularity=args.granularity, compiled=compile_arguments(args) is not None)
    problem = posed.problem
    eager = simulate(problem, Schedule.store_all(problem.num_stages)).peak_bytes
    margin = allocator_margin_for(args.allocator_margin, device_spec(args.device) if args.device else None,
                                  captured_device_type(captured))
    progress.note(f"{problem.num_stages} stages, eager peak {format_bytes(eager)}"
                  + (f"; plans leave {margin:.0%} of the budget to the allocator" if margin else ""))
    options: dict = {"time_limit": args.time_limit}
    if args.solver_progress and progress.enabled:
        options["progress"] = lambda line: progress.note(line)
    return Session(model, captured, posed, eager, margin, options)


def _infeasible(budget: Budget, budget_bytes: int, minimum: int | None, why: str) -> InfeasibleBudgetError:
    smallest = (f"the smallest feasible budget is {format_bytes(minimum)} ({minimum} bytes): rerun with "
                f"--budget {minimum} or more" if minimum is not None else "no smaller peak is known")
    budget_text = format_bytes_apart(budget_bytes, minimum)[0] if minimum is not None else format_bytes(budget_bytes)
    return InfeasibleBudgetError(f"budget {budget.text!r} ({budget_text}) cannot be met: {why}; "
                                 f"{smallest}", minimum_budget_bytes=minimum)


# --- commands -------------------------------------------------------------------------------------------------
def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise PlannerError(f"cannot write {path}: {exc.strerror or exc}") from None


def run_plan(args: argparse.Namespace, progress: Progress) -> int:
    """``planner plan``: print the plan's summary (or its JSON with ``--json``), write it with ``-o``."""
    if args.budget is None and args.device is None:
        raise PlannerError("--budget is required unless --device names the GPU whose memory to plan for",
                           hint="e.g. --budget 8GB, --budget 60%, or --device h100")
    if args.budget is not None:
        parse_budget(args.budget)  # a malformed budget fails before the model is built
    compile_options = compile_arguments(args)
    if compile_options is not None:
        _compile_options(compile_options, args.device)  # not with --device: nothing runs there to measure
    session = open_session(args, progress)
    budget = device_budget(args.budget, device_spec(args.device) if args.device else None,
                           captured_device_type(session.captured))
    budget_bytes = budget.resolve(session.eager_peak_bytes)
    if compile_options is not None:
        with progress.step(f"solving for {format_bytes(session.usable(budget_bytes))} with {args.solver} under "
                           f"torch.compile, measuring each compiled plan"), quiet_torch():
            plan = session.solve_compiled(budget, args.solver, compile_options)
        progress.note(f"compiled step measured {format_bytes(plan.compiled_peak_bytes)}")
        return _print_plan(plan, args, progress)
    with progress.step(f"solving for {format_bytes(session.usable(budget_bytes))} with {args.solver}"):
        try:
            plan = session.solve(budget, args.solver)
        except InfeasibleBudgetError as exc:
            why = (f"no {args.solver} plan fits" if args.solver in BASELINES
                   else "it is below the smallest peak any plan reaches")
            minimum = exc.minimum_budget_bytes
            if minimum is not None and session.allocator_margin:
                minimum = budget_for_usable(minimum, session.allocator_margin)
            raise _infeasible(budget, budget_bytes, minimum, why) from None
    if plan.predicted_peak_bytes > session.usable(budget_bytes):
        raise _infeasible(budget, budget_bytes, plan.predicted_peak_bytes,
                          f"the {plan.solver} rule peaks at {format_bytes(plan.predicted_peak_bytes)}")
    return _print_plan(plan, args, progress)


def _print_plan(plan: Plan, args: argparse.Namespace, progress: Progress) -> int:
    if args.output:
        _write(args.output, plan.to_json() + "\n")
        progress.note(f"wrote {args.output}")
    print(plan.to_json() if args.json else plan.summary())
    return EXIT_OK


def read_plan(path: str) -> Plan:
    """Read and validate a plan file; every problem is a :class:`PlannerError` naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlannerError(f"cannot read plan {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return Plan.from_json(text)
    except PlannerError as exc:
        raise PlannerError(f"{path}: {exc.message}", hint=exc.hint) from None


def run_explain(args: argparse.Namespace, progress: Progress) -> int:
    """``planner explain``: the stage table of a plan file (with ``--nodes``/``--tensors``, what each caches and
    what becomes of each tensor)."""
    print(explain(read_plan(args.plan), show_nodes=args.nodes, show_tensors=args.tensors))
    return EXIT_OK


@dataclass(frozen=True)
class SweepRow:
    """One budget and one method; ``predicted_*`` are None when the method's plan does not fit the budget."""

    budget: str
    budget_bytes: int
    method: str
    solver: str
    status: str | None
    predicted_peak_bytes: int | None
    predicted_overhead: float | None

    @property
    def cell(self) -> str:
        if self.predicted_peak_bytes is None or self.predicted_overhead is None:
            return "-"
        return f"{format_bytes(self.predicted_peak_bytes)} +{self.predicted_overhead:.1%}"


def sweep_row(session: Session, budget: Budget, label: str, method: str) -> tuple[SweepRow, int | None]:
    """Solve one cell of the sweep; also return the smallest feasible peak when the budget is infeasible."""
    budget_bytes = budget.resolve(session.eager_peak_bytes)
    try:
        plan = solvers.solve(session.problem, session.usable(budget_bytes), method=method)
    except InfeasibleBudgetError as exc:
        return SweepRow(budget.text, budget_bytes, label, method, None, None, None), exc.minimum_budget_bytes
    if plan.predicted_peak_bytes > session.usable(budget_bytes):
        return SweepRow(budget.text, budget_bytes, label, plan.solver, None, None, None), None
    return SweepRow(budget.text, budget_bytes, label, plan.solver, plan.status.value, plan.predicted_peak_bytes,
                    plan.predicted_overhead), None


def sweep_table(rows: Sequence[SweepRow]) -> str:
    """Budgets down, methods across, each cell ``peak +overhead`` or ``-``."""
    methods = list(dict.fromkeys(r.method for r in rows))
    budgets = list(dict.fromkeys((r.budget, r.budget_bytes) for r in rows))
    cells = {(r.budget, r.method): r.cell for r in rows}
    table = [["budget", *methods]] + [[f"{text} ({format_bytes(nbytes)})", *(cells[text, m] for m in methods)]
                                      for text, nbytes in budgets]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table)


def write_csv(path: str, rows: Sequence[SweepRow]) -> None:
    """The sweep as CSV, one line per budget and method; empty peak and overhead where the plan does not fit."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[f.name for f in dataclasses.fields(SweepRow)], lineterminator="\n")
    writer.writeheader()
    writer.writerows(dataclasses.asdict(r) for r in rows)
    _write(path, out.getvalue())


def write_png(path: str, rows: Sequence[SweepRow], progress: Progress) -> None:
    """Predicted overhead against budget, one line per method; skipped with a message without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress.note(f"skipped {path}: matplotlib is not installed (pip install matplotlib)")
        return
    figure, axes = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r.method for r in rows):
        fit = [r for r in rows if r.method == method and r.predicted_overhead is not None]
        axes.plot([r.budget_bytes / 2**20 for r in fit], [100 * r.predicted_overhead for r in fit], "o-",
                  label=method)
    axes.set(xlabel="budget (MiB)", ylabel="predicted overhead (% of step time)",
             title="recomputation overhead by budget")
    axes.legend()
    try:
        figure.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as exc:
        raise PlannerError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)
    progress.note(f"wrote {path}")


def parse_budgets(text: str) -> list[Budget]:
    """``"30%,50%,8GB"`` as budgets.

    >>> [b.text for b in parse_budgets("30%, 1GB,")]
    ['30%', '1GB']
    """
    budgets = [parse_budget(part.strip()) for part in text.split(",") if part.strip()]
    if not budgets:
        raise PlannerError(f"--budgets {text!r} names no budget", hint="write e.g. --budgets 30%,50%,70%,100%")
    return budgets


def run_sweep(args: argparse.Namespace, progress: Progress) -> int:
    """``planner sweep``: profile once, then plan every budget with the planner and each baseline."""
    budgets = parse_budgets(args.budgets)
    session = open_session(args, progress)
    rows, minima = [], set()
    with progress.step(f"solving {len(budgets)} budget(s) x {len(SWEEP_METHODS)} methods"):
        for budget in budgets:
            for label, method in SWEEP_METHODS:
                row, minimum = sweep_row(session, budget, label, method)
                rows.append(row)
                if method == "auto" and minimum is not None:
                    minima.add(minimum)
    if args.csv:
        write_csv(args.csv, rows)
        progress.note(f"wrote {args.csv}")
    if args.png:
        write_png(args.png, rows, progress)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
        return EXIT_OK
    print(f"{type(session.model).__name__}: {session.problem.num_stages} stages, eager peak "
          f"{format_bytes(session.eager_peak_bytes)}; each cell: predicted peak +overhead, '-' when it does not fit")
    print(sweep_table(rows))
    if minima:
        print(f"smallest feasible budget: {format_bytes(min(minima))} ({min(minima)} bytes)")
    return EXIT_OK


# --- arguments ------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """Reports bad arguments as a :class:`PlannerError` (one line, exit status 2) instead of usage text."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise PlannerError(message, hint=f"see '{self.prog} --help'")


def _common(model: bool) -> _Parser:
    parent = _Parser(add_help=False)
    parent.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    parent.add_argument("--traceback", action="store_true", help="show the traceback of unexpected errors")
    if model:
        parent.add_argument("model", metavar="FILE.py:FACTORY",
                            help="FACTORY() returns (model, example_inputs[, example_kwargs]); "
                                 "package.module:FACTORY works too")
        parent.add_argument("--profile-repeats", type=int, default=3, metavar="N", help="timed profiling runs")
        parent.add_argument("--max-stages", type=int, default=64, metavar="N", help="cut the model into at most N")
        parent.add_argument("--granularity", choices=[g.value for g in Granularity], default="block",
                            help="where checkpoints may go: around whole blocks (default), their layers "
                                 "(attention, MLP, norms) or the layers' modules; finer solves slower")
        parent.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
        parent.add_argument("--device", metavar="GPU", type=_device_name,
                            help="plan for this GPU (h100, h200, a100, l4, rtx4090) with its roofline times; "
                                 "how a model built on the meta device is planned")
        parent.add_argument("--allocator-margin", type=float, metavar="SHARE",
                            help="share of the budget left to the CUDA allocator (default 0.05 for a GPU, else 0)")
        parent.add_argument("--time-limit", type=float, default=60.0, metavar="SECONDS",
                            help="most seconds a solve may take; then the best plan and its proven gap (default 60)")
        parent.add_argument("--solver-progress", action="store_true",
                            help="print the solver's progress (stage by stage) on stderr")
    return parent


def _device_name(text: str) -> str:
    return device_spec(text).name  # an unknown name is a usage error naming the known ones


def build_parser() -> argparse.ArgumentParser:
    """The ``planner`` argument parser with its three commands."""
    parser = _Parser(prog="planner", description="Plan activation checkpointing for PyTorch under a memory budget.")
    parser.add_argument("--version", action="version", version=f"planner {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{plan,explain,sweep}")
    plan = commands.add_parser("plan", parents=[_common(True)], help="plan a model under a budget")
    plan.add_argument("--budget", help="8GB, 512MiB, an int of bytes or 60%% of the eager peak; "
                                       "with --device, all of its memory when left out")
    plan.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan here")
    plan.add_argument("--solver", default="auto", choices=solvers.METHODS)
    plan.add_argument("--compile", action="store_true",
                      help="fit the budget for the step under torch.compile: each plan is compiled and measured")
    plan.add_argument("--compile-mode", choices=COMPILE_MODES, default=None,
                      help="torch.compile's mode for --compile (implies it)")
    plan.set_defaults(run=run_plan)
    show = commands.add_parser("explain", parents=[_common(False)], help="what a plan keeps and recomputes")
    show.add_argument("plan", metavar="PLAN.json")
    show.add_argument("--nodes", action="store_true", help="list the cached nodes of each stage")
    show.add_argument("--tensors", action="store_true",
                      help="list each stage's tensors held for the backward: kept, region input, cached or recomputed")
    show.set_defaults(run=run_explain)
    sweep = commands.add_parser("sweep", parents=[_common(True)], help="compare the planner with the baselines")
    sweep.add_argument("--budgets", required=True, help="comma-separated, e.g. 30%%,50%%,70%%,100%%")
    sweep.add_argument("--csv", metavar="OUT.csv", help="write the table as CSV")
    sweep.add_argument("--png", metavar="OUT.png", help="plot overhead against budget (needs matplotlib)")
    sweep.set_defaults(run=run_sweep)
    return parser


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"planner: error: {' '.join(message.split())}\n")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``planner`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        return _dispatch(argv)


def _dispatch(argv: Sequence[str] | None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "profile_repeats", 1) < 1 or getattr(args, "max_stages", 1) < 1:
            raise PlannerError("--profile-repeats and --max-stages must be at least 1")
        return args.run(args, Progress(enabled=not args.quiet))
    except InfeasibleBudgetError as exc:
        return _fail(str(exc), EXIT_INFEASIBLE)
    except PlannerError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:  # stdout closed early (``planner sweep ... | head``): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        if args is not None and getattr(args, "traceback", False):
            raise
        return _fail(f"unexpected {_first_line(exc)} (rerun with --traceback for details)", 1)
