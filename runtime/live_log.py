"""Live training metrics (``--log-dir``): per-step loss, lr, gradient norm, throughput, per-stage time.

Every rank, at the end of each training step, publishes what it knows of the step in the
run's store (``Watchdog.publish``: no collective, so no schedule waits for it): the loss
stage its share of the loss, each rank its step's end time, its compute time, learning
rate and gradient norm. Rank 0 writes every step once all ranks published it, in step
order, to ``DIR/metrics.jsonl`` (one JSON object a line) and to TensorBoard event files
in ``DIR`` (``torch.utils.tensorboard``). Line fields (units in the names):

- ``step`` (1-based), ``loss`` (mean over the step's minibatches), ``lr``,
- ``grad_norm``: the global norm before clipping (flush schedules, 2BW), or null
  for 1F1B-RR, whose stages step on their own and log ``stage_grad_norm`` (one per stage),
- ``samples_per_s``: samples of the step / time since the previous step ended (the
  latest rank to finish it, on clocks aligned at the start barrier),
- ``stage_step_ms``: per stage (replica 0), wall ms between its previous and this step's end,
- ``stage_compute_ms``: per stage (replica 0), forward + backward + optimizer ms in the step
  (host clock; null on CUDA, where kernels are timed only at the end of the run).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: ``pipeplan.runtime.curves`` reads LOG_NAME without importing torch
    from torch.utils.tensorboard import SummaryWriter

    from pipeplan.runtime.config import RunConfig
    from pipeplan.runtime.executor import Executor
    from pipeplan.runtime.failure import Watchdog
    from pipeplan.runtime.recorder import Recorder
    from pipeplan.runtime.stage import PipelineSpec

__all__ = ["LiveLog", "step_record", "open_live_log", "publish_step"]

LOG_NAME = "metrics.jsonl"


def step_record(
    stage: int,
    replica: int,
    end_ms: float,
    compute_ms: float | None,
    loss_sum: float | None,
    lr: float | None,
    grad_square: float | None,
) -> str:
    """What one rank publishes for one step (JSON; non-finite values as null).

    ``grad_square``: the squared gradient sum this rank counts (``pipeplan.runtime.clip``):
    summed over the ranks it is the squared global norm; 1F1B-RR: the stage's own.
    """
    return json.dumps(
        {
            "stage": stage,
            "replica": replica,
            "end_ms": end_ms,
            "compute_ms": compute_ms,
            "loss_sum": _finite(loss_sum),
            "lr": lr,
            "grad_square": _finite(grad_square),
        }
    )


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass
class LiveLog:
    """Rank 0's writer: collects each step from every rank, writes it to JSON lines and TensorBoard."""

    directory: str
    ranks: tuple[int, ...]  # ranks that publish (every rank with a stage)
    stages: int
    samples_per_step: int
    minibatches_per_step: int
    across_pipeline: bool  # one global gradient norm (all but 1F1B-RR)
    peek: Callable[[str], str | None]  # name -> published string or None (Watchdog.peek)
    next_step: int = 1  # the first step not yet written
    _previous_end_ms: float = 0.0
    _previous_stage_end: dict[int, float] = field(default_factory=dict)
    _writer: SummaryWriter | None = None
    _lines: IO[str] | None = None

    def open(self, first_step: int) -> LiveLog:
        from torch.utils.tensorboard import SummaryWriter  # tensorboard's import is slow: only with --log-dir

        os.makedirs(self.directory, exist_ok=True)
        self.next_step = first_step + 1
        self._writer = SummaryWriter(self.directory)
        self._lines = open(os.path.join(self.directory, LOG_NAME), "a", encoding="utf-8")
        return self

    def poll(self) -> None:
        """Write every step whose records are all published (never waits)."""
        while True:
            records = self._records(self.next_step)
            if records is None:
                return
            self._write(self.next_step, records)
            self.next_step += 1

    def close(self, last_step: int, timeout_s: float) -> None:
        """Write the remaining steps up to ``last_step`` (waiting at most ``timeout_s``), then close."""
        deadline = time.monotonic() + timeout_s
        while self.next_step <= last_step and time.monotonic() < deadline:
            self.poll()
            if self.next_step <= last_step:
                time.sleep(0.01)
        assert self._writer is not None and self._lines is not None, "close() after open()"
        self._writer.close()
        self._lines.close()

    def _records(self, step: int) -> list[dict[str, Any]] | None:
        records = []
        for rank in self.ranks:
            text = self.peek(f"metrics/{step}/{rank}")
            if text is None:
                return None
            records.append(json.loads(text))
        return records

    def _write(self, step: int, records: list[dict[str, Any]]) -> None:
        assert self._writer is not None and self._lines is not None, "write after open()"
        losses = [r["loss_sum"] for r in records if r["loss_sum"] is not None]
        loss = sum(losses) / self.minibatches_per_step if losses else None
        lr = next((r["lr"] for r in records if r["lr"] is not None), None)
        firsts = {r["stage"]: r for r in records if r["replica"] == 0}
        end_ms = max(r["end_ms"] for r in records)
        elapsed_ms = end_ms - self._previous_end_ms
        self._previous_end_ms = end_ms
        stage_step_ms = []
        for s in range(self.stages):
            stage_step_ms.append(firsts[s]["end_ms"] - self._previous_stage_end.get(s, 0.0))
            self._previous_stage_end[s] = firsts[s]["end_ms"]
        squares = [r["grad_square"] for r in records]
        norm = math.sqrt(sum(squares)) if squares and None not in squares else None
        stage_squares = [firsts[s]["grad_square"] for s in range(self.stages)]
        norms = [math.sqrt(x) if x is not None else None for x in stage_squares]
        line: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": norm if self.across_pipeline else None,
            "samples_per_s": self.samples_per_step * 1000.0 / elapsed_ms if elapsed_ms > 0 else None,
            "stage_step_ms": stage_step_ms,
            "stage_compute_ms": [firsts[s]["compute_ms"] for s in range(self.stages)],
        }
        if not self.across_pipeline:
            line["stage_grad_norm"] = norms
        self._lines.write(json.dumps(line) + "\n")
        self._lines.flush()
        for name in ("loss", "lr", "grad_norm", "samples_per_s"):
            if line[name] is not None:
                self._writer.add_scalar(f"train/{name}", line[name], step)
        for s in range(self.stages):
            self._writer.add_scalar(f"stage{s}/step_ms", stage_step_ms[s], step)
            if line["stage_compute_ms"][s] is not None:
                self._writer.add_scalar(f"stage{s}/compute_ms", line["stage_compute_ms"][s], step)
            if not self.across_pipeline and norms[s] is not None:
                self._writer.add_scalar(f"stage{s}/grad_norm", norms[s], step)
        self._writer.flush()


