"""DTensor sharding rules for the grouped matmul of transformers' MoE experts.

Transformers 5 runs a layer's experts as one grouped matmul over the tokens sorted by
expert (``transformers::grouped_mm_fallback`` where ``torch.nn.functional.grouped_mm`` does
not apply, as on CPU in float32), a custom op DTensor has no rule for. Registered here with
``torch.distributed.tensor.experimental.register_sharding``, the experts split as Megatron
splits an MLP: ``input (S, K) @ weight (E, K, N)`` runs whole, column-parallel (the weight
split on N: the output split on its features) or row-parallel (the weight split on K, the
input split alike: the output a partial sum). The backward op gets the matching rules.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["register_expert_rules"]


@functools.cache
def register_expert_rules() -> bool:
    """Register the rules once per process; False where transformers' op does not exist."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    try:
        import transformers.integrations.moe  # noqa: F401  (defines the ops)
    except ImportError:
        return False
    ops = getattr(torch.ops, "transformers", None)
    if ops is None or not hasattr(ops, "grouped_mm_fallback"):
        return False
    whole = Replicate()

    def forward_rules(*_: object) -> list[tuple[list[object], list[object]]]:
        # (input, weight, offs) -> output: whole, column-parallel, row-parallel
        return [
            ([whole], [whole, whole, whole]),
            ([Shard(1)], [whole, Shard(2), whole]),
            ([Partial()], [Shard(1), Shard(1), whole]),
        ]

    def backward_rules(*_: object) -> list[tuple[list[object], list[object]]]:
        # (input, weight, offs, grad_output) -> (grad_input, grad_weight)
        return [
            ([whole, whole], [whole, whole, whole, whole]),
            ([Partial(), Shard(2)], [whole, Shard(2), whole, Shard(1)]),
            ([Shard(1), Shard(1)], [Shard(1), Shard(1), whole, whole]),
        ]

    register_sharding(ops.grouped_mm_fallback.default)(forward_rules)
    register_sharding(ops.grouped_mm_fallback_backward.default)(backward_rules)
    return True
