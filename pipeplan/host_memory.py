"""Keep glibc's malloc from returning small tensor blocks to the kernel after every use,
and large ones from staying resident after they are freed.

By default glibc serves blocks above a dynamic threshold (128 KiB at start) with a fresh
``mmap`` and ``munmap``s them on free, so a training step that allocates and frees the
same activation and gradient buffers every minibatch pays page faults for all of them:
on a 2-core CPU run this was 10-15% of a pipeline stage's time. Raising the threshold
makes freed blocks reusable, as jemalloc or tcmalloc (the allocators PyTorch recommends
for CPU training) would. But a freed heap block stays resident, and large blocks freed
between small allocations leave holes the next large block does not fit: with glibc's
ceiling (32 MiB), 8 x Linear(1024) trained on 2,048-row batches (8 MiB activations)
peaked at 305-317 MiB for 145 MiB of live tensors, and a pipeline stage of 16 MiB weights
at 1.12-1.34x what it holds (``bench/bench_memory.py``). Blocks of 4 MiB and more are
therefore still mapped and unmapped (the stage then peaks at 1.01-1.02x its live tensors;
the 2,048-row MLP at 145 MiB, 12-14% slower; unchanged at 512 rows, 2 MiB activations):
a rank's peak is then what the planner's memory rule counts. Both the profiler and the
runtime call this, so what is measured is what runs. It does nothing where glibc is not
the C library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

__all__ = ["keep_freed_blocks", "return_freed_blocks"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 4 << 20  # blocks this large are mapped and unmapped (module docstring)
_TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_blocks() -> bool:
    """Set glibc's mmap threshold (4 MiB) and raise its trim threshold; True when glibc accepted both."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )


def return_freed_blocks() -> bool:
    """Hand freed heap memory back to the kernel now (glibc ``malloc_trim(0)``); True if it did.

    The layer-by-layer profiler calls it after freeing each layer, so the retention that
    ``keep_freed_blocks`` allows does not add up across layers.
    """
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def _glibc(name: str) -> Any:
    """glibc's function ``name`` on Linux; None elsewhere or where libc lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
