"""Megatron's sequence parallelism on a tensor-parallel stage, with DTensor's ``SequenceParallel``.

Korthikanti et al. shard the activations of the regions tensor parallelism leaves whole
(layer norms, dropout, the residual stream between blocks) along the sequence over the
tensor-parallel group: each rank holds 1/t of them. The all-reduce after a row-parallel
matmul becomes a reduce-scatter onto sequence shards, and the activation a
column-parallel matmul reads is all-gathered first; backward swaps the two.

In the stage's DTensor global view (``pipeplan.tensor_parallel.apply``) this is:

- DTensor's ``SequenceParallel`` style on every norm and dropout module the stage's graph
  calls (``call_module``: an fx capture, such as the bundled GPT's ``nn.LayerNorm``): its
  input is redistributed to ``Shard(1)`` (a local slice of a replicated value) and its
  output stays sequence-sharded, its parameters replicated (their gradients partial sums,
  all-reduced by ``settle_gradients``);
- ``scatter_sequence`` after a matmul reading a split weight: a partial sum becomes
  ``Shard(1)`` (reduce-scatter; backward all-gathers);
- ``gather_sequence`` before it: a sequence-sharded activation becomes replicated
  (all-gather; backward reduce-scatters the partial gradient); ``apply`` keeps Megatron's
  gradient all-reduce for a replicated one (a stage input read by a matmul directly).

A ``torch.export`` capture (Hugging Face models) runs its norms as ATen ops reading weights
as graph attributes, with no module call for the style: there the norms after a stage's
first reduce-scatter run on sequence shards by DTensor's sharding propagation (the residual
stream is ``Shard(1)`` from then on); the stage's input, and so its first norm, stay
replicated.
"""

from __future__ import annotations

from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

__all__ = [
    "SEQUENCE_DIM",
    "sequence_regions",
    "sequence_parallel_modules",
    "gather_sequence",
    "scatter_sequence",
]

SEQUENCE_DIM = 1  # activations are (batch, sequence, hidden)
_REGIONS = (nn.LayerNorm, nn.RMSNorm, nn.Dropout)


def sequence_regions(module: nn.Module) -> list[str]:
    """Paths (in ``module``) of the norm and dropout modules its captured graphs call."""
    paths = []
    for prefix, sub in module.named_modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op == "call_module" and isinstance(sub.get_submodule(str(node.target)), _REGIONS):
                paths.append(f"{prefix}.{node.target}" if prefix else str(node.target))
    return paths


def sequence_parallel_modules(module: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Apply ``SequenceParallel`` to the norm and dropout modules ``module``'s graphs call; their
    paths (none in a torch.export capture, whose norms DTensor shards by propagation)."""
    paths = sequence_regions(module)
    if paths:
        parallelize_module(module, mesh, dict.fromkeys(paths, SequenceParallel(sequence_dim=SEQUENCE_DIM)))
    return paths


def scatter_sequence(value: object) -> object:
    """A partial-sum DTensor reduce-scattered onto sequence shards (backward: all-gather), else ``value``."""
    if (
        isinstance(value, DTensor)
        and any(p.is_partial() for p in value.placements)
        and value.ndim > SEQUENCE_DIM
    ):
        return value.redistribute(value.device_mesh, [Shard(SEQUENCE_DIM)] * len(value.placements))
    return value


def gather_sequence(value: object) -> object:
    """A sequence-sharded DTensor all-gathered (its partial gradient reduce-scattered back), else
    ``value`` (a row-parallel matmul's feature-sharded input stays as it is)."""
    if isinstance(value, DTensor) and any(p.is_shard(SEQUENCE_DIM) for p in value.placements):
        return value.redistribute(value.device_mesh, [Replicate()] * len(value.placements))
    return value
