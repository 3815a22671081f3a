"""``--record DIR`` (tests, debugging): each rank's parameters, weight versions and digests.

``DIR/rank<r>.pt`` holds, by qualified name: the final parameters (whole, from any
tensor-parallel split), a digest of every parameter after each step, the weight versions
each work unit ran on, the losses, and the (dtype, placements) of each master and of the
tensor its layers ran on, and the bytes of optimizer state the rank holds.
"""

from __future__ import annotations

import io
import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipeplan.jsonio import write_atomic
from pipeplan.runtime.executor import Executor
from pipeplan.runtime.mixed_precision import MixedPrecision
from pipeplan.runtime.sharding import offload_policies, optimizer_state_bytes
from pipeplan.runtime.stage import PipelineSpec
from pipeplan.runtime.stash import WeightStash
from pipeplan.tensor_parallel.apply import full

__all__ = ["digests", "write_record"]


def digests(module: nn.Module) -> dict[str, float]:
    """Local parameter name -> sum of its whole value (a step's fingerprint of the weights)."""
    return {name: float(full(p.detach()).double().sum()) for name, p in module.named_parameters()}


def write_record(
    folder: str,
    rank: int,
    spec: PipelineSpec,
    module: nn.Module,
    executor: Executor,
    step_digests: list[dict[str, float]],
    stash: WeightStash | None,
    mixed: MixedPrecision | None,
) -> None:
    """This rank's ``rank<r>.pt`` in ``folder`` (``step_digests``: ``digests`` after each step)."""
    names = spec.qualified_names
    params = {names[n]: full(p.detach()).cpu().clone() for n, p in module.named_parameters()}
    obj = {
        "rank": rank,
        "stage": spec.stage_index,
        "replica": spec.replica,
        "params": params,
        "digests": [{names[n]: v for n, v in d.items()} for d in step_digests],
        "units": {
            u: (r.minibatch, r.microbatch, r.forward_version, r.backward_version)
            for u, r in executor.units.items()
        },
        "peak_versions": stash.peak_versions if stash is not None else 1,
        "peak_kept_versions": stash.peak_kept if stash is not None else 1,
        "losses": dict(executor.losses),
        # bytes of the optimizer state this rank holds (a sharded optimizer: its share)
        "optimizer_state_bytes": optimizer_state_bytes(executor.optimizer),
        # FSDP2 units' offload policies (CPUOffloadPolicy under StagePlan.offload optimizer+params)
        "offload_policies": offload_policies(module),
        # (dtype, placements) of each master and of the tensor the layers ran on (its compute copy)
        "masters": {names[n]: _layout(p) for n, p in module.named_parameters()},
        "compute": {
            names[n]: _layout(mixed.copy_of(p) if mixed is not None else p)
            for n, p in module.named_parameters()
        },
    }
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_atomic(os.path.join(folder, f"rank{rank}.pt"), buffer.getvalue())


def _layout(tensor: torch.Tensor) -> tuple[str, tuple[str, ...]]:
    """``("bfloat16", ("Shard(dim=0)",))``: a tensor's dtype and DTensor placements (none: a plain tensor)."""
    placements = tuple(repr(p) for p in tensor.placements) if isinstance(tensor, DTensor) else ()
    return str(tensor.dtype).removeprefix("torch."), placements
