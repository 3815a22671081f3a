"""PipeDream's hierarchical dynamic program (SOSP 2019, section 3.1), pipeplan cost model.

Over a DAG the positions 0..N below are the cut states of ``planner.cuts`` (downsets
sorted by size; the prefixes of the topological order for a chain) and a "range [i, j)"
is the stage state j minus state i, valid only when state i is a proper subset of state
j (``nested_states``; invalid entries stay inf, so every recurrence below only chains
nested states). Lengths are counted in states.

Level 0 is one device; level k groups ``u_k`` units of level k-1 (``D_{k-1}`` devices
each) joined by bandwidth ``B_k``. For a layer range ``[i, j)`` on ``m`` units of level k::

    T_k(i, j, m)  = max( U_{k-1}(i, j) / m,  2(m-1)/m * P(i, j) / B_k )
    A_k(i, j, m)  = min( T_k(i, j, m),
                         min_{s, m'} max( T_k(i, s, m'), 2 a_s / B_k, A_k(s, j, m - m') ) )

where ``U_{k-1}`` is the best time of the range on one whole unit of level k-1
(``U_0`` = its compute on one device) and ``a_s`` the bytes crossing the cut before
layer s. The first stage is split off (a suffix recursion), so a stage always knows how
many devices come after it: that is what its 1F1B-RR memory depends on.

Memory (exact for 1F1B-RR). A stage with n replicas and ``after`` devices from it to the
end of the pipeline keeps ``ceil(after / n)`` minibatches in flight. Inside a unit that
is itself one of m' replicas of an outer stage with ``tail`` devices behind it, this is
``ceil((tau + after_local) / n_local)`` with ``tau = ceil(tail / m')`` (an integer:
ceil(ceil(x) / r) = ceil(x / r)), so the tables of level k are computed per ``tau``.
``tau`` is exact when the topology has at most ``EXACT_TAU_WORLD`` devices; beyond that
it is rounded up to a power of two (conservative: a plan that fits under the rounded
count fits). Tables are monotone in ``tau``: when the device tables at tau = 0 and at
the largest tau agree, one table serves all. Otherwise level 1 of a two-level topology
fills just the taus the top reads, and every other level shares one table when its
tables at tau = 0 and at the largest tau agree. 1F1B-flush is charged one whole minibatch of activations
(an upper bound); the final plan's memory is recomputed exactly (``partition``).

Pruning (exact). Every formula is a min of maxes, so given a limit ``V`` >= the optimum
an entry matters only up to the largest value a plan of time <= V can use there: ``V``
at the top, ``limit_k = limit_{k+1} * F`` below, F the most units of level k+1 whose
all-reduce of the range fits in ``limit_{k+1}`` (``_unit_limits``). Entries whose lower
bound (``compute / devices``, with the all-reduce for one stage) exceeds their limit are
left at inf: entries <= their limit stay exact and the others can only grow, so the
optimum and every tie the reconstruction compares are unchanged. This bounds the range
length per unit count: ``Lt(f)`` for one stage on f units, ``Lr(m)`` for a pipeline on
m units, ``width[k]`` for a whole table. Two more bounds of the same kind skip work:

- *Complement* (``_live``): a range on d devices (R copies) leaves the rest of the
  compute C to the other W - dR devices, so it needs C - c <= V (W - dR) as well as
  c <= V d R. Near a balanced plan (V close to C / W) few ranges pass both, and a
  (units, first-stage units) pair with few live choices is combined sparsely
  (``_combine_live``) instead of densely.
- *Regions* (``_top_regions``): the level below the top is read at tau > 0 only by
  first top stages after a suffix start that a plan <= V allows, so those tables are
  filled only over the states such stages span.

``solve`` runs a pass at a lower bound of the answer (cheap: balanced plans leave few
live choices; the bound is the top level's own DP over relaxed units, ``_relaxed_top_ms``),
and if that does not prove its answer, a pass at 1.25 times that bound, then one at the
best plan known (its answer, or pure data parallelism's time,
``_data_parallel_bound_ms``), which is exact (a finite answer of a pruned pass is the
time of a real plan). The top band
(longest top-level stage) follows from that bound (``_band_bound``).

The reconstruction follows the tau each table was filled with (rounded, or 0 for a
table shared across tau), so it retraces exactly the choices the tables hold.

Running time O(sum_k T_k sum_{f < m <= u_k} N Lt(f) Lr(m - f) Q^2), T_k the number of
tau tables of level k, numpy over (length, start) with the start innermost, in blocks
of ``COLUMN_BLOCK`` starts; memory
O(N width_k u_k Q) per table; Q = max stages (1 when unbounded). ``solve`` estimates the
tables' bytes before a pass allocates them (``table_bytes``) and refuses in one line
above ``PIPEPLAN_PLANNER_MEMORY`` (default 8 GiB): a 20,000-layer chain on 4,096
devices would need about 20 GiB. Without pruning
Lt = Lr = width = band. On the 1,000-layer chain x 4,096 devices of
``bench/bench_planner.py`` about 0.4-1.3 s (16 s to 10 min before pruning).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.schedule import schedule_kind
from pipeplan.topology import Level, Topology
from pipeplan.planner.costs import LayerArrays, ring_allreduce_ms, transfer_ms
from pipeplan.planner.memory import optimizer_states

__all__ = ["DPSettings", "StageNode", "DPSolution", "solve", "reconstruct", "EXACT_TAU_WORLD", "nested_states",
           "table_bytes", "planner_memory_limit", "DEFAULT_PLANNER_MEMORY"]

EXACT_TAU_WORLD = 64
DEFAULT_PLANNER_MEMORY = 8 * 2**30  # bytes of DP tables before ``solve`` refuses
INF = math.inf
PRUNE_SLACK = 1e-9  # relative and absolute (ms) slack added to every pruning limit
LIMIT_ATTEMPTS = 3  # pruned passes before one without pruning
LIMIT_GROWTH = 1.25  # the second round's first limit over the lower bound (a tighter pass is cheaper)


@dataclass(frozen=True)
class DPSettings:
    schedule: str = "1f1b-rr"
    optimizer: str = "sgd"
    straight: bool = False
    max_stages: int | None = None
    use_fewer_devices: bool = False
    memory_check: bool = True


@dataclass(frozen=True)
class StageNode:
    """A stage of level ``level``: layers [start, end) on ``units`` units of level-1.

    ``children`` is the pipeline inside one of those units (empty at level 1, whose
    units are devices).
    """

    level: int
    start: int
    end: int
    units: int
    children: tuple["StageNode", ...] = ()


@dataclass
class DPSolution:
    """Filled tables (``solve``); ``reconstruct`` turns them into stages."""

    time_ms: float
    arrays: LayerArrays
    topology: Topology
    settings: DPSettings
    band: int  # longest top-level stage (layers) the answer was searched over
    top: np.ndarray  # S[m, q, i]: layers [i, N) on m top units, <= q+1 stages
    tables: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # (k, tau) -> A_k[m, q, l, i]
    ctx: "_Context | None" = None
    limit_ms: float = INF  # pruning limit the tables were filled under (inf: none)


class _Context:
    """Band arrays shared by every level and the memoised tables.

    Band arrays are indexed ``[l, i]``: the range [i, i + l), l <= ``span``. Tables are
    ``[q, l, i]`` (level tables ``[m, q, l, i]``), the start innermost so that numpy
    works on long contiguous rows. ``limit_ms`` prunes every entry that cannot be part
    of a plan of time <= ``limit_ms`` (module docstring); inf keeps every entry.
    ``width[k]``: longest range a table of level k < top keeps (later lengths are
    pruned); ``span = width[top - 1]`` (the longest of them); top stages have at most
    ``band`` layers.
    """

    def __init__(self, arrays: LayerArrays, topology: Topology, settings: DPSettings, band: int,
                 limit_ms: float = INF):
        self.arrays, self.topology, self.settings = arrays, topology, settings
        n = arrays.layers
        self.n, self.band = n, band
        self.levels = topology.levels
        self.world = topology.world_size
        self.bounded = settings.max_stages is not None
        self.q: int = settings.max_stages if settings.max_stages is not None else 1
        self.track_tau = _tracks_tau(settings)
        self.tau_cache: dict[int, bool] = {}  # level -> tables independent of tau
        self.tables: dict[tuple[int, int], np.ndarray] = {}
        self.stage_tables: dict[tuple[int, int, int], np.ndarray] = {}
        self.alive: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}  # level -> (stage, pipeline) masks
        self.live_by_start: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.regions: dict[int, tuple[int, int]] | None = None  # tau -> states read by the top (``_top_regions``)
        self.allreduce: dict[tuple[int, int], np.ndarray] = {}
        self.limit_ms = limit_ms
        top = len(self.levels)
        limit = limit_ms * (1.0 + PRUNE_SLACK) + PRUNE_SLACK
        self.first_len = {top: _top_first_lengths(self, limit)}
        self.width = {top: band, top - 1: max(self.first_len[top])}
        self.span = span = self.width[top - 1]
        self.rows = n + span + 1
        lengths = np.arange(span + 1)[:, None]
        starts = np.arange(self.rows)[None, :]
        ends = starts + lengths
        self.valid = (ends <= n) & (lengths >= 1)
        if not arrays.cut_family.is_prefix:  # a stage runs between nested states only
            nested = nested_states(arrays)[: span + 1]
            self.valid[:, : nested.shape[1]] &= nested
        s_idx, e_idx = np.minimum(starts, n), np.minimum(ends, n)
        self.compute = arrays.compute_ms[e_idx] - arrays.compute_ms[s_idx]
        self.params = arrays.param_bytes[e_idx] - arrays.param_bytes[s_idx]
        self.saved = arrays.saved_bytes[e_idx] - arrays.saved_bytes[s_idx]
        self.cut = np.zeros(self.rows)
        self.cut[: n + 1] = arrays.cut_bytes
        self.limits: dict[int, np.ndarray] = {top: np.full((span + 1, self.rows), limit)}
        self.rest_len: dict[int, list[int]] = {}
        for k in range(top - 1, 0, -1):  # a level-k unit serves stages of level k+1 only
            self.limits[k] = _unit_limits(self, k)
            self.first_len[k] = _lengths(self, k, stage=True)
            self.rest_len[k] = _lengths(self, k, stage=False)
            self.width[k - 1] = max(self.first_len[k])

    def devices_per_unit(self, level: int) -> int:
        """Devices in one unit of ``level`` (level 0 = a device)."""
        return math.prod(lv.count for lv in self.levels[:level])

    def tau_key(self, tau: int) -> int:
        if not self.track_tau:
            return 0
        tau = min(tau, self.world - 1)
        if self.world <= EXACT_TAU_WORLD or tau == 0:
            return tau
        return min(1 << (tau - 1).bit_length(), self.world - 1)

    def allreduce_ms(self, level: int, units: int) -> np.ndarray:
        """Ring all-reduce (ms) among ``units`` units of ``level`` of every range [i, i+l),
        l <= the level's width (``span`` at the top) (memoised)."""
        key = (level, units)
        if key not in self.allreduce:
            lv = self.levels[level - 1]
            columns = min(self.width[level], self.span) + 1
            self.allreduce[key] = ring_allreduce_ms(self.params[:columns], units, lv.bandwidth_bytes_per_s,
                                                    lv.latency_ms)
        return self.allreduce[key]


