"""Measurements of every rank, merged on rank 0 into metrics.json and the Chrome trace.

Format: ``docs/metrics.md`` (schema ``pipeplan.metrics/2``). Per (stage, replica):
``compute_ms`` (forward + backward + optimizer per minibatch handled), ``wait_ms``
(blocked on receives and all-reduces per minibatch handled), ``time_per_minibatch_ms``
(busy time, compute + all-reduce, per minibatch handled, divided by the stage's replicas:
the stage's share of the period, comparable with ``StagePlan.time_per_minibatch_ms``),
each beside the plan's prediction; the first ``warmup_minibatches`` are left out. The
rank's memory (baseline before its stage was built, peak over the run:
``pipeplan.runtime.memory_usage``) sits beside the plan's per-device figure. The
pipeline's ``time_per_minibatch_ms`` is the steady-state spacing of minibatch
completions on the input stage (the first ``noam`` minibatches are warm-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from pipeplan.errors import InputError
from pipeplan.metrics import METRICS_SCHEMA, Metrics, StageMetrics
from pipeplan.plan import Plan, StagePlan
from pipeplan.planner.predict import predict
from pipeplan.runtime.checkpoint.persist import CheckpointCost
from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.executor import Executor
from pipeplan.runtime.memory_usage import MemoryReading
from pipeplan.runtime.recorder import Recorder
from pipeplan.runtime.stage import PipelineSpec
from pipeplan.runtime.stash import WeightStash
from pipeplan.schedules import schedule_kind
from pipeplan.trace import TraceEvent, merge_events, write_chrome_trace

__all__ = [
    "METRICS_SCHEMA",
    "RankReport",
    "CheckpointReport",
    "rank_report",
    "predicted_compute_ms",
    "gather_reports",
    "write_outputs",
    "prediction_for_run",
    "steady_period_ms",
    "warmup_minibatches",
    "tensor_count_steps",
    "timed_from",
]


@dataclass
class RankReport:
    rank: int
    stage: int
    replica: int
    minibatches: int  # distinct minibatches this worker handled
    totals_ms: dict[str, float]
    wall_ms: float
    losses: dict[int, float]  # global minibatch -> loss (loss stage only)
    done_ms: dict[int, float]  # global minibatch -> time its S finished here (from t0)
    peak_versions: int
    events: list[TraceEvent] = field(default_factory=list)
    memory: MemoryReading | None = None
    checkpoint: CheckpointReport | None = None


@dataclass(frozen=True)
class CheckpointReport:
    """A rank's checkpoints (``pipeplan.runtime.checkpointing``) and its start-to-first-step time."""

    cost: CheckpointCost | None  # None: no --checkpoint-dir
    every: int | None  # steps between checkpoints (auto: its last choice)
    predicted_overhead_pct: float | None  # auto's prediction for ``every``
    first_step_ms: float | None  # process start to the end of its first step
    asynchronous: bool


def warmup_minibatches(schedule: str, replicas: tuple[int, ...], total: int) -> int:
    """Minibatches at the start of a run left out of the per-stage figures (pipeline fill).

    >>> warmup_minibatches("1f1b-rr", (1, 1), 20), warmup_minibatches("gpipe", (1, 1), 20)
    (2, 1)
    """
    fill = schedule_kind(schedule).minibatches_in_flight(replicas)
    return min(fill, max(total - 1, 0))


