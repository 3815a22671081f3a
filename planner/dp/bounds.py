"""Bounds that prune the DP without changing its answer: lower, relaxed and data-parallel bounds; table memory."""

from __future__ import annotations

import math
import os

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.planner.costs import LayerArrays, level_sum_ms, on_gloo, transfer_ms
from pipeplan.planner.dp.context import (
    DEFAULT_PLANNER_MEMORY,
    INF,
    LIMIT_ATTEMPTS,
    DPContext,
    DPSettings,
    DPSolution,
    device_need_bytes,
    level_sync_floor,
    longest_prefix,
    nested_states,
    versions_in_flight,
)
from pipeplan.planner.dp.sharded import least_need_bytes
from pipeplan.planner.dp.tables import fill_top, split_choices
from pipeplan.planner.recompute import range_extra_ms
from pipeplan.topology import Level, Topology

__all__ = [
    "FIRST_BAND_GROWTH",
    "RELAXED_MAX_WORK",
    "band_bound",
    "check_memory",
    "data_parallel_bound_ms",
    "fewest_stages",
    "fill_solution",
    "lower_bound_ms",
    "next_limit",
    "planner_memory_limit",
    "some_layer_never_fits",
    "table_bytes",
]


def _top_stage_bound(
    arrays: LayerArrays, topology: Topology, starts: np.ndarray, ends: np.ndarray, floor: float = 1.0
) -> np.ndarray:
    """Lower bound (ms) of layers [starts, ends) as one top-level stage on any unit count.

    Non-decreasing in ``ends`` (every operation is monotone, in floating point too).
    """
    lv = topology.levels[-1]
    per_unit = math.prod(level.count for level in topology.levels[:-1])
    compute = arrays.compute_range(starts, ends)
    grads = arrays.sync_range(starts, ends)
    low = np.full(len(starts), INF)
    for m in range(1, lv.count + 1):
        low = np.minimum(low, _relaxed_stage_ms(compute, grads, m, per_unit, lv, on_gloo(topology), floor))
    return low


def _relaxed_stage_ms(
    compute: np.ndarray,
    grads: np.ndarray,
    units: int,
    per_unit: int,
    level: Level,
    on_gloo: bool,
    floor: float = 1.0,
) -> np.ndarray:
    """Lower bound (ms) of ranges of ``compute`` ms and ``grads`` gradient bytes
    (``LayerArrays.sync_range``) as one stage on ``units`` units of ``level`` (``per_unit``
    devices each): max(compute over the devices, the units' gradient sum as the DP prices it
    (``costs.level_sum_ms``), times ``floor`` where sharded replicas may send less:
    ``context.level_sync_floor``)."""
    allreduce = level_sum_ms(grads, units, level, on_gloo) * floor
    return np.maximum(compute / (units * per_unit), allreduce)


def band_bound(arrays: LayerArrays, topology: Topology, bound_ms: float, floor: float = 1.0) -> int:
    """Longest range whose lower bound as a top-level stage is <= ``bound_ms``.

    Binary search per start (the bound grows with the range): O(N u log N).
    """
    n = arrays.layers
    if not math.isfinite(bound_ms):
        return n
    starts = np.arange(n)

    def fits(lengths: np.ndarray) -> np.ndarray:
        return _top_stage_bound(arrays, topology, starts, starts + lengths, floor) <= bound_ms * (1 + 1e-12)

    return max(longest_prefix(fits, n - starts, arrays), 1)


