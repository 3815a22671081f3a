"""A rank's training state: its optimizer and LR scheduler, and its checkpoints (save, resume, weights).

The parameters go to the optimizer as named groups (``pipeplan.optimizers.param_groups``);
the model file's ``make_optimizer`` / ``make_lr_scheduler`` replace the built-in ones.
A checkpoint (``pipeplan.runtime.checkpoint``, keyed by qualified names) holds the
model, the optimizer's and the scheduler's state and the RNG, so a resumed run
continues the learning-rate curve exactly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from pipeplan.errors import InputError, first_line
from pipeplan.modelfile import ModelFile
from pipeplan.optimizers import make_lr_scheduler, make_optimizer, param_groups
from pipeplan.runtime.checkpoint import pretrained, store
from pipeplan.runtime.checkpoint import state as ckstate
from pipeplan.runtime.checkpoint.persist import Persister
from pipeplan.runtime.checkpoint.split import group_rng_states
from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.run_identity import RunIdentity
from pipeplan.runtime.sharding import FSDP_MODES, local_optimizer, shard_optimizer
from pipeplan.runtime.stage import PipelineSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "Layout",
    "make_training_optimizer",
    "apply_lr",
    "plan_layout",
    "describe_layout",
    "resume",
    "save",
    "load_weights",
    "loader_states",
]

Layout = dict[str, Any]  # a checkpoint manifest's "layout": the plan that wrote it (JSON)


def make_training_optimizer(
    config: RunConfig,
    model_file: ModelFile,
    spec: PipelineSpec,
    module: nn.Module | None,
    shards: dist.ProcessGroup | None = None,
) -> tuple[Optimizer | None, LRScheduler | None]:
    """(optimizer, LR scheduler) of this rank's parameters; (None, None) when it has none.

    The parameters go as named groups (``pipeplan.optimizers.param_groups``: qualified
    names, biases and norms without weight decay) to the built-in optimizer or to the model
    file's ``make_optimizer(params)``; ``make_lr_scheduler(optimizer)`` likewise. ``shards``:
    the group the plan shards this stage's optimizer state over (zero1: the built-in
    optimizer as a ``ZeroRedundancyOptimizer``, ``pipeplan.runtime.sharding``).
    """
    if module is None or not list(module.parameters()):
        return None, None
    names = spec.qualified_names
    groups = param_groups((names[n], p) for n, p in module.named_parameters())
    if model_file.make_optimizer is not None:
        optimizer = _user_hook(model_file.make_optimizer, model_file, "make_optimizer", groups)
        for method in ("step", "zero_grad", "state_dict", "load_state_dict"):
            if not callable(getattr(optimizer, method, None)) or not hasattr(optimizer, "param_groups"):
                raise InputError(
                    f"{model_file.path}: make_optimizer returned {type(optimizer).__name__}, "
                    f"not a torch.optim.Optimizer (it has no {method}() or param_groups)"
                )
    else:
        optimizer = make_optimizer(config.optimizer, groups, config.optim.lr, config.optim.weight_decay)
        if shards is not None:
            optimizer = shard_optimizer(optimizer, groups, shards)
    if model_file.make_lr_scheduler is not None:
        scheduler = _user_hook(model_file.make_lr_scheduler, model_file, "make_lr_scheduler", optimizer)
        if scheduler is not None and not all(
            callable(getattr(scheduler, m, None)) for m in ("step", "state_dict", "load_state_dict")
        ):
            raise InputError(
                f"{model_file.path}: make_lr_scheduler returned {type(scheduler).__name__}, "
                "not an LR scheduler (step, state_dict, load_state_dict)"
            )
    else:
        scheduler = make_lr_scheduler(optimizer, config.schedule_settings, config.optim.lr)
    # the model file's hooks return what the checks above verified: an optimizer, an LR scheduler
    return optimizer, scheduler


def _user_hook(hook: Callable[[Any], Any], model_file: ModelFile, name: str, argument: object) -> Any:
    """Call the model file's hook ``name``; its exception is one line naming the hook."""
    try:
        return hook(argument)
    except Exception as exc:
        raise InputError(
            f"{model_file.path}: {name} raised {type(exc).__name__}: {first_line(exc)[:160]}"
        ) from exc


