"""At the memory uniform per-block checkpointing reaches, how much faster is the planner's plan?

For each example model: measure eager and uniform per-block checkpointing (every block its own non-reentrant
checkpoint, what ``gradient_checkpointing_enable`` does), plan at the peak uniform reached, and time all three with
interleaved repeats. Prints a table: measured peak, predicted peak, step time (median and spread) and the
planner's speed-up over uniform.

    python -m benchmarks.uniform_vs_planner [--size test|demo] [--repeats 9] [models...]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from examples.common import EXAMPLES, build_example
from planner import solvers
from planner.api import planned_module, pose_problem
from planner.budget import format_bytes
from planner.capture import capture
from planner.plan import Plan, SolverStatus
from planner.problem import Schedule
from planner.timing import interleaved_rounds


def run(name: str, size: str, repeats: int) -> dict:
    example = build_example(name, size=size)
    captured = capture(example.model, example.example_inputs, example.example_kwargs)
    start = time.perf_counter()
    problem, stage_nodes = pose_problem(captured, loss_fn=example.loss_fn)
    profile_seconds = time.perf_counter() - start

    uniform_plan = Plan.from_schedule(problem, Schedule.uniform(problem.num_stages), solver="uniform",
                                      status=SolverStatus.HEURISTIC)
    uniform = planned_module(captured, uniform_plan, stage_nodes)
    uniform_peak, _ = example.measured_step(uniform)
    start = time.perf_counter()
    plan = solvers.solve(problem, max(uniform_peak, uniform_plan.predicted_peak_bytes))
    solve_seconds = time.perf_counter() - start
    planned = planned_module(captured, plan, stage_nodes)
    modules = {"eager": example.model, "uniform": uniform, "planner": planned}
    peaks = {k: example.measured_step(m)[0] for k, m in modules.items()}
    times = interleaved_rounds({k: functools.partial(example.step_seconds, m) for k, m in modules.items()}, repeats)
    return dict(name=name, stages=problem.num_stages, peaks=peaks, times=times, plan=plan, uniform=uniform_plan,
                profile_seconds=profile_seconds, solve_seconds=solve_seconds)


def spread(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=4) if len(samples) >= 4 else [min(samples), 0, max(samples)]
    return f"{statistics.median(samples) * 1e3:7.1f}ms [{q[0] * 1e3:.1f}-{q[-1] * 1e3:.1f}]"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(EXAMPLES))
    parser.add_argument("--size", default="test", choices=["test", "demo"])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, size {args.size}, "
          f"{args.repeats} interleaved repeats (median [quartiles])\n")
    header = (f"{'model':11s} {'method':8s} {'peak':>10s} {'predicted':>10s} {'step time':>28s} "
              f"{'vs eager':>8s} {'recompute':>9s}")
    print(header)
    print("-" * len(header))
    for name in args.models:
        r = run(name, args.size, args.repeats)
        eager = statistics.median(r["times"]["eager"])
        predicted = {"eager": r["plan"].eager_peak_bytes, "uniform": r["uniform"].predicted_peak_bytes,
                     "planner": r["plan"].predicted_peak_bytes}
        recompute = {"eager": 0.0, "uniform": r["uniform"].predicted_overhead,
                     "planner": r["plan"].predicted_overhead}
        for method in ("eager", "uniform", "planner"):
            step = statistics.median(r["times"][method])
            print(f"{name:11s} {method:8s} {format_bytes(r['peaks'][method]):>10s} "
                  f"{format_bytes(predicted[method]):>10s} {spread(r['times'][method]):>28s} "
                  f"{step / eager:>7.2f}x {recompute[method]:>8.1%}")
        uniform = statistics.median(r["times"]["uniform"])
        planner_time = statistics.median(r["times"]["planner"])
        print(f"{'':11s} planner vs uniform at equal memory: {1 - planner_time / uniform:.1%} faster "
              f"(predicted recompute {r['plan'].predicted_recompute_seconds * 1e3:.1f}ms vs "
              f"{r['uniform'].predicted_recompute_seconds * 1e3:.1f}ms); {r['stages']} stages, profile "
              f"{r['profile_seconds']:.1f}s, solve {r['solve_seconds']:.2f}s ({r['plan'].solver}, "
              f"{r['plan'].status.value})\n")


if __name__ == "__main__":
    main()
