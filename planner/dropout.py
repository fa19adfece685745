"""Dropout that a recomputation replays from its kept mask instead of drawing it again.

On the CPU, drawing a dropout mask is the most expensive part of a transformer block's forward (``bernoulli_``
over every attention score: about 25 ms of an 80 ms Llama block at 8x256 tokens), and eager dropout saves its float
noise for the backward: four bytes per element where one would do. :func:`replayable_dropout` rewrites a captured
graph so that each dropout draws its mask in a node of its own (:func:`dropout_mask`, one byte per element) and
applies it in another (:func:`apply_mask`, which saves the mask, not the noise, as CUDA's fused dropout does). A
checkpoint region may then keep that mask and recompute only the cheap arithmetic around it; and every dropout
keeps a quarter of the bytes it did for the backward (the demo-size GPT-2's eager peak: 445 MiB, against 513 MiB).
``scaled_dot_product_attention`` with dropout runs PyTorch's own math path on the CPU; the pass spells that path
out (`_spelled_attention`), so the mask inside it is a node too.

Exactness: the rewritten graph computes what eager computes (``at::dropout``: ``empty_like(x).bernoulli_(1-p)``,
divided by ``1-p``, times ``x``), bit for bit: same numbers, same gradients, same generator state after. Each mask
node first takes the generator's state (:func:`rng_state`, a node of its own) and draws from it, so a
recomputation that re-draws one mask while keeping another still draws the same numbers. A region that keeps a mask
keeps its state too (5 KiB), overwritten once the mask is drawn with the generator's state after the draw
(:func:`write_state_after_draw`); the mask's replay sets the generator to it (:func:`advance_to`), as the draw moved
it, so a later mask of the region whose state is recomputed reads the state it read in the forward. See
:mod:`planner.rewrite`.

The pass runs on CPU graphs captured outside autocast (CUDA's fused dropout draws differently, and is cheap).

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
>>> graph_module = torch.export.export(model, (torch.randn(2, 4),), strict=False).module()
>>> replayable_dropout(graph_module)
1
>>> [n.name for n in graph_module.graph.nodes if n.op == "call_function"]
['linear', 'dropout_state', 'dropout_mask', 'dropout']
>>> _ = torch.manual_seed(0); expected = model(torch.ones(2, 4))
>>> _ = torch.manual_seed(0); torch.equal(graph_module(torch.ones(2, 4)), expected)
True

:func:`planner.capture.capture` runs this pass.
"""

from __future__ import annotations

import functools
import math
import platform
import struct
from typing import Any

import torch
import torch.fx as fx

from .attention import sdpa_arguments

_LIB = "planner"

# Defined with torch.library.Library rather than torch.library.custom_op: a custom_op call costs 30-50 us of Python
# (and as much again for its autograd wrapper), about 5% of a test-size GPT-2 step with its 13 dropouts; these
# cost 4-7 us.
_LIBRARY = torch.library.Library(_LIB, "DEF")
_LIBRARY.define("rng_state(Tensor like) -> Tensor")
_LIBRARY.define("dropout_mask(Tensor like, float p, Tensor state) -> Tensor",
                tags=(torch.Tag.nondeterministic_seeded,))
_LIBRARY.define("apply_mask(Tensor x, Tensor mask, float p) -> Tensor")
STATE_OP = torch.ops.planner.rng_state.default
MASK_OP = torch.ops.planner.dropout_mask.default
APPLY_OP = torch.ops.planner.apply_mask.default


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def rng_state(like: torch.Tensor) -> torch.Tensor:
    """The state of the random generator of ``like``'s device, now (a copy)."""
    return _generator_state(like.device)


def advance_to(state: torch.Tensor, like: torch.Tensor) -> None:
    """Set the random generator of ``like``'s device to ``state``: where a kept mask's replay leaves it, as its draw
    in the forward did (see :func:`write_state_after_draw`)."""
    if like.device.type == "cuda":
        torch.cuda.set_rng_state(state, like.device)
    else:
        torch.set_rng_state(state)


