"""Predicted vs measured: read a run's metrics.json and compare it with the plan.

The metrics format (``pipeplan.metrics/1``) is described in ``docs/metrics.md``. The
reader is tolerant: unknown keys are ignored, missing predictions are taken from the
embedded plan, and a value that is absent stays ``None`` (printed as "-").
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from pipeplan.errors import InputError
from pipeplan.jsonio import read_json

__all__ = [
    "METRICS_SCHEMA",
    "OFF_THRESHOLD",
    "Comparison",
    "StageComparison",
    "MetricsReport",
    "read_metrics",
    "compare",
    "load_report",
]

METRICS_SCHEMA = "pipeplan.metrics/1"
OFF_THRESHOLD = 0.20  # flag a measurement more than 20 % away from its prediction


@dataclass(frozen=True)
class Comparison:
    """One predicted / measured pair (ms)."""

    predicted_ms: float | None
    measured_ms: float | None

    @property
    def ratio(self) -> float | None:
        """measured / predicted; None when either is missing or the prediction is 0."""
        if self.predicted_ms is None or self.measured_ms is None or self.predicted_ms <= 0:
            return None
        return self.measured_ms / self.predicted_ms

    @property
    def off(self) -> bool:
        """True when measured is more than ``OFF_THRESHOLD`` away from predicted."""
        ratio = self.ratio
        return ratio is not None and abs(ratio - 1.0) > OFF_THRESHOLD


@dataclass(frozen=True)
class StageComparison:
    stage: int
    replica: int
    rank: int
    time_per_minibatch: Comparison
    compute: Comparison
    wait_ms: float | None


@dataclass(frozen=True)
class MetricsReport:
    schedule: str
    samples_per_s: float | None
    time_per_minibatch: Comparison
    stages: tuple[StageComparison, ...]
    losses: tuple[float, ...]

    @property
    def flagged(self) -> tuple[StageComparison, ...]:
        """Stages whose time per minibatch is off by more than 20 %."""
        return tuple(s for s in self.stages if s.time_per_minibatch.off)


def read_metrics(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metrics object of ``path``; ``InputError`` on a bad file or another schema."""
    obj = read_json(path, METRICS_SCHEMA)
    return obj


def _number(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{where}: {key} = {value!r} is not a finite number")
    return float(value)


def compare(metrics: Mapping[str, Any], where: str = "metrics") -> MetricsReport:
    """Pair every measured figure with its prediction (from the metrics or its plan)."""
    plan = metrics.get("plan") if isinstance(metrics.get("plan"), dict) else {}
    plan_stages = {s.get("index"): s for s in plan.get("stages", []) if isinstance(s, dict)}
    predicted_period = _number(metrics, "predicted_time_per_minibatch_ms", where)
    if predicted_period is None and isinstance(plan.get("predicted"), dict):
        predicted_period = _number(plan["predicted"], "time_per_minibatch_ms", f"{where}: plan")
    stages = []
    raw_stages = metrics.get("stages", [])
    if not isinstance(raw_stages, list):
        raise InputError(f"{where}: 'stages' must be a list (got {type(raw_stages).__name__})")
    for position, raw in enumerate(raw_stages):
        here = f"{where}: stages[{position}]"
        if not isinstance(raw, dict) or "stage" not in raw:
            raise InputError(f"{here} has no 'stage'")
        stage = _integer(raw, "stage", -1, here)
        planned = plan_stages.get(stage, {})
        predicted_time = _number(raw, "predicted_time_per_minibatch_ms", here)
        if predicted_time is None:
            predicted_time = _number(planned, "time_per_minibatch_ms", f"{where}: plan stage {stage}")
        predicted_compute = _number(raw, "predicted_compute_ms", here)
        if predicted_compute is None:
            predicted_compute = _number(planned, "compute_ms", f"{where}: plan stage {stage}")
        stages.append(
            StageComparison(
                stage=stage,
                replica=_integer(raw, "replica", 0, here),
                rank=_integer(raw, "rank", -1, here),
                time_per_minibatch=Comparison(predicted_time, _number(raw, "time_per_minibatch_ms", here)),
                compute=Comparison(predicted_compute, _number(raw, "compute_ms", here)),
                wait_ms=_number(raw, "wait_ms", here),
            )
        )
    stages.sort(key=lambda s: (s.stage, s.replica))
    losses = metrics.get("losses") or []
    return MetricsReport(
        schedule=str(metrics.get("schedule") or plan.get("schedule") or "?"),
        samples_per_s=_number(metrics, "samples_per_s", where),
        time_per_minibatch=Comparison(predicted_period, _number(metrics, "time_per_minibatch_ms", where)),
        stages=tuple(stages),
        losses=tuple(float(x) for x in losses if isinstance(x, (int, float))),
    )


def _integer(obj: Mapping[str, Any], key: str, default: int, where: str) -> int:
    """``obj[key]`` as an int (``default`` when absent); ``InputError`` naming it otherwise."""
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: {key!r} must be an integer (got {value!r})")
    return value


def load_report(path: str | os.PathLike[str]) -> MetricsReport:
    """``compare(read_metrics(path))``."""
    return compare(read_metrics(path), where=str(path))
