"""A run's training curve (loss and learning rate per step), read back and drawn as a PNG."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from pipeplan.errors import InputError
from pipeplan.runtime.live_log import LOG_NAME

__all__ = ["TrainingCurve", "read_curve", "draw_curve"]


@dataclass(frozen=True)
class TrainingCurve:
    """Indexed by position: ``steps[i]`` (1-based step) had ``losses[i]``, ``lrs[i]``, ``grad_norms[i]``."""

    source: str
    steps: tuple[int, ...]
    losses: tuple[float | None, ...]
    lrs: tuple[float | None, ...] = ()  # empty when the source has none (metrics.json)
    grad_norms: tuple[float | None, ...] = ()
    samples_per_s: tuple[float | None, ...] = ()


def read_curve(path: str) -> TrainingCurve:
    """The curve of a ``--log-dir`` (or its metrics.jsonl) or of a ``--metrics`` metrics.json.

    A log that a resumed run appended to keeps, for a step written twice, the newest line.
    """
    if os.path.isdir(path):
        path = os.path.join(path, LOG_NAME)
    if path.endswith(".jsonl"):
        return _read_log(path)
    from pipeplan.metrics import Metrics

    metrics = Metrics.load(path)
    first = metrics.first_step
    return TrainingCurve(
        path,
        tuple(range(first + 1, first + 1 + len(metrics.losses))),
        tuple(_finite(x) for x in metrics.losses),
    )


def _read_log(path: str) -> TrainingCurve:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from exc
    by_step: dict[int, dict[str, object]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = record["step"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{path}:{number}: not a metrics line ({type(exc).__name__})") from exc
        if not isinstance(step, int) or step < 1:
            raise InputError(f"{path}:{number}: step must be an integer >= 1 (got {step!r})")
        by_step[step] = record
    if not by_step:
        raise InputError(f"{path}: no steps logged")
    steps = tuple(sorted(by_step))

    def column(name: str) -> tuple[float | None, ...]:
        return tuple(_finite(by_step[s].get(name)) for s in steps)

    return TrainingCurve(
        path, steps, column("loss"), column("lr"), column("grad_norm"), column("samples_per_s")
    )


def _finite(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def draw_curve(curve: TrainingCurve, title: str = "") -> bytes:
    """PNG bytes: the loss per step (left axis) and, when logged, the learning rate (right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 3.6))
    points = [(s, x) for s, x in zip(curve.steps, curve.losses) if x is not None]
    ax.plot([s for s, _ in points], [x for _, x in points], color="#1f77b4", linewidth=1.6, label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="#1f77b4")
    ax.grid(True, alpha=0.3)
    handles = ax.get_lines()
    rates = [(s, x) for s, x in zip(curve.steps, curve.lrs) if x is not None]
    if rates:
        right = ax.twinx()
        right.plot(
            [s for s, _ in rates],
            [x for _, x in rates],
            color="#ff7f0e",
            linewidth=1.2,
            linestyle="--",
            label="learning rate",
        )
        right.set_ylabel("learning rate", color="#ff7f0e")
        right.set_ylim(bottom=0.0)
        handles = [*handles, *right.get_lines()]
    ax.legend(handles, [str(h.get_label()) for h in handles], loc="upper right", fontsize=8)
    ax.set_title(title or curve.source, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    return buffer.getvalue()
