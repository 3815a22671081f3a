"""A model file for the pipeplan tutorial: a small residual MLP classifier.

The model file contract: ``build_model()`` returns the ``nn.Module``;
``sample_batch(batch_size)`` returns ``(inputs, targets)``; ``loss_fn`` is optional
(cross-entropy for integer targets, mean squared error otherwise would be the default).
"""

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, WIDTH, CLASSES = 256, 512, 10


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.Sequential(*(ResidualBlock(WIDTH) for _ in range(4)))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def build_model() -> nn.Module:
    return ResidualMLP()


def sample_batch(batch_size: int):
    labels = torch.randint(0, CLASSES, (batch_size,))
    x = torch.randn(batch_size, FEATURES)
    x[torch.arange(batch_size), labels] += 3.0  # a learnable signal
    return x, labels


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
