"""Plan a Hugging Face model, then train it with a plain loop and with ``transformers.Trainer``.

    python -m examples.hf_trainer            # the tiny GPT-2 of examples/gpt2.py, a few steps each way

The planned module takes the model's keyword inputs (``input_ids``, ``labels``) and returns its ``ModelOutput``,
so ``Trainer`` (which needs ``accelerate``) drives it like the model itself; it trains the model's own parameters.
To have ``Trainer`` save checkpoints as it does for the model (``save_pretrained``, which ``from_pretrained``
reads), plan with ``in_place=True`` and give ``Trainer`` the model itself: its forward then runs the plan.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch

import planner
from examples import gpt2


@dataclass(frozen=True)
class Trained:
    """Losses of each step, and the plan they ran under."""

    losses: tuple[float, ...]
    plan: planner.Plan | None


def planned_gpt2(budget: str = "60%", seed: int = 0, *, for_trainer: bool = False, in_place: bool = False):
    """The tiny GPT-2 of :mod:`examples.gpt2` (dropout on) planned for ``budget``, and its example batch.

    ``Trainer`` also passes ``num_items_in_batch`` (the label tokens it averages over): planned with it, the
    first ``Trainer`` step does not plan again for a new input signature. ``in_place``: the model itself runs
    the plan (see :func:`planner.optimize`).
    """
    example = gpt2.build("test", seed=seed)
    ids = example.example_inputs[0]
    kwargs = {"input_ids": ids, "labels": ids}
    if for_trainer:
        kwargs["num_items_in_batch"] = torch.tensor(float(ids[:, 1:].numel()))
    opt = planner.optimize(example.model, budget, example_kwargs=kwargs, profile_repeats=1, in_place=in_place)
    return example.model, opt, ids


def train_plain(opt: planner.OptimizedModule, ids: torch.Tensor, steps: int = 3, lr: float = 1e-3) -> Trained:
    """A plain loop: forward with keywords, ``out.loss.backward()``, AdamW step."""
    optimizer = torch.optim.AdamW(opt.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = opt(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return Trained(tuple(losses), opt.plan)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train_with_trainer(opt: torch.nn.Module, ids: torch.Tensor, steps: int = 3, output_dir: str = "hf_out",
                       lr: float = 1e-3, save_steps: int = 0) -> Trained:
    """``transformers.Trainer`` on the planned module (or a model planned in place): one full batch per step, on
    the CPU, a checkpoint every ``save_steps`` steps in ``output_dir`` (none for 0)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=len(ids), max_steps=steps,
                             learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                             logging_steps=1, save_strategy="steps" if save_steps else "no",
                             save_steps=save_steps or 500, report_to=[], use_cpu=True,
                             dataloader_drop_last=True, seed=0, disable_tqdm=True,
                             remove_unused_columns=False)  # the planned forward takes **kwargs
    trainer = Trainer(model=opt, args=args, train_dataset=_Tokens(ids))
    trainer.train()
    losses = tuple(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    return Trained(losses, opt.plan if isinstance(opt, planner.OptimizedModule) else None)


def main() -> None:
    _, opt, ids = planned_gpt2()
    print(opt.plan.summary())
    print("plain loop losses:", train_plain(opt, ids).losses)
    _, opt, ids = planned_gpt2(for_trainer=True)
    print("Trainer losses:   ", train_with_trainer(opt, ids).losses)
    model, opt, ids = planned_gpt2(for_trainer=True, in_place=True)
    with tempfile.TemporaryDirectory() as out:
        print("Trainer, in place:", train_with_trainer(model, ids, steps=2, output_dir=out, save_steps=2).losses)
        saved = type(model).from_pretrained(os.path.join(out, "checkpoint-2"))
        same = all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), model.state_dict().values()))
        print("checkpoint-2 loads with from_pretrained, same weights:", same)


if __name__ == "__main__":
    main()