def apply_lr(optimizer: Optimizer, scheduler: LRScheduler | None, lr: float) -> None:
    """Peak ``lr`` for the built-in schedule: each group's lr = lr * factor(saved step), as LambdaLR computes it."""
    if not isinstance(scheduler, LambdaLR):  # none (the built-in one is a LambdaLR)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        factor.peak = lr  # type: ignore[attr-defined]  # the built-in factors (pipeplan.optimizers) keep it
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)


def plan_layout(config: RunConfig, spec: PipelineSpec, identity: RunIdentity, period: int) -> Layout:
    """What a checkpoint manifest says about the plan that wrote it (printed when it changes)."""
    return {
        "fingerprint": identity.plan,
        "replicas": list(spec.replicas),
        "layers": [[min(stage.layers), max(stage.layers) + 1] for stage in config.plan.stages],
        "schedule": config.schedule,
        "microbatches": config.microbatches,
        "virtual_stages": config.plan.virtual_stages,
        "world_size": len(config.plan.used_ranks),
        "minibatches_per_step": period,
    }


def describe_layout(layout: Layout) -> str:
    """``2 stages (layers 0-2 | 3-5), replicas 1,1, 1f1b-flush, 2 micro-batches, 2 ranks``."""
    layers = " | ".join(f"{start}-{end - 1}" for start, end in layout["layers"])
    return (
        f"{len(layout['layers'])} stages (layers {layers}), replicas "
        f"{','.join(map(str, layout['replicas']))}, {layout['schedule']}, "
        f"{layout['microbatches']} micro-batches, {layout['world_size']} ranks"
    )


def resume(
    config: RunConfig,
    spec: PipelineSpec,
    identity: RunIdentity,
    device: str,
    rank: int,
    module: nn.Module | None,
    optimizer: Optimizer | None,
    layout: Layout,
    scheduler: LRScheduler | None = None,
    model_file: ModelFile | None = None,
) -> int:
    """Restore the newest step complete on every rank's view of the directory; returns it (0: none).

    Each rank finds its newest complete step; an all-reduce of the minimum makes every
    rank resume from the same one. Rank 0 names each newer step it skipped (a file that
    fails verification) and a plan that differs from the one that saved the step, then
    deletes this run's folders after that step, which the resumed run writes anew.
    Any plan of the same model resumes: every tensor is found by its qualified name.
    """
    directory = str(config.checkpoints.directory)
    latest, skipped = store.latest_complete_step(directory, identity.fingerprint)
    agreed_tensor = torch.tensor([latest or 0], dtype=torch.int64, device=device)  # NCCL: on the GPU
    dist.all_reduce(agreed_tensor, op=dist.ReduceOp.MIN)
    agreed = int(agreed_tensor.item())
    if rank == 0:
        for step, why in skipped:
            sys.stderr.write(
                f"resume: skipped step {step} ({why}); resuming from "
                f"{f'step {agreed}' if agreed else 'the start'}\n"
            )
        store.discard_steps_after(directory, agreed, identity.fingerprint)
    if agreed == 0:
        return 0
    saved = next(iter(store.read_manifests(directory, agreed).values()))
    if saved["layout"].get("minibatches_per_step") != layout["minibatches_per_step"]:
        raise InputError(
            f"--resume: step {agreed} was saved with {saved['layout'].get('minibatches_per_step')} "
            f"minibatches per step, this plan takes {layout['minibatches_per_step']} (1f1b-rr: "
            f"lcm of the replicas); resume under a plan with the same step length"
        )
    same_plan = saved["layout"].get("fingerprint") == layout["fingerprint"]
    if rank == 0 and not same_plan:
        sys.stderr.write(
            f"resume: step {agreed} was saved under another plan: "
            f"{describe_layout(saved['layout'])}; continuing under {describe_layout(layout)}\n"
        )
    if module is not None:
        try:
            index = ckstate.CheckpointIndex.of_step(directory, agreed)
            ckstate.restore_rank(
                index, module, ckstate.rank_state_names(spec), local_optimizer(optimizer), scheduler
            )
        except InputError as exc:
            raise InputError(f"--resume from {store.step_folder(directory, agreed)}: {exc}") from exc
        if optimizer is not None and (
            model_file is None or (model_file.make_optimizer is None and model_file.make_lr_scheduler is None)
        ):
            # the built-in ones: this run's --lr, on the saved curve
            apply_lr(optimizer, scheduler, config.optim.lr)
        if same_plan:  # dropout continues as it would have
            ckstate.restore_rng(
                store.rank_folder(directory, agreed, spec.stage_index, spec.replica), spec.tp_index
            )
    return agreed


