"""The DP's settings, results and shared state: band arrays, limits and per-device tables."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeplan.planner.boundary import boundary_range
from pipeplan.planner.costs import LayerArrays, level_sum_ms, on_gloo
from pipeplan.planner.memory import backward_temporary_bytes, parameter_copies
from pipeplan.planner.recompute import least_activation_bytes, range_extra_ms
from pipeplan.planner.sharding import replica_microbatches, sync_floor_factor, sync_floor_ms
from pipeplan.precision import Precision
from pipeplan.schedules import DEFAULT_SCHEDULE, schedule_kind
from pipeplan.topology import Topology

__all__ = [
    "DEFAULT_PLANNER_MEMORY",
    "EXACT_TAU_WORLD",
    "INF",
    "LIMIT_ATTEMPTS",
    "LIMIT_GROWTH",
    "PRUNE_SLACK",
    "DPContext",
    "DPSettings",
    "DPSolution",
    "StageNode",
    "device_need_bytes",
    "activation_need_bytes",
    "versions_in_flight",
    "level_sync_floor",
    "device_table",
    "device_time",
    "recompute_extra_ms",
    "longest_prefix",
    "nested_states",
    "sharding",
    "table_entry",
]

EXACT_TAU_WORLD = 64
DEFAULT_PLANNER_MEMORY = 8 * 2**30  # bytes of DP tables before ``solve`` refuses
INF = math.inf
PRUNE_SLACK = 1e-9  # relative and absolute (ms) slack added to every pruning limit
LIMIT_ATTEMPTS = 3  # pruned passes before one without pruning
LIMIT_GROWTH = 1.25  # the second round's first limit over the lower bound (a tighter pass is cheaper)


@dataclass(frozen=True)
class DPSettings:
    schedule: str = DEFAULT_SCHEDULE  # one of pipeplan.schedules.SCHEDULE_NAMES
    optimizer: str = "sgd"
    straight: bool = False
    max_stages: int | None = None
    use_fewer_devices: bool = False
    memory_check: bool = True
    # minibatches of activations charged to a stage of a schedule without stashing: 1.0
    # (every micro-batch of one minibatch), or for 1f1b-flush min(M, K) / M with K a bound
    # on the stages (``planner.partition.flush_in_flight``): thousands of micro-batches are
    # then not all charged
    flush_in_flight: float = 1.0
    # minibatches of a split-backward schedule's units between their "I" and "W" charged to a
    # stage (``ScheduleKind.deferred_by_chunk``; a bound, as ``flush_in_flight``); 0 without one
    deferred_in_flight: float = 0.0
    precision: Precision = Precision()  # the profile's (bf16: float32 masters charged; planner.memory)
    # micro-batches per minibatch: more than one charges each stage's gradient temporary
    # (planner.memory.gradient_temporary_bytes)
    microbatches: int = 1
    # activation recomputation per stage (``planner.recompute``): "none" | "selective" | "full" | "auto"
    # (the least recomputation that fits each stage, chosen with the split)
    recompute: str = "none"
    # modes a stage replicated on d > 1 devices of level 1 may shard its replicas in
    # (planner.sharding; the DP takes the fastest that fits, per stage: planner.dp.sharded)
    shard: tuple[str, ...] = ("none",)
    # whether zero2 / fsdp stages may recompute layers (False under --shard auto: pipeplan run
    # refuses recomputed layers on them, so auto plans them without)
    fsdp_recomputes: bool = True
    # the host link offload's copies cross (planner.offload; modes ``mode/offload`` in ``shard``)
    host_bandwidth_bytes_per_s: float = 25e9


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
    children: tuple[StageNode, ...] = ()


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
    ctx: DPContext | None = None
    limit_ms: float = INF  # pruning limit the tables were filled under (inf: none)


class DPContext:
    """Band arrays shared by every level and the memoised tables.

    Band arrays are indexed ``[l, i]``: the range [i, i + l), l <= ``span``. Tables are
    ``[q, l, i]`` (level tables ``[m, q, l, i]``), the start innermost so that numpy
    works on long contiguous rows. ``limit_ms`` prunes every entry that cannot be part
    of a plan of time <= ``limit_ms`` (module docstring); inf keeps every entry.
    ``width[k]``: longest range a table of level k < top keeps (later lengths are
    pruned); ``span = width[top - 1]`` (the longest of them); top stages have at most
    ``band`` layers.
    """

    def __init__(
        self, arrays: LayerArrays, topology: Topology, settings: DPSettings, band: int, limit_ms: float = INF
    ):
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
        self.alive: dict[
            int, tuple[list[np.ndarray], list[np.ndarray]]
        ] = {}  # level -> (stage, pipeline) masks
        self.live_by_start: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.regions: dict[int, tuple[int, int]] | None = (
            None  # tau -> states read by the top (``_top_regions``)
        )
        self.allreduce: dict[tuple[int, int], np.ndarray] = {}
        self.largest_layers: np.ndarray | None = None  # fsdp's gathered layer per range (dp.sharded)
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
        self.compute = arrays.compute_range(s_idx, e_idx)
        self.params = arrays.param_bytes[e_idx] - arrays.param_bytes[s_idx]
        self.grads = self.params * arrays.precision.gradient_ratio  # all-reduced (LayerArrays.sync_bytes)
        # what the stage keeps beside its layers' saved bytes: the values it received and sent
        # (held as long as the saved bytes, so charged with them) and, under a split backward,
        # what its "I" keeps for its "W" (a stage from state 0 keeps none): as ``shard_choice``
        self.saved = (
            arrays.saved_bytes[e_idx]
            - arrays.saved_bytes[s_idx]
            + boundary_range(arrays, s_idx, e_idx, packed_copy=on_gloo(topology))
        )
        self.deferred = arrays.deferred_range(s_idx, e_idx) * settings.deferred_in_flight
        self.largest = arrays.largest_range(s_idx, e_idx)
        self.working = arrays.working_range(s_idx, e_idx)  # backward working bytes (planner.memory)
        self.starts, self.ends = (np.broadcast_to(x, self.compute.shape) for x in (s_idx, e_idx))
        self.transient = (
            arrays.recompute_transient(s_idx, e_idx) / settings.microbatches
            if settings.recompute != "none"
            else np.zeros(self.compute.shape)
        )
        self.selective = (
            arrays.selective_ranges(self.starts, self.ends, settings.microbatches)
            if settings.recompute in ("selective", "auto")
            else None
        )
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
        """The replicas' gradient sum (ms) among ``units`` units of ``level`` of every range
        [i, i+l), l <= the level's width (``span`` at the top), as the simulator charges it
        (``costs.level_sum_ms``) (memoised)."""
        key = (level, units)
        if key not in self.allreduce:
            lv = self.levels[level - 1]
            columns = min(self.width[level], self.span) + 1
            if level == 1 and sharding(self.settings):  # the least sync of any mode: a bound
                self.allreduce[key] = sync_floor_ms(
                    self.settings.shard,
                    self.params[:columns],
                    units,
                    lv.bandwidth_bytes_per_s,
                    lv.message_ms,
                    self.arrays.precision,
                    replica_microbatches(self.settings.schedule, self.settings.microbatches, units),
                    on_gloo(self.topology),
                )
            else:
                self.allreduce[key] = level_sum_ms(self.grads[:columns], units, lv, on_gloo(self.topology))
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


def longest_prefix(
    fits: Callable[[np.ndarray], np.ndarray], longest: np.ndarray, arrays: LayerArrays | None = None
) -> int:
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


def _top_first_lengths(ctx: DPContext, limit: float) -> list[int]:
    """Lt(f) at the top: longest range one top stage on f units can hold within ``limit``
    (its bound max(compute / (f D), all-reduce) grows with the range). O(u N log band)."""
    lv, top = ctx.levels[-1], len(ctx.levels)
    per_unit = ctx.devices_per_unit(top - 1)
    arrays, n = ctx.arrays, ctx.n
    starts = np.arange(n)

    def fits(f: int) -> Callable[[np.ndarray], np.ndarray]:
        def test(lengths: np.ndarray) -> np.ndarray:
            ends = starts + lengths
            compute = arrays.compute_range(starts, ends)
            grads = arrays.sync_range(starts, ends)
            allreduce = level_sum_ms(grads, f, lv, on_gloo(ctx.topology)) * floor
            return (
                np.maximum(compute / (f * per_unit), allreduce) <= limit * (1.0 + PRUNE_SLACK) + PRUNE_SLACK
            )

        return test

    floor = level_sync_floor(ctx.settings, top)
    longest = np.minimum(ctx.band, n - starts)
    return [0] + [longest_prefix(fits(f), longest, arrays) for f in range(1, lv.count + 1)]


def _unit_limits(ctx: DPContext, level: int) -> np.ndarray:
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


def _lengths(ctx: DPContext, level: int, stage: bool) -> list[int]:
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


def table_entry(table: np.ndarray, q: int, length: int, start: int) -> float:
    """table[q, length, start] as a float; inf past the table's width (pruned)."""
    return float(table[q, length, start]) if length < table.shape[1] else INF


