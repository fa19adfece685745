"""A tiny Hugging Face Llama (random weights, attention dropout on) on random tokens."""

from __future__ import annotations

import torch

from examples.common import Example, check_size, generator, seeded, train_demo

# size -> (layers, hidden, intermediate, heads, kv heads, vocab, batch, seq)
CONFIGS = {
    "test": (4, 64, 172, 4, 2, 128, 8, 128),
    "demo": (6, 192, 512, 6, 2, 512, 8, 256),
}


def loss_fn(out) -> torch.Tensor:
    return out.loss


def build(size: str = "test", seed: int = 0) -> Example:
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, inter, heads, kv_heads, vocab, batch, seq = CONFIGS[check_size(size)]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        attention_dropout=0.1,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    with seeded(seed):
        model = LlamaForCausalLM(config).train()
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator(seed + 1))
    return Example(
        name="llama",
        model=model,
        example_inputs=(input_ids,),
        example_kwargs={"labels": input_ids},
        loss_fn=loss_fn,
        block_path="model.layers",
    )


if __name__ == "__main__":
    train_demo(build)
