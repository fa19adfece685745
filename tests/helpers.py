"""Shared test helpers: one measured training step, compared parameter by parameter."""

from __future__ import annotations

import torch

from benchmarks.compat import Step as StepResult, measured_step


def training_step(model: torch.nn.Module, run, inputs, *, owner: torch.nn.Module | None = None,
                  seed: int = 0) -> StepResult:
    """Run ``run(model)`` (forward + loss) and backward under a live-storage meter; restore buffers afterwards
    (:func:`benchmarks.compat.measured_step`).

    ``owner`` is the module whose parameters and buffers are reported (the caller's model).
    """
    return measured_step(lambda: run(model), owner or model, inputs, seed=seed)


def assert_same_training(a: StepResult, b: StepResult, *, atol: float = 1e-5) -> None:
    """Loss, every gradient and every buffer equal (allclose at ``atol``)."""
    torch.testing.assert_close(a.loss, b.loss, atol=atol, rtol=atol)
    assert a.grads.keys() == b.grads.keys()
    for name in a.grads:
        torch.testing.assert_close(a.grads[name], b.grads[name], atol=atol, rtol=atol, msg=f"gradient of {name}")
    assert a.buffers.keys() == b.buffers.keys()
    for name in a.buffers:
        torch.testing.assert_close(a.buffers[name], b.buffers[name], atol=atol, rtol=atol, msg=f"buffer {name}")


class NoGradInside(torch.nn.Module):
    """Four MLP blocks; block 1 runs under ``torch.no_grad`` inside forward, which cuts blocks 0 and 1 off from
    the backward."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
            for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == 1:
                with torch.no_grad():
                    x = x + layer(x)
            else:
                x = x + layer(x)
        return x


class Dropping(torch.nn.Module):
    """``n`` residual MLP blocks of ``width`` features with dropout inside."""

    def __init__(self, n: int = 4, width: int = 32):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(4 * width, width)) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x
