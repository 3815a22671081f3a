"""No hangs: a watchdog that notices a dead or stopped rank or store and ends this one.

Every rank runs a ``Watchdog`` over its own clients of the rendezvous store
(``MASTER_ADDR:MASTER_PORT``; under torchrun that is the agent's store):

- a *beat* thread bumps a heartbeat counter ``pipeplan/hb/<rank>`` every ``interval_s``
  and reads the others' counters and the ``pipeplan/failed`` key;
- a rank that raises writes ``pipeplan/failed`` = "<rank>|<message>" (``report``);
- a *guard* thread, which never touches the store, ends the process when the beat
  thread's last answered round, or a store call of the main thread (``publish``,
  ``peek``, ``report``), is older than ``store_timeout_s``: a SIGSTOPped store host
  (the torchrun agent, or rank 0 when it hosts the store) answers nothing and a TCPStore
  client call does not time out on its own, so only a clock outside the call bounds it;
- a counter that has not moved for ``heartbeat_timeout_s`` means that rank died or was
  stopped (SIGKILL, SIGSTOP, os._exit, a lost host), and a ``pipeplan/failed`` key means
  a rank raised.

Whatever fails, this process prints one ``error:`` line naming it and exits with code 2
(``os._exit``, since the main thread may be blocked inside a collective). The beat thread
and the main thread use separate store clients, so neither ever waits for a lock the
other holds while inside a store call. ``deadline`` bounds any other blocking call
(process-group start-up, the final barrier) the same way.

Counters, not clocks, so hosts need no synchronised time. With the bounded p2p waits
(``pipeplan.runtime.comm``) and the process-group timeout, every surviving rank exits
non-zero within ``max(heartbeat_timeout_s, store_timeout_s) + interval_s`` of a peer's
or the store's death (21 s by default).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from pipeplan.errors import RuntimeFailure, first_line

if TYPE_CHECKING:  # torch.distributed is imported where a store is made: the watchdog module stays light
    from torch.distributed import TCPStore

__all__ = ["Watchdog", "HEARTBEAT_TIMEOUT_S", "deadline", "exit_now"]

HEARTBEAT_TIMEOUT_S = 20.0
_FAILED_KEY = "pipeplan/failed"
T = TypeVar("T")


def exit_now(message: str) -> None:
    """Print ``error: message`` and end the process with code 2, whatever threads hold."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(2)


