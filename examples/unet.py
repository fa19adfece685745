"""A small U-Net written by hand.

Structure, for ``levels=3`` and base width ``c``::

    blocks[0]  ConvBlock(3 -> c)           at H x W        (skip 0)
    blocks[1]  Down: maxpool + ConvBlock(c -> 2c)   H/2    (skip 1)
    blocks[2]  Down: maxpool + ConvBlock(2c -> 4c)  H/4    (skip 2)
    blocks[3]  Down: maxpool + ConvBlock(4c -> 8c)  H/8    (bottleneck)
    blocks[4]  Up: convT(8c -> 4c), cat skip 2, ConvBlock(8c -> 4c)  H/4
    blocks[5]  Up: convT(4c -> 2c), cat skip 1, ConvBlock(4c -> 2c)  H/2
    blocks[6]  Up: convT(2c -> c),  cat skip 0, ConvBlock(2c -> c)   H
    head       1x1 conv c -> 3

A ``ConvBlock`` is (conv3x3 + BatchNorm + ReLU) twice.

``block_path`` is ``"blocks"``: one ``nn.ModuleList`` holding every encoder, bottleneck
and decoder block in execution order.  That is the natural unit for checkpointing here:
each entry is one resolution stage whose inputs are plain tensors (an encoder block takes
the previous output; a decoder block takes the previous output and the matching skip
tensor), and almost all of the activation memory lives inside them.  Note that, unlike a
chain, the skip tensors produced by blocks 0-2 stay alive until blocks 6-4 consume them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.common import Example, check_size, generator, seeded, train_demo


class ConvBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(),
            nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Down(nn.Module):
    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.pool = nn.MaxPool2d(2)
        self.conv = ConvBlock(in_ch, out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pool(x))


class Up(nn.Module):
    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(in_ch, out_ch, 2, stride=2)
        self.conv = ConvBlock(2 * out_ch, out_ch)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, in_ch: int = 3, out_ch: int = 3, base: int = 16, levels: int = 3):
        super().__init__()
        self.levels = levels
        widths = [base * 2**i for i in range(levels + 1)]
        blocks: list[nn.Module] = [ConvBlock(in_ch, widths[0])]
        blocks += [Down(widths[i], widths[i + 1]) for i in range(levels)]
        blocks += [Up(widths[i + 1], widths[i]) for i in reversed(range(levels))]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Conv2d(widths[0], out_ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.blocks[: self.levels + 1]:
            x = block(x)
            skips.append(x)
        skips.pop()  # the bottleneck output is not a skip
        for block in self.blocks[self.levels + 1:]:
            x = block(x, skips.pop())
        return self.head(x)


# size -> (base width, levels, batch, image side)
CONFIGS = {
    "test": (16, 3, 8, 64),
    "demo": (32, 3, 6, 128),
}


def build(size: str = "test", seed: int = 0) -> Example:
    base, levels, batch, side = CONFIGS[check_size(size)]
    with seeded(seed):
        model = UNet(3, 3, base, levels).train()
    g = generator(seed + 1)
    images = torch.randn(batch, 3, side, side, generator=g)
    target = torch.randn(batch, 3, side, side, generator=g)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)

    return Example(
        name="unet",
        model=model,
        example_inputs=(images,),
        example_kwargs={},
        loss_fn=loss_fn,
        block_path="blocks",
    )


if __name__ == "__main__":
    train_demo(build)
