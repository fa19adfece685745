"""Issue 8: examples/hf_trainer.py at its tiny size: a planned Hugging Face GPT-2 trains exactly like the model in
a plain loop within its budget, and ``transformers.Trainer`` drives it without planning again."""

from __future__ import annotations

import math

import pytest
import torch

import planner
from examples import gpt2
from examples.hf_trainer import planned_gpt2, train_with_trainer
from planner.meter import LiveMemoryMeter, storage_bytes
from planner.rewrite import CheckpointRegion

pytest.importorskip("accelerate")  # Trainer needs it; it is in the test extra


@pytest.fixture(scope="module")
def planned():
    return planned_gpt2(for_trainer=True)  # planned once, with the inputs Trainer passes


def _plain_losses(module, ids, steps=2):
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    count = torch.tensor(float(ids[:, 1:].numel()))
    torch.manual_seed(0)
    losses = []
    for _ in range(steps):
        out = module(input_ids=ids, labels=ids, num_items_in_batch=count)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses


def test_plain_loop_matches_the_model_step_for_step_within_budget(planned):
    model, opt, ids = planned
    count = torch.tensor(float(ids[:, 1:].numel()))
    fixed = storage_bytes(list(model.parameters()) + [ids, count])
    with LiveMemoryMeter() as meter:
        opt(input_ids=ids, labels=ids, num_items_in_batch=count).loss.backward()
    model.zero_grad(set_to_none=True)
    assert opt.plan.regions and fixed + meter.peak_bytes <= opt.plan.budget_bytes
    reference = gpt2.build("test").model
    reference.load_state_dict(model.state_dict())
    assert _plain_losses(opt, ids) == _plain_losses(reference, ids)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    assert len(opt._planned) == 1


def test_a_shorter_sequence_reuses_the_plan_without_profiling(planned, monkeypatch):
    """A dynamically padded batch, shorter than the one planned for, runs the same plan captured for its shape:
    no profile (planning again took 35 s at this size), the same losses as the model, within the plan's peak."""
    model, opt, ids = planned
    first = opt.planned
    monkeypatch.setattr("planner.api._plan_captured", lambda *a, **k: pytest.fail("planned the shorter batch anew"))
    short = ids[:, :96].contiguous()
    count = torch.tensor(float(short[:, 1:].numel()))
    reference = gpt2.build("test").model
    reference.load_state_dict(model.state_dict())
    fixed = storage_bytes(list(model.parameters()) + [short, count])
    torch.manual_seed(0)
    with LiveMemoryMeter() as meter:
        out = opt(input_ids=short, labels=short, num_items_in_batch=count)
        out.loss.backward()
    torch.manual_seed(0)
    expected = reference(input_ids=short, labels=short, num_items_in_batch=count).loss
    expected.backward()
    reused = opt.plan
    assert reused.reused_from == first.plan.fingerprint and reused.regions == first.plan.regions
    assert torch.equal(out.loss, expected)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0, msg=name)
    assert fixed + meter.peak_bytes <= first.plan.predicted_peak_bytes
    model.zero_grad(set_to_none=True)
    del opt._planned[opt.planned.captured.key]  # as the module was for the tests that follow
    opt._last = first


def _plans(opt) -> int:
    """How many plans ``opt`` holds: Accelerate marks the model it prepares (``_is_accelerate_prepared = True``),
    which changes a number on it, so Trainer's first step captures again and finds the graph it planned (the same
    code), and the plan is kept under a second key too."""
    return len({id(planned) for planned, _ in opt._planned.values()})


def test_switching_hugging_face_checkpointing_on_and_off_keeps_the_plan(planned):
    """Plans are cached under the model's hooks, and Hugging Face's checkpointing adds its input-grads hook each
    time it is switched on and leaves it when switched off: that hook is left out, so the plan stays (the demo,
    which switches it for its comparison, ran its planned steps 2.4x eager's, each capturing again)."""
    from examples.common import hugging_face_checkpointing

    model, opt, ids = planned
    first, count = opt.planned, torch.tensor(float(ids[:, 1:].numel()))
    for _ in range(2):
        hugging_face_checkpointing(model, True)
        hugging_face_checkpointing(model, False)
        opt(input_ids=ids, labels=ids, num_items_in_batch=count).loss.backward()
        model.zero_grad(set_to_none=True)  # a step that begins with gradients held has a plan of its own
    assert opt.planned is first and len(opt._planned) == 1


