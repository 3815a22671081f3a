"""``pipeplan run``: the training loop of one rank, from plan.json to metrics.json.

Phases (every rank), each a function with a typed record in and out:

1. *Prepare* (``_prepare`` -> ``Prepared``; no communication, identical on every rank): read
   torchrun's environment, check the world size and the configuration
   (``pipeplan.runtime.config``), build the stage (``pipeplan.runtime.stage``) and the
   schedule. An error here is the user's and the same everywhere: ``PrepareError``,
   printed by rank 0 only, and every rank exits 2. ``run_training`` then joins the process
   group (``timeout_s`` on every collective) and starts the watchdog.
2. *Build* (``_build`` -> ``BuiltStage``): create the replica and tie groups, place and split
   the stage, make its optimizer, load a checkpoint with ``--resume`` (or ``--weights``).
3. *Train* (``_train_steps`` -> ``TrainedRank``): walk this worker's actions
   (``pipeplan.runtime.executor``); ``_StepEnd`` runs at each step's end.
4. *Finish* (``_finish_run``): gather every rank's measurements on rank 0, which writes
   metrics.json and the Chrome trace.

Steps: a step is ``L = lcm(stage replicas)`` minibatches for 1F1B-RR (so replicas
all-reduce in lock step; ``L = 1`` without replication) and one minibatch for 1F1B-Flush
and GPipe; ``losses`` has one value per step (the mean over its minibatches).
Minibatch k is drawn with seed ``seed + k`` (``pipeplan.runtime.data``) and the model is
built under ``torch.manual_seed(seed)`` on every rank.

Optimizer, learning rate and clipping (``pipeplan.optimizers``, ``pipeplan.runtime.clip``):
every rank steps its own parameters (as named groups: decayed, and biases and norms not);
the model file's ``make_optimizer(params)`` / ``make_lr_scheduler(optimizer)`` replace the
built-in ones when present. The LR scheduler steps once per training step, after the
rank's last optimizer step of it, so every stage follows the same curve (1F1B-RR with
replicas: a stage taking several updates in one step takes them at that step's lr).
The gradient norm is global for the flush schedules and 2BW and the stage's own for
1F1B-RR (see ``pipeplan.runtime.clip``).

Precision (``pipeplan.precision``): ``--dtype bfloat16`` (or a plan of a bf16 profile)
trains in mixed precision: bf16 compute copies, float32 masters, gradients and optimizer
state (``pipeplan.runtime.mixed_precision``; with a tensor-parallel plan the masters are
float32 DTensors and the copies bf16 DTensors with their placements); checkpoints hold the masters.

Checkpoints (``pipeplan.runtime.training_state``) hold the scheduler's state beside the
optimizer's, so a resumed run continues the learning-rate curve exactly. They are taken at step boundaries, keyed by the model's qualified names
(``pipeplan.runtime.checkpoint``), so ``--resume`` continues under another plan of the same
model (stages, replicas, schedule, world size); ``--weights`` starts from pretrained
weights instead of the seeded initialisation. For 1F1B-RR the pipeline is drained at a
resume (minibatches in flight at the checkpoint restart from the saved weights), so a
resumed 1F1B-RR run follows the same data but not the same staleness as an uninterrupted
one; 1F1B-Flush and GPipe resume exactly. When each step is saved, synchronously or in two
phases (``--checkpoint-async``), and at which interval (``--checkpoint-every auto``):
``pipeplan.runtime.checkpointing``.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipeplan.capture import MODEL_OUTPUT
from pipeplan.errors import InputError, PipeplanError, RuntimeFailure, first_line
from pipeplan.host_memory import keep_freed_blocks
from pipeplan.memory_errors import memory_step
from pipeplan.modelfile import ModelFile, load_model_file, resolve_model_path
from pipeplan.optimizers import OPTIMIZERS
from pipeplan.planner.simulate import plan_positions
from pipeplan.runtime import training_state as state
from pipeplan.runtime.checkpoint import store
from pipeplan.runtime.checkpoint.persist import CheckpointCost
from pipeplan.runtime.checkpointing import Checkpointer, process_age_ms
from pipeplan.runtime.clip import GradNorm, make_grad_norm
from pipeplan.runtime.comm import P2P, PeerFailure
from pipeplan.runtime.config import RunConfig, check_options
from pipeplan.runtime.data import BatchSource
from pipeplan.runtime.device_mesh import stage_meshes
from pipeplan.runtime.executor import Executor
from pipeplan.runtime.failure import HEARTBEAT_TIMEOUT_S, Watchdog, deadline
from pipeplan.runtime.launch import DistEnv, check_world_size, init_distributed, read_env
from pipeplan.runtime.live_log import LiveLog, open_live_log, publish_step
from pipeplan.runtime.memory_usage import MemoryMeter
from pipeplan.runtime.mixed_precision import MixedPrecision, cast_buffers
from pipeplan.runtime.progress import ProgressLine
from pipeplan.runtime.rank_metrics import (
    CheckpointReport,
    gather_reports,
    rank_report,
    tensor_count_steps,
    timed_from,
    write_outputs,
)
from pipeplan.runtime.recorder import Recorder
from pipeplan.runtime.run_identity import RunIdentity, check_checkpoint_dir, plan_fingerprint
from pipeplan.runtime.run_record import digests, write_record
from pipeplan.runtime.sharding import (
    FSDP_MODES,
    check_fsdp_ties,
    check_shard,
    fully_shard_stage,
    shard_group,
)
from pipeplan.runtime.stage import PipelineSpec, build_pipeline
from pipeplan.runtime.stash import WeightStash
from pipeplan.runtime.sync import GradSync, make_grad_sync
from pipeplan.schedules import (
    Action,
    Schedule,
    ScheduleKind,
    build_schedule,
    names_where,
    or_list,
    peak_in_flight,
    schedule_kind,
)
from pipeplan.tensor_parallel.apply import compute_context, parallelize_stage

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler

__all__ = ["OPTIMIZERS", "PrepareError", "RunConfig", "check_loss", "run_training"]
_FAULT_ENV = "PIPEPLAN_TEST_FAULT"  # tests only: "<rank>:<step>:kill|raise"


class PrepareError(InputError):
    """A user error found before any communication; every rank sees the same one."""


def steps_period(schedule: str, replicas: tuple[int, ...]) -> int:
    """Minibatches per step: lcm(replicas) for 1f1b-rr, else 1.

    >>> steps_period("1f1b-rr", (2, 1, 3)), steps_period("1f1b-flush", (2, 1))
    (6, 1)
    """
    return schedule_kind(schedule).minibatches_per_step(replicas)


@dataclass(frozen=True)
class Prepared:
    """What every rank found before any communication (``_prepare``)."""

    env: DistEnv
    model_file: ModelFile
    spec: PipelineSpec  # this rank's stage, built on its device
    schedule: Schedule  # the whole run's actions (from step 0)
    identity: RunIdentity  # which run a checkpoint belongs to
    meter: MemoryMeter  # started before the stage was built


@dataclass(frozen=True)
class BuiltStage:
    """This rank's stage ready to train: on its device, split, with its groups, optimizer and
    resumed state (``_build``)."""

    kind: ScheduleKind
    period: int  # minibatches per step
    module: nn.Module | None  # every parameter this rank steps (None: an idle rank)
    compute_dtype: torch.dtype  # the weights the layers run on, activations
    master_dtype: torch.dtype | None  # mixed precision: the float32 masters (None: no masters)
    sync: GradSync
    tp_context: (
        Callable[[], contextlib.AbstractContextManager[None]] | None
    )  # where a tensor-parallel stage computes
    tensor_mesh: DeviceMesh | None  # this rank's tensor-parallel group (checkpoints gather over it)
    optimizer: Optimizer | None
    scheduler: LRScheduler | None
    grad_norm: GradNorm | None  # with --clip-grad-norm or --log-dir
    across: bool  # one gradient norm over the whole pipeline (all but 1F1B-RR)
    layout: state.Layout  # what a checkpoint says of the plan
    done_steps: int  # steps a resumed checkpoint holds (0: from the start)
    checkpoint_group: dist.ProcessGroup | None  # gloo, ranks with a stage: async saves, auto's agreement


@dataclass(frozen=True)
class TrainedRank:
    """What ``_train_steps`` leaves for ``_finish_run``: the executor's and recorder's measurements."""

    executor: Executor
    recorder: Recorder
    stash: WeightStash | None
    mixed: MixedPrecision | None
    schedule: Schedule  # the schedule that ran (the remaining steps after a resume)
    offset: int  # global minibatch of the run's first
    wall_ms: float
    step_digests: list[dict[str, float]]  # --record: the digests after each step
    checkpoint_cost: CheckpointCost | None  # None: no --checkpoint-dir
    checkpoint_every: int | None  # the interval (auto's last choice)
    predicted_checkpoint_overhead_pct: float | None  # auto's latest prediction
    first_step_ms: float | None  # from the process's start to its first step's end


def _prepare(config: RunConfig) -> Prepared:
    """Environment, model file, pipeline spec, schedule, run identity and the memory meter
    (started before the stage is built); raises ``PrepareError``.

    With ``--checkpoint-dir`` a directory holding another run's checkpoints (or any,
    without ``--resume``) is refused here, before any communication.
    """
    try:
        env = read_env(config.plan)
        check_world_size(config.plan, env)
        check_options(config)
        _check_tensor_parallel(config)
        if env.rank == 0 and config.precision.dtype != config.plan.dtype:
            sys.stderr.write(
                f"note: the plan's times and memory are {config.plan.dtype}'s (its profile's "
                f"dtype); this run computes in {config.precision.dtype}\n"
            )
        if config.plan.batch_size % config.microbatches:
            raise InputError(
                f"batch size {config.plan.batch_size} is not divisible into "
                f"{config.microbatches} micro-batches"
            )
        model_file = load_model_file(resolve_model_path(config.model_path))
        check_shard(
            config.plan,
            config.schedule,
            config.precision.mixed,
            config.pipeline.recompute,
            model_file.make_optimizer is not None,
        )
        # the baseline: imports done, a tiny step taken (the fixed costs), nothing of the model built
        meter = MemoryMeter(env.device, config.optimizer, count_tensors=_counts_tensors(config, env.device))
        with memory_step(
            f"rank {env.rank} built its stage (--build {config.build.mode})",
            "with --build meta each rank materialises only its own layers; or plan more stages",
        ):
            spec = build_pipeline(
                model_file,
                config.plan,
                env.rank,
                config.build.seed,
                config.plan.batch_size // config.microbatches,
                config.build.mode,
                getattr(torch, config.precision.dtype),
                loaded_after=bool(config.checkpoints.weights),
                device=env.device,
            )
        period = steps_period(config.schedule, spec.replicas)
        schedule = build_schedule(
            config.schedule,
            spec.replicas,
            config.steps * period,
            config.microbatches,
            config.plan.virtual_stages,
        )
        identity = RunIdentity(
            plan=plan_fingerprint(config.plan, config.schedule, config.microbatches),
            model=spec.fingerprint,
            optimizer=_optimizer_identity(config, model_file),
            lr=config.optim.lr,
            seed=config.build.seed,
            lr_schedule=_schedule_identity(config, model_file),
            clip_grad_norm=config.optim.clip_grad_norm,
        )
        if config.checkpoints.directory:
            check_checkpoint_dir(config.checkpoints.directory, identity, config.checkpoints.resume)
        if config.checkpoints.weights:
            # safetensors and the checkpoint readers: only for a run that loads weights
            from pipeplan.runtime.checkpoint.pretrained import open_weights

            # a path that holds no weights: one line, before any communication
            open_weights(config.checkpoints.weights)
    except PrepareError:
        raise
    except InputError as exc:
        raise PrepareError(str(exc)) from exc
    return Prepared(env, model_file, spec, schedule, identity, meter)


def _counts_tensors(config: RunConfig, device: str) -> bool:
    """Whether the rank counts its live tensors over its first steps (``MemoryMeter``): on the
    CPU, for a run long enough to time steps after them, of plain tensors (a tensor-parallel
    or sharded stage's DTensors and hooks are left to RSS)."""
    plain = all(s.tensor_parallel == 1 and s.shard == "none" for s in config.plan.stages)
    if device != "cpu" or not plain:
        return False
    replicas = tuple(s.replicas for s in config.plan.stages[: plan_positions(config.plan)])
    period = steps_period(config.schedule, replicas)
    return config.steps > tensor_count_steps(config.schedule, replicas, period)


def _optimizer_identity(config: RunConfig, model_file: ModelFile) -> str:
    """``adamw(weight_decay=0.1)`` (the name alone without decay), or the model file's hook."""
    if model_file.make_optimizer is not None:
        return "make_optimizer (model file)"
    if config.optim.weight_decay == 0:
        return config.optimizer
    return f"{config.optimizer}(weight_decay={config.optim.weight_decay!r})"


def _schedule_identity(config: RunConfig, model_file: ModelFile) -> str:
    if model_file.make_lr_scheduler is not None:
        return "make_lr_scheduler (model file)"
    return config.schedule_settings.describe()


def _check_tensor_parallel(config: RunConfig) -> None:
    """What a tensor-parallel run does not do yet, refused in one line before any communication."""
    degrees = sorted({stage.tensor_parallel for stage in config.plan.stages if stage.tensor_parallel > 1})
    if not degrees:
        return
    kind = schedule_kind(config.schedule)
    if not kind.runs_tensor_parallel:
        raise InputError(
            f"the plan splits stages tensor-parallel (t = {degrees[0]}); pipeplan runs that with "
            f"{or_list(names_where(lambda kind: kind.runs_tensor_parallel))}, not {config.schedule}"
        )


def run_training(config: RunConfig) -> dict[str, Any] | None:
    """Run this rank's part of the training; rank 0 returns the metrics summary."""
    keep_freed_blocks()  # as the profiler does: no page faults per minibatch
    prepared = _prepare(config)
    env = prepared.env
    init_distributed(env, config.timeout_s)
    prefix = f"run{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    silent_s = min(HEARTBEAT_TIMEOUT_S, config.timeout_s)  # a rank or store silent this long is dead
    watchdog = Watchdog(
        env.rank,
        env.world_size,
        env.master_addr,
        env.master_port,
        prefix=prefix,
        interval_s=min(1.0, silent_s / 4),
        heartbeat_timeout_s=silent_s,
    ).start()
    try:
        spec = prepared.spec
        stage = f"stage {spec.stage_index}" if spec.stage is not None else "no stage"
        with memory_step(
            f"rank {env.rank} ({stage}) trained",
            "plan more stages (partition for more devices), fewer micro-batches in flight, "
            "or a smaller micro-batch (--microbatches)",
        ):
            built = _build(config, prepared)
            trained = _train_steps(config, prepared, built, watchdog)
            summary = _finish_run(config, prepared, built, trained)
    except BaseException as exc:
        _report_failure(watchdog, env.rank, exc)
        raise _as_failure(env.rank, exc) from exc
    watchdog.stop()
    _leave_group(env.rank, config.timeout_s)
    return summary


def _leave_group(rank: int, timeout_s: float) -> None:
    """The final barrier and group teardown, bounded; a rank whose peer failed while writing
    its outputs gets one line, not the barrier's traceback."""
    with deadline(
        timeout_s + 5.0,
        f"rank {rank}: the final barrier did not complete within "
        f"{timeout_s:.0f} s (another rank failed after training)",
    ):
        try:
            dist.barrier()
        except Exception as exc:
            raise RuntimeFailure(
                f"rank {rank}: another rank failed after training (see its error): {first_line(exc)[:120]}"
            ) from exc
        finally:
            dist.destroy_process_group()


def _report_failure(watchdog: Watchdog, rank: int, exc: BaseException) -> None:
    message = first_line(exc)
    if isinstance(exc, PeerFailure):
        # first reporter names the peer it lost, not itself
        watchdog.report(message, rank=exc.peer)
    else:
        watchdog.report(f"rank {rank}: {message}" if not message.startswith("rank ") else message)


def _as_failure(rank: int, exc: BaseException) -> PipeplanError:
    if isinstance(exc, PipeplanError):
        return exc
    message = first_line(exc)
    return RuntimeFailure(f"rank {rank} failed: {type(exc).__name__}: {message}")


def _build(config: RunConfig, prepared: Prepared) -> BuiltStage:
    """Build: groups and meshes (collective), the stage on its device and dtype, split
    tensor-parallel, its optimizer, and the state ``--resume`` or ``--weights`` loads."""
    env, spec, model_file = prepared.env, prepared.spec, prepared.model_file
    kind = schedule_kind(config.schedule)
    split = any(stage.tensor_parallel > 1 for stage in config.plan.stages)
    meshes = (
        stage_meshes(spec.ranks, spec.tensor_parallel, spec.stages, env.device.split(":")[0])
        if split
        else None
    )  # collective: before any other group
    sync = make_grad_sync(
        spec,
        env.rank,
        average_replicas=kind.gradients == "stashed",
        timeout_s=config.timeout_s,
        meshes=meshes,
    )
    shards = shard_group(config.plan, env.rank, config.timeout_s)[0]  # collective: after sync's groups
    precision = config.precision  # the plan's (its profile's dtype), or --dtype
    dtype = getattr(torch, precision.dtype)  # compute: weights the layers run on, activations
    master = getattr(torch, precision.master_dtype) if precision.mixed and precision.master_dtype else None
    module = (
        spec.rank_module.to(device=env.device, dtype=master or dtype)
        if spec.rank_module is not None
        else None
    )
    if module is not None and master is not None:
        cast_buffers(module, dtype)  # as the profile measured them; buffers have no masters
    mode = config.plan.stages[spec.stage_index].shard if spec.stage_index >= 0 else "none"
    check_fsdp_ties(mode, bool(sync.tie_groups), spec.stage_index)
    if mode in FSDP_MODES and module is not None and shards is not None:
        fully_shard_stage(
            [chunk.module for chunk in spec.chunks],
            mode,
            shards,
            env.device.split(":")[0],
            config.plan.stages[spec.stage_index].offload == "optimizer+params",
        )
        sync.replica_group, sync.replica_ranks = None, ()  # FSDP2 reduce-scatters them
    own_mesh = meshes[spec.stage_index] if meshes is not None and spec.stage_index >= 0 else None
    tp_context = None
    if own_mesh is not None and module is not None and any(spec.tp_splits):
        for chunk, splits in zip(spec.chunks, spec.tp_splits):
            sequence = config.plan.stages[chunk.index].sequence_parallel
            parallelize_stage(chunk.module, splits, own_mesh["tensor"], sequence_parallel=sequence)
        tp_context = partial(compute_context, env.device.split(":")[0])
    optimizer, scheduler = state.make_training_optimizer(
        config, model_file, spec, module, shards if mode == "zero1" else None
    )
    tensor_mesh = (
        own_mesh["tensor"]  # checkpoints gather split tensors over it
        if own_mesh is not None and spec.tensor_parallel[spec.stage_index] > 1
        else None
    )
    period = steps_period(config.schedule, spec.replicas)
    across = kind.gradients != "stashed"  # 1F1B-RR: each stage's own norm
    grad_norm = (
        make_grad_norm(
            spec, env.rank, sync, config.optim.clip_grad_norm, across, config.timeout_s, env.device
        )
        if config.optim.clip_grad_norm is not None or config.outputs.log_dir
        else None
    )
    layout = state.plan_layout(config, spec, prepared.identity, period)
    done_steps = 0
    if config.checkpoints.resume and config.checkpoints.directory:
        done_steps = state.resume(
            config,
            spec,
            prepared.identity,
            env.device,
            env.rank,
            module,
            optimizer,
            layout,
            scheduler,
            model_file,
        )
    if config.checkpoints.weights and done_steps == 0 and module is not None:
        state.load_weights(config, model_file, spec, module)
    return BuiltStage(
        kind=kind,
        period=period,
        module=module,
        compute_dtype=dtype,
        master_dtype=master,
        sync=sync,
        tp_context=tp_context,
        tensor_mesh=tensor_mesh,
        optimizer=optimizer,
        scheduler=scheduler,
        grad_norm=grad_norm,
        across=across,
        layout=layout,
        done_steps=done_steps,
        checkpoint_group=_checkpoint_group(config, spec),
    )


def _actions_by_rank(schedule: Schedule, spec: PipelineSpec) -> dict[int, tuple[Action, ...]]:
    """Every rank's actions in ``schedule`` (a tensor-parallel group's ranks share theirs)."""
    out: dict[int, tuple[Action, ...]] = {}
    for position in range(spec.stages):
        t = spec.tensor_parallel[position]
        for index, rank in enumerate(spec.ranks[position]):
            out[rank] = schedule.actions.get((position, index // t), ())
    return out


def _checkpoint_group(config: RunConfig, spec: PipelineSpec) -> dist.ProcessGroup | None:
    """A gloo group of every rank with a stage (collective: every rank calls it), for
    asynchronous or ``auto`` checkpoints; None otherwise.

    ``async_save`` needs a group with a CPU backend (it writes with ``no_dist``, so it never
    communicates on it); ``--checkpoint-every auto`` agrees on its measurements over it, away
    from the training's own groups.
    """
    checkpoints = config.checkpoints
    if not checkpoints.directory or not (checkpoints.asynchronous or checkpoints.interval is None):
        return None
    ranks = sorted({rank for position in spec.ranks for rank in position})
    return dist.new_group(ranks, timeout=timedelta(seconds=config.timeout_s), backend="gloo")


def _train_steps(config: RunConfig, prepared: Prepared, built: BuiltStage, watchdog: Watchdog) -> TrainedRank:
    """Train: walk this worker's actions over the steps left, with its hooks at each step's end."""
    env, spec, plan, period = prepared.env, prepared.spec, config.plan, built.period
    remaining = config.steps - built.done_steps
    schedule = prepared.schedule
    if remaining > 0 and built.done_steps > 0:
        schedule = build_schedule(
            config.schedule, spec.replicas, remaining * period, config.microbatches, plan.virtual_stages
        )
    actions = schedule.actions.get((spec.stage_index, spec.replica), ()) if remaining > 0 else ()
    offset = built.done_steps * period
    dtype, master, module = built.compute_dtype, built.master_dtype, built.module
    stash = mixed = None
    if built.kind.gradients != "exact" and module is not None:  # weight versions: stashed or delayed
        stash = WeightStash(
            module,
            built.kind.weight_versions(spec.replicas, spec.stage_index),
            delayed=built.kind.gradients == "delayed",
            compute_dtype=dtype if master else None,
        )
    elif master is not None and module is not None:  # after --resume / --weights filled the masters
        mixed = MixedPrecision(dtype, [chunk.module for chunk in spec.chunks])
    recorder = Recorder(
        env.rank,
        spec.stage_index,
        spec.replica,
        trace=bool(config.outputs.trace_path),
        cuda=env.device.startswith("cuda"),
    )
    window = tensor_count_steps(config.schedule, spec.replicas, period)
    if remaining <= window:  # a resumed run with too few steps left to time after the count
        prepared.meter.discard_tensors()
    counting = prepared.meter.count_tensors
    recorder.count_from = offset + timed_from(
        config.schedule, spec.replicas, max(remaining, 0) * period, period, counting
    )
    comm = P2P(
        env.rank,
        len(spec.value_ids),
        env.device,
        config.timeout_s,
        tagged=_tagged(env.backend),
        on_send_done=lambda label, peer, s, e, message: recorder.add("send", label, s, e, message=message),
        post_thread=config.microbatches > 1 or not schedule_kind(config.schedule).flushes,
    )
    data = BatchSource(
        prepared.model_file,
        plan.batch_size,
        config.microbatches,
        config.build.seed,
        loader_replicas=spec.replicas[0],
        device=env.device,
        dtype=dtype,
        target_dtype=master or dtype,
    )
    if built.done_steps and data.reads_loaders and config.checkpoints.directory:
        data.restore_loaders(state.loader_states(config, built.done_steps, spec.replicas[0]))
    progress = ProgressLine(env.rank, config, plan.batch_size * period, watchdog, built.done_steps, offset)
    live = open_live_log(
        config, env.rank, spec, plan.batch_size * period, period, built.across, watchdog, built.done_steps
    )
    checkpointer = Checkpointer(
        config,
        spec,
        env.rank,
        prepared.identity,
        built.layout,
        module,
        built.optimizer,
        built.scheduler,
        built.tensor_mesh,
        built.checkpoint_group,
        built.done_steps,
        _loader_keys(data, period, spec.replicas[0]) if data.reads_loaders else None,
    )
    step_end = _StepEnd(config, prepared, built, watchdog, recorder, progress, live, checkpointer)
    step_end.count_tensors_until = built.done_steps + window if counting else None
    executor = Executor(
        spec=spec,
        actions=actions,
        microbatches=config.microbatches,
        comm=comm,
        data=data,
        loss_fn=prepared.model_file.loss_fn,
        optimizer=built.optimizer,
        sync=built.sync,
        recorder=recorder,
        grad_norm=built.grad_norm,
        stash=stash,
        recompute=config.pipeline.recompute,
        minibatch_offset=offset,
        lookahead=2 * (peak_in_flight(actions) + 1),
        peer_actions=_actions_by_rank(schedule, spec) if remaining > 0 else {},
        on_step=step_end,
        schedule=config.schedule,
        compute_context=built.tp_context,
        precision=mixed,
        loss_dtype=master,
    )
    step_end.executor = executor
    if any(MODEL_OUTPUT in c.output_names or min(c.producers.values(), default=0) < 0 for c in spec.chunks):
        data.draw_ahead(dict.fromkeys(a.minibatch + offset for a in actions if a.kind == "F"))
    dist.barrier()
    prepared.meter.steps_begin(_tensor_bytes(module))
    recorder.start()
    progress.start()
    checkpointer.start()
    if spec.stage is not None:
        executor.run()
    checkpointer.finish()  # the last persist is written and sealed before the run ends
    recorder.finish()
    wall_ms = (time.perf_counter() * 1000.0) - recorder.t0_ms
    progress.stop()
    if live is not None:
        live.close(config.steps, config.timeout_s)
    return TrainedRank(
        executor,
        recorder,
        stash,
        mixed,
        schedule,
        offset,
        wall_ms,
        step_end.digests,
        checkpointer.persister.cost if config.checkpoints.directory else None,
        checkpointer.every,
        checkpointer.auto.predicted_overhead_pct if checkpointer.auto is not None else None,
        step_end.first_step_ms,
    )


def _tensor_bytes(module: nn.Module | None) -> int:
    """Bytes of the distinct parameters and buffers of ``module`` (0 for an idle rank)."""
    if module is None:
        return 0
    seen = {id(t): t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers())}
    return sum(seen.values())


def _loader_keys(data: BatchSource, period: int, replicas: int) -> Callable[[int], dict[str, Any]]:
    """step -> the checkpoint keys of this rank's stateful loaders, at the step's next minibatch."""
    from pipeplan.runtime.checkpoint.state import loader_keys

    return lambda step: loader_keys(data.loader_state(step * period), replicas)


@dataclass
class _StepEnd:
    """What a rank does when its part of a training step ends (the executor's ``on_step``):
    check the loss, step the LR scheduler, publish live metrics, checkpoint, show progress."""

    config: RunConfig
    prepared: Prepared
    built: BuiltStage
    watchdog: Watchdog
    recorder: Recorder
    progress: ProgressLine
    live: LiveLog | None
    checkpointer: Checkpointer
    executor: Executor | None = None  # set once the executor this hook belongs to exists
    digests: list[dict[str, float]] = field(default_factory=list)  # --record: after each step
    first_step_ms: float | None = None  # the process's age when its first step ended
    count_tensors_until: int | None = None  # the step after which live tensors are no longer counted
    _published: dict[str, float] = field(default_factory=lambda: {"compute_ms": 0.0})
    _fault: Callable[[int], None] = field(init=False)

    def __post_init__(self) -> None:
        self._fault = _fault_hook(self.prepared.env.rank)

    def __call__(self, minibatch: int) -> None:
        config, spec, period = self.config, self.prepared.spec, self.built.period
        rank = self.prepared.env.rank
        assert self.executor is not None, "the executor calls its on_step only once it exists"
        step = minibatch // period  # global step index
        last_of_step = minibatch + spec.replicas[spec.stage_index] >= (step + 1) * period
        if any(MODEL_OUTPUT in chunk.output_names for chunk in spec.chunks):
            loss = self.executor.losses.get(minibatch, float("nan"))
            if config.outputs.progress:  # for rank 0's progress line only: a store round trip per minibatch
                self.watchdog.publish(f"loss/{minibatch}", f"{loss!r}")
            if not config.allow_nonfinite:
                check_loss(loss, step + 1, minibatch, spec.stage_index, rank)
        if not last_of_step:
            return
        completed = step + 1
        if self.built.scheduler is not None:
            self.built.scheduler.step()  # once per training step: the next step's lr
        if spec.stage is not None and config.outputs.log_dir is not None:
            publish_step(
                self.watchdog, self.executor, self.recorder, spec, rank, step, period, self._published
            )
        if self.live is not None:
            self.live.poll()
        if config.outputs.record_dir and self.built.module is not None:
            self.digests.append(digests(self.built.module))
        if self.first_step_ms is None:
            self.first_step_ms = process_age_ms()
        if self.count_tensors_until is not None and completed >= self.count_tensors_until:
            self.prepared.meter.stop_counting()
            self.count_tensors_until = None
        self.checkpointer.at_step_end(completed)
        self.progress.update(completed)
        self._fault(completed)


def _finish_run(
    config: RunConfig, prepared: Prepared, built: BuiltStage, trained: TrainedRank
) -> dict[str, Any] | None:
    """Finish: prune old checkpoints, write ``--record``, gather every rank's report on rank 0,
    which writes metrics.json and the trace and returns the summary (None elsewhere)."""
    env, spec = prepared.env, prepared.spec
    if config.checkpoints.directory:
        dist.barrier()  # every rank saved its final step: prune with all their files in place
        if spec.stage_index == 0 and spec.replica == 0 and spec.tp_index == 0:
            store.prune_checkpoints(config.checkpoints.directory, prepared.identity.fingerprint, keep=2)
    if config.outputs.record_dir and built.module is not None:
        write_record(
            config.outputs.record_dir,
            env.rank,
            spec,
            built.module,
            trained.executor,
            trained.step_digests,
            trained.stash,
            trained.mixed,
        )
    report = rank_report(
        env.rank,
        spec,
        trained.executor,
        trained.recorder,
        trained.wall_ms,
        trained.stash,
        prepared.meter.read(),
        CheckpointReport(
            trained.checkpoint_cost,
            trained.checkpoint_every,
            trained.predicted_checkpoint_overhead_pct,
            trained.first_step_ms,
            config.checkpoints.asynchronous,
        ),
    )
    reports = gather_reports(report, env.rank)
    if env.rank != 0:
        return None
    return write_outputs(config, spec, reports, built.period, trained.offset)


def check_loss(loss: float, step: int, minibatch: int, stage: int, rank: int) -> None:
    """``RuntimeFailure`` naming the step and stage when ``loss`` is NaN or infinite."""
    if not math.isfinite(loss):
        raise RuntimeFailure(
            f"rank {rank}: the loss is {loss} at step {step} (minibatch {minibatch}) on stage "
            f"{stage}; pass --allow-nonfinite to train on"
        )


def _tagged(backend: str) -> bool:
    """Gloo matches messages by tag; NCCL has none and matches by posting order.

    ``PIPEPLAN_TEST_UNTAGGED=1`` makes gloo match by order too, so the CPU tests cover
    the order NCCL relies on.
    """
    return backend != "nccl" and os.environ.get("PIPEPLAN_TEST_UNTAGGED") != "1"


def _fault_hook(rank: int) -> Callable[[int], None]:
    """Tests only: ``PIPEPLAN_TEST_FAULT=<rank>:<step>:kill|raise`` fails that rank."""
    spec = os.environ.get(_FAULT_ENV, "")
    if not spec:
        return lambda step: None
    target, at, how = spec.split(":")

    def fault(step: int) -> None:
        if int(target) == rank and step == int(at):
            if how == "kill":
                os._exit(1)
            raise RuntimeError(f"injected failure at step {step}")

    return fault
