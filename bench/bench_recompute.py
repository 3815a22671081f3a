"""Benchmark: recomputation planned per stage on a measured profile, run, measured against the plan.

Issue 30's measured check: `bench/llama_long.py` (a small eager-attention HF Llama on 1,024
tokens, whose attention probabilities dominate its activations) is profiled on this CPU
(``bench/bench_predict.py``'s ``profile``: one thread, ``--batch-size``), then planned on
``local-cpu`` (2 devices, one per stage, 1F1B-flush, ``--microbatches``) with its device
memory set from the profile's own figures: ``memory_limit`` finds by bisection the least
device memory at which each ``--recompute`` mode plans, and takes the midpoint between
``auto``'s and ``none``'s, so that ``none`` does not fit and recomputation must. Each mode's
plan is printed (predicted ms per minibatch, per-stage recomputed and selective layers,
memory against the device's); ``auto`` must not predict worse than ``none``: asserted at
the limit, at ``none``'s least memory and with unlimited memory, wherever ``none`` fits. The
``auto`` plan then trains ``--steps`` steps on 2 gloo ranks (``bench/launch.py``), and, as a
reference beside it, the ``none`` plan with unlimited memory (the fastest ``none`` plan):
measured ms per minibatch (the run's metrics) against predicted,
and each rank's held memory (peak less baseline, RSS) against the plan's figure. Prints
tables and writes JSON (``--out``, default bench/results/recompute_cpu.json).

``--device cuda`` profiles on the GPU and plans on ``--topology`` (default
``bench/one-h100.yaml``: one GPU, so one stage on one NCCL rank, whose held memory is the
CUDA allocator's peak over its baseline); its JSON defaults to bench/results/recompute_cuda.json.

    python bench/bench_recompute.py
    python bench/bench_recompute.py --steps 10 --microbatches 2
    python bench/bench_recompute.py --device cuda --batch-size 8

Figures move with the machine's load: the JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeplan.errors import InfeasibleError
from pipeplan.jsonio import write_json_atomic
from pipeplan.plan import Plan
from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.partition import partition
from pipeplan.profile import Profile
from pipeplan.topology import Topology, resolve

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_predict import ONE_GPU, device_name, profile  # noqa: E402
from launch import torchrun_pipeplan  # noqa: E402

MODEL = ROOT / "bench" / "llama_long.py"
MODES = ("none", "selective", "full", "auto")
MiB = 1 << 20


def with_memory(topology: Topology, memory_bytes: int) -> Topology:
    """``topology`` with each device holding ``memory_bytes``."""
    return dataclasses.replace(
        topology, device=dataclasses.replace(topology.device, memory_bytes=memory_bytes)
    )


def plan_or_none(
    prof: Profile, topology: Topology, options: PartitionOptions, memory_bytes: int
) -> Plan | None:
    """The plan of ``prof`` on devices of ``memory_bytes``, or None when no plan fits."""
    try:
        return partition(prof, with_memory(topology, memory_bytes), options)
    except InfeasibleError:
        return None


def least_memory(prof: Profile, topology: Topology, options: PartitionOptions, resolution: int = MiB) -> int:
    """The least device memory (to ``resolution`` bytes) at which ``options`` plans ``prof``
    (what fits only grows with memory; the plan at 1 PiB's stage memory, doubled until it
    plans, bounds it from above)."""
    roomy = plan_or_none(prof, topology, options, 1 << 50)
    if roomy is None:
        raise InfeasibleError(f"recompute {options.recompute}: no plan fits even at 1 PiB per device")
    low, high = 0, max(stage.memory_bytes for stage in roomy.stages)
    while plan_or_none(prof, topology, options, high) is None:  # the planner may keep headroom
        low, high = high, 2 * high
    while high - low > resolution:
        middle = (low + high) // 2
        if plan_or_none(prof, topology, options, middle) is None:
            low = middle
        else:
            high = middle
    return high


def memory_limit(least: dict[str, int]) -> int:
    """The device memory of the benchmark: midway between the least memory at which ``auto``
    plans and that at which ``none`` does, so ``none`` does not fit and ``auto`` must
    recompute; a one-line error when recomputation saves nothing."""
    if least["auto"] >= least["none"]:
        raise InfeasibleError(
            f"recomputation frees nothing here: auto needs {least['auto'] / MiB:.1f} MiB, "
            f"none {least['none'] / MiB:.1f} MiB per device"
        )
    return (least["auto"] + least["none"]) // 2


def auto_against_none(
    prof: Profile, topology: Topology, options: dict[str, PartitionOptions], memories: Sequence[int]
) -> list[dict[str, Any]]:
    """``auto``'s and ``none``'s predicted ms per minibatch at each of ``memories`` bytes per
    device; asserts that ``auto`` never predicts worse than ``none`` where ``none`` fits."""
    checks = []
    for memory in memories:
        found = {mode: plan_or_none(prof, topology, options[mode], memory) for mode in ("auto", "none")}
        ms = {m: p.predicted.time_per_minibatch_ms if p is not None else None for m, p in found.items()}
        if ms["none"] is not None:
            assert ms["auto"] is not None and ms["auto"] <= ms["none"], (memory, ms)
        where = "unlimited" if memory >= 1 << 50 else f"{memory / MiB:.1f} MiB"
        line = f"at {where} per device: auto {_ms(ms['auto'])}, none {_ms(ms['none'])}" + (
            " (auto <= none: asserted)" if ms["none"] is not None else " (none does not fit)"
        )
        checks.append({"memory_bytes": memory, "auto_ms": ms["auto"], "none_ms": ms["none"], "line": line})
    return checks


def _ms(ms: float | None) -> str:
    return "no plan fits" if ms is None else f"{ms:.1f} ms per minibatch"


def stage_choices(plan: Plan) -> str:
    """Each stage's layers, recomputed and selective layers, and memory, one stage a line."""
    return "\n".join(
        f"s{s.index} [{s.layer_start}, {s.layer_end}): full {list(s.recompute_layers) or '-'}, "
        f"selective {list(s.selective_layers) or '-'}, {s.memory_bytes / MiB:.1f} MiB"
        for s in plan.stages
    )


