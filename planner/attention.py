"""Attention as the model runs it: what export spells out around ``scaled_dot_product_attention`` handed back to it.

Hugging Face models call ``scaled_dot_product_attention`` with ``is_causal=True`` and no mask when a batch has no
padding, but while being exported they cannot know that, so they build the causal mask op by op from ``arange``
and hand it to the kernel (GPT-2: 27 ops a step making an 8 x 1 x 128 x 128 boolean). A mask rules out the
kernels that a GPU picks for causal attention without one: flash attention for 16-bit inputs, and the
memory-efficient kernel without an additive bias for float32. On an H200 the captured GPT-2 stepped 1.09x and
Llama 1.12x slower than the models as written (``benchmarks/GPU-h200.md``), and a plan for the meta device charged
the masked kernel (:mod:`planner.meta`). With a mask, a model with grouped-query attention (fewer key/value heads
than query heads) also copies each key and value head for every query head it serves (``repeat_kv``) instead of
letting the kernel share them (``enable_gqa``), and the attention saves the copies for the backward.

:func:`drop_constant_masks` finds each mask that no input, parameter, buffer or random draw feeds, works it out on
the CPU, and when it is the causal mask (``ones(L, S).tril()``, as a boolean or as an additive ``0``/``-inf``
float) or lets every query see every key, calls the kernel with ``is_causal`` or without a mask instead; the ops
that built the mask go. The graph is captured for fixed shapes (plans are keyed by them), so the mask is the same
in every step. :func:`group_repeated_heads` then hands an unmasked call without dropout its key and value heads
uncopied with ``enable_gqa``, where the kernel that will run takes them so (:func:`kernel_shares_heads`).
:func:`restore_attention` runs both, on models that hold a Hugging Face model (others build such a mask eagerly
too, and the kernel may sum in another order without it); :func:`planner.capture.capture` calls it. A mask given
as an input stays, but for a Hugging Face model an ``attention_mask`` of ones means no mask, and
:func:`without_unmasking_mask` drops it before planning and before each training call (:mod:`planner.api`).

>>> import torch
>>> class Causal(torch.nn.Module):
...     def forward(self, x):
...         visible = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool).tril()
...         return torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=visible)
>>> graph_module = torch.export.export(Causal(), (torch.randn(1, 2, 8, 4),), strict=False).module()
>>> drop_constant_masks(graph_module)
1
>>> [n.target.__name__ for n in graph_module.graph.nodes if n.op == "call_function"]
['scaled_dot_product_attention.default']
>>> next(n for n in graph_module.graph.nodes if n.op == "call_function").kwargs
{'is_causal': True}
"""

from __future__ import annotations

import enum
import functools
import sys
from typing import Any

import torch
import torch.fx as fx

from .meta import flash_attention_runs

_aten = torch.ops.aten
SDPA = _aten.scaled_dot_product_attention.default
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)
_ASSERT_METADATA = _aten._assert_tensor_metadata.default
_ROWS_AT_A_TIME = 1024
_REPEAT_VIEWS = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)


def sdpa_arguments(node: fx.Node) -> dict[str, Any] | None:
    """Every argument of a ``scaled_dot_product_attention`` node by name, defaults included; None for other nodes.

    >>> graph = fx.Graph()
    >>> q = graph.placeholder("q")
    >>> node = graph.call_function(SDPA, (q, q, q), {"is_causal": True})
    >>> arguments = sdpa_arguments(node)
    >>> arguments["attn_mask"], arguments["is_causal"], arguments["scale"]
    (None, True, None)
    """
    if node.op != "call_function" or node.target is not SDPA:
        return None
    given = list(node.args) + [node.kwargs.get(k, d) for k, d in zip(SDPA_PARAMETERS, _SDPA_DEFAULTS)][len(node.args):]
    return dict(zip(SDPA_PARAMETERS, given))


def attention_calls(graph_module: fx.GraphModule) -> list[dict[str, Any]]:
    """The arguments (:func:`sdpa_arguments`) of each ``scaled_dot_product_attention`` call in ``graph_module``."""
    return [arguments for arguments in map(sdpa_arguments, graph_module.graph.nodes) if arguments is not None]


class ImpliedMask(enum.Enum):
    """What a constant attention mask says, when the kernel can be told it without the mask."""

    EVERY_KEY = "every key"  # every query sees every key: no mask at all
    CAUSAL = "causal"  # query i sees keys 0..i: is_causal=True


