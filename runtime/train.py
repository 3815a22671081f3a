"""``pipeplan run``: the training loop of one rank, from plan.json to metrics.json.

Phases (every rank):

1. *Prepare* (no communication, identical on every rank): read torchrun's environment,
   check the world size, build the stage (``pipeplan.runtime.stage``) and the schedule.
   An error here is the user's and the same everywhere: ``PrepareError``, printed by
   rank 0 only, and every rank exits 2.
2. *Start*: join the process group (``timeout_s`` on every collective), start the
   watchdog, create the replica and tie groups, load a checkpoint with ``--resume``.
3. *Train*: walk this worker's actions (``pipeplan.runtime.executor``).
4. *Finish*: gather every rank's measurements on rank 0, which writes metrics.json and
   the Chrome trace.

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
one; 1F1B-Flush and GPipe resume exactly.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from pipeplan.errors import InputError, PipeplanError, RuntimeFailure, first_line
from pipeplan.optimizers import OPTIMIZERS, LRSchedule
from pipeplan.plan import Plan
from pipeplan.precision import Precision

__all__ = ["RunConfig", "PrepareError", "run_training", "OPTIMIZERS", "check_loss"]
_FAULT_ENV = "PIPEPLAN_TEST_FAULT"  # tests only: "<rank>:<step>:kill|raise"


class PrepareError(InputError):
    """A user error found before any communication; every rank sees the same one."""


@dataclass(frozen=True)
class RunConfig:
    plan: Plan
    model_path: str
    schedule: str  # one of pipeplan.plan.SCHEDULE_NAMES
    steps: int  # total steps of the run (a resumed run continues up to it)
    lr: float
    optimizer: str  # one of OPTIMIZERS
    microbatches: int  # per minibatch (1F1B-Flush, GPipe); 1 for 1F1B-RR
    recompute: bool = False  # GPipe re-materialisation
    seed: int = 0
    timeout_s: float = 300.0  # bound on every collective and p2p wait
    metrics_path: str | None = None
    trace_path: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps; 0 = only with --checkpoint-dir at the end
    resume: bool = False
    weights: str | None = None  # pretrained weights (HF safetensors folder or a pipeplan checkpoint)
    record_dir: str | None = None  # tests/debugging: per-rank params, versions, digests
    progress: bool = True
    allow_nonfinite: bool = False  # train on when a loss is NaN or infinite
    weight_decay: float = 0.0  # decoupled for adamw; never on biases and norms
    lr_schedule: str = "constant"  # one of pipeplan.optimizers.LR_SCHEDULES
    warmup_steps: int = 0
    min_lr: float = 0.0
    clip_grad_norm: float | None = None  # max global gradient norm (1f1b-rr: per stage)
    log_dir: str | None = None  # live metrics: TensorBoard events and metrics.jsonl
    build: str = "auto"  # pipeplan.capture.materialise.BUILDS: whole model, or only this rank's stage
    dtype: str | None = None  # compute dtype (bfloat16: float32 masters); None: the plan's precision

    @property
    def precision(self) -> Precision:
        return self.plan.precision if self.dtype is None else Precision.for_dtype(self.dtype)

    @property
    def schedule_settings(self) -> LRSchedule:
        return LRSchedule(self.lr_schedule, self.warmup_steps, self.min_lr, self.steps)


def steps_period(schedule: str, replicas: tuple[int, ...]) -> int:
    """Minibatches per step: lcm(replicas) for 1f1b-rr, else 1.

    >>> steps_period("1f1b-rr", (2, 1, 3)), steps_period("1f1b-flush", (2, 1))
    (6, 1)
    """
    from pipeplan.schedules import schedule_kind

    return schedule_kind(schedule).minibatches_per_step(replicas)


def _prepare(config: RunConfig) -> tuple[Any, Any, Any, Any, Any, Any]:
    """Environment, model file, pipeline spec, schedule, run identity and the memory meter
    (started before the stage is built); raises ``PrepareError``.

    With ``--checkpoint-dir`` a directory holding another run's checkpoints (or any,
    without ``--resume``) is refused here, before any communication.
    """
    import torch

    from pipeplan.memory_errors import memory_step
    from pipeplan.modelfile import load_model_file, resolve_model_path
    from pipeplan.runtime.launch import check_world_size, read_env
    from pipeplan.runtime.memory_usage import MemoryMeter
    from pipeplan.runtime.run_identity import RunIdentity, check_checkpoint_dir, plan_fingerprint
    from pipeplan.runtime.stage import build_pipeline
    from pipeplan.schedules import build_schedule, names_where, or_list, schedule_kind

    try:
        env = read_env(config.plan)
        check_world_size(config.plan, env)
        if config.optimizer not in OPTIMIZERS:
            raise InputError(f"optimizer {config.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if config.steps < 1:
            raise InputError(f"--steps must be >= 1 (got {config.steps})")
        if config.checkpoint_every < 0:
            raise InputError(f"--checkpoint-every must be >= 0 (got {config.checkpoint_every})")
        if not (math.isfinite(config.lr) and config.lr > 0):
            raise InputError(f"--lr must be a finite number > 0 (got {config.lr})")
        if not (math.isfinite(config.weight_decay) and config.weight_decay >= 0):
            raise InputError(f"--weight-decay must be a finite number >= 0 (got {config.weight_decay})")
        if config.clip_grad_norm is not None and not (math.isfinite(config.clip_grad_norm)
                                                      and config.clip_grad_norm > 0):
            raise InputError(f"--clip-grad-norm must be a finite number > 0 (got {config.clip_grad_norm})")
        config.schedule_settings.check(config.lr)
        if not (math.isfinite(config.timeout_s) and config.timeout_s > 0):
            raise InputError(f"--timeout must be a finite number of seconds > 0 (got {config.timeout_s})")
        if config.recompute and not schedule_kind(config.schedule).supports_recompute:
            allowed = or_list(names_where(lambda kind: kind.supports_recompute))
            raise InputError(f"--recompute applies to {allowed}, not {config.schedule}")
        _check_tensor_parallel(config)
        if env.rank == 0 and config.precision.dtype != config.plan.dtype:
            import sys

            sys.stderr.write(f"note: the plan's times and memory are {config.plan.dtype}'s (its profile's "
                             f"dtype); this run computes in {config.precision.dtype}\n")
        if config.plan.batch_size % config.microbatches:
            raise InputError(
                f"batch size {config.plan.batch_size} is not divisible into "
                f"{config.microbatches} micro-batches"
            )
        model_file = load_model_file(resolve_model_path(config.model_path))
        meter = MemoryMeter(env.device)  # the baseline: imports done, nothing of the model built
        with memory_step(f"rank {env.rank} built its stage (--build {config.build})",
                         "with --build meta each rank materialises only its own layers; or plan more stages"):
            spec = build_pipeline(model_file, config.plan, env.rank, config.seed,
                                  config.plan.batch_size // config.microbatches, config.build,
                                  getattr(torch, config.precision.dtype), loaded_after=bool(config.weights),
                                  device=env.device)
        replicas = spec.replicas
        period = steps_period(config.schedule, replicas)
        schedule = build_schedule(config.schedule, replicas, config.steps * period, config.microbatches,
                                  config.plan.virtual_stages)
        identity = RunIdentity(plan=plan_fingerprint(config.plan, config.schedule, config.microbatches),
                               model=spec.fingerprint, optimizer=_optimizer_identity(config, model_file),
                               lr=config.lr, seed=config.seed,
                               lr_schedule=_schedule_identity(config, model_file),
                               clip_grad_norm=config.clip_grad_norm)
        if config.checkpoint_dir:
            check_checkpoint_dir(config.checkpoint_dir, identity, config.resume)
        if config.weights:
            from pipeplan.runtime.checkpoint.pretrained import open_weights

            open_weights(config.weights)  # a path that holds no weights: one line, before any communication
    except PrepareError:
        raise
    except InputError as exc:
        raise PrepareError(str(exc)) from exc
    return env, model_file, spec, schedule, identity, meter


def _optimizer_identity(config: RunConfig, model_file: Any) -> str:
    """``adamw(weight_decay=0.1)`` (the name alone without decay), or the model file's hook."""
    if model_file.make_optimizer is not None:
        return "make_optimizer (model file)"
    if config.weight_decay == 0:
        return config.optimizer
    return f"{config.optimizer}(weight_decay={config.weight_decay!r})"


