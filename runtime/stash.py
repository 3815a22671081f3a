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
    max_versions: int  # W_s + 1: more versions in use at once is a schedule error
    steps: int = 0  # optimizer steps applied to the live weights
    versions: dict[int, WeightVersion] = field(default_factory=dict)
    peak_versions: int = 0

    def acquire(self) -> WeightVersion:
        """The newest version (snapshotted on first use after a step), for one forward."""
        version = self.versions.get(self.steps)
        if version is None:
            if self.max_versions == 1:
                # One version in use at a time: no optimizer step can come between its
                # forward and its backward, so it may be the live weights (no copy).
                params = dict(self.module.named_parameters())
            else:
                params = {
                    name: p.detach().clone().requires_grad_(p.requires_grad)
                    for name, p in self.module.named_parameters()
                }
            version = WeightVersion(self.steps, params)
            self.versions[self.steps] = version
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
        for name, tensor in version.params.items():
            grads[name] = tensor.grad
            tensor.grad = None
        version.users -= 1
        if version.users == 0 and version.id != self.steps:
            del self.versions[version.id]
        return grads

    def load_grads(self, grads: dict[str, torch.Tensor | None]) -> None:
        """Put one unit's gradients on the live parameters, for the optimizer step."""
        for name, p in self.module.named_parameters():
            g = grads.get(name)
            p.grad = torch.zeros_like(p) if g is None else g

    def stepped(self) -> None:
        """The optimizer updated the live weights: later forwards get a new version."""
        self.steps += 1
        stale = [vid for vid, v in self.versions.items() if v.users == 0]
        for vid in stale:
            del self.versions[vid]
