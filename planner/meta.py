"""Planning on the meta device: a model built under ``with torch.device("meta"):`` is captured, profiled and
planned without allocating a byte of its parameters or activations.

Meta tensors have shapes, dtypes and storages with sizes but no data, and PyTorch has meta kernels for nearly every
op, autograd included. So the profile's storage tracking and ``saved_tensors_hooks`` see the same storages as with
real tensors, FLOPs come from the same formulas, and the live-storage meter measures the same eager step; only
times cannot be measured and come from a :class:`~planner.devices.DeviceSpec` instead (:mod:`planner.timing`).

One thing runs differently on meta: ``scaled_dot_product_attention`` falls back to the math path, which builds and
saves the whole attention matrix, where a GPU runs a fused kernel that saves only its output and log-sum-exp.
When the target device has fused attention, :func:`target_kernels` substitutes the kernel CUDA would choose
(:func:`fused_attention`), so a 7B model at sequence 4096 is not charged gigabytes per layer it would not use.

>>> import torch
>>> with torch.device("meta"):
...     model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096))
>>> is_meta(model, (torch.empty(8, 4096, device="meta"),))
True
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .devices import DeviceSpec
from .errors import PlannerError

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


def tensors_of(model: torch.nn.Module, inputs: Any) -> list[torch.Tensor]:
    """Parameters, buffers and tensor inputs: everything whose device says where the step runs."""
    return (list(model.parameters()) + list(model.buffers())
            + [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)])


def device_type_of(model: torch.nn.Module, inputs: Any) -> str:
    """The one device type (``"cpu"``, ``"cuda"``, ``"meta"``) the model's tensors and the inputs are on.

    >>> device_type_of(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
    'cpu'
    >>> device_type_of(torch.nn.Linear(2, 2), (torch.zeros(1, 2, device="meta"),))
    Traceback (most recent call last):
    ...
    planner.errors.PlannerError: the model and its inputs are on different devices (cpu, meta). Hint: build both on one device; to plan without allocating, build the model under `with torch.device("meta"):` and make the inputs with device="meta"
    """
    types = sorted({t.device.type for t in tensors_of(model, inputs)})
    if len(types) > 1:
        raise PlannerError(f"the model and its inputs are on different devices ({', '.join(types)})",
                           hint='build both on one device; to plan without allocating, build the model under '
                                '`with torch.device("meta"):` and make the inputs with device="meta"')
    return types[0] if types else "cpu"


def is_meta(model: torch.nn.Module, inputs: Any) -> bool:
    """Whether the model and its inputs live on the meta device."""
    return device_type_of(model, inputs) == "meta"


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    meta = t.detach().to("meta")
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(meta, requires_grad=t.requires_grad)
    return meta.requires_grad_(t.requires_grad)


def meta_copy(model: torch.nn.Module, inputs: Any) -> tuple[torch.nn.Module, Any]:
    """A copy of ``model`` and ``inputs`` on the meta device; tied parameters stay tied, ``requires_grad`` is kept.

    (``model.to("meta")`` would untie shared weights and leave autograd pointing at the CPU originals.)

    >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    >>> model[1].weight = model[0].weight
    >>> copied, (x,) = meta_copy(model, (torch.zeros(2, dtype=torch.long),))
    >>> copied[1].weight is copied[0].weight, copied[0].weight.device.type, x.device.type
    (True, 'meta', 'meta')
    """
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        memo.setdefault(id(t), _meta_like(t))
    copied = copy.deepcopy(model, memo)
    moved = tree_map(lambda x: memo.setdefault(id(x), _meta_like(x)) if isinstance(x, torch.Tensor) else x, inputs)
    return copied, moved


def _bias_from_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive bias CUDA's attention converts it to (0 where kept, -inf where masked)."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


def flash_attention_runs(query: torch.Tensor, attn_mask: torch.Tensor | None = None) -> bool:
    """Whether CUDA runs an attention call on ``query`` with flash attention: 16-bit inputs without a mask, a head
    dimension up to 256 (:func:`fused_attention` stands in for it on meta; it takes grouped key/value heads).

    >>> flash_attention_runs(torch.empty(1, 8, 128, 64, dtype=torch.bfloat16, device="meta"))
    True
    >>> flash_attention_runs(torch.empty(1, 8, 128, 64, device="meta"))
    False
    """
    return attn_mask is None and query.dtype in _HALF and query.size(-1) <= _FLASH_MAX_HEAD_DIM


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` as CUDA runs it: flash attention for 16-bit inputs without a mask,
    memory-efficient attention otherwise (float32, or a mask as an additive bias); 4-D inputs only.

    >>> q = torch.empty(1, 4, 128, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    >>> out = fused_attention(q, q, q, is_causal=True)
    >>> out.shape, out.grad_fn.name()
    (torch.Size([1, 4, 128, 64]), 'ScaledDotProductFlashAttentionBackward0')
    >>> fused_attention(q.float(), q.float(), q.float()).grad_fn.name()
    'ScaledDotProductEfficientAttentionBackward0'
    >>> shared = torch.empty(1, 2, 128, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    >>> out = fused_attention(q, shared, shared, is_causal=True, enable_gqa=True)  # flash keeps the two heads
    >>> out.grad_fn.name(), out.grad_fn._saved_key.shape
    ('ScaledDotProductFlashAttentionBackward0', torch.Size([1, 2, 128, 64]))
    """
    if query.dim() != 4:
        return aten.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                 enable_gqa=enable_gqa)
    if flash_attention_runs(query, attn_mask):  # takes grouped heads
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    if enable_gqa and key.size(1) != query.size(1):  # the memory-efficient kernel does not
        groups = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    bias = None
    if attn_mask is not None:
        shape = (query.size(0), query.size(1), query.size(2), key.size(2))
        bias = _bias_from_mask(attn_mask, query.dtype).expand(shape)
    needs_grad = any(t.requires_grad for t in (query, key, value))
    return aten._scaled_dot_product_efficient_attention(query, key, value, bias, needs_grad, dropout_p, is_causal,
                                                        scale=scale)[0]


def target_kernels(device_type: str, device: DeviceSpec | None) -> dict[Callable, Callable]:
    """Graph targets to run differently while profiling ``device_type`` tensors for ``device``: on meta tensors
    for a device with fused attention, :func:`fused_attention` for ``aten.scaled_dot_product_attention``.

    >>> from planner.devices import device_spec
    >>> target_kernels("meta", device_spec("h100"))  # doctest: +ELLIPSIS
    {<OpOverload(op='aten.scaled_dot_product_attention', overload='default')>: <function fused_attention at ...>}
    >>> target_kernels("cpu", device_spec("h100"))
    {}
    """
    if device_type == "meta" and device is not None and device.fused_attention:
        return {aten.scaled_dot_product_attention.default: fused_attention}
    return {}
