"""Benchmark: peak memory (RSS) of the profiler against depth, and of the largest rank against ranks.

1. ``pipeplan profile`` of ``bench/blocks.py`` with 4, 8, 16 and 32 blocks of one width,
   built on meta with ``--no-whole-step`` (one layer in memory at a time: flat) and eagerly
   (the whole model, with every optimizer's state: grows).
2. ``pipeplan run`` (1F1B-flush, SGD, ``--build meta``) of one model on 1, 2 and 4 ranks, each
   rank holding an equal share of the blocks: the largest rank's peak RSS falls with its
   share. Each rank is started as torchrun would start it (its environment) and reaped with
   ``os.wait4``, whose rusage gives that process's own peak RSS. The planner's figure for the
   largest stage (``pipeplan.planner.memory.plan_stage_memory`` on a profile of the model at
   the micro-batch size) is set against what the rank held: its peak RSS less the peak RSS of
   a rank of the same launch that holds a model of a few KiB (torch, gloo, Python).

Prints tables and writes JSON (``--out``, default bench/results/memory.json).

    python bench/bench_memory.py
    python bench/bench_memory.py --depths 4 8 --ranks 1 2 --width 1024
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeplan.jsonio import write_json_atomic
from pipeplan.units import format_bytes

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "runtime"))
from plans import make_plan  # noqa: E402

MODEL = str(ROOT / "bench" / "blocks.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peak_rss(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """Wait for each process; its own peak RSS in bytes (Linux reports ru_maxrss in KiB)."""
    peaks = []
    for process in processes:
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            raise SystemExit(f"{' '.join(map(str, process.args))} failed (exit {process.returncode})")  # type: ignore[arg-type]
        peaks.append(usage.ru_maxrss * 1024)
    return peaks


def _env(blocks: int, width: int, threads: int) -> dict[str, str]:
    return {**os.environ, "PIPEPLAN_BENCH_BLOCKS": str(blocks), "PIPEPLAN_BENCH_WIDTH": str(width),
            "OMP_NUM_THREADS": str(threads)}


def profile_peak(blocks: int, width: int, build: str, batch_size: int, threads: int, folder: Path) -> dict[str, Any]:
    """Peak RSS of one ``pipeplan profile`` (and the profile it wrote)."""
    out = folder / f"profile-{build}-{blocks}.json"
    command = [sys.executable, "-m", "pipeplan", "profile", MODEL, "--build", build, "--device", "cpu",
               "-b", str(batch_size), "--warmup", "1", "--repeats", "3", "--threads", str(threads), "-o", str(out)]
    if build == "meta":
        command.append("--no-whole-step")  # layers only: the flat line
    process = subprocess.Popen(command, env=_env(blocks, width, threads), stdout=subprocess.DEVNULL)
    peak = _peak_rss([process], 1800)[0]
    profile = json.loads(out.read_text())
    params = sum(layer["param_bytes"] for layer in profile["layers"])
    return {"blocks": blocks, "build": build, "peak_rss_bytes": peak, "param_bytes": params,
            "step_measured": profile["step_ms"] > 0, "profile": str(out)}


def run_peaks(blocks: int, width: int, ranks: int, batch_size: int, microbatches: int, threads: int,
              folder: Path) -> list[int]:
    """Peak RSS of every rank of one ``pipeplan run`` on ``ranks`` ranks (equal shares of the blocks)."""
    os.environ.update(_env(blocks, width, threads))  # make_plan builds the model in this process
    children = 2 * blocks + 1
    per = 2 * (blocks // ranks)
    stages = [list(range(i * per, (i + 1) * per)) for i in range(ranks - 1)]
    stages.append(list(range((ranks - 1) * per, children)))
    plan = make_plan(MODEL, stages, [1] * ranks, "1f1b-flush", batch_size=batch_size, microbatches=microbatches)
    path = folder / f"plan-{blocks}-{ranks}.json"
    plan.save(path)
    port = str(_free_port())
    processes = []
    for rank in range(ranks):
        env = {**_env(blocks, width, threads), "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        command = [sys.executable, "-m", "pipeplan", "run", str(path), "--model", MODEL, "--steps", "3",
                   "--build", "meta", "--no-progress"]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL))
    return _peak_rss(processes, 1800)


def planned_bytes(profile_path: Path, blocks: int, ranks: int, microbatches: int) -> int:
    """The planner's memory figure for the largest stage (the first; equal shares, SGD)."""
    from pipeplan.planner.memory import plan_stage_memory
    from pipeplan.profile import Profile

    profile = Profile.load(profile_path)
    per = 2 * (blocks // ranks)
    layers = profile.layers[:per] if ranks > 1 else profile.layers
    params = sum(layer.param_bytes for layer in layers)
    saved = sum(layer.saved_bytes for layer in layers)
    memory, _, _ = plan_stage_memory("1f1b-flush", [1] * ranks, 0, params, saved, "sgd", microbatches)
    return memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--run-blocks", type=int, default=16, help="blocks of the model trained on 1, 2, 4 ranks")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    args = parser.parse_args()
    console = Console(width=140)
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        profiles = [profile_peak(depth, args.width, build, args.batch_size, args.threads, folder)
                    for depth in args.depths for build in ("meta", "eager")]
        table = Table(title=f"pipeplan profile: peak RSS against depth (width {args.width}, batch {args.batch_size})")
        for column in ("blocks", "parameters", "peak RSS, --build meta", "peak RSS, --build eager"):
            table.add_column(column, justify="right")
        for depth in args.depths:
            meta, eager = (next(p for p in profiles if p["blocks"] == depth and p["build"] == b) for b in ("meta", "eager"))
            table.add_row(str(depth), format_bytes(meta["param_bytes"]), format_bytes(meta["peak_rss_bytes"]),
                          format_bytes(eager["peak_rss_bytes"]))
        console.print(table)

        micro = args.batch_size // args.microbatches
        reference = profile_peak(args.run_blocks, args.width, "meta", micro, args.threads, folder)
        baseline = max(run_peaks(1, 8, 1, args.batch_size, args.microbatches, args.threads, folder))
        runs = []
        for ranks in args.ranks:
            peaks = run_peaks(args.run_blocks, args.width, ranks, args.batch_size, args.microbatches, args.threads, folder)
            planned = planned_bytes(Path(reference["profile"]), args.run_blocks, ranks, args.microbatches)
            held = max(peaks) - baseline
            runs.append({"ranks": ranks, "peak_rss_bytes": peaks, "largest_peak_rss_bytes": max(peaks),
                         "held_bytes": held, "planned_bytes": planned, "held_over_planned": held / planned})
        table = Table(title=f"pipeplan run --build meta: the largest rank against ranks ({args.run_blocks} blocks of "
                            f"width {args.width}, 1f1b-flush, sgd; baseline rank {format_bytes(baseline)})")
        for column in ("ranks", "largest rank peak RSS", "held (peak - baseline)", "planned", "held / planned"):
            table.add_column(column, justify="right")
        for run in runs:
            table.add_row(str(run["ranks"]), format_bytes(run["largest_peak_rss_bytes"]), format_bytes(run["held_bytes"]),
                          format_bytes(run["planned_bytes"]), f"{run['held_over_planned']:.3f}")
        console.print(table)
    result = {"schema": "pipeplan.bench.memory/1", "machine": platform.platform(), "width": args.width,
              "batch_size": args.batch_size, "microbatches": args.microbatches, "threads": args.threads,
              "profiles": [{k: v for k, v in p.items() if k != "profile"} for p in profiles],
              "run_blocks": args.run_blocks, "baseline_rank_peak_rss_bytes": baseline, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, result)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
