"""How true is the cost model? Predicted against measured peak memory and step-time overhead.

For each example model and several budgets (shares of the way from the smallest feasible peak to the eager peak),
plan, run the planned module, and measure its peak with the live-storage meter and its step time against eager
with interleaved repeats (fastest of the repeats: load on the machine only adds time). Prints one table.

    python -m benchmarks.fidelity [--size test|demo] [--repeats 7] [models...]
"""

from __future__ import annotations

import argparse

import torch

from examples.common import EXAMPLES, build_example
from planner import solvers
from planner.api import planned_module, pose_problem
from planner.budget import format_bytes
from planner.capture import capture
from planner.problem import Schedule, simulate

POINTS = (0.0, 0.25, 0.5, 0.75, 1.0)


def fastest_steps(example, modules: dict, repeats: int) -> dict[str, float]:
    best = {name: float("inf") for name in modules}
    for _ in range(repeats):
        for name, module in modules.items():
            best[name] = min(best[name], example.step_seconds(module))
    return best


def rows_for(name: str, size: str, repeats: int) -> list[tuple]:
    example = build_example(name, size=size)
    captured = capture(example.model, example.example_inputs, example.example_kwargs)
    problem, stage_nodes = pose_problem(captured, loss_fn=example.loss_fn, hold_outputs=False)
    eager_peak = simulate(problem, Schedule.store_all(problem.num_stages)).peak_bytes
    smallest = solvers.minimum_peak(problem)
    plans = {}
    for point in POINTS:
        plan = solvers.solve(problem, int(smallest + point * (eager_peak - smallest)))
        plans[f"{point:.0%}"] = plan
    modules = {"eager": example.model, **{k: planned_module(captured, p, stage_nodes) for k, p in plans.items()}}
    seconds = fastest_steps(example, modules, repeats)
    rows = []
    for key, plan in plans.items():
        peak, _ = example.measured_step(modules[key])
        overhead = seconds[key] / seconds["eager"] - 1
        rows.append((name, key, plan.budget_bytes, plan.predicted_peak_bytes, peak, plan.predicted_overhead,
                     overhead))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(EXAMPLES))
    parser.add_argument("--size", default="test", choices=["test", "demo"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, size {args.size}; budget points go from "
          f"the smallest feasible peak (0%) to the eager peak (100%)\n")
    header = (f"{'model':11s} {'point':>5s} {'budget':>10s} {'predicted':>10s} {'measured':>10s} {'error':>7s} "
              f"{'overhead pred':>13s} {'measured':>9s}")
    print(header)
    print("-" * len(header))
    worst_peak, worst_overhead = 0.0, 0.0
    for name in args.models:
        for model, point, budget, predicted, peak, predicted_overhead, overhead in rows_for(name, args.size,
                                                                                          args.repeats):
            error = predicted / peak - 1
            worst_peak = max(worst_peak, abs(error))
            if overhead > 0.05:
                worst_overhead = max(worst_overhead, abs(predicted_overhead / overhead - 1))
            print(f"{model:11s} {point:>5s} {format_bytes(budget):>10s} {format_bytes(predicted):>10s} "
                  f"{format_bytes(peak):>10s} {error:>+7.1%} {predicted_overhead:>13.1%} {overhead:>9.1%}")
    print(f"\nworst peak error {worst_peak:.1%}; worst relative overhead error {worst_overhead:.0%} "
          f"(over plans whose measured overhead exceeds 5%)")


if __name__ == "__main__":
    main()
