"""A VGG-16-style CNN: 13 3x3 convolutions in 5 blocks with max-pooling, then 3 Linear.

A bundled pipeplan model file: ``nn.Sequential(features, flatten, classifier)`` with
nested Sequentials (layer names ``features.0``, ``classifier.3``, ...). Scale it with
environment variables (defaults profile in a few seconds on a CPU; the real VGG-16 on
ImageNet is ``PIPEPLAN_VGG_WIDTH=64 PIPEPLAN_IMAGE_SIZE=224 PIPEPLAN_CLASSES=1000``):

- ``PIPEPLAN_VGG_WIDTH``  channels of the first block (default 8; VGG-16: 64). Later blocks
  use 2x, 4x, 8x, 8x; the hidden Linear width is 64x (VGG-16: 4096).
- ``PIPEPLAN_IMAGE_SIZE`` square image side in pixels, a multiple of 32 (default 32)
- ``PIPEPLAN_CLASSES``    classes (default 10)

Each image is noise plus a fixed per-class template, so the task is learnable.
``sample_batch`` is deterministic given ``torch.manual_seed``.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch
from torch import nn

WIDTH = int(os.environ.get("PIPEPLAN_VGG_WIDTH", "8"))
IMAGE_SIZE = int(os.environ.get("PIPEPLAN_IMAGE_SIZE", "32"))
CLASSES = int(os.environ.get("PIPEPLAN_CLASSES", "10"))
# VGG-16 "configuration D": channel multipliers of the first block's width, "M" = max-pool.
CONFIG: tuple[int | str, ...] = (1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M")

if IMAGE_SIZE % 32:
    raise ValueError(f"PIPEPLAN_IMAGE_SIZE must be a multiple of 32 (got {IMAGE_SIZE})")

_TEMPLATES = torch.randn(CLASSES, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(1234))


def build_model() -> nn.Module:
    features: list[nn.Module] = []
    channels = 3
    for entry in CONFIG:
        if entry == "M":
            features.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            out_channels = WIDTH * int(entry)
            features += [nn.Conv2d(channels, out_channels, kernel_size=3, padding=1), nn.ReLU()]
            channels = out_channels
    side = IMAGE_SIZE // 32
    hidden = 64 * WIDTH
    classifier = nn.Sequential(
        nn.Linear(channels * side * side, hidden),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(hidden, CLASSES),
    )
    return nn.Sequential(
        OrderedDict(features=nn.Sequential(*features), flatten=nn.Flatten(), classifier=classifier)
    )


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)``: float32 (batch_size, 3, S, S) and int64 (batch_size,)."""
    labels = torch.randint(0, CLASSES, (batch_size,))
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE) + 0.5 * _TEMPLATES[labels]
    return images, labels
