"""Out of memory as one line: what was being allocated, how much, and what to change."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from pipeplan.errors import PipeplanError
from pipeplan.units import format_bytes

__all__ = ["OutOfMemory", "memory_step", "allocation_bytes"]

# torch's CPU allocator: "you tried to allocate 67108864 bytes"; CUDA: "Tried to allocate 2.00 GiB"
_CPU_BYTES = re.compile(r"allocate (\d+) bytes")
_CUDA_SIZE = re.compile(r"[Tt]ried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


class OutOfMemory(PipeplanError):
    """An allocation failed; the message says what, how much and what to change."""


def allocation_bytes(message: str) -> int | None:
    """The size of the failed allocation named in torch's message, in bytes (None if unnamed)."""
    found = _CPU_BYTES.search(message)
    if found:
        return int(found.group(1))
    found = _CUDA_SIZE.search(message)
    if found:
        return int(float(found.group(1)) * _UNITS[found.group(2)])
    return None


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


@contextmanager
def memory_step(what: str, hint: str) -> Iterator[None]:
    """Turn an out-of-memory error inside the block into ``OutOfMemory`` (one line).

    >>> with memory_step("building the model", "use --build meta"):
    ...     raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes.")
    Traceback (most recent call last):
    ...
    pipeplan.memory_errors.OutOfMemory: out of memory while building the model (an allocation of 1.00 KiB failed); use --build meta
    """
    try:
        yield
    except OutOfMemory:
        raise  # an inner step named it
    except BaseException as exc:
        # a one-line error about the user's code may wrap it (the model raised on its batch)
        cause = exc.__cause__ if isinstance(exc, PipeplanError) else exc
        if cause is None or not _is_out_of_memory(cause):
            raise
        size = allocation_bytes(str(cause))
        amount = f"an allocation of {format_bytes(size)} failed" if size is not None else type(cause).__name__
        raise OutOfMemory(f"out of memory while {what} ({amount}); {hint}") from cause