def _schedule_identity(config: RunConfig, model_file: Any) -> str:
    if model_file.make_lr_scheduler is not None:
        return "make_lr_scheduler (model file)"
    return config.schedule_settings.describe()


def _check_tensor_parallel(config: RunConfig) -> None:
    """What a tensor-parallel run does not do yet, refused in one line before any communication."""
    from pipeplan.schedules import schedule_kind

    degrees = sorted({stage.tensor_parallel for stage in config.plan.stages if stage.tensor_parallel > 1})
    if not degrees:
        return
    kind = schedule_kind(config.schedule)
    if not kind.runs_tensor_parallel:
        raise InputError(
            f"the plan splits stages tensor-parallel (t = {degrees[0]}); pipeplan runs that with "
            f"1f1b-flush, gpipe or interleaved-1f1b, not {config.schedule}"
        )


def run_training(config: RunConfig) -> dict[str, Any] | None:
    """Run this rank's part of the training; rank 0 returns the metrics summary."""
    import torch.distributed as dist

    from pipeplan.host_memory import keep_freed_blocks
    from pipeplan.memory_errors import memory_step
    from pipeplan.runtime.failure import HEARTBEAT_TIMEOUT_S, Watchdog
    from pipeplan.runtime.launch import init_distributed

    keep_freed_blocks()  # as the profiler does: no page faults per minibatch
    env, model_file, spec, schedule, identity, meter = _prepare(config)
    init_distributed(env, config.timeout_s)
    prefix = f"run{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    silent_s = min(HEARTBEAT_TIMEOUT_S, config.timeout_s)  # a rank or store silent this long is dead
    watchdog = Watchdog(env.rank, env.world_size, env.master_addr, env.master_port, prefix=prefix,
                        interval_s=min(1.0, silent_s / 4), heartbeat_timeout_s=silent_s).start()
    try:
        stage = f"stage {spec.stage_index}" if spec.stage is not None else "no stage"
        with memory_step(f"rank {env.rank} ({stage}) trained",
                         "plan more stages (partition for more devices), fewer micro-batches in flight, "
                         "or a smaller micro-batch (--microbatches)"):
            summary = _train(config, env, model_file, spec, schedule, watchdog, identity, meter)
    except BaseException as exc:
        _report_failure(watchdog, env.rank, exc)
        raise _as_failure(env.rank, exc) from exc
    watchdog.stop()
    _finish(env.rank, config.timeout_s)
    return summary


