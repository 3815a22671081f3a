"""Korthikanti et al.'s GPT configurations planned by pipeplan: full recomputation against
selective recomputation with sequence parallelism, chosen per stage.

Source: V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", MLSys 2023 (arXiv 2205.05198): Table 3 (the four GPT configurations on A100s:
heads, hidden, layers, t, p, GPUs, global batch; s = 2048, micro-batches of one sequence
except the 22B row's one micro-batch of 4), Table 4 (end-to-end iteration time with full
recomputation and with the paper's selective recomputation + sequence parallelism) and
Table 5 (that MFU). The paper's full-recomputation MFU is Table 5's MFU x Table 4's time
ratio (the same model FLOPs per iteration). The figures below were transcribed from the
paper: this session could not retrieve its tables through its search tool, so check them
against the PDF before quoting; the 530B row's 2,240-GPU figures of the abstract (42.1% and
54.2% MFU) agree with them within the data-parallel all-reduce (the table's row is 280 GPUs).

For each row, on the paper's GPU count of A100 80 GB (``bench_ptdp.megatron_cluster``: 8 per
node over NVLink, InfiniBand between nodes) and the paper's global batch, from the what-if
profile estimated *without* recomputation (``pipeplan estimate --no-recompute``: every block
carries its full and selective options, Korthikanti et al.'s Table 2 bytes), pipeplan plans:

- ``full``: ``--recompute full --sequence-parallel off`` (the paper's baseline), over the
  schedules that recompute (1F1B, GPipe) x micro-batch counts x t, p, d;
- ``auto``: everything ``auto`` (recomputation none / selective / full per stage, sequence
  parallelism, sharded replicas) over ``bench_ptdp.SCHEDULES``.

Predicted MFU: the model FLOPs of an iteration (Korthikanti et al. eq. in section 6 /
Narayanan et al.: 72 B s l h^2 (1 + s / (6 h) + V / (12 l h)), recomputation not counted)
over the predicted iteration time, the GPU count and the A100's 312 TFLOP/s. Prints a
markdown table, writes JSON.

    python bench/bench_memory_plan.py --out bench/results/memory_plan.json
    python bench/bench_memory_plan.py --rows 22,175
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ptdp import SCHEDULES, megatron_cluster  # noqa: E402

from pipeplan.errors import InfeasibleError, InputError  # noqa: E402
from pipeplan.jsonio import write_json_atomic  # noqa: E402
from pipeplan.plan import Plan  # noqa: E402
from pipeplan.planner.auto import search  # noqa: E402
from pipeplan.planner.partition import PartitionOptions  # noqa: E402
from pipeplan.profile import Profile  # noqa: E402
from pipeplan.profiler.estimate import DEVICE_RATES, GPTShape, estimate_gpt  # noqa: E402

PEAK_FLOPS = DEVICE_RATES["a100-80gb"].matmul_flops_per_s  # 312 TFLOP/s dense bf16
FULL_SCHEDULES = ("1f1b-flush", "gpipe")  # the schedules pipeplan plans recomputation with
TARGET_GAIN = 1.25


@dataclass(frozen=True)
class Row:
    """One configuration of the paper's Table 3, with its Tables 4 and 5 figures."""

    name: str
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    full_s: float  # Table 4: iteration time with full recomputation (s)
    present_s: float  # Table 4: with selective recomputation + sequence parallelism (s)
    present_mfu: float  # Table 5: MFU of the latter

    @property
    def shape(self) -> GPTShape:
        return GPTShape(self.layers, self.hidden, self.heads)

    @property
    def full_mfu(self) -> float:
        """The paper's MFU with full recomputation: the same FLOPs over Table 4's longer time."""
        return self.present_mfu * self.present_s / self.full_s


TABLE_3 = (
    Row("22B", 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10, 0.415),
    Row("175B", 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75, 0.514),
    Row("530B", 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83, 0.560),
    Row("1T", 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49, 0.563),
)


