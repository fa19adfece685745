"""What an optimizer keeps through a training step: its state, fixed memory that the budget must cover.

An optimizer made before the first step holds no state yet (Adam-like ones make theirs on their first ``step()``),
so :func:`optimizer_state_bytes` finds what that step will make by taking it on the meta device: the same optimizer
class, over meta copies of the parameters with meta gradients. No memory is allocated and the caller's optimizer
is untouched.

>>> import torch
>>> w = torch.nn.Parameter(torch.zeros(1000))
>>> optimizer_state_bytes(torch.optim.Adam([w]))            # exp_avg, exp_avg_sq: 2 x 4,000 bytes
8000
>>> optimizer_state_bytes(torch.optim.Adam([w], amsgrad=True))  # and max_exp_avg_sq
12000
"""

from __future__ import annotations

import warnings

import torch

from .meter import storage_bytes

__all__ = ["optimizer_state_bytes", "state_bytes", "first_step_state_bytes"]

# Copies of each parameter that an optimizer's first step makes, by its class name, for optimizers whose step does
# not run on the meta device (one that reads a value with ``.item()``): the last resort of
# :func:`first_step_state_bytes`.
STATE_COPIES = {"adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "radam": 2, "adadelta": 2, "rprop": 2,
                "adagrad": 1, "asgd": 1, "lion": 1}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's (DTensor's) local shard, another tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state ``optimizer`` holds now (step counters, which are scalars, left out).

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(10))
    >>> sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    >>> state_bytes(sgd)
    0
    >>> w.grad = torch.ones(10); sgd.step()
    >>> state_bytes(sgd)                                    # the momentum buffer
    40
    """
    return storage_bytes(_local(value) for state in optimizer.state.values() for value in state.values()
                         if isinstance(value, torch.Tensor) and value.dim() > 0)


def _meta_first_step_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The state bytes of ``optimizer``'s class after one step over meta copies of its parameters and groups.
    Raises what the optimizer raises where its step cannot run on meta tensors."""
    copies = {}
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) not in copies:
                local = _local(p)
                copy = torch.nn.Parameter(torch.empty_like(local, device="meta"), requires_grad=p.requires_grad)
                if p.requires_grad:
                    copy.grad = torch.empty_like(copy)
                copies[id(p)] = copy
            params.append(copies[id(p)])
        groups.append({**group, "params": params})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dry = type(optimizer)(groups)
        dry.step()
    return state_bytes(dry)


def _kind(optimizer: torch.optim.Optimizer) -> str:
    """The lowercased name of the nearest class in ``optimizer``'s MRO whose state :func:`first_step_state_bytes`
    knows (a subclass of Adam keeps Adam's), or of its own class."""
    known = {*STATE_COPIES, "sgd", "rmsprop"}
    names = [cls.__name__.lower() for cls in type(optimizer).__mro__]
    return next((name for name in names if name in known), names[0])


def first_step_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state ``optimizer``'s first step will make: that step taken on the meta device, or where it
    cannot run there, the copies of each trained parameter its kind makes (:data:`STATE_COPIES`, by the nearest known
    class it derives from; momentum SGD and RMSprop by their options), each in the parameter's dtype (Adam keeps a
    bf16 parameter's moments in bf16).

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    >>> first_step_state_bytes(torch.optim.RMSprop([w], momentum=0.9, centered=True))  # 3 x 10 x 2 bytes
    60
    >>> first_step_state_bytes(torch.optim.SGD([w], lr=0.1))  # plain SGD keeps nothing
    0
    """
    try:
        return _meta_first_step_bytes(optimizer)
    except Exception:  # an optimizer of any make: its step may read values (.item()) or need real devices
        pass
    name = _kind(optimizer)
    per_group = []
    for group in optimizer.param_groups:
        copies = STATE_COPIES.get(name, 0)
        if name == "adam" or name == "adamw":
            copies += 1 if group.get("amsgrad") else 0
        elif name == "sgd":
            copies = 1 if group.get("momentum", 0) else 0
        elif name == "rmsprop":
            copies = 1 + (1 if group.get("momentum", 0) else 0) + (1 if group.get("centered") else 0)
        per_group.append((copies, {id(p): p for p in group["params"] if p.requires_grad}))
    return sum(copies * _local(p).numel() * _local(p).element_size()
               for copies, params in per_group for p in params.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes the optimizer keeps through each step: the state it holds now, or, before its first step, what that
    step will make (:func:`first_step_state_bytes`).

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(10))
    >>> optimizer_state_bytes(torch.optim.AdamW([w]))
    80
    >>> optimizer_state_bytes(None)
    0
    """
    if optimizer is None:
        return 0
    return state_bytes(optimizer) or first_step_state_bytes(optimizer)