@contextlib.contextmanager
def deadline(seconds: float, message: str, on_expiry: Callable[[str], None] = exit_now) -> Iterator[None]:
    """Run the block; if it has not finished after ``seconds`` s, ``on_expiry(message)``."""
    timer = threading.Timer(seconds, on_expiry, args=(message,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _brief(exc: BaseException) -> str:
    return first_line(exc)[:120]


def _connect(host: str, port: int, timeout_s: float) -> TCPStore:
    import torch.distributed as dist

    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def _bounded(call: Callable[[], T], seconds: float, what: str) -> T:
    """``call()`` in a helper thread; ``RuntimeFailure`` naming ``what`` if it takes > ``seconds``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name="pipeplan-bounded", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise RuntimeFailure(f"{what}: no answer within {seconds:.0f} s")
    if "error" in box:
        raise RuntimeFailure(f"{what}: {_brief(box['error'])}") from box["error"]
    return box["value"]


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
        on_failure: Callable[[str], None] = exit_now,
        store_timeout_s: float | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.store_timeout_s = heartbeat_timeout_s if store_timeout_s is None else store_timeout_s
        self._where = f"{host}:{port}"
        self._on_failure = on_failure
        self._prefix = prefix
        what = f"rank {rank}: cannot reach the rendezvous store at {self._where}"
        self._beat_store = _bounded(
            lambda: _connect(host, port, self.store_timeout_s), self.store_timeout_s, what
        )
        self._main_store = _bounded(
            lambda: _connect(host, port, self.store_timeout_s), self.store_timeout_s, what
        )
        self._main_lock = threading.Lock()  # main-thread callers only; the beat thread never takes it
        self._main_since: float | None = None  # when the main thread's store call began
        self._last_answer = time.monotonic()
        self._stop = threading.Event()
        self._failed = threading.Event()
        self._threads: list[threading.Thread] = []

    def _key(self, name: str) -> str:
        return f"{self._prefix}{name}"

    def start(self) -> Watchdog:
        self._last_answer = time.monotonic()
        for target, name in ((self._beat, "pipeplan-heartbeat"), (self._guard, "pipeplan-watchdog")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop both threads (waits at most ``interval_s`` + 1 s; a blocked beat is left behind)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.interval_s + 1.0)

    def _fail(self, message: str) -> None:
        if self._stop.is_set() or self._failed.is_set():
            return
        self._failed.set()
        self._on_failure(message)

    @contextlib.contextmanager
    def _main_call(self) -> Iterator[TCPStore]:
        """The main thread's store client, with the guard timing the call."""
        with self._main_lock:
            self._main_since = time.monotonic()
            try:
                yield self._main_store
            finally:
                self._main_since = None

    def report(self, message: str, rank: int | None = None) -> None:
        """Tell every rank that ``rank`` (default: this one) failed; best effort, never raises.

        Only the first report is kept, so the root cause wins over its echoes.
        """
        culprit = self.rank if rank is None else rank
        try:
            with self._main_call() as store:
                # compare_set writes only when the key is absent: no race between reporters
                store.compare_set(self._key(_FAILED_KEY), "", f"{culprit}|{message}")
        except Exception:
            pass

    def publish(self, name: str, value: str) -> None:
        """Store a small value for other ranks (e.g. the newest loss for rank 0's progress)."""
        with self._main_call() as store:
            store.set(self._key(f"pipeplan/{name}"), value)

    def peek(self, name: str) -> str | None:
        """A published value, or None when it is not there yet (never waits for a key)."""
        key = self._key(f"pipeplan/{name}")
        with self._main_call() as store:
            if not store.check([key]):
                return None
            return store.get(key).decode()

    def failed_rank(self) -> tuple[int, str] | None:
        """(rank, message) of the first rank that reported a failure, if any."""
        try:
            with self._main_call() as store:
                if not store.check([self._key(_FAILED_KEY)]):
                    return None
                text = store.get(self._key(_FAILED_KEY)).decode()
        except Exception:
            return None
        rank, _, message = text.partition("|")
        return int(rank), message

    def _guard(self) -> None:
        """Never touches the store: ends the process when a store call is overdue."""
        while not self._stop.wait(min(self.interval_s, 1.0)):
            now = time.monotonic()
            started = self._main_since
            silent = max(now - self._last_answer, now - started if started is not None else 0.0)
            if silent > self.store_timeout_s:
                self._fail(
                    f"rank {self.rank}: the rendezvous store at {self._where} (rank 0 or the "
                    f"torchrun agent) has not answered for {silent:.0f} s"
                )
                return

    def _beat(self) -> None:
        store = self._beat_store
        last_value = [-1] * self.world_size
        last_change = [time.monotonic()] * self.world_size
        while not self._stop.wait(self.interval_s):
            try:
                store.add(self._key(f"pipeplan/hb/{self.rank}"), 1)
                values = [store.add(self._key(f"pipeplan/hb/{r}"), 0) for r in range(self.world_size)]
                failed = store.check([self._key(_FAILED_KEY)])
                text = store.get(self._key(_FAILED_KEY)).decode() if failed else ""
            except Exception as exc:
                self._fail(
                    f"rank {self.rank}: lost the rendezvous store at {self._where} (hosted by "
                    f"rank 0 or the torchrun agent): {_brief(exc)}"
                )
                return
            now = time.monotonic()
            self._last_answer = now
            if text:
                rank, _, message = text.partition("|")
                if not message.startswith(f"rank {self.rank}:"):  # not our own report
                    self._fail(f"rank {self.rank} stops because rank {rank} failed: {message}")
                    return
            for other, value in enumerate(values):
                if value != last_value[other]:
                    last_value[other], last_change[other] = value, now
                elif other != self.rank and now - last_change[other] > self.heartbeat_timeout_s:
                    self._fail(
                        f"rank {self.rank} stops because rank {other} died or stopped "
                        f"(no heartbeat for {now - last_change[other]:.0f} s)"
                    )
                    return
