"""Sharded replicas at run time: ZeRO-1 with ``ZeroRedundancyOptimizer``, ZeRO-2 and FSDP with FSDP2.

A stage the plan shards among groups of ``shard_degree`` consecutive replicas
(``pipeplan.planner.sharding``):

- ``zero1``: a ``torch.distributed.optim.ZeroRedundancyOptimizer`` over the group: each
  replica keeps the optimizer state of its share of the parameters (torch's greedy split by
  size), steps that share after the usual gradient all-reduce (``pipeplan.runtime.sync``)
  and broadcasts it; the masters stay whole on every replica, as the planner charges them.
  ZeroRedundancyOptimizer rather than FSDP2 for zero1: FSDP2 shards gradients and weights
  too (that is zero2), and this leaves every schedule's executor as it is (weight stashing,
  split backward, mixed precision): zero1 runs wherever the plan puts it.
- ``zero2`` / ``fsdp``: FSDP2 ``fully_shard`` of the chunk module over the replicas' mesh
  (``reshard_after_forward`` False / True; fsdp also shards each child holding parameters
  as a unit of its own). FSDP2 reduce-scatters the gradients (summed: a plain SUM, gloo
  has no PREMUL_SUM) in place of the replica all-reduce. Run for float32 flush schedules
  with exact gradients and one backward (GPipe, 1F1B-flush), a sharding group of all of
  the stage's replicas, no ``--recompute`` and no recomputed layers (``StagePlan.recompute_layers``:
  a zero1 stage runs them, a zero2/fsdp one is refused; the planner prices both alike);
  ``check_shard`` refuses the rest in one line.

Offload (``StagePlan.offload``, ``pipeplan.planner.offload``): ``optimizer+params`` runs
FSDP2's ``CPUOffloadPolicy`` on every ``fully_shard`` unit of a zero2 / fsdp stage (sharded
parameters, gradients and optimizer state on the host, the optimizer stepping there;
``pin_memory`` on CUDA only: pinning needs an accelerator). ``optimizer`` alone is refused:
FSDP2 has no policy that leaves the parameters on the device and moves only the optimizer
state, and pipeplan runs no hand-written copy of one.

Found on this machine (torch 2.13 CPU, 2 gloo ranks): FSDP2 ``fully_shard`` and
``ZeroRedundancyOptimizer`` both train; ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))``
trains on CPU tensors over gloo allclose to one process (``pin_memory=True`` fails without an
accelerator). Untested on GPUs (NCCL): the same calls.

Checkpoints: a zero1 replica saves the optimizer state of the parameters it owns under
their qualified names; an FSDP2 stage's replicas all join each tensor's gather and the
first writes it whole. A run under another plan, sharded or not, finds each tensor in
whichever folder holds it and keeps its own share.

Process groups are created on all ranks in one fixed order (stage, then group), after
the replica and tie groups of ``make_grad_sync``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pipeplan.errors import InputError
from pipeplan.plan import Plan
from pipeplan.schedules import schedule_kind

__all__ = [
    "RUN_MODES",
    "FSDP_MODES",
    "check_fsdp_ties",
    "check_shard",
    "fully_shard_stage",
    "local_optimizer",
    "offload_policies",
    "optimizer_state_bytes",
    "shard_group",
    "shard_optimizer",
]

RUN_MODES = ("none", "zero1")  # run wherever the plan puts them
FSDP_MODES = ("zero2", "fsdp")  # FSDP2 fully_shard: float32 flush schedules (``check_shard``)


def check_shard(plan: Plan, schedule: str, mixed: bool, recompute: bool, custom_optimizer: bool) -> None:
    """``InputError`` in one line for a sharding ``pipeplan run`` does not run (before any communication)."""
    kind = schedule_kind(schedule)
    for stage in plan.stages:
        if stage.shard != "none" and stage.tensor_parallel > 1:
            raise InputError(
                f"plan stage {stage.index} shards its replicas {stage.shard} and splits them "
                f"{stage.tensor_parallel} ways: pipeplan run shards stages without tensor parallelism"
            )
        if stage.shard == "zero1" and custom_optimizer:
            raise InputError(
                f"plan stage {stage.index} shards its optimizer state (zero1): the model file's "
                "make_optimizer builds its own optimizer (partition --shard none for it)"
            )
        if stage.offload == "optimizer":
            raise InputError(
                f"plan stage {stage.index} offloads its optimizer state alone: FSDP2's CPUOffloadPolicy "
                "moves parameters and gradients too (partition --offload all, or none)"
            )
        if stage.shard not in FSDP_MODES:
            continue
        why = (
            f"schedule {schedule} keeps weight versions or splits the backward"
            if not kind.runs_tensor_parallel
            else "mixed precision (FSDP2 would need its own MixedPrecisionPolicy)"
            if mixed
            else "--recompute"
            if recompute
            else "recomputed layers (partition --recompute none for it)"
            if stage.recompute_layers or stage.selective_layers
            else "tensor-parallel or interleaved stages"
            if stage.tensor_parallel > 1 or plan.virtual_stages > 1
            else f"a sharding group of {stage.shard_degree} of its {stage.replicas} replicas"
            if stage.shard_degree != stage.replicas
            else ""
        )
        if why:
            raise InputError(
                f"plan stage {stage.index} shards its replicas {stage.shard}: pipeplan run runs it "
                f"with FSDP2 on float32 flush schedules over all of a stage's replicas, not with {why}"
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
    """Bytes of the tensors of the optimizer state this rank holds (its share when sharded:
    a ZeroRedundancyOptimizer's local state, or the local shards of FSDP2's DTensor state)."""
    local = local_optimizer(optimizer)
    if local is None:
        return 0
    from torch.distributed.tensor import DTensor

    return sum(
        (value.to_local() if isinstance(value, DTensor) else value).numel() * value.element_size()
        for values in local.state.values()
        for value in values.values()
        if isinstance(value, torch.Tensor)
    )


def fully_shard_stage(
    chunks: list[nn.Module], mode: str, group: dist.ProcessGroup, device_type: str, offload: bool = False
) -> None:
    """FSDP2 ``fully_shard`` of this rank's chunk modules over its stage's replicas
    (``group``): ``zero2`` one unit per chunk kept whole from forward to backward
    (``reshard_after_forward=False``); ``fsdp`` each child holding parameters a unit of its
    own, gathered again for the backward. Gradients are summed over the replicas, as the
    flush schedules' ``GradSync`` sums them (each replica's losses are already scaled by 1/M).
    ``offload``: every unit under ``CPUOffloadPolicy`` (pinned host memory on CUDA)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device_type)
    policy = CPUOffloadPolicy(pin_memory=device_type == "cuda") if offload else OffloadPolicy()
    reshard = mode == "fsdp"
    for chunk in chunks:
        units: list[nn.Module] = []
        if reshard:
            units = [child for child in chunk.children() if any(True for _ in child.parameters())]
        for unit in units + [chunk]:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
            assert isinstance(unit, FSDPModule)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)


def offload_policies(module: nn.Module) -> list[str]:
    """The class names of the offload policies of ``module``'s FSDP2 units (reads FSDP2's
    state: its parameter groups' ``offload_policy``); [] without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    names = []
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            state = unit._get_fsdp_state()
            for group in state._fsdp_param_groups:
                names.append(type(group.offload_policy).__name__)
    return names


def check_fsdp_ties(mode: str, tied: bool, stage: int) -> None:
    """``InputError`` in one line for an FSDP2 stage holding a weight tied to another stage
    (their shards would not line up for the tie's all-reduce)."""
    if mode in FSDP_MODES and tied:
        raise InputError(
            f"plan stage {stage} shards its replicas {mode} and holds a weight tied to another stage: "
            "pipeplan run shards tied stages with zero1 or none"
        )
