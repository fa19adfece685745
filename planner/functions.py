"""Custom ``autograd.Function``\\ s kept whole in the captured graph.

``torch.export`` traces a custom ``autograd.Function``'s forward into plain ops and drops its backward, so a captured
graph would train a straight-through estimator (or any Function whose backward is not the forward's derivative)
with other gradients. While a model is exported, :func:`functions_kept_whole` routes each call of a user's Function
through an operator of its own (:func:`function_op`): export records one node for the call, and running that node
calls the Function itself, so its forward runs, and its backward is what autograd calls. Profiling, recomputation
and the meters see the Function's own ops, as in eager.

>>> class RoundThrough(torch.autograd.Function):  # rounds; passes the gradient through unchanged
...     @staticmethod
...     def forward(ctx, x):
...         return torch.round(x)
...     @staticmethod
...     def backward(ctx, grad):
...         return grad
>>> class Model(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.lin = torch.nn.Linear(2, 2)
...     def forward(self, x):
...         return RoundThrough.apply(self.lin(x))
>>> model = Model()
>>> with functions_kept_whole():
...     graph = torch.export.export(model, (torch.randn(3, 2),), strict=False).module()
>>> [n.target.name().split("::")[1].rsplit("_", 1)[0] for n in graph.graph.nodes if calls_function(n)]
['RoundThrough']
>>> graph(torch.randn(3, 2)).sum().backward()
>>> bool(model.lin.bias.grad.abs().sum() > 0)  # the traced round alone would give zero gradients
True
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.autograd.function import _is_setup_context_defined
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from .errors import PlannerError

__all__ = ["FunctionCall", "calls_function", "function_op", "functions_kept_whole", "is_own_code", "OWN_CODE",
           "name_function_calls", "checkpoints_traced", "OwnCheckpoints"]

# Code whose hooks and autograd.Functions the captured graph stands for: torch's, and the planner's own
OWN_CODE = ("torch.", "planner.rewrite", "planner.parts", "planner.profile", "planner.dropout")
NAMESPACE = "planner_functions"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
_APPLY = inspect.getattr_static(torch.autograd.Function, "apply")


def is_own_code(code: Any) -> bool:
    """Whether ``code`` (a hook, an autograd.Function class) is torch's or the planner's rather than the user's."""
    code = getattr(code, "func", code)  # a functools.partial: the function it binds
    defined_in = getattr(code, "__module__", None) or type(code).__module__ or ""
    return defined_in.startswith(OWN_CODE)


def calls_function(node: Any) -> bool:
    """Whether the fx ``node`` calls a user's autograd.Function (an operator of :func:`function_op`)."""
    return getattr(getattr(node, "target", None), "namespace", None) == NAMESPACE


