"""Sharded replicas at run time: ZeRO-1 with torch's ``ZeroRedundancyOptimizer``.

A stage the plan shards ``zero1`` among groups of ``shard_degree`` consecutive replicas
(``pipeplan.planner.sharding``) steps a ``torch.distributed.optim.ZeroRedundancyOptimizer``
over its group: each replica keeps the optimizer state of its share of the parameters
(torch's greedy split by size), steps that share after the usual gradient all-reduce
(``pipeplan.runtime.sync``) and broadcasts it to the group. The masters stay whole on
every replica, as the planner charges them. Why not FSDP2 for zero1: FSDP2
(``fully_shard``) shards the parameters and gradients too (that is zero2 / fsdp), and it
trains on gloo CPU ranks in torch 2.13, but it owns the backward (its hooks reduce-scatter
every micro-batch) where this runtime's executors drive the backward themselves (weight
stashing, split backward, their own mixed precision): ``pipeplan run`` refuses zero2 and
fsdp plans in one line (``check_shard``) until the executors are wrapped.

Checkpoints: every replica of the group saves the optimizer state of the parameters it
owns under their qualified names (``pipeplan.runtime.checkpoint.state``), so a run under
another plan, sharded or not, finds each parameter's state in whichever folder holds it;
a sharded run loads the state of the parameters it owns from any plan's step.

Process groups are created on all ranks in one fixed order (stage, then group), after
the replica and tie groups of ``make_grad_sync``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from pipeplan.errors import InputError
from pipeplan.plan import Plan

__all__ = [
    "RUN_MODES",
    "check_shard",
    "local_optimizer",
    "optimizer_state_bytes",
    "shard_group",
    "shard_optimizer",
]

RUN_MODES = ("none", "zero1")  # pipeplan.planner.sharding.RUN_MODES


def check_shard(plan: Plan, custom_optimizer: bool) -> None:
    """``InputError`` in one line for a sharding ``pipeplan run`` does not run (before any communication)."""
    for stage in plan.stages:
        if stage.shard not in RUN_MODES:
            raise InputError(
                f"plan stage {stage.index} shards its replicas {stage.shard}: pipeplan run runs "
                f"{' and '.join(RUN_MODES)} only (partition --shard auto, none or zero1)"
            )
        if stage.shard != "none" and custom_optimizer:
            raise InputError(
                f"plan stage {stage.index} shards its optimizer state (zero1): the model file's "
                "make_optimizer builds its own optimizer (partition --shard none for it)"
            )


def shard_group(plan: Plan, rank: int, timeout_s: float) -> tuple[dist.ProcessGroup | None, tuple[int, ...]]:
    """(this rank's sharding group, its ranks); (None, ()) where its stage is not sharded.
    Collective: every rank creates every group, stage by stage, in the same order."""
    mine: tuple[dist.ProcessGroup | None, tuple[int, ...]] = (None, ())
    timeout = timedelta(seconds=timeout_s)
    positions = len(plan.stages) // plan.virtual_stages
    for stage in plan.stages[:positions]:
        d = stage.shard_degree
        if stage.shard == "none" or d < 2:
            continue
        for start in range(0, stage.replicas, d):
            ranks = tuple(stage.ranks[start : start + d])
            group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                mine = (group, ranks)
    return mine


def shard_optimizer(
    optimizer: Optimizer, groups: list[dict[str, Any]], group: dist.ProcessGroup
) -> Optimizer:
    """``optimizer`` (a built-in ``torch.optim`` one of ``groups``) as a
    ``ZeroRedundancyOptimizer`` of the same class and settings over ``group``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        groups, optimizer_class=type(optimizer), process_group=group, **optimizer.defaults
    )


def local_optimizer(optimizer: Optimizer | None) -> Optimizer | None:
    """The optimizer whose state this rank holds: a ``ZeroRedundancyOptimizer``'s local one
    (its share of the parameters), else ``optimizer``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        inner: Optimizer = optimizer.optim
        return inner
    return optimizer


def optimizer_state_bytes(optimizer: Optimizer | None) -> int:
    """Bytes of the tensors of the optimizer state this rank holds (its share when sharded)."""
    local = local_optimizer(optimizer)
    if local is None:
        return 0
    return sum(
        value.numel() * value.element_size()
        for values in local.state.values()
        for value in values.values()
        if isinstance(value, torch.Tensor)
    )
