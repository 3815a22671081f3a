"""PipeDream's optimizer (``optimizer_graph_hierarchical.py``), reproduced for comparison.

States are the cut states of ``planner.cuts`` (PipeDream's state j is cut state j + 1;
the empty state is implicit). PipeDream enumerates the downsets of the DAG that its
antichain DAG reaches (every downset that holds the first source); pipeplan searches
every downset when there are few enough (``all-downsets``), which contains PipeDream's
states, and a bounded family otherwise. A stage runs between nested states only (state i
a proper subset of state j). Differences from PipeDream, on purpose:

- the bytes leaving a state are those crossing its cut, each tensor once (plus the last
  layer's own output when nothing outside reads it); PipeDream's augmented antichain also
  charges a predecessor whose readers all lie inside (README, PipeDream section);
- PipeDream's inner levels may combine ranges whose states are not nested (it skips only
  splits that are predecessors of the range's start): pipeplan does not.

For chain profiles (VGG-16, AlexNet) the states are the prefixes and the result is
PipeDream's exactly. Times are seconds inside (as PipeDream), milliseconds outside.

Per level k (u units joined by bandwidth B, ``w`` = units inside one unit, 1 at level 1),
for the range of states [i, j] on m units (m-1 = index in PipeDream's tables):

- one stage: ``(C(i, j) + 4 (m-1) P / (B m) / w) / m``, where C is the previous level's
  best time on all its units (level 1: the compute sum);
- split after state k, the last stage on m' units:
  ``max(A(i, k, m - m'), (C(k+1, j) + 4 (m'-1) P / (B m')) / m')``, and, only with an
  activation compression ratio r, also ``2 a_k / (B m' r)`` and ``2 a_j / (B m' r)``;
- memory check (when on): a single stage is dropped when
  ``ceil((u - m) / m) * (act + params) > memory``, a last stage when
  ``ceil((u - m) / m') * (act + params) > memory`` (act = outputs of its layers);
- ``use_fewer_devices``: A(i, j, m) may take A(i, j, m-1) when that is strictly faster;
- the top level only fills the splits of prefixes (i = 0).

Ties go to the first candidate in (k, m') order with k ascending (PipeDream iterates a
Python set there, so its own tie order depends on object addresses); when A(i, j, m-1)
is missing (memory) it is never taken (Python 2 would compare None < x as true).
Running time O(u^2 F^3 / 6) per inner level and O(u^2 F^2) at the top for F states, in
numpy blocks over (range start, range end) for each split state k and m' (O(u^2 F)
Python steps); tables hold values only, and the reconstruction finds each chosen split
again in the same order (``_choice``). Memory O(u^2 F^2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeplan.errors import InfeasibleError
from pipeplan.planner.costs import LayerArrays
from pipeplan.planner.dp import StageNode, nested_states
from pipeplan.topology import Topology

__all__ = ["PipeDreamSettings", "PipeDreamSolution", "solve_pipedream", "pipedream_data_parallel_ms"]

INF = math.inf


@dataclass(frozen=True)
class PipeDreamSettings:
    straight: bool = False
    use_fewer_devices: bool = False
    memory_check: bool = True
    activation_compression_ratio: float | None = None


@dataclass(frozen=True)
class PipeDreamSolution:
    time_ms: float  # PipeDream's "time per stage in pipeline", in ms
    stages: tuple[StageNode, ...]  # top-level pipeline with inner pipelines
    single_stage_nodes: frozenset[tuple[int, int, int]]  # (level, start, end) chosen as one stage


def _range_matrix(prefix: np.ndarray, empty: float, nested: np.ndarray) -> np.ndarray:
    """M[i, j] = sum of states i..j from the per-state sums (PipeDream's state j is cut
    state j + 1); ``empty`` where the stage is not a difference of nested states."""
    n = len(prefix) - 1
    out = prefix[None, 1:] - prefix[:n, None]
    out[~nested] = empty
    return out


def _nested_pairs(arrays: LayerArrays) -> np.ndarray:
    """ok[i, j]: PipeDream's range i..j is a stage (cut state i a proper subset of j + 1)."""
    n = arrays.layers
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    if arrays.cut_family.is_prefix:
        return j >= i
    ok = nested_states(arrays)  # [length, start]
    length = j + 1 - i
    return (length >= 1) & ok[np.clip(length, 0, n), i]


