"""Benchmark: what an exchange costs pipeplan's runtime on this machine: the message overhead to put in a topology.

The model of messages ``pipeplan calibrate`` trains (``configs/models/exchange.py``: four
``Linear(4, 4)`` layers, 75 us of compute at batch 8) is
profiled, planned as 2 stages on ``--topology`` (default ``local-cpu``: one stage per device,
1F1B-flush) at each micro-batch count, and trained on 2 gloo ranks: with next to no compute,
a minibatch's time is its messages and the runtime's own cost per action. For each count the
table gives the predicted and measured ms per minibatch, the excess per message (measured -
predicted over the 2 M messages of the minibatch), and the message overhead
(``Level.message_overhead_ms``: what each end of a message costs its rank, beside the
latency) at which the simulator predicts the measured time. The median of those is the
figure ``pipeplan calibrate`` writes as ``message_overhead:`` on the topology level joining
the ranks (it fits the same way: ``planner.message_overhead``); this bench also gives the
excess per message. The ``local-cpu`` preset's is this bench's on the 2-vCPU dev VM, one day.

    python bench/bench_exchange.py
    python bench/bench_exchange.py --microbatches 1 2 4 8 --steps 300 --topology my-cluster.yaml

Writes JSON (``--out``, default bench/results/exchange.json). The machine's load moves every
figure: run it idle, and say the load next to the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeplan.jsonio import write_json_atomic
from pipeplan.modelfile import bundled_model_path
from pipeplan.plan import Plan
from pipeplan.planner.message_overhead import fitted_message_overhead_ms
from pipeplan.topology import resolve

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_predict import measure, profile  # noqa: E402

MODEL = Path(bundled_model_path("exchange"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--topology", default="local-cpu")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "exchange.json"))
    args = parser.parse_args()
    topology = resolve(args.topology)
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prof, _ = profile(str(MODEL), 8, 5, folder, args.timeout)
        for micro in args.microbatches:
            row = measure(str(MODEL), prof, micro, args.steps, folder, args.timeout, topology)
            plan = Plan.load(folder / f"plan-m{micro}.json")
            row["excess_per_message_ms"] = (row["measured_ms"] - row["predicted_ms"]) / (2 * micro)
            row["fitted_overhead_ms"] = fitted_message_overhead_ms(plan, prof, row["measured_ms"])
            rows.append(row)
    overhead_ms = statistics.median(row["fitted_overhead_ms"] for row in rows)
    level = topology.levels[0]
    table = Table(
        title=f"2 gloo ranks, {args.topology} (latency {level.latency_ms * 1e3:.0f} us, message overhead "
        f"{level.message_overhead_ms * 1e3:.0f} us), "
        f"{args.steps} steps; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}"
    )
    for column in ("M", "predicted ms", "measured ms", "excess per message ms", "overhead that fits, ms"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["microbatches"]),
            f"{row['predicted_ms']:.3f}",
            f"{row['measured_ms']:.3f}",
            f"{row['excess_per_message_ms']:.3f}",
            f"{row['fitted_overhead_ms']:.3f}",
        )
    Console().print(table)
    print(f"message overhead that fits, median over the counts: {overhead_ms * 1e3:.0f} us")
    write_json_atomic(
        Path(args.out),
        {
            "topology": args.topology,
            "steps": args.steps,
            "load_before": load_before,
            "rows": rows,
            "message_overhead_ms": overhead_ms,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