def run_plan(plan: Plan, name: str, folder: Path, steps: int, timeout_s: float) -> dict[str, Any]:
    """Train ``plan`` on its ranks; measured against predicted time and memory per rank."""
    path = folder / f"plan-{name}.json"
    plan.save(path)
    args = [str(path), "--model", str(MODEL), "--steps", str(steps), "--lr", "1e-4", "--no-progress"]
    metrics, _ = torchrun_pipeplan(
        plan.world_size, args, folder / f"metrics-{name}.json", threads=1, timeout_s=timeout_s, what=name
    )
    ranks = [
        {
            "rank": s["rank"],
            "held_bytes": s["peak_memory_bytes"] - s["baseline_memory_bytes"],
            "predicted_bytes": s["predicted_memory_bytes"],
            "compute_ms": s["compute_ms"],
            "predicted_compute_ms": s["predicted_compute_ms"],
        }
        for s in metrics["stages"]
        if s.get("peak_memory_bytes") is not None
    ]
    return {
        "plan": name,
        "steps": metrics["steps"],
        "predicted_ms": metrics["predicted_time_per_minibatch_ms"],
        "measured_ms": metrics["time_per_minibatch_ms"],
        "measured_over_predicted": metrics["time_per_minibatch_ms"]
        / metrics["predicted_time_per_minibatch_ms"],
        "ranks": ranks,
        "launch_s": metrics["launch_s"],
    }


