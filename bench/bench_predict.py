"""Benchmark: measured over predicted time per minibatch, for every bundled model and HF family.

For each model: ``pipeplan profile`` (CPU, one thread, ``--batch-size``), then for each
micro-batch count (``--microbatches``, default 1 and 4) a plan of 2 stages on 2 devices
(``local-cpu`` with the message overhead ``pipeplan calibrate`` measures here first, unless
``--no-calibrate``; 1F1B-flush, one device per stage), trained on 2 gloo ranks under torchrun
(``bench/launch.py``) for ``--steps`` steps. The prediction is the plan's (its schedule
simulated with the profile's layer times, read at the micro-batch size where the profile
measured them: ``planner/microbatch_time.py``); the table also gives what the proportional
model (time per micro-batch = 1/M of the minibatch's) predicts for the same plan, and, per
stage, the measured compute over the compute the simulator charged it (its micro-batches at
their measured size and its optimizer step: ``stages[].predicted_compute_ms``; the worst of
the two stages). The Hugging Face families are the tiny configs of ``tests/fixtures/models/hf_family.py``
(nothing downloaded), those ``tests/test_hf_families.py`` runs and plans. Prints a rich
table and writes JSON (``--out``, default bench/results/predict.json).

    python bench/bench_predict.py
    python bench/bench_predict.py --models mlp hf:llama --microbatches 1 4 --steps 100
    python bench/bench_predict.py --device cuda --models hf:llama hf:gpt2 hf:mixtral

``--device cuda`` profiles with CUDA events and plans on ``--topology`` (default
``bench/one-h100.yaml``: one GPU, so one stage on one NCCL rank, torchrun's
``--nproc-per-node`` is the topology's device count); the CPU default is ``local-cpu``.

The machine's load moves every figure: run it on an idle machine and say so next to them.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeplan.jsonio import write_json_atomic
from pipeplan.modelfile import BUNDLED_MODELS, bundled_model_path
from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.partition import partition
from pipeplan.planner.simulate import simulate_plan
from pipeplan.profile import Profile
from pipeplan.topology import Topology, resolve

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from launch import torchrun_pipeplan  # noqa: E402

HF_MODEL = ROOT / "tests" / "fixtures" / "models" / "hf_family.py"
ONE_GPU = ROOT / "bench" / "one-h100.yaml"
# tests/test_hf_families.py: RUN and PLAN_ONLY
HF_FAMILIES = (
    "resnet", "llama", "mistral", "qwen2", "gemma3", "mixtral", "t5", "bart", "whisper", "vit",
    "qwen3", "phi3", "olmo", "gpt_neox", "qwen2_moe", "deepseek_v3", "modernbert", "gpt2", "bert",
)  # fmt: skip


def device_name(device: str) -> str:
    """The GPU's name on cuda, else the processor's."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return platform.processor() or platform.machine()


def model_target(name: str) -> tuple[str, dict[str, str]]:
    """(model file, environment) of a bundled model, an HF family (``hf:<family>``) or a file."""
    if Path(name).is_file():
        return name, {}
    if name.startswith("hf:"):
        return str(HF_MODEL), {"PIPEPLAN_HF_FAMILY": name[3:]}
    return str(bundled_model_path(name)), {}


def profile(
    name: str, batch_size: int, repeats: int, folder: Path, timeout_s: float, device: str = "cpu"
) -> tuple[Profile, float]:
    """``pipeplan profile`` in its own process (an HF family is picked at import); (profile, s)."""
    path, env = model_target(name)
    out = folder / "profile.json"
    command = [sys.executable, "-m", "pipeplan", "profile", path, "--device", device, "--threads", "1"]
    command += ["--batch-size", str(batch_size), "--repeats", str(repeats), "-o", str(out)]
    start = time.perf_counter()
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"profile of {name} failed: {done.stderr.strip()[-500:]}")
    return Profile.load(out), time.perf_counter() - start