@dataclass
class FunctionCall:
    """One way of calling an ``autograd.Function``: its class, where its tensor arguments go among the others
    (``spec`` and ``constants``, a placeholder at each tensor's place), and where its tensor outputs go among the
    rest (``out_spec``, ``out_constants``: learnt the first time it runs, so not frozen)."""

    function: type
    spec: TreeSpec
    constants: tuple
    out_spec: TreeSpec | None = None
    out_constants: tuple = ()

    def arguments(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        """The Function's ``(args, kwargs)``, with ``tensors`` put back in their places."""
        given = iter(tensors)
        leaves = [next(given) if c is _TENSOR else c for c in self.constants]
        return tree_unflatten(leaves, self.spec)

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Call the Function on ``tensors`` (and the constant arguments); its tensor outputs, in order."""
        args, kwargs = self.arguments(tensors)
        _RUNNING.depth += 1
        try:
            out = _APPLY.__func__(self.function, *args, **kwargs)
        finally:
            _RUNNING.depth -= 1
        leaves, out_spec = tree_flatten(out)
        self._check_outputs(tensors, leaves)
        if self.out_spec is None:
            self.out_spec = out_spec
            self.out_constants = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    def outputs(self, tensors: list[torch.Tensor]) -> Any:
        """What the Function returns, from its tensor outputs (``run``'s)."""
        given = iter(tensors)
        return tree_unflatten([next(given) if c is _TENSOR else c for c in self.out_constants], self.out_spec)

    def _check_outputs(self, inputs: list[torch.Tensor], outputs: list[Any]) -> None:
        storages = {t.untyped_storage()._cdata for t in inputs}
        if any(isinstance(x, torch.Tensor) and x.untyped_storage()._cdata in storages for x in outputs):
            raise PlannerError(f"the custom autograd.Function {self.function.__qualname__} returns an input or a view "
                               "of one, which a captured graph cannot keep as one call",
                               hint="return new tensors from its forward")


class _Tensor:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Tensor()  # a tensor's place among a call's arguments or outputs


class _Running(threading.local):
    depth = 0  # how many Function operators are running on this thread: their Functions run their own forward


_RUNNING = _Running()
_OPS: dict[str, tuple[FunctionCall, Any]] = {}


def _op_name(function: type, spec: TreeSpec, constants: tuple) -> str:
    """The name of the operator for ``function`` called this way: its name and a hash of where it is defined and
    how it is called, so that capturing the same model again, in this process or another, names the same operators
    (and a saved plan's fingerprint matches); a counter tells apart classes defined alike (a notebook cell run
    again).

    >>> spec = tree_flatten(((1.5,), {}))[1]
    >>> name = _op_name(torch.autograd.Function, spec, (1.5,))
    >>> name.startswith("Function_"), name == _op_name(torch.autograd.Function, spec, (1.5,))
    (True, True)
    """
    described = repr((function.__module__, function.__qualname__, str(spec), constants))
    stem = re.sub(r"\W", "_", function.__qualname__.replace("<locals>.", ""))
    base = name = f"{stem}_{hashlib.sha1(described.encode()).hexdigest()[:8]}"
    again = 1
    while name in _OPS and (_OPS[name][0].function, _OPS[name][0].spec, _OPS[name][0].constants) != \
            (function, spec, constants):
        again += 1
        name = f"{base}_{again}"
    return name


def function_op(function: type, args: tuple, kwargs: dict) -> tuple[Any, FunctionCall]:
    """The operator that calls ``function`` with arguments shaped like ``args`` and ``kwargs`` (registered the first
    time), and what it knows of the call."""
    leaves, spec = tree_flatten((args, kwargs))
    constants = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
    name = _op_name(function, spec, constants)
    if name not in _OPS:
        call = FunctionCall(function, spec, constants)
        _LIBRARY.define(f"{name}(Tensor[] tensors) -> Tensor[]")
        _LIBRARY.impl(name, call.run, "Autograd")
        _LIBRARY.impl(name, call.run, "CompositeExplicitAutograd")

        def fake(tensors: list[torch.Tensor], call: FunctionCall = call) -> list[torch.Tensor]:
            with torch.no_grad():
                return call.run(tensors)
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
        _OPS[name] = (call, getattr(getattr(torch.ops, NAMESPACE), name).default)
    call, op = _OPS[name]
    return op, call


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _user_functions() -> list[type]:
    """The user's ``autograd.Function`` classes that define a forward (torch's and the planner's left out)."""
    return [cls for cls in dict.fromkeys(_subclasses(torch.autograd.Function))
            if not is_own_code(cls) and "forward" in vars(cls)]


def _whole_forward(cls: type, forward: Callable) -> Callable:
    """A forward for ``cls`` that calls the Function's operator instead (see :func:`functions_kept_whole`)."""
    takes_ctx = not _is_setup_context_defined(cls.setup_context)

    def kept_whole(*args, **kwargs):
        if _RUNNING.depth:  # the operator itself calling the Function: its own forward
            return forward(*args, **kwargs)
        ctx, args = (args[0], args[1:]) if takes_ctx else (None, args)
        applied = getattr(type(ctx), "_forward_cls", cls)  # a subclass inheriting this forward
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if not tensors:
            return forward(*args, **kwargs) if not takes_ctx else forward(ctx, *args, **kwargs)
        op, call = function_op(applied, args, kwargs)
        return call.outputs(op(tensors))
    return kept_whole


@contextlib.contextmanager
def functions_kept_whole() -> Iterator[None]:
    """Within the block, each call of a user's ``autograd.Function`` that is given tensors runs as one operator
    (:func:`function_op`): what ``torch.export`` records instead of tracing its forward. Every Function class of the
    user's has its forward swapped for one that calls the operator, so calls through ``Fn.apply``, an alias such as
    ``act = Fn.apply`` and a subclass all reach it."""
    swapped = {cls: vars(cls)["forward"] for cls in _user_functions()}
    try:
        for cls, forward in swapped.items():
            setattr(cls, "forward", staticmethod(_whole_forward(cls, getattr(cls, "forward"))))
        yield
    finally:
        for cls, forward in swapped.items():
            setattr(cls, "forward", forward)


@dataclass
class OwnCheckpoints:
    """How many checkpoints a model made itself (``torch.utils.checkpoint``, either kind) while it was captured."""

    count: int = 0


@contextlib.contextmanager
def checkpoints_traced() -> Iterator[OwnCheckpoints]:
    """Within the block, ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` (Hugging Face's
    ``gradient_checkpointing_enable`` without ``use_reentrant=False``, for one) calls the checkpointed function as
    it is. Its ``CheckpointFunction`` runs the function without autograd, which ``torch.export`` records as a graph
    that computes no gradients from there on (the first backward raises); traced through, the graph computes what
    the model does, as for non-reentrant checkpoints, and the plan decides what is recomputed. Yields the count of
    the model's own checkpoints of either kind (the planner's regions, whose bodies are graph modules, left out):
    a share of the eager peak is then of the step without them.

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> layer = torch.nn.Linear(2, 2)
    >>> with checkpoints_traced() as own:
    ...     _ = checkpoint(layer, torch.ones(1, 2), use_reentrant=True)
    ...     _ = checkpoint(layer, torch.ones(1, 2), use_reentrant=False)
    >>> own.count
    2
    """
    import torch.utils.checkpoint as checkpointing

    own = OwnCheckpoints()
    reentrant = checkpointing.CheckpointFunction
    non_reentrant = checkpointing._checkpoint_without_reentrant_generator

    class TracedThrough:
        @staticmethod
        def apply(run_function: Callable, preserve_rng_state: bool, *args: Any) -> Any:
            own.count += 1
            return run_function(*args)

    def counted(function: Callable, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(getattr(function, "__self__", function), torch.fx.GraphModule):
            own.count += 1
        return non_reentrant(function, *args, **kwargs)

    checkpointing.CheckpointFunction = TracedThrough
    checkpointing._checkpoint_without_reentrant_generator = counted
    try:
        yield own
    finally:
        checkpointing.CheckpointFunction = reentrant
        checkpointing._checkpoint_without_reentrant_generator = non_reentrant


def name_function_calls(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Name each node that calls a Function after the Function (``swish``, ``swish_1``), not after its operator,
    whose name ends in a hash: what :func:`planner.explain` and the plan's stages show. Returns the module.

    >>> class Doubled(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         return x * 2
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         return grad * 2
    >>> class Model(torch.nn.Module):
    ...     def forward(self, x):
    ...         return Doubled.apply(Doubled.apply(x))
    >>> with functions_kept_whole():
    ...     graph = torch.export.export(Model(), (torch.randn(2),), strict=False).module()
    >>> [n.name for n in name_function_calls(graph).graph.nodes if calls_function(n)]
    ['doubled', 'doubled_1']
    """
    for n in graph_module.graph.nodes:
        if calls_function(n):
            stem = n.target.name().split("::", 1)[1].rsplit("_", 1)[0]
            n._rename(re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower().replace("__", "_"))
    graph_module.recompile()
    return graph_module