def save(
    config: RunConfig,
    spec: PipelineSpec,
    module: nn.Module | None,
    optimizer: Optimizer | None,
    step: int,
    identity: RunIdentity,
    layout: Layout,
    persister: Persister,
    scheduler: LRScheduler | None = None,
    tensor_mesh: DeviceMesh | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """This rank's checkpoint of ``step`` (replicas after the first save their RNG only),
    written and sealed by ``persister`` (in the background when asynchronous).

    ``scheduler`` (an LR scheduler with ``state_dict``) is saved beside the optimizer and
    restored by ``resume`` under any plan (every stage steps it in lock step).
    ``tensor_mesh``: this rank's tensor-parallel group where its stage's t > 1. Every rank
    of the group takes part (collectives): replica 0's gather each split tensor whole, and
    the group's first rank writes one folder holding the whole tensors (in its host memory
    while it writes) and every rank's RNG state; the others write nothing. ``extra``: more
    keys of this rank (its data loaders' state).
    """
    if module is None:
        return
    writer = spec.tp_index == 0
    own = local_optimizer(optimizer)  # a sharded optimizer's share (pipeplan.runtime.sharding)
    # FSDP2 stages: every replica joins each tensor's gather, the first keeps them
    gathered = spec.stage_index >= 0 and config.plan.stages[spec.stage_index].shard in FSDP_MODES
    state = ckstate.rank_state(
        module,
        ckstate.rank_state_names(spec),
        own,
        scheduler,
        weights=spec.replica == 0 or gathered,
        keep=writer and (spec.replica == 0 or not gathered),
        own_state=own is not optimizer,
    )
    rngs = group_rng_states(tensor_mesh) if tensor_mesh is not None else []
    if not writer:
        return
    state.update({ckstate.rng_key(j): rng for j, rng in enumerate(rngs) if j > 0})
    state.update(extra or {})
    manifest = {
        "run_fingerprint": identity.fingerprint,
        "run": identity.to_dict(),
        "minibatches": step * layout["minibatches_per_step"],
        "layout": layout,
    }
    directory = str(config.checkpoints.directory)
    stage, replica = spec.stage_index, spec.replica
    folder = store.open_rank_folder(directory, step, stage, replica)

    def seal() -> int:  # once the files are written (on the persist's thread when asynchronous)
        written = store.seal_rank(folder, step, stage, replica, manifest)
        if stage == 0 and replica == 0:  # keep the 2 newest complete steps (no barrier needed:
            # see pipeplan.runtime.checkpoint.store); only this run's folders are deleted
            store.prune_checkpoints(directory, identity.fingerprint, keep=2)
        return written

    persister.save(folder, step, state, seal)


def load_weights(config: RunConfig, model_file: ModelFile, spec: PipelineSpec, module: nn.Module) -> None:
    """``--weights``: this rank's tensors from pretrained weights (tied ones via the model's ties)."""
    path = str(config.checkpoints.weights)
    pretrained.load_weights(
        path,
        module,
        ckstate.rank_state_names(spec),
        pretrained.tie_aliases(model_file),
        pretrained.library_layout(model_file, path),
    )


def loader_states(config: RunConfig, step: int, replicas: int) -> dict[int, tuple[int, Any]]:
    """The data loaders' saved states of ``step`` (replica -> (position, state)); see
    ``pipeplan.runtime.checkpoint.state.read_loader_states``."""
    index = ckstate.CheckpointIndex.of_step(str(config.checkpoints.directory), step)
    return ckstate.read_loader_states(index, replicas)
