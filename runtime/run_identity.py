"""Which run a checkpoint belongs to: model, optimizer, lr schedule and seed (and its plan).

A ``RunIdentity`` is written into every checkpoint manifest (``pipeplan.runtime.checkpoint``).
Its ``fingerprint`` hashes what a resumed run must share with the saved one (the model's
layer structure, the optimizer and its weight decay, the LR schedule's settings,
the clipping norm, the seed). The plan (split, ranks,
schedule) and ``lr`` are recorded but not hashed: checkpoints are keyed by the model's
qualified names, so a run re-planned onto other stages, replicas or world size resumes
(the runtime prints the changed plan), and a changed lr is applied.
``check_checkpoint_dir`` refuses, in one line, a directory that already holds
checkpoints unless ``--resume`` asks to continue the same run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from pipeplan.errors import InputError
from pipeplan.plan import Plan

__all__ = ["RunIdentity", "plan_fingerprint", "check_checkpoint_dir"]

_MATCHING = ("model", "optimizer", "lr_schedule", "clip_grad_norm", "seed")  # fields a resume must share


def plan_fingerprint(plan: Plan, schedule: str, microbatches: int) -> str:
    """16 hex digits over what decides the checkpoint layout and the training math."""
    stages = [[sorted(stage.layers), list(stage.ranks)] for stage in plan.stages]
    basis = [stages, schedule, microbatches, plan.batch_size, plan.dtype, plan.virtual_stages]
    return hashlib.sha256(json.dumps(basis).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunIdentity:
    plan: str  # plan_fingerprint(...): recorded, a resume may change it
    model: str  # the model's layer-structure fingerprint
    optimizer: str  # "adamw(weight_decay=0.1)", ... or "make_optimizer (model file)"
    lr: float  # learning rate (may change on resume)
    seed: int
    lr_schedule: str = "constant"  # LRSchedule.describe() or "make_lr_scheduler (model file)"
    clip_grad_norm: float | None = None

    @property
    def fingerprint(self) -> str:
        basis = {name: getattr(self, name) for name in _MATCHING}
        return "run-" + hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def differences(self, saved: dict[str, Any]) -> list[str]:
        """``["optimizer adam != sgd", ...]``: this run's values vs a saved identity."""
        return [
            f"{name} {saved.get(name)!r} (saved) != {getattr(self, name)!r} (this run)"
            for name in _MATCHING
            if saved.get(name) != getattr(self, name)
        ]


def check_checkpoint_dir(directory: str, identity: RunIdentity, resume: bool) -> None:
    """``InputError`` when ``directory`` holds another run's checkpoints, or any without --resume."""
    from pipeplan.runtime.checkpoint.store import read_run, step_folders

    steps = step_folders(directory)
    if not steps:
        return
    found = read_run(directory)
    if not resume:
        owner = f"run {found[0]}" if found else "unreadable files"
        raise InputError(
            f"checkpoint directory {directory} already holds checkpoints (steps up to {steps[-1]}, "
            f"{owner}); pass --resume to continue that run or choose another --checkpoint-dir"
        )
    if found is None or found[0] == identity.fingerprint:
        return
    differ = identity.differences(found[1]) or [f"fingerprint {found[0]} != {identity.fingerprint}"]
    raise InputError(
        f"--resume: checkpoint directory {directory} holds another run ({'; '.join(differ)}); "
        f"resume needs the same model, optimizer, LR schedule, clipping and seed"
    )
