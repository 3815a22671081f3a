"""A ResNet-style CNN: a stem, stages of basic residual blocks, global pooling, a Linear.

A bundled pipeplan model file. The blocks add a skip connection (``out + identity``),
so the layer graph is a DAG, not a chain; the model traces with ``torch.fx``. Scale it
with environment variables (defaults profile in a few seconds on a CPU; ResNet-18-like
on ImageNet: ``PIPEPLAN_RESNET_WIDTH=64 PIPEPLAN_RESNET_BLOCKS=2,2,2,2 PIPEPLAN_IMAGE_SIZE=224
PIPEPLAN_CLASSES=1000``):

- ``PIPEPLAN_RESNET_WIDTH``  channels of the first stage (default 16); each later stage doubles
- ``PIPEPLAN_RESNET_BLOCKS`` blocks per stage, comma-separated (default ``2,2,2``)
- ``PIPEPLAN_IMAGE_SIZE``    square image side in pixels (default 32)
- ``PIPEPLAN_CLASSES``       classes (default 10)

Each image is noise plus a fixed per-class template, so the task is learnable.
``sample_batch`` is deterministic given ``torch.manual_seed``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

WIDTH = int(os.environ.get("PIPEPLAN_RESNET_WIDTH", "16"))
BLOCKS = tuple(int(n) for n in os.environ.get("PIPEPLAN_RESNET_BLOCKS", "2,2,2").split(","))
IMAGE_SIZE = int(os.environ.get("PIPEPLAN_IMAGE_SIZE", "32"))
CLASSES = int(os.environ.get("PIPEPLAN_CLASSES", "10"))

_TEMPLATES = torch.randn(CLASSES, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(1234))


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn, plus the input (1x1 conv projection when the shape changes), relu."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.shortcut(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + identity)


class ResNet(nn.Module):
    def __init__(self, width: int, blocks: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        stages: list[nn.Module] = []
        channels = width
        for position, count in enumerate(blocks):
            out_channels = width * 2**position
            stride = 1 if position == 0 else 2
            stage = [BasicBlock(channels, out_channels, stride)]
            stage += [BasicBlock(out_channels, out_channels, 1) for _ in range(count - 1)]
            stages.append(nn.Sequential(*stage))
            channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(self.stages(self.stem(x)))))


def build_model() -> nn.Module:
    return ResNet(WIDTH, BLOCKS, CLASSES)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)``: float32 (batch_size, 3, S, S) and int64 (batch_size,)."""
    labels = torch.randint(0, CLASSES, (batch_size,))
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE) + 0.5 * _TEMPLATES[labels]
    return images, labels