def _finish(rank: int, timeout_s: float) -> None:
    """The final barrier and group teardown, bounded; a rank whose peer failed while writing
    its outputs gets one line, not the barrier's traceback."""
    import torch.distributed as dist

    from pipeplan.runtime.failure import deadline

    with deadline(timeout_s + 5.0, f"rank {rank}: the final barrier did not complete within "
                                   f"{timeout_s:.0f} s (another rank failed after training)"):
        try:
            dist.barrier()
        except Exception as exc:
            raise RuntimeFailure(
                f"rank {rank}: another rank failed after training (see its error): "
                f"{first_line(exc)[:120]}"
            ) from exc
        finally:
            dist.destroy_process_group()


def _report_failure(watchdog: Any, rank: int, exc: BaseException) -> None:
    from pipeplan.runtime.comm import PeerFailure

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


def _train(config: RunConfig, env: Any, model_file: Any, spec: Any, schedule: Any, watchdog: Any,
           identity: Any, meter: Any) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from pipeplan.capture import MODEL_OUTPUT
    from pipeplan.runtime import training_state as state
    from pipeplan.runtime.checkpoint import store
    from pipeplan.runtime.clip import make_grad_norm
    from pipeplan.runtime.live_log import open_live_log, publish_step
    from pipeplan.runtime.mixed_precision import MixedPrecision, cast_buffers
    from pipeplan.runtime.comm import P2P
    from pipeplan.runtime.data import BatchSource
    from pipeplan.runtime.executor import Executor
    from pipeplan.runtime.recorder import Recorder
    from pipeplan.runtime.rank_metrics import gather_reports, rank_report, warmup_minibatches, write_outputs
    from pipeplan.runtime.stash import WeightStash
    from pipeplan.runtime.sync import make_grad_sync
    from pipeplan.tensor_parallel.apply import compute_context, parallelize_stage
    from pipeplan.runtime.device_mesh import stage_meshes
    from pipeplan.schedules import build_schedule, peak_in_flight, schedule_kind

    plan = config.plan
    kind = schedule_kind(config.schedule)
    split = any(stage.tensor_parallel > 1 for stage in plan.stages)
    meshes = (stage_meshes(spec.ranks, spec.tensor_parallel, spec.stages, env.device.split(":")[0])
              if split else None)  # collective: before any other group
    sync = make_grad_sync(spec, env.rank, average_replicas=kind.gradients == "stashed", timeout_s=config.timeout_s,
                          meshes=meshes)
    worker = (spec.stage_index, spec.replica)
    stage = spec.stage
    precision = config.precision  # the plan's (its profile's dtype), or --dtype
    dtype = getattr(torch, precision.dtype)  # compute: weights the layers run on, activations
    master = getattr(torch, precision.master_dtype) if precision.mixed else None  # type: ignore[arg-type]
    module = (spec.rank_module.to(device=env.device, dtype=master or dtype)
              if spec.rank_module is not None else None)
    if module is not None and master is not None:
        cast_buffers(module, dtype)  # as the profile measured them; buffers have no masters
    tp_context = None
    if meshes is not None and module is not None and any(spec.tp_splits):
        for chunk, splits in zip(spec.chunks, spec.tp_splits):
            parallelize_stage(chunk.module, splits, meshes[spec.stage_index]["tensor"])
        tp_context = partial(compute_context, env.device.split(":")[0])
    optimizer, scheduler = state.make_training_optimizer(config, model_file, spec, module)
    tensor_mesh = (meshes[spec.stage_index]["tensor"]  # checkpoints gather split tensors over it
                   if meshes is not None and spec.stage_index >= 0 and spec.tensor_parallel[spec.stage_index] > 1
                   else None)
    period = steps_period(config.schedule, spec.replicas)
    across = kind.gradients != "stashed"  # 1F1B-RR: each stage's own norm
    grad_norm = (make_grad_norm(spec, env.rank, sync, config.clip_grad_norm, across, config.timeout_s, env.device)
                 if config.clip_grad_norm is not None or config.log_dir else None)

    layout = state.plan_layout(config, spec, identity, period)
    done_steps = 0
    if config.resume and config.checkpoint_dir:
        done_steps = state.resume(config, spec, identity, env.device, env.rank, module, optimizer, layout,
                                  scheduler, model_file)
    if config.weights and done_steps == 0 and module is not None:
        state.load_weights(config, model_file, spec, module)
    remaining = config.steps - done_steps
    if remaining > 0 and done_steps > 0:
        schedule = build_schedule(config.schedule, spec.replicas, remaining * period, config.microbatches,
                                  plan.virtual_stages)
    actions = schedule.actions.get(worker, ()) if remaining > 0 else ()
    offset = done_steps * period

    stash = mixed = None
    if kind.gradients != "exact" and module is not None:  # weight versions: stashed or delayed
        stash = WeightStash(module, kind.weight_versions(spec.replicas, spec.stage_index),
                            delayed=kind.gradients == "delayed", compute_dtype=dtype if master else None)
    elif master is not None and module is not None:  # after --resume / --weights filled the masters
        mixed = MixedPrecision(dtype, [chunk.module for chunk in spec.chunks])
    recorder = Recorder(env.rank, spec.stage_index, spec.replica, trace=bool(config.trace_path),
                        cuda=env.device.startswith("cuda"))
    recorder.count_from = offset + warmup_minibatches(config.schedule, spec.replicas, max(remaining, 0) * period)
    comm = P2P(env.rank, len(spec.value_ids), env.device, config.timeout_s, tagged=_tagged(env.backend),
               on_send_done=lambda label, peer, s, e: recorder.add("send", label, s, e))
    data = BatchSource(model_file, plan.batch_size, config.microbatches, config.seed,
                       loader_replicas=spec.replicas[0], device=env.device, dtype=dtype,
                       target_dtype=master or dtype)
    record: dict[str, Any] = {"digests": []}
    progress = _Progress(env.rank, config, plan.batch_size * period, watchdog, done_steps, offset)
    fault = _fault_hook(env.rank)
    live = open_live_log(config, env.rank, spec, plan.batch_size * period, period, across, watchdog, done_steps)
    publish = stage is not None and config.log_dir is not None
    published = {"compute_ms": 0.0}

    def on_step(minibatch: int) -> None:
        step = minibatch // period  # global step index
        last_of_step = minibatch + spec.replicas[spec.stage_index] >= (step + 1) * period
        if any(MODEL_OUTPUT in chunk.output_names for chunk in spec.chunks):
            loss = executor.losses.get(minibatch, float("nan"))
            if config.progress:  # for rank 0's progress line only: a store round trip per minibatch
                watchdog.publish(f"loss/{minibatch}", f"{loss!r}")
            if not config.allow_nonfinite:
                check_loss(loss, step + 1, minibatch, spec.stage_index, env.rank)
        if not last_of_step:
            return
        completed = step + 1
        if scheduler is not None:
            scheduler.step()  # once per training step: the next step's lr
        if publish:
            publish_step(watchdog, executor, recorder, spec, env.rank, step, period, published)
        if live is not None:
            live.poll()
        if config.record_dir:
            record["digests"].append(_digests(module))
        every = config.checkpoint_every
        if config.checkpoint_dir and ((every and completed % every == 0) or completed == config.steps):
            state.save(config, spec, module, optimizer, completed, identity, layout, scheduler,  # the final step always
                       tensor_mesh)
        progress.update(completed)
        fault(completed)

    executor = Executor(
        spec=spec, actions=actions, microbatches=config.microbatches, comm=comm, data=data,
        loss_fn=model_file.loss_fn, optimizer=optimizer, sync=sync, recorder=recorder, grad_norm=grad_norm,
        stash=stash, recompute=config.recompute, minibatch_offset=offset,
        lookahead=2 * (peak_in_flight(actions) + 1), on_step=on_step, schedule=config.schedule,
        compute_context=tp_context, precision=mixed, loss_dtype=master,
    )
    if any(MODEL_OUTPUT in c.output_names or min(c.producers.values(), default=0) < 0 for c in spec.chunks):
        data.draw_ahead(dict.fromkeys(a.minibatch + offset for a in actions if a.kind == "F"))
    dist.barrier()
    recorder.start()
    progress.start()
    if stage is not None:
        executor.run()
    recorder.finish()
    wall_ms = (time.perf_counter() * 1000.0) - recorder.t0_ms
    progress.stop()
    if live is not None:
        live.close(config.steps, config.timeout_s)
    if config.checkpoint_dir:
        dist.barrier()  # every rank saved its final step: prune with all their files in place
        if spec.stage_index == 0 and spec.replica == 0 and spec.tp_index == 0:
            store.prune_checkpoints(config.checkpoint_dir, identity.fingerprint, keep=2)
    if config.record_dir and module is not None:
        _write_record(config.record_dir, env.rank, spec, module, executor, record, stash, mixed)
    reports = gather_reports(rank_report(env.rank, spec, executor, recorder, wall_ms, stash, meter.read()), env.rank)
    if env.rank != 0:
        return None
    return write_outputs(config, spec, schedule, reports, period, offset)


