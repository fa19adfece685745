"""Plan the Llama-7B shape on the meta device for an 80 GB H100: capture, profile and solve times, host peak memory.

    python -m benchmarks.meta_7b                      # 7B: hidden 4096, 32 layers, 32 heads, seq 4096, batch 1, bf16
    python -m benchmarks.meta_7b --budgets 80GB,40GB,30GB --device h100 --dtype float32
    python -m benchmarks.meta_7b --kv_heads 8 --intermediate 14336 --vocab 128256 --seq 8192 --budgets 80GB
                                                      # the Llama-3-8B shape: grouped-query attention
    planner plan benchmarks/meta_7b.py:llama_7b --device h100 --budget 80GB      # the same model from the CLI

Nothing is allocated: the model is built under ``with torch.device("meta")``, times come from the device's roofline
model (``planner.devices``) and memory from the meta tensors' storages. The target is under 60 s and 2 GB of host
memory for the whole run (``resource.getrusage`` peak RSS, which includes Python, torch and transformers).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

LLAMA_7B = dict(hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000, seq=4096, batch=1)


def llama(*, hidden: int, layers: int, heads: int, intermediate: int, vocab: int, seq: int, batch: int,
          kv_heads: int | None = None, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module, tuple, dict]:
    """A Hugging Face Llama of this shape on the meta device (``kv_heads`` key/value heads, ``heads`` if None), and
    meta token ids (also the labels)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                         max_position_embeddings=seq, use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype).train()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def llama_7b() -> tuple[torch.nn.Module, tuple, dict]:
    """The 7B shape in bf16 (a factory for ``planner plan FILE.py:FACTORY``)."""
    return llama(**LLAMA_7B)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(shape: dict, dtype: torch.dtype, device: str, budgets: list[str], solver: str = "auto") -> dict:
    """Capture, pose and solve; print and return the seconds of each step and the host peak memory."""
    from planner import solvers
    from planner.api import allocator_margin_for, device_budget, pose
    from planner.budget import format_bytes
    from planner.capture import capture
    from planner.devices import device_spec
    from planner.plan import usable_bytes
    from planner.problem import Schedule, simulate

    spec = device_spec(device)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    model, args, kwargs = llama(**shape, dtype=dtype)
    seconds["build"] = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    print(f"Llama {params / 1e9:.2f}B parameters ({dtype}), seq {shape['seq']} x batch {shape['batch']}, "
          f"planned for {spec.description}")
    start = time.perf_counter()
    captured = capture(model, args, kwargs)
    seconds["capture"] = time.perf_counter() - start
    start = time.perf_counter()
    posed = pose(captured, device=spec, profile_repeats=1)
    seconds["profile"] = time.perf_counter() - start
    problem = posed.problem
    eager = simulate(problem, Schedule.store_all(problem.num_stages))
    print(f"{problem.num_stages} stages, {len(problem.tensors)} tensors; fixed {format_bytes(problem.fixed_bytes)}, "
          f"eager peak {format_bytes(eager.peak_bytes)}, eager step {eager.step_seconds * 1e3:.0f} ms (analytic)")
    margin = allocator_margin_for(None, spec, "meta")
    rows = []
    for text in budgets:
        budget = device_budget(text, spec, "meta").resolve(eager.peak_bytes)
        start = time.perf_counter()
        try:
            plan = solvers.solve(problem, usable_bytes(budget, margin), method=solver)
            row = (f"{plan.solver} {plan.status.value}", format_bytes(plan.predicted_peak_bytes),
                   f"+{plan.predicted_overhead:.1%}", f"{len(plan.recomputed_stage_names)}")
        except Exception as exc:  # an infeasible budget is a result here, not a failure
            row = ("infeasible", getattr(exc, "message", str(exc))[:60], "", "")
        took = time.perf_counter() - start
        seconds[f"solve {text}"] = took
        rows.append((text, *row, f"{took:.2f} s"))
    header = ("budget", "solver", "predicted peak", "overhead", "recomputed stages", "solve")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    total = sum(seconds.values())
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) + f"; total {total:.1f}")
    rss = peak_rss_bytes()
    print(f"host peak RSS {rss / 2**30:.2f} GiB (target: under 60 s and 2 GB)")
    return {"seconds": seconds, "total_seconds": total, "peak_rss_bytes": rss, "eager_peak_bytes": eager.peak_bytes}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, value in LLAMA_7B.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    parser.add_argument("--kv_heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="h100")
    parser.add_argument("--budgets", default="80GB,40GB,30GB")
    parser.add_argument("--solver", default="auto")
    args = parser.parse_args(argv)
    shape = {key: getattr(args, key) for key in LLAMA_7B} | {"kv_heads": args.kv_heads}
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    return run(shape, getattr(torch, args.dtype), args.device, budgets, args.solver)


if __name__ == "__main__":
    main()
