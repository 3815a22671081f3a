"""Benchmark: pipeplan's runtime against torch.distributed.pipelining and a plain loop.

Same model file, batch, split and learning rate for every run (2 CPU ranks, gloo):

- pipeplan ``1f1b-flush`` (M micro-batches) vs ``torch.distributed.pipelining``
  ``Schedule1F1B`` (``bench/pipelining_baseline.py``), and their ratio;
- pipeplan ``1f1b-rr`` (PipeDream, weight stashing, no flush);
- a 1-stage pipeplan run vs a plain single-process training loop: the runtime's own
  overhead (scheduling, data, bookkeeping) with no communication.

pipeplan's figure is its steady-state ``samples_per_s`` from ``--metrics`` (the spacing of
minibatch completions after warm-up). Prints a rich table and writes JSON
(``--out``, default bench/results/runtime.json).

    python bench/bench_runtime.py
    python bench/bench_runtime.py --model mlp --batch-size 64 --microbatches 4 --steps 20
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
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeplan.jsonio import write_json_atomic
from pipeplan.modelfile import bundled_model_path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "runtime"))
sys.path.insert(0, str(ROOT / "bench"))

from plans import make_plan  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pipeplan(model_path: str, stage_layers: list[list[int]], schedule: str, batch_size: int,
                 microbatches: int, steps: int, lr: float, threads: int, timeout_s: float) -> dict[str, Any]:
    """One torchrun launch of ``pipeplan run``; returns its metrics JSON plus ``launch_s``."""
    plan = make_plan(model_path, stage_layers, [1] * len(stage_layers), schedule,
                     batch_size=batch_size, microbatches=microbatches)
    with tempfile.TemporaryDirectory() as folder:
        plan.save(Path(folder) / "plan.json")
        metrics = Path(folder) / "metrics.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(len(stage_layers)),
                   "--master-port", str(_free_port()), "-m", "pipeplan", "run", str(Path(folder) / "plan.json"),
                   "--model", model_path, "--steps", str(steps), "--lr", str(lr), "--no-progress",
                   "--metrics", str(metrics)]
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        if result.returncode != 0:
            raise SystemExit(f"pipeplan run ({schedule}) failed:\n{result.stderr[-3000:]}")
        out = json.loads(metrics.read_text())
        out["launch_s"] = time.perf_counter() - start
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="bundled model name or a model.py path")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "runtime.json"))
    args = parser.parse_args()

    from pipelining_baseline import run_pipelining_baseline, run_single_process_baseline

    model_path = args.model if args.model.endswith(".py") else bundled_model_path(args.model)
    from pipeplan.modelfile import load_model_file

    layers = len(load_model_file(model_path).build())
    cut = layers // 2
    split = [list(range(cut)), list(range(cut, layers))]
    cores = os.cpu_count() or 2
    threads = max(1, cores // 2)
    total = args.steps + args.warmup
    console = Console()
    console.print(f"model {model_path}: {layers} layers, split [0,{cut}) [{cut},{layers}), "
                  f"batch {args.batch_size}, {args.microbatches} micro-batches, {cores} cores")

    flush = run_pipeplan(model_path, split, "1f1b-flush", args.batch_size, args.microbatches, total,
                         args.lr, threads, args.timeout)
    baseline = run_pipelining_baseline(model_path, [cut], args.batch_size, args.microbatches, args.steps,
                                       args.lr, warmup_steps=args.warmup, threads_per_rank=threads,
                                       timeout_s=args.timeout)
    rr = run_pipeplan(model_path, split, "1f1b-rr", args.batch_size, 1, total, args.lr, threads, args.timeout)
    one_stage = run_pipeplan(model_path, [list(range(layers))], "1f1b-flush", args.batch_size, 1, total,
                             args.lr, cores, args.timeout)
    single = run_single_process_baseline(model_path, args.batch_size, args.steps, args.lr,
                                         warmup_steps=args.warmup, threads=cores)

    rows = [
        ("pipeplan 1f1b-flush (2 ranks)", flush["samples_per_s"], flush["time_per_minibatch_ms"]),
        ("torch pipelining Schedule1F1B (2 ranks)", baseline["samples_per_s"], baseline["time_per_minibatch_ms"]),
        ("pipeplan 1f1b-rr (2 ranks)", rr["samples_per_s"], rr["time_per_minibatch_ms"]),
        ("pipeplan 1 stage (1 rank)", one_stage["samples_per_s"], one_stage["time_per_minibatch_ms"]),
        ("plain training loop (1 process)", single["samples_per_s"], single["time_per_minibatch_ms"]),
    ]
    table = Table(title="pipeplan runtime benchmark (CPU, gloo)")
    for column in ("run", "samples/s", "ms/minibatch"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for name, rate, period in rows:
        table.add_row(name, f"{rate:,.1f}", f"{period:,.2f}")
    console.print(table)
    ratios = {
        "flush_vs_pipelining": flush["samples_per_s"] / baseline["samples_per_s"],
        "rr_vs_pipelining": rr["samples_per_s"] / baseline["samples_per_s"],
        "rr_vs_flush": rr["samples_per_s"] / flush["samples_per_s"],
        "one_stage_vs_plain_loop": one_stage["samples_per_s"] / single["samples_per_s"],
    }
    for name, value in ratios.items():
        console.print(f"ratio {name}: {value:.2f}x")
    write_json_atomic(args.out, {
        "benchmark": "runtime",
        "machine": {"platform": platform.platform(), "cores": cores},
        "settings": {"model": model_path, "layers": layers, "cut": cut, "batch_size": args.batch_size,
                     "microbatches": args.microbatches, "steps": args.steps, "warmup": args.warmup,
                     "lr": args.lr, "threads_per_rank": threads},
        "samples_per_s": {name: rate for name, rate, _ in rows},
        "time_per_minibatch_ms": {name: period for name, _, period in rows},
        "ratios": ratios,
        "pipeplan_final_loss": {"1f1b-flush": flush["losses"][-1], "1f1b-rr": rr["losses"][-1],
                                "1-stage": one_stage["losses"][-1]},
        "pipelining_final_loss": baseline["losses"][-1],
        "plain_loop_final_loss": single["losses"][-1],
    })
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