def check_loss(loss: float, step: int, minibatch: int, stage: int, rank: int) -> None:
    """``RuntimeFailure`` naming the step and stage when ``loss`` is NaN or infinite."""
    if not math.isfinite(loss):
        raise RuntimeFailure(
            f"rank {rank}: the loss is {loss} at step {step} (minibatch {minibatch}) on stage "
            f"{stage}; pass --allow-nonfinite to train on"
        )


def _digests(module: Any) -> dict[str, float]:
    from pipeplan.tensor_parallel.apply import full

    return {name: float(full(p.detach()).double().sum()) for name, p in module.named_parameters()}


def _write_record(folder: str, rank: int, spec: Any, module: Any, executor: Any, record: dict[str, Any], stash: Any,
                  mixed: Any) -> None:
    import io

    import torch

    from pipeplan.jsonio import write_atomic

    names = spec.qualified_names
    from pipeplan.tensor_parallel.apply import full

    params = {names[n]: full(p.detach()).cpu().clone() for n, p in module.named_parameters()}
    obj = {
        "rank": rank,
        "stage": spec.stage_index,
        "replica": spec.replica,
        "params": params,
        "digests": [{names[n]: v for n, v in d.items()} for d in record["digests"]],
        "units": {u: (r.minibatch, r.microbatch, r.forward_version, r.backward_version)
                  for u, r in executor.units.items()},
        "peak_versions": stash.peak_versions if stash is not None else 1,
        "peak_kept_versions": stash.peak_kept if stash is not None else 1,
        "losses": dict(executor.losses),
        # (dtype, placements) of each master and of the tensor the layers ran on (its compute copy)
        "masters": {names[n]: _layout(p) for n, p in module.named_parameters()},
        "compute": {names[n]: _layout(mixed.copy_of(p) if mixed is not None else p)
                    for n, p in module.named_parameters()},
    }
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_atomic(os.path.join(folder, f"rank{rank}.pt"), buffer.getvalue())


