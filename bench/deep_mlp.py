"""Benchmark model: 8 equal blocks (Linear 1024 -> 1024, ReLU) and a 10-way head.

An ``nn.Sequential`` of 17 children (block b is children 2b and 2b + 1, the head is 16),
so 2, 4 or 8 equal pipeline stages are whole blocks: the split is balanced for 1F1B on
2 and 4 ranks and for interleaved 1F1B with 2 chunks per rank.
"""

import torch
from torch import nn

WIDTH = 1024
BLOCKS = 8


def build_model() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def sample_batch(batch_size: int):
    return torch.randn(batch_size, WIDTH), torch.randint(0, 10, (batch_size,))
