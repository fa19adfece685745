"""The seed article's model: a stack of MLP "LargeBlock"s (structure kept verbatim).

Only change from the article: ``use_checkpoint`` defaults to False and, when True,
uses non-reentrant ``torch.utils.checkpoint.checkpoint``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from examples.common import Example, check_size, generator, seeded, train_demo


class LargeBlock(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(size, size * 4),
            nn.ReLU(),
            nn.Linear(size * 4, size * 4),
            nn.ReLU(),
            nn.Linear(size * 4, size),
        )

    def forward(self, x):
        return self.layers(x)


class CheckpointedModel(nn.Module):
    def __init__(self, size, num_blocks):
        super().__init__()
        self.blocks = nn.ModuleList([LargeBlock(size) for _ in range(num_blocks)])

    def forward(self, x, use_checkpoint=False):
        for i, block in enumerate(self.blocks):
            if use_checkpoint:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


# size -> (feature size, number of blocks, batch)
CONFIGS = {
    "test": (64, 8, 512),
    "demo": (128, 16, 2048),
}


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def build(size: str = "test", seed: int = 0) -> Example:
    d, n, batch = CONFIGS[check_size(size)]
    with seeded(seed):
        model = CheckpointedModel(d, n).train()
    x = torch.randn(batch, d, generator=generator(seed + 1)).requires_grad_(True)
    return Example(
        name="largeblock",
        model=model,
        example_inputs=(x,),
        example_kwargs={},
        loss_fn=loss_fn,
        block_path="blocks",
    )


if __name__ == "__main__":
    train_demo(build)
