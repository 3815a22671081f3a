"""The exact tables of the hierarchical DP: level, stage and top tables, dense and sparse combines."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pipeplan.planner.costs import level_sum_ms, on_gloo, transfer_ms
from pipeplan.planner.dp.context import (
    INF,
    PRUNE_SLACK,
    DPContext,
    DPSettings,
    device_table,
    device_time,
    sharding,
)
from pipeplan.planner.dp.sharded import sharded_stage_values

__all__ = [
    "COLUMN_BLOCK",
    "SHORT_RANGES",
    "SPARSE_MAX_CHOICES",
    "SPARSE_SPEEDUP",
    "TOP_BLOCK_ELEMENTS",
    "fill_top",
    "level_table",
    "split_choices",
    "stage_table",
]


def _unit_table(ctx: DPContext, level: int, tau: int) -> np.ndarray:
    """U_level[q, l, i]: best time of each range on one whole unit of ``level``."""
    if level == 0:
        key = (0, ctx.tau_key(tau))
        if key not in ctx.tables:
            ctx.tables[key] = device_table(ctx, key[1])
        return ctx.tables[key]
    return level_table(ctx, level, tau)[-1]


def level_table(ctx: DPContext, level: int, tau: int) -> np.ndarray:
    """A_level[m, q, l, i] at ``tau`` (memoised; shared across tau when it cannot matter)."""
    key = ctx.tau_key(tau)
    if ctx.track_tau and level not in ctx.tau_cache:
        highest = ctx.tau_key(ctx.world - 1)
        # (sharded level-1 stages are valued off the device tables: planner.dp.sharded)
        if not sharding(ctx.settings) and np.array_equal(
            _unit_table(ctx, 0, 0), _unit_table(ctx, 0, highest)
        ):
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


def _top_regions(ctx: DPContext) -> dict[int, tuple[int, int]]:
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
            fits = (prefix <= v * (u - m) * per_unit + tolerance) & (
                total - prefix <= v * m * per_unit + tolerance
            )
            starts = np.nonzero(fits)[0]
        else:
            starts = np.arange(n)
        if len(starts) == 0:
            continue
        for first_units in split_choices(ctx.settings, m):
            if m - first_units < 1:
                continue
            key = ctx.tau_key(math.ceil((m - first_units) * per_unit / first_units))
            reach = min(ctx.band, ctx.first_len[top][first_units])
            a, b = regions.get(key, (n, 0))
            regions[key] = (min(a, int(starts[0])), max(b, min(n, int(starts[-1]) + reach)))
    regions.pop(0, None)  # suffixes from every start read it
    ctx.regions = regions
    return regions


def stage_table(ctx: DPContext, level: int, units: int, tau: int) -> np.ndarray:
    """T_level[q, l, i] for ranges replicated on ``units`` units of level-1 (memoised)."""
    unit = _unit_table(ctx, level - 1, tau)
    below = level - 1
    shared = below >= 1 and ctx.track_tau and ctx.tau_cache.get(below, False)
    key = (level, units, 0 if shared else ctx.tau_key(tau))
    if key not in ctx.stage_tables:
        if level == 1 and units > 1 and sharding(ctx.settings):
            best = sharded_stage_values(ctx, ctx.tau_key(tau), units, (slice(0, unit.shape[1]),))
            ctx.stage_tables[key] = np.repeat(best[None, :, :], ctx.q, axis=0)
            return ctx.stage_tables[key]
        allreduce = ctx.allreduce_ms(level, units)[: unit.shape[1]]
        values = unit / units
        np.maximum(values, allreduce[None, :, :], out=values)
        ctx.stage_tables[key] = values
    return ctx.stage_tables[key]


def _stage_values(
    ctx: DPContext, level: int, units: int, tau: int, lengths: np.ndarray, starts: np.ndarray
) -> np.ndarray:
    """``stage_table(ctx, level, units, tau)[0, lengths, starts]`` (unbounded), computed at
    those points only unless the table exists: the same operations, so the same values."""
    below = level - 1
    shared = below >= 1 and ctx.track_tau and ctx.tau_cache.get(below, False)
    key = (level, units, 0 if shared else ctx.tau_key(tau))
    if key in ctx.stage_tables:
        return ctx.stage_tables[key][0, lengths, starts]
    if level == 1 and units > 1 and sharding(ctx.settings):
        return sharded_stage_values(ctx, ctx.tau_key(tau), units, (lengths, starts))
    if below == 0 and (0, ctx.tau_key(tau)) not in ctx.tables:
        unit = device_time(ctx, ctx.tau_key(tau), (lengths, starts))
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


def split_choices(settings: DPSettings, m: int) -> range:
    """Units of a first stage split off m units: 1 only when ``straight`` (no replicas)."""
    return range(1, 2) if settings.straight else range(1, m)


def _fill_level(ctx: DPContext, level: int, tau: int, region: tuple[int, int] | None = None) -> np.ndarray:
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
            single = stage_table(ctx, level, m, math.ceil(tau / m))
            columns = min(width + 1, single.shape[1])
            table[m, :, :columns] = single[:, :columns]
        table[m, :, columns:] = INF
        longest = rest_len[m]
        for first_units in split_choices(ctx.settings, m):
            if m - first_units < 1:
                continue
            after = m - first_units
            inner_tau = math.ceil((tau + after * per_unit) / first_units)
            rest = table[after]
            first_longest = min(first_len[first_units], longest - 1)
            if not ctx.bounded and _combine_live(
                ctx, level, table[m, 0], (first_units, inner_tau), cut, rest[0], m, first_longest, longest
            ):
                continue
            first = stage_table(ctx, level, first_units, inner_tau)
            low, high = region if region is not None else (0, n)
            block = COLUMN_BLOCK if longest > SHORT_RANGES else n  # blocks of starts keep long rows in cache
            for begin in range(low, high, block):
                end = min(high, begin + block)
                block_longest = min(longest, high - begin)
                for t in range(1, min(first_longest, block_longest - 1) + 1):
                    # first stage [i, i+t), rest [i+t, i+l) for l in t+1..hi
                    hi = min(block_longest, t + rest_len[after])
                    head = np.maximum(first[:, t, begin:end], cut[t + begin : t + end])[:, None, :]
                    _combine(
                        table[m, :, t + 1 : hi + 1, begin:end],
                        head,
                        rest[:, 1 : hi - t + 1, t + begin : t + end],
                        ctx.bounded,
                        scratch,
                    )
        if ctx.settings.use_fewer_devices and m > 1:
            np.minimum(table[m], table[m - 1], out=table[m])
    table[:, :, ~ctx.valid[: width + 1]] = INF
    return table


COLUMN_BLOCK = 512  # starts per block of the dense combine (about 1.4x faster than whole rows)
SPARSE_SPEEDUP = 4  # a live choice costs about this many dense elements (gather + scatter-min)
SHORT_RANGES = 64  # pipelines at most this long: whole rows (no blocks) and no sparse combine
SPARSE_MAX_CHOICES = 4_000_000  # beyond this the gathers outgrow the caches: dense is faster


def _live(ctx: DPContext, level: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
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


def _live_by_start(ctx: DPContext, level: int, units: int) -> tuple[np.ndarray, np.ndarray]:
    """The live pipelines on ``units`` units of ``level`` by start: (lengths, offsets),
    start i's lengths ascending in ``lengths[offsets[i] : offsets[i + 1]]`` (memoised)."""
    key = (level, units)
    if key not in ctx.live_by_start:
        starts, lengths = np.nonzero(_live(ctx, level)[1][units][1:, : ctx.n].T)
        offsets = np.concatenate(([0], np.cumsum(np.bincount(starts, minlength=ctx.n))))
        ctx.live_by_start[key] = (lengths + 1, offsets)
    return ctx.live_by_start[key]


