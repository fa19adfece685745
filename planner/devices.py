"""Accelerators you may not have: published peak figures, and the roofline time of an op on them.

Planning for a GPU you do not have (``planner.plan(model_on_meta, budget="80GB", device="h100")``) needs two things
the machine at hand cannot measure: how much memory the device holds, and how long each op would take there.
:class:`DeviceSpec` holds the published dense figures (no structured sparsity) of one device, and
:meth:`DeviceSpec.op_seconds` is the roofline model: an op takes as long as the slower of its arithmetic and its
memory traffic, plus a fixed launch overhead::

    seconds = max(flops / peak_flops[precision], bytes_moved / memory_bandwidth) + launch_seconds

It is torch-free; :mod:`planner.timing` applies it to the ops a training step dispatches.

>>> h100 = device_spec("h100")
>>> h100.memory_bytes / 2**30
79.6474609375
>>> h100.op_seconds(flops=2 * 4096**3, nbytes=3 * 4096**2 * 2, precision=Precision.HALF) * 1e6  # doctest: +ELLIPSIS
143.9...
>>> h100.op_seconds(flops=0, nbytes=2 * 4096**2 * 2) * 1e6  # an elementwise op: memory bound
25.03...
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from .errors import PlannerError

MiB = 2**20


class Precision(enum.Enum):
    """Which peak an op's arithmetic runs at."""

    FP32 = "fp32"  # CUDA cores, full float32
    TF32 = "tf32"  # tensor cores on float32 inputs (allowed by torch.backends / set_float32_matmul_precision)
    HALF = "bf16/fp16"  # tensor cores, 16-bit inputs, float32 accumulation


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator's published dense peaks, memory and per-kernel launch overhead.

    Parameters
    ----------
    name : the registry key (``"h100"``).
    fp32_flops, tf32_flops, half_flops : peak FLOP/s at each :class:`Precision`, dense.
    memory_bandwidth : bytes per second between device memory and the chip.
    memory_bytes : total device memory as the driver reports it (``nvidia-smi``); the CUDA context and the
        caching allocator's fragmentation take some of it, which ``allocator_margin`` leaves free.
    launch_seconds : fixed cost of one kernel (launch latency and eager dispatch), so tiny ops are not free.
    fused_attention : whether ``scaled_dot_product_attention`` runs a fused kernel (flash or memory-efficient)
        there, which saves no attention matrix for the backward; meta tensors then profile the fused kernel.
    description : what the figures are for, in words.
    """

    name: str
    fp32_flops: float
    tf32_flops: float
    half_flops: float
    memory_bandwidth: float
    memory_bytes: int
    launch_seconds: float = 5e-6
    fused_attention: bool = True
    description: str = ""

    def peak_flops(self, precision: Precision = Precision.FP32) -> float:
        """Peak FLOP/s at ``precision``.

        >>> device_spec("a100").peak_flops(Precision.HALF) / 1e12
        312.0
        """
        return {Precision.FP32: self.fp32_flops, Precision.TF32: self.tf32_flops,
                Precision.HALF: self.half_flops}[precision]

    def op_seconds(self, flops: float, nbytes: float, precision: Precision = Precision.FP32) -> float:
        """Roofline time of one kernel doing ``flops`` and moving ``nbytes`` (read plus written).

        >>> l4 = device_spec("l4")
        >>> l4.op_seconds(0, 0) == l4.launch_seconds
        True
        >>> l4.op_seconds(121e12, 0, Precision.HALF)   # a second of half-precision peak, plus the launch
        1.000005
        """
        compute = flops / self.peak_flops(precision) if flops else 0.0
        return max(compute, nbytes / self.memory_bandwidth) + self.launch_seconds


DEVICES: dict[str, DeviceSpec] = {spec.name: spec for spec in (
    DeviceSpec("h100", fp32_flops=67e12, tf32_flops=494.7e12, half_flops=989.4e12, memory_bandwidth=3.35e12,
               memory_bytes=81559 * MiB, description="NVIDIA H100 SXM5 80GB (HBM3)"),
    DeviceSpec("h200", fp32_flops=67e12, tf32_flops=494.7e12, half_flops=989.4e12, memory_bandwidth=4.8e12,
               memory_bytes=143771 * MiB, description="NVIDIA H200 SXM 141GB (HBM3e)"),
    DeviceSpec("a100", fp32_flops=19.5e12, tf32_flops=156e12, half_flops=312e12, memory_bandwidth=2.039e12,
               memory_bytes=81920 * MiB, description="NVIDIA A100 SXM4 80GB (HBM2e)"),
    DeviceSpec("l4", fp32_flops=30.3e12, tf32_flops=60e12, half_flops=121e12, memory_bandwidth=300e9,
               memory_bytes=23034 * MiB, description="NVIDIA L4 24GB (GDDR6)"),
    DeviceSpec("rtx4090", fp32_flops=82.6e12, tf32_flops=82.6e12, half_flops=165.2e12, memory_bandwidth=1008e9,
               memory_bytes=24564 * MiB, description="NVIDIA GeForce RTX 4090 24GB (GDDR6X), FP32 accumulate"),
)}


def device_spec(device: str | DeviceSpec) -> DeviceSpec:
    """The :class:`DeviceSpec` named ``device`` (case and ``-``/``_``/spaces ignored); a spec passes through.

    >>> device_spec("H100").description
    'NVIDIA H100 SXM5 80GB (HBM3)'
    >>> device_spec("tpu")
    Traceback (most recent call last):
    ...
    planner.errors.PlannerError: unknown device 'tpu'. Hint: known devices: a100, h100, h200, l4, rtx4090; or pass a planner.devices.DeviceSpec with your device's figures
    """
    if isinstance(device, DeviceSpec):
        return device
    key = "".join(ch for ch in str(device).lower() if ch not in "-_ ")
    if key not in DEVICES:
        raise PlannerError(f"unknown device {device!r}",
                           hint=f"known devices: {', '.join(sorted(DEVICES))}; or pass a "
                                f"planner.devices.DeviceSpec with your device's figures")
    return DEVICES[key]


def spec_for_gpu(name: str, memory_bytes: int) -> DeviceSpec | None:
    """The spec of the GPU that ``name`` (as ``torch.cuda.get_device_name`` gives it) names, with the memory the
    GPU reports (an A100 has 40 or 80 GB); None for a GPU this registry has no figures for.

    >>> spec_for_gpu("NVIDIA A100-SXM4-40GB", 40 * 2**30).name, spec_for_gpu("NVIDIA GeForce RTX 4090", 0).name
    ('a100', 'rtx4090')
    >>> spec_for_gpu("NVIDIA H100 80GB HBM3", 85 * 10**9).memory_bytes
    85000000000
    >>> spec_for_gpu("NVIDIA L40S", 48 * 2**30) is None  # not an L4
    True
    """
    words = set(name.lower().replace("-", " ").replace("_", " ").split())
    for key, spec in DEVICES.items():
        if key in words or key.removeprefix("rtx") in words:
            return dataclasses.replace(spec, memory_bytes=memory_bytes)
    return None
