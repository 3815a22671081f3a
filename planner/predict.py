"""Honest predictions: a plan's figures are those of the schedule it runs, bubble included.

``predict(plan, profile)`` simulates the plan under its own schedule (``planner.simulate``)
and writes the simulated steady-state period, throughput, speed-ups and per-stage busy
time into it. ``predict(plan, schedule=..., microbatches=...)`` re-predicts a plan for
another schedule or micro-batch count from the plan's own per-stage figures (no profile
needed): what ``pipeplan run --schedule X`` reports against.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pipeplan.plan import Plan
from pipeplan.planner.simulate import SimResult, plan_positions, simulate_plan
from pipeplan.profile import Profile
from pipeplan.schedules import schedule_kind

__all__ = ["predict", "with_simulation"]


def predict(
    plan: Plan,
    profile: Profile | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    steady: int = 8,
) -> Plan:
    """``plan`` with the predictions of ``schedule`` (default: its own) and ``microbatches``.

    Costs come from ``profile`` when given, else from the plan's per-stage figures
    (``stage_costs_from_plan``). Memory stays the plan's when re-predicting without a
    profile (a plan carries no parameter or activation sizes). Time: one simulation of
    ``steady`` minibatches after the warm-up (``simulate.default_minibatches``).
    """
    result = simulate_plan(plan, profile, schedule, microbatches, steady)
    return with_simulation(plan, result, keep_memory=profile is None or result.schedule == plan.schedule)


def with_simulation(plan: Plan, result: SimResult, keep_memory: bool = True) -> Plan:
    """``plan`` carrying ``result``'s schedule, period, throughput and per-stage busy time."""
    kind = schedule_kind(result.schedule)
    positions = plan_positions(plan)
    replicas = tuple(stage.replicas for stage in plan.stages[:positions])
    stages = tuple(
        replace(
            stage,
            time_per_minibatch_ms=sim.busy_ms,
            weight_versions=kind.weight_versions(replicas, stage.index % positions),
            in_flight=stage.in_flight if keep_memory else max(1, math.ceil(sim.in_flight - 1e-9)),
            memory_bytes=stage.memory_bytes if keep_memory else sim.memory_bytes,
        )
        for stage, sim in zip(plan.stages, result.stages)
    )
    period = result.time_per_minibatch_ms
    old = plan.predicted
    predicted = replace(
        old,
        time_per_minibatch_ms=period,
        samples_per_s=plan.batch_size * 1000.0 / period if period > 0 else math.inf,
        speedup_vs_data_parallel=old.data_parallel_ms / period if period > 0 else math.inf,
        speedup_vs_single_device=old.single_device_ms / period if period > 0 else math.inf,
        simulated=True,
    )
    bottleneck = max(range(len(stages)), key=lambda q: stages[q].time_per_minibatch_ms)
    return replace(
        plan,
        schedule=result.schedule,
        microbatches=result.microbatches,
        in_flight=kind.minibatches_in_flight(replicas),
        stages=stages,
        predicted=predicted,
        bottleneck_stage=bottleneck,
    )
