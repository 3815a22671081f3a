"""The optimizers pipeplan plans for and trains with, built one way everywhere.

The profiler times each one's step, the planner charges its state in memory, and the
runtime trains with it: all three must mean the same update.
"""

from __future__ import annotations

from typing import Any, Iterable

from pipeplan.errors import InputError

__all__ = ["OPTIMIZERS", "STATE_COPIES", "make_optimizer"]

OPTIMIZERS = ("sgd", "momentum", "adam")

# Tensors of optimizer state per parameter (momentum buffer; Adam's two moments).
STATE_COPIES = {"sgd": 0, "momentum": 1, "adam": 2}


def make_optimizer(name: str, params: Iterable[Any], lr: float) -> Any:
    """``torch.optim`` optimizer ``name`` (sgd, momentum = SGD with momentum 0.9, adam)."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise InputError(f"unknown optimizer {name!r} (choose {', '.join(OPTIMIZERS)})")
