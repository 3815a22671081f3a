"""No hangs: a watchdog thread that notices a dead or failed rank and ends this one.

Every rank runs a ``Watchdog`` over its own client of the rendezvous store
(``MASTER_ADDR:MASTER_PORT``; under torchrun that is the agent's store):

- it bumps a heartbeat counter ``pipeplan/hb/<rank>`` every ``interval_s``;
- a rank that raises writes ``pipeplan/failed`` = "<rank>|<message>" (``report``);
- it reads the others' counters; a counter that has not moved for
  ``heartbeat_timeout_s`` (default 20 s) means that rank died (SIGKILL, os._exit, a lost
  host), and a ``pipeplan/failed`` key means a rank raised. Either way this process
  prints one ``error:`` line naming the failed rank and exits with code 2 (``os._exit``,
  since the main thread may be blocked inside a collective).

Counters, not clocks, so hosts need no synchronised time. Together with the bounded
p2p waits (``pipeplan.runtime.comm``) and the process-group timeout, every surviving rank
exits non-zero well within 60 s of a peer's death.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

__all__ = ["Watchdog", "HEARTBEAT_TIMEOUT_S"]

HEARTBEAT_TIMEOUT_S = 20.0
_FAILED_KEY = "pipeplan/failed"


def _exit_now(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(2)


class Watchdog:
    """Heartbeat + failure broadcast over the rendezvous store (see module docstring)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        prefix: str = "",
        interval_s: float = 1.0,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        on_failure: Callable[[str], None] = _exit_now,
    ) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._on_failure = on_failure
        self._prefix = prefix
        self._store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=heartbeat_timeout_s),
            wait_for_workers=False,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _key(self, name: str) -> str:
        return f"{self._prefix}{name}"

    def start(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._loop, name="pipeplan-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def report(self, message: str, rank: int | None = None) -> None:
        """Tell every rank that ``rank`` (default: this one) failed; best effort, never raises.

        Only the first report is kept, so the root cause wins over its echoes.
        """
        culprit = self.rank if rank is None else rank
        try:
            with self._lock:
                if not self._store.check([self._key(_FAILED_KEY)]):
                    self._store.set(self._key(_FAILED_KEY), f"{culprit}|{message}")
        except Exception:
            pass

    def publish(self, name: str, value: str) -> None:
        """Store a small value for other ranks (e.g. the newest loss for rank 0's progress)."""
        with self._lock:
            self._store.set(self._key(f"pipeplan/{name}"), value)

    def peek(self, name: str) -> str | None:
        """A published value, or None when it is not there yet (never blocks)."""
        with self._lock:
            key = self._key(f"pipeplan/{name}")
            if not self._store.check([key]):
                return None
            return self._store.get(key).decode()

    def failed_rank(self) -> tuple[int, str] | None:
        """(rank, message) of the first rank that reported a failure, if any."""
        try:
            with self._lock:
                if not self._store.check([self._key(_FAILED_KEY)]):
                    return None
                text = self._store.get(self._key(_FAILED_KEY)).decode()
        except Exception:
            return None
        rank, _, message = text.partition("|")
        return int(rank), message

    def _loop(self) -> None:
        last_value = [-1] * self.world_size
        last_change = [time.monotonic()] * self.world_size
        while not self._stop.wait(self.interval_s):
            try:
                with self._lock:
                    self._store.add(self._key(f"pipeplan/hb/{self.rank}"), 1)
                    values = [
                        self._store.add(self._key(f"pipeplan/hb/{r}"), 0) for r in range(self.world_size)
                    ]
                    failed = self._store.check([self._key(_FAILED_KEY)])
                    text = self._store.get(self._key(_FAILED_KEY)).decode() if failed else ""
            except Exception as exc:
                if self._stop.is_set():
                    return
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                self._on_failure(
                    f"rank {self.rank}: lost the rendezvous store (hosted by rank 0 or the "
                    f"torchrun agent): {reason[:120]}"
                )
                return
            if text:
                rank, _, message = text.partition("|")
                if not message.startswith(f"rank {self.rank}:"):  # not our own report
                    self._on_failure(f"rank {self.rank} stops because rank {rank} failed: {message}")
                    return
            now = time.monotonic()
            for other, value in enumerate(values):
                if value != last_value[other]:
                    last_value[other], last_change[other] = value, now
                elif other != self.rank and now - last_change[other] > self.heartbeat_timeout_s:
                    self._on_failure(
                        f"rank {self.rank} stops because rank {other} died "
                        f"(no heartbeat for {now - last_change[other]:.0f} s)"
                    )
                    return