def _combine_live(
    ctx: DPContext,
    level: int,
    out: np.ndarray,
    first_stage: tuple[int, int],
    cut: np.ndarray,
    rest: np.ndarray,
    m: int,
    first_longest: int,
    longest: int,
) -> bool:
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


def fill_top(ctx: DPContext, band: int) -> np.ndarray:
    """S[m, q, i]: layers [i, N) on m units of the top level, tau = 0, top stages of at
    most ``band`` (<= ctx.band) layers. O(sum_{f < m <= u} N Lt(f) Q^2).

    Unbounded (one q), the choices of every first-stage unit count f of one m are combined
    in one numpy operation (``_TopHeads``, ``_combine_top``): the same maxes and mins as
    one f at a time, so the same values, without a Python step per (m, f) pair (73,000 of
    them on 384 units).
    """
    top = len(ctx.levels)
    lv = ctx.levels[-1]
    u, per_unit, n = lv.count, ctx.devices_per_unit(top - 1), ctx.n
    suffix = np.full((u + 1, ctx.q, n + band + 1), INF)
    cut = np.zeros(n + 2 * band + 1)
    cut[: n + 1] = transfer_ms(ctx.arrays.cut_bytes, lv.bandwidth_bytes_per_s, lv.latency_ms)
    starts = np.arange(n)
    lengths = n - starts
    heads = None if ctx.bounded else _TopHeads(ctx, band, cut)
    for m in range(1, u + 1):
        if m == 1 or not ctx.settings.straight:
            whole = stage_table(ctx, top, m, 0)
            fits = lengths <= min(band, whole.shape[1] - 1)
            suffix[m][:, starts[fits]] = whole[:, lengths[fits], starts[fits]]
        if heads is not None:
            _combine_top(ctx, heads, suffix, m)
        else:
            for first_units in split_choices(ctx.settings, m):
                if m - first_units < 1:
                    continue
                longest = min(band, ctx.first_len[top][first_units])
                if longest < 1:
                    continue
                inner_tau = math.ceil((m - first_units) * per_unit / first_units)
                first = stage_table(ctx, top, first_units, inner_tau)[
                    :, 1 : longest + 1, :n
                ]  # first stage [i, i+t)
                rest = sliding_window_view(
                    suffix[m - first_units, :, 1 : n + longest], n, axis=-1
                )  # [q, t-1, i]: S[i+t]
                head = np.maximum(first, sliding_window_view(cut[1 : n + longest], n)[None, :, :])
                out = np.full(rest.shape, INF)
                _combine(out, head, rest, True, np.empty(rest.shape[1:]))
                np.minimum(suffix[m, :, :n], out.min(axis=1), out=suffix[m, :, :n])
        if ctx.settings.use_fewer_devices and m > 1:
            np.minimum(suffix[m], suffix[m - 1], out=suffix[m])
    return suffix


