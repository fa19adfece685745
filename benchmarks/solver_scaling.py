"""How the exact solvers scale with the number of stages, on the random problems the solver tests use.

For each problem: the ILP's size (variables, constraints), then for budgets a share of the way from a low peak
(the least of uniform checkpointing and 300 random schedules, so the budget is feasible) to the eager peak, the
ILP's and the DP's status, recompute seconds and wall time.

    python -m benchmarks.solver_scaling [--stages 12 30 64] [--time-limit 60] [--solvers ilp dp]
"""

from __future__ import annotations

import argparse
import random
import time

from planner.errors import PlannerError
from planner.problem import Schedule, simulate
from planner.solvers import solve
from planner.solvers.ilp import Encoding
from tests.solver_problems import layered_chain, random_chain, random_dag, random_schedule

SHARES = (0.2, 0.6)


def problems(stages: int):
    yield random_chain(stages, 0)
    yield layered_chain(stages, 0)
    yield random_dag(stages, 0)


def run(method: str, problem, budget: int, time_limit: float) -> str:
    options = {"time_limit": time_limit} if method == "ilp" else {}
    if method == "dp" and not problem.is_chain():
        return "dp: not a chain (conservative), skipped"
    started = time.perf_counter()
    try:
        plan = solve(problem, budget, method=method, **options)
    except PlannerError as error:
        return f"{method}: {type(error).__name__} after {time.perf_counter() - started:.1f}s"
    gap = "" if plan.gap is None else f" gap {plan.gap:.2%}"
    return (f"{method}: {plan.status.value}{gap}, {plan.predicted_recompute_seconds:.3f}s recomputed, "
            f"{time.perf_counter() - started:.1f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[12, 30, 64])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--solvers", nargs="+", default=["ilp", "dp"])
    args = parser.parse_args()
    for stages in args.stages:
        for problem in problems(stages):
            encoding = Encoding(problem)
            print(f"{problem.name}: {len(problem.tensors)} tensors, ILP {len(encoding.model.variables())} variables, "
                  f"{len(encoding.model.constraints)} constraints", flush=True)
            eager = simulate(problem, Schedule()).peak_bytes
            rng = random.Random(0)
            low = min(simulate(problem, s).peak_bytes for s in [Schedule.uniform(stages)] + [
                random_schedule(problem, rng, rng.random()) for _ in range(300)])
            low = min(low, eager)
            for share in SHARES:
                budget = int(low + share * (eager - low))
                results = "; ".join(run(m, problem, budget, args.time_limit) for m in args.solvers)
                print(f"  budget {share:.0%} of the way to eager: {results}", flush=True)


if __name__ == "__main__":
    main()
