"""A small CIFAR-style ResNet written by hand (basic blocks with BatchNorm).

Structure: stem (conv3x3 + BN + ReLU) -> ``self.blocks``, one ``nn.Sequential``
holding every residual block of the three stages in order (the first block of
stages 2 and 3 has stride 2 and a 1x1 conv + BN projection shortcut) -> global
average pooling -> ``fc``.  The loss is cross-entropy against fixed random labels
held in the ``loss_fn`` closure.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.common import Example, check_size, generator, seeded, train_demo


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths=(16, 32, 64), blocks_per_stage: int = 2, num_classes: int = 10,
                 in_ch: int = 3):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_ch, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        blocks = []
        prev = widths[0]
        for stage, width in enumerate(widths):
            for i in range(blocks_per_stage):
                stride = 2 if (stage > 0 and i == 0) else 1
                blocks.append(BasicBlock(prev, width, stride))
                prev = width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.blocks(x)
        x = self.pool(x).flatten(1)
        return self.fc(x)


# size -> (widths, blocks per stage, batch, image side)
CONFIGS = {
    "test": ((16, 32, 64), 2, 16, 32),
    "demo": ((32, 64, 128), 3, 64, 32),
}
NUM_CLASSES = 10


def build(size: str = "test", seed: int = 0) -> Example:
    widths, per_stage, batch, side = CONFIGS[check_size(size)]
    with seeded(seed):
        model = ResNet(widths, per_stage, NUM_CLASSES).train()
    g = generator(seed + 1)
    images = torch.randn(batch, 3, side, side, generator=g)
    labels = torch.randint(0, NUM_CLASSES, (batch,), generator=g)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)

    return Example(
        name="resnet",
        model=model,
        example_inputs=(images,),
        example_kwargs={},
        loss_fn=loss_fn,
        block_path="blocks",
    )


if __name__ == "__main__":
    train_demo(build)
