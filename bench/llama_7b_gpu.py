"""The 7B Llama on one GPU: profile it, plan it for two H100 nodes, train one stage's worth of it.

1. ``pipeplan profile bench/llama_7b.py`` in bf16 at sequence 2048 on the GPU (meta build,
   one layer materialised at a time), with the profile process's own peak RSS (``os.wait4``)
   and peak CUDA allocation (``max_memory_allocated``, printed by the process itself).
2. ``pipeplan partition`` of that profile for two 8-GPU H100 nodes (Adam).
3. One stage's worth of it: a Llama of the same width with as many decoder layers as the
   plan's first stage holds (with the embedding, final norm and head), saved in bf16 with
   ``save_pretrained`` from a seeded initialisation; its first loss computed in that process,
   in bf16, on minibatch 0 (``sample_batch`` under ``torch.manual_seed(0)``).
4. That model profiled and planned on one H100 (1F1B-flush, micro-batches as gradient
   accumulation), trained with ``torchrun --nproc-per-node 1 -m pipeplan run --weights DIR
   --dtype bfloat16`` (NCCL), then ``pipeplan report``: the first loss against step 3's, and the
   plan's per-device memory against the rank's measured ``max_memory_allocated``.

Prints a table and writes JSON (``--out``, default bench/results/llama-7b-gpu/summary.json).

    python bench/llama_7b_gpu.py                       # on a GPU machine
    python bench/llama_7b_gpu.py --layers 2 --seq 128 --device cpu --stage-layers 1   # a dry run

The driver itself imports no torch before step 1, so the profile's peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "bench" / "llama_7b.py")

# Runs `pipeplan ARGS` in this process and prints its peak CUDA allocation (bytes) last on stderr.
_WRAP = (
    "import sys, runpy, torch\nsys.argv = ['pipeplan', *sys.argv[1:]]\ntry:\n"
    "    runpy.run_module('pipeplan', run_name='__main__', alter_sys=True)\nfinally:\n"
    "    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0\n"
    "    print(f'PEAK_CUDA_BYTES {peak}', file=sys.stderr)\n"
)


def run_step(
    name: str, command: list[str], env: dict[str, str], log: Path, timeout_s: float
) -> dict[str, Any]:
    """Run ``command``; its exit code, wall time, own peak RSS (bytes) and, for a wrapped
    pipeplan command, its peak CUDA allocation. Output goes to ``log``."""
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except BaseException:
            process.kill()
            raise
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    text = log.read_text()
    peak_cuda = [int(line.split()[1]) for line in text.splitlines() if line.startswith("PEAK_CUDA_BYTES")]
    result = {
        "step": name,
        "exit": code,
        "wall_s": round(wall, 1),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "peak_cuda_bytes": peak_cuda[-1] if peak_cuda else None,
    }
    print(
        f"{name}: exit {code}, {wall:.1f} s, peak RSS {usage.ru_maxrss / 2**20:.2f} GiB"
        + (f", peak CUDA {peak_cuda[-1] / 2**30:.2f} GiB" if peak_cuda else ""),
        flush=True,
    )
    if code != 0:
        print(text[-3000:], flush=True)
        raise SystemExit(f"{name} failed (exit {code}); log: {log}")
    return result


def pipeplan(*args: str) -> list[str]:
    return [sys.executable, "-c", _WRAP, *args]


def stage_decoder_layers(profile: Path, plan: Path, stage: int) -> int:
    """Decoder layers (``LlamaDecoderLayer``) in ``stage`` of ``plan``."""
    layers = json.loads(profile.read_text())["layers"]
    chosen = json.loads(plan.read_text())["stages"][stage]
    share = layers[chosen["layer_start"] : chosen["layer_end"]]
    return sum(layer["type"] == "LlamaDecoderLayer" for layer in share)


def save_weights(folder: str, batch_size: int, device: str) -> None:
    """(In a child process.) Seeded bf16 weights of the model as configured by the environment,
    ``save_pretrained`` to ``folder``, and minibatch 0's loss in bf16 to ``folder``/first_loss.json."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import llama_7b

    torch.manual_seed(1234)
    with torch.device(device):
        model = llama_7b.build_model().to(torch.bfloat16)
    model.save_pretrained(folder)
    torch.manual_seed(0)  # minibatch 0 of a run with --seed 0
    inputs, targets = llama_7b.sample_batch(batch_size)
    with torch.no_grad():
        logits = model(inputs.to(device)).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten())
    Path(folder, "first_loss.json").write_text(json.dumps({"loss": float(loss)}))
    print(
        f"saved {sum(p.numel() for p in model.parameters()) / 1e9:.2f}e9 parameters; first loss {float(loss):.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the profiled model")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=4, help="of the stage run (the 7B profile: 1)")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-4, help="Adam's, after 5 steps of warm-up")
    parser.add_argument(
        "--stage-layers",
        type=int,
        default=0,
        help="decoder layers of the trained model (default: those of the plan's first stage)",
    )
    parser.add_argument("--topology", default=str(ROOT / "bench" / "two-h100-nodes.yaml"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "llama-7b-gpu")
    parser.add_argument("--save-weights", help=argparse.SUPPRESS)  # the child of step 3
    args = parser.parse_args()
    if args.save_weights:
        return save_weights(args.save_weights, args.batch_size, args.device)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PIPEPLAN_LLAMA_SEQ": str(args.seq), "PIPEPLAN_LLAMA_LAYERS": str(args.layers)}
    summary: dict[str, Any] = {"layers": args.layers, "seq": args.seq, "device": args.device, "steps": []}

    def step(
        name: str, command: list[str], step_env: dict[str, str], timeout_s: float = 900
    ) -> dict[str, Any]:
        record = run_step(name, command, step_env, out / f"{name}.log", timeout_s)
        summary["steps"].append(record)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        return record

    profile, plan = out / "profile-7b.json", out / "plan-7b.json"
    step(
        "profile-7b",
        pipeplan(
            "profile", MODEL, "--device", args.device, "--dtype", "bfloat16", "-b", "1", "-o", str(profile)
        ),
        env,
    )
    step(
        "partition-7b",
        pipeplan(
            "partition", str(profile), "--topology", args.topology, "--optimizer", "adam", "-o", str(plan)
        ),
        env,
    )
    layers = args.stage_layers or stage_decoder_layers(profile, plan, 0)
    summary["stage_layers"] = layers
    stage_env = {**env, "PIPEPLAN_LLAMA_LAYERS": str(layers)}
    weights = out / "weights"
    step(
        "save-weights",
        [
            sys.executable,
            __file__,
            "--save-weights",
            str(weights),
            "--batch-size",
            str(args.batch_size),
            "--device",
            args.device,
        ],
        stage_env,
    )
    stage_profile, stage_plan = out / "profile-stage.json", out / "plan-stage.json"
    step(
        "profile-stage",
        pipeplan(
            "profile",
            MODEL,
            "--device",
            args.device,
            "--dtype",
            "bfloat16",
            "-b",
            str(args.batch_size),
            "-o",
            str(stage_profile),
        ),
        stage_env,
    )
    step(
        "partition-stage",
        pipeplan(
            "partition",
            str(stage_profile),
            "--topology",
            str(ROOT / "bench" / "one-h100.yaml"),
            "--schedule",
            "1f1b-flush",
            "--microbatches",
            str(args.microbatches),
            "--optimizer",
            "adam",
            "-o",
            str(stage_plan),
        ),
        stage_env,
    )
    metrics = out / "metrics.json"
    step(
        "run-stage",
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "1",
            "-m",
            "pipeplan",
            "run",
            str(stage_plan),
            "--model",
            MODEL,
            "--weights",
            str(weights),
            "--dtype",
            "bfloat16",
            "--steps",
            str(args.steps),
            "--optimizer",
            "adam",
            "--lr",
            str(args.lr),
            "--warmup-steps",
            "5",
            "--no-progress",
            "--metrics",
            str(metrics),
        ],
        stage_env,
    )
    step("report", pipeplan("report", str(metrics)), stage_env)
    ran = json.loads(metrics.read_text())
    stage = json.loads(stage_plan.read_text())["stages"][0]
    measured = ran["stages"][0]
    summary["first_loss"] = {
        "run": ran["losses"][0],
        "reference_bf16": json.loads((weights / "first_loss.json").read_text())["loss"],
    }
    summary["losses"] = ran["losses"]
    summary["memory"] = {"planned_bytes": stage["memory_bytes"], "metrics_stage": measured}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("stage_layers", "first_loss", "memory")}, indent=1))


if __name__ == "__main__":
    main()