@dataclass
class _LevelTables:
    """One level: time[m-1, i, j] (seconds, inf when nothing fits) and what rebuilding a
    split needs; splits are found again on the way back (``_choice``)."""

    time: np.ndarray
    single: np.ndarray  # single-stage time[m-1, i, j]
    last: dict[tuple[int, int], np.ndarray]  # (m-1, m') -> last-stage time [k+1, j] with its transfer terms
    first_extra: dict[int, np.ndarray]  # m' -> transfer term of the split after state k (or zeros)
    fewer: bool


def _level(
    compute: np.ndarray,
    act: np.ndarray,
    params: np.ndarray,
    grads: np.ndarray,
    out_act: np.ndarray,
    units: int,
    within: float,
    bandwidth: float,
    memory: float,
    settings: PipeDreamSettings,
    final: bool,
) -> _LevelTables:
    """One level's table. O(u^2 n^3 / 6) numpy work (n^2 u^2 at the final level, whose
    ranges all start at state 0), O(u^2 n) Python steps. ``params`` are the ranges'
    weight bytes (the memory rule), ``grads`` the gradient bytes they all-reduce."""
    n = compute.shape[0]
    time = np.full((units, n, n), INF)
    max_m = 1 if settings.straight else units
    for m in range(max_m):
        stash = math.ceil((units - (m + 1)) / (m + 1)) * (act + params)
        dp = (4 * m * grads) / (bandwidth * (m + 1)) / within
        value = (compute + dp) / (m + 1)
        if settings.memory_check:
            value = np.where(stash > memory, INF, value)
        time[m] = value
    single = time.copy()
    ratio = settings.activation_compression_ratio
    last: dict[tuple[int, int], np.ndarray] = {}
    first_extra: dict[int, np.ndarray] = {}
    for m_prime in range(1, units):
        if ratio is None:
            first_extra[m_prime] = np.zeros(n)
        else:
            first_extra[m_prime] = (2.0 * out_act) / (bandwidth * m_prime) / ratio
    rows = 1 if final else n
    for m in range(1, units):
        best = time[m]
        if settings.use_fewer_devices:
            take = time[m - 1] < best
            take[np.tril_indices(n)] = False  # PipeDream only looks at j > i here,
            take[rows:] = False  # and at i = 0 on the final level
            best[take] = time[m - 1][take]
        for m_prime in range(1, 2 if settings.straight else m + 1):
            cost = compute + (4 * (m_prime - 1) * grads) / (bandwidth * m_prime)
            cost = cost / m_prime
            if settings.memory_check:
                stash = (act + params) * math.ceil((units - (m + 1)) / m_prime)
                cost = np.where(stash > memory, INF, cost)
            if ratio is not None:
                out = (2.0 * out_act) / (bandwidth * m_prime) / ratio
                out[n - 1] = 0.0  # no output transfer after the last state
                cost = np.maximum(cost, out[None, :])
            last[(m, m_prime)] = cost
            first = time[m - m_prime]
            extra = first_extra[m_prime]
            if rows == 1:  # final level: one (split k, end j) matrix for the range starting at 0
                head = np.maximum(first[0, : n - 1], extra[: n - 1])
                np.minimum(
                    best[0], np.maximum(head[:, None], cost[1:, :]).min(axis=0, initial=INF), out=best[0]
                )
                continue
            for k in range(n - 1):
                top = min(rows, k + 1)
                head = np.maximum(first[:top, k], extra[k])
                block = best[:top, k + 1 :]
                np.minimum(block, np.maximum(head[:, None], cost[k + 1, k + 1 :][None, :]), out=block)
    return _LevelTables(time, single, last, first_extra, settings.use_fewer_devices)