def model_flops(shape: GPTShape, batch: int) -> float:
    """Model FLOPs per iteration, recomputation not counted: 72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    b, s, l, h, v = batch, shape.seq_len, shape.layers, shape.hidden, shape.vocab
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def mfu(row: Row, plan: Plan) -> float:
    """Model FLOPs utilisation of ``plan``'s predicted iteration."""
    seconds = plan.predicted.time_per_minibatch_ms / 1e3
    return model_flops(row.shape, row.batch) / seconds / row.gpus / PEAK_FLOPS


def plan(row: Row, profile: Profile, mode: str) -> tuple[Plan, float, float]:
    """(pipeplan's plan of ``row`` for ``mode`` "full" or "auto", planning wall seconds,
    planning CPU seconds of this process: not counting waits for a core others hold)."""
    if mode == "full":
        options = PartitionOptions(optimizer="adam", recompute="full", sequence_parallel="off")
        schedules: tuple[str, ...] = FULL_SCHEDULES
    else:
        options, schedules = PartitionOptions(optimizer="adam"), SCHEDULES
    start, cpu = time.perf_counter(), time.process_time()
    found = search(profile, megatron_cluster(row.gpus), options, schedules, misfit_memory=False).plan
    return found, time.perf_counter() - start, time.process_time() - cpu


def stage_summary(plan: Plan) -> str:
    """Compact per-stage choices: runs of equal stages as ``count x (recompute, sp, shard)``."""

    def choice(stage_index: int) -> str:
        stage = plan.stages[stage_index]
        if stage.recompute_layers:
            recompute = f"full {len(stage.recompute_layers)}/{len(stage.layers)}"
        elif stage.selective_layers:
            recompute = f"sel {len(stage.selective_layers)}/{len(stage.layers)}"
        else:
            recompute = "none"
        sp = "+sp" if stage.sequence_parallel else ""
        shard = f" {stage.shard}" if stage.shard != "none" else ""
        return f"{recompute}{sp}{shard}"

    runs: list[tuple[str, int]] = []
    for q in range(len(plan.stages)):
        text = choice(q)
        if runs and runs[-1][0] == text:
            runs[-1] = (text, runs[-1][1] + 1)
        else:
            runs.append((text, 1))
    return ", ".join(f"{count}x {text}" if count > 1 else text for text, count in runs)


def shape_text(plan: Plan) -> str:
    """``t p [v] d schedule m``: p pipeline positions (devices per pipeline), v chunks each."""
    stage, v = plan.stages[0], plan.virtual_stages
    chunks = f" v{v}" if v > 1 else ""
    return (
        f"t{stage.tensor_parallel} p{len(plan.stages) // v}{chunks} d{stage.replicas} {plan.schedule} "
        f"m{plan.microbatches}"
    )


def busy_ms(plan: Plan) -> float:
    """The busiest device's work per minibatch (ms): the stage bound, or under interleaving
    the sum over a device's chunks (each chunk's time per minibatch)."""
    if plan.virtual_stages == 1:
        return plan.predicted.stage_bound_ms
    positions = len(plan.stages) // plan.virtual_stages
    return max(sum(s.time_per_minibatch_ms for s in plan.stages[i::positions]) for i in range(positions))


