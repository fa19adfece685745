"""Capture: a model and example inputs in, an ATen-level ``fx.GraphModule`` out that trains the caller's parameters.

``torch.export.export(..., strict=False)`` captures Hugging Face GPT-2 and Llama as well as plain modules. Its
unlifted module (``ExportedProgram.module()``) holds the model's own ``Parameter`` and buffer objects, keeps
``nn_module_stack`` on every node (so plans can speak of layers) and mutates BatchNorm buffers in place, so it trains
exactly like the model.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> captured = capture(model, (torch.randn(3, 4),))
>>> captured.graph_module.get_parameter("0.weight") is model[0].weight
True
>>> [n.target.__name__ for n in captured.compute_nodes()]
['linear.default', 'relu.default', 'linear.default']
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import io
import logging
import operator
import random
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet, Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from .dropout import replayable_dropout
from .errors import PlannerError, warn_at_callers_line
from .functions import checkpoints_traced, functions_kept_whole, is_own_code, name_function_calls
from .attention import restore_attention


@dataclass(frozen=True)
class CapturedGraph:
    """The captured module, and what it was captured with."""

    graph_module: fx.GraphModule
    example_args: tuple
    example_kwargs: dict
    input_signature: tuple
    autocast: tuple = ()
    sharding: Any = None  # the model's fully_shard units (planner.fsdp.Sharding) when it has any
    hooks: tuple = ()  # the model's hooks when it was captured (hooks_signature)
    numbers: tuple = ()  # the numbers on the model's modules when it was captured (numbers_signature)
    trained: tuple = ()  # which of its parameters required gradients (trained_signature)
    modules: tuple = ()  # which modules it was made of (modules_signature)
    own_checkpoints: int = 0  # checkpoints the model made itself, traced through (functions.checkpoints_traced)

    @property
    def key(self) -> tuple:
        """What plans are cached under: the input signature, the autocast state it was profiled in, the model's
        hooks, numbers, trained parameters and modules and, for a model sharded with ``fully_shard``, its units."""
        return plan_key(self.input_signature, self.autocast,
                        self.sharding.signature if self.sharding is not None else None, self.hooks, self.numbers,
                        self.trained, self.modules)

    def compute_nodes(self) -> Iterator[fx.Node]:
        """Nodes that compute (``call_function``), in execution order."""
        return (n for n in self.graph_module.graph.nodes if n.op == "call_function")


def module_path(node: fx.Node) -> str:
    """Dotted path of the innermost module that ran ``node`` ("" for the root).

    >>> import torch
    >>> captured = capture(torch.nn.Sequential(torch.nn.Linear(2, 2)), (torch.randn(1, 2),))
    >>> [module_path(n) for n in captured.compute_nodes()]
    ['0']
    """
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def returns_alias(op: Any) -> bool:
    """Whether ATen ``op``'s schema says it returns an alias of an input: a view or an in-place op."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def aliases_input(node: fx.Node) -> bool:
    """Whether ``node``'s output shares its first argument's storage: a view or in-place ATen op, or an item of a
    multi-output op's result (``topk(...)[0]``)."""
    return node.target is operator.getitem or returns_alias(node.target)


def is_layout_copy(node: fx.Node) -> bool:
    """Whether ``node`` is a ``.contiguous()`` that copied: export records one only where the input's strides were
    not contiguous, and those depend on the kernel that made it (meta's attention math path returns a contiguous
    output where fused and CPU flash attention return the query's layout), so graphs of one model on two devices
    differ by such nodes and by nothing else."""
    return node.op == "call_function" and node.target is torch.ops.aten.contiguous.default


def name_layout_copies(graph_module: fx.GraphModule) -> fx.GraphModule:
    """Name each :func:`is_layout_copy` node after its input (``transpose_3_contiguous``), so that it has the same
    name in every graph that makes it, whichever other copies a device adds or leaves out; returns the module.

    >>> class Heads(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.transpose(0, 1).contiguous().view(-1)
    >>> [n.name for n in capture(Heads(), (torch.randn(2, 3),)).compute_nodes()]
    ['transpose', 'transpose_contiguous', 'view']
    """
    for n in graph_module.graph.nodes:
        if is_layout_copy(n) and isinstance(n.args[0], fx.Node):
            n._rename(f"{n.args[0].name}_contiguous")
    graph_module.recompile()
    return graph_module


