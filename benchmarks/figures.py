"""The README's pictures, drawn from a real run: ``docs/timeline.png``, ``docs/frontier.png`` (its points in
``docs/frontier.json``) and ``docs/stages.png``.

    python -m benchmarks.figures                 # GPT-2 "demo" size, torch.compile points included (minutes)
    python -m benchmarks.figures --size test --no-compile

Plans the GPT-2 from ``examples/gpt2.py`` for half its eager peak, then draws the memory timeline of one step
(eager and planned, predicted and measured), the budget/overhead frontier (the planner, uniform checkpointing,
Chen's sqrt(n) predicted; ``torch.compile`` with ``activation_memory_budget`` measured) and the per-layer strip,
and prints the numbers behind them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import planner  # noqa: E402
from planner.budget import format_bytes  # noqa: E402
from planner.frontier import compile_frontier, planner_frontier  # noqa: E402
from planner.timeline import step_timelines  # noqa: E402
from planner.viz import plot_frontier, plot_stages, plot_timeline  # noqa: E402

from examples.common import build_example  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="demo", choices=["test", "demo"])
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile points")
    parser.add_argument("--out", type=Path, default=DOCS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    example = build_example("gpt2", size=args.size)
    start = time.perf_counter()
    opt = planner.optimize(example.model, args.budget, example.example_inputs, example_kwargs=example.example_kwargs,
                           loss_fn=example.loss_fn, hold_outputs=False)
    print(opt.plan.summary())
    print(f"planned in {time.perf_counter() - start:.1f}s")

    timelines = step_timelines(opt)
    for tl in timelines:
        print(f"{tl.label:8s} predicted peak {format_bytes(tl.predicted_peak_bytes):>11s}, "
              f"measured {format_bytes(tl.measured_peak_bytes):>11s}")
    figure = plot_timeline(timelines)
    figure.suptitle(f"GPT-2 ({args.size}), one training step at a budget of {args.budget} of eager", fontsize=10)
    figure.savefig(args.out / "timeline.png", dpi=90)

    points = planner_frontier(opt.planned.problem)
    if not args.no_compile:
        points += compile_frontier(example.model, example.example_inputs, example.example_kwargs,
                                   loss_fn=example.loss_fn)
    for p in points:
        print(f"{p.method.value:14s} {p.setting:32s} peak {format_bytes(p.peak_bytes):>11s}  "
              f"overhead {p.overhead:+6.1%}{'  (measured)' if p.measured else ''}")
    (args.out / "frontier.json").write_text(json.dumps(
        [{**dataclasses.asdict(p), "method": p.method.value} for p in points], indent=1) + "\n")
    figure = plot_frontier(points, budget_bytes=opt.plan.budget_bytes)
    figure.axes[0].set_title(f"GPT-2 ({args.size}): peak memory vs extra step time", fontsize=10)
    figure.savefig(args.out / "frontier.png", dpi=90)

    plot_stages(opt.plan).savefig(args.out / "stages.png", dpi=90)
    print(f"wrote {', '.join(str(args.out / n) for n in ('timeline.png', 'frontier.png', 'stages.png'))}")


if __name__ == "__main__":
    main()
