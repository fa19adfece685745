"""Models that ``torch.export`` captures only in parts: find the largest submodules that capture, plan those.

When the whole model does not capture (Python control flow on tensor values, unsupported ops at the top level), the
planner runs the model once eagerly, records what each submodule is called with, and walks the module tree from the
root: a submodule that captures with its recorded inputs becomes a *part* and is planned on its own; one that does
not is searched in turn. Everything outside the parts runs eagerly, as written.

Each part must lower its own peak by what the whole step has to shed (its eager peak minus the budget):
:class:`ReducedBudget`. While the model runs, :func:`parts_planned` routes each part's calls to its plan.

>>> import torch
>>> class Gate(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
...     def forward(self, x):
...         return self.body(x) if x.sum() > 0 else -self.body(x)   # data-dependent: no export
>>> model = Gate()
>>> recorded = record_calls(model, (torch.ones(2, 4),), {}, loss_fn=None)
>>> sorted(recorded.calls)
['', 'body', 'body.0', 'body.1', 'body.2']
>>> sorted(capturable_parts(model, recorded.calls))
['body']
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .budget import Budget
from .capture import CapturedGraph, capture, numbers_kept, outside_autocast
from .errors import PlannerError
from .meter import measure_step_peak
from .profile import default_loss, preserved_training_state


class PartialCaptureWarning(UserWarning):
    """The model was planned in parts; the rest of it runs eagerly."""


@dataclass(frozen=True)
class ReducedBudget(Budget):
    """A part's budget: its own eager peak less ``reduce_bytes``, what the whole step must shed.

    >>> ReducedBudget("60% (part 'body')", reduce_bytes=300).resolve(1000)
    700
    """

    reduce_bytes: int = 0

    def resolve(self, eager_peak_bytes: int) -> int:
        return max(0, eager_peak_bytes - self.reduce_bytes)


@dataclass(frozen=True)
class RecordedCalls:
    """One eager training step: the (args, kwargs) each submodule was first called with, by path, and its peak."""

    calls: dict[str, tuple[tuple, dict]]
    eager_peak_bytes: int


def _detached(value: Any) -> Any:
    def copy(x):
        if isinstance(x, torch.Tensor):
            return x.detach().requires_grad_(x.requires_grad and x.is_floating_point())
        return x
    return tree_map(copy, value)


def record_calls(model: torch.nn.Module, args: tuple, kwargs: dict, *, loss_fn: Callable | None,
                 extra_fixed_bytes: int = 0) -> RecordedCalls:
    """Run an eager training step of ``model``, recording each submodule's first inputs, and another for the
    step's peak (:func:`step_peak_bytes`, which leaves no trace on the model, so both draw alike): the recorded
    inputs, held until the step ends, made the peak of the first step higher (by about 6% for six residual blocks:
    a 60% budget was 63% of the real eager peak)."""
    calls: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for path, module in model.named_modules():
        def hook(_module, a, k, path=path):
            calls.setdefault(path, (_detached(a), _detached(k)))
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        step_peak_bytes(model, args, kwargs, loss_fn=loss_fn)
    finally:
        for h in handles:
            h.remove()
    return RecordedCalls(calls, step_peak_bytes(model, args, kwargs, loss_fn=loss_fn,
                                                extra_fixed_bytes=extra_fixed_bytes))


def step_peak_bytes(model: torch.nn.Module, args: tuple, kwargs: dict, *, loss_fn: Callable | None,
                    extra_fixed_bytes: int = 0, parts: dict[str, torch.nn.Module] | None = None) -> int:
    """The peak of one eager training step of ``model`` (the loss of its output, backward): live storages plus
    parameters, buffers, inputs and ``extra_fixed_bytes``; ``parts``: planned modules that run the model's parts
    meanwhile (:func:`parts_planned`). A step of planning's, not the caller's: buffers, gradients, torch's RNG,
    and the numbers and Python and NumPy generators its forward changes (:func:`~planner.capture.numbers_kept`)
    are put back after.

    >>> model = torch.nn.Linear(4, 4)
    >>> step_peak_bytes(model, (torch.ones(2, 4),), {}, loss_fn=None) > 0 and model.weight.grad is None
    True
    """
    def step() -> None:
        # under autocast, as a step of the caller's runs: its forward and loss in an autocast block of their own
        # (the weights cast by an earlier step are not held already), its backward after the block (the casts it
        # does not save are gone); measured inside the caller's block, wav2vec2 in parts went 0.2 MB (1%) over
        torch.clear_autocast_cache()
        loss = (loss_fn or default_loss)(model(*args, **kwargs))
        torch.clear_autocast_cache()
        with outside_autocast():
            loss.backward()

    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    with preserved_training_state(model), numbers_kept(model), parts_planned(model, parts or {}):
        peak = measure_step_peak(step, model.parameters(), model.buffers(), inputs)
        for p in model.parameters():
            p.grad = None
    return peak + extra_fixed_bytes


def capturable_parts(model: torch.nn.Module, calls: dict[str, tuple[tuple, dict]]) -> dict[str, CapturedGraph]:
    """The largest submodules (outermost first) that capture with their recorded inputs, and have parameters.

    The root is never a part (it did not capture); modules that were not called (containers such as
    ``ModuleList``) are looked into. A module the recorded step skipped (a layer dropped at random, as layerdrop
    does) is captured with the inputs of a sibling of its class that ran (:func:`_recorded_inputs`), so that it
    is planned too, not run eagerly whenever a later step runs it.
    """
    parts: dict[str, CapturedGraph] = {}
    pending = [(f"{name}", child) for name, child in model.named_children()]
    while pending:
        path, module = pending.pop(0)
        recorded = _recorded_inputs(model, path, module, calls)
        if recorded is not None and any(p.requires_grad for p in module.parameters()):
            try:
                parts[path] = capture(module, *recorded)
                continue
            except PlannerError:
                pass
        pending.extend((f"{path}.{name}", child) for name, child in module.named_children())
    return parts


def _recorded_inputs(model: torch.nn.Module, path: str, module: torch.nn.Module,
                     calls: dict[str, tuple[tuple, dict]]) -> tuple[tuple, dict] | None:
    """What ``module`` (at ``path``) was first called with, or else what the first sibling of its class (the same
    parent) was, or None.

    >>> layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.ReLU()])
    >>> calls = {"1": ((torch.ones(1, 2),), {})}
    >>> _recorded_inputs(layers, "0", layers[0], calls) is calls["1"], _recorded_inputs(layers, "2", layers[2], calls)
    (True, None)
    """
    if path in calls:
        return calls[path]
    parent_path, _, _ = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    for name, sibling in parent.named_children():
        sibling_path = f"{parent_path}.{name}" if parent_path else name
        if type(sibling) is type(module) and sibling_path in calls:
            return calls[sibling_path]
    return None


class _PartForward:
    """Stands in for a part's ``forward`` while the model runs: calls the part's planned module instead."""

    def __init__(self, module: torch.nn.Module, planned: torch.nn.Module):
        self.module = module
        self.planned = planned

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        del self.module.forward  # the part's own forward again, should it need re-planning or run eagerly
        try:
            return self.planned(*args, **kwargs)
        finally:
            self.module.forward = self


@contextmanager
def parts_planned(model: torch.nn.Module, parts: dict[str, torch.nn.Module]) -> Iterator[None]:
    """Within the block, calls of each part of ``model`` (by path) run that part's planned module."""
    patched = []
    try:
        for path, planned in parts.items():
            module = model.get_submodule(path)
            module.forward = _PartForward(module, planned)
            patched.append(module)
        yield
    finally:
        for module in patched:
            if "forward" in module.__dict__:
                del module.forward