def _choice(tables: _LevelTables, i: int, j: int, m: int, straight: bool) -> tuple[int, int, int]:
    """(k, m - m', m') of PipeDream's choice for time[m, i, j]: k = -1 for one stage
    (then m - m' is -1 and m' the units), or the fewer-devices entry (k, m'') of m - 1.
    Ties go to the first candidate in (k, m') order, as PipeDream's loop takes it."""
    best = tables.single[m, i, j]
    if m == 0:
        return -1, -1, 1
    if tables.fewer and j > i and tables.time[m - 1, i, j] < best:
        best = tables.time[m - 1, i, j]
        fallback = _choice(tables, i, j, m - 1, straight)
    else:
        fallback = (-1, -1, m + 1)
    target = tables.time[m, i, j]
    if not target < best:
        return fallback
    for k in range(i, j):
        for m_prime in range(1, 2 if straight else m + 1):
            head = max(tables.time[m - m_prime, i, k], tables.first_extra[m_prime][k])
            value = max(head, tables.last[(m, m_prime)][k + 1, j])
            if value == target:
                return k, m - m_prime, m_prime
    raise InfeasibleError(f"internal: no PipeDream split reproduces {target} s")


def _analyze(
    tables: list[_LevelTables], level: int, start: int, end: int, nodes: set, straight: bool
) -> tuple[StageNode, ...]:
    """PipeDream's analyze_partitioning for states [start, end) at ``level`` (1-based)."""
    table = tables[level - 1]
    stages: list[tuple[int, int, int]] = []
    m = table.time.shape[0] - 1
    last_end = end
    k, mm, units = _choice(table, start, end - 1, m, straight)
    while k >= 0:
        stages.append((int(k) + 1, last_end, int(units)))
        last_end = int(k) + 1
        k, mm, units = _choice(table, start, k, mm, straight)
    stages.append((start, last_end, int(units)))
    nodes.add((level, start, last_end))
    stages.reverse()
    out = []
    for s, e, u in stages:
        inner = _analyze(tables, level - 1, s, e, nodes, straight) if level > 1 else ()
        out.append(StageNode(level, s, e, u, inner))
    return tuple(out)


def solve_pipedream(
    arrays: LayerArrays, topology: Topology, settings: PipeDreamSettings
) -> PipeDreamSolution:
    """Run PipeDream's hierarchical optimizer over the cut states of ``arrays``.

    PipeDream's state j is cut state j + 1 (state 0, the empty set, is implicit); a
    stage runs between nested states only. Stage nodes come back in cut-state indices.
    """
    nested = _nested_pairs(arrays)
    compute = _range_matrix(arrays.compute_ms / 1000.0, INF, nested)
    act = _range_matrix(arrays.output_bytes, 0.0, nested)
    params = _range_matrix(arrays.param_bytes, 0.0, nested)
    grads = params * arrays.precision.gradient_ratio  # all-reduced in the gradients' dtype
    out_act = arrays.frontier_bytes[1:]  # bytes leaving state j
    memory = float(topology.device.memory_bytes)
    tables = []
    within = 1
    levels = topology.levels
    for k, level in enumerate(levels):
        final = k == len(levels) - 1
        tables.append(
            _level(
                compute,
                act,
                params,
                grads,
                out_act,
                level.count,
                within,
                level.bandwidth_bytes_per_s,
                memory,
                settings,
                final,
            )
        )
        within = level.count
        compute = tables[-1].time[-1].copy()
    n = arrays.layers
    value = float(tables[-1].time[-1, 0, n - 1])
    if not math.isfinite(value):
        return PipeDreamSolution(INF, (), frozenset())
    nodes: set = set()
    stages = _analyze(tables, len(levels), 0, n, nodes, settings.straight)
    return PipeDreamSolution(value * 1000.0, stages, frozenset(nodes))


def pipedream_data_parallel_ms(arrays: LayerArrays, topology: Topology) -> float:
    """PipeDream's data-parallel time: per level t = (t + 4(n-1) P / (B n) / w) / n, in ms."""
    total = float(arrays.compute_ms[-1]) / 1000.0
    grads = arrays.sync_bytes(0, arrays.layers)
    within = 1
    for level in topology.levels:
        n = level.count
        total = (total + (4 * (n - 1) * grads) / (level.bandwidth_bytes_per_s * n) / within) / n
        within = n
    return total * 1000.0
