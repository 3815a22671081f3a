"""Predicted vs measured: read a run's metrics.json and compare it with the plan.

Reads the typed metrics contract (``pipeplan.metrics.Metrics``, format in
``docs/metrics.md``): unknown keys are ignored, missing predictions are taken from the
embedded plan, and a value that is absent stays ``None`` (printed as "-").
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeplan.errors import InputError
from pipeplan.metrics import METRICS_SCHEMA, Metrics

__all__ = [
    "METRICS_SCHEMA",
    "OFF_THRESHOLD",
    "Comparison",
    "StageComparison",
    "MetricsReport",
    "read_metrics",
    "compare",
    "load_report",
    "explain",
    "explain_pipeline",
]

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
    predicted_for: str | None = None  # the schedule the predictions are for, when re-predicted

    @property
    def flagged(self) -> tuple[StageComparison, ...]:
        """Stages whose time per minibatch is off by more than 20 %."""
        return tuple(s for s in self.stages if s.time_per_minibatch.off)


def read_metrics(path: str | os.PathLike[str]) -> Metrics:
    """The metrics of ``path``; ``InputError`` on a bad file, another schema or a bad value."""
    return Metrics.load(path)


def _plan_number(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{where}: {key} = {value!r} is not a finite number")
    return float(value)


def compare(metrics: Metrics | Mapping[str, Any], where: str = "metrics") -> MetricsReport:
    """Pair every measured figure with its prediction (from the metrics or its plan)."""
    if not isinstance(metrics, Metrics):
        metrics = Metrics.from_dict(metrics, where)
    plan = metrics.plan if isinstance(metrics.plan, Mapping) else {}
    plan_stages = {s.get("index"): s for s in plan.get("stages", []) if isinstance(s, Mapping)}
    predicted_period = metrics.predicted_time_per_minibatch_ms
    if predicted_period is None and isinstance(plan.get("predicted"), Mapping):
        predicted_period = _plan_number(plan["predicted"], "time_per_minibatch_ms", f"{where}: plan")
    stages = []
    for raw in metrics.stages:
        planned = plan_stages.get(raw.stage, {})
        predicted_time = raw.predicted_time_per_minibatch_ms
        if predicted_time is None:
            predicted_time = _plan_number(
                planned, "time_per_minibatch_ms", f"{where}: plan stage {raw.stage}"
            )
        predicted_compute = raw.predicted_compute_ms
        if predicted_compute is None:
            predicted_compute = _plan_number(planned, "compute_ms", f"{where}: plan stage {raw.stage}")
        stages.append(
            StageComparison(
                stage=raw.stage,
                replica=raw.replica,
                rank=raw.rank,
                time_per_minibatch=Comparison(predicted_time, raw.time_per_minibatch_ms),
                compute=Comparison(predicted_compute, raw.compute_ms),
                wait_ms=raw.wait_ms,
            )
        )
    stages.sort(key=lambda s: (s.stage, s.replica))
    return MetricsReport(
        schedule=metrics.schedule_name,
        samples_per_s=metrics.samples_per_s,
        time_per_minibatch=Comparison(predicted_period, metrics.time_per_minibatch_ms),
        stages=tuple(stages),
        losses=metrics.losses,
        predicted_for=metrics.predicted_schedule,
    )


def load_report(path: str | os.PathLike[str]) -> MetricsReport:
    """``compare(read_metrics(path))``."""
    return compare(read_metrics(path), where=str(path))


def explain(stage: StageComparison) -> str:
    """One line for a stage off its prediction: which part is off (its compute, its waiting,
    or the rest of its period) and what the user can do."""
    period, compute = stage.time_per_minibatch, stage.compute
    head = f"stage {stage.stage} replica {stage.replica} (rank {stage.rank})"
    if period.ratio is not None and period.predicted_ms is not None:
        head += f": {period.ratio:.2f}x its predicted {period.predicted_ms:.2f} ms/minibatch"
    if compute.off and compute.ratio is not None and compute.predicted_ms is not None:
        measured = f"{compute.measured_ms:.2f} vs {compute.predicted_ms:.2f} ms"
        if compute.ratio > 1:
            return (
                f"{head}; its compute is off, {compute.ratio:.2f}x ({measured}): its layers run slower "
                f"here than profiled. Profile with the run's conditions (an idle machine, the run's "
                f"--threads), check the profile's layers-vs-step ratio (pipeplan profile prints it), "
                f"and compare the stage's trace (--trace) with its layers' profiled times; on CPU ranks "
                f"sharing a few cores, short layers also run slower right after their rank waited "
                f"(bench/bench_turns.py)"
            )
        return (
            f"{head}; its compute is off, {compute.ratio:.2f}x ({measured}): its layers run faster "
            f"here than profiled. Profile again on this machine with the run's --threads"
        )
    measured_period = period.measured_ms or 0.0
    wait = stage.wait_ms or 0.0
    rest = measured_period - (compute.measured_ms or 0.0) - wait
    within = f"its compute is within {OFF_THRESHOLD:.0%}" + (
        f" ({compute.ratio:.2f}x)" if compute.ratio is not None else ""
    )
    if wait >= rest:
        return (
            f"{head}; {within}, it waits {wait:.2f} ms/minibatch: for a slower neighbour or the "
            f"network. Look at the stage whose compute is off, or at the links in the trace (--trace)"
        )
    return (
        f"{head}; {within}, and {rest:.2f} ms/minibatch go neither to compute nor to waiting "
        f"(the optimizer step, weight copies, sends): see them in the trace (--trace)"
    )


def explain_pipeline(report: MetricsReport) -> str | None:
    """One line when the pipeline's period is off its prediction by more than 20 %: which part
    is off (the stages' compute, or the time between them) and what the user can do; None
    when it is within.

    Every stage can be within its own prediction while the pipeline is not: the stages then
    compute as planned and the period goes to what lies between them (waiting, the runtime's
    work per action, posting messages), which no stage line flags.
    """
    period = report.time_per_minibatch
    if not period.off or period.ratio is None or period.measured_ms is None or period.predicted_ms is None:
        return None
    head = (
        f"the pipeline: {period.ratio:.2f}x its predicted {period.predicted_ms:.2f} ms/minibatch "
        f"({period.measured_ms:.2f} ms measured)"
    )
    if period.ratio < 1.0:
        return (
            f"{head}: faster than planned. The profile was taken on a slower or busier machine, or "
            f"with other --threads: profile again on this one"
        )
    known = [s for s in report.stages if s.compute.ratio is not None]
    if any(s.compute.off and (s.compute.ratio or 0.0) > 1.0 for s in known):
        return f"{head}: a stage computes slower than profiled (below)"
    worst = max(known, key=lambda s: s.compute.ratio or 0.0, default=None)
    within = (
        f"every stage computes within {OFF_THRESHOLD:.0%} of its prediction (worst {worst.compute.ratio:.2f}x)"
        if worst is not None
        else "no stage has a compute prediction"
    )
    waits = [s.wait_ms for s in report.stages if s.wait_ms is not None]
    wait = f", waiting up to {max(waits):.2f} ms/minibatch" if waits else ""
    return (
        f"{head}: {within}{wait}. The time goes between the stages: each exchange (a send, a "
        f"receive, a step's all-reduce) costs more here than the topology's links charge; on "
        f"CPU ranks sharing a few cores a message also costs both ranks' cores time, which the "
        f"plan counts only as its topology's message_overhead: measure it here with "
        f"`pipeplan calibrate` and plan again on the topology it writes. Fewer micro-batches exchange fewer messages "
        f"(partition --schedule auto compares them); --trace shows the gaps"
    )
