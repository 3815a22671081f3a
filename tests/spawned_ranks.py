"""Run a test's ranks as spawned processes (gloo on 127.0.0.1), bounded by a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from ports import free_port


def run_ranks(target: Callable[[int, int], None], ranks: int, deadline_s: float = 120.0) -> None:
    """``target(rank, port)`` in ``ranks`` spawned processes; the test fails if one fails or
    they are not all done within ``deadline_s`` (then they are killed)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(target, args=(free_port(),), nprocs=ranks, join=False, start_method="spawn")
    start = time.monotonic()
    while not context.join(timeout=5):
        if time.monotonic() - start > deadline_s:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {ranks} ranks did not finish within {deadline_s:.0f} s")
