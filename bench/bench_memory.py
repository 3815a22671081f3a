"""Benchmark: peak memory (RSS) of the profiler against depth, and what each rank holds against ranks.

1. ``pipeplan profile`` of ``bench/blocks.py`` with 4, 8, 16 and 32 blocks of one width,
   built on meta with ``--no-whole-step`` (one layer in memory at a time: flat) and eagerly
   (the whole model, with every optimizer's state: grows). Each figure is the profile
   process's own peak RSS, from ``os.wait4`` in a small helper process that starts it (a
   child's ``ru_maxrss`` includes the RSS of the process it was forked from: started from
   this benchmark, which holds models, a bare interpreter read 982 MiB).
2. ``pipeplan run`` (1F1B-flush, SGD, ``--build meta``) of one model on 1, 2 and 4 ranks, each
   rank holding an equal share of the blocks, with 2 and with 1 micro-batch. The plan's
   per-device figure for each stage is the planner's rule (``plan_stage_memory`` on a
   profile of the model at the micro-batch size); each rank measures its own baseline
   (RSS after its imports, before its stage is built) and peak (``VmHWM``, reset at the
   baseline) into metrics.json. A launch of the same shape whose model is a few KiB gives
   the runtime's own cost per rank (capture code, process group, threads); what a rank
   holds for its stage is ``peak - baseline - that``, set against the plan's figure.

Prints tables and writes JSON (``--out``, default bench/results/memory.json).

    python bench/bench_memory.py
    python bench/bench_memory.py --depths --ranks 2 4 --microbatches 2   # the run tables only
    python bench/bench_memory.py --depths --dtype bfloat16 --optimizer adam   # mixed precision, Adam
"""

from __future__ import annotations

import argparse
import dataclasses
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


# Starts the command given as its arguments and prints that process's own peak RSS (KiB):
# forked from this small interpreter, the child's ru_maxrss carries only the helper's few MiB.
_HELPER = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL); "
    "_, status, usage = os.wait4(p.pid, 0); code = os.waitstatus_to_exitcode(status); "
    "print(usage.ru_maxrss); sys.exit(code)"
)


def _own_peak_rss(command: list[str], env: dict[str, str], timeout_s: float = 1800.0) -> int:
    """Run ``command``; its own peak RSS in bytes (Linux reports ru_maxrss in KiB)."""
    result = subprocess.run(
        [sys.executable, "-c", _HELPER, *command], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit {result.returncode}): {result.stderr[-2000:]}")
    return int(result.stdout.split()[-1]) * 1024


def _env(blocks: int, width: int, threads: int) -> dict[str, str]:
    return {
        **os.environ,
        "PIPEPLAN_BENCH_BLOCKS": str(blocks),
        "PIPEPLAN_BENCH_WIDTH": str(width),
        "OMP_NUM_THREADS": str(threads),
    }


