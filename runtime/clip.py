"""The gradient norm over the whole pipeline at an optimizer step, and clipping by it.

At a step every rank holding a stage has its stage's synchronised gradients (replicas
all-reduced, tied copies summed: ``pipeplan.runtime.sync``). Each rank sums the squares
of the gradients it *counts*, one all-reduce of that one number over every stage's ranks
gives the squared global norm, and every rank scales its gradients by
``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does on the
whole model. A gradient is counted once: replica 0 counts its stage (the replicas hold
the same sum), and a tied parameter is counted by the first rank of its tie, once. In a
tensor-parallel group every rank counts its shards of the split parameters and rank 0 of
the group the parameters it holds whole (``counted_here``).

Schedules: the flush schedules and 2BW step every stage once per minibatch, so the
norm spans the pipeline (2BW: the norm of the delayed gradient it applies; the
all-reduce makes the last stage wait for the first one's backward of that minibatch).
1F1B-RR steps each stage on its own minibatches at its own time (a replicated stage
steps on the mean of several), so no single gradient spans the pipeline: there the norm
is the stage's own (``group`` None, no communication).

Without clipping (``--log-dir`` alone) nothing is all-reduced: each rank hands its sum
to the live log, which adds them, so logging never makes a stage wait.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from pipeplan.errors import RuntimeFailure
from pipeplan.runtime.collectives import sum_over
from pipeplan.runtime.comm import short_reason
from pipeplan.runtime.stage import PipelineSpec
from pipeplan.runtime.sync import GradSync
from pipeplan.tensor_parallel.apply import counted_here
from pipeplan.tensor_parallel.apply import local as local_shard

__all__ = ["GradNorm", "make_grad_norm"]

_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


@dataclass
class GradNorm:
    """Measures (and with ``max_norm``, clips) the gradient norm at each step."""

    rank: int
    module: nn.Module | None
    max_norm: float | None  # None: measure only (for --log-dir), no communication
    group: dist.ProcessGroup | None = None  # every stage's ranks; None: this stage alone (1F1B-RR)
    group_ranks: tuple[int, ...] = ()
    across_pipeline: bool = True
    device: str = "cpu"  # where the all-reduced number lives (NCCL: the GPU)
    counted: list[str] = field(default_factory=list)  # local parameter names whose gradients count
    tp_index: int = 0  # this rank's index in its tensor-parallel group

    def apply(self) -> float:
        """This rank's counted sum of squared gradients; with ``max_norm``, clips by the norm.

        Clipping across the pipeline all-reduces the sum first; measuring only (``--log-dir``
        without clipping) needs no communication: the live log adds every rank's sum.
        """
        params = dict(self.module.named_parameters()) if self.module is not None else {}
        square = torch.zeros((), dtype=torch.float64, device=self.device)
        for name in self.counted:
            grad = params[name].grad
            if grad is not None and counted_here(grad, self.tp_index):
                square += local_shard(grad).detach().double().pow(2).sum()
        local = float(square)
        if self.max_norm is None:
            return local
        if self.across_pipeline:
            try:
                sum_over(square, self.group, self.group_ranks)
            except Exception as exc:
                raise RuntimeFailure(
                    f"rank {self.rank}: all-reduce of the gradient norm among ranks "
                    f"{list(self.group_ranks)} failed: {short_reason(exc)}"
                ) from exc
        coefficient = self.max_norm / (math.sqrt(float(square)) + _EPS)
        if coefficient < 1.0:
            for param in params.values():
                if param.grad is not None:
                    param.grad.mul_(coefficient)
        return local


def make_grad_norm(
    spec: PipelineSpec,
    rank: int,
    sync: GradSync,
    max_norm: float | None,
    across_pipeline: bool,
    timeout_s: float,
    device: str = "cpu",
) -> GradNorm:
    """The norm of this rank's step (collective when ``across_pipeline``: every rank calls it)."""
    module = spec.rank_module if spec.stage is not None else None
    clip = GradNorm(
        rank, module, max_norm, across_pipeline=across_pipeline, device=device, tp_index=spec.tp_index
    )
    if across_pipeline:
        busy = sorted({r for stage_ranks in spec.ranks for r in stage_ranks})
        clip.group = dist.new_group(busy, timeout=timedelta(seconds=timeout_s))
        clip.group_ranks = tuple(busy)
    if module is None:
        return clip
    if across_pipeline and spec.replica != 0:
        return clip  # replica 0 counts the stage: after the all-reduce every replica holds the same
    counted: dict[str, bool] = {}  # tied local name -> counted here
    for _, ranks, copies in sync.tie_groups:
        for names in copies:  # a tie's copies on this rank: the first one stands for them
            for i, name in enumerate(names):
                counted[name] = i == 0 and (ranks[0] == rank or not across_pipeline)
    clip.counted = [name for name, _ in module.named_parameters() if counted.get(name, True)]
    return clip