def _tracks_tau(settings: DPSettings) -> bool:
    """Whether a stage's memory depends on the devices after it (stashed weights)."""
    return settings.memory_check and schedule_kind(settings.schedule).gradients == "stashed"


def sharding(settings: DPSettings) -> bool:
    """Whether replicated level-1 stages may shard (``planner.dp.sharded``)."""
    return settings.shard != ("none",)


def level_sync_floor(settings: DPSettings, level: int) -> float:
    """Scale of the ring all-reduce that bounds a stage's sync at ``level`` from below: below 1
    only at level 1 when sharding may send less (``planner.sharding.sync_floor_factor``)."""
    if level != 1 or not sharding(settings):
        return 1.0
    return sync_floor_factor(settings.shard, settings.precision)


def versions_in_flight(settings: DPSettings, tau: int) -> tuple[int, float]:
    """(weight versions, minibatches of activations in flight) the DP charges a device at ``tau``."""
    if _tracks_tau(settings):
        return tau + 1, float(tau + 1)
    return schedule_kind(settings.schedule).weight_versions((1,), 0), settings.flush_in_flight


def _parameter_bytes(
    settings: DPSettings,
    params: np.ndarray,
    tau: int,
    largest: np.ndarray,
    working: np.ndarray | float,
    deferred: np.ndarray | float = 0.0,
) -> np.ndarray:
    """Bytes of everything but the saved activations: weight versions, gradients, optimizer
    states (and masters), the gradient temporary, the backward working memory and what a
    split backward's "I" keeps for its "W" (``deferred``, already times its units)."""
    versions, _ = versions_in_flight(settings, tau)
    return (
        params * parameter_copies(versions, settings.optimizer, settings.precision)
        + backward_temporary_bytes(largest, working, settings.microbatches, settings.precision)
        + deferred
    )