def tensor_count_steps(schedule: str, replicas: tuple[int, ...], period: int) -> int:
    """Steps over which a CPU rank counts its live tensors (``MemoryMeter.stop_counting``): the
    pipeline's fill and one step of the steady state, where the stage's peak falls (every
    weight version stashed, every micro-batch of the fill in flight, the optimizer's state made).

    >>> tensor_count_steps("1f1b-rr", (1, 1), 1), tensor_count_steps("1f1b-flush", (1, 1), 1)
    (3, 2)
    """
    fill = schedule_kind(schedule).minibatches_in_flight(replicas)
    return -(-fill // period) + 1


def timed_from(
    schedule: str, replicas: tuple[int, ...], total: int, period: int, counted_tensors: bool
) -> int:
    """Minibatches at the start of a run left out of its timings: the pipeline's fill
    (``warmup_minibatches``) and, where the ranks counted their live tensors, the steps counted
    (``tensor_count_steps``: the counter's cost per operator is in them).

    >>> timed_from("1f1b-rr", (1, 1), 20, 1, False), timed_from("1f1b-rr", (1, 1), 20, 1, True)
    (2, 3)
    """
    fill = warmup_minibatches(schedule, replicas, total)
    if not counted_tensors:
        return fill
    return min(max(fill, tensor_count_steps(schedule, replicas, period) * period), max(total - 1, 0))


def rank_report(
    rank: int,
    spec: PipelineSpec,
    executor: Executor,
    recorder: Recorder,
    wall_ms: float,
    stash: WeightStash | None,
    memory: MemoryReading | None = None,
    checkpoint: CheckpointReport | None = None,
) -> RankReport:
    counted_from = recorder.count_from - executor.minibatch_offset
    handled = {a.minibatch for a in executor.actions if a.kind == "F" and a.minibatch >= counted_from}
    done = dict(executor.done_ms)
    return RankReport(
        rank=rank,
        stage=spec.stage_index,
        replica=spec.replica,
        minibatches=len(handled),
        totals_ms=dict(recorder.totals_ms),
        wall_ms=wall_ms,
        losses=dict(executor.losses) if spec.tp_index == 0 else {},  # a tensor-parallel group reports once
        done_ms=done,
        peak_versions=stash.peak_versions if stash is not None else 1,
        events=list(recorder.events),
        memory=memory,
        checkpoint=checkpoint,
    )


def gather_reports(report: RankReport, rank: int) -> list[RankReport]:
    """Every rank's report on rank 0 (``[]`` elsewhere); collective."""
    out: list[RankReport | None] = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object(report, out if rank == 0 else None, dst=0)
    return [r for r in out if r is not None] if rank == 0 else []


def steady_period_ms(done_ms: list[float], warmup: int) -> float:
    """Mean spacing of completion times after ``warmup`` of them (all of them if too few).

    >>> steady_period_ms([10.0, 30.0, 40.0, 50.0, 60.0], 1)
    10.0
    """
    times = sorted(done_ms)
    if len(times) < 2:
        return times[0] if times else float("nan")
    start = min(warmup, len(times) - 2)
    return (times[-1] - times[start]) / (len(times) - 1 - start)


def predicted_compute_ms(stage: StagePlan, flushes: bool) -> float:
    """The stage's simulated compute (forward + backward of its micro-batches, at their size,
    and the optimizer step) per minibatch a replica handles: its busy time
    (``StagePlan.time_per_minibatch_ms``, per replica per minibatch of the pipeline) less its
    all-reduce. Without a flush a replica handles 1 minibatch in ``replicas``. Not
    ``StagePlan.compute_ms``: that is one whole minibatch in one call, which M micro-batches
    of B / M samples exceed by their fixed cost per call (``pipeplan.planner.microbatch_time``).
    A plan with no simulated busy time (0, or ``Predicted.simulated`` False: the caller's
    test) keeps ``compute_ms``.

    >>> from pipeplan.plan import StagePlan
    >>> stage = StagePlan(0, 0, 2, 2, (0, 1), 8.0, 1.0, 0.0, 7.0, 0, 1, 1)
    >>> predicted_compute_ms(stage, True), predicted_compute_ms(stage, False)
    (6.0, 13.0)
    """
    if stage.time_per_minibatch_ms <= 0:
        return stage.compute_ms
    handled = stage.time_per_minibatch_ms * (1 if flushes else stage.replicas)
    return max(handled - stage.allreduce_ms, 0.0)


def prediction_for_run(plan: Plan, schedule: str, microbatches: int) -> Plan:
    """``plan`` predicted for the ``schedule`` and ``microbatches`` that ran.

    The plan itself when they are its own; else re-predicted from the plan's per-stage
    figures (``pipeplan.planner.predict``), so a run is never reported against another
    schedule's number. A schedule the plan cannot be simulated with (its chunks do not
    suit it) keeps the plan's figures, and ``predicted_schedule`` in the metrics says so.
    """
    kind = schedule_kind(schedule)
    same_micro = kind.whole_minibatches or microbatches == plan.microbatches
    if schedule == plan.schedule and same_micro:
        return plan
    try:
        return predict(plan, schedule=schedule, microbatches=microbatches)
    except InputError:
        return plan


def write_outputs(
    config: RunConfig, spec: PipelineSpec, reports: list[RankReport], period: int, offset: int
) -> dict[str, Any]:
    """Build the metrics summary (and write --metrics / --trace files); returns it."""
    plan = config.plan
    # With a replicated loss stage and micro-batches, each replica holds the loss of its
    # own micro-batches of a minibatch: the minibatch's loss is their sum.
    losses_by_minibatch: dict[int, float] = {}
    for r in reports:
        for k, loss in r.losses.items():
            losses_by_minibatch[k] = losses_by_minibatch.get(k, 0.0) + loss
    ordered = sorted(losses_by_minibatch)
    step_losses = []
    for first in range(offset, offset + len(ordered), period):
        chunk = [losses_by_minibatch[k] for k in range(first, first + period) if k in losses_by_minibatch]
        if chunk:
            step_losses.append(sum(chunk) / len(chunk))
    # one completion per minibatch: under a flush every input-stage replica steps on it
    done_by_minibatch: dict[int, float] = {}
    for r in reports:
        if r.stage == 0:
            for k, t in r.done_ms.items():
                done_by_minibatch[k] = max(done_by_minibatch.get(k, t), t)
    input_done = list(done_by_minibatch.values())
    counted = any(r.memory is not None and r.memory.tensor_held_bytes is not None for r in reports)
    period_ms = steady_period_ms(
        input_done, timed_from(config.schedule, spec.replicas, len(input_done), period, counted)
    )
    wall_ms = max(r.wall_ms for r in reports)
    minibatches = len(losses_by_minibatch)
    predicted = prediction_for_run(plan, config.schedule, config.microbatches)
    kind = schedule_kind(predicted.schedule)
    stages = []
    for r in sorted(reports, key=lambda r: r.rank):
        if r.stage < 0:
            continue
        handled = max(r.minibatches, 1)
        replicas = spec.replicas[r.stage % spec.stages]
        compute = sum(r.totals_ms.get(c, 0.0) for c in ("forward", "backward", "step"))
        wait = sum(r.totals_ms.get(c, 0.0) for c in ("recv", "allreduce"))
        # a worker runs every model stage of its position (q = chunk * p + position)
        positions = len(predicted.stages) // predicted.virtual_stages
        chunks = predicted.stages[r.stage :: positions]
        stages.append(
            StageMetrics(
                stage=r.stage,
                replica=r.replica,
                rank=r.rank,
                time_per_minibatch_ms=(compute + r.totals_ms.get("allreduce", 0.0)) / handled / replicas,
                compute_ms=compute / handled,
                wait_ms=wait / handled,
                forward_ms=r.totals_ms.get("forward", 0.0) / handled,
                backward_ms=r.totals_ms.get("backward", 0.0) / handled,
                allreduce_ms=r.totals_ms.get("allreduce", 0.0) / handled,
                minibatches=r.minibatches,
                weight_versions_used=r.peak_versions,
                predicted_time_per_minibatch_ms=sum(s.time_per_minibatch_ms for s in chunks),
                predicted_compute_ms=sum(
                    predicted_compute_ms(s, kind.flushes) if predicted.predicted.simulated else s.compute_ms
                    for s in chunks
                ),
                predicted_weight_versions=chunks[0].weight_versions,
                memory_kind=r.memory.kind if r.memory is not None else None,
                baseline_memory_bytes=r.memory.baseline_bytes if r.memory is not None else None,
                overhead_memory_bytes=r.memory.overhead_bytes if r.memory is not None else None,
                setup_memory_bytes=r.memory.setup_bytes if r.memory is not None else None,
                peak_memory_bytes=r.memory.peak_bytes if r.memory is not None else None,
                tensor_held_bytes=r.memory.tensor_held_bytes if r.memory is not None else None,
                predicted_memory_bytes=sum(s.memory_bytes for s in chunks),
                **_checkpoint_fields(r),
            )
        )
    checkpoints = [r.checkpoint for r in reports if r.checkpoint is not None]
    first_steps = [c.first_step_ms for c in checkpoints if c.first_step_ms is not None]
    lead = checkpoints[0] if checkpoints else None
    metrics = Metrics(
        schedule=config.schedule,
        microbatches=config.microbatches,
        plan=plan.to_dict(),
        steps=len(step_losses),
        first_step=offset // period,
        minibatches_per_step=period,
        losses=tuple(step_losses),
        minibatch_losses=tuple(losses_by_minibatch[k] for k in ordered),
        samples_per_s=plan.batch_size * 1000.0 / period_ms if period_ms > 0 else float("nan"),
        wall_samples_per_s=minibatches * plan.batch_size * 1000.0 / wall_ms if wall_ms > 0 else 0.0,
        wall_ms=wall_ms,
        time_per_minibatch_ms=period_ms,
        predicted_time_per_minibatch_ms=predicted.predicted.time_per_minibatch_ms,
        predicted_samples_per_s=predicted.predicted.samples_per_s,
        predicted_schedule=predicted.schedule,
        predicted_microbatches=predicted.microbatches,
        stages=tuple(stages),
        checkpoint_mode=(
            ("async" if lead.asynchronous else "sync") if lead is not None and lead.cost is not None else None
        ),
        checkpoint_every=lead.every if lead is not None else None,
        predicted_checkpoint_overhead_pct=lead.predicted_overhead_pct if lead is not None else None,
        start_to_first_step_ms=max(first_steps) if first_steps else None,
    )
    summary = metrics.to_dict()
    if config.outputs.metrics_path:
        metrics.save(config.outputs.metrics_path)
    if config.outputs.trace_path:
        events = merge_events(*(r.events for r in reports))
        names = {
            r.rank: f"rank {r.rank} (stage {r.stage}, replica {r.replica})" for r in reports if r.stage >= 0
        }
        write_chrome_trace(
            config.outputs.trace_path,
            events,
            {"source": "runtime", "schedule": config.schedule, "microbatches": config.microbatches},
            names,
        )
    return summary


def _checkpoint_fields(report: RankReport) -> dict[str, Any]:
    """A rank's checkpoint figures for its ``StageMetrics`` (none without --checkpoint-dir).

    The overhead is the stall over the training time without it: ``100 * stall / (wall - stall)``.
    """
    cost = report.checkpoint.cost if report.checkpoint is not None else None
    if cost is None:
        return {}
    training_ms = report.wall_ms - cost.stall_ms
    return {
        "checkpoints": cost.checkpoints,
        "checkpoint_stall_ms": cost.stall_ms,
        "checkpoint_wait_ms": cost.wait_ms,
        "checkpoint_persist_ms": cost.persist_ms,
        "checkpoint_bytes": cost.bytes_written,
        "checkpoint_overhead_pct": 100.0 * cost.stall_ms / training_ms if training_ms > 0 else None,
    }
