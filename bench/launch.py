"""``pipeplan run`` under torchrun for the benchmarks: one timed launch, its metrics.json read back."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["torchrun_pipeplan"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_pipeplan(
    ranks: int, run_args: list[str], metrics: Path, *, threads: int, timeout_s: float, what: str
) -> tuple[dict[str, Any], str]:
    """Run ``pipeplan run RUN_ARGS --metrics METRICS`` on ``ranks`` local ranks.

    Returns the metrics (with ``launch_s``, the launch's wall time in seconds) and the run's
    stderr; a failed run ends the benchmark with its stderr's tail, naming ``what`` ran.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-port",
        str(_free_port()),
        "-m",
        "pipeplan",
        "run",
        *run_args,
        "--metrics",
        str(metrics),
    ]
    start = time.perf_counter()
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    if result.returncode != 0:
        raise SystemExit(f"pipeplan run ({what}) failed:\n{result.stderr[-3000:]}")
    out = json.loads(metrics.read_text())
    out["launch_s"] = time.perf_counter() - start
    return out, result.stderr
