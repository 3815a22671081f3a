"""Per-rank timings: totals per category (for metrics) and trace events (for --trace).

Categories are those of ``pipeplan.trace``: forward, backward, step (compute, tid 0) and
send, recv, allreduce (communication, tid 1). Times are milliseconds relative to
``t0_ms`` (``time.perf_counter`` after the start barrier, so ranks share an origin to
within the barrier's skew). On a CUDA device compute spans are timed with CUDA events
(resolved in ``finish``); communication waits are host wall time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pipeplan.trace import TraceEvent

__all__ = ["Recorder", "now_ms"]

_COMPUTE = ("forward", "backward", "step")


def now_ms() -> float:
    return time.perf_counter() * 1000.0


@dataclass
class Recorder:
    rank: int
    stage: int
    replica: int
    trace: bool  # keep every event (for --trace), not just the totals
    cuda: bool = False
    # Spans of global minibatches before this one are warm-up (CUDA/allocator start-up,
    # pipeline fill): traced, but left out of ``totals_ms``.
    count_from: int = 0
    t0_ms: float = field(default_factory=now_ms)
    totals_ms: dict[str, float] = field(default_factory=dict)
    live_compute_ms: float = 0.0  # every host-timed compute span, warm-up included (live metrics)
    events: list[TraceEvent] = field(default_factory=list)
    _cuda_spans: list[tuple[str, str, Any, Any, int, int]] = field(default_factory=list)
    _cuda_origin: Any = None

    def start(self) -> None:
        """Reset the clock origin (call right after the start barrier)."""
        self.t0_ms = now_ms()
        if self.cuda:
            import torch

            self._cuda_origin = torch.cuda.Event(enable_timing=True)
            self._cuda_origin.record()

    @contextmanager
    def span(self, category: str, name: str, minibatch: int = -1, microbatch: int = 0) -> Iterator[None]:
        if self.cuda and category in _COMPUTE:
            import torch

            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self._cuda_spans.append((category, name, begin, end, minibatch, microbatch))
            return
        start = now_ms()
        yield
        self.add(category, name, start, now_ms(), minibatch, microbatch)

    def add(
        self,
        category: str,
        name: str,
        start_ms: float,
        end_ms: float,
        minibatch: int = -1,
        microbatch: int = 0,
        message: tuple[int, int] = (-1, -1),
    ) -> None:
        """Record a span given in absolute ``now_ms`` times; a send's or a receive's
        ``message`` is (bytes, values it carries)."""
        duration = max(0.0, end_ms - start_ms)
        if category in _COMPUTE:
            self.live_compute_ms += duration
        if minibatch < 0 or minibatch >= self.count_from:
            self.totals_ms[category] = self.totals_ms.get(category, 0.0) + duration
        if self.trace:
            self.events.append(
                TraceEvent(
                    name,
                    category,
                    start_ms - self.t0_ms,
                    duration,
                    self.rank,
                    minibatch,
                    microbatch,
                    self.stage,
                    self.replica,
                    *message,
                )
            )

    def finish(self) -> None:
        """Resolve CUDA-timed spans (synchronises the device once)."""
        if not self._cuda_spans:
            return
        import torch

        torch.cuda.synchronize()
        for category, name, begin, end, minibatch, microbatch in self._cuda_spans:
            start = self._cuda_origin.elapsed_time(begin) + self.t0_ms
            self.add(category, name, start, start + begin.elapsed_time(end), minibatch, microbatch)
        self._cuda_spans.clear()

    def total(self, *categories: str) -> float:
        return sum(self.totals_ms.get(c, 0.0) for c in categories)
