"""Each placed stage's sharding: the fastest mode that fits, its figures and exact memory.

The DP (``planner.dp.sharded``) values a level-1 stage on d > 1 devices at the least over
the modes that fit; ``stage_shard`` makes that choice for one stage of a placed plan with
the exact memory rule (``planner.memory.plan_stage_memory``'s weight versions and
activations in flight), so ``partition`` and the brute force (``planner.exhaustive``)
price plans alike. Ties keep the mode with less sharding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeplan.planner.costs import LayerArrays, ring_allreduce_ms
from pipeplan.planner.dp.sharded import largest_layer_range
from pipeplan.planner.memory import gradient_temporary_bytes, plan_stage_memory
from pipeplan.planner.placement import FlatStage
from pipeplan.planner.sharding import replica_microbatches, shard_memory_bytes, shard_sync_ms
from pipeplan.schedules import schedule_kind
from pipeplan.topology import Topology

__all__ = ["StageShard", "stage_shard"]

Figures = tuple[float, float, float, float]


@dataclass(frozen=True)
class StageShard:
    mode: str  # planner.sharding.SHARD_MODES
    degree: int  # replicas sharing (1: none)
    figures: Figures  # (compute, sync, communication, time per minibatch) in ms
    memory_bytes: int
    versions: int
    in_flight: float


def _higher_sync_ms(stage: FlatStage, arrays: LayerArrays, topology: Topology) -> float:
    """The all-reduces of the stage's nodes above level 1, each over the replication above it
    (``cost_models._pipeplan_stage_figures``'s terms)."""
    out, above = 0.0, 1
    for node in stage.path[:-1]:
        lv = topology.levels[node.level - 1]
        ar = ring_allreduce_ms(
            arrays.sync_bytes(node.start, node.end), node.units, lv.bandwidth_bytes_per_s, lv.latency_ms
        )
        out = max(out, float(ar) / above)
        above *= node.units
    return out


def stage_shard(
    stage: FlatStage,
    q: int,
    replicas: list[int],
    arrays: LayerArrays,
    topology: Topology,
    schedule: str,
    optimizer: str,
    microbatches: int,
    modes: tuple[str, ...],
    figures: Figures,
    memory_limit: float | None,
) -> StageShard:
    """The stage's fastest mode of ``modes`` that fits ``memory_limit`` (None: any), or
    ``none`` with its unsharded ``figures`` when it is not a level-1 stage on several
    devices or nothing else is asked. Without a fitting mode: the first mode's figures
    (the caller refuses the plan on its memory)."""
    precision = arrays.precision
    memory, versions, in_flight = plan_stage_memory(
        schedule,
        replicas,
        q,
        arrays.params(stage.start, stage.end),
        arrays.saved(stage.start, stage.end),
        optimizer,
        microbatches,
        precision=precision,
        largest_param_bytes=arrays.largest(stage.start, stage.end),
    )
    leaf = stage.path[-1]
    unsharded = StageShard("none", 1, figures, memory, versions, in_flight)
    if leaf.level != 1 or leaf.units < 2 or modes == ("none",):
        return unsharded
    d = leaf.units
    kind = schedule_kind(schedule)
    in_flight_exact = kind.activations_in_flight(replicas, q, microbatches, 1)
    lv = topology.levels[0]
    above = math.prod(node.units for node in stage.path[:-1])
    params = arrays.params(stage.start, stage.end)
    largest_layer = float(largest_layer_range(arrays, stage.start, stage.end))
    temporary = gradient_temporary_bytes(arrays.largest(stage.start, stage.end), microbatches, precision)
    higher = _higher_sync_ms(stage, arrays, topology)
    compute, _, comm, _ = figures
    best: StageShard | None = None
    best_fits = False
    for mode in modes:
        need = shard_memory_bytes(
            mode,
            params,
            arrays.saved(stage.start, stage.end),
            versions,
            in_flight_exact,
            optimizer,
            precision,
            d,
            temporary,
            largest_layer,
        )
        sync = float(
            shard_sync_ms(
                mode,
                params,
                d,
                lv.bandwidth_bytes_per_s,
                lv.latency_ms,
                precision,
                replica_microbatches(schedule, microbatches, d),
            )
        )
        allreduce = max(higher, sync / above)
        time = max(compute / (above * d), allreduce, comm)
        choice = (
            unsharded
            if mode == "none"
            else StageShard(
                mode, d, (compute, allreduce, comm, time), int(math.ceil(need)), versions, in_flight
            )
        )
        time = choice.figures[3]
        fits = memory_limit is None or choice.memory_bytes <= memory_limit
        if best is None:
            best = choice
            best_fits = fits
            continue
        if fits and (not best_fits or time < best.figures[3]):
            best, best_fits = choice, True
    assert best is not None
    return best
