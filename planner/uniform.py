"""Megatron-shaped candidates: p pipeline stages of balanced layers, each on d devices.

The DP (``planner.dp``) is exact on its objective, the slowest stage without the
pipeline's bubble; with flush schedules the bubble, (p - 1) / (micro-batches per
replica) of the period, favours shallow pipelines that the DP does not see. Megatron's
PTD-P plans are uniform: p stages, each replicated d times, p * d = devices. For every
such (p, d) the topology allows, ``uniform_trees`` cuts the layers into p contiguous
stages of balanced compute (the smallest slowest stage, by bisection on it) and lays
them out as the DP's stage trees, so that ``partition`` prices, checks and simulates
them exactly as the DP's own plan and keeps the fastest simulated one.

Two-level topologies only (devices in units, units in the cluster): a stage takes d / g
whole units when d is a multiple of the g devices per unit, or shares a unit with
g / d - 1 others when d divides g. Chains only (the prefix cut family).
"""

from __future__ import annotations

import numpy as np

from pipeplan.planner.costs import LayerArrays
from pipeplan.planner.dp import StageNode
from pipeplan.topology import Topology

__all__ = ["uniform_shapes", "balanced_cuts", "uniform_trees"]


def uniform_shapes(topology: Topology, layers: int) -> list[tuple[int, int]]:
    """(p, d) with p * d = devices, p <= layers, laid out whole within the two levels.

    >>> from pipeplan.topology import DeviceSpec, Level
    >>> uniform_shapes(Topology("x", DeviceSpec("d", 1), (Level("n", 2, 1.0), Level("c", 3, 1.0))), 9)
    [(1, 6), (2, 3), (3, 2), (6, 1)]
    """
    if len(topology.levels) != 2:
        return []
    g, n = topology.levels[0].count, topology.levels[1].count
    out = []
    for p in range(1, min(layers, g * n) + 1):
        if (g * n) % p:
            continue
        d = g * n // p
        if d % g == 0 or g % d == 0:
            out.append((p, d))
    return out


def balanced_cuts(compute_ms: np.ndarray, stages: int) -> list[int]:
    """Cut states 0 = c_0 < c_1 < ... < c_p = N minimising the largest stage compute
    (``compute_ms`` a prefix sum over N states), by bisection on that largest compute with
    a greedy fill (each stage as long as the bound allows, leaving a state for each later
    stage). O(N log(1/eps)). ``[]`` when there are fewer states than stages.

    >>> balanced_cuts(np.cumsum([0.0, 1, 1, 1, 1, 4]), 3)
    [0, 3, 4, 5]
    """
    n = len(compute_ms) - 1
    if stages > n:
        return []
    widths = np.diff(compute_ms)
    low, high = float(widths.max()), float(compute_ms[-1] - compute_ms[0])
    best = _fill(compute_ms, stages, high)
    for _ in range(60):
        if high - low <= 1e-9 * max(high, 1.0):
            break
        middle = (low + high) / 2
        cuts = _fill(compute_ms, stages, middle)
        if cuts:
            best, high = cuts, middle
        else:
            low = middle
    return best


def _fill(compute_ms: np.ndarray, stages: int, bound: float) -> list[int]:
    """Greedy cuts with every stage's compute <= ``bound``; [] when p stages cannot."""
    n = len(compute_ms) - 1
    cuts = [0]
    for q in range(stages - 1):
        start = cuts[-1]
        last = n - (stages - 1 - q)  # leave one state for each later stage
        limit = compute_ms[start] + bound
        end = int(np.searchsorted(compute_ms, limit * (1 + 1e-12), side="right")) - 1
        end = min(end, last)
        if end <= start:
            return []
        cuts.append(end)
    if compute_ms[n] - compute_ms[cuts[-1]] > bound * (1 + 1e-12):
        return []
    return cuts + [n]


def uniform_trees(arrays: LayerArrays, topology: Topology) -> list[tuple[int, int, tuple[StageNode, ...]]]:
    """(p, d, the DP's stage tree) of every uniform shape (``uniform_shapes``), stages cut
    by ``balanced_cuts``. Empty for a DAG's cut family or another number of levels."""
    if not arrays.cut_family.is_prefix:
        return []
    g = topology.levels[0].count
    out = []
    for p, d in uniform_shapes(topology, arrays.layers):
        cuts = balanced_cuts(arrays.compute_ms, p)
        if not cuts:
            continue
        spans = list(zip(cuts[:-1], cuts[1:]))
        if d % g == 0:  # each stage on d / g whole units
            tree = tuple(StageNode(2, s, e, d // g, (StageNode(1, s, e, g),)) for s, e in spans)
        else:  # g / d stages share each unit
            per = g // d
            tree = tuple(
                StageNode(
                    2,
                    spans[u * per][0],
                    spans[u * per + per - 1][1],
                    1,
                    tuple(StageNode(1, s, e, d) for s, e in spans[u * per : (u + 1) * per]),
                )
                for u in range(p // per)
            )
        out.append((p, d, tree))
    return out
