"""PTD-P's GPT configurations (Narayanan et al., SC'21, Table 1) planned by pipeplan.

For each row: the what-if profile of the GPT on an A100 80 GB (``pipeplan estimate``:
datasheet rates, every kernel at its roofline, one GEMM efficiency calibrated on the 1.7B
row (``--calibrate``), full recomputation, bf16 weights on float32 masters: Megatron's 18
bytes per parameter with Adam, gradients all-reduced in float32, marked estimated), a
Megatron-like cluster (8 A100 per node over NVLink 3 at 300 GB/s, 8 x 200 Gbit/s
InfiniBand per node = 200 GB/s between nodes), and
``planner.auto.search`` over the schedules that train as Megatron does (``SCHEDULES``) x
micro-batch counts x t, p, d, Adam. Beside it, pipeplan's prediction for the paper's own t,
p, d (``plan_uniform``, 1F1B-flush, micro-batches of one sequence) and Megatron's bubble
(p - 1)/m of both; every plan without sequence parallelism (the paper predates it:
``--sequence-parallel off``). Predicted TFLOP/s per GPU use the paper's own count (eq. 3,
recomputation included) over the simulated time per iteration. Prints a markdown table,
writes JSON.

    python bench/bench_ptdp.py --out bench/results/ptdp.json
    python bench/bench_ptdp.py --rows 1.7,1008
    python bench/bench_ptdp.py --calibrate
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.jsonio import write_json_atomic
from pipeplan.plan import Plan
from pipeplan.planner.auto import SearchResult, device_peak_bytes, search
from pipeplan.planner.partition import PartitionOptions, partition, plan_uniform
from pipeplan.profiler.estimate import DEVICE_RATES, MATMUL_EFFICIENCY, GPTShape, estimate_gpt
from pipeplan.schedules import names_where
from pipeplan.topology import DeviceSpec, Level, Topology

TARGET_S = 10.0


@dataclass(frozen=True)
class Row:
    """One row of the paper's Table 1 (its t, p, GPUs, batch and TFLOP/s per GPU)."""

    billions: float
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    tflops: float
    # the paper's own run (NVIDIA/Megatron-LM examples/sc21/run_table_1.sh): micro-batch size
    # (MBS) and chunks per device, layers / (p * --num-layers-per-virtual-pipeline-stage);
    # 1: the non-interleaved 1F1B schedule
    microbatch_size: int = 1
    virtual: int = 1

    @property
    def shape(self) -> GPTShape:
        return GPTShape(self.layers, self.hidden, self.heads)

    @property
    def schedule(self) -> str:
        """The paper's schedule for this row: interleaved 1F1B where it ran chunks, else 1F1B."""
        return "interleaved-1f1b" if self.virtual > 1 else "1f1b-flush"


TABLE_1 = (
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),  # 5 layers per virtual stage
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),  # 5
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),  # 3
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),  # 1
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1),
)


