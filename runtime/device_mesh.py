"""The device mesh of a tensor-parallel run: (pipeline, data, tensor), or one (data, tensor) mesh per stage.

A stage's ``ranks`` are replica-major (``ranks[r*t:(r+1)*t]`` is replica r's
tensor-parallel group), so reshaping them to (replicas, t) gives the stage's
(data, tensor) mesh: its tensor dimension carries the DTensor collectives of one
replica, its data dimension the gradient all-reduce among the replicas. When every
pipeline position has the same replicas and degree, the stages stack into one
(pipeline, data, tensor) mesh, as Megatron's and torchtitan's runs lay out; otherwise
(a plan may give each stage its own degree) each stage gets its own mesh. Creating a
mesh is collective: every rank builds every mesh, in stage order.

The stage's column- and row-parallel linear pairs (``pipeplan.tensor_parallel.plans``) are
split over the mesh's tensor dimension with ``parallelize_module``
(``pipeplan.tensor_parallel.apply``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["stage_meshes"]


def stage_meshes(
    ranks: Sequence[Sequence[int]], tensor_parallel: Sequence[int], positions: int, device_type: str
) -> list[DeviceMesh | None]:
    """The (data, tensor) mesh of each pipeline position (collective on every rank).

    ``ranks[q]`` / ``tensor_parallel[q]``: model stage q's ranks and degree; only the
    first ``positions`` stages are used (with virtual stages, a position's later chunks
    run on the same ranks).
    """
    layouts = [torch.tensor(list(ranks[q])).view(-1, tensor_parallel[q]) for q in range(positions)]
    if len({tuple(layout.shape) for layout in layouts}) == 1:
        mesh = DeviceMesh(device_type, torch.stack(layouts), mesh_dim_names=("pipeline", "data", "tensor"))
        return [_position_slice(mesh, q, layouts[q]) for q in range(positions)]
    return [DeviceMesh(device_type, layout, mesh_dim_names=("data", "tensor")) for layout in layouts]


def _position_slice(mesh: DeviceMesh, position: int, layout: torch.Tensor) -> DeviceMesh | None:
    """Position ``position``'s (data, tensor) slice of the 3-D mesh (None off this rank's position).

    ``mesh["data", "tensor"]`` is the slice holding this rank; other positions' slices
    are not needed on this rank (their collectives never include it).
    """
    import torch.distributed as dist

    if dist.get_rank() in layout.flatten().tolist():
        return mesh["data", "tensor"]
    return None
