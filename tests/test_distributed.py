"""Issue 8: the planned module under DDP and FSDP2 (``fully_shard``), two processes on the CPU (gloo).

Each rank plans its own replica for a per-rank budget, trains through ``DDP(planned)`` on its own batch, and must
end with the gradients of the unplanned ``DDP(model)`` run (checkpointed regions must not mark a parameter ready
twice: non-reentrant checkpoint) while its measured step stays within the budget.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                                     torch.nn.Linear(128, 32)) for _ in range(4)])


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _ddp_rank(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        import planner
        from planner.meter import LiveMemoryMeter, storage_bytes
        from torch.nn.parallel import DistributedDataParallel as DDP

        x = torch.randn(256, 32, generator=torch.Generator().manual_seed(100 + rank))  # each rank its own batch
        reference, planned_model = _model(), _model()
        opt = planner.optimize(planned_model, "60%", example_inputs=(x,), loss_fn=_loss, profile_repeats=1, ddp=True)
        grads = {}
        peaks = {}
        for name, module, owner in [("eager", DDP(reference), reference), ("planned", DDP(opt), planned_model)]:
            fixed = storage_bytes(list(owner.parameters()) + [x])
            for _ in range(2):  # two steps: DDP's bucket rebuild after the first must not trip on regions
                owner.zero_grad(set_to_none=True)
                with LiveMemoryMeter() as meter:
                    _loss(module(x)).backward()
            peaks[name] = fixed + meter.peak_bytes
            grads[name] = {k: p.grad.clone() for k, p in owner.named_parameters()}
        results[rank] = dict(
            equal=all(torch.equal(grads["eager"][k], grads["planned"][k]) for k in grads["eager"]),
            synced=_same_on_all_ranks(grads["planned"]),
            peak=peaks["planned"], eager_peak=peaks["eager"], budget=opt.plan.budget_bytes,
            regions=len(opt.plan.regions), gradient_bytes=storage_bytes(list(planned_model.parameters())),
            buckets=dict(opt.plan.extra).get("ddp_bucket_bytes"))
    finally:
        dist.destroy_process_group()


def _same_on_all_ranks(grads: dict[str, torch.Tensor]) -> bool:
    flat = torch.cat([g.flatten() for g in grads.values()])
    other = flat.clone()
    dist.broadcast(other, src=0)
    return bool(torch.equal(flat, other))


def test_ddp_trains_the_planned_module_like_the_model_within_the_per_rank_budget():
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_ddp_rank, args=(_free_port(), results), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        r = results[rank]
        assert r["regions"] > 0
        assert r["equal"], f"rank {rank}: gradients differ from DDP(model)"
        assert r["synced"], f"rank {rank}: gradients were not all-reduced"
        # ddp=True counts the reducer's buckets (one more copy of the gradients) into the per-rank budget
        assert r["buckets"] == r["gradient_bytes"]
        assert r["peak"] <= r["budget"] < r["eager_peak"], r


def _fsdp_rank(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        import planner
        from planner.meter import LiveMemoryMeter, storage_bytes
        from torch.distributed.fsdp import fully_shard

        x = torch.randn(256, 32, generator=torch.Generator().manual_seed(100 + rank))
        reference, planned_model = _model(), _model()
        opt = planner.optimize(planned_model, "60%", example_inputs=(x,), loss_fn=_loss, profile_repeats=1)
        fully_shard(reference)
        fully_shard(opt)  # the root: one all-gather before the forward, one reduce-scatter after the backward
        grads, peaks = {}, {}
        for name, module, owner in [("eager", reference, reference), ("planned", opt, planned_model)]:
            shards = storage_bytes([p.to_local() for p in owner.parameters()] + [x])
            for _ in range(2):
                owner.zero_grad(set_to_none=True)
                with LiveMemoryMeter() as meter:
                    _loss(module(x)).backward()
            peaks[name] = shards + meter.peak_bytes
            grads[name] = {k: p.grad.full_tensor() for k, p in owner.named_parameters()}
        results[rank] = dict(
            equal=all(torch.equal(grads["eager"][k], grads["planned"][k]) for k in grads["eager"]),
            sharded=all(p.to_local().numel() < p.numel() for p in planned_model.parameters() if p.dim() == 2),
            peak=peaks["planned"], eager_peak=peaks["eager"], budget=opt.plan.budget_bytes)
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharding_the_planned_module_trains_like_sharding_the_model():
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_fsdp_rank, args=(_free_port(), results), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        r = results[rank]
        assert r["equal"], f"rank {rank}: gradients differ from fully_shard(model)"
        assert r["sharded"]
        assert r["peak"] <= r["budget"] < r["eager_peak"], r
