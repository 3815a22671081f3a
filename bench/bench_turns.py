"""Benchmark: does a process compute as fast taking turns with another as it does alone? No pipeplan.

A pipeline of 2 stages on 2 CPU ranks takes turns: under a flush at one micro-batch, rank 1
computes while rank 0 waits for its gradient, then the other way round. pipeplan's profile
times each layer in one process running alone. This bench measures what taking turns costs
the compute itself, with nothing of pipeplan, gloo or torch.distributed in it: one process
runs ``--layers`` ``Linear(width, width)`` forward and backward at batch 8 back to back
(``alone``); then two processes, each on its own core, run the same step in turn, handing
over through a pipe (``turns``: the waiting process blocks in ``recv``; ``turns, spinning``:
it polls). Each figure is the median over ``--steps`` timed steps of one process; the
ratios are set against ``alone`` of the same width in the same run.

    python bench/bench_turns.py
    python bench/bench_turns.py --widths 64 256 1024 --steps 400

Prints a table and writes JSON (``--out``, default bench/results/turns.json). Run it idle.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from pipeplan.jsonio import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
MODES = ("alone", "turns", "turns, spinning")
WARMUP = 30


def _steps_ms(
    width: int, layers: int, steps: int, turn: tuple[Connection, Connection, bool] | None, spin: bool
) -> float:
    """Median ms of one forward and backward of ``layers`` Linear layers; ``turn`` = (receive
    end, send end, whether this process goes first) hands the core over after every step."""
    torch.set_num_threads(1)
    x = torch.randn(8, width)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    spans = []
    for k in range(WARMUP + steps):
        if turn is not None and not (turn[2] and k == 0):
            while spin and not turn[0].poll(0):
                pass
            turn[0].recv()
        start = time.perf_counter()
        model(x).sum().backward()
        spans.append(time.perf_counter() - start)
        if turn is not None:
            turn[1].send(k)
    return statistics.median(spans[WARMUP:]) * 1e3


def _worker(cpu: int, args: tuple[Any, ...], out: Any) -> None:
    if hasattr(os, "sched_setaffinity") and os.cpu_count() and cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})
    out.put((cpu, _steps_ms(*args)))


def measure(width: int, layers: int, steps: int, mode: str) -> float:
    """Median step ms of rank 0 in ``mode``; both processes' figures are within noise of each other."""
    context = mp.get_context("spawn")
    results: Any = context.Queue()
    if mode == "alone":
        procs = [context.Process(target=_worker, args=(0, (width, layers, steps, None, False), results))]
    else:
        to_second_rx, to_second_tx = context.Pipe(False)
        to_first_rx, to_first_tx = context.Pipe(False)
        spin = mode == "turns, spinning"
        procs = [
            context.Process(
                target=_worker,
                args=(0, (width, layers, steps, (to_first_rx, to_second_tx, True), spin), results),
            ),
            context.Process(
                target=_worker,
                args=(1, (width, layers, steps, (to_second_rx, to_first_tx, False), spin), results),
            ),
        ]
    for proc in procs:
        proc.start()
    figures = dict(results.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return figures[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "turns.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = []
    for width in args.widths:
        ms = {mode: measure(width, args.layers, args.steps, mode) for mode in MODES}
        rows.append({"width": width, "ms": ms, "over_alone": {m: ms[m] / ms["alone"] for m in MODES}})
    table = Table(
        title=f"{args.layers} Linear(width, width), batch 8, one thread: median ms per step over {args.steps} "
        f"steps; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}"
    )
    for column in ("width", *(f"{m} ms" for m in MODES), *(f"{m} / alone" for m in MODES[1:])):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["width"]),
            *(f"{row['ms'][m]:.3f}" for m in MODES),
            *(f"{row['over_alone'][m]:.2f}" for m in MODES[1:]),
        )
    Console().print(table)
    write_json_atomic(
        Path(args.out), {"layers": args.layers, "steps": args.steps, "load_before": load_before, "rows": rows}
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