def open_live_log(
    config: RunConfig,
    rank: int,
    spec: PipelineSpec,
    samples_per_step: int,
    period: int,
    across: bool,
    watchdog: Watchdog,
    done_steps: int,
) -> LiveLog | None:
    """Rank 0's ``--log-dir`` writer (None elsewhere or without the option)."""
    log_dir = config.outputs.log_dir
    if rank != 0 or log_dir is None or done_steps >= config.steps:
        return None
    ranks = tuple(sorted({r for stage_ranks in spec.ranks for r in stage_ranks}))
    return LiveLog(log_dir, ranks, spec.stages, samples_per_step, period, across, watchdog.peek).open(
        done_steps
    )


def publish_step(
    watchdog: Watchdog,
    executor: Executor,
    recorder: Recorder,
    spec: PipelineSpec,
    rank: int,
    step: int,
    period: int,
    published: dict[str, float],
) -> None:
    """This rank's share of step ``step`` (0-based) for rank 0's live log."""
    minibatches = range(step * period, (step + 1) * period)
    losses = [executor.losses[k] for k in minibatches if k in executor.losses]
    mine = [k for k in minibatches if k in executor.done_ms]
    last = mine[-1] if mine else None
    compute = recorder.live_compute_ms - published["compute_ms"]
    published["compute_ms"] = recorder.live_compute_ms
    record = step_record(
        spec.stage_index,
        spec.replica,
        end_ms=executor.done_ms[last] if last is not None else 0.0,
        compute_ms=None if recorder.cuda else compute,
        loss_sum=sum(losses) if losses else None,
        lr=executor.lrs.get(last) if last is not None else None,
        grad_square=executor.grad_squares.get(last) if last is not None else None,
    )
    watchdog.publish(f"metrics/{step + 1}/{rank}", record)
