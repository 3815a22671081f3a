"""Two-phase checkpoints of one rank (CheckFreq): a snapshot while training waits, a persist behind it.

- *Snapshot*: DCP's ``DefaultStager`` copies the rank's state into host memory (pinned
  on CUDA; its buffers are kept and reused from one checkpoint to the next). Training
  waits for this copy only.
- *Persist*: ``torch.distributed.checkpoint.async_save`` writes the copy from its own
  thread while the next steps train; when the write is done, the same thread seals the
  folder (``store.seal_rank``: sizes and sha256 of its files, the manifest written last).

At most one persist is in flight per rank: the next snapshot first waits for it, and that
wait is counted in the stall (``CheckpointCost.wait_ms``). A step is complete only when
every rank's manifest exists and verifies (``pipeplan.runtime.checkpoint.store``), so a
rank that dies mid-persist leaves its folder unsealed and ``--resume`` takes the previous
complete step, naming the torn one.

The persist needs no collective: each rank's folder is a DCP checkpoint of its own
(``no_dist=True``), so the background thread never joins the training's process groups
and cannot race their collectives. ``async_save`` only checks that the group it is given
has a CPU backend; a run whose default group is NCCL passes a gloo group (``cpu_group``).

Synchronous saves (``asynchronous=False``) go through the same object, so both are
measured alike: there the stall is the whole write and seal.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeplan.errors import RuntimeFailure, first_line

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import DefaultStager

__all__ = ["CheckpointCost", "Persister", "PERSIST_DELAY_ENV"]

PERSIST_DELAY_ENV = "PIPEPLAN_TEST_PERSIST_DELAY"  # tests only: "<rank>:<step>:<seconds>"
Seal = Callable[[], int]  # writes the manifest of a written folder; returns the bytes it seals


@dataclass
class CheckpointCost:
    """What one rank's checkpoints cost over a run (totals; milliseconds and bytes)."""

    checkpoints: int = 0
    stall_ms: float = 0.0  # training blocked: the wait for the previous persist, then the snapshot
    wait_ms: float = 0.0  # of the stall: waiting for the previous persist to finish
    persist_ms: float = 0.0  # writing and sealing (behind training when asynchronous)
    bytes_written: int = 0
    last_snapshot_ms: float = 0.0  # the latest checkpoint's stall less its wait
    last_persist_ms: float | None = None  # the latest finished persist (None: none yet)


@dataclass
class _InFlight:
    step: int
    sealed: Future[int]  # the bytes sealed, once the write and the seal are done


class Persister:
    """Saves this rank's checkpoints, at most one persist in flight, and measures them."""

    def __init__(
        self, rank: int, asynchronous: bool, cpu_group: dist.ProcessGroup | None = None, pinned: bool = False
    ) -> None:
        self.rank = rank
        self.asynchronous = asynchronous
        self.cost = CheckpointCost()
        self._group = cpu_group
        self._pinned = pinned
        self._stager: DefaultStager | None = None
        self._in_flight: _InFlight | None = None
        self._delay = _delay_hook(rank)

    def save(self, folder: Path, step: int, state: dict[str, Any], seal: Seal) -> None:
        """Checkpoint ``state`` (flat, str keys) of ``step`` into ``folder``, then ``seal`` it.

        Returns once the snapshot is taken (asynchronous) or the folder is sealed.
        """
        started = time.perf_counter()
        waited_ms = self.wait()
        snapshot_at = time.perf_counter()
        if self.asynchronous:
            self._in_flight = _InFlight(step, self._persist_async(folder, step, state, seal))
        else:
            self._write(folder, step, state)
            self._finished(seal(), snapshot_at)
        now = time.perf_counter()
        self.cost.checkpoints += 1
        self.cost.stall_ms += (now - started) * 1000.0
        self.cost.wait_ms += waited_ms
        self.cost.last_snapshot_ms = (now - snapshot_at) * 1000.0

    def busy(self) -> bool:
        """True while a persist is in flight (written or sealed behind training)."""
        return self._in_flight is not None and not self._in_flight.sealed.done()

    def wait(self) -> float:
        """Wait for the persist in flight (if any); returns the milliseconds waited.

        A persist that failed is a ``RuntimeFailure`` naming the step.
        """
        if self._in_flight is None:
            return 0.0
        started = time.perf_counter()
        flight, self._in_flight = self._in_flight, None
        try:
            flight.sealed.result()
        except Exception as exc:
            raise RuntimeFailure(
                f"rank {self.rank}: the checkpoint of step {flight.step} could not be written: "
                f"{type(exc).__name__}: {first_line(exc)[:160]}"
            ) from exc
        return (time.perf_counter() - started) * 1000.0

    def close(self) -> float:
        """Wait for the last persist and release the staging buffers; returns the ms waited."""
        waited = self.wait()
        self.cost.stall_ms += waited
        self.cost.wait_ms += waited
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        return waited

    def _persist_async(self, folder: Path, step: int, state: dict[str, Any], seal: Seal) -> Future[int]:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "experimental", "a single process": intended
            upload = dcp.async_save(
                state,
                storage_writer=dcp.FileSystemWriter(str(folder)),
                async_stager=self._staging(),
                process_group=self._group,
                no_dist=True,
            )
        if not isinstance(upload, Future):  # AsyncSaveResponse: only with asynchronous staging
            upload = upload.upload_completion
        sealed: Future[int] = Future()
        snapshot_at = time.perf_counter()

        def after_write(done: Future[Any]) -> None:  # on DCP's writer thread
            try:
                done.result()
                self._delay(step)
                written = seal()
                self._finished(written, snapshot_at)
                sealed.set_result(written)
            except BaseException as exc:  # handed to the training thread by ``wait``
                sealed.set_exception(exc)

        upload.add_done_callback(after_write)
        return sealed

    def _write(self, folder: Path, step: int, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": intended
            try:
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
            except OSError as exc:
                raise RuntimeFailure(
                    f"rank {self.rank}: cannot write checkpoint {folder}: {exc.strerror or exc}"
                ) from exc
        self._delay(step)

    def _finished(self, written: int, snapshot_at: float) -> None:
        persist_ms = (time.perf_counter() - snapshot_at) * 1000.0
        self.cost.persist_ms += persist_ms
        self.cost.last_persist_ms = persist_ms
        self.cost.bytes_written += written

    def _staging(self) -> DefaultStager:
        """One stager for the run: its host copies are reused by every snapshot (same shapes)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            # synchronous staging: the snapshot is complete when async_save returns
            self._stager = DefaultStager(StagingOptions(self._pinned, False, False, False))
        return self._stager


def _delay_hook(rank: int) -> Callable[[int], None]:
    """Tests only: ``PIPEPLAN_TEST_PERSIST_DELAY=<rank>:<step>:<seconds>`` holds that rank's
    persist of that step between its write and its seal (a crash then tears the step)."""
    spec = os.environ.get(PERSIST_DELAY_ENV, "")
    if not spec:
        return lambda step: None
    target, at, seconds = spec.split(":")

    def delay(step: int) -> None:
        if int(target) == rank and step == int(at):
            time.sleep(float(seconds))

    return delay
