"""The README's demo: plan a GPT-2 for half its eager peak memory, train it, and compare with the alternatives.

Run from the repository root::

    python -m examples.demo            # GPT-2 "demo" size (about 2 minutes on 2 CPU cores, 1 of them planning)
    python -m examples.demo --size test --steps 2

It prints, for eager training, Hugging Face's ``gradient_checkpointing_enable`` (every layer checkpointed) and
``planner.optimize`` at 50% of the eager peak and at the memory uniform checkpointing reaches: the measured peak
memory of one step (a live-storage meter, parameters and gradients included), the median step time over
interleaved rounds and the median of its ratio to eager's in the same round, and the losses, which agree with eager
training.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import planner
from planner.budget import format_bytes
from planner.timing import interleaved_rounds, keep_freed_memory, paired_ratios

from .common import build_example, hugging_face_checkpointing


def measure(example, module) -> tuple[int, float]:
    """Peak bytes and loss of one training step of ``module``, from the same random state as the others."""
    torch.manual_seed(0)
    peak, loss = example.measured_step(module)
    return peak, loss.item()


class HFCheckpointed(torch.nn.Module):
    """The model with Hugging Face's gradient checkpointing switched on only while it runs."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        hugging_face_checkpointing(self.model, True)
        try:
            return self.model(*args, **kwargs)
        finally:
            hugging_face_checkpointing(self.model, False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="demo", choices=["test", "demo"])
    parser.add_argument("--steps", type=int, default=3, help="training steps with AdamW on the planned model")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds, each a step of every method")
    args = parser.parse_args(argv)
    if keep_freed_memory():  # otherwise eager's step faults its freed memory in again: see its docstring
        print("heap: freed memory kept between steps, as the CUDA caching allocator keeps it")

    example = build_example("gpt2", size=args.size)
    model = example.model
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT-2 ({args.size}): {params / 1e6:.2f} M parameters, batch {tuple(example.example_inputs[0].shape)}")

    eager_peak, eager_loss = measure(example, model)
    uniform = HFCheckpointed(model)
    uniform_peak, uniform_loss = measure(example, uniform)

    start = time.perf_counter()
    options = dict(example_kwargs=example.example_kwargs, loss_fn=example.loss_fn, hold_outputs=False)
    half = planner.optimize(model, "50%", example.example_inputs, **options)
    plan_seconds = time.perf_counter() - start
    at_uniform = planner.optimize(model, uniform_peak, example.example_inputs, **options)
    print(half.plan.summary())
    rows = [("eager", model, eager_peak, eager_loss), ("HF gradient checkpointing", uniform, uniform_peak,
                                                       uniform_loss)]
    for name, opt in (("planner @ 50% of eager", half), ("planner @ uniform's memory", at_uniform)):
        peak, loss = measure(example, opt)
        rows.append((name, opt, peak, loss))

    # interleaved rounds after a warm-up one, each in a drawn order, so load on the machine hits every method alike
    times = interleaved_rounds({name: functools.partial(example.step_seconds, module) for name, module, *_ in rows},
                               args.repeats)
    print(f"\n{'method':28s} {'peak memory':>12s} {'vs eager':>9s} {'step time':>10s} {'vs eager':>9s} "
          f"{'loss':>9s}")
    for name, _, peak, loss in rows:
        step, ratio = statistics.median(times[name]), statistics.median(paired_ratios(times, name, "eager"))
        print(f"{name:28s} {format_bytes(peak):>12s} {peak / eager_peak:>8.0%} {step * 1e3:>8.0f}ms "
              f"{ratio:>8.2f}x {loss:>9.5f}")
    print(f"\nplanning took {plan_seconds:.1f}s (capture, profile, solve); "
          f"predicted peak {format_bytes(half.plan.predicted_peak_bytes)}, budget "
          f"{format_bytes(half.plan.budget_bytes)}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = example.loss_fn(half(*example.example_inputs, **example.example_kwargs))
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