def nested_states(arrays: LayerArrays) -> np.ndarray:
    """ok[l, i]: a stage can run from state i to state i + l (memoised per family).
    Shape (F, F + 1) for F states; all lengths >= 1 for prefixes."""
    family = arrays.cut_family
    key = id(family)
    cached = _NESTED.get(key)
    if cached is None or cached[0] is not family:
        _NESTED.clear()
        cached = (family, family.nested(arrays.layers, arrays.layers + 1))
        _NESTED[key] = cached
    return cached[1]


_NESTED: dict[int, tuple[object, np.ndarray]] = {}


def _longest_prefix(fits: Callable[[np.ndarray], np.ndarray], longest: np.ndarray,
                    arrays: LayerArrays | None = None) -> int:
    """Largest l <= longest[i] over all starts i with fits(l)[i] (0 if none), where
    ``fits`` maps an array of lengths (one per start) to booleans. For prefixes
    (``arrays`` None or a prefix family) it holds for a prefix of lengths at each start:
    binary search, O(log max(longest)) calls. Over a DAG family a stage's sums need not
    grow with its length in state order: every length is tried on the nested ranges,
    O(max(longest)) calls."""
    if arrays is not None and not arrays.cut_family.is_prefix:
        ok_ranges = nested_states(arrays)
        starts = np.arange(len(longest))
        best = 0
        for length in range(1, int(np.max(longest, initial=0)) + 1):
            lengths = np.full(len(longest), length)
            ok = (length <= longest) & ok_ranges[length, starts]
            if ok.any() and np.any(ok & fits(np.minimum(lengths, longest))):
                best = length
        return best
    lo, hi = np.zeros(len(longest), dtype=np.int64), np.asarray(longest, dtype=np.int64)
    while np.any(lo < hi):
        mid = (lo + hi + 1) // 2
        ok = fits(mid)
        active = lo < hi
        lo = np.where(active & ok, mid, lo)
        hi = np.where(active & ~ok, mid - 1, hi)
    return int(lo.max()) if len(lo) else 0


