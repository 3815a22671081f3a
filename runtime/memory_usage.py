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

On the CPU the process's first training step adds to its RSS what no model holds: the
kernels' code pages, the autograd engine's thread, the allocator's arenas (measured: 40
MiB on torch 2.13 for a step of an 8-unit MLP, which is 2.4x the bundled MLP's 16 MiB of
parameters). ``warm_up`` runs such a step on a tiny model before the baseline is taken,
and ``MemoryMeter`` records what it added as ``overhead_bytes``: the fixed part, shown
apart, in the baseline. On a GPU the same step runs on the rank's device: cuBLAS keeps a
workspace per handle and stream from the allocator once a first matmul ran (tens of MiB
on Hopper), which ``memory_allocated`` counts though no stage holds it. Just before its first step a rank holds, besides its stage's
parameters and buffers, what the runtime set up: the rest of a model built whole and
split, the minibatches drawn ahead (``runtime/data.py``), communication buffers. ``steps_begin``
records that as ``setup_bytes`` (the RSS then, less the baseline and the stage's tensor
bytes), so that ``held = peak - baseline - setup`` is the stage's own.

RSS still reads above the tensors a stage holds: glibc keeps freed memory for reuse, and the
high-water mark falls wherever the heap was largest (the demo's stage 1 read 1.22-1.39x its
plan by RSS, 1.03x by its tensors). So on the CPU the meter can also count the bytes of live
tensors (``pipeplan.profiler.live_bytes``, the profiler's own counter) from the first step
over the first steps (``stop_counting``), beside the stage's parameters and buffers; what
the set-up made before is not counted. The counter costs a Python call per operator
(measured: 6.6 us, 2.6x a tiny Llama's step), so it counts over a window only, which the
timings leave out, and never while the stage is built (torch.export cannot capture under
it). The stage's bytes plus the most bytes of new tensors alive at once
(``tensor_held_bytes``) is what the plan's figure predicts, with no allocator in it.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeplan.metrics import MEMORY_KINDS

if TYPE_CHECKING:  # typing only: the counter imports torch
    from pipeplan.profiler.live_bytes import LiveBytes

__all__ = ["MemoryReading", "MemoryMeter", "current_rss_bytes", "peak_rss_bytes", "warm_up"]

RSS, CUDA_ALLOCATED = MEMORY_KINDS  # MemoryReading.kind on the CPU, on a GPU


@dataclass(frozen=True)
class MemoryReading:
    kind: str  # RSS | CUDA_ALLOCATED
    baseline_bytes: int  # before the stage was built (after ``warm_up`` on the CPU)
    peak_bytes: int  # the most at any moment since
    overhead_bytes: int = 0  # of the baseline, what the warm-up step added (the runtime's fixed part)
    setup_bytes: int = 0  # before the first step, beyond the stage's parameters and buffers (CPU)
    # live tensors (CPU, where counted): the stage's parameters and buffers and the most bytes
    # of tensors made in the counted steps alive at once
    tensor_held_bytes: int | None = None

    @property
    def held_bytes(self) -> int:
        return self.peak_bytes - self.baseline_bytes - self.setup_bytes


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


def warm_up(optimizer: str, device: str = "cpu") -> None:
    """One training step (forward, loss, backward, an ``optimizer`` step) of a tiny MLP on
    ``device``, so the process's fixed costs of a first step are paid before a baseline. O(1)."""
    import torch

    from pipeplan.optimizers import make_optimizer

    with torch.device(device):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        step = make_optimizer(optimizer, list(model.parameters()), lr=1e-3)
        sample, target = torch.randn(2, 8), torch.tensor([0, 1])
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(sample), target)
        loss.backward()
        step.step()
        step.zero_grad(set_to_none=True)


class MemoryMeter:
    """Started before the stage is built; ``read()`` at the end of the run. On the CPU with
    ``optimizer``, ``warm_up`` runs first and its growth is the reading's ``overhead_bytes``;
    with ``count_tensors``, live tensors are counted from ``steps_begin`` to ``stop_counting``."""

    def __init__(self, device: str, optimizer: str | None = None, count_tensors: bool = False) -> None:
        self.cuda = device.startswith("cuda")
        self.device = device
        self.overhead = 0
        self.setup = 0
        self.count_tensors = count_tensors and not self.cuda
        self.tensors: LiveBytes | None = None
        self.stage_bytes = 0
        self.counted: int | None = None  # the tensors' peak, once counting stopped
        if self.cuda:
            import torch

            torch.cuda.init()  # the allocator's statistics exist once CUDA is initialised (torch 2.11 raised before)
            if optimizer is not None:  # cuBLAS's workspaces stay allocated after a first matmul
                before = int(torch.cuda.memory_allocated(device))
                warm_up(optimizer, device)
                torch.cuda.synchronize(device)
                self.overhead = max(0, int(torch.cuda.memory_allocated(device)) - before)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = int(torch.cuda.memory_allocated(device))
        else:
            if optimizer is not None:
                before = current_rss_bytes()
                warm_up(optimizer)
                self.overhead = max(0, current_rss_bytes() - before)
            reset_peak_rss()
            self.baseline = current_rss_bytes()

    def steps_begin(self, stage_bytes: int) -> None:
        """Just before the first step: what the rank holds beyond its stage's ``stage_bytes``
        (parameters and buffers) is the runtime's set-up (CPU; a GPU's allocator counts
        tensors only). With ``count_tensors`` the count of live tensors starts."""
        if not self.cuda:
            self.setup = max(0, current_rss_bytes() - self.baseline - stage_bytes)
        if self.count_tensors:
            from pipeplan.profiler.live_bytes import LiveBytes

            self.stage_bytes = stage_bytes
            self.tensors = LiveBytes()
            self.tensors.__enter__()

    def stop_counting(self) -> None:
        """The counted steps are done: later tensors are not counted (the peak stays as read).
        Where another mode was entered above the counter, it cannot leave: no tensor figures."""
        tensors = self.tensors
        if tensors is None or self.counted is not None:
            return
        if not _innermost_mode(tensors):
            self.tensors = None
            return
        tensors.__exit__(None, None, None)
        self.counted = self.stage_bytes + tensors.peak

    def discard_tensors(self) -> None:
        """No tensor figures in the reading (too few steps to time any after the count)."""
        self.stop_counting()
        self.count_tensors = False
        self.tensors = self.counted = None

    def read(self) -> MemoryReading:
        if self.cuda:
            import torch

            peak = int(torch.cuda.max_memory_allocated(self.device))
            return MemoryReading(CUDA_ALLOCATED, self.baseline, max(peak, self.baseline), self.overhead)
        peak = max(peak_rss_bytes(), self.baseline)
        self.stop_counting()  # a run that ended inside its counted steps: counted to its end
        setup = min(self.setup, peak - self.baseline)
        return MemoryReading(RSS, self.baseline, peak, self.overhead, setup, self.counted)


def _innermost_mode(mode: object) -> bool:
    """Whether ``mode`` is the dispatch mode entered last on this thread (the one that may leave)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return bool(_get_current_dispatch_mode() is mode)


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
