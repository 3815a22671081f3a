"""Rank 0's live progress line (``--no-progress`` turns it off): step, newest loss, samples/s.

The loss stage publishes each minibatch's loss in the run's store (``Watchdog.publish``);
rank 0 peeks at them after each of its steps, so the line never waits for anyone.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: rich is imported where a line is shown
    from rich.progress import Progress, TaskID

    from pipeplan.runtime.config import RunConfig
    from pipeplan.runtime.failure import Watchdog

__all__ = ["ProgressLine"]


class ProgressLine:
    """Rank 0's live progress line: step, newest loss, samples/s."""

    def __init__(
        self,
        rank: int,
        config: RunConfig,
        samples_per_step: int,
        watchdog: Watchdog,
        first_step: int,
        first_minibatch: int,
    ) -> None:
        self.enabled = rank == 0 and config.outputs.progress
        self.samples_per_step = samples_per_step
        self.watchdog = watchdog
        self.total = config.steps
        self.first_step = first_step
        self.loss = float("nan")
        self._next_loss = first_minibatch
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._start = 0.0

    def start(self) -> None:
        if not self.enabled:
            return
        # rich only where a line is shown: its import is not free
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} samples/s"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self._task = self._bar.add_task(
            "train", total=self.total, completed=self.first_step, loss="-", rate="-"
        )
        self._bar.start()
        self._start = time.perf_counter()

    def update(self, completed: int) -> None:
        if not self.enabled or self._bar is None or self._task is None:
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
