"""A dynamically padded epoch: batches of varying length on one plan reused, or planned per length.

    python -m benchmarks.variable_shapes [--steps 40] [--lengths 128,112,96,80,64] [--budget 60%]

The test-size GPT-2 of :mod:`examples.gpt2` (dropout on), one torch thread. Each step's length is drawn (seeded)
from ``--lengths``; a planned module is given the longest batch as its example, as a user planning for a padded
dataset would. For each way of training it prints the seconds to set up (planning the example), the seconds of the
epoch (plans made for new lengths included), the plans made and reused, and the highest peak any length measured
(a live-storage meter, one metered step per length after the epoch).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from typing import Callable, Sequence

import torch

import planner
from planner.budget import format_bytes
from planner.meter import measure_step_peak


@dataclasses.dataclass(frozen=True)
class Row:
    """One way of training through the epoch."""

    way: str
    setup_seconds: float
    epoch_seconds: float
    plans_made: int
    plans_reused: int
    peak_bytes: int


Batch = Callable[[int], dict]


def _epoch(module: torch.nn.Module, model: torch.nn.Module, batch_of: Batch, lengths: Sequence[int]) -> float:
    start = time.perf_counter()
    for length in lengths:
        module(**batch_of(length)).loss.backward()
        model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _peak(module: torch.nn.Module, model: torch.nn.Module, batch_of: Batch, lengths: Sequence[int]) -> int:
    peaks = []
    for length in sorted(set(lengths)):
        batch = batch_of(length)
        peaks.append(measure_step_peak(lambda: module(**batch).loss.backward(), model.parameters(), model.buffers(),
                                       [t for t in batch.values() if isinstance(t, torch.Tensor)]))
        model.zero_grad(set_to_none=True)
    return max(peaks)


def run_way(way: str, build: Callable[[], torch.nn.Module], batch_of: Batch, lengths: Sequence[int],
            budget: str | int) -> Row:
    """Train a fresh model from ``build`` through ``lengths`` one way: ``eager``, ``hf_checkpointing``
    (``gradient_checkpointing_enable``), ``planner_reused`` or ``planner_per_length`` (``reuse_plans=False``)."""
    model = build()
    start = time.perf_counter()
    module: torch.nn.Module = model
    if way == "hf_checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif way.startswith("planner"):
        module = planner.optimize(model, budget, example_kwargs=batch_of(max(lengths)), hold_outputs=False,
                                  loss_fn=lambda out: out.loss, reuse_plans=way == "planner_reused")
    setup = time.perf_counter() - start
    epoch = _epoch(module, model, batch_of, lengths)
    plans = [planned.plan for planned, _ in getattr(module, "_planned", {}).values()]
    reused = sum(plan.reused_from is not None for plan in plans)
    return Row(way, setup, epoch, len(plans) - reused, reused, _peak(module, model, batch_of, lengths))


def table(rows: Sequence[Row]) -> str:
    header = ("way", "setup s", "epoch s", "total s", "plans made", "reused", "peak")
    lines = [header] + [(r.way, f"{r.setup_seconds:.1f}", f"{r.epoch_seconds:.1f}",
                         f"{r.setup_seconds + r.epoch_seconds:.1f}", str(r.plans_made), str(r.plans_reused),
                         format_bytes(r.peak_bytes)) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def gpt2_batches(seed: int = 0) -> tuple[Callable[[], torch.nn.Module], Batch]:
    """The test-size GPT-2 builder and its batches: the example's ids cut to a length, also the labels."""
    from examples import gpt2

    ids = gpt2.build("test", seed=seed).example_inputs[0]

    def batch_of(length: int) -> dict:
        cut = ids[:, :length].contiguous()
        return {"input_ids": cut, "labels": cut}
    return (lambda: gpt2.build("test", seed=seed).model), batch_of


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lengths", default="128,112,96,80,64")
    parser.add_argument("--budget", default="60%")
    parser.add_argument("--ways", default="eager,hf_checkpointing,planner_reused,planner_per_length")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    choices = [int(n) for n in args.lengths.split(",")]
    draw = random.Random(args.seed)
    lengths = [max(choices)] + [draw.choice(choices) for _ in range(args.steps - 1)]
    build, batch_of = gpt2_batches(args.seed)
    rows = []
    for way in args.ways.split(","):
        rows.append(run_way(way, build, batch_of, lengths, args.budget))
        print(f"{way} done", flush=True)
    print(f"test-size GPT-2, {args.steps} steps of lengths drawn from {choices}, budget {args.budget}, "
          f"torch {torch.__version__}, 1 thread")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
