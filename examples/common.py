"""Shared pieces of the example models.

Every model module in this package exposes ``build(size="test", seed=0) -> Example``.
``size`` is ``"test"`` (a forward+backward well under 0.5 s on a 2-core CPU, saved
activations several times the parameter bytes) or ``"demo"`` (a step of roughly
0.5-2 s on the same machine).  Weights are random; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

SIZES = ("test", "demo")


@dataclass(frozen=True)
class Example:
    """A model ready for one training step.

    name: registry name of the example.
    model: the module, in train mode.
    example_inputs: positional inputs, ``model(*example_inputs, **example_kwargs)``.
    example_kwargs: keyword inputs.
    loss_fn: turns the model's output into a scalar loss tensor.
    block_path: dotted path (from ``model``) of the ModuleList/Sequential that
        holds the repeated blocks, e.g. ``"transformer.h"``.
    """

    name: str
    model: torch.nn.Module
    example_inputs: tuple
    example_kwargs: dict
    loss_fn: Callable[[Any], torch.Tensor]
    block_path: str

    def run(self, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Forward through ``model`` (default: ``self.model``) and return the loss."""
        m = self.model if model is None else model
        return self.loss_fn(m(*self.example_inputs, **self.example_kwargs))

    def blocks(self) -> torch.nn.Module:
        """The container named by ``block_path``."""
        return self.model.get_submodule(self.block_path)

    def measured_step(self, model: torch.nn.Module | None = None) -> tuple[int, torch.Tensor]:
        """Peak bytes and loss of one forward + backward through ``model`` (default: ``self.model``).

        The peak counts live storages (a live-storage meter) plus the parameters, buffers and inputs;
        gradients are cleared afterwards.
        """
        from planner.meter import LiveMemoryMeter, storage_bytes

        fixed = storage_bytes(list(self.model.parameters()) + list(self.model.buffers())
                              + [t for t in self.example_inputs if isinstance(t, torch.Tensor)])
        with LiveMemoryMeter() as meter:
            loss = self.run(model)
            loss.backward()
        self.model.zero_grad(set_to_none=True)
        return fixed + meter.peak_bytes, loss.detach()

    def step_seconds(self, model: torch.nn.Module | None = None) -> float:
        """Seconds of one forward + backward through ``model``; gradients are cleared afterwards."""
        start = time.perf_counter()
        self.run(model).backward()
        seconds = time.perf_counter() - start
        self.model.zero_grad(set_to_none=True)
        return seconds


def check_size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    return size


def hugging_face_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """Switch a Hugging Face model's checkpointing of every layer (non-reentrant) on or off, by the name the
    installed transformers gives it: ``activation_checkpointing_enable`` since 5.x (where the old
    ``gradient_checkpointing_enable`` still works but warns that it is deprecated), or the old one before."""
    new = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if not enabled:
        getattr(model, f"{new}_checkpointing_disable")()
        return
    getattr(model, f"{new}_checkpointing_enable")(**{f"{new}_checkpointing_kwargs": {"use_reentrant": False}})


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the body with the global CPU RNG seeded, restoring it afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def generator(seed: int) -> torch.Generator:
    """A CPU generator for example inputs / targets (does not touch the global RNG)."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _lazy(module: str) -> Callable[..., Example]:
    def build(size: str = "test", seed: int = 0) -> Example:
        return importlib.import_module(f"examples.{module}").build(size=size, seed=seed)

    build.__name__ = f"build_{module}"
    build.__qualname__ = build.__name__
    build.__doc__ = f"Lazily import ``examples.{module}`` and call its ``build``."
    return build


EXAMPLES: dict[str, Callable[..., Example]] = {
    name: _lazy(name) for name in ("largeblock", "gpt2", "llama", "resnet", "unet", "bert")
}


def build_example(name: str, size: str = "test", seed: int = 0) -> Example:
    """Build the registered example ``name`` at ``size``."""
    try:
        build = EXAMPLES[name]
    except KeyError:
        raise KeyError(f"unknown example {name!r}; known: {sorted(EXAMPLES)}") from None
    return build(size=size, seed=seed)


# --------------------------------------------------------------------------- measuring


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def saved_activation_bytes(ex: Example) -> int:
    """Bytes alive after one forward (what the backward will need, and the loss), counted as live storages.

    It runs the real forward once, so it advances the RNG and BatchNorm statistics.
    """
    from planner.meter import LiveMemoryMeter

    with LiveMemoryMeter() as meter:
        loss = ex.run()
        alive = meter.live_bytes
    del loss
    return alive


def train_demo(build: Callable[..., Example], size: str = "demo", steps: int = 3,
               lr: float = 1e-3) -> None:
    """Build ``size`` and run ``steps`` AdamW training steps, printing loss and time."""
    ex = build(size=size)
    n_params = sum(p.numel() for p in ex.model.parameters())
    print(f"{ex.name} ({size}): {n_params:,} parameters, "
          f"{param_bytes(ex.model) / 2**20:.2f} MiB; blocks at {ex.block_path!r} "
          f"({len(ex.blocks())} blocks)")
    opt = torch.optim.AdamW(ex.model.parameters(), lr=lr)
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = ex.run()
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        print(f"step {step}: loss {loss.item():.4f}  time {dt:.3f} s")
