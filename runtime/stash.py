"""Weight stashing for 1F1B-RR: every in-flight minibatch keeps the weights of its forward.

The optimizer updates the live parameters of the stage module. A forward runs on a
*version*: a snapshot of the live parameters taken after the latest optimizer step (the
live parameters themselves where the schedule keeps a single version: no copy)
(separate leaf tensors, so later in-place updates never invalidate what autograd saved),
through ``torch.func.functional_call``. Its backward differentiates the same graph, so
it uses the same version by construction; its gradients are collected per unit and
handed to the step. A version is dropped when no in-flight minibatch uses it, so a
replica of stage s keeps at most ``weight_versions = W_s + 1`` versions (plus the live
weights the optimizer writes).

Version ids count optimizer steps: version v holds the weights after v steps.

Mixed precision (``compute_dtype``; ``pipeplan.runtime.mixed_precision``): the live
parameters are the float32 masters and every version is a ``compute_dtype`` snapshot of
them (one version too: the copy the layers run on); a version's gradients come back in
the masters' dtype, so a minibatch's micro-batch gradients sum in float32.

PipeDream-2BW (``delayed``): a forward of minibatch t runs on version t - 1 (chosen by
the caller from ``ScheduleKind.forward_version``), so the version that the newest step
replaces stays needed: ``before_step`` snapshots the live weights first when no forward
has yet. Versions older than ``steps - 1`` are dropped once unused: at most two exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeplan.errors import RuntimeFailure

__all__ = ["WeightVersion", "WeightStash"]


@dataclass
class WeightVersion:
    id: int  # optimizer steps applied before this snapshot
    params: dict[str, torch.Tensor]  # local (deduplicated) parameter name -> leaf tensor
    users: int = 0  # in-flight units whose forward ran on this version


@dataclass
class WeightStash:
    """Versions of one stage module's parameters (see the module docstring)."""

    module: nn.Module
    max_versions: int  # W_s + 1 (1F1B-RR), 2 (2BW): more versions in use at once is a schedule error
    delayed: bool = False  # 2BW: forwards of minibatch t run on version t - 1
    compute_dtype: torch.dtype | None = None  # mixed precision: versions are snapshots in this dtype
    steps: int = 0  # optimizer steps applied to the live weights
    versions: dict[int, WeightVersion] = field(default_factory=dict)
    peak_versions: int = 0  # most versions in use at once
    peak_kept: int = 0  # most versions held at once (in use or kept for later forwards)

    def acquire(self, version_id: int | None = None) -> WeightVersion:
        """Version ``version_id`` (default: the newest) for one forward.

        The newest is snapshotted on first use after a step; an older one must still be
        held (``RuntimeFailure`` otherwise: the schedule needs more versions).
        """
        wanted = self.steps if version_id is None else version_id
        version = self.versions.get(wanted)
        if version is None and wanted != self.steps:
            raise RuntimeFailure(
                f"weight version {wanted} is gone (live weights are version {self.steps}, "
                f"held: {sorted(self.versions)})"
            )
        if version is None:
            if self.max_versions == 1 and self.compute_dtype is None:
                # One version in use at a time: no optimizer step can come between its
                # forward and its backward, so it may be the live weights (no copy).
                params: dict[str, torch.Tensor] = dict(self.module.named_parameters())
            else:
                params = self._snapshot()
            version = WeightVersion(self.steps, params)
            self.versions[self.steps] = version
            self.peak_kept = max(self.peak_kept, len(self.versions))
        version.users += 1
        in_use = sum(1 for v in self.versions.values() if v.users > 0)
        self.peak_versions = max(self.peak_versions, in_use)
        if in_use > self.max_versions:
            raise RuntimeFailure(
                f"weight stash holds {in_use} versions in use, more than the "
                f"{self.max_versions} the schedule allows"
            )
        return version

    def forward(self, version: WeightVersion, inputs: tuple[Any, ...]) -> Any:
        """Run the stage module on ``version``'s weights (buffers stay the module's own)."""
        return torch.func.functional_call(self.module, version.params, inputs, tie_weights=True)

    def collect_grads(self, version: WeightVersion) -> dict[str, torch.Tensor | None]:
        """Move the gradients of one backward out of ``version`` and release it."""
        grads = {}
        masters = dict(self.module.named_parameters()) if self.compute_dtype is not None else {}
        for name, tensor in version.params.items():
            grad = tensor.grad
            grads[name] = grad.to(masters[name].dtype) if grad is not None and masters else grad
            tensor.grad = None
        version.users -= 1
        if version.users == 0 and version.id < self._oldest_needed():
            del self.versions[version.id]
        return grads

    def _oldest_needed(self) -> int:
        """Oldest version a later forward may still ask for: steps - 1 with 2BW, else steps."""
        return self.steps - 1 if self.delayed else self.steps

    def before_step(self) -> None:
        """2BW: keep the weights the step is about to overwrite (the next minibatch runs on them)."""
        if self.delayed and self.steps not in self.versions:
            self.versions[self.steps] = WeightVersion(self.steps, self._snapshot())
            self.peak_kept = max(self.peak_kept, len(self.versions))

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the live parameters as separate leaves (in ``compute_dtype`` when set)."""
        dtype = self.compute_dtype
        return {
            name: (
                p.detach().to(dtype, copy=True) if dtype is not None else p.detach().clone()
            ).requires_grad_(p.requires_grad)
            for name, p in self.module.named_parameters()
        }

    def load_grads(self, grads: dict[str, torch.Tensor | None]) -> None:
        """Put one unit's gradients on the live parameters, for the optimizer step."""
        for name, p in self.module.named_parameters():
            g = grads.get(name)
            p.grad = torch.zeros_like(p) if g is None else g

    def stepped(self) -> None:
        """The optimizer updated the live weights: later forwards get a new version."""
        self.steps += 1
        stale = [vid for vid, v in self.versions.items() if v.users == 0 and vid < self._oldest_needed()]
        for vid in stale:
            del self.versions[vid]
