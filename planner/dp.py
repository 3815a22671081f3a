"""PipeDream's hierarchical dynamic program (SOSP 2019, section 3.1), pipeplan cost model.

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
count fits). Tables are monotone in ``tau``; when those at tau = 0 and at the largest tau
agree, one table serves all. 1F1B-flush is charged one whole minibatch of activations
(an upper bound); the final plan's memory is recomputed exactly (``partition``).

Pruning. A stage of the top level on m' units costs at least
``max(C / (m' D_{L-1}), all-reduce)``; ranges whose bound exceeds the time of a plan
already found cannot be in an optimal plan, which bounds the range length ``Lb``.
Running time O(sum_k u_k^2 N Lb^2 Q^2) with numpy over (start, length), memory
O(N Lb u Q) per table; Q = max stages (1 when unbounded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pipeplan.errors import InfeasibleError
from pipeplan.topology import Topology
from pipeplan.planner.costs import LayerArrays, ring_allreduce_ms, transfer_ms
from pipeplan.planner.memory import optimizer_states

__all__ = ["DPSettings", "StageNode", "DPSolution", "solve", "reconstruct", "EXACT_TAU_WORLD"]

EXACT_TAU_WORLD = 64
INF = math.inf


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
    band: int
    top: np.ndarray  # S[i, m, q]: layers [i, N) on m top units, <= q+1 stages
    tables: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # (k, tau) -> A_k
    ctx: "_Context | None" = None


class _Context:
    """Precomputed band arrays shared by every level (ranges [i, i + l), l <= band)."""

    def __init__(self, arrays: LayerArrays, topology: Topology, settings: DPSettings, band: int):
        self.arrays, self.topology, self.settings = arrays, topology, settings
        n = arrays.layers
        self.n, self.band = n, band
        self.rows = n + band + 1
        starts = np.arange(self.rows)[:, None]
        ends = starts + np.arange(band + 1)[None, :]
        self.valid = (ends <= n) & (np.arange(band + 1)[None, :] >= 1)
        s_idx, e_idx = np.minimum(starts, n), np.minimum(ends, n)
        self.compute = arrays.compute_ms[e_idx] - arrays.compute_ms[s_idx]
        self.params = arrays.param_bytes[e_idx] - arrays.param_bytes[s_idx]
        self.saved = arrays.saved_bytes[e_idx] - arrays.saved_bytes[s_idx]
        self.cut = np.zeros(self.rows)
        self.cut[: n + 1] = arrays.cut_bytes
        self.levels = topology.levels
        self.world = topology.world_size
        self.bounded = settings.max_stages is not None
        self.q = settings.max_stages if self.bounded else 1
        self.track_tau = settings.memory_check and settings.schedule == "1f1b-rr"
        self.tau_cache: dict[int, bool] = {}  # level -> tables independent of tau
        self.tables: dict[tuple[int, int], np.ndarray] = {}
        self.stage_tables: dict[tuple[int, int, int], np.ndarray] = {}
        self.opt = optimizer_states(settings.optimizer)

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


def _device_table(ctx: _Context, tau: int) -> np.ndarray:
    """U_0: compute of each range on one device, inf where it does not fit in memory."""
    time = np.where(ctx.valid, ctx.compute, INF)
    if ctx.settings.memory_check:
        if ctx.settings.schedule == "1f1b-rr":
            versions = in_flight = tau + 1
        else:
            versions, in_flight = 1, 1.0
        need = ctx.params * (versions + 1 + ctx.opt) + ctx.saved * in_flight
        time = np.where(need <= ctx.topology.device.memory_bytes, time, INF)
    return np.repeat(time[:, :, None], ctx.q, axis=2)


def _unit_table(ctx: _Context, level: int, tau: int) -> np.ndarray:
    """U_level(i, l, q): best time of each range on one whole unit of ``level``."""
    if level == 0:
        key = (0, ctx.tau_key(tau))
        if key not in ctx.tables:
            ctx.tables[key] = _device_table(ctx, key[1])
        return ctx.tables[key]
    return _level_table(ctx, level, tau)[:, :, -1, :]


def _level_table(ctx: _Context, level: int, tau: int) -> np.ndarray:
    """A_level(i, l, m, q) at ``tau`` (memoised; shared across tau when it cannot matter)."""
    key = ctx.tau_key(tau)
    if ctx.track_tau and level not in ctx.tau_cache:
        low = _fill_level(ctx, level, 0)
        high = _fill_level(ctx, level, ctx.tau_key(ctx.world - 1))
        same = np.array_equal(low, high)
        ctx.tau_cache[level] = same
        ctx.tables[(level, 0)] = low
        ctx.tables[(level, ctx.tau_key(ctx.world - 1))] = high
    if ctx.track_tau and ctx.tau_cache.get(level):
        key = 0
    if (level, key) not in ctx.tables:
        ctx.tables[(level, key)] = _fill_level(ctx, level, key)
    return ctx.tables[(level, key)]


def _stage_table(ctx: _Context, level: int, units: int, tau: int) -> np.ndarray:
    """T_level(i, l, q) for ranges replicated on ``units`` units of level-1 (memoised)."""
    unit = _unit_table(ctx, level - 1, tau)
    below = level - 1
    shared = below >= 1 and ctx.track_tau and ctx.tau_cache.get(below, False)
    key = (level, units, 0 if shared else ctx.tau_key(tau))
    if key not in ctx.stage_tables:
        lv = ctx.levels[level - 1]
        allreduce = ring_allreduce_ms(ctx.params, units, lv.bandwidth_bytes_per_s, lv.latency_ms)
        ctx.stage_tables[key] = np.maximum(unit / units, allreduce[:, :, None])
    return ctx.stage_tables[key]


def _combine(out: np.ndarray, first: np.ndarray, cut: np.ndarray, rest: np.ndarray, bounded: bool) -> None:
    """out[..., q] = min(out, max(first[..., q1], cut, rest[..., q2])) over q1 + q2 + 1 <= q."""
    if not bounded:
        np.minimum(out[..., 0], np.maximum(np.maximum(first[..., 0], cut), rest[..., 0]), out=out[..., 0])
        return
    q_count = out.shape[-1]
    for q in range(1, q_count):
        for q1 in range(q):
            value = np.maximum(np.maximum(first[..., q1], cut), rest[..., q - 1 - q1])
            np.minimum(out[..., q], value, out=out[..., q])


def _split_choices(ctx: _Context, m: int) -> range:
    return range(1, 2) if ctx.settings.straight else range(1, m)


def _fill_level(ctx: _Context, level: int, tau: int) -> np.ndarray:
    """A_level over every range of the band, for 1..u units; O(u^2 N band^2 Q^2)."""
    lv = ctx.levels[level - 1]
    u, per_unit, n, band = lv.count, ctx.devices_per_unit(level - 1), ctx.n, ctx.band
    table = np.full((ctx.rows, band + 1, u + 1, ctx.q), INF)
    cut = transfer_ms(ctx.cut, lv.bandwidth_bytes_per_s, lv.latency_ms)
    for m in range(1, u + 1):
        if m == 1 or not ctx.settings.straight:
            table[:, :, m, :] = _stage_table(ctx, level, m, math.ceil(tau / m))
        for first_units in _split_choices(ctx, m):
            if m - first_units < 1:
                continue
            inner_tau = math.ceil((tau + (m - first_units) * per_unit) / first_units)
            first = _stage_table(ctx, level, first_units, inner_tau)
            rest = table[:, :, m - first_units, :]
            for t in range(1, band):
                # first stage [i, i+t), rest [i+t, i+l) for l in t+1..band
                out = table[:n, t + 1 :, m, :]
                _combine(
                    out,
                    first[:n, t, None, :],
                    cut[t : n + t, None],
                    rest[t : n + t, 1 : band - t + 1, :],
                    ctx.bounded,
                )
        if ctx.settings.use_fewer_devices and m > 1:
            np.minimum(table[:, :, m, :], table[:, :, m - 1, :], out=table[:, :, m, :])
    table[~ctx.valid] = INF
    return table


def _fill_top(ctx: _Context) -> np.ndarray:
    """S[i, m, q]: layers [i, N) on m units of the top level, tau = 0."""
    top = len(ctx.levels)
    lv = ctx.levels[-1]
    u, per_unit, n, band = lv.count, ctx.devices_per_unit(top - 1), ctx.n, ctx.band
    suffix = np.full((n + band + 1, u + 1, ctx.q), INF)
    cut = np.zeros(n + 2 * band + 1)
    cut[: ctx.rows] = transfer_ms(ctx.cut, lv.bandwidth_bytes_per_s, lv.latency_ms)
    starts = np.arange(n)
    lengths = n - starts
    fits = lengths <= band
    idx = starts[:, None] + np.arange(1, band + 1)[None, :]  # i + t, first stage [i, i+t)
    for m in range(1, u + 1):
        if m == 1 or not ctx.settings.straight:
            whole = _stage_table(ctx, top, m, 0)
            suffix[starts[fits], m, :] = whole[starts[fits], lengths[fits], :]
        for first_units in _split_choices(ctx, m):
            if m - first_units < 1:
                continue
            inner_tau = math.ceil((m - first_units) * per_unit / first_units)
            first = _stage_table(ctx, top, first_units, inner_tau)[:n, 1 : band + 1, :]
            rest = suffix[idx, m - first_units, :]
            out = np.full((n, band, ctx.q), INF)
            _combine(out, first, cut[idx], rest, ctx.bounded)
            np.minimum(suffix[:n, m, :], out.min(axis=1), out=suffix[:n, m, :])
        if ctx.settings.use_fewer_devices and m > 1:
            np.minimum(suffix[:, m, :], suffix[:, m - 1, :], out=suffix[:, m, :])
    return suffix


def _band_bound(arrays: LayerArrays, topology: Topology, bound_ms: float) -> int:
    """Longest range whose lower bound as a top-level stage is <= ``bound_ms``."""
    n = arrays.layers
    if not math.isfinite(bound_ms):
        return n
    lv = topology.levels[-1]
    per_unit = math.prod(level.count for level in topology.levels[:-1])
    best = 0
    for start in range(n):
        compute = arrays.compute_ms[start + 1 :] - arrays.compute_ms[start]
        params = arrays.param_bytes[start + 1 :] - arrays.param_bytes[start]
        low = np.full(len(compute), INF)
        for m in range(1, lv.count + 1):
            ar = ring_allreduce_ms(params, m, lv.bandwidth_bytes_per_s, lv.latency_ms)
            low = np.minimum(low, np.maximum(compute / (m * per_unit), ar))
        ok = np.nonzero(low <= bound_ms * (1 + 1e-12))[0]
        if len(ok):
            best = max(best, int(ok[-1]) + 1)
    return max(best, 1)


def _solve_band(arrays: LayerArrays, topology: Topology, settings: DPSettings, band: int) -> DPSolution:
    ctx = _Context(arrays, topology, settings, band)
    top = _fill_top(ctx)
    value = float(top[0, topology.levels[-1].count, ctx.q - 1])
    return DPSolution(value, arrays, topology, settings, band, top, ctx.tables, ctx)


def solve(arrays: LayerArrays, topology: Topology, settings: DPSettings) -> DPSolution:
    """Fill the tables and return the optimum (``time_ms`` is inf when nothing fits).

    A first pass limits ranges to a short band; its plan bounds the optimum, which
    bounds the longest useful range (``_band_bound``); a second pass with that band is
    exact. Raises nothing: ``reconstruct`` and ``partition`` report infeasibility.
    """
    n = arrays.layers
    guess = min(n, max(8, 2 * math.ceil(n / topology.levels[-1].count)))
    first = _solve_band(arrays, topology, settings, guess)
    if guess == n:
        return first
    needed = _band_bound(arrays, topology, first.time_ms)
    if needed <= guess:
        return first
    return _solve_band(arrays, topology, settings, min(n, needed))


def _close(a: float, b: float) -> bool:
    return a == b or (math.isfinite(a) and abs(a - b) <= 1e-12 * max(1.0, abs(b)))


def _reconstruct_level(ctx: _Context, level: int, start: int, end: int, m: int, q: int, tau: int) -> tuple[StageNode, ...]:
    """The pipeline achieving A_level(start, end, m, q) at ``tau``."""
    if level == 0:
        return ()
    table = _level_table(ctx, level, tau)
    length = end - start
    target = float(table[start, length, m, q])
    return _pick(ctx, level, start, end, m, q, tau, target, lambda s, mm, qq: float(table[s, end - s, mm, qq]))


def _pick(ctx, level, start, end, m, q, tau, target, rest_value) -> tuple[StageNode, ...]:
    """Find the choice (single stage or first stage + rest) whose value is ``target``."""
    lv = ctx.levels[level - 1]
    per_unit = ctx.devices_per_unit(level - 1)
    length = end - start
    if not math.isfinite(target):
        raise InfeasibleError("no plan fits (internal: reconstruct of an infeasible entry)")
    if (m == 1 or not ctx.settings.straight) and length <= ctx.band:
        single_tau = math.ceil(tau / m)
        value = float(_stage_table(ctx, level, m, single_tau)[start, length, q])
        if _close(value, target):
            inner = _reconstruct_level(ctx, level - 1, start, end, lv_units(ctx, level - 1), q, single_tau)
            return (StageNode(level, start, end, m, inner),)
    cut = transfer_ms(ctx.cut, lv.bandwidth_bytes_per_s, lv.latency_ms)
    for first_units in _split_choices(ctx, m):
        if m - first_units < 1:
            continue
        inner_tau = math.ceil((tau + (m - first_units) * per_unit) / first_units)
        first = _stage_table(ctx, level, first_units, inner_tau)
        for t in range(1, min(length - 1, ctx.band) + 1):
            split = start + t
            pairs = [(0, 0)] if not ctx.bounded else [(q1, q - 1 - q1) for q1 in range(q)]
            for q1, q2 in pairs:
                value = max(float(first[start, t, q1]), float(cut[split]), rest_value(split, m - first_units, q2))
                if _close(value, target):
                    inner = _reconstruct_level(ctx, level - 1, start, split, lv_units(ctx, level - 1), q1, inner_tau)
                    head = StageNode(level, start, split, first_units, inner)
                    tail = _follow(ctx, level, split, end, m - first_units, q2, tau, rest_value)
                    return (head,) + tail
    if ctx.settings.use_fewer_devices and m > 1:
        return _follow(ctx, level, start, end, m - 1, q, tau, rest_value)
    raise InfeasibleError(f"internal: no choice reproduces {target} ms at level {level}")


def _follow(ctx, level, start, end, m, q, tau, rest_value) -> tuple[StageNode, ...]:
    return _pick(ctx, level, start, end, m, q, tau, rest_value(start, m, q), rest_value)


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
        ctx, top_level, 0, n, u, ctx.q - 1, 0, float(suffix[0, u, ctx.q - 1]),
        lambda s, mm, qq: float(suffix[s, mm, qq]),
    )
