"""Planning on the meta device: the same problem as with real tensors, nothing allocated, plans that apply."""

import dataclasses
import os
import resource

import pytest
import torch

import planner
from examples.common import build_example
from planner.api import captured_device_type, pose
from planner.capture import capture
from planner.devices import device_spec
from planner.errors import InfeasibleBudgetError, PlannerError
from planner.meta import fused_attention, meta_copy
from planner.problem import Schedule, simulate

# the stand-in runs attention as the CPU does (the math path), so both sides run the same kernels
H100_AS_RUN = dataclasses.replace(device_spec("h100"), fused_attention=False)


def _posed(example, device):
    # as planner.plan(..., device=...) captures: for the device's own dropout, not the CPU's (planner.dropout)
    return pose(capture(example.model, example.example_inputs, example.example_kwargs, replay_dropout=False),
                device=device, profile_repeats=1)


@pytest.mark.parametrize("name", ["largeblock", "gpt2", "llama", "resnet", "unet"])
def test_meta_tensors_pose_the_same_problem_as_real_ones(name):
    example = build_example(name)
    real = _posed(example, H100_AS_RUN)
    model, (args, kwargs) = meta_copy(example.model, (example.example_inputs, example.example_kwargs))
    meta = pose(capture(model, args, kwargs), device=H100_AS_RUN, profile_repeats=1)
    assert meta.problem.tensors == real.problem.tensors  # the same storages, bytes, producers, readers, savers
    assert meta.problem.fixed_bytes == real.problem.fixed_bytes
    assert meta.problem.stages == real.problem.stages  # workspaces, gradients, analytic times, options
    assert meta.stage_nodes == real.stage_nodes and meta.timing == real.timing == "analytic:h100"
    budget = simulate(real.problem, Schedule.uniform(real.problem.num_stages)).peak_bytes  # feasible, below eager
    plans = [dataclasses.replace(planner.solvers.solve(p.problem, budget, method="dp"), solve_seconds=0.0)
             for p in (real, meta)]
    assert plans[0] == plans[1] and plans[0].regions  # the same plan, and one that recomputes something


