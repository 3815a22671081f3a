"""Benchmark: pipeplan's runtime against torch.distributed.pipelining and a plain loop.

Same model file, batch, micro-batches, split and learning rate for every pair (CPU, gloo),
on 2 and 4 ranks (``--ranks``), each pair measured back to back:

- pipeplan ``1f1b-flush`` vs ``Schedule1F1B`` (one stage per rank);
- pipeplan ``interleaved-1f1b`` vs ``ScheduleInterleaved1F1B`` (2 chunks per rank);
- pipeplan ``zb-h1`` vs ``ScheduleInterleavedZeroBubble`` (one stage per rank);
- a 1-stage pipeplan run vs a plain single-process training loop: the runtime's own
  overhead (scheduling, data, bookkeeping) with no communication.

The default model (``bench/deep_mlp.py``) is 8 equal blocks, so every split is balanced.
pipeplan's figure is its steady-state ``samples_per_s`` from ``--metrics`` (the spacing of
minibatch completions after warm-up); torch's is the timed steps after warm-up. Both
draw their minibatches before the timed loop. Prints a rich table with the ratios and
writes JSON (``--out``, default bench/results/runtime.json).

    python bench/bench_runtime.py
    python bench/bench_runtime.py --ranks 2 --batch-size 128 --microbatches 8 --steps 10
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeplan.jsonio import write_json_atomic
from pipeplan.modelfile import bundled_model_path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "runtime"))
sys.path.insert(0, str(ROOT / "bench"))

from launch import torchrun_pipeplan  # noqa: E402
from plans import make_plan  # noqa: E402


def run_pipeplan(
    model_path: str,
    stage_layers: list[list[int]],
    schedule: str,
    batch_size: int,
    microbatches: int,
    steps: int,
    lr: float,
    threads: int,
    timeout_s: float,
    virtual_stages: int = 1,
) -> dict[str, Any]:
    """One torchrun launch of ``pipeplan run``; returns its metrics JSON plus ``launch_s``."""
    plan = make_plan(
        model_path,
        stage_layers,
        [1] * len(stage_layers),
        schedule,
        batch_size=batch_size,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
    )
    ranks = len(stage_layers) // virtual_stages
    with tempfile.TemporaryDirectory() as folder:
        plan.save(Path(folder) / "plan.json")
        run_args = [
            str(Path(folder) / "plan.json"),
            "--model",
            model_path,
            "--steps",
            str(steps),
            "--lr",
            str(lr),
            "--no-progress",
        ]
        out, _ = torchrun_pipeplan(
            ranks,
            run_args,
            Path(folder) / "metrics.json",
            threads=threads,
            timeout_s=timeout_s,
            what=schedule,
        )
        return out


def equal_split(children: int, stages: int) -> list[list[int]]:
    """``stages`` runs of Sequential children, equal but for the last (which adds the rest).

    >>> equal_split(17, 4)
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16]]
    """
    size = children // stages
    bounds = [q * size for q in range(stages)] + [children]
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]


# (pipeplan schedule, torch schedule, chunks per rank)
PAIRS = (
    ("1f1b-flush", "Schedule1F1B", 1),
    ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2),
    ("zb-h1", "ScheduleInterleavedZeroBubble", 1),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=str(ROOT / "bench" / "deep_mlp.py"),
        help="an nn.Sequential model.py path or a bundled model name",
    )
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="launch every pair this many times (alternating which goes first); report medians",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "runtime.json"))
    args = parser.parse_args()

    from pipelining_baseline import run_pipelining_baseline, run_single_process_baseline

    model_path = args.model if args.model.endswith(".py") else bundled_model_path(args.model)
    from pipeplan.modelfile import load_model_file

    children = len(load_model_file(model_path).build())
    cores = os.cpu_count() or 2
    total = args.steps + args.warmup
    console = Console()
    console.print(
        f"model {model_path}: {children} Sequential children, batch {args.batch_size}, "
        f"{args.microbatches} micro-batches, {args.steps} timed steps, {cores} cores"
    )

    rows: list[dict[str, Any]] = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        threads = max(1, cores // ranks)
        for ours, theirs, chunks in PAIRS:
            split = equal_split(children, ranks * chunks)
            boundaries = [layers[0] for layers in split[1:]]
            mine_rates, base_rates = [], []
            for repeat in range(args.repeats):
                launches = [
                    lambda: mine_rates.append(
                        run_pipeplan(
                            model_path,
                            split,
                            ours,
                            args.batch_size,
                            args.microbatches,
                            total,
                            args.lr,
                            threads,
                            args.timeout,
                            virtual_stages=chunks,
                        )
                    ),
                    lambda: base_rates.append(
                        run_pipelining_baseline(
                            model_path,
                            boundaries,
                            args.batch_size,
                            args.microbatches,
                            args.steps,
                            args.lr,
                            warmup_steps=args.warmup,
                            threads_per_rank=threads,
                            timeout_s=args.timeout,
                            schedule=theirs,
                            virtual_stages=chunks,
                        )
                    ),
                ]
                for launch in launches if repeat % 2 == 0 else reversed(launches):
                    launch()
            mine_rate = statistics.median(r["samples_per_s"] for r in mine_rates)
            base_rate = statistics.median(r["samples_per_s"] for r in base_rates)
            rows.append(
                {
                    "ranks": ranks,
                    "pipeplan": ours,
                    "torch": theirs,
                    "chunks_per_rank": chunks,
                    "split": split,
                    "threads_per_rank": threads,
                    "pipeplan_samples_per_s": mine_rate,
                    "torch_samples_per_s": base_rate,
                    "ratio": mine_rate / base_rate,
                    "pipeplan_samples_per_s_each": [r["samples_per_s"] for r in mine_rates],
                    "torch_samples_per_s_each": [r["samples_per_s"] for r in base_rates],
                    "pipeplan_final_loss": mine_rates[0]["losses"][-1],
                    "torch_final_loss": base_rates[0]["losses"][-1],
                }
            )
    one_stage = run_pipeplan(
        model_path,
        [list(range(children))],
        "1f1b-flush",
        args.batch_size,
        1,
        total,
        args.lr,
        cores,
        args.timeout,
    )
    single = run_single_process_baseline(
        model_path, args.batch_size, args.steps, args.lr, warmup_steps=args.warmup, threads=cores
    )
    rows.append(
        {
            "ranks": 1,
            "pipeplan": "1 stage",
            "torch": "plain training loop",
            "chunks_per_rank": 1,
            "split": [list(range(children))],
            "threads_per_rank": cores,
            "pipeplan_samples_per_s": one_stage["samples_per_s"],
            "torch_samples_per_s": single["samples_per_s"],
            "ratio": one_stage["samples_per_s"] / single["samples_per_s"],
            "pipeplan_final_loss": one_stage["losses"][-1],
            "torch_final_loss": single["losses"][-1],
        }
    )

    table = Table(title="pipeplan runtime vs torch.distributed.pipelining (CPU, gloo)")
    for column in ("ranks", "pipeplan", "samples/s", "torch", "samples/s ", "ratio"):
        table.add_column(column, justify="left" if column in ("pipeplan", "torch") else "right")
    for row in rows:
        table.add_row(
            str(row["ranks"]),
            row["pipeplan"],
            f"{row['pipeplan_samples_per_s']:,.1f}",
            row["torch"],
            f"{row['torch_samples_per_s']:,.1f}",
            f"{row['ratio']:.2f}x",
        )
    console.print(table)
    write_json_atomic(
        args.out,
        {
            "benchmark": "runtime",
            "machine": {
                "platform": platform.platform(),
                "cores": cores,
                "load_average_1m": os.getloadavg()[0],
            },
            "settings": {
                "model": model_path,
                "children": children,
                "batch_size": args.batch_size,
                "microbatches": args.microbatches,
                "steps": args.steps,
                "warmup": args.warmup,
                "lr": args.lr,
                "repeats": args.repeats,
            },
            "runs": rows,
        },
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
