"""Each placed stage's sharding: the fastest mode that fits, its figures and exact memory.

The DP (``planner.dp.sharded``) values a level-1 stage on d > 1 devices at the least over
the modes that fit; ``stage_shard`` makes that choice for one stage of a placed plan with
the exact memory rule (``planner.memory.plan_stage_memory``'s weight versions and
activations in flight), so ``partition`` and the brute force (``planner.exhaustive``)
price plans alike. Ties keep the mode with less sharding.

With activation recomputation (``planner.recompute``), each mode takes the recomputation
``recompute_mode`` chooses among the stage's ``candidates`` on what that mode leaves of
the device (sharding divides the parameter side, recomputation shrinks the activation
side; ``planner.dp.sharded`` composes them alike), its extra ms in the stage's compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeplan.planner.costs import LayerArrays, level_sum_ms, on_gloo
from pipeplan.planner.dp.sharded import largest_layer_range
from pipeplan.planner.memory import backward_temporary_bytes, plan_stage_memory
from pipeplan.planner.offload import FSDP_MODES, base_mode, host_bandwidth, offload_ms
from pipeplan.planner.placement import FlatStage
from pipeplan.planner.recompute import StageRecompute, choose
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
    recompute: StageRecompute | None = None  # the recomputation chosen; None: none fits
    offload_ms: float = 0.0  # host-link copies and host optimizer step per minibatch (planner.offload)


def _higher_sync_ms(stage: FlatStage, arrays: LayerArrays, topology: Topology) -> float:
    """The all-reduces of the stage's nodes above level 1, each over the replication above it
    (``cost_models._pipeplan_stage_figures``'s terms)."""
    out, above = 0.0, 1
    for node in stage.path[:-1]:
        lv = topology.levels[node.level - 1]
        ar = level_sum_ms(arrays.sync_bytes(node.start, node.end), node.units, lv, on_gloo(topology))
        out = max(out, float(ar) / above)
        above *= node.units
    return out


def _recomputed(
    candidates: Sequence[StageRecompute],
    mode: str,
    memory: Callable[[StageRecompute], int],
    memory_limit: float | None,
) -> tuple[StageRecompute | None, int]:
    """``mode``'s choice among ``candidates`` under the bytes rule ``memory`` (None when
    ``auto`` finds none that fits), and its bytes (of no recomputation when none fits)."""
    fits = None if memory_limit is None else (lambda option: memory(option) <= memory_limit)
    chosen = choose(candidates, mode, fits)
    return chosen, memory(chosen if chosen is not None else candidates[0])


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
    candidates: Sequence[StageRecompute] | None = None,
    recompute_mode: str = "none",
    fsdp_recomputes: bool = True,
) -> StageShard:
    """The stage's fastest mode of ``modes`` that fits ``memory_limit`` (None: any), or
    ``none`` with its unsharded ``figures`` when it is not a level-1 stage on several
    devices or nothing else is asked; each mode with the recomputation ``recompute_mode``
    chooses among ``candidates`` (``recompute_choice.recompute_candidates``; None: none;
    zero2 / fsdp none unless ``fsdp_recomputes``), and its offload (``planner.offload``) in its time.
    Without a fitting mode: the first mode's figures (the caller refuses the plan on its
    memory, or on ``recompute`` None)."""
    precision = arrays.precision
    params = arrays.params(stage.start, stage.end)
    if candidates is None:
        candidates = [StageRecompute((), 0.0, arrays.saved(stage.start, stage.end), 0.0)]
    largest_param = arrays.largest(stage.start, stage.end)
    working = arrays.working(stage.start, stage.end)
    deferred = arrays.deferred(stage.start, stage.end)
    boundary = arrays.boundary(stage.start, stage.end, packed_copy=on_gloo(topology))

    def unsharded_memory(option: StageRecompute) -> int:
        return plan_stage_memory(
            schedule,
            replicas,
            q,
            params,
            option.activation_bytes + boundary,
            optimizer,
            microbatches,
            precision=precision,
            largest_param_bytes=largest_param,
            transient_bytes=option.transient_bytes,
            working_bytes=working,
            deferred_bytes=deferred,
        )[0]

    _, versions, in_flight = plan_stage_memory(
        schedule, replicas, q, params, 0.0, optimizer, microbatches, precision=precision
    )
    chosen, memory = _recomputed(candidates, recompute_mode, unsharded_memory, memory_limit)
    unsharded = _with_recompute(StageShard("none", 1, figures, memory, versions, in_flight, chosen), stage)
    leaf = stage.path[-1]
    if leaf.level != 1 or leaf.units < 2 or modes == ("none",):
        return unsharded
    d = leaf.units
    kind = schedule_kind(schedule)
    in_flight_exact = kind.activations_in_flight(replicas, q, microbatches, 1)
    lv = topology.levels[0]
    above = math.prod(node.units for node in stage.path[:-1])
    largest_layer = float(largest_layer_range(arrays, stage.start, stage.end))
    temporary = backward_temporary_bytes(largest_param, working, microbatches, precision) + deferred * sum(
        kind.deferred_by_chunk(replicas, q, microbatches, 1)
    )
    higher = _higher_sync_ms(stage, arrays, topology)
    compute, _, comm, _ = figures
    best: StageShard | None = None
    best_fits = False
    for mode in modes:

        def sharded_memory(option: StageRecompute, mode: str = mode) -> int:
            need = shard_memory_bytes(
                mode,
                params,
                option.activation_bytes + boundary,
                versions,
                in_flight_exact,
                optimizer,
                precision,
                d,
                temporary + option.transient_bytes,
                largest_layer,
            )
            return int(math.ceil(need))

        sync = float(
            shard_sync_ms(
                mode,
                params,
                d,
                lv.bandwidth_bytes_per_s,
                lv.message_ms,
                precision,
                replica_microbatches(schedule, microbatches, d),
                on_gloo(topology),
            )
        )
        if mode == "none":
            choice = unsharded
        else:
            plain = base_mode(mode) in FSDP_MODES and not fsdp_recomputes
            option, need = _recomputed(
                candidates[:1] if plain else candidates,
                "none" if plain else recompute_mode,
                sharded_memory,
                memory_limit,
            )
            extra = option.extra_ms if option is not None else 0.0
            host = float(
                offload_ms(
                    mode,
                    params,
                    d,
                    precision,
                    replica_microbatches(schedule, microbatches, d),
                    host_bandwidth(topology),
                )
            )
            allreduce = max(higher, sync / above)
            time = max(((compute + extra) / d + host) / above, allreduce, comm)
            choice = StageShard(
                mode, d, (compute + extra, allreduce, comm, time), need, versions, in_flight, option, host
            )
        time = choice.figures[3]
        fits = choice.recompute is not None and (memory_limit is None or choice.memory_bytes <= memory_limit)
        if best is None:
            best = choice
            best_fits = fits
            continue
        if fits and (not best_fits or time < best.figures[3]):
            best, best_fits = choice, True
    assert best is not None
    return best


def _with_recompute(choice: StageShard, stage: FlatStage) -> StageShard:
    """An unsharded ``choice`` with its recomputed forwards in its compute and time."""
    extra = choice.recompute.extra_ms if choice.recompute is not None else 0.0
    if not extra:
        return choice
    compute, allreduce, comm, time = choice.figures
    compute += extra
    figures = (compute, allreduce, comm, max(time, compute / stage.replicas))
    return StageShard(
        choice.mode,
        choice.degree,
        figures,
        choice.memory_bytes,
        choice.versions,
        choice.in_flight,
        choice.recompute,
    )