def _meta_llama(hidden, layers, seq, heads=8, batch=1, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=seq, use_cache=False, bos_token_id=0, eos_token_id=0,
                         )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype).train()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def test_a_model_larger_than_this_machine_plans_without_allocating():
    model, args, kwargs = _meta_llama(hidden=4096, layers=6, seq=16384, heads=32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = planner.plan(model, "80GB", args, example_kwargs=kwargs, device="h100")
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert result.eager_peak_bytes > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # > this machine
    assert grown < 2 * 2**30
    assert result.timing == "analytic:h100" and result.device == "meta" and result.allocator_margin == 0.05
    assert result.predicted_peak_bytes <= result.planned_budget_bytes == int(80e9 * 0.95)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert result.eager_peak_bytes > 2 * params  # parameters and their gradients are counted


def test_fused_attention_saves_no_attention_matrix():
    model, args, kwargs = _meta_llama(hidden=512, layers=1, seq=2048, heads=8, dtype=torch.bfloat16)
    captured = capture(model, args, kwargs)
    fused = pose(captured, device="h100", profile_repeats=1)
    math = pose(captured, device=H100_AS_RUN, profile_repeats=1)
    attention_matrix = 8 * 2048 * 2048 * 2
    saved = [sum(t.nbytes for t in p.problem.tensors if t.savers) for p in (fused, math)]
    assert saved[1] - saved[0] >= attention_matrix  # the math path keeps at least the softmax
    sdpa = next(n for n in captured.compute_nodes() if n.target == torch.ops.aten.scaled_dot_product_attention.default)
    assert sdpa.meta["planner"].flops > 0  # the fused kernel's FLOPs are counted too


def test_fused_attention_matches_the_math_shapes_and_masks():
    q = torch.empty(2, 4, 64, 32, device="meta", requires_grad=True)
    mask = torch.ones(2, 1, 64, 64, dtype=torch.bool, device="meta")
    out = fused_attention(q, q, q, attn_mask=mask, dropout_p=0.1, scale=0.2)
    assert out.shape == q.shape and out.grad_fn.name() == "ScaledDotProductEfficientAttentionBackward0"
    kv = torch.empty(2, 2, 64, 32, device="meta", dtype=torch.bfloat16)
    half = fused_attention(q.bfloat16(), kv, kv, is_causal=True, enable_gqa=True)
    assert half.shape == (2, 4, 64, 32) and half.grad_fn.name() == "ScaledDotProductFlashAttentionBackward0"


def test_a_meta_model_needs_a_device_to_time_it():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with pytest.raises(PlannerError, match=r"meta device has no run time.*device=.*h100"):
        planner.plan(model, "1GB", torch.empty(4, 8, device="meta"))


def test_mixed_devices_are_refused_with_the_remedy():
    model = torch.nn.Linear(8, 8)
    with pytest.raises(PlannerError, match=r"different devices \(cpu, meta\).*torch.device\(\"meta\"\)"):
        planner.plan(model, "1GB", torch.empty(4, 8, device="meta"), device="h100")


def test_a_meta_plan_applies_to_the_real_model():
    example = build_example("gpt2")
    model, (args, kwargs) = meta_copy(example.model, (example.example_inputs, example.example_kwargs))
    meta_plan = planner.plan(model, None, args, example_kwargs=kwargs, device="l4", solver="uniform")
    assert meta_plan.budget_text == "l4 memory" and meta_plan.budget_bytes == device_spec("l4").memory_bytes
    restored = planner.Plan.from_json(meta_plan.to_json())
    assert restored.timing == "analytic:l4" and restored.allocator_margin == 0.05
    opt = planner.apply(example.model, restored, example.example_inputs, example_kwargs=example.example_kwargs)
    loss = example.loss_fn(opt(*example.example_inputs, **example.example_kwargs))
    loss.backward()
    assert "region_0" in opt.code and example.model.transformer.wte.weight.grad is not None


def test_a_meta_plan_of_attention_without_dropout_applies_to_the_real_model():
    """Meta's attention (the math path) returns a contiguous output where the CPU's flash kernel, and CUDA's,
    return the query's layout, so the meta graph copies each layer's heads (``.transpose(1, 2).contiguous()``) and
    the real one does not: the plan still applies, those copies left out, and trains exactly like the model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, use_cache=False)  # attention_dropout 0, as Llama's
    real = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 64))
    model, (args, kwargs) = meta_copy(real, ((), {"input_ids": ids, "labels": ids}))
    meta_plan = planner.plan(model, None, args, example_kwargs=kwargs, device="h100", solver="uniform")
    copies = {name for names in meta_plan.stage_nodes for name in names if name.endswith("_contiguous")}
    real_nodes = {n.name for n in capture(real, (), {"input_ids": ids, "labels": ids}).graph_module.graph.nodes}
    assert len(copies - real_nodes) == 2  # one per layer; the loss's copy of its shifted logits is made on both
    real(input_ids=ids, labels=ids).loss.backward()
    eager = {name: p.grad.clone() for name, p in real.named_parameters()}
    real.zero_grad(set_to_none=True)
    opt = planner.apply(real, meta_plan, example_kwargs={"input_ids": ids, "labels": ids})
    opt(input_ids=ids, labels=ids).loss.backward()
    assert "region_0" in opt.code
    assert all(torch.equal(p.grad, eager[name]) for name, p in real.named_parameters())


def test_budgets_on_a_device():
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)])
    x = torch.empty(8192, 4096, device="meta")
    with pytest.raises(PlannerError, match=r"more than a100 holds \(80.00 GiB\)"):
        planner.plan(model, "100GB", x, device="a100")
    with pytest.raises(PlannerError, match=r"budget=None means all of the device's memory"):
        planner.plan(torch.nn.Linear(2, 2), None, torch.zeros(1, 2))
    with pytest.raises(PlannerError, match=r"allocator_margin 1.5 is not a share"):
        planner.plan(model, "1GB", x, device="a100", allocator_margin=1.5)
    with pytest.raises(InfeasibleBudgetError, match=r"with 10% left to the allocator") as info:
        planner.plan(model, "400MB", x, device="a100", allocator_margin=0.1)
    minimum = info.value.minimum_budget_bytes
    fits = planner.plan(model, minimum, x, device="a100", allocator_margin=0.1)  # the named minimum works
    assert fits.predicted_peak_bytes <= fits.planned_budget_bytes <= minimum
    assert captured_device_type(capture(model, (x,))) == "meta"
