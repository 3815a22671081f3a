"""`pipeplan calibrate`: the message overhead measured on 2 local gloo ranks, written into a
topology file that `partition` reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeplan.topology import preset, resolve

pytestmark = pytest.mark.multiprocess


def run_calibrate(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    return subprocess.run(
        [sys.executable, "-m", "pipeplan", "calibrate", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )


def test_calibrate_writes_the_measured_overhead_on_level_0(tmp_path: Path) -> None:
    out = tmp_path / "measured.yaml"
    done = run_calibrate("--steps", "40", "--microbatches", "1", "--microbatches", "4", "-o", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured, given = resolve(str(out)), preset("local-cpu")
    # the rest of the topology is the input's
    assert measured.device == given.device and measured.name == given.name
    level = measured.levels[0]
    assert (level.count, level.bandwidth_bytes_per_s, level.latency_ms) == (
        given.levels[0].count,
        given.levels[0].bandwidth_bytes_per_s,
        given.levels[0].latency_ms,
    )
    # gloo's ranks pay for each message: a model of next to no compute runs far slower than
    # its layers, and what explains it is a positive overhead per message, below 50 ms
    assert 0.0 < level.message_overhead_ms < 50.0
    text = " ".join(done.stdout.split())
    assert f"message overhead: {level.message_overhead_ms * 1e3:.0f} us (median" in text
    assert "overhead that fits, us" in text and "$ torchrun" in text
    header = out.read_text().splitlines()[:3]
    assert header[0].startswith("# Measured by `pipeplan calibrate`") and "(M = 4)" in header[1]


def test_one_device_on_level_0_is_one_line_exit_2_and_no_file(tmp_path: Path) -> None:
    topology = tmp_path / "one.yaml"
    topology.write_text(
        "name: one\ndevice: {name: cpu, memory: 1 GiB, kind: cpu}\nlevels:\n  - {name: host, count: 1, bandwidth: 1 GB/s}\n"
    )
    out = tmp_path / "measured.yaml"
    done = run_calibrate("--topology", str(topology), "-o", str(out), timeout_s=60)
    assert done.returncode == 2 and not out.exists()
    assert done.stderr.strip().count("\n") == 0
    assert done.stderr.startswith("error: topology 'one': level 0 (host) joins 1 device")


def test_an_output_folder_that_does_not_exist_is_one_line_exit_2(tmp_path: Path) -> None:
    done = run_calibrate("-o", str(tmp_path / "nope" / "measured.yaml"), timeout_s=60)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "folder" in done.stderr and "does not exist" in done.stderr