def implied_mask(mask: torch.Tensor, queries: int, keys: int) -> ImpliedMask | None:
    """What ``mask`` (boolean, or additive float) says for ``queries`` x ``keys`` scores, if it says one of the
    :class:`ImpliedMask` patterns over every leading dimension; else None.

    >>> implied_mask(torch.ones(4, 4, dtype=torch.bool).tril()[None, None].expand(2, 1, 4, 4), 4, 4)
    <ImpliedMask.CAUSAL: 'causal'>
    >>> implied_mask(torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf")), 4, 4)
    <ImpliedMask.CAUSAL: 'causal'>
    >>> implied_mask(torch.ones(2, 1, 1, 4, dtype=torch.bool), 4, 4)
    <ImpliedMask.EVERY_KEY: 'every key'>
    >>> implied_mask(torch.ones(4, 4, dtype=torch.bool).triu(), 4, 4) is None  # anti-causal: kept
    True
    >>> implied_mask(torch.full((4, 4), -1e9).triu(1), 4, 4) is None  # a finite bias is not "hidden"
    True
    """
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point() and bool(((mask == 0) | (mask == float("-inf"))).all()):
        visible = mask == 0
    else:
        return None
    try:
        visible = visible.expand(torch.broadcast_shapes(visible.shape, (queries, keys)))
    except RuntimeError:
        return None
    if bool(visible.all()):
        return ImpliedMask.EVERY_KEY
    columns = torch.arange(keys)
    for start in range(0, queries, _ROWS_AT_A_TIME):  # a 16k x 16k mask is 256 MiB: no second one beside it
        rows = torch.arange(start, min(start + _ROWS_AT_A_TIME, queries))
        causal = columns[None, :] <= rows[:, None]
        if not torch.equal(visible[..., start:start + len(rows), :], causal.expand_as(visible[..., :len(rows), :])):
            return None
    return ImpliedMask.CAUSAL