def megatron_cluster(gpus: int) -> Topology:
    """``gpus / 8`` DGX A100 nodes as in the paper (configs/topologies/megatron-a100.yaml)."""
    return Topology(
        f"megatron-a100-{gpus}",
        DeviceSpec("A100-80GB", 80 * 2**30),
        (Level("node", 8, 300e9, 0.002), Level("cluster", gpus // 8, 200e9, 0.005)),
    )


# the schedules searched: every registered one that trains as Megatron does (every minibatch's
# exact gradient, a flush), from the registry, so that new kinds join by themselves: 1F1B,
# GPipe, interleaved 1F1B (p positions x d replicas x v chunks, each replica a pipeline of its
# own, as PTD-P runs it), ZB-H1 and ZB-V (their backward split into the input and weight
# gradients the estimated profile derives from FLOPs, the recomputed forward in the input half:
# 75% of a block's backward at h = 4096, s = 2048; pipeplan runs them without tensor
# parallelism, so the planner offers them at t = 1 only). Left out: 1f1b-rr and 2bw (they
# change the training algorithm)
SCHEDULES = names_where(lambda kind: kind.flushes and kind.gradients == "exact")
# the column without the schedules of several chunks per device (the table before issue 33)
ONE_CHUNK = names_where(lambda kind: kind.flushes and kind.gradients == "exact" and not kind.virtual_stages)


def plan_row(
    row: Row,
    gpus: int | None = None,
    batch: int | None = None,
    schedule: str | None = None,
    matmul_efficiency: float = MATMUL_EFFICIENCY,
    schedules: tuple[str, ...] = SCHEDULES,
) -> tuple[Plan, float, float, SearchResult | None]:
    """(pipeplan's plan, planning wall seconds, planning CPU seconds of this process, the
    search's candidates) of ``row`` (optionally on other counts): ``planner.auto.search``
    over ``schedules`` x
    micro-batch counts (powers of two, and micro-batches of 1, 2, 4, 8 sequences) x t, p,
    d; with ``schedule``, that schedule with micro-batches of one sequence only. CPU
    seconds do not count waiting for a core the shared machine's other jobs hold."""
    gpus, batch = gpus or row.gpus, batch or row.batch
    profile = estimate_gpt(row.shape, DEVICE_RATES["a100-80gb"], batch, matmul_efficiency=matmul_efficiency)
    start, cpu = time.perf_counter(), time.process_time()
    found: SearchResult | None = None
    if schedule:
        plan = partition(
            profile,
            megatron_cluster(gpus),
            PartitionOptions(
                schedule=schedule, microbatches=batch, optimizer="adam", sequence_parallel="off"
            ),
        )
    else:
        found = search(
            profile,
            megatron_cluster(gpus),
            PartitionOptions(optimizer="adam", sequence_parallel="off"),
            schedules,
            misfit_memory=False,
        )
        plan = found.plan
    return plan, time.perf_counter() - start, time.process_time() - cpu, found


def calibrate(row: Row, tolerance: float = 1e-4) -> float:
    """The GEMM efficiency at which pipeplan's plan of ``row`` reaches the paper's TFLOP/s
    per GPU (bisection; the throughput grows with the efficiency)."""
    low, high = 0.3, 1.0
    while high - low > tolerance:
        middle = (low + high) / 2
        plan, _, _, _ = plan_row(row, matmul_efficiency=middle, schedules=ONE_CHUNK)
        if tflops_per_gpu(row, plan, row.gpus, row.batch) < row.tflops:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def tflops_per_gpu(row: Row, plan: Plan, gpus: int, batch: int) -> float:
    """The paper's eq. 3 FLOPs per iteration over the plan's predicted iteration time."""
    return row.shape.training_flops(batch) / (plan.predicted.time_per_minibatch_ms / 1e3) / gpus / 1e12


def paper_config(row: Row) -> dict:
    """pipeplan's prediction for the paper's own t, p, d (``plan_uniform``): 1F1B-flush with
    micro-batches of one sequence (the paper ran its interleaved schedule, which pipeplan
    plans without replicas only); {"error": ...} when it does not fit pipeplan's memory."""
    profile = estimate_gpt(row.shape, DEVICE_RATES["a100-80gb"], row.batch)
    try:
        plan = plan_uniform(
            profile,
            megatron_cluster(row.gpus),
            PartitionOptions(
                schedule="1f1b-flush", microbatches=row.batch, optimizer="adam", sequence_parallel="off"
            ),
            row.t,
            row.p,
        )
    except (InfeasibleError, InputError) as exc:
        return {"error": str(exc)}
    return {
        "tflops_per_gpu": tflops_per_gpu(row, plan, row.gpus, row.batch),
        "time_per_iteration_s": plan.predicted.time_per_minibatch_ms / 1e3,
    }


def paper_run(row: Row) -> dict:
    """pipeplan's prediction for the paper's own run (``plan_uniform``): its t, p, d, its
    micro-batch size and its schedule (interleaved 1F1B with its chunks per device where
    run_table_1.sh sets them, else 1F1B); {"error": ...} when it does not fit pipeplan's memory."""
    profile = estimate_gpt(row.shape, DEVICE_RATES["a100-80gb"], row.batch)
    options = PartitionOptions(
        schedule=row.schedule,
        microbatches=row.batch // row.microbatch_size,
        optimizer="adam",
        virtual_stages=row.virtual if row.virtual > 1 else None,
    )
    try:
        plan = plan_uniform(profile, megatron_cluster(row.gpus), options, row.t, row.p)
    except (InfeasibleError, InputError) as exc:
        return {"error": str(exc)}
    return {
        "schedule": row.schedule,
        "virtual_stages": row.virtual,
        "microbatch_size": row.microbatch_size,
        "tflops_per_gpu": tflops_per_gpu(row, plan, row.gpus, row.batch),
        "time_per_iteration_s": plan.predicted.time_per_minibatch_ms / 1e3,
    }


def bubble(p: int, d: int, microbatches: int, virtual: int = 1) -> float:
    """Megatron's pipeline bubble (p - 1) / (v m), m = micro-batches per pipeline, v chunks
    per device (SC'21, 2.2.1-2.2.2)."""
    return (p - 1) / (virtual * microbatches / d)


def one_chunk_best(row: Row) -> tuple[str, int, float] | None:
    """(schedule, micro-batches, ms per iteration) of the search's choice among the
    schedules of one chunk per device (``ONE_CHUNK``): what the table chose before the
    schedules of several chunks joined. A search of its own, untimed: the timed search
    prunes the candidates that cannot beat its choice, so it has no figure for them."""
    try:
        plan, _, _, found = plan_row(row, schedules=ONE_CHUNK)
    except InfeasibleError:
        return None
    assert found is not None  # plan_row searches without a schedule
    return plan.schedule, plan.microbatches, found.best.time_per_minibatch_ms


def describe(
    row: Row, plan: Plan, seconds: float, cpu_seconds: float, found: SearchResult | None = None
) -> dict:
    t = plan.stages[0].tensor_parallel
    v = plan.virtual_stages
    p, d = len(plan.stages) // v, plan.stages[0].replicas
    one = one_chunk_best(row) if found is not None else None
    paper_d = row.gpus // (row.t * row.p)
    return {
        "params_billions": row.billions,
        "gpus": row.gpus,
        "batch": row.batch,
        "paper": {
            "t": row.t,
            "p": row.p,
            "d": paper_d,
            "tflops_per_gpu": row.tflops,
            "bubble_1f1b_one_sequence": bubble(row.p, paper_d, row.batch),
            "microbatch_size": row.microbatch_size,
            "virtual_stages": row.virtual,
            "bubble_own_run": bubble(row.p, paper_d, row.batch // row.microbatch_size, row.virtual),
        },
        "pipeplan_at_paper_config": paper_config(row),
        "pipeplan_at_paper_run": paper_run(row),
        "pipeplan_one_chunk": None
        if one is None
        else {
            "schedule": one[0],
            "microbatches": one[1],
            "tflops_per_gpu": row.shape.training_flops(row.batch) / (one[2] / 1e3) / row.gpus / 1e12,
        },
        "pipeplan": {
            "t": t,
            "p": p,
            "d": d,
            "replicas": [s.replicas for s in plan.stages],
            "schedule": plan.schedule,
            "virtual_stages": v,
            "microbatches": plan.microbatches,
            "simulated": plan.predicted.simulated,
            "bubble": bubble(p, d, plan.microbatches, v),
            "time_per_iteration_s": plan.predicted.time_per_minibatch_ms / 1e3,
            "tflops_per_gpu": tflops_per_gpu(row, plan, row.gpus, row.batch),
            "peak_memory_gib": device_peak_bytes(plan) / 2**30,
        },
        "planning_seconds": seconds,
        "planning_cpu_seconds": cpu_seconds,
    }


def _tflops(figures: dict | None) -> str:
    return f"{figures['tflops_per_gpu']:.1f}" if figures and "tflops_per_gpu" in figures else "does not fit"


def markdown(results: list[dict]) -> str:
    head = (
        "| params | GPUs | batch | paper t, p, d, v, b | paper TFLOP/s/GPU | pipeplan at the paper's own run "
        "| pipeplan at the paper's t, p, d, 1F1B, b=1 | `auto`, one chunk per device "
        "| `auto`, every schedule: t, p, d, v | schedule, micro-batches | TFLOP/s/GPU (estimated) | vs paper "
        "| bubble (p-1)/(v m): `auto`, paper's run | peak GiB per GPU "
        "| planning (wall, CPU) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in results:
        paper, ours, one = r["paper"], r["pipeplan"], r["pipeplan_one_chunk"]
        d = (
            str(ours["d"])
            if len(set(ours["replicas"])) == 1
            else "/".join(map(str, sorted(set(ours["replicas"]))))
        )
        own = (
            f"{paper['t']}, {paper['p']}, {paper['d']}, {paper['virtual_stages']}, {paper['microbatch_size']}"
        )
        chunk = f"{_tflops(one)} ({one['schedule']}, {one['microbatches']:,})" if one else "none fits"
        lines.append(
            f"| {r['params_billions']:g}B | {r['gpus']:,} | {r['batch']:,} | {own} "
            f"| {paper['tflops_per_gpu']:.0f} | {_tflops(r['pipeplan_at_paper_run'])} "
            f"| {_tflops(r['pipeplan_at_paper_config'])} | {chunk} "
            f"| {ours['t']}, {ours['p']}, {d}, {ours['virtual_stages']} "
            f"| {ours['schedule']}, {ours['microbatches']:,} "
            f"| {ours['tflops_per_gpu']:.1f}{'' if ours['simulated'] else ' (not simulated)'} "
            f"| {100 * (ours['tflops_per_gpu'] / paper['tflops_per_gpu'] - 1):+.1f}% "
            f"| {100 * ours['bubble']:.1f}%, {100 * paper['bubble_own_run']:.1f}% "
            f"| {ours['peak_memory_gib']:.1f} "
            f"| {r['planning_seconds']:.1f} s, {r['planning_cpu_seconds']:.1f} s |"
        )
    return head + "\n".join(lines)


# Figure 12 of the paper (NVIDIA/Megatron-LM examples/sc21/run_figure_12.sh): a 175B GPT
# (96 layers, h = 12288, 96 heads) on 96 A100s, t = 8, p = 12, d = 1, micro-batches of one
# sequence, batches 12 to 60, interleaved (2 layers per virtual stage: v = 4) against 1F1B
FIGURE_12 = Row(175.0, 96, 12288, 96, 8, 12, 96, 12, 0.0, 1, 4)
FIGURE_12_BATCHES = (12, 24, 36, 48, 60)


def figure_12() -> list[dict]:
    """pipeplan's TFLOP/s per GPU for Figure 12's runs, interleaved and not, at each batch."""
    out = []
    for batch in FIGURE_12_BATCHES:
        row = replace(FIGURE_12, batch=batch)
        interleaved = paper_run(row)
        plain = paper_run(replace(row, virtual=1))
        out.append({"batch": batch, "interleaved": interleaved, "1f1b": plain})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/ptdp.json")
    parser.add_argument(
        "--rows", default="", help="comma-separated parameter counts in billions (default: all)"
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="print the GEMM efficiency that brings the 1.7B row to the paper's figure, and stop",
    )
    parser.add_argument(
        "--figure12",
        action="store_true",
        help="print pipeplan's interleaved vs 1F1B figures for the paper's Figure 12 runs (175B, 96 GPUs), and stop",
    )
    args = parser.parse_args()
    if args.figure12:
        print(
            "| batch | interleaved (v=4) TFLOP/s/GPU | 1F1B TFLOP/s/GPU | interleaved / 1F1B |\n|---|---|---|---|"
        )
        for r in figure_12():
            fast, slow = r["interleaved"], r["1f1b"]
            ratio = (
                f"{fast['tflops_per_gpu'] / slow['tflops_per_gpu']:.3f}"
                if "tflops_per_gpu" in fast and "tflops_per_gpu" in slow
                else "-"
            )
            print(f"| {r['batch']} | {_tflops(fast)} | {_tflops(slow)} | {ratio} |")
        return
    if args.calibrate:
        print(f"GEMM efficiency calibrated on the {TABLE_1[0].billions:g}B row: {calibrate(TABLE_1[0]):.4f}")
        return
    chosen = [row for row in TABLE_1 if not args.rows or f"{row.billions:g}" in args.rows.split(",")]
    results = []
    for row in chosen:
        plan, seconds, cpu_seconds, found = plan_row(row)
        results.append(describe(row, plan, seconds, cpu_seconds, found))
        print(markdown(results[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown(results))
    slow = [f"{r['params_billions']:g}B" for r in results if r["planning_seconds"] > TARGET_S]
    print(
        f"\nrows over {TARGET_S:.0f} s of planning (wall): {len(slow)} of {len(results)}"
        + (f" ({', '.join(slow)})" if slow else "")
    )
    slow = [f"{r['params_billions']:g}B" for r in results if r["planning_cpu_seconds"] > TARGET_S]
    print(
        f"rows over {TARGET_S:.0f} s of planning (CPU): {len(slow)} of {len(results)}"
        + (f" ({', '.join(slow)})" if slow else "")
    )
    print(
        f"GEMM efficiency {MATMUL_EFFICIENCY:.3f} of the A100's 312 TFLOP/s (calibrated on the 1.7B row); "
        f"every pipeplan figure rests on an ESTIMATED profile"
    )
    write_json_atomic(
        args.out,
        {
            "schema": "pipeplan.bench.ptdp/3",
            "matmul_efficiency": MATMUL_EFFICIENCY,
            "schedules": list(SCHEDULES),
            "rows": results,
        },
    )


if __name__ == "__main__":
    main()
