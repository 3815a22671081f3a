"""Time ``pipeplan partition`` on a synthetic 1,000-layer chain x 4,096 devices (every
3-level shape: 8x8x64, 8x16x32, 4x32x32, 16x16x16) and on the PipeDream profiles in
/work/shared (skipped when absent). Prints a rich table, writes JSON (``--out``).
Target: each 1,000-layer x 4,096-device case under 10 s on 2 cores.

    python bench/bench_planner.py --out bench/results/planner.json
    python bench/bench_planner.py --shapes 8x8x64 --no-pipedream
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipeplan.jsonio import write_json_atomic
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.topology import DeviceSpec, Level, Topology, preset
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.pipedream_import import load_pipedream_graph

SHARED = Path("/work/shared/pipedream-profiles")
SHAPES = ((8, 8, 64), (8, 16, 32), (4, 32, 32), (16, 16, 16))


def synthetic_chain(layers: int = 1000, seed: int = 0) -> Profile:
    """A transformer-like chain: ~1 ms per layer, 4 MB of parameters, 8 MB activations out."""
    rng = random.Random(seed)
    return Profile(
        "synthetic-chain", f"synthetic-{layers}-{seed}", DeviceInfo("cuda", "synthetic"), 32, "bfloat16",
        tuple(
            LayerProfile(i, f"layer{i}", "Block", () if i == 0 else (i - 1,), rng.uniform(0.3, 0.5),
                         rng.uniform(0.6, 1.0), 8 * 2**20, 4 * 2**20, 2 * 2**20)
            for i in range(layers)
        ),
    )


def pod(shape: tuple[int, int, int]) -> Topology:
    a, b, c = shape
    return Topology(
        f"{a}x{b}x{c}", DeviceSpec("H100-80GB", 80 * 2**30),
        (Level("node", a, 450e9), Level("rack", b, 100e9), Level("pod", c, 25e9)),
    )


def run(name: str, profile: Profile, topology: Topology, options: PartitionOptions) -> dict:
    start = time.perf_counter()
    plan = partition(profile, topology, options)
    seconds = time.perf_counter() - start
    return {
        "case": name, "layers": len(profile.layers), "devices": topology.world_size,
        "cost_model": options.cost_model, "seconds": seconds, "stages": len(plan.stages),
        "time_per_minibatch_ms": plan.predicted.time_per_minibatch_ms,
        "speedup_vs_data_parallel": plan.predicted.speedup_vs_data_parallel,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/planner.json")
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                        help="comma-separated node x rack x pod unit counts (default: all four 4,096-device shapes)")
    parser.add_argument("--all-shapes", action="store_true", help="kept for old scripts: every shape is the default")
    parser.add_argument("--no-pipedream", action="store_true", help="skip the PipeDream profiles")
    args = parser.parse_args()
    rows = []
    chain = synthetic_chain(args.layers)
    shapes = [tuple(int(count) for count in shape.split("x")) for shape in args.shapes.split(",") if shape]
    for shape in shapes:
        if len(shape) != 3:
            parser.error(f"--shapes: {'x'.join(map(str, shape))} is not three unit counts (e.g. 8x8x64)")
        rows.append(run(f"chain x {shape[0]}x{shape[1]}x{shape[2]}", chain, pod(shape), PartitionOptions()))
    if SHARED.is_dir() and not args.no_pipedream:
        for folder in sorted(SHARED.iterdir()):
            profile = load_pipedream_graph(folder / "graph.txt", batch_size=64)
            if len(profile.layers) > 400:
                continue  # nasnet: PipeDream's O(N^3) optimizer takes minutes in Python
            for cost_model in ("pipeplan", "pipedream"):
                try:
                    rows.append(run(f"{folder.name} x cluster-a", profile, preset("cluster-a"), PartitionOptions(cost_model=cost_model)))
                except Exception as exc:  # an infeasible profile is a row, not a crash
                    rows.append({"case": f"{folder.name} x cluster-a", "layers": len(profile.layers), "devices": 16,
                                 "cost_model": cost_model, "seconds": float("nan"), "error": str(exc)})
    table = Table(title="pipeplan partition: planner time")
    for column in ("case", "layers", "devices", "cost model", "planner s", "stages", "ms/minibatch", "vs DP"):
        table.add_column(column, justify="right" if column not in ("case", "cost model") else "left")
    for row in rows:
        table.add_row(row["case"], str(row["layers"]), str(row["devices"]), row["cost_model"], f"{row['seconds']:.2f} s",
                      str(row.get("stages", "-")), f"{row.get('time_per_minibatch_ms', float('nan')):.3f} ms",
                      f"{row.get('speedup_vs_data_parallel', float('nan')):.2f}x")
    Console().print(table)
    write_json_atomic(args.out, {"schema": "pipeplan.bench.planner/1", "rows": rows})


if __name__ == "__main__":
    main()
