"""Gradient synchronisation at an optimizer step ("S").

1. Replicas of a stage all-reduce all gradients in the stage's replica group: the mean
   for 1F1B-RR (each replica ran a whole minibatch, as DistributedDataParallel) and the
   sum for 1F1B-Flush / GPipe (each replica ran some micro-batches of one minibatch whose
   losses are already scaled by 1/M).
2. Parameters tied across stages (a tied embedding and head) sum their gradients over
   the stages holding them (as Megatron does), replica j with replica j, so each copy
   takes the identical optimizer step. With virtual stages a rank may hold several
   copies (two chunks of one tie): it sums them locally first, all-reduces the sum
   among the distinct ranks, and gives every copy the result.

Every process group is created on all ranks in one fixed order (``dist.new_group`` is
collective), replica groups first (by stage), then tie groups (by sorted stage tuple,
then replica). Gradients are flattened into one buffer per all-reduce (two ranks on gloo: one
exchange and an add, ``pipeplan.runtime.collectives``).

Tensor parallelism: a stage's replicas all-reduce over the data dimension of its
(data, tensor) mesh (``pipeplan.runtime.device_mesh``): rank k of each
replica's group with rank k of the others, each on its own shards; tied copies pair
rank k with rank k likewise (tied stages have equal degrees). DTensor gradients are
first given their parameters' placements (``settle_gradients``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipeplan.errors import RuntimeFailure
from pipeplan.runtime.collectives import sum_over
from pipeplan.runtime.comm import short_reason
from pipeplan.runtime.stage import PipelineSpec, rank_names_of
from pipeplan.tensor_parallel.apply import local, settle_gradients

__all__ = ["GradSync", "make_grad_sync"]


@dataclass
class GradSync:
    rank: int
    module: nn.Module | None
    average_replicas: bool
    replica_group: dist.ProcessGroup | None = None  # this stage's replica group (None: one replica)
    replica_ranks: tuple[int, ...] = ()
    # (group or None when all copies are on this rank, ranks, per tied parameter its local copies)
    tie_groups: list[tuple[dist.ProcessGroup | None, tuple[int, ...], list[list[str]]]] = field(
        default_factory=list
    )

    def reduce(self) -> None:
        """All-reduce this stage's gradients (replicas), then the tied ones (stages)."""
        if self.module is None:
            return
        params = dict(self.module.named_parameters())
        for p in params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        settle_gradients(self.module)
        # every name of a tied parameter: two chunks of this rank may hold one Parameter (a
        # V schedule's first and last chunks, a tied embedding and head), which
        # named_parameters() lists once
        every_name = dict(self.module.named_parameters(remove_duplicate=False))
        if self.replica_group is not None:
            names = list(params)
            self._all_reduce(
                [params[n] for n in names],
                self.replica_group,
                self.replica_ranks,
                scale=1.0 / len(self.replica_ranks) if self.average_replicas else 1.0,
                what="replica gradients",
            )
        for group, ranks, copies in self.tie_groups:
            grads = {name: local(_grad(every_name[name])) for names in copies for name in names}
            local_sums = [_local_sum([grads[name] for name in names]) for names in copies]
            if group is not None:
                self._all_reduce_grads(local_sums, group, ranks, 1.0, "tied-parameter gradients")
            for names, total in zip(copies, local_sums):
                for name in names:
                    if grads[name] is not total:
                        grads[name].copy_(total)

    def _all_reduce(
        self,
        params: list[torch.Tensor],
        group: dist.ProcessGroup,
        ranks: tuple[int, ...],
        scale: float,
        what: str,
    ) -> None:
        self._all_reduce_grads([local(p.grad) for p in params], group, ranks, scale, what)  # type: ignore[arg-type]

    def _all_reduce_grads(
        self,
        grads: list[torch.Tensor],
        group: dist.ProcessGroup,
        ranks: tuple[int, ...],
        scale: float,
        what: str,
    ) -> None:
        if not grads:  # a stage without parameters (pooling, activations): nothing to sum
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
        try:
            sum_over(flat, group, ranks)
        except Exception as exc:
            raise RuntimeFailure(
                f"rank {self.rank}: all-reduce of {what} among ranks {list(ranks)} failed: "
                f"{short_reason(exc)}"
            ) from exc
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for g in grads:
            n = g.numel()  # type: ignore[union-attr]
            g.copy_(flat[offset : offset + n].view_as(g))  # type: ignore[union-attr]
            offset += n


def _local_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of one rank's copies of a tied gradient, each tensor once: copies that are one
    Parameter already hold every use's gradient in its ``.grad`` (autograd added them)."""
    distinct = list({id(g): g for g in grads}.values())
    return distinct[0] if len(distinct) == 1 else sum(distinct[1:], distinct[0])


def _grad(param: torch.Tensor) -> torch.Tensor:
    if param.grad is None:
        raise RuntimeFailure("a parameter has no gradient at the step")
    return param.grad


def make_grad_sync(
    spec: PipelineSpec,
    rank: int,
    average_replicas: bool,
    timeout_s: float,
    meshes: list[DeviceMesh | None] | None = None,
) -> GradSync:
    """Create every replica and tie group (collective: all ranks, same order).

    ``meshes``: each pipeline position's (data, tensor) mesh in a tensor-parallel run
    (None elsewhere); the replicas then all-reduce over its data dimension.
    """
    timeout = timedelta(seconds=timeout_s)
    sync = GradSync(rank, spec.rank_module, average_replicas)
    if meshes is not None:
        mesh = meshes[spec.stage_index] if spec.stage_index >= 0 else None
        if mesh is not None and mesh.size(0) > 1:
            sync.replica_group = mesh.get_group("data")
            sync.replica_ranks = tuple(dist.get_process_group_ranks(sync.replica_group))
    else:
        for stage_ranks in spec.ranks[: spec.stages]:  # one replica group per pipeline position
            if len(stage_ranks) > 1:
                group = dist.new_group(list(stage_ranks), timeout=timeout)
                if rank in stage_ranks:
                    sync.replica_group, sync.replica_ranks = group, stage_ranks
    for stages, qualified in spec.tie_groups.items():
        for j in range(len(spec.ranks[stages[0]])):  # replica j // t, tensor-parallel rank j % t
            ranks = tuple(dict.fromkeys(spec.ranks[s][j] for s in stages))
            group = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks and spec.stage is not None:
                sync.tie_groups.append((group, ranks, rank_names_of(spec, stages, qualified)))
    return sync