def _top_first_lengths(ctx: _Context, limit: float) -> list[int]:
    """Lt(f) at the top: longest range one top stage on f units can hold within ``limit``
    (its bound max(compute / (f D), all-reduce) grows with the range). O(u N log band)."""
    lv, top = ctx.levels[-1], len(ctx.levels)
    per_unit = ctx.devices_per_unit(top - 1)
    arrays, n = ctx.arrays, ctx.n
    starts = np.arange(n)

    def fits(f: int) -> Callable[[np.ndarray], np.ndarray]:
        def test(lengths: np.ndarray) -> np.ndarray:
            ends = starts + lengths
            compute = arrays.compute_ms[ends] - arrays.compute_ms[starts]
            params = arrays.param_bytes[ends] - arrays.param_bytes[starts]
            allreduce = ring_allreduce_ms(params, f, lv.bandwidth_bytes_per_s, lv.latency_ms)
            return np.maximum(compute / (f * per_unit), allreduce) <= limit * (1.0 + PRUNE_SLACK) + PRUNE_SLACK
        return test

    longest = np.minimum(ctx.band, n - starts)
    return [0] + [_longest_prefix(fits(f), longest, arrays) for f in range(1, lv.count + 1)]


def _unit_limits(ctx: _Context, level: int) -> np.ndarray:
    """limits[level][l, i]: the largest value of a level-``level`` entry (A or T) of range
    [i, i+l), l <= width[level], that a plan within the top limit can use.
    O(u_{level+1} N width).

    A unit of ``level`` serves a stage of level+1 replicated on f units only if that
    stage's all-reduce fits the stage's own limit, so ``limits[level] = limits[level+1]
    * (most such f)``. Limits shrink as ranges grow (more parameters), so the limit of a
    range also bounds every sub-range's useful values.
    """
    columns = ctx.width[level] + 1
    above = ctx.limits[level + 1][:columns]
    replicas = np.ones(above.shape)
    for f in range(2, ctx.levels[level].count + 1):  # all-reduce grows with f
        replicas[ctx.allreduce_ms(level + 1, f)[:columns] <= above] = f
    return above * replicas


def _longest(ok: np.ndarray) -> int:
    """Largest length (row) with a True entry in ``ok[length, start]``; 0 if none."""
    rows = np.nonzero(ok.any(axis=1))[0]
    return int(rows[-1]) if len(rows) else 0


def _lengths(ctx: _Context, level: int, stage: bool) -> list[int]:
    """Lt(f) (``stage``) or Lr(m) for level < top, capped by the level's width.

    One stage on f units of D devices takes at least max(compute / (f D), all-reduce)
    ms; a pipeline on m units at least compute / (m D).
    """
    columns = ctx.width[level] + 1
    per_unit = ctx.devices_per_unit(level - 1)
    limit = ctx.limits[level] * (1.0 + PRUNE_SLACK) + PRUNE_SLACK
    valid, compute = ctx.valid[:columns], ctx.compute[:columns]
    out = [0]
    for units in range(1, ctx.levels[level - 1].count + 1):
        bound = compute / (units * per_unit)
        if stage:
            bound = np.maximum(bound, ctx.allreduce_ms(level, units)[:columns])
        out.append(_longest(valid & (bound <= limit)))
    return out


def _entry(table: np.ndarray, q: int, length: int, start: int) -> float:
    """table[q, length, start] as a float; inf past the table's width (pruned)."""
    return float(table[q, length, start]) if length < table.shape[1] else INF


def _tracks_tau(settings: DPSettings) -> bool:
    """Whether a stage's memory depends on the devices after it (stashed weights)."""
    return settings.memory_check and schedule_kind(settings.schedule).gradients == "stashed"


def _device_need_bytes(settings: DPSettings, params: np.ndarray, saved: np.ndarray, tau: int) -> np.ndarray:
    """Bytes one device needs for ranges of ``params`` and ``saved`` bytes at ``tau``."""
    if _tracks_tau(settings):
        versions, in_flight = tau + 1, float(tau + 1)
    else:
        versions, in_flight = schedule_kind(settings.schedule).weight_versions((1,), 0), 1.0
    return params * (versions + 1 + optimizer_states(settings.optimizer)) + saved * in_flight


def _device_time(ctx: _Context, tau: int, where: tuple) -> np.ndarray:
    """Compute (ms) of the ranges ``[l, i]`` at ``where`` (an index into the band arrays)
    on one device at ``tau``; inf where the range is no stage or does not fit in memory."""
    time = np.where(ctx.valid[where], ctx.compute[where], INF)
    if ctx.settings.memory_check:
        need = _device_need_bytes(ctx.settings, ctx.params[where], ctx.saved[where], tau)
        time = np.where(need <= ctx.topology.device.memory_bytes, time, INF)
    return time


def _device_table(ctx: _Context, tau: int) -> np.ndarray:
    """U_0[q, l, i]: compute of each range on one device, inf where it does not fit in memory."""
    time = _device_time(ctx, tau, (slice(0, ctx.width[0] + 1),))
    return np.repeat(time[None, :, :], ctx.q, axis=0)


def _unit_table(ctx: _Context, level: int, tau: int) -> np.ndarray:
    """U_level[q, l, i]: best time of each range on one whole unit of ``level``."""
    if level == 0:
        key = (0, ctx.tau_key(tau))
        if key not in ctx.tables:
            ctx.tables[key] = _device_table(ctx, key[1])
        return ctx.tables[key]
    return _level_table(ctx, level, tau)[-1]


def _level_table(ctx: _Context, level: int, tau: int) -> np.ndarray:
    """A_level[m, q, l, i] at ``tau`` (memoised; shared across tau when it cannot matter)."""
    key = ctx.tau_key(tau)
    if ctx.track_tau and level not in ctx.tau_cache:
        highest = ctx.tau_key(ctx.world - 1)
        if np.array_equal(_unit_table(ctx, 0, 0), _unit_table(ctx, 0, highest)):
            ctx.tau_cache[level] = True  # memory never binds: no table depends on tau
            ctx.tables[(level, 0)] = _fill_level(ctx, level, 0)
        elif level == len(ctx.levels) - 1 == 1:
            # two levels: the top reads few taus, most over narrow regions (``_top_regions``),
            # and a fill of level 1 reads only device tables: fill those taus, no whole-table check
            ctx.tau_cache[level] = False
        else:
            low = _fill_level(ctx, level, 0)
            high = _fill_level(ctx, level, highest)
            ctx.tau_cache[level] = np.array_equal(low, high)
            ctx.tables[(level, 0)] = low
            ctx.tables[(level, highest)] = high
    if ctx.track_tau and ctx.tau_cache.get(level):
        key = 0
    if (level, key) not in ctx.tables:
        region = _top_regions(ctx).get(key) if level == len(ctx.levels) - 1 else None
        ctx.tables[(level, key)] = _fill_level(ctx, level, key, region)
    return ctx.tables[(level, key)]