TOP_BLOCK_ELEMENTS = 1 << 20  # (f, t, i) elements per numpy step of ``_combine_top`` (8 MiB)


class _TopHeads:
    """First top stages of every unit count f, maxed with the cut after them:
    ``get(f, tau)[t - 1, i]`` for the stage [i, i + t), inf past Lt(f) (memoised per
    (f, tau key)); ``stacked`` holds all f at once when no table depends on tau."""

    def __init__(self, ctx: DPContext, band: int, cut: np.ndarray):
        top = len(ctx.levels)
        self.ctx, self.top, self.n = ctx, top, ctx.n
        self.longest = [min(band, length) for length in ctx.first_len[top]]
        self.width = max(self.longest[1:], default=0)
        self.cut = sliding_window_view(cut[1 : ctx.n + max(self.width, 1)], ctx.n)  # [t - 1, i]: cut at i + t
        self.cache: dict[tuple[int, int], np.ndarray] = {}
        self.units = [f for f in range(1, ctx.levels[-1].count) if self.longest[f] >= 1]
        self.stacked: np.ndarray | None = None
        self.starts = _top_live_starts(ctx)
        if not ctx.track_tau and self.units and not (top == 1 and sharding(ctx.settings)):
            self.stacked = self._stack(cut)

    def _stack(self, cut: np.ndarray) -> np.ndarray:
        """``get(f, 0)`` of every f at once: ``stage_table``'s max(unit / f, all-reduce on
        f) with f broadcast, the same operations elementwise, so the same values."""
        ctx, n, width = self.ctx, self.n, self.width
        lv = ctx.levels[-1]
        units = np.arange(self.units[-1] + 1, dtype=np.float64)[1:, None, None]
        unit = _unit_table(ctx, self.top - 1, 0)[0, 1 : width + 1, :n]
        grads = ctx.grads[1 : width + 1, :n]
        heads = np.empty((len(units) + 1, width, n))
        heads[0] = INF
        np.divide(unit[None], units, out=heads[1:])
        np.maximum(
            heads[1:],
            level_sum_ms(grads[None], units, lv, on_gloo(ctx.topology)),
            out=heads[1:],
        )
        np.maximum(heads[1:], self.cut[:width][None], out=heads[1:])
        lengths = np.arange(1, width + 1)[None, :]
        longest = np.array(self.longest[: len(units) + 1])[:, None]
        heads[lengths.repeat(len(units) + 1, axis=0) > longest] = INF  # past Lt(f), and f without choices
        return heads

    def get(self, f: int, tau: int) -> np.ndarray:
        key = (f, self.ctx.tau_key(tau))
        if key not in self.cache:
            longest = self.longest[f]
            head = np.full((self.width, self.n), INF)
            first = stage_table(self.ctx, self.top, f, tau)[0, 1 : longest + 1, : self.n]
            np.maximum(first, self.cut[:longest], out=head[:longest])
            self.cache[key] = head
        return self.cache[key]


