"""PipeDream's optimizer (``optimizer_graph_hierarchical.py``), reproduced for comparison.

States are layer prefixes: state j holds layers 0..j (PipeDream's antichains; for a chain
profile, and for a chain with side edges such as AlexNet's ``Size`` node, they are the
prefixes of the topological order, and the bytes leaving state j are its frontier).
For branching DAGs (ResNet, Inception) PipeDream enumerates every antichain of the
graph; pipeplan keeps one topological order, so exact reproduction is claimed for chain
profiles only. Times are seconds inside (as PipeDream), milliseconds outside.

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
Running time O(L N^2 u^2) with numpy over the split state and m'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeplan.topology import Topology
from pipeplan.planner.costs import LayerArrays
from pipeplan.planner.dp import StageNode

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


def _range_matrix(prefix: np.ndarray, empty: float) -> np.ndarray:
    """M[i, j] = sum of states i..j (inclusive) from a prefix array; ``empty`` where j < i."""
    n = len(prefix) - 1
    out = prefix[None, 1:] - prefix[:n, None]
    out[np.tril_indices(n, -1)] = empty
    return out


def _level(compute, act, params, out_act, units, within, bandwidth, memory, settings, final):
    """One level's tables: time[i, j, m-1], split[i, j, m-1] = (k, m - m'), used[i, j, m-1]."""
    n = compute.shape[0]
    time = np.full((n, n, units), INF)
    split_k = np.full((n, n, units), -1, dtype=np.int64)
    split_m = np.full((n, n, units), -1, dtype=np.int64)
    used = np.zeros((n, n, units), dtype=np.int64)
    max_m = 1 if settings.straight else units
    for m in range(max_m):
        stash = math.ceil((units - (m + 1)) / (m + 1)) * (act + params)
        dp = (4 * m * params) / (bandwidth * (m + 1)) / within
        value = (compute + dp) / (m + 1)
        if settings.memory_check:
            value = np.where(stash > memory, INF, value)
        time[:, :, m] = value
        used[:, :, m] = m + 1
    ratio = settings.activation_compression_ratio
    for i in range(1 if final else n):
        for m in range(1, units):
            m_primes = np.arange(1, 2 if settings.straight else m + 1)
            for j in range(i + 1, n):
                best, best_k, best_m, best_used = time[i, j, m], -1, -1, m + 1
                if settings.use_fewer_devices and time[i, j, m - 1] < best:
                    best, best_k, best_m, best_used = (
                        time[i, j, m - 1], split_k[i, j, m - 1], split_m[i, j, m - 1], used[i, j, m - 1]
                    )
                ks = np.arange(i, j)
                mp = m_primes[None, :]
                last = compute[ks + 1, j][:, None]
                last_params = params[ks + 1, j][:, None]
                stash = (act[ks + 1, j][:, None] + last_params) * np.ceil((units - (m + 1)) / mp)
                last = (last + (4 * (mp - 1) * last_params) / (bandwidth * mp)) / mp
                if settings.memory_check:
                    last = np.where(stash > memory, INF, last)
                first = time[i, ks[:, None], m - mp]
                cand = np.maximum(first, last)
                if ratio is not None:
                    cand = np.maximum(cand, (2.0 * out_act[ks][:, None]) / (bandwidth * mp) / ratio)
                    if j < n - 1:
                        cand = np.maximum(cand, (2.0 * out_act[j]) / (bandwidth * mp) / ratio)
                flat = int(np.argmin(cand))
                k_at, mp_at = divmod(flat, cand.shape[1])
                if cand[k_at, mp_at] < best:
                    best = cand[k_at, mp_at]
                    best_k, best_m, best_used = int(ks[k_at]), int(m - m_primes[mp_at]), int(m_primes[mp_at])
                time[i, j, m], split_k[i, j, m], split_m[i, j, m], used[i, j, m] = best, best_k, best_m, best_used
    return time, split_k, split_m, used


def _analyze(tables, level: int, start: int, end: int, nodes: set) -> tuple[StageNode, ...]:
    """PipeDream's analyze_partitioning for states [start, end) at ``level`` (1-based)."""
    time, split_k, split_m, used = tables[level - 1]
    stages: list[tuple[int, int, int]] = []
    m = time.shape[2] - 1
    last_end = end
    k, mm, units = split_k[start, end - 1, m], split_m[start, end - 1, m], used[start, end - 1, m]
    while k >= 0:
        stages.append((int(k) + 1, last_end, int(units)))
        last_end = int(k) + 1
        k, mm, units = split_k[start, k, mm], split_m[start, k, mm], used[start, k, mm]
    stages.append((start, last_end, int(units)))
    nodes.add((level, start, last_end))
    stages.reverse()
    out = []
    for s, e, u in stages:
        inner = _analyze(tables, level - 1, s, e, nodes) if level > 1 else ()
        out.append(StageNode(level, s, e, u, inner))
    return tuple(out)


def solve_pipedream(arrays: LayerArrays, topology: Topology, settings: PipeDreamSettings) -> PipeDreamSolution:
    """Run PipeDream's hierarchical optimizer over the layer prefixes of ``arrays``."""
    compute = _range_matrix(arrays.compute_ms / 1000.0, INF)
    act = _range_matrix(arrays.output_bytes, 0.0)
    params = _range_matrix(arrays.param_bytes, 0.0)
    out_act = arrays.frontier_bytes[1:]  # bytes leaving state j (prefix of layers 0..j)
    memory = float(topology.device.memory_bytes)
    tables = []
    within = 1
    levels = topology.levels
    for k, level in enumerate(levels):
        final = k == len(levels) - 1
        tables.append(
            _level(compute, act, params, out_act, level.count, within, level.bandwidth_bytes_per_s,
                   memory, settings, final)
        )
        within = level.count
        compute = tables[-1][0][:, :, -1].copy()
    n = arrays.layers
    value = float(tables[-1][0][0, n - 1, -1])
    if not math.isfinite(value):
        return PipeDreamSolution(INF, (), frozenset())
    nodes: set = set()
    stages = _analyze(tables, len(levels), 0, n, nodes)
    return PipeDreamSolution(value * 1000.0, stages, frozenset(nodes))


def pipedream_data_parallel_ms(arrays: LayerArrays, topology: Topology) -> float:
    """PipeDream's data-parallel time: per level t = (t + 4(n-1) P / (B n) / w) / n, in ms."""
    total = float(arrays.compute_ms[-1]) / 1000.0
    params = float(arrays.param_bytes[-1])
    within = 1
    for level in topology.levels:
        n = level.count
        total = (total + (4 * (n - 1) * params) / (level.bandwidth_bytes_per_s * n) / within) / n
        within = n
    return total * 1000.0
