"""How true is the cost model? Predicted against measured peak memory and step-time overhead.

For each example model and several budgets (shares of the way from the smallest feasible peak to the eager peak),
plan, run the planned module, and measure its peak with the live-storage meter and its step time in interleaved
rounds (the median over rounds of each round's ratio: drifts in the machine's speed cancel). Prints one table.

The cost model predicts what recomputation adds to the captured graph's step, so the overhead it is held to is
measured against that graph run without checkpoints ("vs graph"). The captured graph itself runs a few percent
faster than the model as written (no module calls or hooks on the CPU), so the overhead a user sees against their
own model ("vs model") is smaller still; both are printed.

    python -m benchmarks.fidelity [--size test|demo] [--repeats 7] [--profile-repeats 3] [models...]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import torch

from examples.common import EXAMPLES, build_example
from planner import solvers
from planner.api import planned_module, pose_problem
from planner.budget import format_bytes
from planner.capture import capture
from planner.problem import Schedule, simulate

POINTS = (0.0, 0.25, 0.5, 0.75, 1.0)


def step_samples(example, modules: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each module's training step in ``repeats`` rounds, each round running every module once (after
    one warm-up round), so that a round's times are taken under the same load; each round starts one module later
    than the last, so that no module always runs right after the same other one."""
    samples: dict[str, list[float]] = {name: [] for name in modules}
    names = list(modules)
    for round_ in range(repeats + 1):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            seconds = example.step_seconds(modules[name])
            if round_:
                samples[name].append(seconds)
    return samples


def paired_overhead(samples: dict[str, list[float]], name: str, baseline: str) -> float:
    """The median over rounds of ``name``'s step time over ``baseline``'s in the same round, less one: drifts in
    the machine's speed between rounds cancel.

    >>> paired_overhead({"plan": [1.2, 2.4, 1.3], "graph": [1.0, 2.0, 1.0]}, "plan", "graph")
    0.2
    """
    return round(statistics.median(a / b for a, b in zip(samples[name], samples[baseline])) - 1, 12)


@dataclass(frozen=True)
class FidelityRow:
    """One plan of one model: its budget, predicted and measured peak, predicted and measured overheads."""

    model: str
    point: str
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_overhead: float
    overhead_vs_graph: float  # against the captured graph without checkpoints: what the cost model predicts
    overhead_vs_model: float  # against the model as written: what the user sees

    @property
    def peak_error(self) -> float:
        return self.predicted_peak_bytes / self.measured_peak_bytes - 1

    @property
    def overhead_error(self) -> float:
        return self.predicted_overhead / self.overhead_vs_graph - 1


def rows_for(name: str, size: str, repeats: int, profile_repeats: int = 3) -> list[FidelityRow]:
    example = build_example(name, size=size)
    captured = capture(example.model, example.example_inputs, example.example_kwargs)
    problem, stage_nodes = pose_problem(captured, loss_fn=example.loss_fn, hold_outputs=False,
                                        profile_repeats=profile_repeats)
    eager_peak = simulate(problem, Schedule.store_all(problem.num_stages)).peak_bytes
    smallest = solvers.minimum_peak(problem)
    plans = {}
    for point in POINTS:
        plan = solvers.solve(problem, int(smallest + point * (eager_peak - smallest)))
        plans[f"{point:.0%}"] = plan
    modules = {"model": example.model, "graph": captured.graph_module,
               **{k: planned_module(captured, p, stage_nodes) for k, p in plans.items()}}
    samples = step_samples(example, modules, repeats)
    rows = []
    for key, plan in plans.items():
        peak, _ = example.measured_step(modules[key])
        rows.append(FidelityRow(name, key, plan.budget_bytes, plan.predicted_peak_bytes, peak,
                                plan.predicted_overhead, paired_overhead(samples, key, "graph"),
                                paired_overhead(samples, key, "model")))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(EXAMPLES))
    parser.add_argument("--size", default="test", choices=["test", "demo"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile-repeats", type=int, default=3, help="the planner's own timing repeats")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, size {args.size}; budget points go from "
          f"the smallest feasible peak (0%) to the eager peak (100%)\n")
    header = (f"{'model':11s} {'point':>5s} {'budget':>10s} {'predicted':>10s} {'measured':>10s} {'error':>7s} "
              f"{'overhead pred':>13s} {'vs graph':>9s} {'vs model':>9s}")
    print(header)
    print("-" * len(header))
    worst_peak, worst_overhead = 0.0, 0.0
    for name in args.models:
        for row in rows_for(name, args.size, args.repeats, args.profile_repeats):
            worst_peak = max(worst_peak, abs(row.peak_error))
            if row.overhead_vs_graph > 0.05:
                worst_overhead = max(worst_overhead, abs(row.overhead_error))
            print(f"{row.model:11s} {row.point:>5s} {format_bytes(row.budget_bytes):>10s} "
                  f"{format_bytes(row.predicted_peak_bytes):>10s} {format_bytes(row.measured_peak_bytes):>10s} "
                  f"{row.peak_error:>+7.1%} {row.predicted_overhead:>13.1%} {row.overhead_vs_graph:>9.1%} "
                  f"{row.overhead_vs_model:>9.1%}")
    print(f"\nworst peak error {worst_peak:.1%}; worst relative overhead error {worst_overhead:.0%} "
          f"(predicted against measured vs graph, over plans whose measured overhead exceeds 5%)")


if __name__ == "__main__":
    main()