def proportional(profile: Profile) -> Profile:
    """``profile`` without its times at smaller sizes: the proportional model."""
    layers = tuple(replace(layer, forward_ms_at=(), backward_ms_at=()) for layer in profile.layers)
    return replace(profile, layers=layers, timed_batch_sizes=())


def measure(
    name: str,
    prof: Profile,
    microbatches: int,
    steps: int,
    folder: Path,
    timeout_s: float,
    topology: Topology,
) -> dict[str, Any]:
    """Plan one stage per device of ``topology`` with ``microbatches`` (1F1B-flush) and train
    it on as many ranks (gloo on CPUs, NCCL on GPUs)."""
    options = PartitionOptions(schedule="1f1b-flush", microbatches=microbatches, straight=True)
    plan = partition(prof, topology, options)
    plan_path = folder / f"plan-m{microbatches}.json"
    plan.save(plan_path)
    path, env = model_target(name)
    os.environ.update(env)
    metrics, _ = torchrun_pipeplan(
        topology.world_size,
        [
            str(plan_path),
            "--model",
            path,
            "--steps",
            str(steps),
            "--lr",
            "1e-4",
            "--no-progress",
            "--allow-nonfinite",
        ],
        folder / f"metrics-m{microbatches}.json",
        threads=1,
        timeout_s=timeout_s,
        what=f"{name}, {microbatches} micro-batches",
    )
    predicted = metrics["predicted_time_per_minibatch_ms"]
    measured = metrics["time_per_minibatch_ms"]
    stage_compute = [
        s["compute_ms"] / s["predicted_compute_ms"]
        for s in metrics["stages"]
        if s.get("predicted_compute_ms")
    ]
    return {
        "model": name,
        "layers": len(prof.layers),
        "microbatches": microbatches,
        "stages": [list(stage.layers) for stage in plan.stages],
        "predicted_ms": predicted,
        "proportional_ms": simulate_plan(plan, proportional(prof)).time_per_minibatch_ms,
        "measured_ms": measured,
        "measured_over_predicted": measured / predicted,
        "stage_compute_over_predicted": stage_compute,
        "layers_vs_step": prof.layers_vs_step_ratio,
        "launch_s": metrics["launch_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default = [*BUNDLED_MODELS, *(f"hf:{family}" for family in HF_FAMILIES)]
    parser.add_argument("--models", nargs="+", default=default, help="bundled names and hf:<family>")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4])
    # 100, not 30: at 30 steps one hiccup moved a tiny model's figure by 40% (hf:mixtral at
    # M = 1: 7.36 ms in one bench, 5.06-5.27 ms in three 200-step runs), at ~1 s per launch more
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=10, help="profile repeats")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per profile or launch")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to profile and run")
    parser.add_argument(
        "--topology", default=None, help="file or preset (default: local-cpu, or bench/one-h100.yaml on cuda)"
    )
    parser.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the topology's message overhead here first (pipeplan calibrate; default: on CPU)",
    )
    parser.add_argument("--out", default=None, help="JSON (default: bench/results/predict[_cuda].json)")
    args = parser.parse_args()
    topology = resolve(args.topology or ("local-cpu" if args.device == "cpu" else str(ONE_GPU)))
    calibrated = args.device == "cpu" if args.calibrate is None else args.calibrate
    if calibrated:
        topology = calibrate(args.topology or "local-cpu", args.timeout)
    out = args.out or str(
        ROOT / "bench" / "results" / f"predict{'_cuda' if args.device == 'cuda' else ''}.json"
    )
    where = device_name(args.device)
    backend = "NCCL" if args.device == "cuda" else "gloo"
    console = Console()
    rows: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                prof, profile_s = profile(
                    name, args.batch_size, args.repeats, Path(tmp), args.timeout, args.device
                )
                for m in args.microbatches:
                    row = measure(name, prof, m, args.steps, Path(tmp), args.timeout, topology)
                    row["profile_s"] = profile_s
                    rows.append(row)
                    console.print(
                        f"{name} M={m}: measured {row['measured_ms']:.2f} ms vs predicted "
                        f"{row['predicted_ms']:.2f} ms ({row['measured_over_predicted']:.2f}x)",
                        highlight=False,
                    )
            except (RuntimeError, SystemExit, subprocess.TimeoutExpired) as exc:
                failures[name] = (
                    str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
                )
                console.print(f"[red]{name}: {failures[name]}[/]")
    table = Table(
        title=f"measured / predicted time per minibatch: {topology.world_size} stage(s) on "
        f"{topology.world_size} {backend} rank(s), 1F1B-flush, batch {args.batch_size}, "
        f"{args.steps} steps ({where})"
    )
    for column in (
        "model",
        "layers",
        "M",
        "predicted ms",
        "proportional ms",
        "measured ms",
        "measured / predicted",
        "measured / proportional",
        "worst stage compute / predicted",
        "layers / step",
    ):
        table.add_column(column, justify="right" if column != "model" else "left")
    for r in rows:
        table.add_row(
            r["model"],
            str(r["layers"]),
            str(r["microbatches"]),
            f"{r['predicted_ms']:.2f}",
            f"{r['proportional_ms']:.2f}",
            f"{r['measured_ms']:.2f}",
            f"{r['measured_over_predicted']:.2f}",
            f"{r['measured_ms'] / r['proportional_ms']:.2f}",
            f"{max(r['stage_compute_over_predicted'], key=lambda x: abs(x - 1.0), default=float('nan')):.2f}",
            f"{r['layers_vs_step']:.2f}",
        )
    console.print(table)
    summary = _summary(rows)
    for line in summary["lines"]:
        console.print(line, highlight=False)
    for name, why in failures.items():
        console.print(f"not measured: {name}: {why}", highlight=False)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        out,
        {
            "batch_size": args.batch_size,
            "steps": args.steps,
            "microbatches": args.microbatches,
            "device": args.device,
            "ranks": topology.world_size,
            "machine": where,
            "message_overhead_ms": topology.levels[0].message_overhead_ms,
            "calibrated": calibrated,
            "rows": rows,
            "summary": {k: v for k, v in summary.items() if k != "lines"},
            "failures": failures,
        },
    )
    console.print(f"wrote {out}")