def _top_regions(ctx: _Context) -> dict[int, tuple[int, int]]:
    """tau -> states [a, b): the ranges of the level below the top that the top fill
    reads at that tau, other than tau 0, lie inside [a, b) (memoised).

    The top fill reads the table at tau = ceil((m - f) D / f) for a first top stage on f
    of m units (D devices per unit), starting where a suffix on m units starts and at
    most ``Lt(f)`` long. In a plan of time <= V a suffix from state i on m units has
    compute <= V m D and the states before it run on at most (u - m) D devices, so its
    prefix compute is <= V (u - m) D. Entries outside [a, b) belong to no such plan and
    are left partial (never below their exact value). O(u^2 + u N).
    """
    if ctx.regions is not None:
        return ctx.regions
    top = len(ctx.levels)
    u, per_unit, n = ctx.levels[-1].count, ctx.devices_per_unit(top - 1), ctx.n
    prefix = ctx.arrays.compute_ms[:n]
    total = float(ctx.arrays.compute_ms[-1])
    v = ctx.limit_ms * (1.0 + PRUNE_SLACK) + PRUNE_SLACK
    tolerance = 1e-9 * max(1.0, total)
    regions: dict[int, tuple[int, int]] = {}
    for m in range(1, u + 1):
        if math.isfinite(v):
            fits = (prefix <= v * (u - m) * per_unit + tolerance) & (total - prefix <= v * m * per_unit + tolerance)
            starts = np.nonzero(fits)[0]
        else:
            starts = np.arange(n)
        if len(starts) == 0:
            continue
        for first_units in _split_choices(ctx.settings, m):
            if m - first_units < 1:
                continue
            key = ctx.tau_key(math.ceil((m - first_units) * per_unit / first_units))
            reach = min(ctx.band, ctx.first_len[top][first_units])
            a, b = regions.get(key, (n, 0))
            regions[key] = (min(a, int(starts[0])), max(b, min(n, int(starts[-1]) + reach)))
    regions.pop(0, None)  # suffixes from every start read it
    ctx.regions = regions
    return regions


def _stage_table(ctx: _Context, level: int, units: int, tau: int) -> np.ndarray:
    """T_level[q, l, i] for ranges replicated on ``units`` units of level-1 (memoised)."""
    unit = _unit_table(ctx, level - 1, tau)
    below = level - 1
    shared = below >= 1 and ctx.track_tau and ctx.tau_cache.get(below, False)
    key = (level, units, 0 if shared else ctx.tau_key(tau))
    if key not in ctx.stage_tables:
        allreduce = ctx.allreduce_ms(level, units)[: unit.shape[1]]
        values = unit / units
        np.maximum(values, allreduce[None, :, :], out=values)
        ctx.stage_tables[key] = values
    return ctx.stage_tables[key]


def _stage_values(ctx: _Context, level: int, units: int, tau: int, lengths: np.ndarray,
                  starts: np.ndarray) -> np.ndarray:
    """``_stage_table(ctx, level, units, tau)[0, lengths, starts]`` (unbounded), computed at
    those points only unless the table exists: the same operations, so the same values."""
    below = level - 1
    shared = below >= 1 and ctx.track_tau and ctx.tau_cache.get(below, False)
    key = (level, units, 0 if shared else ctx.tau_key(tau))
    if key in ctx.stage_tables:
        return ctx.stage_tables[key][0, lengths, starts]
    if below == 0 and (0, ctx.tau_key(tau)) not in ctx.tables:
        unit = _device_time(ctx, ctx.tau_key(tau), (lengths, starts))
    else:
        unit = _unit_table(ctx, below, tau)[0, lengths, starts]
    return np.maximum(unit / units, ctx.allreduce_ms(level, units)[lengths, starts])


def _combine(out: np.ndarray, head: np.ndarray, rest: np.ndarray, bounded: bool, scratch: np.ndarray) -> None:
    """out[q] = min(out[q], max(head[q1], rest[q2])) over q1 + q2 + 1 = q.

    ``head`` is the first stage's time already maxed with the cut after it (it
    broadcasts against ``rest``); ``scratch`` is a buffer of at least ``rest[0]``'s
    shape. Unbounded (one q): q1 = q2 = 0 and out[0] is updated.
    """
    tmp = scratch[tuple(slice(0, size) for size in rest.shape[1:])]
    if not bounded:
        np.maximum(head[0], rest[0], out=tmp)
        np.minimum(out[0], tmp, out=out[0])
        return
    for q in range(1, out.shape[0]):
        for q1 in range(q):
            np.maximum(head[q1], rest[q - 1 - q1], out=tmp)
            np.minimum(out[q], tmp, out=out[q])


def _split_choices(settings: DPSettings, m: int) -> range:
    """Units of a first stage split off m units: 1 only when ``straight`` (no replicas)."""
    return range(1, 2) if settings.straight else range(1, m)


def _fill_level(ctx: _Context, level: int, tau: int, region: tuple[int, int] | None = None) -> np.ndarray:
    """A_level[m, q, l, i] over every range of the level's width, for 1..u units; with
    ``region = (a, b)`` exact only for ranges inside states [a, b) (``_top_regions``).

    O(sum_{f < m <= u} N Lt(f) Lr(m - f) Q^2): first stages longer than Lt(f) and
    pipelines longer than Lr(m) are pruned (left at their single-stage value or inf).
    Unbounded, a (units, first-stage units) pair whose live choices (``_live``) are few
    enough is combined sparsely (``_combine_live``), in time proportional to them.
    """
    lv = ctx.levels[level - 1]
    u, per_unit, n, width = lv.count, ctx.devices_per_unit(level - 1), ctx.n, ctx.width[level]
    rest_len, first_len = ctx.rest_len[level], ctx.first_len[level]
    table = np.empty((u + 1, ctx.q, width + 1, ctx.rows))
    table[0] = INF
    scratch = np.empty((width + 1, n))
    cut = transfer_ms(ctx.cut, lv.bandwidth_bytes_per_s, lv.latency_ms)
    for m in range(1, u + 1):
        columns = 0
        if m == 1 or not ctx.settings.straight:
            single = _stage_table(ctx, level, m, math.ceil(tau / m))
            columns = min(width + 1, single.shape[1])
            table[m, :, :columns] = single[:, :columns]
        table[m, :, columns:] = INF
        longest = rest_len[m]
        for first_units in _split_choices(ctx.settings, m):
            if m - first_units < 1:
                continue
            after = m - first_units
            inner_tau = math.ceil((tau + after * per_unit) / first_units)
            rest = table[after]
            first_longest = min(first_len[first_units], longest - 1)
            if not ctx.bounded and _combine_live(ctx, level, table[m, 0], (first_units, inner_tau), cut, rest[0],
                                                 m, first_longest, longest):
                continue
            first = _stage_table(ctx, level, first_units, inner_tau)
            low, high = region if region is not None else (0, n)
            block = COLUMN_BLOCK if longest > SHORT_RANGES else n  # blocks of starts keep long rows in cache
            for begin in range(low, high, block):
                end = min(high, begin + block)
                block_longest = min(longest, high - begin)
                for t in range(1, min(first_longest, block_longest - 1) + 1):
                    # first stage [i, i+t), rest [i+t, i+l) for l in t+1..hi
                    hi = min(block_longest, t + rest_len[after])
                    head = np.maximum(first[:, t, begin:end], cut[t + begin : t + end])[:, None, :]
                    _combine(table[m, :, t + 1 : hi + 1, begin:end], head,
                             rest[:, 1 : hi - t + 1, t + begin : t + end], ctx.bounded, scratch)
        if ctx.settings.use_fewer_devices and m > 1:
            np.minimum(table[m], table[m - 1], out=table[m])
    table[:, :, ~ctx.valid[: width + 1]] = INF
    return table


