"""A tiny Hugging Face GPT-2 (random weights, dropout on) trained on random tokens."""

from __future__ import annotations

import torch

from examples.common import Example, check_size, generator, seeded, train_demo

# size -> (n_layer, n_embd, n_head, vocab, batch, seq)
CONFIGS = {
    "test": (4, 64, 4, 128, 8, 128),
    "demo": (6, 192, 6, 512, 8, 256),
}


def loss_fn(out) -> torch.Tensor:
    return out.loss


def build(size: str = "test", seed: int = 0) -> Example:
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, n_embd, n_head, vocab, batch, seq = CONFIGS[check_size(size)]
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=256,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    with seeded(seed):
        model = GPT2LMHeadModel(config).train()
    # transformers derives the loss from the class name, which for GPT2LMHeadModel
    # matches nothing and logs a warning before falling back to ForCausalLM.
    model.loss_type = "ForCausalLM"
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator(seed + 1))
    return Example(
        name="gpt2",
        model=model,
        example_inputs=(input_ids,),
        example_kwargs={"labels": input_ids},
        loss_fn=loss_fn,
        block_path="transformer.h",
    )


if __name__ == "__main__":
    train_demo(build)