def write_state_after_draw(state: torch.Tensor, like: torch.Tensor) -> None:
    """Overwrite ``state`` (a kept mask's generator state, which its replay does not draw from) with the state of
    ``like``'s generator now, just after the mask was drawn: the replay then moves the generator on as the draw
    did, so that a later mask of the region whose state is recomputed reads the state it read in the forward.
    The generator's state is read into a temporary copy first (5 KiB on the CPU, outside any dispatch mode's
    sight, freed at once: as :func:`dropout_mask` compares states).

    >>> x = torch.zeros(4)
    >>> state = rng_state(x)
    >>> mask = dropout_mask(x, 0.5, state)
    >>> write_state_after_draw(state, x)
    >>> torch.equal(state, torch.get_rng_state())
    True
    """
    with torch.no_grad():
        state.copy_(_generator_state(like.device))


def dropout_mask(like: torch.Tensor, p: float, state: torch.Tensor) -> torch.Tensor:
    """Which elements of ``like`` dropout keeps, drawn as ``at::dropout`` draws them, from generator ``state``.

    ``bernoulli_`` draws the same numbers into a ``bool`` tensor as into ``like``'s float one (whichever the type,
    the CPU kernel draws integers and converts them), so the mask costs no float tensor and no conversion. It takes
    ``like``'s layout, as eager's noise does, so that a transposed ``like`` draws in the same (memory) order. When
    ``state`` is the generator's state now (the forward), it draws from the generator, which moves on as eager's
    does; otherwise (a recomputation) from a private generator set to ``state``, leaving the device's generator
    where it is."""
    generator = None
    if not torch.equal(state, _generator_state(like.device)):
        generator = torch.Generator(like.device)
        generator.set_state(state)
    return torch.empty_like(like, dtype=torch.bool).bernoulli_(1 - p, generator=generator)


def _kept_scale(p: float, dtype: torch.dtype) -> float | torch.Tensor:
    """What a kept element is multiplied by: ``1 / (1 - p)`` rounded as ``at::dropout``'s ``noise.div_(1 - p)``
    rounds it. For ``float32`` and ``float64`` a Python float (a division in double, rounded to ``float32``, is
    ``float32``'s own correctly rounded division), so that no tensor is read back, which ``torch.compile`` could
    not trace; for other types a 0-d tensor of ``dtype``.

    >>> _kept_scale(0.1, torch.float32) == torch.ones((), dtype=torch.float32).div_(0.9).item() != 1 / 0.9
    True
    """
    if dtype == torch.float64:
        return 1.0 / (1 - p)
    if dtype == torch.float32:
        return _to_float32(1.0 / _to_float32(1 - p))
    return torch.ones((), dtype=dtype).div_(1 - p)


def _to_float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


# From this many elements on, apply_mask takes two passes over x's size and a Python autograd.Function (below, an
# ATen product that takes three and runs its autograd in C++): the Python costs 100-400 us a call in a step (fixed),
# the third pass about 1 ns an element. With the Function everywhere the test-size GPT-2's graph (dropouts of 65,536
# and 524,288 elements) ran 1.10x Hugging Face's module, with the ATen product 1.01-1.04x; at the demo size (393,216
# and 3,145,728) the ATen product everywhere ran 1.020x against 1.003x, this threshold 1.006-1.011x.
TWO_PASS_ELEMENTS = 1 << 20