def test_trainer_drives_the_planned_module_without_planning_again(planned, tmp_path):
    model, opt, ids = planned
    reference = gpt2.build("test").model
    reference.load_state_dict(model.state_dict())
    before = model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    # Trainer reads the model's loss_type through the wrapper, so it counts a causal LM's tokens the same way
    assert opt.loss_type == reference.loss_type and opt.config is model.config
    first = opt.planned
    trained = train_with_trainer(opt, ids, steps=2, output_dir=str(tmp_path / "planned"))
    # Trainer's inputs match the planned signature, and its move of the model to the CPU, where it is, keeps the
    # plan (until 2026-12-07 the move dropped it, and the first step planned again)
    assert opt.planned is first and _plans(opt) == 1
    assert len(trained.losses) == 2 and all(math.isfinite(x) for x in trained.losses)
    assert not torch.equal(before, model.transformer.h[0].mlp.c_fc.weight)  # it trained the model's parameters
    assert trained.losses == train_with_trainer(reference, ids, steps=2, output_dir=str(tmp_path / "eager")).losses


def test_trainer_saves_a_model_planned_in_place_as_it_saves_the_model(tmp_path):
    """Given the planned module, ``Trainer`` saves only a state dict, and with GPT-2's tied embeddings that fails
    (safetensors refuses shared tensors). Planned in place, the model is what ``Trainer`` holds: it trains under
    the plan, exactly as the model does, and its checkpoints load with ``from_pretrained``."""
    model, opt, ids = planned_gpt2(for_trainer=True, in_place=True)
    reference = gpt2.build("test").model
    reference.load_state_dict(model.state_dict())
    first = opt.planned
    regions = [m for m in opt._planned[first.captured.key][1].modules() if isinstance(m, CheckpointRegion)]
    calls = []
    for region in regions:
        region.register_forward_pre_hook(lambda module, args: calls.append(module))
    trained = train_with_trainer(model, ids, steps=2, output_dir=str(tmp_path / "planned"), save_steps=2)
    assert opt.planned is first and _plans(opt) == 1
    assert regions and len(calls) == 2 * len(regions)  # each step ran the plan's regions
    assert trained.losses == train_with_trainer(reference, ids, steps=2, output_dir=str(tmp_path / "eager")).losses
    saved = type(model).from_pretrained(str(tmp_path / "planned" / "checkpoint-2"))
    for (name, a), b in zip(model.state_dict().items(), saved.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_trainer_trains_a_peft_lora_model_planned_in_place_and_saves_its_adapters(tmp_path):
    """The usual fine-tuning set-up: LoRA adapters on a frozen Llama, ``Trainer`` driving the model planned in
    place. The same losses as ``Trainer`` on the unplanned model (adapter dropout included), the plan's regions run
    each step, and the checkpoint is PEFT's adapters, which load onto a fresh base model as trained."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)

    def build():
        torch.manual_seed(0)
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
        return peft.get_peft_model(LlamaForCausalLM(config), lora)
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(0))
    model = build()
    kwargs = {"input_ids": ids, "labels": ids, "num_items_in_batch": torch.tensor(float(ids[:, 1:].numel()))}
    opt = planner.optimize(model, "60%", example_kwargs=kwargs, profile_repeats=1, in_place=True)
    regions = [m for m in opt._planned[opt.planned.captured.key][1].modules() if isinstance(m, CheckpointRegion)]
    calls = []
    for region in regions:
        region.register_forward_pre_hook(lambda module, args: calls.append(module))
    trained = train_with_trainer(model, ids, steps=2, output_dir=str(tmp_path / "planned"), save_steps=2)
    assert regions and len(calls) == 2 * len(regions)
    assert trained.losses == train_with_trainer(build(), ids, steps=2, output_dir=str(tmp_path / "eager")).losses
    torch.manual_seed(1)
    loaded = peft.PeftModel.from_pretrained(LlamaForCausalLM(config), str(tmp_path / "planned" / "checkpoint-2"))
    adapters = {name: value for name, value in model.state_dict().items() if "lora_" in name}
    assert len(adapters) == 12
    for name, value in loaded.state_dict().items():
        if "lora_" in name:
            torch.testing.assert_close(value, adapters[name], atol=0, rtol=0, msg=name)
