"""Benchmark: what checkpoints cost a GPT-2-sized run (issue 34, CheckFreq).

The bundled gpt at 8 blocks of width 512 with a vocabulary of 16384 (33.6M parameters,
Adam: about 400 MB of state) on 2 gloo ranks, 1F1B-Flush, trained ``--steps`` steps five
ways, side by side in one invocation:

- no checkpoints;
- synchronous saves every step (``--checkpoint-every 1``);
- asynchronous saves every step (``--checkpoint-every 1 --checkpoint-async``);
- ``--checkpoint-every auto --checkpoint-async`` (target ``--checkpoint-overhead``, 3.5%);
- a restart: ``--resume`` from the asynchronous run's last step, ``--restart-steps`` more.

steps/s is steps over the training wall time (``wall_ms`` of metrics.json: the first step
to the last checkpoint sealed); overhead is against the run without checkpoints. The
modes run interleaved ``--repeats`` times and each keeps its fastest run (a shared host's
load only ever slows a run); every run's wall time is in the JSON. The
per-rank stall, persist and bytes come from metrics.json; the restart figure is its
``start_to_first_step_ms`` (process start to the first resumed step's end, slowest rank)
beside the fresh run's. Prints a table and writes JSON (``--out``, default
bench/results/checkpoint.json).

    python bench/bench_checkpoint.py
    python bench/bench_checkpoint.py --steps 20 --batch-size 16
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
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

GPT_ENV = {
    "PIPEPLAN_GPT_LAYERS": "8",
    "PIPEPLAN_GPT_DIM": "512",
    "PIPEPLAN_GPT_HEADS": "8",
    "PIPEPLAN_GPT_VOCAB": "16384",
    "PIPEPLAN_GPT_SEQ": "64",
}
os.environ.update(GPT_ENV)  # before the model file is imported (it reads them once)

from launch import torchrun_pipeplan  # noqa: E402
from plans import make_plan  # noqa: E402

MODES: dict[str, list[str]] = {
    "none": [],
    "sync every step": ["--checkpoint-every", "1"],
    "async every step": ["--checkpoint-every", "1", "--checkpoint-async"],
    "auto (async)": ["--checkpoint-every", "auto", "--checkpoint-async"],
}


def run(
    folder: Path, name: str, options: list[str], steps: int, threads: int, timeout_s: float
) -> dict[str, Any]:
    """One torchrun launch of ``pipeplan run``; its metrics JSON plus ``launch_s``."""
    run_args = [
        str(folder / "plan.json"),
        "--model",
        bundled_model_path("gpt"),
        "--steps",
        str(steps),
        "--lr",
        "0.0003",
        "--no-progress",
        *options,
    ]
    out, stderr = torchrun_pipeplan(
        2, run_args, folder / f"{name}.json", threads=threads, timeout_s=timeout_s, what=name
    )
    out["stderr_lines"] = [
        line for line in stderr.splitlines() if line.startswith(("checkpoint:", "resume:"))
    ]
    return out


def row(name: str, metrics: dict[str, Any], baseline_wall_ms: float) -> dict[str, Any]:
    """The figures of one run: steps/s, overhead, and per rank stall / persist / bytes."""
    wall_ms = metrics["wall_ms"]
    ranks = [
        {
            "rank": s["rank"],
            "checkpoints": s.get("checkpoints", 0),
            "stall_ms": s.get("checkpoint_stall_ms"),
            "wait_ms": s.get("checkpoint_wait_ms"),
            "persist_ms": s.get("checkpoint_persist_ms"),
            "bytes": s.get("checkpoint_bytes"),
            "overhead_pct": s.get("checkpoint_overhead_pct"),
        }
        for s in metrics["stages"]
    ]
    return {
        "mode": name,
        "steps": metrics["steps"],
        "wall_ms": wall_ms,
        "steps_per_s": metrics["steps"] * 1000.0 / wall_ms,
        "overhead_pct": 100.0 * (wall_ms / baseline_wall_ms - 1.0),
        "checkpoint_every": metrics.get("checkpoint_every"),
        "predicted_overhead_pct": metrics.get("predicted_checkpoint_overhead_pct"),
        "start_to_first_step_ms": metrics.get("start_to_first_step_ms"),
        "ranks": ranks,
        "messages": metrics.get("stderr_lines", []),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--repeats", type=int, default=2, help="interleaved runs of each mode; the fastest counts"
    )
    parser.add_argument("--restart-steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint.json"))
    args = parser.parse_args()

    from pipeplan.capture import build_layer_graph
    from pipeplan.modelfile import load_model_file

    model = bundled_model_path("gpt")
    model_file = load_model_file(model)
    built = model_file.build()
    parameters = sum(p.numel() for p in built.parameters())
    layers = len(
        build_layer_graph(built, model_file.batch(args.batch_size // args.microbatches, 0)[0]).layers
    )
    half = layers // 2
    plan = make_plan(
        model,
        [list(range(half)), list(range(half, layers))],
        [1, 1],
        "1f1b-flush",
        batch_size=args.batch_size,
        microbatches=args.microbatches,
        optimizer="adam",
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plan.save(folder / "plan.json")
        results: dict[str, dict[str, Any]] = {}
        walls: dict[str, list[float]] = {name: [] for name in MODES}
        for _ in range(args.repeats):
            for index, (name, options) in enumerate(MODES.items()):
                ckpt = folder / f"ckpt-{index}"  # ckpt-2 (async every step) is resumed below
                shutil.rmtree(ckpt, ignore_errors=True)
                extra = ["--checkpoint-dir", str(ckpt), *options] if options else []
                metrics = run(folder, name, extra, args.steps, args.threads, args.timeout)
                walls[name].append(metrics["wall_ms"])
                if name not in results or metrics["wall_ms"] < results[name]["wall_ms"]:
                    results[name] = metrics
        base = results["none"]["wall_ms"]
        rows = [
            {**row(name, metrics, base), "every_wall_ms": walls[name]} for name, metrics in results.items()
        ]
        restart = run(
            folder,
            "restart",
            [
                "--checkpoint-dir",
                str(folder / "ckpt-2"),
                "--checkpoint-every",
                "1",
                "--checkpoint-async",
                "--resume",
            ],
            args.steps + args.restart_steps,
            args.threads,
            args.timeout,
        )
    restart_ms = restart.get("start_to_first_step_ms")
    fresh_ms = results["none"].get("start_to_first_step_ms")

    table = Table(
        title=(
            f"checkpoints of gpt ({parameters / 1e6:.1f}M parameters, Adam), 2 gloo ranks, 1f1b-flush, "
            f"batch {args.batch_size} x {args.microbatches} micro-batches, {args.steps} steps"
        )
    )
    for column in (
        "mode",
        "steps/s",
        "overhead %",
        "every (steps)",
        "stall ms/ckpt",
        "persist ms/ckpt",
        "written",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        counts = [x["checkpoints"] for x in r["ranks"]]
        stall = [x["stall_ms"] / x["checkpoints"] for x in r["ranks"] if x["checkpoints"]]
        persist = [x["persist_ms"] / x["checkpoints"] for x in r["ranks"] if x["checkpoints"]]
        written = sum(x["bytes"] or 0 for x in r["ranks"])
        every = r["checkpoint_every"]
        if every and r["predicted_overhead_pct"] is not None:
            every = f"{every} (predicted {r['predicted_overhead_pct']:.1f}%)"
        table.add_row(
            r["mode"],
            f"{r['steps_per_s']:.3f}",
            f"{r['overhead_pct']:+.1f}",
            str(every or "-"),
            " / ".join(f"{v:,.0f}" for v in stall) or "-",
            " / ".join(f"{v:,.0f}" for v in persist) or "-",
            f"{written / 1e6:,.0f} MB in {max(counts)} ckpts" if written else "-",
        )
    console = Console()
    console.print(table)
    console.print(
        f"start to first step: fresh {_seconds(fresh_ms)}; restart (--resume from step {args.steps}) "
        f"to the first resumed step: {_seconds(restart_ms)}"
    )
    out = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "model": {"gpt_env": GPT_ENV, "parameters": parameters, "layers": layers},
        "settings": vars(args),
        "rows": rows,
        "restart": {"start_to_first_step_ms": restart_ms, "fresh_start_to_first_step_ms": fresh_ms},
    }
    write_json_atomic(args.out, out)
    console.print(f"wrote {args.out}")


def _seconds(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000.0:.2f} s"


if __name__ == "__main__":
    main()