def apply_mask(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` with dropout's ``mask`` applied: bit for bit ``at::dropout``'s ``x * (noise / (1 - p))``; for the
    backward it saves the one-byte mask, where eager's product saves the float noise.

    Below ``TWO_PASS_ELEMENTS`` it is ``(x * scale) * mask``: a kept element is ``x * scale``, a dropped one
    ``(x * scale) * 0``, a zero of ``x``'s sign (NaN where ``x`` is infinite or NaN) as eager's ``x * 0``; the
    gradient is ``(grad * mask) * scale``, eager's ``grad * noise`` the same way. Both are ATen ops, so autograd
    runs them in C++; the product by the mask runs in place and saves only ``mask`` (the other operand needs no
    gradient). Masking comes last in the forward so that it comes first in the backward: its node unpacks the mask
    at once, so a checkpoint region recomputes before any gradient of its own is made. The mask takes part as
    ``uint8`` (a view of the ``bool`` one): the CPU converts it to ``x``'s type for the product, about four times
    as fast from bytes as from booleans (see :func:`planner.meter.converted_operand_bytes`). From
    ``TWO_PASS_ELEMENTS`` on, and under ``torch.compile``, :class:`_MaskApplied` does it (see :func:`_masked`).

    Traced by ``torch.compile``, the mask takes part as ``bool``: inductor's C++ kernels reinterpret a ``bool``
    tensor viewed as ``uint8`` element by element, which made the attention's backward kernel 8 times slower (9.4
    against 1.2 ms at the test-size GPT-2's scores).

    >>> import torch
    >>> x = torch.tensor([2.0, -3.0, float("inf")])
    >>> apply_mask(x, torch.tensor([True, False, False]), 0.5)
    tensor([4., -0., nan])
    """
    if _compiling() or x.numel() >= TWO_PASS_ELEMENTS:
        return _MaskApplied.apply(x, mask, p)
    return x.mul(_kept_scale(p, x.dtype)).mul_(mask.view(torch.uint8))


def _compiling() -> bool:
    """Whether ``torch.compile`` (or export) is tracing: ``torch.compiler.is_compiling()``, or make_fx's proxy mode
    on the stack. Torch 2.13 sets the first for a whole compile session; torch 2.11 (the GPU machines' image) only
    while Dynamo traces Python, not while AOT autograd traces :func:`apply_mask`'s decomposition or
    :class:`_MaskApplied`'s backward, whose ``uint8`` view of the mask its inductor then failed to lower
    ("torch.bool is not supported by torch.iinfo").

    >>> _compiling()
    False
    """
    return torch.compiler.is_compiling() \
        or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def _in_one_pass(x: torch.Tensor) -> bool:
    """Whether :func:`_masked` writes its output over the converted mask: for a contiguous ``x`` whose kept scale
    is a Python float."""
    return x.is_contiguous() and x.dtype in (torch.float32, torch.float64)


def _masked(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """``x * mask * scale`` as eager's ``x * noise`` rounds it, with ``noise = mask * scale``, in two passes.

    The mask is converted to ``x``'s type (from bytes), and ``-0 + (scale * x) * mask`` is written over it in one
    pass (``addcmul``): ``(scale * x) * 1`` is ``x * scale``, ``(scale * x) * 0`` is ``x * 0`` (a zero of ``x``'s
    sign; NaN where ``x`` is infinite), and adding ``-0`` changes neither. A non-contiguous ``x`` takes three
    passes, so that the result keeps its layout, as eager's product does, and so do types other than ``float32``
    and ``float64``.

    Traced by ``torch.compile``, the mask is converted from booleans, and the backward converts the saved ``bool``
    mask itself, so that the partitioner is handed the mask to keep (left to autograd, it kept the converted float
    mask, four bytes per element)."""
    if _compiling():
        return x * mask.to(x.dtype) * _kept_scale(p, x.dtype)
    noise = mask.view(torch.uint8).to(x.dtype)
    if not _in_one_pass(x):
        return x.mul(noise).mul_(_kept_scale(p, x.dtype))
    return torch.addcmul(torch.full((), -0.0, dtype=x.dtype), x, noise, value=_kept_scale(p, x.dtype), out=noise)


class _MaskApplied(torch.autograd.Function):
    """:func:`apply_mask` of a large ``x`` in two passes, and under ``torch.compile``: saves the mask; the gradient
    is the incoming one, masked and scaled the same way."""

    @staticmethod
    def forward(ctx, x, mask, p):
        ctx.save_for_backward(mask)
        ctx.p = p
        return _masked(x, mask, p)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return _masked(grad, mask, ctx.p), None, None


_LIBRARY.impl("rng_state", rng_state, "CompositeExplicitAutograd")
_LIBRARY.impl("dropout_mask", dropout_mask, "CompositeExplicitAutograd")
# Composite: autograd, dispatch modes (the meters, a region's cache modes) and tracers see the ATen ops it runs.
_LIBRARY.impl("apply_mask", apply_mask, "CompositeImplicitAutograd")


@torch.library.register_fake(f"{_LIB}::rng_state", lib=_LIBRARY)
def _(like):
    return torch.empty(_generator_state(torch.device("cpu")).numel() if like.device.type == "cpu" else 16,
                       dtype=torch.uint8, device=like.device)


@torch.library.register_fake(f"{_LIB}::dropout_mask", lib=_LIBRARY)
def _(like, p, state):
    return torch.empty_like(like, dtype=torch.bool)


def _intel_with_mkl() -> bool:
    """Whether this build has MKL and ``/proc/cpuinfo`` names an Intel CPU: where ATen would take MKL's path."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return "intel" in platform.processor().lower()


@functools.cache
def _measured_draw_buffer_bytes() -> int:
    from .meter import allocator_peak_bytes  # the meter imports this module
    mask = torch.empty(4096, dtype=torch.bool)
    draws = torch.Generator()  # its own: measured inside a step, a draw from the default one moved its dropouts
    return allocator_peak_bytes(lambda: mask.bernoulli_(0.5, generator=draws)) // mask.numel()


def draw_buffer_bytes() -> int:
    """Bytes per element that ``bernoulli_`` on the CPU holds beside a ``bool`` mask while it draws: 4 where ATen
    takes MKL's path (MKL, and a CPU that cpuinfo names Intel), which draws into an integer buffer and converts;
    0 where it draws into the mask itself. Measured once from the allocator's events, as the choice is ATen's
    (under a virtual machine cpuinfo may not name the CPU that ``/proc/cpuinfo`` does); while a profiler already
    runs, guessed from ``/proc/cpuinfo``.

    >>> draw_buffer_bytes() in (0, 4)
    True
    """
    if torch.autograd._profiler_enabled() and _measured_draw_buffer_bytes.cache_info().currsize == 0:
        return 4 if _intel_with_mkl() else 0
    return _measured_draw_buffer_bytes()


def workspace_bytes(func: Any, args: tuple) -> int:
    """The most bytes an op of this module holds at once while it runs, where a dispatch mode cannot see inside
    it (0 for any other op): :func:`dropout_mask` keeps one byte per element (and where ATen draws through MKL first
    draws into a 4-byte integer buffer). :func:`apply_mask` reaches dispatch modes as the ATen ops it runs (see
    :func:`planner.meter.converted_operand_bytes` for what its product holds).

    >>> import torch
    >>> workspace_bytes(torch.ops.planner.dropout_mask.default, (torch.zeros(10), 0.1, None)) in (10, 50)
    True
    >>> workspace_bytes(torch.ops.aten.mul.Tensor, (torch.zeros(10), 2.0))
    0
    """
    if func is MASK_OP:
        return args[0].numel() * (draw_buffer_bytes() + 1)
    return 0


def is_mask(node: fx.Node) -> bool:
    """Whether ``node`` draws a replayable dropout mask (caching it is exact)."""
    return node.op == "call_function" and node.target is MASK_OP


def is_state(node: fx.Node) -> bool:
    """Whether ``node`` takes the generator's state for a mask (a caching region always keeps it)."""
    return node.op == "call_function" and node.target is STATE_OP


# --- the pass ------------------------------------------------------------------------------------------------------

def _on_cpu(node: Any) -> bool:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype in (
        torch.float32, torch.float64)


class _Pieces:
    """Inserts the ops that replace ``node`` before it, each named after it (``dropout_3_mask``) and carrying its
    module stack; :meth:`finish` turns ``node`` itself into the last op, so its name and users stay."""

    def __init__(self, node: fx.Node):
        self.node = node

    def add(self, piece: str, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        with self.node.graph.inserting_before(self.node):
            new = self.node.graph.call_function(target, args, kwargs or {})
        new._rename(f"{self.node.name}_{piece}")
        new.meta.update({k: v for k, v in self.node.meta.items() if k in ("nn_module_stack", "stack_trace")})
        return new

    def finish(self, target: Any, args: tuple) -> None:
        self.node.target, self.node.args, self.node.kwargs = target, args, {}


def _dropped(pieces: _Pieces, x: fx.Node, p: float) -> tuple[Any, tuple]:
    """``at::dropout(x, p, train=True)`` on the CPU as pieces; returns the last op and its arguments."""
    state = pieces.add("state", STATE_OP, (x,))
    mask = pieces.add("mask", MASK_OP, (x, p, state))
    return APPLY_OP, (x, mask, p)


def _dropout_args(node: fx.Node) -> tuple[fx.Node, float] | None:
    """``(x, p)`` of a training dropout this pass rewrites, else None."""
    if node.target is not torch.ops.aten.dropout.default:
        return None
    x, p, train = (list(node.args) + [node.kwargs.get("p"), node.kwargs.get("train")])[:3]
    if not train or not isinstance(p, float) or not 0.0 < p < 1.0 or not _on_cpu(x):
        return None
    return x, p


def _attention_args(node: fx.Node) -> dict | None:
    """Arguments of a CPU ``scaled_dot_product_attention`` with dropout that this pass spells out, else None."""
    call = sdpa_arguments(node)
    if call is None:
        return None
    query, key, value, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    if not (isinstance(call["dropout_p"], float) and 0.0 < call["dropout_p"] < 1.0) or call["enable_gqa"]:
        return None
    if not all(_on_cpu(t) and t.meta["val"].dtype == query.meta["val"].dtype for t in (query, key, value)):
        return None
    if mask is not None and not (isinstance(mask, fx.Node) and isinstance(mask.meta.get("val"), torch.Tensor)):
        return None
    if call["is_causal"] and mask is not None:
        return None
    return call


def _spelled_attention(pieces: _Pieces, call: dict) -> tuple[Any, tuple]:
    """PyTorch's math path of ``scaled_dot_product_attention`` (``_scaled_dot_product_attention_math``), op for op,
    as pieces; returns the last op and its arguments."""
    aten = torch.ops.aten
    query, key, value, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    scale = call["scale"] if call["scale"] is not None else 1.0 / math.sqrt(query.meta["val"].shape[-1])
    factor = math.sqrt(abs(scale))
    dtype = query.meta["val"].dtype
    q = pieces.add("query", aten.mul.Tensor, (query, -factor if scale < 0 else factor))
    if call["is_causal"]:
        length, source = query.meta["val"].shape[-2], key.meta["val"].shape[-2]
        ones = pieces.add("ones", aten.ones.default, ([length, source],), {"dtype": torch.bool})
        mask = pieces.add("causal", aten.tril.default, (ones,))
    if mask is not None and (call["is_causal"] or mask.meta["val"].dtype == torch.bool):
        zeros = pieces.add("zeros", aten.zeros_like.default, (mask,), {"dtype": dtype})
        hidden = pieces.add("hidden", aten.logical_not.default, (mask,))
        mask = pieces.add("bias", aten.masked_fill.Scalar, (zeros, hidden, float("-inf")))
    key_t = pieces.add("key_t", aten.transpose.int, (key, -2, -1))
    key_scaled = pieces.add("key", aten.mul.Tensor, (key_t, factor))
    scores = pieces.add("scores", aten.matmul.default, (q, key_scaled))
    if mask is not None:
        scores = pieces.add("masked", aten.add.Tensor, (scores, mask))
    weights = pieces.add("softmax", aten._safe_softmax.default, (scores, -1))
    target, args = _dropped(pieces, weights, call["dropout_p"])
    dropped = pieces.add("dropped", target, args)
    return aten.matmul.default, (dropped, value)


def replayable_dropout(graph_module: fx.GraphModule) -> int:
    """Rewrite ``graph_module``'s training dropouts (and attention with dropout) on the CPU into explicit mask
    nodes, in place; returns how many it rewrote. See the module's docstring."""
    rewritten = 0
    for node in list(graph_module.graph.nodes):
        if (dropout := _dropout_args(node)) is not None:
            pieces = _Pieces(node)
            pieces.finish(*_dropped(pieces, *dropout))
        elif (attention := _attention_args(node)) is not None:
            pieces = _Pieces(node)
            pieces.finish(*_spelled_attention(pieces, attention))
        else:
            continue
        rewritten += 1
    if rewritten:
        graph_module.graph.lint()
        graph_module.recompile()
    return rewritten
