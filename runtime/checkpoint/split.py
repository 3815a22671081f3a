"""Whole tensors out of, and back into, a tensor-parallel stage's DTensors (checkpoints, ``--weights``).

A checkpoint holds every tensor whole under its qualified name, whatever plan saved it,
so any plan of the model reads it. Saving gathers a split tensor (``full_tensor``: a
collective every rank of the tensor-parallel group joins) and the group's writer keeps it
in host memory; loading reads the whole tensor on every rank and keeps the rank's own
shard, sliced as DTensor shards it (uneven chunks included) with no communication.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["whole", "copy_whole", "shard_like", "group_rng_states"]


def whole(value: object) -> object:  # a state-dict value: a tensor, or a step count, a setting
    """``value`` whole: a DTensor gathered over its mesh (collective) onto the host; anything else as is."""
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    return value


def _shard_of(param: DTensor, full: torch.Tensor) -> DTensor:
    """``full`` as a DTensor with ``param``'s mesh and placements: each rank slices its own copy."""
    return distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)


def copy_whole(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor ``full`` into ``target`` (a DTensor parameter: into this rank's shard)."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            target.to_local().copy_(_shard_of(target, full).to_local())
        else:
            target.copy_(full)


def shard_like(param: torch.Tensor, value: object) -> object:  # as ``whole``
    """An optimizer state ``value`` saved whole, with ``param``'s placements when ``param`` is
    a DTensor and ``value`` has its shape (``exp_avg``, a momentum buffer); else as is (``step``)."""
    if (
        isinstance(param, DTensor)
        and torch.is_tensor(value)
        and value.dim() > 0
        and value.shape == param.shape
    ):
        return _shard_of(param, value)
    return value


def group_rng_states(mesh: DeviceMesh) -> list[torch.Tensor]:
    """Every rank's CPU RNG state in the 1-D tensor-parallel ``mesh``, in mesh order (collective).

    Random ops in a split region draw per rank, so each rank's state is saved (by the
    group's first rank) to continue as it would on a resume under the same plan.
    """
    import torch.distributed as dist

    states: list[torch.Tensor | None] = [None] * mesh.size()
    dist.all_gather_object(states, torch.get_rng_state(), group=mesh.get_group())
    return [torch.as_tensor(state) for state in states]
