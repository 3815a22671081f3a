"""The metrics contract: what ``pipeplan run`` measured, beside the plan's predictions.

Written by ``pipeplan.runtime.rank_metrics`` (rank 0 merges every rank's measurements), read
by ``pipeplan.reporting.run_vs_plan`` and ``pipeplan report``. Stored as JSON with
``"schema": "pipeplan.metrics/2"`` (format in ``docs/metrics.md``; version 1 files, written
before the per-rank memory figures, still load with those ``None``; the checkpoint figures
are optional keys of version 2, ``None`` when absent). Times are
milliseconds per minibatch, rates samples per second, memory bytes; a figure that was not
measured or not predicted is ``None`` (JSON null). ``stages`` is indexed by position in the list,
one entry per (stage, replica), i.e. per rank running a stage.

Reading is tolerant in one way only: unknown keys are ignored (newer writers), and every
field but ``stage`` has a default (older writers). A value of the wrong type is a
one-line ``InputError`` naming its key.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from pipeplan.errors import InputError
from pipeplan.jsonio import JSONValue, read_json, write_json_atomic

__all__ = ["METRICS_SCHEMA", "OLDER_METRICS_SCHEMAS", "MEMORY_KINDS", "StageMetrics", "Metrics"]

METRICS_SCHEMA = "pipeplan.metrics/2"
OLDER_METRICS_SCHEMAS = ("pipeplan.metrics/1",)  # still load (no memory figures)
MEMORY_KINDS = ("rss", "cuda_allocated")  # StageMetrics.memory_kind: CPU resident set, GPU allocator


@dataclass(frozen=True)
class StageMetrics:
    """One worker (stage, replica): measured per minibatch it handled, and predicted."""

    stage: int
    replica: int = 0
    rank: int = -1
    time_per_minibatch_ms: float | None = None  # busy time / replicas: the stage's share of the period
    compute_ms: float | None = None  # forward + backward + optimizer step
    wait_ms: float | None = None  # blocked on receives and all-reduces
    forward_ms: float | None = None
    backward_ms: float | None = None
    allreduce_ms: float | None = None
    minibatches: int = 0  # minibatches this worker handled (after the warm-up)
    weight_versions_used: int | None = None  # most weight versions it held at once
    predicted_time_per_minibatch_ms: float | None = None  # StagePlan.time_per_minibatch_ms
    predicted_compute_ms: float | None = None  # StagePlan.compute_ms
    predicted_weight_versions: int | None = None  # StagePlan.weight_versions
    # memory of this rank: "rss" (CPU: the process's resident set) or "cuda_allocated"
    # (GPU: torch.cuda.memory_allocated / max_memory_allocated); see pipeplan.runtime.memory_usage
    memory_kind: str | None = None
    baseline_memory_bytes: int | None = None  # before the stage was built
    # of the baseline, the runtime's fixed part: what a warm-up step of a tiny model added (CPU)
    overhead_memory_bytes: int | None = None
    # what the rank held just before its first step beyond its stage's parameters and buffers
    # (CPU: the build's leftovers, minibatches drawn ahead, communication); not the stage's
    setup_memory_bytes: int | None = None
    peak_memory_bytes: int | None = None  # the most at any moment of the run
    # CPU: the stage's parameters and buffers and the most bytes of tensors made in the first
    # steps alive at once (the steady state's peak among them), with no allocator in it: what
    # predicted_memory_bytes predicts (None: not counted)
    tensor_held_bytes: int | None = None
    predicted_memory_bytes: int | None = None  # StagePlan.memory_bytes (summed over the rank's chunks)
    # checkpoints of this rank over the run (totals; None: the run took none, or an older file)
    checkpoints: int = 0
    checkpoint_stall_ms: float | None = None  # training blocked: waits for the previous persist + snapshots
    checkpoint_wait_ms: float | None = None  # of the stall: waiting for the previous persist
    checkpoint_persist_ms: float | None = None  # writing and sealing (behind training when async)
    checkpoint_bytes: int | None = None  # bytes of the files written
    checkpoint_overhead_pct: float | None = None  # 100 * stall / (wall time - stall)

    @property
    def held_memory_bytes(self) -> int | None:
        """What the rank held for its stage: peak - baseline - set-up (what ``predicted_memory_bytes``
        predicts)."""
        if self.peak_memory_bytes is None or self.baseline_memory_bytes is None:
            return None
        return self.peak_memory_bytes - self.baseline_memory_bytes - (self.setup_memory_bytes or 0)

    @classmethod
    def from_dict(cls, obj: JSONValue, where: str) -> StageMetrics:
        if not isinstance(obj, Mapping) or "stage" not in obj:
            raise InputError(f"{where} has no 'stage'")
        values = _typed(cls, obj, where)
        kind = values.get("memory_kind")
        if kind is not None and kind not in MEMORY_KINDS:
            raise InputError(f"{where}: memory_kind {kind!r} is not one of {', '.join(MEMORY_KINDS)}")
        for key in (
            "baseline_memory_bytes",
            "overhead_memory_bytes",
            "setup_memory_bytes",
            "peak_memory_bytes",
            "tensor_held_bytes",
            "predicted_memory_bytes",
            "checkpoint_bytes",
        ):
            if (values.get(key) or 0) < 0:
                raise InputError(f"{where}: {key} = {values[key]} is negative")
        return cls(**values)


@dataclass(frozen=True)
class Metrics:
    """A run's measurements; ``plan`` is the executed plan's JSON (``Plan.to_dict()``)."""

    schedule: str = ""  # the schedule that ran ("" = the plan's)
    microbatches: int = 1  # micro-batches per minibatch that ran
    plan: Mapping[str, Any] | None = field(default=None, compare=False)
    steps: int = 0  # optimizer steps run
    first_step: int = 0  # the first one (after --resume)
    minibatches_per_step: int = 1
    losses: tuple[float, ...] = ()  # mean loss of each step
    minibatch_losses: tuple[float, ...] = ()
    samples_per_s: float | None = None  # steady state, from the pipeline period
    wall_samples_per_s: float | None = None  # all minibatches over the wall time
    wall_ms: float | None = None
    time_per_minibatch_ms: float | None = None  # measured steady-state period
    predicted_time_per_minibatch_ms: float | None = None  # for the schedule that ran
    predicted_samples_per_s: float | None = None
    predicted_schedule: str | None = None  # the schedule and micro-batch count the
    predicted_microbatches: int | None = None  # predictions are for (re-predicted when not the plan's)
    stages: tuple[StageMetrics, ...] = ()
    checkpoint_mode: str | None = None  # "sync" or "async" (None: no checkpoints)
    checkpoint_every: int | None = (
        None  # steps between checkpoints (--checkpoint-every auto: its last choice)
    )
    predicted_checkpoint_overhead_pct: float | None = None  # auto's prediction for that interval
    start_to_first_step_ms: float | None = None  # process start to the first step's end (slowest rank)

    @property
    def schedule_name(self) -> str:
        """The schedule that ran: ``schedule``, else the plan's, else "?"."""
        plan_schedule = self.plan.get("schedule") if isinstance(self.plan, Mapping) else None
        return self.schedule or str(plan_schedule or "?")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["plan"] = dict(self.plan) if self.plan is not None else None
        out["losses"] = list(self.losses)
        out["minibatch_losses"] = list(self.minibatch_losses)
        out["stages"] = [{k: _finite(v) for k, v in asdict(s).items()} for s in self.stages]
        return {"schema": METRICS_SCHEMA, **{k: _finite(v) for k, v in out.items()}}

    @classmethod
    def from_dict(cls, obj: JSONValue, where: str = "metrics") -> Metrics:
        """Parse (and type-check) a metrics object; ``InputError`` naming the bad key."""
        if not isinstance(obj, Mapping):
            raise InputError(f"{where}: expected a JSON object (got {type(obj).__name__})")
        raw_stages = obj.get("stages", [])
        if not isinstance(raw_stages, list):
            raise InputError(f"{where}: 'stages' must be a list (got {type(raw_stages).__name__})")
        plan = obj.get("plan")
        rest = {k: v for k, v in obj.items() if k not in ("stages", "plan", "schema")}
        return cls(
            **_typed(cls, rest, where),
            plan=plan if isinstance(plan, Mapping) else None,
            stages=tuple(
                StageMetrics.from_dict(s, f"{where}: stages[{i}]") for i, s in enumerate(raw_stages)
            ),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Metrics:
        return cls.from_dict(read_json(path, METRICS_SCHEMA, OLDER_METRICS_SCHEMAS), where=str(path))


_Value = TypeVar("_Value")


def _finite(value: _Value) -> _Value | None:
    """JSON has no inf/nan: a non-finite float is written as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _typed(cls: type, obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The known keys of ``obj`` checked against ``cls``'s field types (as written above)."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in obj or f.name in ("stages", "plan"):
            continue
        value, kind = obj[f.name], str(f.type)
        if kind.startswith("tuple[float"):
            if not isinstance(value, list) or not all(_is_number(x) for x in value):
                raise InputError(f"{where}: {f.name} must be a list of numbers (got {value!r:.60})")
            out[f.name] = tuple(float(x) for x in value)
        elif kind.startswith("float"):
            if value is not None and not (_is_number(value) and math.isfinite(value)):
                raise InputError(f"{where}: {f.name} = {value!r} is not a finite number")
            out[f.name] = None if value is None else float(value)
        elif kind.startswith("int"):
            if not (value is None and "None" in kind) and (
                isinstance(value, bool) or not isinstance(value, int)
            ):
                raise InputError(f"{where}: {f.name!r} must be an integer (got {value!r})")
            out[f.name] = value
        else:  # str fields
            if not (value is None and "None" in kind) and not isinstance(value, str):
                raise InputError(f"{where}: {f.name!r} must be a string (got {value!r})")
            out[f.name] = value
    return out


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