def lower_bound_ms(arrays: LayerArrays, topology: Topology, settings: DPSettings | None = None) -> float:
    """A lower bound (ms) on the answer, the first pruning limit: total compute over every
    device, and either one top stage of every layer or at least one top-level cut; with
    ``settings``, also the top level's own DP over relaxed units (``_relaxed_top_ms``)."""
    n = arrays.layers
    lv = topology.levels[-1]
    spread = float(arrays.compute_ms[-1]) / topology.world_size
    floor = level_sync_floor(settings, len(topology.levels)) if settings is not None else 1.0
    single = float(_top_stage_bound(arrays, topology, np.array([0]), np.array([n]), floor)[0])
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
    floor = level_sync_floor(settings, len(topology.levels))
    lengths, starts = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    ends = np.minimum(starts + lengths, n)
    ok = (starts + lengths <= n) & (lengths >= 1)
    if not arrays.cut_family.is_prefix:
        ok &= nested_states(arrays)[: n + 1, : n + 1]
    compute = arrays.compute_range(starts, ends)
    grads = arrays.sync_range(starts, ends)
    transfer = np.full(2 * n + 2, INF)
    transfer[: n + 1] = transfer_ms(arrays.cut_bytes, lv.bandwidth_bytes_per_s, lv.latency_ms)
    cut = sliding_window_view(transfer, n + 1)[: n + 1]  # [t, i]: the cut at state i + t
    suffix = np.full((lv.count + 1, 2 * n + 2), INF)  # [m, i]: states from i on m units
    for m in range(1, lv.count + 1):
        best = np.full(n + 1, INF)
        if m == 1 or not settings.straight:
            whole = _relaxed_stage_ms(compute, grads, m, per_unit, lv, on_gloo(topology), floor)
            best[:n] = np.where(ok, whole, INF)[n - np.arange(n), np.arange(n)]
        for first_units in split_choices(settings, m):
            stage = _relaxed_stage_ms(compute, grads, first_units, per_unit, lv, on_gloo(topology), floor)
            rest = sliding_window_view(suffix[m - first_units], n + 1)[: n + 1]  # [t, i]: suffix from i + t
            split = np.maximum(np.where(ok, stage, INF), np.maximum(cut, rest))
            np.minimum(best, split.min(axis=0), out=best)
        suffix[m, : n + 1] = best
        if settings.use_fewer_devices and m > 1:
            np.minimum(suffix[m], suffix[m - 1], out=suffix[m])
    return float(suffix[lv.count, 0])


def data_parallel_bound_ms(arrays: LayerArrays, topology: Topology, settings: DPSettings) -> float:
    """The DP's own value of pure data parallelism (every layer in one stage on every unit
    at every level, tau 0): an upper bound on the answer with top stages of any length;
    inf when that plan is not a candidate (``straight``) or does not fit. O(levels)."""
    if settings.straight and topology.world_size > 1:
        return INF
    if "none" not in settings.shard and topology.levels[0].count > 1:  # a forced mode: not its value
        return INF
    params, saved = (
        arrays.param_bytes[-1:] - arrays.param_bytes[:1],
        arrays.saved_bytes[-1:] - arrays.saved_bytes[:1],
    )
    first, last = np.array([0]), np.array([len(arrays.param_bytes) - 1])
    whole, working = arrays.largest_range(first, last), arrays.working_range(first, last)
    if (
        settings.memory_check
        and float(device_need_bytes(settings, params, saved, 0, whole, working, arrays, first, last)[0])
        > topology.device.memory_bytes
    ):
        return INF
    value = arrays.compute(0, arrays.layers) + _whole_recompute_ms(
        arrays, topology, settings, params, saved, whole, working
    )
    grads = params * arrays.precision.gradient_ratio
    for level in topology.levels:
        allreduce = level_sum_ms(grads, level.count, level, on_gloo(topology))
        value = max(value / level.count, float(allreduce[0]))
    return value


def _whole_recompute_ms(
    arrays: LayerArrays,
    topology: Topology,
    settings: DPSettings,
    params: np.ndarray,
    saved: np.ndarray,
    largest: np.ndarray,
    working: np.ndarray,
) -> float:
    """The recomputation (ms) the whole model as one stage at tau 0 chooses (``device_time``'s)."""
    mode = settings.recompute
    if mode == "none" or (mode == "auto" and not settings.memory_check):
        return 0.0
    assert arrays.recompute_gain is not None and arrays.recompute_forward_ms is not None
    first, last = np.array([0]), np.array([len(arrays.param_bytes) - 1])
    need = device_need_bytes(settings, params, np.zeros(1), 0, largest, working)
    spare = topology.device.memory_bytes - need if settings.memory_check else np.full(1, INF)
    extra = range_extra_ms(
        arrays.recompute_gain,
        arrays.recompute_forward_ms,
        arrays.recompute_transient(first, last) / settings.microbatches,
        saved,
        first,
        last,
        versions_in_flight(settings, 0)[1],
        spare,
        mode,
        bisect=arrays.cut_family.is_prefix,
        selective=arrays.selective_ranges(first, last, settings.microbatches),
    )
    return float(extra[0])


