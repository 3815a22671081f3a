"""A rank's memory meter: baseline, peak since, and a peak that is the process's own."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pipeplan.runtime.memory_usage import MemoryMeter, peak_rss_bytes

MiB = 1 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS figures from /proc")
def test_meter_counts_what_was_touched_after_its_baseline() -> None:
    meter = MemoryMeter("cpu")
    block = torch.ones(64 * MiB // 4)  # 64 MiB, every page written
    del block
    reading = meter.read()
    assert reading.kind == "rss"
    # held: the 64 MiB block and little else (the meter's own reset put the peak at the baseline)
    assert 64 * MiB <= reading.held_bytes < 96 * MiB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS figures from /proc")
def test_peak_is_the_process_own_not_its_parents() -> None:
    """getrusage's ru_maxrss of a child includes its parent's RSS at the fork; VmHWM does not."""
    held = torch.ones(256 * MiB // 4)  # the parent holds 256 MiB while the child starts
    code = ("import resource; from pipeplan.runtime.memory_usage import peak_rss_bytes; "
            "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    own, inherited = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True, timeout=60).stdout.split())
    assert inherited >= 256 * MiB > 3 * own  # a bare interpreter and pipeplan.metrics: tens of MiB
    assert peak_rss_bytes() >= held.numel() * 4  # the parent's own peak does hold it
