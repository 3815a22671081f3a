"""Plan a long synthetic chain on a 4,096-device pod and print wall time and peak memory.

Issue 13 item 9: the planner's memory must stay at most linear in layers x devices, or it
must refuse in one line before it allocates. Default: 20,000 layers on 8 x 8 x 64 H100s
(the 1,000-layer chain of ``bench_planner.py``, longer). Peak memory is the process's
maximum resident set (``resource.getrusage``, KiB on Linux), measured in a fresh child
process per case, so cases do not inherit each other's peak.

    python bench/bench_planner_memory.py --layers 20000 --out bench/results/planner_memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {bench!r})
from bench_planner import pod, synthetic_chain
from pipeplan.errors import PipeplanError
from pipeplan.planner.partition import PartitionOptions, partition
layers, shape = {layers}, {shape!r}
profile = synthetic_chain(layers)
start = time.perf_counter()
try:
    plan = partition(profile, pod(tuple(int(c) for c in shape.split("x"))), PartitionOptions())
    result = {{"stages": len(plan.stages), "time_per_minibatch_ms": plan.predicted.time_per_minibatch_ms}}
except PipeplanError as exc:
    result = {{"refused": str(exc)}}
result["seconds"] = time.perf_counter() - start
result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(result))
"""


def run_case(layers: int, shape: str, timeout_s: float) -> dict:
    import os

    bench = os.path.dirname(os.path.abspath(__file__))
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD.format(bench=bench, layers=layers, shape=shape)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {
            "layers": layers,
            "shape": shape,
            "error": f"over {timeout_s:.0f} s",
            "wall_s": time.perf_counter() - start,
        }
    if done.returncode != 0:
        return {
            "layers": layers,
            "shape": shape,
            "error": done.stderr.strip().splitlines()[-1:],
            "wall_s": time.perf_counter() - start,
        }
    return {
        "layers": layers,
        "shape": shape,
        **json.loads(done.stdout.strip().splitlines()[-1]),
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="20000", help="comma-separated layer counts (default 20000)")
    parser.add_argument("--shapes", default="8x8x64", help="comma-separated node x rack x pod unit counts")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case (default 600)")
    parser.add_argument("--out", default="bench/results/planner_memory.json")
    args = parser.parse_args()
    rows = [
        run_case(int(n), shape, args.timeout)
        for n in args.layers.split(",")
        for shape in args.shapes.split(",")
    ]
    table = Table(title="pipeplan partition: planner memory (fresh process per case)")
    for column in ("layers", "devices", "planner s", "process s", "peak RSS", "result"):
        table.add_column(column, justify="left" if column == "result" else "right")
    for row in rows:
        a, b, c = (int(x) for x in row["shape"].split("x"))
        result = (
            row.get("refused")
            or row.get("error")
            or f"{row['stages']} stages, {row['time_per_minibatch_ms']:.3f} ms/minibatch"
        )
        peak = row.get("peak_rss_bytes")
        table.add_row(
            str(row["layers"]),
            str(a * b * c),
            f"{row.get('seconds', float('nan')):.2f} s",
            f"{row['wall_s']:.2f} s",
            f"{peak / 2**30:.2f} GiB" if peak else "-",
            str(result),
        )
    Console(width=150).print(table)
    from pipeplan.jsonio import write_json_atomic

    write_json_atomic(args.out, {"schema": "pipeplan.bench.planner_memory/1", "rows": rows})


if __name__ == "__main__":
    main()