COLUMN_BLOCK = 512  # starts per block of the dense combine (about 1.4x faster than whole rows)
SPARSE_SPEEDUP = 4  # a live choice costs about this many dense elements (gather + scatter-min)
SHORT_RANGES = 64  # pipelines at most this long: whole rows (no blocks) and no sparse combine
SPARSE_MAX_CHOICES = 4_000_000  # beyond this the gathers outgrow the caches: dense is faster


def _live(ctx: _Context, level: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(stage[f], pipeline[m]): masks ``[l, i]`` of the level's ranges that a plan of time
    <= the pruning limit V can use as a stage on f units / a pipeline on m units (memoised).

    Besides the per-entry limit, a complement bound: a range of compute c on d devices
    (``units * devices_per_unit(level - 1)``), R copies of it (R <= W / D_level, W devices),
    leaves the other layers' compute C - c to at most W - dR devices. Every stage of a plan
    takes at least its compute over its devices, so a plan of time <= V needs c <= V d R and
    C - c <= V (W - d R) for some integer R: R in [c / (V d), (V W - C + c) / (V d)]. With V
    near C / W (a balanced plan) only ranges of compute near a multiple of V d stay live.
    Entries a plan <= V uses stay exact (their own choices are live), so the optimum and
    the reconstruction's ties are unchanged. O(u width N).
    """
    if level in ctx.alive:
        return ctx.alive[level]
    columns = ctx.width[level] + 1
    per_unit = ctx.devices_per_unit(level - 1)
    valid, compute = ctx.valid[:columns], ctx.compute[:columns]
    limit = ctx.limits[level] * (1.0 + PRUNE_SLACK) + PRUNE_SLACK
    v = ctx.limit_ms * (1.0 + PRUNE_SLACK) + PRUNE_SLACK
    spare = v * ctx.world - float(ctx.arrays.compute_ms[-1])
    copies = ctx.world // ctx.devices_per_unit(level)
    stages, pipelines = [valid], [valid]
    for units in range(1, ctx.levels[level - 1].count + 1):
        devices = units * per_unit
        if math.isfinite(v) and v > 0:
            low = np.maximum(1.0, np.ceil(compute / (v * devices) - 1e-7))
            high = np.minimum(float(copies), np.floor((spare + compute) / (v * devices) + 1e-7))
            fits = valid & (low <= high)
        else:
            fits = valid
        spread = compute / devices
        pipelines.append(fits & (spread <= limit))
        stages.append(fits & (np.maximum(spread, ctx.allreduce_ms(level, units)[:columns]) <= limit))
    ctx.alive[level] = (stages, pipelines)
    return ctx.alive[level]


def _live_by_start(ctx: _Context, level: int, units: int) -> tuple[np.ndarray, np.ndarray]:
    """The live pipelines on ``units`` units of ``level`` by start: (lengths, offsets),
    start i's lengths ascending in ``lengths[offsets[i] : offsets[i + 1]]`` (memoised)."""
    key = (level, units)
    if key not in ctx.live_by_start:
        starts, lengths = np.nonzero(_live(ctx, level)[1][units][1:, : ctx.n].T)
        offsets = np.concatenate(([0], np.cumsum(np.bincount(starts, minlength=ctx.n))))
        ctx.live_by_start[key] = (lengths + 1, offsets)
    return ctx.live_by_start[key]


def _combine_live(ctx: _Context, level: int, out: np.ndarray, first_stage: tuple[int, int], cut: np.ndarray,
                  rest: np.ndarray, m: int, first_longest: int, longest: int) -> bool:
    """``_fill_level``'s combine of a pipeline on m units, first stage on f units at
    ``tau`` (``first_stage = (f, tau)``), over live choices only, unbounded:
    out[l, i] = min(out[l, i], max(T(t, i), cut[i + t], rest[l - t, i + t])) for every live
    first stage (t, i), live rest and live pipeline (``_live``); T from ``_stage_values``.
    Returns False, doing nothing, when the live choices are not at least
    ``SPARSE_SPEEDUP`` times fewer than the dense loop's elements. O(live choices)."""
    f, tau = first_stage
    n, after = ctx.n, m - f
    rest_longest = ctx.rest_len[level][after]
    if first_longest < 1:
        return True
    if longest <= SHORT_RANGES:
        return False
    dense = sum((min(longest, t + rest_longest) - t) * n for t in range(1, first_longest + 1))
    stages, pipelines = _live(ctx, level)
    lengths, starts = np.nonzero(stages[f][1 : first_longest + 1, :n])
    lengths += 1
    mids = starts + lengths
    keep = mids < n
    lengths, starts, mids = lengths[keep], starts[keep], mids[keep]
    rest_lengths, offsets = _live_by_start(ctx, level, after)
    per_start = np.diff(offsets)
    counts = per_start[mids]
    total = int(counts.sum())
    if total * SPARSE_SPEEDUP > dense or total > SPARSE_MAX_CHOICES:
        return False
    pair = np.repeat(np.arange(len(starts)), counts)
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    tail = rest_lengths[offsets[mids][pair] + within]
    whole = lengths[pair] + tail
    pick = (whole <= longest) & (tail <= rest_longest)
    pair, tail, whole = pair[pick], tail[pick], whole[pick]
    begin = starts[pair]
    pick = pipelines[m][whole, begin]
    pair, tail, whole, begin = pair[pick], tail[pick], whole[pick], begin[pick]
    head = np.maximum(_stage_values(ctx, level, f, tau, lengths, starts), cut[mids])
    value = np.maximum(head[pair], rest[tail, mids[pair]])
    np.minimum.at(out, (whole, begin), value)
    return True


def _fill_top(ctx: _Context, band: int) -> np.ndarray:
    """S[m, q, i]: layers [i, N) on m units of the top level, tau = 0, top stages of at
    most ``band`` (<= ctx.band) layers. O(sum_{f < m <= u} N Lt(f) Q^2)."""
    top = len(ctx.levels)
    lv = ctx.levels[-1]
    u, per_unit, n = lv.count, ctx.devices_per_unit(top - 1), ctx.n
    suffix = np.full((u + 1, ctx.q, n + band + 1), INF)
    cut = np.zeros(n + 2 * band + 1)
    cut[: n + 1] = transfer_ms(ctx.arrays.cut_bytes, lv.bandwidth_bytes_per_s, lv.latency_ms)
    starts = np.arange(n)
    lengths = n - starts
    for m in range(1, u + 1):
        if m == 1 or not ctx.settings.straight:
            whole = _stage_table(ctx, top, m, 0)
            fits = lengths <= min(band, whole.shape[1] - 1)
            suffix[m][:, starts[fits]] = whole[:, lengths[fits], starts[fits]]
        for first_units in _split_choices(ctx.settings, m):
            if m - first_units < 1:
                continue
            longest = min(band, ctx.first_len[top][first_units])
            if longest < 1:
                continue
            inner_tau = math.ceil((m - first_units) * per_unit / first_units)
            first = _stage_table(ctx, top, first_units, inner_tau)[:, 1 : longest + 1, :n]  # first stage [i, i+t)
            rest = sliding_window_view(suffix[m - first_units, :, 1 : n + longest], n, axis=-1)  # [q, t-1, i]: S[i+t]
            head = np.maximum(first, sliding_window_view(cut[1 : n + longest], n)[None, :, :])
            if ctx.bounded:
                out = np.full(rest.shape, INF)
                _combine(out, head, rest, True, np.empty(rest.shape[1:]))
                best = out.min(axis=1)
            else:
                best = np.maximum(head, rest).min(axis=1)
            np.minimum(suffix[m, :, :n], best, out=suffix[m, :, :n])
        if ctx.settings.use_fewer_devices and m > 1:
            np.minimum(suffix[m], suffix[m - 1], out=suffix[m])
    return suffix


def _top_stage_bound(arrays: LayerArrays, topology: Topology, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Lower bound (ms) of layers [starts, ends) as one top-level stage on any unit count.

    Non-decreasing in ``ends`` (every operation is monotone, in floating point too).
    """
    lv = topology.levels[-1]
    per_unit = math.prod(level.count for level in topology.levels[:-1])
    compute = arrays.compute_ms[ends] - arrays.compute_ms[starts]
    params = arrays.param_bytes[ends] - arrays.param_bytes[starts]
    low = np.full(len(starts), INF)
    for m in range(1, lv.count + 1):
        low = np.minimum(low, _relaxed_stage_ms(compute, params, m, per_unit, lv))
    return low


def _relaxed_stage_ms(compute: np.ndarray, params: np.ndarray, units: int, per_unit: int, level: Level) -> np.ndarray:
    """Lower bound (ms) of ranges of ``compute`` ms and ``params`` bytes as one stage on
    ``units`` units of ``level`` (``per_unit`` devices each): max(compute over the devices,
    the ring all-reduce among the units)."""
    allreduce = ring_allreduce_ms(params, units, level.bandwidth_bytes_per_s, level.latency_ms)
    return np.maximum(compute / (units * per_unit), allreduce)


def _band_bound(arrays: LayerArrays, topology: Topology, bound_ms: float) -> int:
    """Longest range whose lower bound as a top-level stage is <= ``bound_ms``.

    Binary search per start (the bound grows with the range): O(N u log N).
    """
    n = arrays.layers
    if not math.isfinite(bound_ms):
        return n
    starts = np.arange(n)

    def fits(lengths: np.ndarray) -> np.ndarray:
        return _top_stage_bound(arrays, topology, starts, starts + lengths) <= bound_ms * (1 + 1e-12)

    return max(_longest_prefix(fits, n - starts, arrays), 1)


def _lower_bound_ms(arrays: LayerArrays, topology: Topology, settings: DPSettings | None = None) -> float:
    """A lower bound (ms) on the answer, the first pruning limit: total compute over every
    device, and either one top stage of every layer or at least one top-level cut; with
    ``settings``, also the top level's own DP over relaxed units (``_relaxed_top_ms``)."""
    n = arrays.layers
    lv = topology.levels[-1]
    spread = float(arrays.compute_ms[-1]) / topology.world_size
    single = float(_top_stage_bound(arrays, topology, np.array([0]), np.array([n]))[0])
    cuts = transfer_ms(arrays.cut_bytes[1:n], lv.bandwidth_bytes_per_s, lv.latency_ms)
    cheapest_cut = float(cuts.min()) if n > 1 and lv.count > 1 else INF
    relaxed = _relaxed_top_ms(arrays, topology, settings) if settings is not None else 0.0
    return max(spread, min(single, cheapest_cut), relaxed)


FIRST_BAND_GROWTH = 2  # the first pass searches top stages up to this many times its guess
RELAXED_MAX_WORK = 30_000_000  # (unit-count pairs) x states^2 of the relaxed top DP: skipped above


def _relaxed_top_ms(arrays: LayerArrays, topology: Topology, settings: DPSettings) -> float:
    """The top level's DP with each unit below relaxed to its compute / devices (no memory
    limit, free links inside): a top stage of compute c and parameters P on f units takes
    max(c / (f D), all-reduce of P on f). Every inner value is at least c / D, so this is a
    lower bound on the answer, and close to it when the top level's links bind (NASNet
    on 4 x 4). O(u^2 F^2) for F states: 0 when that exceeds ``RELAXED_MAX_WORK``."""
    n = arrays.layers
    lv = topology.levels[-1]
    if lv.count * (lv.count + 1) // 2 * (n + 1) ** 2 > RELAXED_MAX_WORK:
        return 0.0
    per_unit = topology.world_size // lv.count
    lengths, starts = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    ends = np.minimum(starts + lengths, n)
    ok = (starts + lengths <= n) & (lengths >= 1)
    if not arrays.cut_family.is_prefix:
        ok &= nested_states(arrays)[: n + 1, : n + 1]
    compute = arrays.compute_ms[ends] - arrays.compute_ms[starts]
    params = arrays.param_bytes[ends] - arrays.param_bytes[starts]
    transfer = np.full(2 * n + 2, INF)
    transfer[: n + 1] = transfer_ms(arrays.cut_bytes, lv.bandwidth_bytes_per_s, lv.latency_ms)
    cut = sliding_window_view(transfer, n + 1)[: n + 1]  # [t, i]: the cut at state i + t
    suffix = np.full((lv.count + 1, 2 * n + 2), INF)  # [m, i]: states from i on m units
    for m in range(1, lv.count + 1):
        best = np.full(n + 1, INF)
        if m == 1 or not settings.straight:
            whole = _relaxed_stage_ms(compute, params, m, per_unit, lv)
            best[:n] = np.where(ok, whole, INF)[n - np.arange(n), np.arange(n)]
        for first_units in _split_choices(settings, m):
            stage = _relaxed_stage_ms(compute, params, first_units, per_unit, lv)
            rest = sliding_window_view(suffix[m - first_units], n + 1)[: n + 1]  # [t, i]: suffix from i + t
            split = np.maximum(np.where(ok, stage, INF), np.maximum(cut, rest))
            np.minimum(best, split.min(axis=0), out=best)
        suffix[m, : n + 1] = best
        if settings.use_fewer_devices and m > 1:
            np.minimum(suffix[m], suffix[m - 1], out=suffix[m])
    return float(suffix[lv.count, 0])


def _data_parallel_bound_ms(arrays: LayerArrays, topology: Topology, settings: DPSettings) -> float:
    """The DP's own value of pure data parallelism (every layer in one stage on every unit
    at every level, tau 0): an upper bound on the answer with top stages of any length;
    inf when that plan is not a candidate (``straight``) or does not fit. O(levels)."""
    if settings.straight and topology.world_size > 1:
        return INF
    params, saved = arrays.param_bytes[-1:] - arrays.param_bytes[:1], arrays.saved_bytes[-1:] - arrays.saved_bytes[:1]
    if settings.memory_check and float(_device_need_bytes(settings, params, saved, 0)[0]) > topology.device.memory_bytes:
        return INF
    value = float(arrays.compute_ms[-1] - arrays.compute_ms[0])
    for level in topology.levels:
        allreduce = ring_allreduce_ms(params, level.count, level.bandwidth_bytes_per_s, level.latency_ms)
        value = max(value / level.count, float(allreduce[0]))
    return value


def _next_limit(limit_ms: float, attempt: int) -> float:
    """Limit of pass ``attempt`` (1, 2, ...) after one under ``limit_ms`` found no plan and
    none is known: fourfold, and the last attempt prunes nothing."""
    if attempt >= LIMIT_ATTEMPTS:
        return INF
    return max(4.0 * limit_ms, 1e-3)


def _some_layer_never_fits(ctx: _Context) -> bool:
    """True when a single layer exceeds device memory even with one minibatch in flight."""
    if not ctx.settings.memory_check:
        return False
    params, saved = np.diff(ctx.arrays.param_bytes), np.diff(ctx.arrays.saved_bytes)
    need = _device_need_bytes(ctx.settings, params, saved, 0)  # _device_table at tau = 0 for single layers
    return bool(np.any(need > ctx.topology.device.memory_bytes))


def _solution(ctx: _Context, band: int) -> DPSolution:
    top = _fill_top(ctx, band)
    value = float(top[ctx.levels[-1].count, ctx.q - 1, 0])
    return DPSolution(value, ctx.arrays, ctx.topology, ctx.settings, band, top, ctx.tables, ctx, ctx.limit_ms)


def table_bytes(arrays: LayerArrays, topology: Topology, settings: DPSettings, band: int) -> int:
    """Estimated peak bytes of one pass's tables with top stages of at most ``band`` states
    (before pruning narrows them): every table is [units, stages, band, N + band] float64;
    two tau tables per inner level (more only where memory binds), one stage table and
    one all-reduce table per unit count and level, and the range arrays. O(levels): the
    check runs before anything is allocated."""
    q = settings.max_stages or 1
    rows = arrays.layers + band + 1
    levels = topology.levels
    per_row = sum(2 * (lv.count + 1) for lv in levels[:-1]) + 2 * sum(lv.count for lv in levels) + 8
    return 8 * q * (band + 1) * rows * per_row


def planner_memory_limit() -> int:
    """Bytes the DP's tables may take: ``PIPEPLAN_PLANNER_MEMORY`` (bytes) or 8 GiB."""
    value = os.environ.get("PIPEPLAN_PLANNER_MEMORY", "")
    try:
        return int(float(value)) if value else DEFAULT_PLANNER_MEMORY
    except ValueError:
        raise InputError(f"PIPEPLAN_PLANNER_MEMORY must be a number of bytes (got {value!r})") from None


def _check_memory(arrays: LayerArrays, topology: Topology, settings: DPSettings, band: int) -> None:
    """One-line refusal before allocating when the tables would exceed the limit."""
    need, limit = table_bytes(arrays, topology, settings, band), planner_memory_limit()
    if need > limit:
        raise InfeasibleError(
            f"planning {arrays.layers} cut states on {topology.world_size} devices with top stages of up to "
            f"{band} states needs about {need / 2**30:.1f} GiB of DP tables, over the planner's limit of "
            f"{limit / 2**30:.1f} GiB (set PIPEPLAN_PLANNER_MEMORY in bytes, or plan fewer layers: merge layers "
            f"or use fewer top-level units)"
        )


def _exact_pass(arrays: LayerArrays, topology: Topology, settings: DPSettings, band: int,
                upper_ms: float = INF, prune: bool = True, start_ms: float | None = None) -> DPSolution:
    """The optimum with top stages of at most ``band`` layers, on pruned tables.

    The limit starts at ``start_ms`` (default: a lower bound of the answer, the
    strongest pruning) and grows until a pass proves its answer. Once a plan within the
    band is known (``upper_ms``, or a pruned pass's finite answer, the time of a real
    plan), the next pass runs at that plan's time and proves; with none known the limit
    grows fourfold (``_next_limit``), the last attempt without pruning (the only one
    when not ``prune``).
    """
    start = start_ms if start_ms is not None else _lower_bound_ms(arrays, topology, settings)
    limit = min(start, upper_ms) if prune else INF
    _check_memory(arrays, topology, settings, band)
    attempt = 0
    while True:
        ctx = _Context(arrays, topology, settings, band, limit)
        solution = _solution(ctx, band)
        if solution.time_ms <= limit or not math.isfinite(limit):
            return solution
        if not math.isfinite(solution.time_ms) and _some_layer_never_fits(ctx):
            return solution  # infeasible under any limit
        attempt += 1
        upper_ms = min(upper_ms, solution.time_ms)
        limit = upper_ms if math.isfinite(upper_ms) else _next_limit(limit, attempt)


def solve(arrays: LayerArrays, topology: Topology, settings: DPSettings, *, prune: bool = True) -> DPSolution:
    """Fill the tables and return the optimum (``time_ms`` is inf when nothing fits).

    A first pass runs at a lower bound of the answer (``_lower_bound_ms``; with few
    live choices it is cheap) over top stages as long as that bound allows
    (``_band_bound``) if that is at most ``FIRST_BAND_GROWTH`` times a short ``guess``,
    else over the guess. If it proves its answer within its band, that is the optimum.
    Otherwise the best plan known, its answer or pure data parallelism
    (``_data_parallel_bound_ms``), bounds the answer and so the longest useful top stage;
    over that band a pass at ``LIMIT_GROWTH`` times the lower bound (cheap, and often
    enough), else one at that plan's time, proves the exact optimum. Passes run on pruned tables
    (``_exact_pass``). ``prune=False`` fills every entry of one pass over every band
    (same answer and plan, slower: for tests).
    Raises nothing: ``reconstruct`` and ``partition`` report infeasibility.
    """
    n = arrays.layers
    if not prune:
        return _exact_pass(arrays, topology, settings, n, prune=False)
    whole = _data_parallel_bound_ms(arrays, topology, settings)
    lower = _lower_bound_ms(arrays, topology, settings)
    guess = min(n, max(8, 2 * math.ceil(n / topology.levels[-1].count)))
    reach = _band_bound(arrays, topology, lower)  # top stages a plan at the lower bound may use
    band = min(n, max(guess, reach) if reach <= FIRST_BAND_GROWTH * guess else guess)
    _check_memory(arrays, topology, settings, band)
    limit = min(lower, whole if band == n else INF)
    first = _solution(_Context(arrays, topology, settings, band, limit), band)
    if first.time_ms <= limit and (band == n or _band_bound(arrays, topology, first.time_ms) <= band):
        return first
    bound = min(first.time_ms, whole)
    if not math.isfinite(bound):  # no plan known yet: grow the limit on this band first
        first = _exact_pass(arrays, topology, settings, band)
        if band == n or _band_bound(arrays, topology, first.time_ms) <= band:
            return first
        bound = first.time_ms
    band = min(n, max(band, _band_bound(arrays, topology, bound)))
    return _exact_pass(arrays, topology, settings, band, bound, start_ms=min(bound, lower * LIMIT_GROWTH))


def _close(a: float, b: float) -> bool:
    return a == b or (math.isfinite(a) and abs(a - b) <= 1e-12 * max(1.0, abs(b)))


RestValue = Callable[[int, int, int], float]


def _reconstruct_level(ctx: _Context, band: int, level: int, start: int, end: int, m: int, q: int,
                       tau: int) -> tuple[StageNode, ...]:
    """The pipeline achieving A_level(start, end, m, q) at ``tau``."""
    if level == 0:
        return ()
    table = _level_table(ctx, level, tau)
    # follow the tau the table was filled with: inner taus derive from it
    filled_tau = 0 if ctx.track_tau and ctx.tau_cache.get(level) else ctx.tau_key(tau)
    target = _entry(table[m], q, end - start, start)
    return _pick(ctx, band, level, start, end, m, q, filled_tau, target,
                 lambda s, mm, qq: _entry(table[mm], qq, end - s, s))


def _pick(ctx: _Context, band: int, level: int, start: int, end: int, m: int, q: int, tau: int,
          target: float, rest_value: RestValue) -> tuple[StageNode, ...]:
    """Find the choice (single stage or first stage + rest) whose value is ``target``.

    Choices are tried in a fixed order (single stage, then first-stage units and length
    ascending), so ties resolve the same way however the tables were filled.
    """
    lv = ctx.levels[level - 1]
    per_unit = ctx.devices_per_unit(level - 1)
    length = end - start
    if not math.isfinite(target):
        raise InfeasibleError("no plan fits (internal: reconstruct of an infeasible entry)")
    if (m == 1 or not ctx.settings.straight) and length <= band:
        single_tau = math.ceil(tau / m)
        value = _entry(_stage_table(ctx, level, m, single_tau), q, length, start)
        if _close(value, target):
            inner = _reconstruct_level(ctx, band, level - 1, start, end, lv_units(ctx, level - 1), q, single_tau)
            return (StageNode(level, start, end, m, inner),)
    cut = transfer_ms(ctx.cut, lv.bandwidth_bytes_per_s, lv.latency_ms)
    for first_units in _split_choices(ctx.settings, m):
        if m - first_units < 1:
            continue
        inner_tau = math.ceil((tau + (m - first_units) * per_unit) / first_units)
        first = _stage_table(ctx, level, first_units, inner_tau)
        for t in range(1, min(length - 1, band) + 1):
            split = start + t
            pairs = [(0, 0)] if not ctx.bounded else [(q1, q - 1 - q1) for q1 in range(q)]
            for q1, q2 in pairs:
                value = max(_entry(first, q1, t, start), float(cut[split]), rest_value(split, m - first_units, q2))
                if _close(value, target):
                    inner = _reconstruct_level(ctx, band, level - 1, start, split, lv_units(ctx, level - 1), q1, inner_tau)
                    head = StageNode(level, start, split, first_units, inner)
                    tail = _follow(ctx, band, level, split, end, m - first_units, q2, tau, rest_value)
                    return (head,) + tail
    if ctx.settings.use_fewer_devices and m > 1:
        return _follow(ctx, band, level, start, end, m - 1, q, tau, rest_value)
    raise InfeasibleError(f"internal: no choice reproduces {target} ms at level {level}")


def _follow(ctx: _Context, band: int, level: int, start: int, end: int, m: int, q: int, tau: int,
            rest_value: RestValue) -> tuple[StageNode, ...]:
    return _pick(ctx, band, level, start, end, m, q, tau, rest_value(start, m, q), rest_value)


def lv_units(ctx: _Context, level: int) -> int:
    """Units a unit of ``level`` holds (its own count); 1 for a device."""
    return ctx.levels[level - 1].count if level >= 1 else 1


def reconstruct(solution: DPSolution) -> tuple[StageNode, ...]:
    """The top-level pipeline of ``solution``, each stage with its inner pipeline."""
    ctx = solution.ctx
    assert ctx is not None
    top_level = len(ctx.levels)
    n, u = ctx.n, ctx.levels[-1].count
    suffix = solution.top
    return _pick(
        ctx, solution.band, top_level, 0, n, u, ctx.q - 1, 0, float(suffix[u, ctx.q - 1, 0]),
        lambda s, mm, qq: float(suffix[mm, qq, s]),
    )
