"""Schedules as data: which forward/backward/step each worker runs, in order.

A worker is ``(stage, replica)``. A schedule maps every worker to its ordered tuple of
``Action``s; the simulator, the runtime and the timeline all read the same schedule,
so 1F1B-RR can be checked on the CPU without processes.

Routing rule (PipeDream): work unit ``u = minibatch * microbatches + microbatch`` runs
on replica ``u % replicas[s]`` of every stage s. Route by this global id, never by a
counter local to a rank.

The memory-relevant counts below are shared with the planner's memory model.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = [
    "warmup_forwards",
    "noam",
    "weight_versions",
    "activations_in_flight",
]


def noam(stage_replicas: Sequence[int]) -> int:
    """Minibatches in flight in the whole 1F1B-RR pipeline: ceil(workers / replicas of stage 0)."""
    return math.ceil(sum(stage_replicas) / stage_replicas[0])


def warmup_forwards(stage_replicas: Sequence[int], stage: int) -> int:
    """Forwards one replica of ``stage`` runs before its first backward in 1F1B-RR.

    PipeDream: ceil(R / n_0) - 1 for the input stage and
    floor((R - 1 - sum_{i<s} n_i) / n_s) for stage s > 0, with R the total workers.

    >>> [warmup_forwards([1, 1, 1, 1], s) for s in range(4)]
    [3, 2, 1, 0]
    >>> [warmup_forwards([2, 1, 1], s) for s in range(3)]
    [1, 1, 0]
    """
    workers = sum(stage_replicas)
    if stage == 0:
        return noam(stage_replicas) - 1
    before = sum(stage_replicas[:stage])
    return max(0, (workers - 1 - before) // stage_replicas[stage])


def weight_versions(schedule: str, stage_replicas: Sequence[int], stage: int) -> int:
    """Weight versions a replica of ``stage`` keeps: W_s + 1 with stashing (1f1b-rr), else 1."""
    if schedule == "1f1b-rr":
        return warmup_forwards(stage_replicas, stage) + 1
    return 1


def activations_in_flight(
    schedule: str, stage_replicas: Sequence[int], stage: int, microbatches: int = 1
) -> float:
    """Minibatches' worth of saved activations a replica of ``stage`` holds at its peak.

    1f1b-rr: W_s + 1 whole minibatches. 1f1b-flush: min(M, S - s) micro-batches of size
    1/M each. gpipe: all M micro-batches, i.e. one whole minibatch.
    """
    if schedule == "1f1b-rr":
        return float(warmup_forwards(stage_replicas, stage) + 1)
    stages = len(stage_replicas)
    if schedule == "1f1b-flush":
        return min(microbatches, stages - stage) / microbatches
    if schedule == "gpipe":
        return 1.0
    raise ValueError(f"unknown schedule {schedule!r}")
