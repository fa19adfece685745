"""Solver time and proven gap against graph size: op-level layered DAGs, transformer shapes, random problems.

Three sections, each printed as a table (issue 3's targets; nothing here is a timed test):

* ``dags``: random layered DAGs of 1k, 5k and 20k ops (``--ops``), given to the planner's own stage cutting
  (``costmodel.partition_stages``, ``build_problem``) as a profiled graph, then solved within what is left of a
  60 s limit on posing and solving together. Columns:
  stages, tensors, seconds to pose the problem, seconds to solve, status and proven gap.
* ``shapes``: GPT-2 small (12 layers, seq 1024) and a Llama-7B shape (32 layers, d 4096, seq 4096, bf16) captured on
  the meta device and timed for an H100 (``planner.devices``), planned at half of the eager activation memory
  (the eager peak less parameters, inputs and gradients). Columns: capture, pose, solve seconds, gap.
* ``random``: the solver tests' random chains and DAGs at 12-64 stages, the DP against the ILP.

    python -m benchmarks.solver_scaling                       # dags and shapes
    python -m benchmarks.solver_scaling --sections dags --ops 1000 5000 20000
    python -m benchmarks.solver_scaling --sections random --stages 12 30 64

Gaps are proven: the lower bound is the optimum of a relaxation (``planner.solvers.dp.lower_bound``) or the ILP's
bound. They are gaps over the plans the planner considers: checkpoint regions of whole stages, with each stage's
menu of selective-caching options.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from planner.budget import format_bytes
from planner.costmodel import build_problem, partition_stages
from planner.errors import PlannerError
from planner.problem import Problem, Schedule, simulate
from planner.profile import GraphProfile, NodeProfile, StorageRecord
from planner.solvers import solve

FLOP_RATE = 1e12  # FLOP/s of the imaginary device the random DAGs' op times assume
BYTE_RATE = 1e11  # bytes/s likewise


@dataclass(frozen=True)
class Row:
    """One line of a table: what was solved, how big, how long, how well."""

    name: str
    stages: int
    tensors: int
    pose_seconds: float
    solve_seconds: float
    status: str
    gap: float | None
    overhead: float

    def cells(self) -> tuple[str, ...]:
        gap = "n/a" if self.gap is None else f"{self.gap:.2%}"
        return (self.name, str(self.stages), str(self.tensors), f"{self.pose_seconds:.2f}",
                f"{self.solve_seconds:.2f}", self.status, gap, f"{self.overhead:.1%}")


HEADER = ("problem", "stages", "tensors", "pose s", "solve s", "status", "gap", "overhead")


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)), flush=True)


def layered_dag_profile(ops: int, seed: int = 0, *, width: int = 20, skip: float = 0.05) -> GraphProfile:
    """A profiled graph of ``ops`` nodes in layers of ``width``: each op reads one to three ops of the layer
    before (and with probability ``skip`` one of up to eight layers back), and saves what it reads for the
    backward, like a matmul. Sizes and FLOPs vary per op; layers are modules ``layers.<i>`` so the planner cuts
    one stage per run of layers, as it does for transformer blocks.

    >>> profile = layered_dag_profile(100, width=10)
    >>> len(profile.nodes), profile.nodes[15].module_path
    (100, 'layers.1')
    """
    rng = random.Random(seed)
    nodes: list[NodeProfile] = []
    layers: list[list[int]] = []
    for index in range(ops):
        layer = index // width
        if layer == len(layers):
            layers.append([])
        reads: set[int] = set()
        if layer:
            reads.update(rng.sample(layers[layer - 1], rng.randint(1, min(3, len(layers[layer - 1])))))
            if layer > 1 and rng.random() < skip:
                reads.add(rng.choice(layers[rng.randint(max(0, layer - 8), layer - 2)]))
        nbytes = 4096 * rng.randint(16, 256)
        flops = rng.randint(1, 64) * 10**7
        seconds = max(flops / FLOP_RATE, nbytes / BYTE_RATE)
        nodes.append(NodeProfile(f"op{index}", f"layers.{layer}", seconds, flops,
                                 (StorageRecord(index, nbytes, True, True),), frozenset(reads), frozenset(reads),
                                 frozenset({f"w{index}"}) if flops > 32 * 10**7 else frozenset(), False))
        layers[-1].append(index)
    read_somewhere = {key for n in nodes for key in n.reads}
    last = layers[-1]
    nodes = [n if n.created[0].key in read_somewhere or n.created[0].key in last else
             NodeProfile(n.name, n.module_path, n.seconds, n.flops, (StorageRecord(n.created[0].key,
                         n.created[0].nbytes, False, True),), n.reads, n.saved, n.param_reads, False)
             for n in nodes]
    grads = {p: 4096 * 64 for n in nodes for p in n.param_reads}
    return GraphProfile(tuple(nodes), frozenset(last), grads, fixed_bytes=sum(grads.values()))


def dag_problem(ops: int, seed: int = 0, max_stages: int = 64) -> Problem:
    profile = layered_dag_profile(ops, seed)
    stages = partition_stages(profile, max_stages=max_stages)
    return build_problem(profile, stages, random_nodes=set(), name=f"dag{ops}")


def half_activation_budget(problem: Problem) -> int:
    """The fixed memory and gradients, plus half of what the eager step holds beyond them."""
    eager = simulate(problem, Schedule()).peak_bytes
    floor = problem.fixed_bytes + sum(s.grad_bytes for s in problem.stages)
    return floor + (eager - floor) // 2


def solved_row(name: str, problem: Problem, budget: int, pose_seconds: float, time_limit: float) -> Row:
    started = time.perf_counter()
    try:
        plan = solve(problem, budget, time_limit=time_limit)
    except PlannerError as error:
        return Row(name, problem.num_stages, len(problem.tensors), pose_seconds, time.perf_counter() - started,
                   type(error).__name__, None, 0.0)
    return Row(name, problem.num_stages, len(problem.tensors), pose_seconds, time.perf_counter() - started,
               f"{plan.solver} {plan.status.value}", plan.gap, plan.predicted_overhead)


def dags(sizes: list[int], time_limit: float) -> None:
    print(f"\nRandom layered DAGs at half the eager activation memory (solver time limit {time_limit:g} s)")
    rows = [HEADER]
    for ops in sizes:
        started = time.perf_counter()
        problem = dag_problem(ops)
        posed = time.perf_counter() - started
        # the limit covers posing and solving: from a profiled graph to a plan
        rows.append(solved_row(f"{ops} ops", problem, half_activation_budget(problem), posed,
                               max(1.0, time_limit - posed)).cells())
    print_table(rows)


def shapes(time_limit: float) -> None:
    import torch
    from benchmarks.meta_7b import LLAMA_7B, llama
    from planner.api import pose
    from planner.capture import capture

    print("\nTransformer shapes on the meta device, timed for an H100, at half the eager activation memory")
    rows = [("problem", "capture s", *HEADER[1:])]
    for name, build in (("GPT-2 small, seq 1024", gpt2_small), ("Llama-7B, seq 4096", lambda: llama(**LLAMA_7B))):
        model, args, kwargs = build()
        started = time.perf_counter()
        captured = capture(model, args, kwargs)
        captured_seconds = time.perf_counter() - started
        started = time.perf_counter()
        problem = pose(captured, device="h100", profile_repeats=1).problem
        row = solved_row(name, problem, half_activation_budget(problem), time.perf_counter() - started, time_limit)
        cells = row.cells()
        rows.append((cells[0], f"{captured_seconds:.2f}", *cells[1:]))
        print(f"  {name}: eager {format_bytes(simulate(problem, Schedule()).peak_bytes)}, budget "
              f"{format_bytes(half_activation_budget(problem))}", flush=True)
        del model, captured
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print_table(rows)


def gpt2_small():
    """GPT-2 small (124M) on the meta device: 12 layers, d 768, batch 1, seq 1024."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_positions=1024, use_cache=False)).train()
    ids = torch.zeros(1, 1024, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def random_problems(stages: list[int], time_limit: float) -> None:
    from tests.solver_problems import layered_chain, random_chain, random_dag

    print(f"\nRandom problems from the solver tests: DP (auto) against the ILP (limit {time_limit:g} s)")
    rows = [("problem", "method", *HEADER[1:])]
    for n in stages:
        for problem in (random_chain(n, 0), layered_chain(n, 0), random_dag(n, 0)):
            budget = (simulate(problem, Schedule.uniform(n)).peak_bytes + simulate(problem, Schedule()).peak_bytes) // 2
            for method in ("auto", "ilp"):
                started = time.perf_counter()
                try:
                    plan = solve(problem, budget, method=method, time_limit=time_limit)
                    cells = (f"{plan.solver} {plan.status.value}", "n/a" if plan.gap is None else f"{plan.gap:.2%}",
                             f"{plan.predicted_recompute_seconds:.3f}")
                except PlannerError as error:
                    cells = (type(error).__name__, "n/a", "")
                rows.append((problem.name, method, str(n), str(len(problem.tensors)), "0",
                             f"{time.perf_counter() - started:.2f}", *cells))
    print_table([r[:8] for r in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["dags", "shapes"], choices=["dags", "shapes", "random"])
    parser.add_argument("--ops", type=int, nargs="+", default=[1000, 5000, 20000])
    parser.add_argument("--stages", type=int, nargs="+", default=[12, 30, 64])
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args(argv)
    if "dags" in args.sections:
        dags(args.ops, args.time_limit)
    if "shapes" in args.sections:
        shapes(args.time_limit)
    if "random" in args.sections:
        random_problems(args.stages, args.time_limit)


if __name__ == "__main__":
    main()
