"""When a rank checkpoints during ``pipeplan run``, and what its checkpoints cost.

``--checkpoint-every N`` checkpoints every N steps and the final step;
``--checkpoint-every auto`` checkpoints after the first step, then at the interval
``pipeplan.runtime.checkpoint.frequency`` chooses from the latest measurements (snapshot
stall, persist time, step time), agreed over the ranks (their maximum, an all-reduce over
the run's checkpoint group) so every rank saves the same steps. Rank 0 prints the
interval and the overhead it predicts whenever the interval changes.

``--checkpoint-async`` takes two-phase saves (``pipeplan.runtime.checkpoint.persist``).
The costs (stall, wait, persist, bytes) are kept in the ``Persister``'s ``CheckpointCost``
and reported per rank in metrics.json.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipeplan.runtime import training_state as state
from pipeplan.runtime.checkpoint.frequency import AutoInterval
from pipeplan.runtime.checkpoint.persist import Persister
from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.run_identity import RunIdentity
from pipeplan.runtime.stage import PipelineSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler

__all__ = ["Checkpointer", "process_age_ms"]


@dataclass
class Checkpointer:
    """One rank's checkpoints: which steps, the save, the measurements ``auto`` chooses from."""

    config: RunConfig
    spec: PipelineSpec
    rank: int
    identity: RunIdentity
    layout: state.Layout
    module: nn.Module | None
    optimizer: Optimizer | None
    scheduler: LRScheduler | None
    tensor_mesh: DeviceMesh | None
    group: dist.ProcessGroup | None  # gloo, every rank with a stage (auto's agreement, async_save)
    done_steps: int  # the step the run starts after (a resume's)
    loader_state: Callable[[int], dict[str, Any]] | None = None  # step -> this rank's loader keys
    persister: Persister = field(init=False)
    auto: AutoInterval | None = field(init=False)
    _since: float = field(init=False)  # perf_counter at the last checkpoint's end (or the start)
    _since_step: int = field(init=False)
    _step_began: float = field(init=False)  # perf_counter when the current step began
    _beside_persist: bool = field(init=False)  # a persist was in flight when the current step began
    _clean_ms: float | None = field(init=False)  # a step without a persist beside it (running mean)
    _beside_ms: list[float] = field(init=False)  # steps run beside a persist since the last choice

    def __post_init__(self) -> None:
        checkpoints = self.config.checkpoints
        on_gpu = self.module is not None and any(p.is_cuda for p in self.module.parameters())
        self.persister = Persister(self.rank, checkpoints.asynchronous, self.group, pinned=on_gpu)
        self.auto = None
        if checkpoints.directory:  # imported now, not inside the first checkpoint's measured stall
            import torch.distributed.checkpoint  # noqa: F401
        if checkpoints.directory and checkpoints.interval is None:
            self.auto = AutoInterval(checkpoints.overhead_pct, next_step=self.done_steps + 1)
        self.start()

    @property
    def every(self) -> int | None:
        """The interval in steps (auto's latest choice); None without checkpoints."""
        if not self.config.checkpoints.directory:
            return None
        return self.auto.every if self.auto is not None else self.config.checkpoints.interval

    def start(self) -> None:
        """The training clock starts now (step times are measured from here)."""
        self._since, self._since_step = time.perf_counter(), self.done_steps
        self._step_began, self._beside_persist = self._since, False
        self._clean_ms, self._beside_ms = None, []

    def at_step_end(self, completed: int) -> None:
        """Checkpoint step ``completed`` when it is due (the final step always)."""
        checkpoints = self.config.checkpoints
        if not checkpoints.directory:
            return
        self._time_step()
        try:
            self._checkpoint_if_due(completed)
        finally:
            self._step_began, self._beside_persist = time.perf_counter(), self.persister.busy()

    def _time_step(self) -> None:
        """Time the step that just ended: beside a persist, or clean (a running mean)."""
        step_ms = (time.perf_counter() - self._step_began) * 1000.0
        if self._beside_persist:
            self._beside_ms.append(step_ms)
        else:
            self._clean_ms = step_ms if self._clean_ms is None else (self._clean_ms + step_ms) / 2.0

    def _checkpoint_if_due(self, completed: int) -> None:
        checkpoints = self.config.checkpoints
        final = completed == self.config.steps
        every = checkpoints.interval
        due = self.auto.due(completed) if self.auto is not None else bool(every) and completed % every == 0
        if not (due or final):
            return
        began = time.perf_counter()
        state.save(
            self.config,
            self.spec,
            self.module,
            self.optimizer,
            completed,
            self.identity,
            self.layout,
            self.persister,
            self.scheduler,
            self.tensor_mesh,
            self.loader_state(completed) if self.loader_state is not None else None,
        )
        if self.auto is not None and not final:
            steps = max(completed - self._since_step, 1)
            self._choose(completed, (began - self._since) * 1000.0 / steps)
        self._since, self._since_step = time.perf_counter(), completed

    def finish(self) -> None:
        """Wait for the last persist (its wait counts in the stall) and free the staging copies."""
        self.persister.close()

    def _choose(self, completed: int, step_ms: float) -> None:
        """Auto: agree on the measurements (the most any rank saw), then choose the interval.

        The step time is a step's without a persist beside it when one was seen (else the
        mean since the last checkpoint); the interference is what the steps run beside the
        last persist took over that.
        """
        cost = self.persister.cost
        persist_ms = (cost.last_persist_ms or 0.0) if self.persister.asynchronous else 0.0
        clean_ms = self._clean_ms if self._clean_ms is not None else step_ms
        interference_ms = sum(max(0.0, beside - clean_ms) for beside in self._beside_ms)
        self._beside_ms = []
        measured = torch.tensor(
            [clean_ms, cost.last_snapshot_ms, persist_ms, interference_ms], dtype=torch.float64
        )
        if self.group is not None:
            dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self.group)
        step, snapshot, persist, interference = (float(x) for x in measured.tolist())
        assert self.auto is not None, "only auto chooses"
        if self.auto.update(completed, step, snapshot, persist, interference) and self.rank == 0:
            sys.stderr.write(
                f"checkpoint: every {self.auto.every} steps (auto), predicted overhead "
                f"{self.auto.predicted_overhead_pct:.2f}% (step {step:.1f} ms, snapshot "
                f"{snapshot:.1f} ms, persist {persist:.1f} ms, slowing training by "
                f"{interference:.1f} ms; target {self.auto.target_pct:g}%)\n"
            )


def process_age_ms() -> float | None:
    """Milliseconds since this process started (Linux ``/proc``; None elsewhere): the
    restart-to-first-step time counts the interpreter's start and imports too."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        uptime_s = float(open("/proc/uptime").read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in ticks
    return (uptime_s - started_s) * 1000.0