def _layout(tensor: Any) -> tuple[str, tuple[str, ...]]:
    """``("bfloat16", ("Shard(dim=0)",))``: a tensor's dtype and DTensor placements (none for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    placements = tuple(repr(p) for p in tensor.placements) if isinstance(tensor, DTensor) else ()
    return str(tensor.dtype).removeprefix("torch."), placements


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


class _Progress:
    """Rank 0's live progress line: step, newest loss, samples/s."""

    def __init__(self, rank: int, config: RunConfig, samples_per_step: int, watchdog: Any,
                 first_step: int, first_minibatch: int) -> None:
        self.enabled = rank == 0 and config.progress
        self.samples_per_step = samples_per_step
        self.watchdog = watchdog
        self.total = config.steps
        self.first_step = first_step
        self.loss = float("nan")
        self._next_loss = first_minibatch
        self._bar: Any = None
        self._task: Any = None
        self._start = 0.0

    def start(self) -> None:
        if not self.enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
            TimeElapsedColumn(), console=Console(stderr=True),
        )
        self._task = self._bar.add_task("train", total=self.total, completed=self.first_step,
                                        loss="-", rate="-")
        self._bar.start()
        self._start = time.perf_counter()

    def update(self, completed: int) -> None:
        if not self.enabled or self._bar is None:
            return
        while True:  # newest loss the loss stage published
            text = self.watchdog.peek(f"loss/{self._next_loss}")
            if text is None:
                break
            self.loss = float(text)
            self._next_loss += 1
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        rate = (completed - self.first_step) * self.samples_per_step / elapsed
        self._bar.update(self._task, completed=completed, loss=f"{self.loss:.4f}", rate=f"{rate:,.1f}")

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
