"""Brute-force reference for the DP: every partition, replication and placement.

Enumerates every hierarchical plan (at each level: consecutive stages between nested cut
states, every downset of the DAG on small graphs (``planner.cuts``), each on a number of
units of the level below, each unit running its own inner pipeline), flattens it
(``planner.placement``), prices it with ``partition.stage_figures`` and the exact memory
of ``planner.memory`` on the flattened replicas, and keeps the fastest that fits.
Exponential: for tests on <= 8 layers and <= 8 devices only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

from pipeplan.planner.costs import LayerArrays, layer_arrays
from pipeplan.planner.cuts import cut_family
from pipeplan.planner.dp import StageNode
from pipeplan.planner.options import planned_fsdp, planned_shard_modes
from pipeplan.planner.partition import PartitionOptions, charged_optimizer, planned_recompute, stage_figures
from pipeplan.planner.placement import flatten
from pipeplan.planner.recompute import gain_bytes
from pipeplan.planner.recompute_choice import recompute_candidates
from pipeplan.planner.shard_choice import stage_shard
from pipeplan.profile import Profile
from pipeplan.topology import Topology

__all__ = ["pipelines", "evaluate", "exhaustive_best"]


Nested = Callable[[int, int], bool]


def _compositions(
    start: int, end: int, units: int, straight: bool, fewer: bool, nested: Nested
) -> Iterator[list[tuple[int, int, int]]]:
    """Every chain of states start < s_1 < ... < end (each a proper subset of the next)
    with unit counts summing to ``units``."""
    if start == end:
        if units == 0 or fewer:
            yield []
        return
    for stop in range(start + 1, end + 1):
        if not (nested(start, stop) and (stop == end or nested(stop, end))):
            continue
        for count in range(1, units + 1):
            if straight and count > 1:
                break
            for rest in _compositions(stop, end, units - count, straight, fewer, nested):
                yield [(start, stop, count)] + rest


def pipelines(
    level: int,
    start: int,
    end: int,
    units: int,
    topology: Topology,
    options: PartitionOptions,
    nested: Nested = lambda i, j: i < j,
) -> Iterator[tuple[StageNode, ...]]:
    """Every pipeline from state ``start`` to state ``end`` on ``units`` units of level
    ``level`` (1-based); ``nested(i, j)``: a stage may run from state i to state j."""
    fewer = options.use_fewer_devices
    for stages in _compositions(start, end, units, options.straight, fewer, nested):
        inner_units = topology.levels[level - 2].count if level >= 2 else 0
        inner_choices = [
            list(pipelines(level - 1, s, e, inner_units, topology, options, nested)) if level >= 2 else [()]
            for s, e, _ in stages
        ]
        for inner in itertools.product(*inner_choices):
            yield tuple(StageNode(level, s, e, c, kids) for (s, e, c), kids in zip(stages, inner))


def evaluate(
    tree: tuple[StageNode, ...],
    arrays: LayerArrays,
    topology: Topology,
    options: PartitionOptions,
    profile: Profile | None = None,
) -> float:
    """Time per minibatch (ms) of ``tree``, or inf when a stage does not fit in memory.
    With ``profile``, each stage recomputes what ``options.recompute`` chooses for it
    (``planner.recompute``: its forwards again in its compute)."""
    flat = flatten(tree, topology)
    if options.max_stages is not None and len(flat) > options.max_stages:
        return math.inf
    replicas = [stage.replicas for stage in flat]
    limit = topology.device.memory_bytes if options.memory_check else None
    modes = planned_shard_modes(options, topology)
    gains = gain_bytes(profile) if profile is not None else None
    times = []
    for q, (stage, figure) in enumerate(zip(flat, stage_figures(flat, arrays, topology, options))):
        candidates = (
            recompute_candidates(
                profile,
                arrays.cut_family.stage_layers(stage.start, stage.end),
                options.microbatches,
                options.recompute,
                gains,
            )
            if profile is not None
            else None
        )
        shard = stage_shard(
            stage, q, replicas, arrays, topology, options.schedule, options.optimizer,
            options.microbatches, modes, figure, limit, candidates,
            options.recompute if profile is not None else "none", options.shard != "auto",
        )  # fmt: skip
        if shard.recompute is None or (limit is not None and shard.memory_bytes > limit):
            return math.inf
        times.append(shard.figures[3])
    return max(times)


def exhaustive_best(
    profile: Profile, topology: Topology, options: PartitionOptions
) -> tuple[float, tuple[StageNode, ...] | None]:
    """(best time in ms, its tree) over every plan cutting at the planner's cut states
    (every downset on a small DAG); (inf, None) when none fits. Trees are over states."""
    # as partition plans it: auto is none where nothing recomputes
    options = planned_recompute(options, 1, profile.master_dtype is not None, bool(profile.estimated))
    options = planned_fsdp(options, profile, topology)
    planned_shard_modes(options, topology)  # refuses an offload as partition does, trees or not
    arrays = layer_arrays(profile, charged_optimizer(options), cut_family(profile))
    top = len(topology.levels)
    best, best_tree = math.inf, None
    for tree in pipelines(top, 0, arrays.layers, topology.levels[-1].count, topology, options, arrays.nested):
        value = evaluate(tree, arrays, topology, options, profile)
        if value < best:
            best, best_tree = value, tree
    return best, best_tree
