"""Benchmark model for bench/bench_memory.py: BLOCKS blocks (Linear WIDTH -> WIDTH, Tanh) and a
10-way head, an ``nn.Sequential`` (block b is children 2b and 2b + 1, the head is the last).

PIPEPLAN_BENCH_BLOCKS (default 8) and PIPEPLAN_BENCH_WIDTH (default 2048: 16 MiB per block).
"""

import os

import torch
from torch import nn

WIDTH = int(os.environ.get("PIPEPLAN_BENCH_WIDTH", "2048"))
BLOCKS = int(os.environ.get("PIPEPLAN_BENCH_BLOCKS", "8"))


def build_model() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def sample_batch(batch_size: int):
    return torch.randn(batch_size, WIDTH), torch.randint(0, 10, (batch_size,))