def placed_stage_nodes(graph: fx.Graph, stage_nodes: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """``stage_nodes`` (node names per stage, of the graph a plan was made on) for ``graph``, a capture of the same
    model that may make other layout copies: a copy only ``graph`` makes joins the stage of its input (else of its
    first user), names ``graph`` lacks are dropped, and each stage lists its nodes in ``graph``'s order.

    >>> class Heads(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.transpose(0, 1).contiguous().view(-1)
    >>> graph = capture(Heads(), (torch.randn(2, 3),)).graph_module.graph
    >>> placed_stage_nodes(graph, [["transpose"], ["view", "other_contiguous"]])
    (('transpose', 'transpose_contiguous'), ('view',))
    """
    stage_of = {name: k for k, names in enumerate(stage_nodes) for name in names}
    placed: list[list[str]] = [[] for _ in stage_nodes]
    for n in graph.nodes:
        if n.name not in stage_of and is_layout_copy(n):
            near = [m.name for m in (*n.all_input_nodes, *n.users) if m.name in stage_of]
            if near:
                stage_of[n.name] = stage_of[near[0]]
        if n.name in stage_of:
            placed[stage_of[n.name]].append(n.name)
    return tuple(tuple(names) for names in placed)


def mutated_nodes(graph_module: fx.GraphModule) -> frozenset[str]:
    """Nodes whose output a later in-place op writes to (directly or through views): caching one of them in a
    selective checkpoint would hand the backward a value that has since changed.

    >>> import torch
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         h = x * 2
    ...         h.relu_()
    ...         return h + 1
    >>> sorted(mutated_nodes(capture(M(), (torch.randn(3),)).graph_module))
    ['mul', 'relu_']

    Through the items of a multi-output op (Mixtral's router normalises ``topk``'s values in place):

    >>> class Router(torch.nn.Module):
    ...     def forward(self, x):
    ...         weights, chosen = torch.topk(x.softmax(-1), 2)
    ...         weights /= weights.sum(-1, keepdim=True)
    ...         return weights * chosen
    >>> sorted(mutated_nodes(capture(Router(), (torch.randn(4, 8),)).graph_module))
    ['div_', 'getitem', 'getitem_1', 'topk']
    """
    base, written = _written_bases(graph_module.graph)
    return frozenset(n.name for n in graph_module.graph.nodes
                     if n.op == "call_function" and base.get(n, n) in written)


def _written_bases(graph: fx.Graph) -> tuple[dict[fx.Node, fx.Node], set[fx.Node]]:
    """Each view's (or in-place op's, or item's) base node in ``graph``, and the base nodes its ops write in
    place, directly or through views."""
    base: dict[fx.Node, fx.Node] = {}
    written: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if first is not None and aliases_input(n):
            base[n] = base.get(first, first)
        written.update(base.get(value, value) for value in written_arguments(n) if isinstance(value, fx.Node))
    return base, written


def written_arguments(node: fx.Node) -> list[Any]:
    """What ``node`` writes in place (``relu_``'s input, ``add_``'s first argument); empty for pure ops. For a
    section export wrapped in a submodule (``torch.no_grad()`` inside forward: ``wrap_with_set_grad_enabled``), the
    operands its ops write, directly or through views (a weight clamped in place, a running average updated).

    >>> class Clipped(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = torch.nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         with torch.no_grad():
    ...             self.lin.weight.clamp_(-1, 1)
    ...         return self.lin(x)
    >>> graph = capture(Clipped(), (torch.randn(3, 2),)).graph_module.graph
    >>> [[w.target for w in written_arguments(n)] for n in graph.nodes if written_arguments(n)]
    [['lin.weight']]
    """
    body_at = next((i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"
                    and isinstance(getattr(node.graph.owning_module, a.target, None), fx.GraphModule)), None)
    if node.op != "call_function" or body_at is None or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return written_inputs(node.target, node.args, node.kwargs)
    body = getattr(node.graph.owning_module, node.args[body_at].target)
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    written = _written_bases(body.graph)[1]
    operands = node.args[body_at + 1:]
    return [operands[i] for i, p in enumerate(placeholders) if p in written and i < len(operands)]


def written_inputs(target: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Which of ``args``/``kwargs`` a call of ``target`` (an ATen op) writes, by its schema; empty for pure ops.

    >>> aten = torch.ops.aten
    >>> written_inputs(aten.add_.Tensor, ("a", "b"), {}), written_inputs(aten.add.Tensor, ("a", "b"), {})
    (['a'], [])
    """
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    return [args[i] if i < len(args) else kwargs.get(a.name)
            for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def no_larger_than(graph: fx.Graph, other: fx.Graph) -> bool:
    """Whether ``graph`` is ``other`` run on inputs no larger: the same nodes in the same order (names, ops, targets
    and the nodes they read), each tensor of the same dtype with at most as many elements. A plan made for
    ``other`` then runs ``graph`` keeping and recomputing the same nodes, and holds no more memory at any point.

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    >>> short, long = (capture(model, (torch.randn(n, 8),)).graph_module.graph for n in (4, 6))
    >>> no_larger_than(short, long), no_larger_than(long, short)
    (True, False)
    """
    nodes, others = list(graph.nodes), list(other.nodes)
    return len(nodes) == len(others) and all(
        (a.name, a.op, a.target) == (b.name, b.op, b.target)
        and [x.name for x in a.all_input_nodes] == [x.name for x in b.all_input_nodes]
        and _no_larger(a.meta.get("val"), b.meta.get("val")) for a, b in zip(nodes, others))


def _no_larger(value: Any, other: Any) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
        return (isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and value.dtype == other.dtype
                and value.numel() <= other.numel())
    if isinstance(value, (tuple, list)) or isinstance(other, (tuple, list)):
        return (isinstance(value, (tuple, list)) and isinstance(other, (tuple, list)) and len(value) == len(other)
                and all(_no_larger(v, o) for v, o in zip(value, other)))
    return True  # sizes, flags, None: only tensors hold memory


def plan_key(signature: tuple, autocast: tuple, sharded: tuple | None = None, hooks: tuple = (),
             numbers: tuple = (), trained: tuple = (), modules: tuple = ()) -> tuple:
    """The key :class:`CapturedGraph` plans are cached under (see ``CapturedGraph.key``); ``sharded`` is the
    signature of the model's ``fully_shard`` units, None without any; ``hooks`` the model's hooks
    (:func:`hooks_signature`), but for a sharded model, whose FSDP hooks the planned graph runs itself; ``numbers``
    the numbers on its modules (:func:`numbers_signature`), ``trained`` which parameters train
    (:func:`trained_signature`), ``modules`` which modules it is made of (:func:`modules_signature`)."""
    numbered = (("numbers", numbers),) if numbers else ()
    numbered += (("trained", trained),) if trained else ()
    numbered += (("modules", modules),) if modules else ()
    if sharded is not None:
        return signature, autocast, sharded, *numbered
    return (signature, autocast, *((("hooks", hooks),) if hooks else ()), *numbered)


def numbers_signature(model: torch.nn.Module, modules: Sequence[torch.nn.Module] | None = None) -> tuple:
    """The ``int``, ``float`` and ``bool`` attributes of ``model``'s modules (a dropout's ``p``, a temperature, each
    module's ``training``; not ``nn.Module``'s other flags, nor one that equals its class's), by module and name:
    the captured graph holds each as the constant it was, so plans are cached under them too, and a number changed
    between calls (a temperature annealed, a dropout probability scheduled, a BatchNorm frozen with ``eval()``)
    makes the next call capture again with its new value. ``modules``: ``model.modules()``, listed before.

    >>> model = torch.nn.Dropout(0.1)
    >>> before = numbers_signature(model)
    >>> model.p = 0.2
    >>> numbers_signature(model) == before
    False
    """
    found = []
    for module in modules or model.modules():  # a loop, not a comprehension: 110 us for test-size GPT-2, not 250
        cls = type(module)
        for name, value in _number_attributes(module, _MODULE_INTERNALS):
            default = _class_default(cls, name)
            if type(default) is type(value) and default == value:  # reads the same without it
                continue
            found.append((id(module), name, type(value), value if value == value else "nan"))
    return tuple(found)


def _number_attributes(module: torch.nn.Module, excluded: AbstractSet[str]) -> Iterator[tuple[str, Any]]:
    """``module``'s own ``int``, ``float`` and ``bool`` attributes (in its ``__dict__``), by name, but the
    ``excluded`` names: what a captured graph holds as constants (:func:`numbers_signature`) and what a forward
    may change without the graph knowing (:func:`_numbers`)."""
    attributes = module.__dict__
    for name in attributes:
        value = attributes[name]
        if type(value) in _NUMBER_TYPES and name not in excluded:
            yield name, value


def modules_signature(model: torch.nn.Module, modules: Sequence[torch.nn.Module] | None = None) -> tuple:
    """Which module each of ``model``'s modules holds as each of its children, by identity: the captured graph runs
    the modules it was captured with, so plans are cached under them too, and a module replaced after planning
    (an activation swapped, a block dropped for ``nn.Identity``, a dropout made anew with another ``p``) makes the
    next call capture again. Until 2026-12-07 such a call ran the old modules: a loss of 0.41 where eager's was
    2.35. ``modules``: ``model.modules()``, listed before.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
    >>> before = modules_signature(model)
    >>> model[1] = torch.nn.ReLU()
    >>> modules_signature(model) == before
    False
    """
    return tuple(id(child) for module in modules or model.modules() for child in module._modules.values())


def replaced_modules(model: torch.nn.Module, modules: tuple, other_modules: tuple) -> list[str]:
    """The paths of ``model``'s modules that :func:`modules_signature` ``modules`` holds and ``other_modules``
    does not, outermost only (a replaced block's own layers are new too).

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Tanh()))
    >>> before = modules_signature(model)
    >>> model[1] = torch.nn.Sequential(torch.nn.ReLU())
    >>> replaced_modules(model, modules_signature(model), before)
    ['1']
    """
    new = set(modules) - set(other_modules)
    paths = [path for path, module in model.named_modules() if id(module) in new]
    return [path for path in paths if not any(path.startswith(outer + ".") for outer in paths)]


def trained_signature(model: torch.nn.Module, modules: Sequence[torch.nn.Module] | None = None) -> tuple:
    """Whether each parameter of ``model``'s modules requires gradients, in their order: a plan holds the gradients
    of those that do, so plans are cached under it too, and unfreezing layers after planning plans again (until
    2026-12-07 a 6-block MLP planned with 4 blocks frozen at 80% then stepped with all of them training at 482 MB,
    2.3 times its 211 MB budget).

    >>> model = torch.nn.Linear(2, 2)
    >>> trained_signature(model), trained_signature(model.requires_grad_(False))
    ((True, True), (False, False))
    """
    return tuple(p.requires_grad for module in modules or model.modules()
                 for p in module._parameters.values() if p is not None)


def _class_default(cls: type, name: str) -> Any:
    """What ``cls`` holds under ``name`` (None without it), remembered: a number an instance sets to its class's
    reads the same without it (Hugging Face's checkpointing, switched on and off, sets each layer's
    ``gradient_checkpointing`` to the ``False`` its class holds)."""
    key = (cls, name)
    if key not in _CLASS_DEFAULTS:
        _CLASS_DEFAULTS[key] = getattr(cls, name, None)
    return _CLASS_DEFAULTS[key]


_CLASS_DEFAULTS: dict[tuple[type, str], Any] = {}
_NUMBER_TYPES = frozenset((int, float, bool))
# nn.Module's own attributes but ``training`` (a BatchNorm frozen with eval() traces other ops):
# ``_is_full_backward_hook`` is left True when the hook is removed (the hooks are in hooks_signature)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}
_TRAINING = frozenset({"training"})


def hooks_signature(model: torch.nn.Module, modules: Sequence[torch.nn.Module] | None = None) -> tuple:
    """Which hooks ``model``'s modules have, and the global ones, by the code they run: a graph captured with other
    hooks does not run these (export traced those, or found none), so plans are cached under it too, and a hook
    registered after planning makes the next call capture and plan again, seeing it. ``modules``:
    ``model.modules()``, listed before (walking the model takes two thirds of the 60 us this takes for a GPT-2 of
    86 modules without it).

    >>> model = torch.nn.Linear(2, 2)
    >>> before = hooks_signature(model)
    >>> handle = model.register_forward_hook(lambda module, args, output: None)
    >>> hooks_signature(model) == before
    False
    >>> handle.remove()
    >>> hooks_signature(model) == before
    True
    """
    import torch.nn.modules.module as module_globals
    kinds = _FORWARD_HOOKS + _BACKWARD_HOOKS
    found = tuple(("*", kind, codes) for kind in kinds
                  if (codes := _hook_codes(getattr(module_globals, f"_global{kind}"))))
    return found + tuple((id(module), kind, codes) for module in modules or model.modules() for kind in kinds
                         if module.__dict__[kind] and (codes := _hook_codes(module.__dict__[kind])))


def _hook_codes(hooks: dict) -> tuple:
    """What the hooks run: each one's function code (a hook registered anew is the same hook), or its type for a
    callable object; Hugging Face's ``make_inputs_require_grads`` left out (its checkpointing switched on adds it
    again each time, and switched off leaves it; its one effect matters only to reentrant checkpoints, which a
    planned graph does not run)."""
    functions = [_hook_function(hook) for hook in hooks.values() if not _traced_whole(hook)]
    return tuple(getattr(function, "__code__", type(function)) for function in functions)


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """Shapes, dtypes and devices of tensor inputs, and values of the others: the key plans are cached under."""
    leaves, spec = tree_flatten((args, kwargs))
    described = tuple(
        ("tensor", tuple(x.shape), str(x.dtype), x.device.type, bool(x.requires_grad))
        if isinstance(x, torch.Tensor) else ("value", repr(x))
        for x in leaves)
    return (str(spec), described)


def autocast_state() -> tuple:
    """The devices autocast is on for and their dtypes: a plan is profiled, and runs, in one precision.

    >>> import torch
    >>> autocast_state()
    ()
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     autocast_state()
    (('cpu', 'torch.bfloat16'),)
    """
    return tuple((device, str(torch.get_autocast_dtype(device))) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


@contextlib.contextmanager
def casts_uncached() -> Iterator[None]:
    """Autocast's cache of weight casts off (as it was again after): every cast is made where it is used and lives
    as long as what reads or saves it. How a planned module runs, and how it is profiled, under ``torch.autocast``.

    With the cache, a weight's low-precision copy lives until the outermost autocast block ends, whoever made it:
    a checkpoint region's forward would keep the casts it does not save, a recomputation would make again the casts
    its forward found made (a weight read twice, as in ALBERT's shared layers), and a recomputed cached node would
    replay other ops than its forward recorded.

    >>> import torch
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     with casts_uncached():
    ...         inside = torch.is_autocast_cache_enabled()
    ...     inside, torch.is_autocast_cache_enabled()
    (False, True)
    """
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


@contextlib.contextmanager
def outside_autocast() -> Iterator[None]:
    """Autocast off on every device it is on for: where a training step runs its backward (``with autocast:`` holds
    the forward and the loss, ``loss.backward()`` comes after it). A checkpoint's recomputation still runs in the
    autocast state of its forward.

    >>> import torch
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     with outside_autocast():
    ...         inside = autocast_state()
    ...     inside, autocast_state()
    ((), (('cpu', 'torch.bfloat16'),))
    """
    with contextlib.ExitStack() as stack:
        for device, _ in autocast_state():
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


@functools.cache
def _forward_parameters(forward: Any) -> tuple[tuple[str, Any], ...]:
    """The names and kinds of a forward function's parameters (none where it has no signature)."""
    try:
        return tuple((p.name, p.kind) for p in inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return ()


def _takes_use_cache(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward takes ``use_cache``: by name, or, for a PEFT model (``get_base_model``), passed
    on through its keyword arguments to a base model that takes it."""
    parameters = _forward_parameters(getattr(model.forward, "__func__", model.forward))
    if any(name == "use_cache" for name, _ in parameters):
        return True
    base = getattr(model, "get_base_model", None)
    if not (callable(base) and any(kind is inspect.Parameter.VAR_KEYWORD for _, kind in parameters)):
        return False
    inner = base()
    return isinstance(inner, torch.nn.Module) and inner is not model and _takes_use_cache(inner)


def drops_cache(model: torch.nn.Module, kwargs: dict) -> bool:
    """Whether ``model`` is captured with ``use_cache=False`` bound: a Hugging Face model in training that takes
    ``use_cache`` and was not given it. Training needs no key/value cache (``gradient_checkpointing_enable`` turns
    it off too), a cache object in the output does not capture (torch.export knows no ``DynamicCache``), and held
    through the backward it would keep every layer's keys and values. An explicit ``use_cache`` is left as given.

    >>> import transformers
    >>> gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    >>> drops_cache(gpt2.train(), {"labels": None}), drops_cache(gpt2.eval(), {})
    (True, False)
    >>> drops_cache(gpt2.train(), {"use_cache": True}), drops_cache(torch.nn.Linear(2, 2), {})
    (False, False)
    """
    if not model.training or "use_cache" in kwargs or not getattr(getattr(model, "config", None), "use_cache", False):
        return False
    return _takes_use_cache(model)


@contextlib.contextmanager
def _cache_dropped(model: torch.nn.Module, kwargs: dict) -> Iterator[None]:
    """While exporting, ``model.forward`` with ``use_cache=False`` bound when :func:`drops_cache`: the graph
    computes what the model does without a cache, and is called with the caller's own arguments."""
    if not drops_cache(model, kwargs):
        yield
        return
    own = model.__dict__.get("forward")  # an instance attribute already (accelerate's hooks), or None
    model.forward = functools.partial(model.forward, use_cache=False)
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


_FORWARD_HOOKS, _BACKWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks"), ("_backward_pre_hooks", "_backward_hooks")
_TRACED_HOOKS = frozenset({"make_inputs_require_grads"})  # Hugging Face's (PEFT's): its one effect is in the graph


class ForwardHookWarning(UserWarning):
    """A global forward hook (``register_module_forward_hook``, on every module, so no part runs without it):
    torch.export traces its tensor ops into the graph, but its other effects (recording outputs, logging) ran once,
    at capture, and do not run in the planned module."""


class OwnCheckpointsWarning(UserWarning):
    """A model that checkpoints itself (``torch.utils.checkpoint``, Hugging Face's ``gradient_checkpointing_enable``)
    was planned for a share of its eager peak: the plan replaces its checkpoints, and the share is of the step
    without them, which may allow more memory than its own checkpoints took."""


class RecaptureWarning(UserWarning):
    """Numbers the graph holds as constants (on the model's modules, or inputs that are not tensors) keep changing
    between calls, and each change captures the model again."""


def changed_values(numbers: tuple, other_numbers: tuple, signature: tuple, other_signature: tuple,
                   model: torch.nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """What differs between two calls besides tensors' shapes: the numbers on ``model``'s modules
    (:func:`numbers_signature`) by path, and the inputs that are not tensors (:func:`input_signature`) by where they
    are in ``(args, kwargs)``. Empty when their input structure or any tensor differs.

    >>> model = torch.nn.Dropout(0.1)
    >>> x = torch.ones(2)
    >>> before, signature = numbers_signature(model), input_signature((x, 0.5), {})
    >>> model.p = 0.2
    >>> changed_values(numbers_signature(model), before, input_signature((x, 0.7), {}), signature, model, (x, 0.7), {})
    ['p', 'args[1]']
    """
    (spec, described), (other_spec, other_described) = signature, other_signature
    if spec != other_spec or len(described) != len(other_described):
        return []
    if any(d != o for d, o in zip(described, other_described) if d[0] == "tensor" or o[0] == "tensor"):
        return []
    paths = {id(module): path for path, module in model.named_modules()}
    old = {(module, name): value for module, name, _, value in other_numbers}
    names = [f"{paths[module]}.{name}" if paths.get(module) else name for module, name, _, value in numbers
             if (module, name) in old and old[module, name] != value]
    leaves = tree_flatten_with_path((args, kwargs))[0]
    where = ["args" + keystr(path[1:]) if path[0].idx == 0 else "kwargs" + keystr(path[1:]) for path, _ in leaves]
    return names + [place for place, d, o in zip(where, described, other_described) if d != o]


def _hook_function(hook: Any) -> Any:
    """The function a hook calls, out of a ``functools.partial`` or a bound method."""
    hook = getattr(hook, "func", hook)
    return getattr(hook, "__func__", hook)


def _traced_whole(hook: Any) -> bool:
    """Whether ``hook`` is one whose only effect the graph holds (:data:`_TRACED_HOOKS`)."""
    return getattr(_hook_function(hook), "__name__", None) in _TRACED_HOOKS


def _foreign(hook: Any, collected_inside: bool = False) -> bool:
    """Whether ``hook`` is the user's: not torch's, the planner's, or one whose only effect the graph holds
    (:data:`_TRACED_HOOKS`, or Hugging Face's output-capturing hook on a module whose outputs are collected by a
    forward inside the captured one: ``collected_inside``, :func:`_collecting_paths`)."""
    if is_own_code(hook) or _traced_whole(hook):
        return False
    return not (collected_inside and _captures_outputs(hook))


def _captures_outputs(hook: Any) -> bool:
    """Whether ``hook`` is the forward hook by which a Hugging Face model collects its layers' outputs
    (``output_hidden_states``, ``output_attentions``; ``transformers.utils.output_capturing``)."""
    function = _hook_function(hook)
    return (getattr(function, "__name__", None) == "output_capturing_hook"
            and getattr(function, "__module__", "").startswith("transformers."))


def _collects_outputs(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is wrapped by Hugging Face's ``capture_outputs``, which sets the collector the
    output-capturing hooks below it append to, and returns what they appended."""
    forward = getattr(type(module), "forward", None)
    while forward is not None:
        code = getattr(forward, "__code__", None)  # functools.wraps gave the wrapper the forward's own names
        if code is not None and code.co_name == "wrapper" and Path(code.co_filename).parts[-3:] == _COLLECTING:
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


_COLLECTING = ("transformers", "utils", "output_capturing.py")  # where capture_outputs' wrapper is defined


def _collecting_paths(model: torch.nn.Module) -> list[str]:
    """Paths of ``model``'s modules (itself "") whose forward collects outputs (:func:`_collects_outputs`): within
    a call of ``model`` each sets the collector afresh, so an output-capturing hook below one of them appends to a
    collector of that call and returns through its outputs, which the graph holds. Above none (``model`` is part
    of a model that collects), a hook appends to a collector of a call outside the graph, and must run."""
    return [path for path, module in model.named_modules() if _collects_outputs(module)]


def _below(path: str, ancestors: list[str]) -> bool:
    """Whether module ``path`` is one of ``ancestors`` or inside one ("" is the root)."""
    return any(a == "" or path == a or path.startswith(a + ".") for a in ancestors)


def hooked_modules(model: torch.nn.Module, kinds: Sequence[str] = _BACKWARD_HOOKS) -> list[str]:
    """Paths of the modules of ``model`` ("" for itself; "*" for all, a global hook) with hooks of the user's of
    ``kinds`` (backward hooks unless told otherwise). A planned module runs the captured graph instead of the
    modules: torch.export drops backward hooks, and traces a forward hook's tensor ops once, with fake tensors.
    Torch's own hooks (weight and spectral normalisation, quantization observers, FSDP's) are left out.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> handle = model[1].register_full_backward_hook(lambda module, grad_input, grad_output: None)
    >>> hooked_modules(model), hooked_modules(model, _FORWARD_HOOKS)
    (['1'], [])
    >>> hooked_modules(torch.nn.utils.weight_norm(torch.nn.Linear(2, 2)), _FORWARD_HOOKS)
    []
    """
    import torch.nn.modules.module as module_globals
    if any(_foreign(hook) for kind in kinds for hook in getattr(module_globals, f"_global{kind}").values()):
        return ["*"]
    collecting = _collecting_paths(model)
    return [path for path, module in model.named_modules()
            if any(_foreign(hook, _below(path, collecting))
                   for kind in kinds for hook in getattr(module, kind).values())]


def _described(paths: list[str]) -> str:
    if paths == ["*"]:
        return "every module (a global hook)"
    return ", ".join(repr(p) for p in paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


_HOOKED_RUN_EAGERLY = ("planner.optimize plans the submodules without them and runs the hooked ones eagerly, hooks "
                       "included; or remove the hooks while planning")


def check_initialized(model: torch.nn.Module) -> None:
    """Raise where ``model`` has parameters or buffers of lazy modules (``nn.LazyLinear``) not yet initialized:
    their shapes come from the first forward, which the plan cannot be made without, and an optimizer made before
    it would hold them uninitialized.

    >>> check_initialized(torch.nn.Sequential(torch.nn.LazyLinear(4)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    planner.errors.PlannerError: Sequential has parameters that are not initialized yet (0.weight, 0.bias, ...
    """
    lazy = [name for name, tensor in (*model.named_parameters(), *model.named_buffers())
            if torch.nn.parameter.is_lazy(tensor)]
    if lazy:
        raise PlannerError(f"{type(model).__name__} has parameters that are not initialized yet "
                           f"({', '.join(lazy[:3])}{' and more' if len(lazy) > 3 else ''}, of lazy modules): their "
                           f"shapes come from the model's first call",
                           hint="run the model once on a batch (model(x)) before planning it, as before making its "
                                "optimizer")


def _check_hooks(model: torch.nn.Module) -> None:
    """Raise when ``model``'s modules have hooks of the user's, backward or forward; warn for a global forward hook,
    which no part is without. A forward hook's tensor ops would be in the graph, but what else it does (records an
    output, logs) would have run once, at capture, on fake tensors: until 2026-12-07 such hooks were traced, and a
    hook recording each step's activations recorded one fake tensor."""
    backward = hooked_modules(model)
    if backward:
        raise PlannerError(f"{type(model).__name__} has backward hooks on {_described(backward)}: the planned "
                           "module runs the captured graph, not the modules, so they would not run",
                           hint=_HOOKED_RUN_EAGERLY)
    forward = hooked_modules(model, _FORWARD_HOOKS)
    if forward and forward != ["*"]:
        raise PlannerError(f"{type(model).__name__} has forward hooks on {_described(forward)}: the planned module "
                           "runs the captured graph, not the modules, so what they do besides tensor ops (recording "
                           "outputs, logging) would not run",
                           hint=_HOOKED_RUN_EAGERLY)
    if forward:
        warn_at_callers_line(ForwardHookWarning(
            f"{type(model).__name__} has forward hooks on {_described(forward)}: the planned module computes "
            "what they do to tensors, but anything else they do (recording outputs, logging) ran once while "
            "capturing and will not run again; remove them before planning if it matters"))


@contextlib.contextmanager
def _tensor_hooks_recorded() -> Iterator[list[Any]]:
    """While the model is exported: the gradient hooks of the user's that its forward registers on tensors, which
    the exported graph would drop."""
    found: list[Any] = []
    register_hook = torch.Tensor.register_hook

    def recording_register_hook(tensor, hook):
        if not is_own_code(hook):
            found.append(hook)
        return register_hook(tensor, hook)

    torch.Tensor.register_hook = recording_register_hook
    try:
        yield found
    finally:
        torch.Tensor.register_hook = register_hook


@contextlib.contextmanager
def _counters_recorded(model: torch.nn.Module) -> Iterator[list[str]]:
    """The numbers (``int``, ``float``, ``bool`` attributes of ``model``'s modules, ``training`` aside) that its
    forward changed, by path (the list it yields, filled on exit): a captured graph reads each as the constant it
    was, and never changes it (a step counter that a warm-up reads would stay where it was). Read at the end of the
    forward, as export puts the attributes back after.

    >>> class Counting(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.steps = 0
    ...     def forward(self, x):
    ...         self.steps += 1
    ...         return x * self.steps
    >>> model = Counting()
    >>> with _counters_recorded(model) as changed:
    ...     _ = model(torch.ones(2))
    >>> changed
    ['steps']
    """
    before, changed = _numbers(model), []
    with _read_at_forward_end(model, lambda: _numbers(model)) as after:
        try:
            yield changed
        finally:
            changed.extend(name for name, (_, _, value) in after.items()
                           if name in before and before[name][2] != value)


@contextlib.contextmanager
def _read_at_forward_end(model: torch.nn.Module, read: Callable[[], dict]) -> Iterator[dict]:
    """A dict that gets what ``read()`` returns at the end of ``model``'s forward in the block (empty until then):
    export puts the model's attributes back after its forward, so what the forward changed is read inside it."""
    after: dict = {}

    def at_the_end(module, args, output):
        after.update(read())
    handle = model.register_forward_hook(at_the_end)
    try:
        yield after
    finally:
        handle.remove()


def _numbers(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, Any]]:
    """The ``int``, ``float`` and ``bool`` attributes of ``model``'s modules but ``training``, by path: the module,
    the name and the value of each."""
    return {f"{path}.{name}" if path else name: (module, name, value) for path, module in model.named_modules()
            for name, value in _number_attributes(module, _TRAINING)}


# What nn.Module.__init__ sets on every module (its parameters, buffers, children, hooks): not the model's own state
_MODULE_OWN = frozenset(vars(torch.nn.Module()))
_CONTAINERS = (list, dict, set, collections.deque)


def _held_objects(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, Any, tuple]]:
    """The tensors (not parameters or buffers: plain attributes) and containers (lists, dicts, sets, deques) held
    by ``model``'s modules, by path: the module, the name, the object and a summary that changes when a forward
    sets or fills it (the tensor's identity; the container's length and the identities of the tensors in it)."""
    held = {}
    for path, module in model.named_modules():
        libraries = _library_classes(type(module))
        if type(module) is not torch.nn.Module and type(module).__module__.startswith("torch."):
            continue  # what torch's modules keep (an LSTM's flat weights) is their own
        for name, value in vars(module).items():
            if name in _MODULE_OWN or isinstance(value, torch.nn.Parameter) or (libraries and name.startswith("_")):
                continue
            if isinstance(value, torch.Tensor):
                summary: tuple = ("tensor", id(value))
            elif type(value) in _CONTAINERS:
                items = value.values() if isinstance(value, dict) else value
                summary = (type(value).__name__, len(value), tuple(id(v) for v in items if isinstance(v, torch.Tensor)))
            else:
                continue
            held[f"{path}.{name}" if path else name] = (module, name, value, summary)
    return held


@contextlib.contextmanager
def _objects_set_recorded(model: torch.nn.Module) -> Iterator[list[str]]:
    """The tensors and containers (see :func:`_held_objects`) that ``model``'s forward set or filled, by path, each
    with what it did (the list it yields, filled on exit): a captured graph does neither, so after a planned step
    they would still hold what they held before (an attention map kept for a plot, a mixture of experts' load
    balancing loss that the training loop adds to its own). Read at the end of the forward, as export puts the
    attributes back after.

    >>> class Recording(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.norms = []
    ...     def forward(self, x):
    ...         self.last = x * 2
    ...         self.norms.append(x.norm())
    ...         return self.last
    >>> model = Recording()
    >>> with _objects_set_recorded(model) as changed:
    ...     _ = model(torch.ones(2))
    >>> changed
    ['norms (filled)', 'last (set)']
    """
    before, changed = _held_objects(model), []
    with _read_at_forward_end(model, lambda: _held_objects(model)) as after:
        try:
            yield changed
        finally:
            remade = _remade_by_torchs_hooks(model)
            for path, (_, _, value, summary) in after.items():
                if path in remade:
                    continue
                if path not in before or before[path][2] is not value:
                    changed.append(f"{path} (set)")
                elif before[path][3] != summary:
                    changed.append(f"{path} (filled)")


@functools.lru_cache(maxsize=None)
def _library_classes(cls: type) -> frozenset[type]:
    """The classes in ``cls``'s MRO that torch or the planner define, ``nn.Module`` aside (a user's subclass of
    ``nn.LSTM`` has ``nn.LSTM`` and ``nn.RNNBase``): their private attributes are theirs (the planner's module keeps
    its plans and open calls)."""
    return frozenset(c for c in cls.__mro__
                     if c.__module__.startswith(("torch.", "planner.")) and c is not torch.nn.Module)


@contextlib.contextmanager
def _buffers_assigned_recorded(model: torch.nn.Module) -> Iterator[list[str]]:
    """The buffers of ``model`` that its forward assigned anew (``self.running = self.running * 0.9 + ...``) or
    registered (a cache made on the first call), by name (the list it yields, filled on exit). ``torch.export``
    records such an assignment for the root module's buffers only: for a submodule's, the graph it made never
    updated the buffer (2.13); and no graph registers a buffer.

    >>> class Averaging(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("running", torch.zeros(2))
    ...     def forward(self, x):
    ...         self.running = 0.9 * self.running + 0.1 * x.detach()
    ...         return x - self.running
    >>> model = torch.nn.Sequential(Averaging())
    >>> with _buffers_assigned_recorded(model) as assigned:
    ...     _ = model(torch.ones(2))
    >>> assigned
    ['0.running']
    """
    before: dict[str, int] = {}

    def identities() -> dict[str, int]:
        return {name: id(b) for name, b in model.named_buffers()}

    def at_the_start(module, args):  # inside the trace: export has put its own tensors in the buffers' places
        before.update(identities())
    handle = model.register_forward_pre_hook(at_the_start)
    assigned: list[str] = []
    with _read_at_forward_end(model, identities) as after:
        try:
            yield assigned
        finally:
            handle.remove()
            assigned.extend(name for name, identity in after.items() if before.get(name) != identity)


def _written_attributes(graph_module: fx.GraphModule) -> set[str]:
    """The attributes (buffers) of ``graph_module`` that its graph writes in place, directly or through views: a
    buffer the model assigned anew, as ``torch.export`` records it (a ``copy_`` into it at the end).

    >>> class Counting(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("seen", torch.zeros(()))
    ...     def forward(self, x):
    ...         self.seen += 1
    ...         return x * 2
    >>> _written_attributes(capture(Counting(), (torch.ones(2),)).graph_module)
    {'seen'}
    """
    written = _written_bases(graph_module.graph)[1]
    return {n.target for n in written if n.op == "get_attr"}


def entangled_state(graph: fx.Graph) -> list[str]:
    """Buffers and inputs that ``graph`` writes in place in a way no checkpoint region can hold, by name: read
    before the write (a region that reads one, recomputed after the write, would read the new value, and autograd
    refuses), or written from the step's activations and read after (the write would have to run in the middle of
    a region, or run again in its recomputation). BatchNorm's own statistics are the kernel's, and safe. Writes
    that only state reads after (a counter, a clamp, a running average nothing reads in the step) are safe too:
    they run once, outside regions (:mod:`planner.rewrite`).

    >>> class Normalizing(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("mean", torch.zeros(2))
    ...     def forward(self, x):
    ...         y = x - self.mean
    ...         with torch.no_grad():
    ...             self.mean.mul_(0.9).add_(0.1 * x.mean(0))
    ...         return y
    >>> exported = torch.export.export(Normalizing(), (torch.ones(3, 2),), strict=False)
    >>> entangled_state(exported.module().graph)
    ['mean']
    """
    base = _written_bases(graph)[0]
    read: set[fx.Node] = set()
    from_activations: set[fx.Node] = set()
    entangled: dict[str, None] = {}
    for n in graph.nodes:
        if n.op != "call_function" or n.target is torch.ops.aten.batch_norm.default:
            continue
        written = {base.get(w, w) for w in written_arguments(n) if isinstance(w, fx.Node)}
        states = {w for w in written if w.op in ("get_attr", "placeholder")}
        sources = {base.get(x, x) for x in n.all_input_nodes} - written
        for state in states:
            if state in read:
                entangled[_state_name(state)] = None
            if any(x.op == "call_function" for x in sources):
                from_activations.add(state)
        if n in base and not written:
            continue  # a view reads nothing yet
        for state in sources & from_activations:
            entangled[_state_name(state)] = None
        read.update(x for x in sources if x.op in ("get_attr", "placeholder"))
    return list(entangled)


def _state_name(node: fx.Node) -> str:
    """A buffer's path on the model (``vq.codebook``), or an input's name."""
    return str(node.target) if node.op == "get_attr" else node.name


def _remade_by_torchs_hooks(model: torch.nn.Module) -> set[str]:
    """Attributes that torch's own forward pre-hooks make again before each forward, from parameters
    (``torch.nn.utils.weight_norm``'s ``weight``, ``spectral_norm``'s), by path: the graph computes them itself."""
    return {f"{path}.{hook.name}" if path else hook.name for path, module in model.named_modules()
            for hook in module._forward_pre_hooks.values()
            if is_own_code(hook) and isinstance(getattr(hook, "name", None), str)}


@contextlib.contextmanager
def _objects_kept(model: torch.nn.Module) -> Iterator[None]:
    """Put back the tensors and containers of ``model``'s modules (see :func:`_held_objects`) as they were before
    the block: each attribute's object, each container's items, and each module's buffers (one registered in the
    block goes; until 2026-12-07 a buffer a forward registered on its first call was left a fake tensor by
    capture, which the model's own forward and its state dict then held)."""
    before = _held_objects(model)
    items = {path: type(value)(value) for path, (_, _, value, _) in before.items()
             if not isinstance(value, torch.Tensor)}  # a shallow copy of each container
    attributes = _attributes_of(model)  # None, say, before a tensor
    buffers = _buffers_of(model)
    try:
        yield
    finally:
        _put_buffers_back(buffers)  # a buffer registered in forward goes (export's would be a fake tensor)
        for path, (module, name, _, _) in _held_objects(model).items():
            if path not in before:
                _put_back(module, name, attributes)
        for path, (module, name, value, _) in before.items():
            setattr(module, name, value)
            if path in items:
                _refill(value, items[path])


def _attributes_of(model: torch.nn.Module) -> dict[int, dict[str, Any]]:
    """Each module's own attributes (a copy of its ``__dict__``), by the module's identity."""
    return {id(module): dict(vars(module)) for module in model.modules()}


def _put_back(module: torch.nn.Module, name: str, attributes: dict[int, dict[str, Any]]) -> None:
    """Set ``module``'s attribute ``name`` to what it held in ``attributes`` (:func:`_attributes_of`), or delete
    it where it had none."""
    before = attributes.get(id(module), {})
    if name in before:
        setattr(module, name, before[name])
    else:
        delattr(module, name)


def _buffers_of(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict, set]]:
    """Each module with its buffers by name and the names of its non-persistent ones, as they are now."""
    return [(module, dict(module._buffers), set(module._non_persistent_buffers_set)) for module in model.modules()]


def _put_buffers_back(buffers: list[tuple[torch.nn.Module, dict, set]]) -> None:
    """Make each module hold the buffers :func:`_buffers_of` saw, and those only (one registered since goes)."""
    for module, kept, non_persistent in buffers:
        module._buffers.clear()
        module._buffers.update(kept)
        module._non_persistent_buffers_set.clear()
        module._non_persistent_buffers_set.update(non_persistent)


def _refill(container: Any, items: Any) -> None:
    """Make ``container`` (a list, dict, set or deque) hold ``items`` (a copy of its kind) again."""
    container.clear()
    if isinstance(container, (dict, set)):
        container.update(items)
    else:
        container.extend(items)


@contextlib.contextmanager
def numbers_kept(model: torch.nn.Module) -> Iterator[None]:
    """Run an eager step that is not the caller's (planning's measurements): the numbers its forward changes
    (see :func:`_counters_recorded`) are put back after, as are the tensors and containers its modules hold
    (:func:`_objects_set_recorded`: a list it appends to grows by the caller's steps only) and Python's and NumPy's
    generators (:func:`python_draws_recorded`).

    A number that was none before (a cache's length, set with the cache on the first call) is put back as it
    was too: until 2026-12-08 it stayed, while the cache went back to ``None``, and the next forward took the
    cache for filled and read ``None``.

    >>> model = torch.nn.Linear(2, 2)
    >>> model.steps, model.cached_length = 0, None
    >>> with numbers_kept(model):
    ...     model.steps += 1
    ...     model.cached_length, model.seen = 128, True
    >>> model.steps, model.cached_length, hasattr(model, "seen")
    (0, None, False)
    """
    before, attributes = _numbers(model), _attributes_of(model)
    try:
        with python_draws_recorded(), _objects_kept(model):
            yield
    finally:
        for module, name, value in before.values():
            setattr(module, name, value)
        for path, (module, name, _) in _numbers(model).items():
            if path not in before and id(module) in attributes:
                _put_back(module, name, attributes)


def _check_gradients_kept(model: torch.nn.Module, hooks: list[Any]) -> None:
    """Raise when the model's forward registered gradient hooks on tensors (:func:`_tensor_hooks_recorded`)."""
    if not hooks:
        return
    named = getattr(hooks[0], "__qualname__", type(hooks[0]).__name__)
    raise PlannerError(
        f"{type(model).__name__}'s forward registers {len(hooks)} gradient hook(s) on tensors (Tensor.register_hook, "
        f"the first {named}), which torch.export drops (it keeps only the forward's ops), so its captured graph "
        "would train differently",
        hint="planner.optimize plans the submodules that register none and runs the rest eagerly; to plan the "
             "whole model, register gradient hooks on parameters (once, outside forward) or write the hooked step as "
             "a custom autograd.Function")


class _NoUserCodeFilter(logging.Filter):
    """Drops the warning that ``torch.export`` found no user code for an unbacked symbol, which it logs while
    wording the error of a data-dependent guard."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unable to find user code")


@contextlib.contextmanager
def python_draws_recorded() -> Iterator[list[str]]:
    """Which of Python's and NumPy's global random generators the code inside drew from (the list it yields, filled
    on exit); both are put back as they were, so that capturing draws nothing for the caller.

    >>> import random
    >>> with python_draws_recorded() as drawn:
    ...     _ = random.random()
    >>> drawn
    ["Python's random module"]
    >>> with python_draws_recorded() as drawn:
    ...     pass
    >>> drawn
    []
    """
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    drawn: list[str] = []
    try:
        yield drawn
    finally:
        if random.getstate() != python_state:
            drawn.append("Python's random module")
            random.setstate(python_state)
        if numpy_state is not None and not _same_numpy_state(numpy.random.get_state(), numpy_state):
            drawn.append("NumPy's global generator")
            numpy.random.set_state(numpy_state)


def _same_numpy_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and (a[1] == b[1]).all() and tuple(a[2:]) == tuple(b[2:])


@contextlib.contextmanager
def _export_failure_unprinted() -> Iterator[None]:
    """What Python writes to ``sys.stderr`` inside, written there after it, but for what ``torch.export`` prints
    when it fails on data-dependent control flow (and its warning about tensors a forward sets, which capture
    deals with): the partial graph, the whole traced forward a line per op (1,500
    lines for a 3-layer DeBERTa), twice, and a warning that it found no user code for the symbol; again for each
    part tried when the model is then planned in parts. The error that follows says what failed, and keeps the
    graph (``__cause__.partial_fx_graph``).

    >>> with _export_failure_unprinted():
    ...     print("kept", file=sys.stderr)
    """
    written, quiet = io.StringIO(), _NoUserCodeFilter()
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    shapes_log.addFilter(quiet)
    try:
        with contextlib.redirect_stderr(written), warnings.catch_warnings():
            # capture says what it makes of tensors a forward sets (_check_state_kept), and refills caches
            warnings.filterwarnings("ignore", message="The tensor attributes .* were assigned during export")
            yield
    except BaseException as exc:
        graph = getattr(exc, "partial_fx_graph", None)
        text = written.getvalue()
        sys.stderr.write(text.replace(f"{graph}\n", "") if graph is not None else text)
        raise
    finally:
        shapes_log.removeFilter(quiet)
    sys.stderr.write(written.getvalue())


def detached_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each tensor a leaf of no graph, on the same storage and requiring gradients as
    it does (one object given twice stays one): planning runs the step's backward through its inputs many times,
    which must neither add to the caller's ``.grad`` of an input (a 4-block MLP planned on its first call with an
    input requiring gradients returned 334 times the input's gradient until 2026-12-07) nor reach a graph the
    input belongs to (a discriminator planned on the generator's output raised "Trying to backward through the
    graph a second time", after adding to the generator's gradients).

    >>> x = torch.ones(2, requires_grad=True)
    >>> y = x * 2
    >>> (a, b), kw = detached_inputs((x, y), {"again": y})
    >>> a.is_leaf and b.is_leaf and a.requires_grad and b.requires_grad, kw["again"] is b
    (True, True)
    >>> b.data_ptr() == y.data_ptr()
    True
    """
    leaves, spec = tree_flatten((args, kwargs))
    made: dict[int, torch.Tensor] = {}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and id(leaf) not in made:
            made[id(leaf)] = leaf.detach().requires_grad_(leaf.requires_grad)
    return tree_unflatten([made.get(id(leaf), leaf) if isinstance(leaf, torch.Tensor) else leaf
                           for leaf in leaves], spec)


@contextlib.contextmanager
def inputs_restored(args: tuple, kwargs: dict) -> Iterator[None]:
    """Planning leaves the inputs it ran on as they were: a model that writes an input in place (``x /= 255``,
    ``ids.masked_fill_(...)``) writes it in every one of planning's steps, so each tensor input whose version
    counter moved meanwhile is copied back from a snapshot taken before (on the host for a GPU's). Until
    2026-12-07 a 4-block MLP that halved its input in place, planned on its first call, trained that call on an
    input halved by every profiling step (all zeros), and a plan made with ``example_inputs`` zeroed them.

    >>> x = torch.ones(3)
    >>> with inputs_restored((x,), {}):
    ...     _ = x.mul_(2)
    >>> x
    tensor([1., 1., 1.])
    """
    tensors = {id(t): t for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor) and t.device.type != "meta" and not t.is_inference()}
    saved = {key: (t._version, t.detach().to("cpu", copy=True)) for key, t in tensors.items()}
    try:
        yield
    finally:
        with torch.no_grad():
            for key, t in tensors.items():
                version, snapshot = saved[key]
                if t._version != version:
                    t.detach().copy_(snapshot)


def unaliased(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each tensor that is given again (the same object, as in ``model(input_ids=ids,
    labels=ids)``) copied after its first place. ``torch.export`` reads one input for both, so the graph it made
    from ``labels=ids`` embedded ``labels``: called later with labels of their own (-100 where padded), the planned
    GPT-2 or Qwen2 indexed its embedding with them and raised, and labels that were valid ids would have trained
    on the wrong tokens. Exported from copies, the graph reads each input where the model does.

    >>> ids = torch.arange(3)
    >>> (x,), kw = unaliased((ids,), {"labels": ids})
    >>> x is ids, kw["labels"] is ids, torch.equal(kw["labels"], ids)
    (True, False, True)
    """
    leaves, spec = tree_flatten((args, kwargs))
    seen: set[int] = set()
    copied = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if id(leaf) in seen:
                leaf = leaf.detach().clone().requires_grad_(leaf.requires_grad)
            else:
                seen.add(id(leaf))
        copied.append(leaf)
    return tree_unflatten(copied, spec)


class _StateSetError(PlannerError):
    """The forward set state on the model that the graph would not: numbers, tensors or containers of its modules,
    or buffers assigned or registered. Where a forward sets it on its first call only (a cache), capture again
    after one forward (:func:`capture`)."""


def _check_state_kept(model: torch.nn.Module, graph_module: fx.GraphModule, objects_set: list[str],
                      buffers_assigned: list[str]) -> None:
    """Raise where the planned module would not keep ``model``'s state as its forward does: buffers or inputs
    written where a region could not hold them (:func:`entangled_state`), buffers assigned or registered that the
    graph does not write (:func:`_buffers_assigned_recorded`), and tensors or containers set or filled
    (:func:`_objects_set_recorded`)."""
    entangled = entangled_state(graph_module.graph)
    if entangled:
        raise PlannerError(
            f"the forward of {type(model).__name__} writes {', '.join(entangled[:3])}"
            f"{' and more' if len(entangled) > 3 else ''} in place where it also reads "
            f"{'them' if len(entangled) > 1 else 'it'} (a running statistic read before its update, or updated from "
            f"this step's activations and read after): a checkpoint region around the read would see the new value "
            f"when recomputed, or write it twice",
            hint="optimize() plans the model's parts and runs the forward that writes it eagerly; to plan it whole, "
                 "read such state only before the step's own update and update it from no activation, or outside "
                 "forward")
    unrecorded = sorted(set(buffers_assigned) - _written_attributes(graph_module))
    if unrecorded:
        raise _StateSetError(
            f"the forward of {type(model).__name__} assigns or registers the buffer{'s' * (len(unrecorded) > 1)} "
            f"{', '.join(unrecorded[:3])}{' and more' if len(unrecorded) > 3 else ''}, which torch.export does "
            f"not record for a submodule's buffer: the captured graph would never update or register "
            f"{'them' if len(unrecorded) > 1 else 'it'}",
            hint="update such a buffer in place (self.running.mul_(0.9).add_(0.1 * x)), which the graph records; "
                 "optimize() plans the model's parts and runs the forward that assigns it eagerly")
    if objects_set:
        raise _StateSetError(
            f"the forward of {type(model).__name__} sets or fills {', '.join(objects_set[:3])}"
            f"{' and more' if len(objects_set) > 3 else ''}, which a captured graph would not do: after each planned "
            f"step they would hold what they held before it (an attention map kept for a plot, a load balancing "
            f"loss the training loop adds, would not be this step's)",
            hint="return such tensors from forward; optimize() plans the model's parts and runs the forward that "
                 "keeps them eagerly")


def capture(model: torch.nn.Module, example_args: tuple, example_kwargs: dict | None = None, *,
            replay_dropout: bool = True) -> CapturedGraph:
    """Export ``model`` for training and return its unlifted graph module.

    ``replay_dropout``: rewrite the dropouts of a graph that runs on the CPU so that a recomputation can keep their
    masks (:func:`planner.dropout.replayable_dropout`; not under autocast). Plans for another device (an analytic
    ``device=``) capture without it, as the model will run there.

    A Hugging Face model in training is captured with ``use_cache=False`` unless told otherwise
    (:func:`drops_cache`), and in a model that holds one, attention masks that are constants of the example shapes
    go back to the kernel as ``is_causal`` or no mask, and repeated key/value heads as ``enable_gqa``, as the model
    runs them eagerly (:func:`planner.attention.restore_attention`).

    Raises :class:`PlannerError` naming the cause when the model does not capture or the inputs do not fit it, and
    when the graph would not train as the model does: the model's modules have hooks of the user's, backward or
    forward (:func:`hooked_modules`; a global forward hook is traced, and a :class:`ForwardHookWarning` says that
    its other effects will not run), its forward registers gradient hooks on tensors, which torch.export drops, or
    it keeps state the graph would not (:func:`_check_state_kept`). What export's trace left on the model is put
    back (:func:`_objects_kept`). Where the forward set state on the model (numbers, tensors, containers, buffers),
    it may be a cache its first call fills: one forward without gradients fills it (:func:`_warmed_up`), and a
    capture that then sets nothing is the model as its later calls run it; else what that forward set is put back
    and the first refusal raised. The user's autograd.Functions are kept whole, forward and backward
    (:mod:`planner.functions`).
    """
    if not isinstance(model, torch.nn.Module):
        raise PlannerError(f"expected an nn.Module to plan, got {type(model).__name__}",
                           hint="pass the model itself, e.g. planner.optimize(model, budget, example_inputs=(x,))")
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    kwargs = dict(example_kwargs or {})
    if not any(isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs))[0]):
        raise PlannerError("example inputs contain no tensor",
                           hint="pass the inputs of one training step, e.g. example_inputs=(batch,)")
    check_initialized(model)
    _check_hooks(model)
    try:
        return _captured(model, args, kwargs, replay_dropout)
    except _StateSetError as error:
        first = error
    with _attributes_put_back_on_error(model):
        try:
            _warmed_up(model, args, kwargs)
        except Exception:
            raise first from None
        try:
            return _captured(model, args, kwargs, replay_dropout)
        except PlannerError:  # sets state again (not a cache), or fails another way once warm: as it was
            raise first from None


def _captured(model: torch.nn.Module, args: tuple, kwargs: dict, replay_dropout: bool) -> CapturedGraph:
    """:func:`capture` of one trace of the forward."""
    modes = [(module, module.training) for module in model.modules()]  # a BatchNorm frozen with eval() stays so
    try:
        with _cache_dropped(model, kwargs), functions_kept_whole(), checkpoints_traced() as own_checkpoints, \
                _tensor_hooks_recorded() as tensor_hooks, _export_failure_unprinted(), \
                python_draws_recorded() as python_draws, _counters_recorded(model) as counters, \
                _objects_kept(model), _objects_set_recorded(model) as objects_set, \
                _buffers_assigned_recorded(model) as buffers_assigned:
            exported = torch.export.export(model, *unaliased(args, kwargs), strict=False)
    except Exception as exc:  # export raises many types; all mean the same to the user
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PlannerError(
            f"could not capture {type(model).__name__} with torch.export ({type(exc).__name__}: {first_line})",
            hint="check that the example inputs are what forward() takes; models with data-dependent Python "
                 "control flow need torch.cond or fixed inputs; for Hugging Face models pass use_cache=False",
        ) from exc
    finally:
        for module, training in modes:
            module.training = training
    _check_gradients_kept(model, tensor_hooks)
    if python_draws:
        raise PlannerError(
            f"the forward of {type(model).__name__} draws from {' and '.join(python_draws)} (a layer skipped at "
            f"random, say), which a captured graph cannot repeat: it would run the choices of this one call on "
            f"every step",
            hint="draw with torch instead (torch.rand(()) < p): the model is then planned in parts, and its "
                 "forward makes the choice each step")
    if counters:
        raise _StateSetError(
            f"the forward of {type(model).__name__} changes {', '.join(counters[:3])}"
            f"{' and more' if len(counters) > 3 else ''}, which a captured graph would neither change nor read "
            f"again: it would run with the value of this one call on every step",
            hint="keep such state in a buffer (register_buffer) that forward updates in place, or change it "
                 "outside forward; optimize() plans the model's parts and runs its forward eagerly")
    _check_hooks(model)  # and those its forward registered (transformers' output-capturing hooks, on the first call)
    graph_module, autocast = exported.module(), autocast_state()
    _check_state_kept(model, graph_module, objects_set, buffers_assigned)
    restore_attention(graph_module, model)  # is_causal and enable_gqa where Hugging Face passes them eagerly
    if replay_dropout and not autocast:  # under autocast the attention's math path casts its inputs: one op
        replayable_dropout(graph_module)
    name_layout_copies(graph_module)
    name_function_calls(graph_module)
    # keyed by the model as its forward left it, as the next call finds it (a flag set on the first call)
    return CapturedGraph(graph_module, args, kwargs, input_signature(args, kwargs), autocast,
                         hooks=hooks_signature(model), numbers=numbers_signature(model),
                         trained=trained_signature(model), modules=modules_signature(model),
                         own_checkpoints=own_checkpoints.count)


def _warmed_up(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """One forward of ``model`` without gradients, as its first call would run: what it sets on its modules (a
    cache filled on the first call, a buffer registered then) stays; the buffers it had, torch's random generators
    and Python's and NumPy's are put back as they were, so that the caller's first step updates and draws as it
    would have (BatchNorm's statistics move once, its dropout masks are the ones eager draws)."""
    buffers = _buffers_of(model)
    values = {id(b): b.detach().clone() for _, kept, _ in buffers for b in kept.values() if b is not None}
    devices = sorted({t.device.index or 0 for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), python_draws_recorded(), torch.no_grad():
        try:
            with _cache_dropped(model, kwargs):
                model(*args, **kwargs)
        finally:
            for module, kept, _ in buffers:  # those it registered stay
                module._buffers.update(kept)
                for b in kept.values():
                    if b is not None:
                        b.copy_(values[id(b)])


@contextlib.contextmanager
def _attributes_put_back_on_error(model: torch.nn.Module) -> Iterator[None]:
    """When the block raises, put back the attributes of ``model``'s modules as they were before it (each object,
    each container's items, the buffers; those it added go)."""
    attributes, buffers = _attributes_of(model), _buffers_of(model)
    items = {(module, name): type(value)(value) for module, held in attributes.items() for name, value in held.items()
             if name not in _MODULE_OWN and isinstance(value, _CONTAINERS)}  # a shallow copy of each container
    try:
        yield
    except BaseException:
        _put_buffers_back(buffers)
        for module, _, _ in buffers:
            for name in (set(vars(module)) | set(attributes[id(module)])) - _MODULE_OWN:
                _put_back(module, name, attributes)
                if (id(module), name) in items:
                    _refill(getattr(module, name), items[id(module), name])
        raise


def flat_call_args(captured: CapturedGraph, args: tuple, kwargs: dict) -> list[Any]:
    """The placeholder values of ``captured`` for a call with ``args`` and ``kwargs``."""
    gm = captured.graph_module
    in_spec = getattr(gm, "_in_spec", None)
    if in_spec is None:
        return list(args)
    from torch.export._tree_utils import reorder_kwargs
    try:
        leaves, spec = tree_flatten((args, reorder_kwargs(kwargs, in_spec)))
    except ValueError as exc:
        raise PlannerError(f"inputs do not have the structure the plan was made for: {exc}",
                           hint="call the optimized module with the same arguments as the example inputs") from exc
    if spec != in_spec:
        raise PlannerError(f"inputs have structure {spec}, but the plan was made for {in_spec}",
                           hint="call the optimized module with the same arguments as the example inputs")
    return leaves
