"""The optimizers and learning-rate schedules pipeplan plans for and trains with, built one way everywhere.

The profiler times each optimizer's step, the planner charges its state in memory, and
the runtime trains with it: all three must mean the same update. Weight decay follows
the usual rule: parameters with fewer than two dimensions (biases, norm weights) are
not decayed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeplan.errors import InputError

if TYPE_CHECKING:  # typing only: torch is imported where it is used
    import torch

__all__ = [
    "OPTIMIZERS",
    "STATE_COPIES",
    "LR_SCHEDULES",
    "LRSchedule",
    "make_optimizer",
    "make_lr_scheduler",
    "param_groups",
]

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")

# Parameter-sized float32 tensors of optimizer state per parameter (momentum buffer;
# Adam's and AdamW's two moments).
STATE_COPIES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}

LR_SCHEDULES = ("constant", "linear", "cosine")


def param_groups(named_params: Iterable[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Two named groups: ``decay`` (ndim >= 2) and ``no_decay`` (biases, norms; weight_decay 0).

    The ``decay`` group takes the optimizer's own weight decay; ``param_names`` holds
    each parameter's name as given (qualified names in the runtime). Empty groups are left out.
    """
    decay: list[tuple[str, Any]] = []
    no_decay: list[tuple[str, Any]] = []
    for name, param in named_params:
        (decay if param.ndim >= 2 else no_decay).append((name, param))
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append(
            {"name": "decay", "params": [p for _, p in decay], "param_names": [n for n, _ in decay]}
        )
    if no_decay:
        groups.append(
            {
                "name": "no_decay",
                "params": [p for _, p in no_decay],
                "param_names": [n for n, _ in no_decay],
                "weight_decay": 0.0,
            }
        )
    return groups


def make_optimizer(
    name: str, params: Iterable[Any], lr: float, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """``torch.optim`` optimizer ``name``: sgd, momentum (SGD, momentum 0.9), adam, adamw.

    ``params``: tensors or parameter groups (``param_groups``); ``weight_decay`` is the
    default of every group that does not set its own (AdamW: decoupled decay; the others:
    L2 added to the gradient, as torch does).
    """
    import torch

    if name not in OPTIMIZERS:
        raise InputError(f"unknown optimizer {name!r} (choose {', '.join(OPTIMIZERS)})")
    params = list(params)
    fused = _fused(name, params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, fused=fused)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay, fused=fused)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, fused=fused)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)


def _fused(name: str, params: list[Any]) -> bool | None:
    """True where torch has a fused kernel for every parameter; None (torch's default) otherwise.

    The fused step updates each tensor in one pass with no temporaries; torch's default on a
    CPU (one tensor at a time) allocates two parameter-sized temporaries per tensor for Adam,
    which the planner's memory rule (``pipeplan.planner.memory``) does not charge. Measured on
    a CPU, 4 x 64 MiB weights: Adam's step held 128 MiB more without it and took about 20 times as long.
    DTensor shards have fused Adam/AdamW but no fused SGD.
    """
    from torch.distributed.tensor import DTensor
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    supported = _get_fused_kernels_supported_devices()
    if not tensors or any(t.device.type not in supported or not t.is_floating_point() for t in tensors):
        return None
    if name in ("sgd", "momentum") and any(isinstance(t, DTensor) for t in tensors):
        return None
    return True


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate of step t (0-based): linear warm-up, then constant, linear or cosine decay.

    Warm-up: ``lr * (t + 1) / warmup_steps`` for t < warmup_steps. Then, with progress
    ``p = (t - warmup_steps) / (total_steps - warmup_steps)`` (0 at the first step after
    the warm-up; ``min_lr`` would be the step after the last, so no step runs at lr 0):
    constant ``lr``; linear ``min_lr + (lr - min_lr) * (1 - p)``; cosine
    ``min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2``. As Hugging Face's warm-up schedules.

    >>> s = LRSchedule("cosine", warmup_steps=2, min_lr=0.0, total_steps=6)
    >>> [round(s.lr(t, 1.0), 3) for t in range(6)]
    [0.5, 1.0, 1.0, 0.854, 0.5, 0.146]
    """

    kind: str = "constant"  # one of LR_SCHEDULES
    warmup_steps: int = 0
    min_lr: float = 0.0
    total_steps: int = 1

    def check(self, lr: float) -> None:
        """One-line ``InputError`` for settings that make no schedule."""
        if self.kind not in LR_SCHEDULES:
            raise InputError(f"unknown --lr-schedule {self.kind!r} (choose {', '.join(LR_SCHEDULES)})")
        if self.warmup_steps < 0 or self.warmup_steps > self.total_steps:
            raise InputError(
                f"--warmup-steps must be between 0 and --steps {self.total_steps} (got {self.warmup_steps})"
            )
        if not (math.isfinite(self.min_lr) and 0.0 <= self.min_lr <= lr):
            raise InputError(f"--min-lr must be between 0 and --lr {lr} (got {self.min_lr})")

    def lr(self, step: int, lr: float) -> float:
        """The learning rate of (0-based) step ``step`` for peak learning rate ``lr``."""
        if step < self.warmup_steps:
            return lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return lr
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        if self.kind == "linear":
            return self.min_lr + (lr - self.min_lr) * (1.0 - progress)
        return self.min_lr + (lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def describe(self) -> str:
        """``cosine(warmup_steps=10, min_lr=1e-05, total_steps=100)``: recorded in checkpoints.

        A constant schedule does not depend on the run's length, so a resumed run may
        extend ``--steps``; a decaying one may not (its curve would change).
        """
        if self.kind == "constant":
            return f"constant(warmup_steps={self.warmup_steps})"
        return (
            f"{self.kind}(warmup_steps={self.warmup_steps}, min_lr={self.min_lr!r}, "
            f"total_steps={self.total_steps})"
        )


class _Factor:
    """``LambdaLR``'s multiplier of the base lr at step t (an object: its settings go in state_dict)."""

    def __init__(self, schedule: LRSchedule, lr: float) -> None:
        self.kind, self.warmup_steps = schedule.kind, schedule.warmup_steps
        self.min_lr, self.total_steps, self.peak = schedule.min_lr, schedule.total_steps, lr

    def __call__(self, step: int) -> float:
        schedule = LRSchedule(self.kind, self.warmup_steps, self.min_lr, self.total_steps)
        return schedule.lr(step, self.peak) / self.peak


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: LRSchedule, lr: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``torch.optim.lr_scheduler.LambdaLR`` following ``schedule`` from peak ``lr``.

    Stepped once per training step after the optimizer step; its ``state_dict`` (step
    count and settings) goes into the checkpoint beside the optimizer's.
    """
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, _Factor(schedule, lr))
