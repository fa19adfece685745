"""Issue 8: examples/hf_trainer.py at its tiny size: a planned Hugging Face GPT-2 trains exactly like the model in
a plain loop within its budget, and ``transformers.Trainer`` drives it without planning again."""

from __future__ import annotations

import math

import pytest
import torch

from examples import gpt2
from examples.hf_trainer import planned_gpt2, train_with_trainer
from planner.meter import LiveMemoryMeter, storage_bytes

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


def test_trainer_drives_the_planned_module_without_planning_again(planned, tmp_path):
    model, opt, ids = planned
    reference = gpt2.build("test").model
    reference.load_state_dict(model.state_dict())
    before = model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    # Trainer reads the model's loss_type through the wrapper, so it counts a causal LM's tokens the same way
    assert opt.loss_type == reference.loss_type and opt.config is model.config
    trained = train_with_trainer(opt, ids, steps=2, output_dir=str(tmp_path / "planned"))
    assert len(opt._planned) == 1, "Trainer's inputs should match the planned signature"
    assert len(trained.losses) == 2 and all(math.isfinite(x) for x in trained.losses)
    assert not torch.equal(before, model.transformer.h[0].mlp.c_fc.weight)  # it trained the model's parameters
    assert trained.losses == train_with_trainer(reference, ids, steps=2, output_dir=str(tmp_path / "eager")).losses