def profile_peak(
    blocks: int,
    width: int,
    build: str,
    batch_size: int,
    threads: int,
    folder: Path,
    timeout_s: float = 1800.0,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Peak RSS of one ``pipeplan profile`` (and the profile it wrote)."""
    out = folder / f"profile-{build}-{blocks}-{dtype}.json"
    command = [
        sys.executable,
        "-m",
        "pipeplan",
        "profile",
        MODEL,
        "--build",
        build,
        "--device",
        "cpu",
        "-b",
        str(batch_size),
        "--warmup",
        "1",
        "--repeats",
        "3",
        "--threads",
        str(threads),
        "--dtype",
        dtype,
        "-o",
        str(out),
    ]
    if build == "meta":
        command.append("--no-whole-step")  # layers only: the flat line
    peak = _own_peak_rss(command, _env(blocks, width, threads), timeout_s)
    profile = json.loads(out.read_text())
    params = sum(layer["param_bytes"] for layer in profile["layers"])
    return {
        "blocks": blocks,
        "build": build,
        "peak_rss_bytes": peak,
        "param_bytes": params,
        "step_measured": profile["step_ms"] > 0,
        "profile": str(out),
    }


def stage_layers(blocks: int, ranks: int) -> list[list[int]]:
    """Equal shares of the blocks (children 2b, 2b + 1); the last stage also takes the head."""
    per = 2 * (blocks // ranks)
    stages = [list(range(i * per, (i + 1) * per)) for i in range(ranks - 1)]
    return stages + [list(range((ranks - 1) * per, 2 * blocks + 1))]


def planned_plan(
    blocks: int,
    width: int,
    ranks: int,
    batch_size: int,
    microbatches: int,
    threads: int,
    folder: Path,
    timeout_s: float = 1800.0,
    dtype: str = "float32",
    optimizer: str = "sgd",
) -> Any:
    """The run's plan, each stage's ``memory_bytes`` the planner's rule on a profile at the
    micro-batch size (``dtype`` bfloat16: mixed precision, float32 masters)."""
    from pipeplan.planner.memory import plan_stage_memory
    from pipeplan.precision import Precision
    from pipeplan.profile import Profile

    reference = profile_peak(
        blocks, width, "meta", batch_size // microbatches, threads, folder, timeout_s, dtype
    )
    profile = Profile.load(reference["profile"])
    os.environ.update(_env(blocks, width, threads))  # make_plan builds the model in this process
    layers = stage_layers(blocks, ranks)
    plan = make_plan(
        MODEL,
        layers,
        [1] * ranks,
        "1f1b-flush",
        batch_size=batch_size,
        microbatches=microbatches,
        optimizer=optimizer,
    )
    plan = dataclasses.replace(plan, dtype=profile.dtype, master_dtype=profile.master_dtype)
    stages = []
    for stage, share in zip(plan.stages, layers):
        params = sum(profile.layers[i].param_bytes for i in share)
        saved = sum(profile.layers[i].saved_bytes for i in share)
        largest = max(profile.layers[i].largest_tensor_bytes for i in share)
        memory, _, in_flight = plan_stage_memory(
            "1f1b-flush",
            [1] * ranks,
            stage.index,
            params,
            saved,
            optimizer,
            microbatches,
            precision=Precision(profile.dtype, profile.master_dtype),
            largest_param_bytes=largest,
        )
        stages.append(dataclasses.replace(stage, memory_bytes=memory, in_flight=max(1, int(in_flight))))
    return dataclasses.replace(plan, stages=tuple(stages))


def run_ranks(
    plan: Any, blocks: int, width: int, threads: int, steps: int, folder: Path, timeout_s: float = 1800.0
) -> list[dict[str, Any]]:
    """Launch every rank of ``plan`` as torchrun would (its environment); each rank's metrics entry."""
    ranks = plan.world_size
    path = folder / f"plan-{blocks}-{ranks}-{plan.microbatches}.json"
    metrics = folder / f"metrics-{blocks}-{ranks}-{plan.microbatches}.json"
    plan.save(path)
    port = str(_free_port())
    processes = []
    for rank in range(ranks):
        env = {
            **_env(blocks, width, threads),
            "RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        command = [
            sys.executable,
            "-m",
            "pipeplan",
            "run",
            str(path),
            "--model",
            MODEL,
            "--steps",
            str(steps),
            "--build",
            "meta",
            "--no-progress",
            "--metrics",
            str(metrics),
        ]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL))
    try:
        codes = [process.wait(timeout=timeout_s) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    if any(codes):
        raise SystemExit(f"pipeplan run on {ranks} ranks failed (exit codes {codes})")
    return list(json.loads(metrics.read_text())["stages"])


def held(stage: dict[str, Any]) -> int:
    return int(stage["peak_memory_bytes"]) - int(stage["baseline_memory_bytes"])


def check_ranks(
    blocks: int,
    width: int,
    ranks: int,
    batch_size: int,
    microbatches: int,
    threads: int,
    steps: int,
    folder: Path,
    timeout_s: float = 1800.0,
    dtype: str = "float32",
    optimizer: str = "sgd",
) -> dict[str, Any]:
    """One launch of the model and one of a few-KiB model of the same shape: held vs planned per rank."""
    plan = planned_plan(
        blocks, width, ranks, batch_size, microbatches, threads, folder, timeout_s, dtype, optimizer
    )
    stages = run_ranks(plan, blocks, width, threads, steps, folder, timeout_s)
    os.environ.update(_env(ranks, 8, threads))  # one block of width 8 per rank: a few KiB
    tiny = make_plan(
        MODEL,
        stage_layers(ranks, ranks),
        [1] * ranks,
        "1f1b-flush",
        batch_size=batch_size,
        microbatches=microbatches,
        optimizer=optimizer,
    )
    tiny = dataclasses.replace(tiny, dtype=plan.dtype, master_dtype=plan.master_dtype)
    overhead = [held(s) for s in run_ranks(tiny, ranks, 8, threads, steps, folder, timeout_s)]
    rows = []
    for stage in stages:
        own = held(stage) - overhead[stage["rank"]]
        rows.append(
            {
                "rank": stage["rank"],
                "baseline_bytes": stage["baseline_memory_bytes"],
                "peak_bytes": stage["peak_memory_bytes"],
                "runtime_bytes": overhead[stage["rank"]],
                "held_bytes": own,
                "planned_bytes": stage["predicted_memory_bytes"],
                "held_over_planned": own / stage["predicted_memory_bytes"],
            }
        )
    return {
        "ranks": ranks,
        "microbatches": microbatches,
        "dtype": dtype,
        "optimizer": optimizer,
        "per_rank": rows,
        "worst_held_over_planned": max((r["held_over_planned"] for r in rows), key=lambda x: abs(x - 1.0)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--depths", type=int, nargs="*", default=[4, 8, 16, 32], help="none: skip the profiles"
    )
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 4], help="none: skip the runs")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument(
        "--run-blocks", type=int, default=16, help="blocks of the model trained on 1, 2, 4 ranks"
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="of the runs (bfloat16: mixed precision, float32 masters)",
    )
    parser.add_argument("--optimizer", choices=("sgd", "momentum", "adam", "adamw"), default="sgd")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    args = parser.parse_args()
    console = Console(width=140)
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        profiles = [
            profile_peak(depth, args.width, build, args.batch_size, args.threads, folder)
            for depth in args.depths
            for build in ("meta", "eager")
        ]
        table = Table(
            title=f"pipeplan profile: peak RSS against depth (width {args.width}, batch {args.batch_size})"
        )
        for column in ("blocks", "parameters", "peak RSS, --build meta", "peak RSS, --build eager"):
            table.add_column(column, justify="right")
        for depth in args.depths:
            meta, eager = (
                next(p for p in profiles if p["blocks"] == depth and p["build"] == b)
                for b in ("meta", "eager")
            )
            table.add_row(
                str(depth),
                format_bytes(meta["param_bytes"]),
                format_bytes(meta["peak_rss_bytes"]),
                format_bytes(eager["peak_rss_bytes"]),
            )
        if profiles:
            console.print(table)
        runs = [
            check_ranks(
                args.run_blocks,
                args.width,
                ranks,
                args.batch_size,
                micro,
                args.threads,
                args.steps,
                folder,
                dtype=args.dtype,
                optimizer=args.optimizer,
            )
            for micro in args.microbatches
            for ranks in args.ranks
        ]
    table = Table(
        title=f"pipeplan run --build meta: what each rank holds against the plan ({args.run_blocks} blocks "
        f"of width {args.width}, batch {args.batch_size}, 1f1b-flush, {args.optimizer}, {args.dtype}, "
        f"{args.steps} steps)"
    )
    for column in (
        "micro-batches",
        "ranks",
        "peak - baseline",
        "runtime's own",
        "held for the stage",
        "planned",
        "held / planned",
    ):
        table.add_column(column, justify="right")
    for run in runs:  # none with --ranks alone
        rows = run["per_rank"]
        table.add_row(
            str(run["microbatches"]),
            str(run["ranks"]),
            ", ".join(format_bytes(r["peak_bytes"] - r["baseline_bytes"]) for r in rows),
            ", ".join(format_bytes(r["runtime_bytes"]) for r in rows),
            ", ".join(format_bytes(r["held_bytes"]) for r in rows),
            ", ".join(format_bytes(r["planned_bytes"]) for r in rows),
            ", ".join(f"{r['held_over_planned']:.2f}" for r in rows),
        )
    if runs:
        console.print(table)
    result = {
        "schema": "pipeplan.bench.memory/3",
        "machine": platform.platform(),
        "width": args.width,
        "batch_size": args.batch_size,
        "microbatches": args.microbatches,
        "threads": args.threads,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "profiles": [{k: v for k, v in p.items() if k != "profile"} for p in profiles],
        "run_blocks": args.run_blocks,
        "steps": args.steps,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, result)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
