"""Time ``pipeplan partition`` on a synthetic 1,000-layer chain x 4,096 devices (every
3-level shape: 8x8x64, 8x16x32, 4x32x32, 16x16x16), on every PipeDream profile in
/work/shared at 4x4 (cluster-a) and 2x8 (cluster-b), both cost models (skipped when
absent), with the cut family and its number of cut states, and on tensor x pipeline x
data parallelism (``bench_ptdp``: estimated profiles): PTD-P's 1T GPT on 3,072 A100s, and
the same GPT on 16,384 H100s (8 per node, 32 nodes per unit, 64 units). Prints a rich table, writes
JSON (``--out``). Targets (2 cores): each case under 10 s; ResNet-50 at 4x4 with
``--cost-model pipedream --activation-compression 1`` under 0.5 s as a whole
``pipeplan partition`` process (median of 3 runs).

    python bench/bench_planner.py --out bench/results/planner.json
    python bench/bench_planner.py --shapes 8x8x64 --no-pipedream
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipeplan.errors import PipeplanError
from pipeplan.jsonio import write_json_atomic
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.profiler.pipedream_graph import load_pipedream_graph
from pipeplan.topology import DeviceSpec, Level, Topology, preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ptdp import TABLE_1, megatron_cluster  # noqa: E402

from pipeplan.profiler.estimate import DEVICE_RATES, estimate_gpt  # noqa: E402

SHARED = Path("/work/shared/pipedream-profiles")
SHAPES = ((8, 8, 64), (8, 16, 32), (4, 32, 32), (16, 16, 16))


def synthetic_chain(layers: int = 1000, seed: int = 0) -> Profile:
    """A transformer-like chain: ~1 ms per layer, 4 MB of parameters, 8 MB activations out."""
    rng = random.Random(seed)
    return Profile(
        "synthetic-chain",
        f"synthetic-{layers}-{seed}",
        DeviceInfo("cuda", "synthetic"),
        32,
        "bfloat16",
        tuple(
            LayerProfile(
                i,
                f"layer{i}",
                "Block",
                () if i == 0 else (i - 1,),
                rng.uniform(0.3, 0.5),
                rng.uniform(0.6, 1.0),
                8 * 2**20,
                4 * 2**20,
                2 * 2**20,
            )
            for i in range(layers)
        ),
    )


def pod(shape: tuple[int, int, int]) -> Topology:
    a, b, c = shape
    return Topology(
        f"{a}x{b}x{c}",
        DeviceSpec("H100-80GB", 80 * 2**30),
        (Level("node", a, 450e9), Level("rack", b, 100e9), Level("pod", c, 25e9)),
    )


TARGET_S = 10.0
PROCESS_TARGET_S = 0.5


def h100_16k() -> Topology:
    """16,384 H100s: 8 per node (NVLink 4), 32 nodes per unit, 64 units (8 x 400 Gbit/s per node)."""
    return Topology(
        "h100-16k",
        DeviceSpec("H100-80GB", 80 * 2**30),
        (Level("node", 8, 450e9, 0.002), Level("unit", 32, 400e9, 0.005), Level("cluster", 64, 400e9, 0.01)),
    )


def tensor_parallel_cases() -> list[tuple[str, Profile, Topology, PartitionOptions]]:
    """PTD-P's 1T GPT: the paper's row (3,072 A100s, batch 3,072) and 16,384 H100s (batch 8,192)."""
    gpt = TABLE_1[-1]
    return [
        (
            "GPT-1T x 3,072 A100 (PTD-P), t/p/d searched",
            estimate_gpt(gpt.shape, DEVICE_RATES["a100-80gb"], gpt.batch),
            megatron_cluster(gpt.gpus),
            PartitionOptions(schedule="1f1b-flush", microbatches=gpt.batch, optimizer="adam"),
        ),
        (
            "GPT-1T x 16,384 H100, t/p/d searched",
            estimate_gpt(gpt.shape, DEVICE_RATES["h100-sxm"], 8192),
            h100_16k(),
            PartitionOptions(schedule="1f1b-flush", microbatches=8192, optimizer="adam"),
        ),
    ]


def run(name: str, profile: Profile, topology: Topology, options: PartitionOptions) -> dict:
    start, cpu = time.perf_counter(), time.process_time()
    plan = partition(profile, topology, options)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return {
        "case": name,
        "layers": len(profile.layers),
        "devices": topology.world_size,
        "cpu_seconds": cpu_seconds,
        "tensor_parallel": plan.stages[0].tensor_parallel,
        "simulated": plan.predicted.simulated,
        "cost_model": options.cost_model,
        "seconds": seconds,
        "stages": len(plan.stages),
        "cut_family": plan.cut_family,
        "cut_states": plan.cut_candidates,
        "time_per_minibatch_ms": plan.predicted.time_per_minibatch_ms,
        "speedup_vs_data_parallel": plan.predicted.speedup_vs_data_parallel,
    }


def whole_process_s(graph: Path, repeats: int = 3) -> dict:
    """Median wall time (s) of ``pipeplan partition GRAPH --topology cluster-a --cost-model
    pipedream --activation-compression 1`` as a fresh process."""
    times = []
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable,
            "-m",
            "pipeplan",
            "partition",
            str(graph),
            "--topology",
            "cluster-a",
            "--cost-model",
            "pipedream",
            "--activation-compression",
            "1",
            "-o",
            os.path.join(folder, "plan.json"),
        ]
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True, timeout=120)
            times.append(time.perf_counter() - start)
    return {
        "case": f"{graph.parent.name} x 4x4, compression 1 (whole process)",
        "cost_model": "pipedream",
        "process_seconds": statistics.median(times),
        "runs_s": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/planner.json")
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument(
        "--shapes",
        default=",".join("x".join(map(str, s)) for s in SHAPES),
        help="comma-separated node x rack x pod unit counts (default: all four 4,096-device shapes)",
    )
    parser.add_argument(
        "--all-shapes", action="store_true", help="kept for old scripts: every shape is the default"
    )
    parser.add_argument("--no-pipedream", action="store_true", help="skip the PipeDream profiles")
    parser.add_argument(
        "--profiles", default="", help="comma-separated PipeDream profile names (default: all)"
    )
    parser.add_argument("--no-tensor-parallel", action="store_true", help="skip the GPT-1T cases")
    args = parser.parse_args()
    rows = []
    process: dict = {}
    chain = synthetic_chain(args.layers)
    shapes = [tuple(int(count) for count in shape.split("x")) for shape in args.shapes.split(",") if shape]
    for shape in shapes:
        if len(shape) != 3:
            parser.error(f"--shapes: {'x'.join(map(str, shape))} is not three unit counts (e.g. 8x8x64)")
        rows.append(run(f"chain x {shape[0]}x{shape[1]}x{shape[2]}", chain, pod(shape), PartitionOptions()))
    if not args.no_tensor_parallel:
        for name, profile, topology, options in tensor_parallel_cases():
            rows.append(run(name, profile, topology, options))
    if SHARED.is_dir() and not args.no_pipedream:
        for folder in sorted(SHARED.iterdir()):
            if args.profiles and folder.name not in args.profiles.split(","):
                continue
            profile = load_pipedream_graph(folder / "graph.txt", batch_size=64)
            for shape_name, cluster in (("4x4", "cluster-a"), ("2x8", "cluster-b")):
                for cost_model in ("pipeplan", "pipedream"):
                    name = f"{folder.name} x {shape_name}"
                    try:
                        rows.append(
                            run(name, profile, preset(cluster), PartitionOptions(cost_model=cost_model))
                        )
                    except PipeplanError as exc:  # an infeasible profile is a row, not a crash
                        rows.append(
                            {
                                "case": name,
                                "layers": len(profile.layers),
                                "devices": 16,
                                "cost_model": cost_model,
                                "seconds": float("nan"),
                                "error": str(exc),
                            }
                        )
        resnet50 = SHARED / "resnet50" / "graph.txt"
        if resnet50.exists():
            process = whole_process_s(resnet50)
    table = Table(title="pipeplan partition: planner time (in process; target < 10 s each)")
    for column in (
        "case",
        "layers",
        "devices",
        "cost model",
        "cut family",
        "cut states",
        "planner s",
        "stages",
        "t",
        "ms/minibatch",
        "vs DP",
    ):
        table.add_column(
            column, justify="right" if column not in ("case", "cost model", "cut family") else "left"
        )
    for row in rows:
        table.add_row(
            row["case"],
            str(row["layers"]),
            str(row["devices"]),
            row["cost_model"],
            row.get("cut_family", "-"),
            str(row.get("cut_states", "-")),
            f"{row['seconds']:.2f} s"
            + (" (over target)" if row["seconds"] > TARGET_S else "")
            + (f", CPU {row['cpu_seconds']:.2f} s" if "cpu_seconds" in row else ""),
            str(row.get("stages", "-")),
            str(row.get("tensor_parallel", "-")),
            f"{row.get('time_per_minibatch_ms', float('nan')):.3f} ms"
            + ("" if row.get("simulated", True) else " (not simulated)"),
            f"{row.get('speedup_vs_data_parallel', float('nan')):.2f}x",
        )
    console = Console(width=170)
    console.print(table)
    slow = [row["case"] + " " + row["cost_model"] for row in rows if not row["seconds"] <= TARGET_S]
    console.print(
        f"cases over {TARGET_S:.0f} s: {len(slow)} of {len(rows)}" + (f" ({', '.join(slow)})" if slow else "")
    )
    if process:
        console.print(
            f"{process['case']}: median {process['process_seconds']:.2f} s of "
            f"{', '.join(f'{t:.2f}' for t in process['runs_s'])} s (target {PROCESS_TARGET_S} s)"
        )
    write_json_atomic(
        args.out, {"schema": "pipeplan.bench.planner/2", "rows": rows, "whole_process": process}
    )


if __name__ == "__main__":
    main()