def device_need_bytes(
    settings: DPSettings,
    params: np.ndarray,
    saved: np.ndarray,
    tau: int,
    largest: np.ndarray,
    working: np.ndarray | float,
    arrays: LayerArrays | None = None,
    starts: np.ndarray | None = None,
    ends: np.ndarray | None = None,
) -> np.ndarray:
    """Bytes one device needs for ranges of ``params`` and ``saved`` bytes, whose largest
    parameters are ``largest`` and largest backward working memory ``working`` (one
    minibatch), at ``tau``. Given ``arrays`` and the ranges' ``starts`` and ``ends``, the
    fewest that ``settings.recompute`` allows (``planner.recompute``). Unsharded: the sharded
    figures are ``planner.dp.sharded``'s, on the same activation side."""
    return _parameter_bytes(settings, params, tau, largest, working) + activation_need_bytes(
        settings, saved, tau, arrays, starts, ends
    )


def activation_need_bytes(
    settings: DPSettings,
    saved: np.ndarray,
    tau: int,
    arrays: LayerArrays | None = None,
    starts: np.ndarray | None = None,
    ends: np.ndarray | None = None,
) -> np.ndarray:
    """The activation side of ``device_need_bytes`` (what sharding leaves whole): ``saved``
    bytes per minibatch in flight at ``tau``, or, given ``arrays`` and the ranges' ``starts``
    and ``ends``, the fewest that ``settings.recompute`` allows (in flight plus transient)."""
    _, in_flight = versions_in_flight(settings, tau)
    if arrays is None or starts is None or ends is None or settings.recompute == "none":
        return saved * in_flight
    assert arrays.recompute_gain is not None
    transient = arrays.recompute_transient(starts, ends) / settings.microbatches
    return least_activation_bytes(
        arrays.recompute_gain,
        transient,
        saved,
        starts,
        ends,
        in_flight,
        settings.recompute,
        arrays.selective_ranges(starts, ends, settings.microbatches),
    )