def next_limit(limit_ms: float, attempt: int) -> float:
    """Limit of pass ``attempt`` (1, 2, ...) after one under ``limit_ms`` found no plan and
    none is known: fourfold, and the last attempt prunes nothing."""
    if attempt >= LIMIT_ATTEMPTS:
        return INF
    return max(4.0 * limit_ms, 1e-3)


def some_layer_never_fits(ctx: DPContext) -> bool:
    """True when a single layer exceeds device memory even with one minibatch in flight
    (and, where replicas may shard, in its least hungry mode on the most replicas).

    Only on a chain (the prefix family), where consecutive states differ by one layer; in a
    family of downsets they need not be nested, so False there (``partition`` refuses a layer
    that never fits before the DP runs, ``_least_need_bytes``)."""
    if not ctx.settings.memory_check or not ctx.arrays.cut_family.is_prefix:
        return False
    params, saved = np.diff(ctx.arrays.param_bytes), np.diff(ctx.arrays.saved_bytes)
    states = np.arange(len(ctx.arrays.param_bytes))
    largest = ctx.arrays.largest_range(states[:-1], states[1:])
    working = ctx.arrays.working_range(states[:-1], states[1:])
    need = least_need_bytes(
        ctx.settings,
        params,
        saved,
        0,
        largest,
        working,
        ctx.levels[0].count,
        ctx.arrays,
        states[:-1],
        states[1:],
    )  # device_table at tau = 0 for single layers, in the least hungry shard mode
    return bool(np.any(need > ctx.topology.device.memory_bytes))


def fewest_stages(arrays: LayerArrays, topology: Topology, settings: DPSettings) -> float:
    """Fewest stages any plan needs under the DP's memory rule, for a chain (the prefix
    family; 0 otherwise, or without the memory check): a stage needs at least its bytes
    at tau = 0 on each of its devices, whatever its replicas, and those grow with the
    range, so filling each stage as far as it fits is optimal. inf when some layer alone
    does not fit. O(N^2) at most, numpy over the ends."""
    if not settings.memory_check or not arrays.cut_family.is_prefix:
        return 0
    n, memory = arrays.layers, topology.device.memory_bytes
    count, start = 0, 0
    while start < n:
        ends = np.arange(start + 1, n + 1)
        need = least_need_bytes(
            settings,
            arrays.param_bytes[ends] - arrays.param_bytes[start],
            arrays.saved_bytes[ends] - arrays.saved_bytes[start],
            0,
            arrays.largest_range(np.full(len(ends), start), ends),
            arrays.working_range(np.full(len(ends), start), ends),
            topology.levels[0].count,
            arrays,
            np.full(len(ends), start),
            ends,
        )
        fits = int(np.searchsorted(need > memory, True))  # need grows with the end: a prefix of ends fits
        if fits == 0:
            return INF
        start += fits
        count += 1
    return count


def fill_solution(ctx: DPContext, band: int) -> DPSolution:
    top = fill_top(ctx, band)
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


def check_memory(arrays: LayerArrays, topology: Topology, settings: DPSettings, band: int) -> None:
    """One-line refusal before allocating when the tables would exceed the limit."""
    need, limit = table_bytes(arrays, topology, settings, band), planner_memory_limit()
    if need > limit:
        raise InfeasibleError(
            f"planning {arrays.layers} cut states on {topology.world_size} devices with top stages of up to "
            f"{band} states needs about {need / 2**30:.1f} GiB of DP tables, over the planner's limit of "
            f"{limit / 2**30:.1f} GiB (set PIPEPLAN_PLANNER_MEMORY in bytes, or plan fewer layers: merge layers "
            f"or use fewer top-level units)"
        )