def calibrate(topology: str, timeout_s: float) -> Topology:
    """``topology`` with the message overhead ``pipeplan calibrate`` measures here now: a
    preset's figure is one machine's on one day (231 and 443 us on the dev VM)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "measured.yaml"
        command = [sys.executable, "-m", "pipeplan", "calibrate", "--topology", topology, "-o", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=4 * timeout_s)
        if done.returncode != 0:
            raise SystemExit(f"pipeplan calibrate failed: {done.stderr.strip()[-500:]}")
        measured = resolve(str(out))
    print(f"calibrated: message overhead {measured.levels[0].message_overhead_ms * 1e3:.0f} us", flush=True)
    return measured


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst measured / predicted (and / proportional) over the rows, per M and all."""
    out: dict[str, Any] = {"lines": []}
    groups: dict[str, list[dict[str, Any]]] = {"all": rows}
    for r in rows:
        groups.setdefault(f"M={r['microbatches']}", []).append(r)
    for key, group in groups.items():
        if not group:
            continue
        ours = [r["measured_over_predicted"] for r in group]
        theirs = [r["measured_ms"] / r["proportional_ms"] for r in group]
        figures = {
            "median": statistics.median(ours),
            "worst": max(ours, key=lambda x: abs(x - 1.0)),
            "within_25pct": sum(abs(x - 1.0) <= 0.25 for x in ours),
            "rows": len(group),
            "proportional_median": statistics.median(theirs),
            "proportional_worst": max(theirs, key=lambda x: abs(x - 1.0)),
        }
        out[key] = figures
        out["lines"].append(
            f"{key}: measured / predicted median {figures['median']:.2f}, worst {figures['worst']:.2f}, "
            f"{figures['within_25pct']} of {figures['rows']} within 25%; proportional model: median "
            f"{figures['proportional_median']:.2f}, worst {figures['proportional_worst']:.2f}"
        )
    return out


if __name__ == "__main__":
    main()