def _top_live_starts(ctx: DPContext) -> list[tuple[int, int]]:
    """starts[m] = [a, b): the states from which a suffix on m top units can belong to a
    plan of time <= the pruning limit V (all of them without a limit, or when idle units
    blur what "m units" means, ``use_fewer_devices``). As in ``_top_regions``: such a
    suffix from state i has compute <= V m D and the states before it run on the other
    u - m units, so their compute is <= V (u - m) D. An entry outside [a, b) is left at
    its single-stage value or inf, never below its exact value; every entry a plan <= V
    reads is exact (its own choices stay inside the windows), so the optimum and the
    reconstruction's ties are unchanged. O(u N)."""
    top = len(ctx.levels)
    u, per_unit, n = ctx.levels[-1].count, ctx.devices_per_unit(top - 1), ctx.n
    v = ctx.limit_ms * (1.0 + PRUNE_SLACK) + PRUNE_SLACK
    if not math.isfinite(v) or ctx.settings.use_fewer_devices:
        return [(0, n)] * (u + 1)
    prefix = ctx.arrays.compute_ms[:n]
    total = float(ctx.arrays.compute_ms[-1])
    tolerance = (
        1e-9 * max(1.0, total) + ctx.arrays.shared_ends_ms
    )  # the ends are paid once by a whole-model stage
    out = [(0, 0)]
    for m in range(1, u + 1):
        live = np.nonzero(
            (prefix <= v * (u - m) * per_unit + tolerance) & (total - prefix <= v * m * per_unit + tolerance)
        )[0]
        out.append((int(live[0]), int(live[-1]) + 1) if len(live) else (0, 0))
    return out


def _combine_top(ctx: DPContext, heads: _TopHeads, suffix: np.ndarray, m: int) -> None:
    """Unbounded top combine of m units: S[m, 0, i] = min(S[m, 0, i], min over f < m
    and t <= Lt(f) of max(head_f[t, i], S[m - f, 0, i + t])), f in blocks of at most
    ``TOP_BLOCK_ELEMENTS``. O(m Lt N)."""
    units = (
        [f for f in heads.units if f < m]
        if not ctx.settings.straight
        else [f for f in heads.units if f == 1 < m]
    )
    if not units or heads.width < 1:
        return
    n, width = heads.n, heads.width
    per_unit = ctx.devices_per_unit(len(ctx.levels) - 1)
    a, b = heads.starts[m]
    if a >= b:
        return
    # rests[j, t - 1, i] = S[m - f, 0, i + t] with f = lo + j (rows m - lo down to m - hi)
    windows = sliding_window_view(suffix[:, 0, 1 : n + width], n, axis=-1)  # [m', t - 1, i]
    block = max(1, TOP_BLOCK_ELEMENTS // (width * (b - a)))
    best = suffix[m, 0, a:b]
    lo_all, hi_all = units[0], units[-1]
    for lo in range(lo_all, hi_all + 1, block):
        hi = min(hi_all, lo + block - 1)
        rest = windows[m - lo : m - hi - 1 : -1, :, a:b]  # m - hi >= 1
        if heads.stacked is not None:
            head = heads.stacked[lo : hi + 1, :, a:b]
        else:
            head = np.stack(
                [
                    heads.get(f, math.ceil((m - f) * per_unit / f))[:, a:b]
                    if heads.longest[f] >= 1
                    else np.full((width, b - a), INF)
                    for f in range(lo, hi + 1)
                ]
            )
        np.minimum(best, np.maximum(head, rest).min(axis=(0, 1)), out=best)