def load_average() -> str:
    """/proc/loadavg's first three figures (empty where there is none)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="profile repeats")
    parser.add_argument("--no-reference", action="store_true", help="do not run the none plan")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per profile or launch")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to profile and run")
    parser.add_argument(
        "--topology", default=None, help="file or preset (default: local-cpu, or bench/one-h100.yaml on cuda)"
    )
    parser.add_argument("--out", default=None, help="JSON (default: bench/results/recompute_<device>.json)")
    args = parser.parse_args(argv)
    args.out = args.out or str(ROOT / "bench" / "results" / f"recompute_{args.device}.json")
    console = Console()
    load_before = load_average()
    base = PartitionOptions(schedule="1f1b-flush", microbatches=args.microbatches, straight=True)
    topology = resolve(args.topology or ("local-cpu" if args.device == "cpu" else str(ONE_GPU)))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prof, profile_s = profile(
            str(MODEL), args.batch_size, args.repeats, folder, args.timeout, args.device
        )
        console.print(
            f"profile: {len(prof.layers)} layers, batch {args.batch_size}, {profile_s:.0f} s; "
            f"saved for backward {sum(layer.saved_bytes for layer in prof.layers) / MiB:.1f} MiB, "
            f"parameters {sum(layer.param_bytes for layer in prof.layers) / MiB:.2f} MiB",
            highlight=False,
        )
        options = {mode: dataclasses.replace(base, recompute=mode) for mode in MODES}
        least = {mode: least_memory(prof, topology, options[mode]) for mode in MODES}
        limit = memory_limit(least)
        console.print(
            "least memory per device at which each mode plans: "
            + ", ".join(f"{mode} {least[mode] / MiB:.1f} MiB" for mode in MODES)
            + f"; device memory set to {limit / MiB:.1f} MiB (midway between auto and none)",
            highlight=False,
        )
        plans = {mode: plan_or_none(prof, topology, options[mode], limit) for mode in MODES}
        auto = plans["auto"]
        assert auto is not None, "auto plans at its own least memory, below the limit"
        checks = auto_against_none(prof, topology, options, (limit, least["none"], 1 << 50))
        table = Table(
            title=f"{MODEL.name} on {topology.name}, {topology.world_size} device(s) of {limit / MiB:.1f} MiB, 1f1b-flush, "
            f"batch {args.batch_size} x {args.microbatches} micro-batches"
        )
        for column in ("--recompute", "predicted ms / minibatch", "stages: recomputed, MiB"):
            table.add_column(column, justify="left" if column != "predicted ms / minibatch" else "right")
        rows: list[dict[str, Any]] = []
        for mode, plan in plans.items():
            predicted = plan.predicted.time_per_minibatch_ms if plan is not None else None
            table.add_row(
                mode,
                f"{predicted:.1f}" if predicted is not None else "no plan fits",
                stage_choices(plan) if plan is not None else "-",
            )
            rows.append(
                {
                    "recompute": mode,
                    "least_memory_bytes": least[mode],
                    "predicted_ms": predicted,
                    "stages": [dataclasses.asdict(s) for s in plan.stages] if plan is not None else None,
                }
            )
        console.print(table)
        for check in checks:
            console.print(check["line"], highlight=False)
        runs = [run_plan(auto, "auto", folder, args.steps, args.timeout)]
        reference = plan_or_none(prof, topology, options["none"], 1 << 50)
        if not args.no_reference and reference is not None:
            runs.append(run_plan(reference, "none, unlimited memory", folder, args.steps, args.timeout))
    load_after = load_average()
    measured = Table(
        title=f"measured on {topology.world_size} {'NCCL' if args.device == 'cuda' else 'gloo'} rank(s), "
        f"{args.steps} steps, 1 thread each (load average before "
        f"{load_before}, after {load_after})"
    )
    for column in (
        "plan",
        "predicted ms",
        "measured ms",
        "measured / predicted",
        "held / planned MiB per rank",
        "compute / predicted ms per rank",
    ):
        measured.add_column(column, justify="right" if column != "plan" else "left")
    for r in runs:
        measured.add_row(
            r["plan"],
            f"{r['predicted_ms']:.1f}",
            f"{r['measured_ms']:.1f}",
            f"{r['measured_over_predicted']:.2f}",
            "; ".join(f"{x['held_bytes'] / MiB:.0f} / {x['predicted_bytes'] / MiB:.0f}" for x in r["ranks"]),
            "; ".join(f"{x['compute_ms']:.0f} / {x['predicted_compute_ms']:.0f}" for x in r["ranks"]),
        )
    console.print(measured)
    write_json_atomic(
        args.out,
        {
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "device": device_name(args.device),
            },
            "load_average": {"before": load_before, "after": load_after},
            "settings": vars(args),
            "profile_s": profile_s,
            "least_memory_bytes": least,
            "memory_limit_bytes": limit,
            "plans": rows,
            "auto_against_none": [{k: v for k, v in c.items() if k != "line"} for c in checks],
            "runs": runs,
        },
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
