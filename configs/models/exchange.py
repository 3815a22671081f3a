"""A model of messages, not compute: four ``Linear(4, 4)`` layers (about 75 us at batch 8 on
one core), so that a 2-stage pipeline's time is its messages and the runtime's cost per
action. ``pipeplan calibrate`` trains it to measure a topology's message overhead
(``planner/message_overhead.py`` fits it); it is not one of the bundled models a user trains."""

import torch
import torch.nn.functional as F
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 4), torch.randint(0, 4, (batch_size,))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
