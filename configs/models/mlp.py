"""A multi-layer perceptron (``nn.Sequential``): Linear, ReLU, ..., Linear.

A bundled pipeplan model file. Scale it with environment variables (defaults profile
in about a second on a CPU; try ``PIPEPLAN_MLP_DIM=8192 PIPEPLAN_MLP_LAYERS=16`` on a GPU):

- ``PIPEPLAN_MLP_IN``      input features (default 1024)
- ``PIPEPLAN_MLP_DIM``     hidden width (default 1024)
- ``PIPEPLAN_MLP_LAYERS``  hidden Linear+ReLU pairs (default 4)
- ``PIPEPLAN_MLP_CLASSES`` output classes (default 10)

Each sample is unit noise plus twice a fixed per-class template (the templates are far
apart in 1024 dimensions, so the label is all but determined by the input): the task is
learnable within a demo's 20 steps (single process, SGD at lr 0.1, batch 128: loss 2.31
-> 0.03; `pipeplan demo` on 2 CPU workers with 1F1B-RR: 2.31 -> 0.04). ``sample_batch`` draws from torch's global RNG: it is deterministic given
``torch.manual_seed``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

IN_FEATURES = int(os.environ.get("PIPEPLAN_MLP_IN", "1024"))
HIDDEN = int(os.environ.get("PIPEPLAN_MLP_DIM", "1024"))
LAYERS = int(os.environ.get("PIPEPLAN_MLP_LAYERS", "4"))
CLASSES = int(os.environ.get("PIPEPLAN_MLP_CLASSES", "10"))

_TEMPLATES = torch.randn(CLASSES, IN_FEATURES, generator=torch.Generator().manual_seed(1234))


def build_model() -> nn.Module:
    width = [IN_FEATURES] + [HIDDEN] * LAYERS
    modules: list[nn.Module] = []
    for fan_in, fan_out in zip(width[:-1], width[1:]):
        modules += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    modules.append(nn.Linear(width[-1], CLASSES))
    return nn.Sequential(*modules)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, labels)``: x float32 (batch_size, PIPEPLAN_MLP_IN), labels int64 (batch_size,)."""
    labels = torch.randint(0, CLASSES, (batch_size,))
    return torch.randn(batch_size, IN_FEATURES) + 2.0 * _TEMPLATES[labels], labels
