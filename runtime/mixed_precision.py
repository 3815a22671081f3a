"""Mixed-precision training of one rank: float32 masters, bf16 compute copies, float32 gradients.

The rank module's parameters are the *masters* (``master_dtype``, float32): the
optimizer, the gradient all-reduce, clipping, checkpoints and ``--weights`` see only
them, unchanged. The layers run on *compute copies* (``dtype``, bf16: one leaf tensor
per master, through ``torch.func.functional_call``), so activations, and the values
sent between stages, are bf16. Each copy's bf16 gradient is added into its master's
float32 ``.grad`` as soon as autograd has accumulated it (a post-accumulate hook, then
the bf16 gradient is dropped), so micro-batch gradients sum in float32 and at most a
few bf16 gradients exist at a time: Megatron's float32 ``main_grad`` buffers, without
its fused GEMM. After the optimizer step the copies are refreshed from the masters.
Floating-point buffers (BatchNorm statistics, rotary tables) are cast to ``dtype``, as
the profile measured them; they have no master.

Tensor parallelism (``pipeplan.tensor_parallel.apply``): the masters are float32 DTensors
and each copy is a bf16 DTensor with its master's placements (the cast runs on the local
shard; no communication), so the split stage runs in bf16, its collectives included
(bf16 all-reduces and all-gathers of activations, as in Megatron). A copy's gradient
keeps the placements DTensor's sharding propagation gave it (a vocabulary-parallel
embedding's is replicated); it is cast to float32 on the local shard and summed into the
master's gradient, whose placements ``settle_gradients`` fixes once per step, in float32. Schedules with weight versions
(1F1B-RR, 2BW) take their versions as ``dtype`` snapshots of the masters instead
(``pipeplan.runtime.stash``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["MixedPrecision", "cast_buffers"]


def cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers of ``module`` (every submodule, each once) to ``dtype``."""
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                sub._buffers[name] = buffer.to(dtype)


@dataclass
class MixedPrecision:
    """The compute copies of one rank's masters (module docstring)."""

    dtype: torch.dtype  # compute
    chunks: Sequence[nn.Module]  # the rank's chunk modules, whose parameters are the masters
    _pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (master, copy)
    _copies: dict[int, torch.Tensor] = field(default_factory=dict)  # id(master) -> copy (tied: one)
    _by_chunk: list[dict[str, torch.Tensor]] = field(default_factory=list)  # chunk -> local name -> copy
    _hooks: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        copies = self._copies
        for chunk in self.chunks:
            named = {}
            for name, master in chunk.named_parameters():
                if id(master) not in copies:
                    copy = master.detach().to(self.dtype, copy=True).requires_grad_(master.requires_grad)
                    copies[id(master)] = copy
                    self._pairs.append((master, copy))
                    if copy.requires_grad:
                        self._hooks.append(copy.register_post_accumulate_grad_hook(self._hook_for(master)))
                named[name] = copies[id(master)]
            self._by_chunk.append(named)

    @staticmethod
    def _hook_for(master: torch.Tensor) -> Any:
        def move(copy: torch.Tensor) -> None:
            _add_grad(master, copy)

        return move

    def forward(self, chunk: nn.Module, inputs: Sequence[Any]) -> Any:
        """The chunk module ``chunk`` (one of ``chunks``) run on its compute copies."""
        index = next(c for c, module in enumerate(self.chunks) if module is chunk)
        return torch.func.functional_call(chunk, self._by_chunk[index], tuple(inputs), tie_weights=True)

    def copy_of(self, master: torch.Tensor) -> torch.Tensor:
        """The compute copy of ``master`` (one of the chunks' parameters)."""
        return self._copies[id(master)]

    def parameters(self, chunk: int) -> list[torch.Tensor]:
        """The compute copies chunk ``chunk`` differentiates (split backward's weights)."""
        return list(self._by_chunk[chunk].values())

    def accumulate(self) -> None:
        """Move gradients autograd left on the copies (a split backward's ``W`` sets ``.grad``
        itself, so no hook runs) into the masters, in float32."""
        for master, copy in self._pairs:
            if copy.grad is not None:
                _add_grad(master, copy)

    @torch.no_grad()
    def refresh(self) -> None:
        """The optimizer stepped the masters: the copies take their new values."""
        for master, copy in self._pairs:
            copy.copy_(master)


def _add_grad(master: torch.Tensor, copy: torch.Tensor) -> None:
    """``master.grad += copy.grad`` in the master's dtype; the copy's gradient is dropped."""
    grad = copy.grad
    assert grad is not None
    if master.grad is None:
        master.grad = grad.to(master.dtype)
    else:
        master.grad.add_(grad)
    copy.grad = None
