"""What a checkpoint of a plan will cost, in words, before the run (``partition``, ``simulate``).

From the plan's figures (``pipeplan.planner.checkpoint_cost``): the bytes each stage's
checkpoint writes and, when the topology gives a storage bandwidth, how long the write takes
against the pipeline's time per minibatch. A synchronous save stalls training for the whole
write; an asynchronous one (``run --checkpoint-async``) hides the write behind the steps that
follow it once the interval covers the write (``pipeplan.runtime.checkpoint.frequency``); its
snapshot (the copy taken aside) is not predicted here, ``--checkpoint-every auto`` measures it.
"""

from __future__ import annotations

import math

from pipeplan.plan import Plan
from pipeplan.units import format_bytes, format_ms

__all__ = ["SYNC_TARGET_PCT", "checkpoint_summary", "sync_interval"]

SYNC_TARGET_PCT = 3.5  # CheckFreq's overhead bound, the default of --checkpoint-overhead


def sync_interval(write_ms: float, period_ms: float, target_pct: float = SYNC_TARGET_PCT) -> int:
    """The smallest interval (steps) at which synchronous saves of ``write_ms`` cost at most
    ``target_pct`` of training time at ``period_ms`` per step.

    >>> sync_interval(70.0, 100.0)  # 70 ms every 20 steps of 100 ms is 3.5%
    20
    """
    return max(1, math.ceil(100.0 * write_ms / (target_pct * period_ms))) if period_ms > 0 else 1


def checkpoint_summary(plan: Plan, period_ms: float | None = None) -> str:
    """One paragraph: bytes per stage, and the write's time against ``period_ms`` (the plan's
    predicted time per minibatch by default)."""
    written = [stage.checkpoint_bytes for stage in plan.stages]
    if not any(written):
        return "checkpoint cost: not predicted (a plan written before it was; partition again)"
    period = plan.predicted.time_per_minibatch_ms if period_ms is None else period_ms
    per_stage = ", ".join(f"stage {s.index} {format_bytes(s.checkpoint_bytes)}" for s in plan.stages)
    text = f"checkpoint: {format_bytes(sum(written))} per checkpoint ({per_stage}; weights and {plan.optimizer} state)"
    write = plan.predicted.checkpoint_write_ms
    bandwidth = plan.topology.storage_bandwidth_bytes_per_s
    if write <= 0 or bandwidth <= 0:
        return (
            text
            + "; no write time predicted: the topology gives no storage bandwidth (storage: {bandwidth: ...})"
        )
    every = sync_interval(write, period)
    hidden = max(1, math.ceil(write / period)) if period > 0 else 1
    return (
        f"{text}; written at {format_bytes(bandwidth)}/s per rank it takes {format_ms(write)}: "
        f"synchronous saves cost {100.0 * write / period:.1f}% of a {format_ms(period)} step each "
        f"(every {every} steps for {SYNC_TARGET_PCT}%); asynchronous ones hide the write behind "
        f"{hidden} step(s)"
    )