def _builders(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes that compute ``mask``, in graph order, if they are all pure ops on constants; else None."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op != "call_function" or node.is_impure() or _draws(node.target):
            return None  # an input, parameter, buffer or random draw: not a constant
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return [n for n in mask.graph.nodes if n in seen]


def _draws(target: Any) -> bool:
    """Whether ``target`` draws random numbers (``Node.is_impure`` says so too in recent torch, not in all)."""
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def _evaluate(builders: list[fx.Node]) -> Any:
    """The value of the last of ``builders`` (see :func:`_builders`), computed on the CPU (a graph captured on meta
    computes its mask here: every device an op names becomes the CPU); each value is let go after its last use."""
    last_use = {arg: i for i, node in enumerate(builders) for arg in node.all_input_nodes}
    values: dict[fx.Node, Any] = {}

    def on_cpu(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return values[value]
        if isinstance(value, torch.device):
            return torch.device("cpu")
        return value.cpu() if isinstance(value, torch.Tensor) else value
    for i, node in enumerate(builders):
        values[node] = node.target(*fx.node.map_aggregate(node.args, on_cpu),
                                   **fx.node.map_aggregate(node.kwargs, on_cpu))
        for arg in node.all_input_nodes:
            if last_use[arg] == i:
                del values[arg]
    return values[builders[-1]]


def _shape(node: Any) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _mask_of(arguments: dict[str, Any]) -> tuple[fx.Node, int, int] | None:
    """The mask node of an attention call and its scores' shape (queries, keys), if it has a mask node."""
    mask, query, key = arguments["attn_mask"], _shape(arguments["query"]), _shape(arguments["key"])
    if not isinstance(mask, fx.Node) or arguments["is_causal"] or query is None or key is None:
        return None
    return mask, query[-2], key[-2]


def _constant_value(mask: fx.Node) -> tuple[torch.Tensor, list[fx.Node]] | None:
    """The value of ``mask`` and the nodes that build it, if it is a constant tensor."""
    builders = _builders(mask)
    if builders is None:
        return None
    try:
        value = _evaluate(builders)
    except Exception:  # an op that does not run on the CPU as captured: leave the mask as it is
        return None
    return (value, builders) if isinstance(value, torch.Tensor) else None


def _set_call(node: fx.Node, arguments: dict[str, Any]) -> None:
    """Make ``node`` call the kernel with ``arguments`` (every one by name): the tensors by position, the rest by
    keyword where not the default."""
    arguments = dict(arguments)
    node.args = tuple(arguments.pop(name) for name in ("query", "key", "value"))
    node.kwargs = {k: v for (k, v), default in zip(arguments.items(), _SDPA_DEFAULTS[3:]) if v != default}


def _erase_unused(graph: fx.Graph, nodes: set[fx.Node]) -> None:
    """Erase those of ``nodes`` that nothing reads any more but export's metadata checks (which go with them)."""
    for node in reversed(list(graph.nodes)):
        if node not in nodes or any(user.target is not _ASSERT_METADATA for user in node.users):
            continue
        for check in list(node.users):
            graph.erase_node(check)  # export's check of a ``.to()`` result: the mask's dtype, not the model's
        graph.erase_node(node)


def _finished(graph_module: fx.GraphModule, changed: int, replaced: set[fx.Node]) -> int:
    """Erase what no call reads any more of the ``replaced`` nodes, recompile if a call ``changed``; ``changed``."""
    _erase_unused(graph_module.graph, replaced)
    if changed:
        graph_module.graph.lint()
        graph_module.recompile()
    return changed


def drop_constant_masks(graph_module: fx.GraphModule) -> int:
    """Call each ``scaled_dot_product_attention`` whose mask is a causal or see-everything constant with
    ``is_causal`` or no mask instead, erase the ops that built the masks, and return how many calls changed. See
    the module's docstring."""
    graph, changed, builders = graph_module.graph, 0, set()
    constants: dict[fx.Node, tuple[torch.Tensor, list[fx.Node]] | None] = {}  # each mask worked out once
    for node in list(graph.nodes):
        arguments = sdpa_arguments(node)
        masked = _mask_of(arguments) if arguments is not None else None
        if masked is None:
            continue
        mask, queries, keys = masked
        if mask not in constants:
            constants[mask] = _constant_value(mask)
        implied = implied_mask(constants[mask][0], queries, keys) if constants[mask] is not None else None
        if implied is not None:
            _set_call(node, dict(arguments, attn_mask=None, is_causal=implied is ImpliedMask.CAUSAL))
            builders.update(constants[mask][1])
            changed += 1
    return _finished(graph_module, changed, builders)


def repeated_heads(node: Any) -> tuple[fx.Node, int] | None:
    """``(x, n)`` when ``node`` is ``x`` (batch, heads, sequence, head dim) with each head repeated ``n`` times in
    place, as Hugging Face's ``repeat_kv`` spells it (``x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s,
    d)``); else None.

    >>> class RepeatKV(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x[:, :, None].expand(2, 2, 3, 5, 4).reshape(2, 6, 5, 4)
    >>> graph = torch.export.export(RepeatKV(), (torch.randn(2, 2, 5, 4),), strict=False).module().graph
    >>> x, n = repeated_heads(list(graph.nodes)[-2])
    >>> x.op, n
    ('placeholder', 3)
    """
    if not (isinstance(node, fx.Node) and node.target in _REPEAT_VIEWS):
        return None
    expanded = node.args[0]
    if not (isinstance(expanded, fx.Node) and expanded.target is _aten.expand.default):
        return None
    unsqueezed = expanded.args[0]
    if not (isinstance(unsqueezed, fx.Node) and unsqueezed.target is _aten.unsqueeze.default
            and unsqueezed.args[1] in (2, -3)):
        return None
    x = unsqueezed.args[0]
    shape, wide, out = _shape(x), _shape(expanded), _shape(node)
    if shape is None or wide is None or out is None or len(shape) != 4:
        return None
    (b, h, s, d), n = shape, wide[2]
    if wide != (b, h, n, s, d) or out != (b, h * n, s, d):
        return None
    return x, n


@functools.cache
def _cpu_kernel_shares_heads() -> bool:
    """Whether this torch's CPU kernel takes grouped heads as they are (torch 2.13's flash kernel does, saving the
    key and value uncopied); a kernel that copies them, or the math path, would cost more than the graph's copy."""
    query = torch.zeros(1, 2, 4, 8, requires_grad=True)
    shared = torch.zeros(1, 1, 4, 8, requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(query, shared, shared, is_causal=True, enable_gqa=True)
    return "FlashAttentionForCpu" in out.grad_fn.name() and out.grad_fn._saved_key.shape == shared.shape


def kernel_shares_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the attention kernel that will run an unmasked call without dropout takes ``key`` and ``value`` with
    fewer heads than ``query`` as they are: on the CPU, if this torch's kernel does; on CUDA, where flash attention
    can run the call (16-bit inputs, a head dimension up to 256, compute capability 8.0 or newer, not ROCm: the
    memory-efficient kernel does not take grouped heads, and the math path it falls back to saves every score); on
    meta, where flash attention would on any GPU that :mod:`planner.devices` knows.

    >>> q, kv = torch.zeros(1, 8, 16, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    >>> kernel_shares_heads(q.to("meta"), kv.to("meta"), kv.to("meta"))
    True
    >>> kernel_shares_heads(q.float().to("meta"), kv.float().to("meta"), kv.float().to("meta"))
    False
    """
    device = query.device.type
    if device == "cpu":
        return _cpu_kernel_shares_heads()
    flash = flash_attention_runs(query) and query.size(-1) == key.size(-1) == value.size(-1)
    if device == "meta":
        return flash
    if device == "cuda":  # flash attention's own conditions (sdp_utils.cpp); on ROCm it does not take groups
        return (flash and torch.version.hip is None and torch.backends.cuda.flash_sdp_enabled()
                and torch.cuda.get_device_capability(query.device) >= (8, 0))
    return False


def _grouped(arguments: dict[str, Any]) -> tuple[fx.Node, fx.Node] | None:
    """The key and value heads before their repeat, if the call can take them as they are with ``enable_gqa``."""
    if arguments["attn_mask"] is not None or arguments["dropout_p"] != 0.0 or arguments["enable_gqa"]:
        return None
    key, value = repeated_heads(arguments["key"]), repeated_heads(arguments["value"])
    if key is None or value is None or key[1] != value[1] or key[1] < 2:
        return None
    tensors = [node.meta.get("val") for node in (arguments["query"], key[0], value[0])]
    if not all(isinstance(t, torch.Tensor) for t in tensors) or tensors[0].size(-3) != tensors[1].size(-3) * key[1]:
        return None
    return (key[0], value[0]) if kernel_shares_heads(*tensors) else None


def group_repeated_heads(graph_module: fx.GraphModule) -> int:
    """Hand each unmasked ``scaled_dot_product_attention`` without dropout whose key and value heads are repeated
    copies (:func:`repeated_heads`) the heads themselves with ``enable_gqa``, where the kernel takes them so
    (:func:`kernel_shares_heads`); erase the copies; return how many calls changed."""
    graph, changed, copies = graph_module.graph, 0, set()
    for node in list(graph.nodes):
        arguments = sdpa_arguments(node)
        grouped = _grouped(arguments) if arguments is not None else None
        if grouped is None:
            continue
        copies.update(n for name in ("key", "value") for n in (arguments[name], arguments[name].args[0],
                                                                 arguments[name].args[0].args[0]))
        _set_call(node, dict(arguments, key=grouped[0], value=grouped[1], enable_gqa=True))
        changed += 1
    return _finished(graph_module, changed, copies)


def restore_attention(graph_module: fx.GraphModule, model: torch.nn.Module) -> int:
    """:func:`drop_constant_masks`, then :func:`group_repeated_heads`, where ``model`` holds a Hugging Face model
    (:func:`holds_hugging_face`); returns how many calls changed.

    Only Hugging Face's code builds a mask because it is being exported: other code builds the same mask eagerly,
    and the kernel may sum in another order with ``is_causal`` than with the mask (Falcon, which builds its mask
    eagerly too, trains 7.5e-9 apart from eager once handed the flag), so its graph keeps the call as written.
    """
    if not holds_hugging_face(model):
        return 0
    return drop_constant_masks(graph_module) + group_repeated_heads(graph_module)


def holds_hugging_face(model: torch.nn.Module) -> bool:
    """Whether ``model`` is or holds a ``transformers`` model (a PEFT wrapper, a head around ``AutoModel``).

    >>> holds_hugging_face(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    False
    """
    transformers = sys.modules.get("transformers")
    return transformers is not None and any(isinstance(m, transformers.PreTrainedModel) for m in model.modules())


def without_unmasking_mask(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without an ``attention_mask`` that masks nothing (every entry 1) when ``model`` is a Hugging Face
    model, which treats such a mask as no mask: its ``sdpa`` path drops it before the kernel (it checks
    ``mask.all()`` when not traced), and the others add a mask of zeros. Exported, the model cannot look at the
    values, so the captured graph would hand the kernel a mask built from it, and keep the masked kernel that
    :func:`drop_constant_masks` hands back for a batch without padding. Tokenizers and data collators pass such
    masks for unpadded batches, so the planned module plans and runs them as the model given none does; a batch
    with padding keeps its mask, and plans apart (another input signature). Anything else is returned as is.

    >>> import torch
    >>> without_unmasking_mask(torch.nn.Linear(2, 2), {"attention_mask": torch.ones(2, 4)})  # not Hugging Face
    {'attention_mask': tensor([[1., 1., 1., 1.],
            [1., 1., 1., 1.]])}
    """
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.device.type == "meta" or not _is_hugging_face(model):
        return kwargs
    if not bool((mask == 1).all()):
        return kwargs
    return {name: value for name, value in kwargs.items() if name != "attention_mask"}


def _is_hugging_face(model: torch.nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)
