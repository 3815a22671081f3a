"""Benchmark: simulate a 1,000-layer plan on 4,096 devices (target: under 30 s on 2 cores).

The plan is built by hand (16 stages of ~63 layers, 256 replicas each, on 8 GPUs per
server x 16 servers per rack x 32 racks) so the figure measures the simulator alone.
Prints a rich table and writes JSON (``--out``, default bench/results/bench_simulate.json).

    python bench/bench_simulate.py
    python bench/bench_simulate.py --layers 1000 --stages 16 --steady 8 --schedule 1f1b-rr
"""

from __future__ import annotations

import argparse
import platform
import random
import time

from rich.console import Console
from rich.table import Table

from pipeplan.jsonio import write_json_atomic
from pipeplan.plan import Plan, Predicted, StagePlan
from pipeplan.planner.simulate import simulate_plan
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.schedules import noam
from pipeplan.topology import DeviceSpec, Level, Topology

TARGET_S = 30.0


def build(layers: int, stages: int, seed: int) -> tuple[Plan, Profile]:
    rng = random.Random(seed)
    topology = Topology(
        "bench-4096",
        DeviceSpec("H100-80GB", 80 * 2**30),
        (Level("server", 8, 450e9, 0.005), Level("rack", 16, 50e9, 0.01), Level("pod", 32, 25e9, 0.02)),
    )
    profile_layers = tuple(
        LayerProfile(
            index=i,
            name=f"block{i}",
            type="Linear",
            inputs=(i - 1,) if i else (),
            forward_ms=rng.uniform(0.5, 1.5),
            backward_ms=rng.uniform(1.0, 3.0),
            output_bytes=rng.randint(1, 8) * 2**20,
            param_bytes=rng.randint(1, 16) * 2**20,
            saved_bytes=rng.randint(1, 8) * 2**20,
        )
        for i in range(layers)
    )
    profile = Profile("bench", "bench-fp", DeviceInfo("cuda", "bench"), 32, "bfloat16", profile_layers)
    replicas = topology.world_size // stages
    bounds = [round(s * layers / stages) for s in range(stages + 1)]
    plan_stages = []
    for s in range(stages):
        compute = sum(layer.compute_ms for layer in profile_layers[bounds[s] : bounds[s + 1]])
        ranks = tuple(range(s * replicas, (s + 1) * replicas))
        plan_stages.append(
            StagePlan(
                s, bounds[s], bounds[s + 1], replicas, ranks, compute, 0.0, 0.0, compute / replicas, 0, 1, 1
            )
        )
    period = max(stage.time_per_minibatch_ms for stage in plan_stages)
    plan = Plan(
        "bench-fp",
        "bench",
        32,
        "bfloat16",
        topology,
        "1f1b-rr",
        "pipeplan",
        "adam",
        topology.world_size,
        noam([replicas] * stages),
        tuple(plan_stages),
        Predicted(period, 32e3 / period, 1.0, 1.0, period, period),
        0,
        1,
    )
    return plan, profile


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--stages", type=int, default=16)
    parser.add_argument("--steady", type=int, default=8, help="minibatches per replica in the window")
    parser.add_argument("--schedule", default="1f1b-rr", choices=["1f1b-rr", "1f1b-flush", "gpipe"])
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/bench_simulate.json")
    args = parser.parse_args()

    plan, profile = build(args.layers, args.stages, args.seed)
    started = time.perf_counter()
    result = simulate_plan(plan, profile, args.schedule, args.microbatches, args.steady)
    elapsed = time.perf_counter() - started
    tasks = result.minibatches * result.microbatches * len(plan.stages)

    table = Table(title=f"simulate: {args.layers} layers, {plan.world_size} devices, {args.schedule}")
    for header in (
        "stages",
        "replicas/stage",
        "minibatches simulated",
        "F/B tasks",
        "sim time (s)",
        "target (s)",
        "period (ms/minibatch)",
        "compute bound (ms/minibatch)",
    ):
        table.add_column(header, justify="right")
    table.add_row(
        str(len(plan.stages)),
        str(plan.stages[0].replicas),
        str(result.minibatches),
        f"{2 * tasks:,}",
        f"{elapsed:.2f}",
        f"{TARGET_S:.0f}",
        f"{result.time_per_minibatch_ms:.4f}",
        f"{plan.predicted.time_per_minibatch_ms:.4f}",
    )
    Console().print(table)
    write_json_atomic(
        args.out,
        {
            "benchmark": "simulate",
            "layers": args.layers,
            "devices": plan.world_size,
            "stages": len(plan.stages),
            "schedule": args.schedule,
            "steady": args.steady,
            "minibatches": result.minibatches,
            "microbatches": result.microbatches,
            "forward_backward_tasks": 2 * tasks,
            "seconds": elapsed,
            "target_seconds": TARGET_S,
            "time_per_minibatch_ms": result.time_per_minibatch_ms,
            "compute_bound_ms": plan.predicted.time_per_minibatch_ms,
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
    )


if __name__ == "__main__":
    main()
