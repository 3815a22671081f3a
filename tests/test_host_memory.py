"""glibc allocator thresholds shared by the profiler and the runtime."""

from __future__ import annotations

import platform
import sys

import pytest

from pipeplan.host_memory import keep_freed_blocks


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="needs glibc"
)
def test_glibc_accepts_the_thresholds() -> None:
    assert keep_freed_blocks() is True
    assert keep_freed_blocks() is True  # idempotent: a second call is accepted too