def device_time(ctx: DPContext, tau: int, where: tuple) -> np.ndarray:
    """Compute (ms) of the ranges ``[l, i]`` at ``where`` (an index into the band arrays)
    on one device at ``tau``, with the recomputation ``ctx.settings.recompute`` chooses for
    it (``planner.recompute``); inf where the range is no stage or does not fit in memory."""
    time = np.where(ctx.valid[where], ctx.compute[where], INF)
    parameters = _parameter_bytes(
        ctx.settings, ctx.params[where], tau, ctx.largest[where], ctx.working[where], ctx.deferred[where]
    )
    return time + recompute_extra_ms(ctx, tau, where, parameters)


def recompute_extra_ms(ctx: DPContext, tau: int, where: tuple, parameter_bytes: np.ndarray) -> np.ndarray:
    """The recomputation's extra ms ``ctx.settings.recompute`` chooses for the ranges at
    ``where`` on a device whose everything but the activations takes ``parameter_bytes``
    (unsharded: ``_parameter_bytes``; sharded: ``planner.dp.sharded``); 0 without
    recomputation, inf where no choice fits the device."""
    settings, arrays = ctx.settings, ctx.arrays
    memory = ctx.topology.device.memory_bytes
    _, in_flight = versions_in_flight(settings, tau)
    if settings.recompute == "none" or (settings.recompute == "auto" and not settings.memory_check):
        if not settings.memory_check:
            return np.zeros(np.shape(parameter_bytes))
        return np.where(parameter_bytes + ctx.saved[where] * in_flight <= memory, 0.0, INF)
    assert arrays.recompute_gain is not None and arrays.recompute_forward_ms is not None
    spare = memory - parameter_bytes if settings.memory_check else np.full(np.shape(parameter_bytes), INF)
    return range_extra_ms(
        arrays.recompute_gain,
        arrays.recompute_forward_ms,
        ctx.transient[where],
        ctx.saved[where],
        ctx.starts[where],
        ctx.ends[where],
        in_flight,
        spare,
        settings.recompute,
        bisect=arrays.cut_family.is_prefix,
        selective=ctx.selective.at(where) if ctx.selective is not None else None,
    )


def device_table(ctx: DPContext, tau: int) -> np.ndarray:
    """U_0[q, l, i]: compute of each range on one device, inf where it does not fit in memory."""
    time = device_time(ctx, tau, (slice(0, ctx.width[0] + 1),))
    return np.repeat(time[None, :, :], ctx.q, axis=0)
