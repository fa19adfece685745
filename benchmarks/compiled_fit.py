"""Does the budget hold once the step is compiled? ``torch.compile(planner.optimize(...))`` against
``planner.optimize(..., compile=True)`` on the example models.

Each is measured through the allocator (the CPU allocator's profiler events; on a GPU, ``max_memory_allocated``),
with parameters, buffers and inputs, and timed against ``torch.compile(model)`` in interleaved rounds, each in an
order drawn afresh. The plan wrapped by ``torch.compile`` was made for eager steps: inductor's own schedule can hold
more than it predicts. ``compile=True`` compiles and measures each plan and plans again until one fits
(:mod:`planner.compiled`), pricing recomputation without eager checkpointing's machinery (:func:`planner.api.pose`).

    python -m benchmarks.compiled_fit --threads 1 --out benchmarks/COMPILED.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import torch

import planner
from benchmarks.run import compile_config, fixed_bytes, heap_setting, add_heap_argument, machine, step_of
from examples.common import EXAMPLES, Example, build_example
from planner.errors import PlannerError
from planner.meter import device_allocator_peak_bytes
from planner.timing import interleaved_rounds, median_standard_error, paired_ratios

CASES = (("bert", 0.40), ("gpt2", 0.50), ("llama", 0.40), ("resnet", 0.70), ("unet", 0.60), ("largeblock", 0.70))


@dataclass(frozen=True)
class FitRow:
    """One model at one budget: the compiled model's peak, the eager plan compiled and the plan fitted compiled,
    their steps against the compiled model's (median of paired rounds, with its standard error)."""

    model: str
    budget_text: str
    budget_bytes: int
    compiled_model_peak_bytes: int
    wrapped_peak_bytes: int
    fitted_peak_bytes: int
    wrapped_ratio: float
    wrapped_error: float
    fitted_ratio: float
    fitted_error: float
    plans_compiled: int
    planning_seconds: float

    def verdict(self, peak: int) -> str:
        """How ``peak`` stands against the budget.

        >>> row = FitRow("m", "50%", 100, 200, 120, 97, 1.0, 0.0, 1.1, 0.0, 2, 1.0)
        >>> row.verdict(row.wrapped_peak_bytes), row.verdict(row.fitted_peak_bytes)
        ('over by 20.0%', 'fits, 3.0% under')
        """
        share = peak / self.budget_bytes - 1
        return f"over by {share:.1%}" if share > 0 else f"fits, {-share:.1%} under"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def measure(example: Example, share: float, rounds: int, profile_repeats: int) -> FitRow:
    """``example`` at ``share`` of its eager peak: both ways of compiling a plan, measured and timed."""
    name, model, device_type = example.name, example.model, next(example.model.parameters()).device.type
    budget = f"{share:.0%}"
    options = dict(example_kwargs=example.example_kwargs, loss_fn=example.loss_fn, profile_repeats=profile_repeats,
                   hold_outputs=False)  # the example's step drops the outputs once it has the loss
    wrapped = torch.compile(planner.optimize(model, budget, example.example_inputs, **options))
    start = time.perf_counter()
    fitted = planner.optimize(model, budget, example.example_inputs, compile=True, **options)
    planning = time.perf_counter() - start
    steps = {"compiled model": step_of(example, torch.compile(model), model),
             "wrapped": step_of(example, wrapped, model), "fitted": step_of(example, fitted, model)}
    fixed = fixed_bytes(example, model)
    peaks = {}
    for key, step in steps.items():
        step()  # compiles
        peaks[key] = fixed + device_allocator_peak_bytes(step, device_type)
    seconds = interleaved_rounds(steps, rounds)
    ratios = {key: paired_ratios(seconds, key, "compiled model") for key in ("wrapped", "fitted")}
    extra = dict(fitted.plan.extra)
    return FitRow(name, budget, fitted.plan.budget_bytes, peaks["compiled model"], peaks["wrapped"], peaks["fitted"],
                  statistics.median(ratios["wrapped"]), median_standard_error(ratios["wrapped"]),
                  statistics.median(ratios["fitted"]), median_standard_error(ratios["fitted"]),
                  extra["compiled_plans_measured"], planning)


def table(rows: Sequence[FitRow]) -> str:
    """The report's table: one line per model and budget."""
    lines = ["| model, budget | `torch.compile(model)` | `torch.compile(optimize(...))` | "
             "`optimize(..., compile=True)` | plans compiled, planning |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.model}, {r.budget_text} = {_mib(r.budget_bytes)} | {_mib(r.compiled_model_peak_bytes)} | "
            f"{_mib(r.wrapped_peak_bytes)} ({r.verdict(r.wrapped_peak_bytes)}), {r.wrapped_ratio:.2f}x "
            f"± {r.wrapped_error:.2f} | {_mib(r.fitted_peak_bytes)} ({r.verdict(r.fitted_peak_bytes)}), "
            f"{r.fitted_ratio:.2f}x ± {r.fitted_error:.2f} | {r.plans_compiled}, {r.planning_seconds:.0f} s |")
    return "\n".join(lines)


def parse_cases(texts: Sequence[str]) -> list[tuple[str, float]]:
    """``model:share`` pairs.

    >>> parse_cases(["bert:0.4", "resnet:0.7"])
    [('bert', 0.4), ('resnet', 0.7)]
    """
    cases = []
    for text in texts:
        name, _, share = text.partition(":")
        if name not in EXAMPLES or not share:
            raise SystemExit(f"--cases takes model:share with a model of {sorted(EXAMPLES)}, not {text!r}")
        cases.append((name, float(share)))
    return cases


def main(argv: Sequence[str] | None = None) -> list[FitRow]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=[f"{n}:{s}" for n, s in CASES],
                        help="model:share of its eager peak, e.g. bert:0.4")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved timing rounds")
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    add_heap_argument(parser)
    parser.add_argument("--out", default=None, help="where to write the report (default: print it)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    heap = heap_setting(args.heap)
    rows, failures = [], []
    with compile_config():
        for name, share in parse_cases(args.cases):
            print(f"{name} at {share:.0%}", file=sys.stderr, flush=True)
            try:
                rows.append(measure(build_example(name, size="test"), share, args.rounds, args.profile_repeats))
            except PlannerError as error:  # an infeasible budget: say so, and measure the other cases
                failures.append(f"- {name} at {share:.0%}: {error}")
            torch._dynamo.reset()
    command = " ".join(argv if argv is not None else sys.argv[1:])
    report = (f"# The budget under torch.compile\n\nMachine: {machine()}; heap: {heap}. Test size, "
              f"{args.rounds} interleaved rounds; peaks through the allocator with parameters, buffers and inputs; "
              f"step times over `torch.compile(model)`'s in the same round, median ± its standard error. Command: "
              f"`python -m benchmarks.compiled_fit {command}`.\n\n{table(rows)}\n"
              + "".join(f"\n{line}" for line in failures) + ("\n" if failures else ""))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report)
    print(report)
    return rows


if __name__ == "__main__":
    main()
