"""A tiny Hugging Face BERT for masked language modelling (random weights, dropout on) on random tokens."""

from __future__ import annotations

import torch

from examples.common import Example, check_size, generator, seeded, train_demo

# size -> (layers, hidden, intermediate, heads, vocab, batch, seq)
CONFIGS = {
    "test": (4, 64, 256, 4, 128, 8, 128),
    "demo": (6, 192, 768, 6, 512, 8, 256),
}


def loss_fn(out) -> torch.Tensor:
    return out.loss


def build(size: str = "test", seed: int = 0) -> Example:
    from transformers import BertConfig, BertForMaskedLM

    layers, hidden, inter, heads, vocab, batch, seq = CONFIGS[check_size(size)]
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=inter,
        max_position_embeddings=seq,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    with seeded(seed):
        model = BertForMaskedLM(config).train()
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator(seed + 1))
    return Example(
        name="bert",
        model=model,
        example_inputs=(input_ids,),
        example_kwargs={"labels": input_ids},  # every position predicted: random tokens, no masking needed
        loss_fn=loss_fn,
        block_path="bert.encoder.layer",
    )


if __name__ == "__main__":
    train_demo(build)
