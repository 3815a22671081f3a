"""Timers and robust statistics for the profiler.

On a GPU a timer records CUDA events around the work and synchronises on the end event,
so it measures device time, not launch time; on the CPU it reads ``time.perf_counter``
(the work is synchronous, so no synchronisation is needed). Times are milliseconds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

__all__ = ["Timer", "CpuTimer", "CudaTimer", "make_timer", "Stats", "robust_stats"]


class Timer(Protocol):
    def start(self) -> None: ...

    def stop(self) -> float:
        """Milliseconds since ``start()``, after the device finished the work."""
        ...


class CpuTimer:
    """Wall-clock timer (``time.perf_counter``), in ms."""

    def __init__(self) -> None:
        self._begin = 0.0

    def start(self) -> None:
        self._begin = time.perf_counter()

    def stop(self) -> float:
        return (time.perf_counter() - self._begin) * 1e3


class CudaTimer:
    """CUDA-event timer on the current stream of ``device``, in ms (synchronises on stop)."""

    def __init__(self, device: Any) -> None:
        import torch

        self._device = device
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        import torch

        self._begin.record(torch.cuda.current_stream(self._device))

    def stop(self) -> float:
        import torch

        self._end.record(torch.cuda.current_stream(self._device))
        self._end.synchronize()
        return float(self._begin.elapsed_time(self._end))


def make_timer(device: Any) -> Timer:
    """A ``CudaTimer`` for a CUDA ``torch.device``, else a ``CpuTimer``."""
    if getattr(device, "type", str(device)) == "cuda":
        return CudaTimer(device)
    return CpuTimer()


@dataclass(frozen=True)
class Stats:
    median: float  # ms
    spread: float  # interquartile range p75 - p25, ms

    @classmethod
    def zero(cls) -> "Stats":
        return cls(0.0, 0.0)


def robust_stats(samples: Sequence[float]) -> Stats:
    """Median and interquartile range (p75 - p25) of ``samples``.

    >>> robust_stats([1.0, 2.0, 3.0, 4.0, 100.0])
    Stats(median=3.0, spread=2.0)
    >>> robust_stats([5.0])
    Stats(median=5.0, spread=0.0)
    """
    if not samples:
        raise ValueError("robust_stats needs at least one sample")
    values = sorted(float(value) for value in samples)
    if len(values) == 1:
        return Stats(values[0], 0.0)
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return Stats(statistics.median(values), quartiles[2] - quartiles[0])
