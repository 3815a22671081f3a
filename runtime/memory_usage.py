"""What a rank's memory is: a baseline before its stage is built, and its peak over the run.

On the CPU both are the process's resident set (RSS) as the OS counts it: the baseline is
the RSS when the meter starts (torch, pipeplan and the model file imported, nothing
built), the peak is the high-water mark ``VmHWM`` of /proc/self/status, which the meter
first resets to the current RSS (``/proc/self/clear_refs``, Linux >= 4.0) so the peak is
the run's, not the imports'. Not ``getrusage``'s ``ru_maxrss``: Linux carries into it the
RSS of the process that forked this one (measured: a child started from a parent holding
763 MiB reports 982 MiB for a bare ``python -c pass``), which is what made bench_memory's
earlier per-rank peaks read high; it is used only where /proc is absent. On a GPU both
are ``torch.cuda`` allocator figures for the rank's device: ``memory_allocated`` at the
start, ``max_memory_allocated`` since (peak statistics reset at the start), so what the
allocator caches but no tensor holds is not counted. ``held = peak - baseline`` is what
the plan's per-device figure (``StagePlan.memory_bytes``) predicts.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

from pipeplan.metrics import MEMORY_KINDS

__all__ = ["MemoryReading", "MemoryMeter", "current_rss_bytes", "peak_rss_bytes"]

RSS, CUDA_ALLOCATED = MEMORY_KINDS  # MemoryReading.kind on the CPU, on a GPU


@dataclass(frozen=True)
class MemoryReading:
    kind: str  # RSS | CUDA_ALLOCATED
    baseline_bytes: int  # before the stage was built
    peak_bytes: int  # the most at any moment since

    @property
    def held_bytes(self) -> int:
        return self.peak_bytes - self.baseline_bytes


def current_rss_bytes() -> int:
    """This process's resident set now (``VmRSS``), in bytes; the peak where /proc is absent."""
    value = _status_kib("VmRSS")
    return value * 1024 if value is not None else _max_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (``VmHWM``), in bytes; ``ru_maxrss`` without /proc."""
    value = _status_kib("VmHWM")
    return value * 1024 if value is not None else _max_rss_bytes()


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current RSS (Linux ``clear_refs`` 5); True if it took."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class MemoryMeter:
    """Started before the stage is built; ``read()`` at the end of the run."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.device = device
        if self.cuda:
            import torch

            torch.cuda.init()  # the allocator's statistics exist once CUDA is initialised (torch 2.11 raised before)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = int(torch.cuda.memory_allocated(device))
        else:
            reset_peak_rss()
            self.baseline = current_rss_bytes()

    def read(self) -> MemoryReading:
        if self.cuda:
            import torch

            peak = int(torch.cuda.max_memory_allocated(self.device))
            return MemoryReading(CUDA_ALLOCATED, self.baseline, max(peak, self.baseline))
        return MemoryReading(RSS, self.baseline, max(peak_rss_bytes(), self.baseline))


def _max_rss_bytes() -> int:
    """``getrusage``'s peak (Linux gives KiB, macOS bytes): where /proc cannot be read."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _status_kib(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status (e.g. VmRSS); None where it cannot be read."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