def describe(row: Row) -> dict:
    profile = estimate_gpt(row.shape, DEVICE_RATES["a100-80gb"], row.batch, recompute=False)
    out: dict = {
        "model": row.name,
        "gpus": row.gpus,
        "global_batch": row.batch,
        "paper": {
            "t": row.t,
            "p": row.p,
            "full_recompute_mfu": row.full_mfu,
            "selective_sp_mfu": row.present_mfu,
            "full_recompute_s": row.full_s,
            "selective_sp_s": row.present_s,
        },
    }
    for mode in ("full", "auto"):
        try:
            found, seconds, cpu_seconds = plan(row, profile, mode)
        except (InfeasibleError, InputError) as exc:
            out[mode] = {"error": str(exc)}
            continue
        out[mode] = {
            "mfu": mfu(row, found),
            "time_per_iteration_s": found.predicted.time_per_minibatch_ms / 1e3,
            "shape": shape_text(found),
            "stages": stage_summary(found),
            "peak_memory_gib": max(s.memory_bytes for s in found.stages) / 2**30,
            "planning_s": seconds,
            "planning_cpu_s": cpu_seconds,
            # the share of the iteration the pipeline idles (1 - the busiest device's work / time)
            "bubble_share": 1 - busy_ms(found) / found.predicted.time_per_minibatch_ms,
            "bubble_free_mfu": mfu(row, found) * found.predicted.time_per_minibatch_ms / busy_ms(found),
        }
    full, auto = out["full"].get("mfu"), out["auto"].get("mfu")
    out["auto_vs_paper_selective"] = auto / row.present_mfu if auto else None
    out["auto_vs_pipeplan_full"] = auto / full if auto and full else None
    out["paper_gain"] = row.full_s / row.present_s
    return out


def verdict(result: dict) -> str:
    """Whether the row meets the targets, and which one it misses."""
    misses = []
    if (result["auto_vs_paper_selective"] or 0) < 1:
        auto = result["auto"]
        why = (
            f" (pipeplan's pipeline bubble {100 * auto['bubble_share']:.1f}%; bubble-free "
            f"{100 * auto['bubble_free_mfu']:.1f}%)"
            if "bubble_share" in auto
            else ""
        )
        misses.append("auto < paper's selective+SP MFU" + why)
    if result["paper_gain"] >= TARGET_GAIN and (result["auto_vs_pipeplan_full"] or 0) < TARGET_GAIN:
        misses.append(f"auto < {TARGET_GAIN}x pipeplan's full")
    return "met" if not misses else "; ".join(misses)


def markdown(results: list[dict]) -> str:
    lines = [
        "| model | GPUs | paper MFU full / sel+SP | pipeplan MFU full | pipeplan MFU auto | auto / full | "
        "full plan | auto plan | auto stages (recompute, sp, shard) | planning CPU s full / auto | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        full, auto, paper = r["full"], r["auto"], r["paper"]

        def pct(entry: dict) -> str:
            return f"{100 * entry['mfu']:.1f}%" if "mfu" in entry else "no plan"

        ratio = f"{r['auto_vs_pipeplan_full']:.2f}x" if r["auto_vs_pipeplan_full"] else "-"
        lines.append(
            f"| {r['model']} | {r['gpus']} | {100 * paper['full_recompute_mfu']:.1f}% / "
            f"{100 * paper['selective_sp_mfu']:.1f}% | {pct(full)} | {pct(auto)} | {ratio} | "
            f"{full.get('shape', '-')} | {auto.get('shape', '-')} | {auto.get('stages', auto.get('error', '-'))} | "
            f"{full.get('planning_cpu_s', 0):.1f} / {auto.get('planning_cpu_s', 0):.1f} | {verdict(r)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="", help="comma-separated model names of Table 3 (default: all)")
    parser.add_argument("--out", default="", help="write the JSON results here")
    args = parser.parse_args()
    wanted = {name.strip().upper() for name in args.rows.split(",") if name.strip()}
    rows = [
        row
        for row in TABLE_3
        if not wanted or row.name.upper().rstrip("B") in {w.rstrip("B") for w in wanted}
    ]
    results = []
    for row in rows:
        results.append(describe(row))
        print(f"{row.name}: planned", file=sys.stderr, flush=True)
    print(markdown(results))
    if args.out:
        write_json_atomic(
            args.out,
            {
                "source": "Korthikanti et al., MLSys 2023 (arXiv 2205.05198), Tables 3-5 (transcribed)",
                "peak_flops": PEAK_FLOPS,
                "rows": results,
            },
        )


if __name__ == "__main__":
    main()
