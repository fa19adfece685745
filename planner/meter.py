"""Measure memory for real: count the tensor storages alive while a step runs.

:class:`LiveMemoryMeter` is a ``TorchDispatchMode``. Every op output whose storage is new (not shared with an input:
views are not allocations) is counted until Python frees that storage. It sees what autograd saves, what
selective checkpointing caches, gradients and temporaries alike, on any device. Storages that existed before the
meter started (parameters, inputs) are not counted: add them with :func:`storage_bytes`.

>>> import torch
>>> w = torch.randn(256, 256, requires_grad=True)
>>> with LiveMemoryMeter() as meter:
...     y = (torch.randn(128, 256) @ w).relu().sum()
...     y.backward()
>>> meter.peak_bytes >= 128 * 256 * 4 * 2
True
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage_key(storage: torch.UntypedStorage) -> tuple[int, int]:
    return (storage.data_ptr(), storage.nbytes())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied tensors count once).

    >>> import torch
    >>> x = torch.zeros(10)
    >>> storage_bytes([x, x[2:], x.view(2, 5)])
    40
    """
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[_storage_key(st)] = st.nbytes()
    return sum(seen.values())


@dataclass
class Segment:
    """The part of a run between two marks: memory when it began and the most it reached."""

    label: str
    start_bytes: int
    peak_bytes: int


class LiveMemoryMeter(TorchDispatchMode):
    """Counts bytes of storages allocated inside the mode and still alive; tracks the peak and labelled segments."""

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.segments: list[Segment] = []
        self._refs: dict[int, weakref.ref] = {}

    def mark(self, label: str) -> None:
        """Start a new segment (for example, the forward of one stage)."""
        self.segments.append(Segment(label, self.live_bytes, self.live_bytes))

    def _release(self, key: int, nbytes: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live_bytes -= nbytes

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._refs:
            return
        nbytes = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _r, k=key, n=nbytes: self._release(k, n))
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if self.segments and self.live_bytes > self.segments[-1].peak_bytes:
            self.segments[-1].peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if id(storage) not in inputs and storage.nbytes() > 0:
                    self._track(storage)
        return out


def measure_step_peak(step, *persistent: Iterable[torch.Tensor]) -> int:
    """Peak bytes of one call of ``step()``: what it allocates plus the storages of ``persistent`` tensors."""
    fixed = storage_bytes(t for group in persistent for t in group)
    with LiveMemoryMeter() as meter:
        step()
    return fixed + meter.peak_bytes
