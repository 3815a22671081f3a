"""``solve``: the pruned passes of the DP, each exact for plans up to its limit."""

from __future__ import annotations

import math

import numpy as np

from pipeplan.planner.costs import LayerArrays
from pipeplan.planner.dp.bounds import (
    FIRST_BAND_GROWTH,
    band_bound,
    check_memory,
    data_parallel_bound_ms,
    fewest_stages,
    fill_solution,
    lower_bound_ms,
    next_limit,
    some_layer_never_fits,
)
from pipeplan.planner.dp.context import INF, LIMIT_GROWTH, DPContext, DPSettings, DPSolution, level_sync_floor
from pipeplan.topology import Topology

__all__ = ["solve"]


def _exact_pass(
    arrays: LayerArrays,
    topology: Topology,
    settings: DPSettings,
    band: int,
    upper_ms: float = INF,
    prune: bool = True,
    start_ms: float | None = None,
    cap_ms: float = INF,
) -> DPSolution:
    """The optimum with top stages of at most ``band`` layers, on pruned tables.

    The limit starts at ``start_ms`` (default: a lower bound of the answer, the
    strongest pruning) and grows until a pass proves its answer. Once a plan within the
    band is known (``upper_ms``, or a pruned pass's finite answer, the time of a real
    plan), the next pass runs at that plan's time and proves; with none known the limit
    grows fourfold (``next_limit``), the last attempt without pruning (the only one
    when not ``prune``). The limit never passes ``cap_ms``: a pass at the cap that finds
    no plan within it proves there is none, and the answer is inf (``solve``).
    """
    start = start_ms if start_ms is not None else lower_bound_ms(arrays, topology, settings)
    limit = min(start, upper_ms, cap_ms) if prune else INF
    check_memory(arrays, topology, settings, band)
    attempt = 0
    while True:
        ctx = DPContext(arrays, topology, settings, band, limit)
        solution = fill_solution(ctx, band)
        if solution.time_ms <= limit or not math.isfinite(limit):
            return solution
        if not math.isfinite(solution.time_ms) and some_layer_never_fits(ctx):
            return solution  # infeasible under any limit
        if limit >= cap_ms:
            return _none(arrays, topology, settings)  # every plan within the cap is in the tables
        attempt += 1
        upper_ms = min(upper_ms, solution.time_ms)
        grown = min(upper_ms if math.isfinite(upper_ms) else next_limit(limit, attempt), cap_ms)
        # a limit that does not grow would prove nothing again: a bound that disagrees with the
        # tables it prunes (found once: dp.sharded priced a gloo pair's sum as a ring, its bounds
        # as a swap, and this loop never ended); the cap, or no pruning, ends it exactly
        limit = grown if grown > limit else cap_ms


def _none(arrays: LayerArrays, topology: Topology, settings: DPSettings) -> DPSolution:
    """The solution of no plan (time inf)."""
    return DPSolution(INF, arrays, topology, settings, 0, np.full((1, 1, 1), INF))


def solve(
    arrays: LayerArrays,
    topology: Topology,
    settings: DPSettings,
    *,
    prune: bool = True,
    cap_ms: float = INF,
) -> DPSolution:
    """Fill the tables and return the optimum (``time_ms`` is inf when nothing fits).

    A first pass runs at a lower bound of the answer (``lower_bound_ms``; with few
    live choices it is cheap) over top stages as long as that bound allows
    (``band_bound``) if that is at most ``FIRST_BAND_GROWTH`` times a short ``guess``,
    else over the guess. If it proves its answer within its band, that is the optimum.
    Otherwise the best plan known, its answer or pure data parallelism
    (``data_parallel_bound_ms``), bounds the answer and so the longest useful top stage;
    over that band a pass at ``LIMIT_GROWTH`` times the lower bound (cheap, and often
    enough), else one at that plan's time, proves the exact optimum. Passes run on pruned tables
    (``_exact_pass``). ``prune=False`` fills every entry of one pass over every band
    (same answer and plan, slower: for tests). With ``cap_ms`` only plans within it are
    wanted (the caller has one as fast): the answer is inf when the optimum is above it,
    and no pass runs at a higher limit, which is what makes a dominated search cheap.
    Raises nothing: ``reconstruct`` and ``partition`` report infeasibility.
    """
    n = arrays.layers
    if fewest_stages(arrays, topology, settings) > min(
        topology.world_size, settings.max_stages or topology.world_size
    ):
        # no plan has so few stages that each fits on a device: infeasible, without the passes
        # that would grow the limit to inf to prove it
        return _none(arrays, topology, settings)
    if not prune:
        return _exact_pass(arrays, topology, settings, n, prune=False)
    whole = data_parallel_bound_ms(arrays, topology, settings)
    floor = level_sync_floor(settings, len(topology.levels))
    lower = lower_bound_ms(arrays, topology, settings)
    if lower > cap_ms:
        return _none(arrays, topology, settings)
    guess = min(n, max(8, 2 * math.ceil(n / topology.levels[-1].count)))
    reach = band_bound(arrays, topology, lower, floor)  # top stages a plan at the lower bound may use
    band = min(n, max(guess, reach) if reach <= FIRST_BAND_GROWTH * guess else guess)
    check_memory(arrays, topology, settings, band)
    limit = min(lower, whole if band == n else INF)
    first = fill_solution(DPContext(arrays, topology, settings, band, limit), band)
    if first.time_ms <= limit and (band == n or band_bound(arrays, topology, first.time_ms, floor) <= band):
        return first
    bound = min(first.time_ms, whole, cap_ms)  # the cap bounds what a wanted plan may use
    if not math.isfinite(bound):  # no plan known yet: grow the limit on this band first
        first = _exact_pass(arrays, topology, settings, band)
        if band == n or band_bound(arrays, topology, first.time_ms, floor) <= band:
            return first
        bound = first.time_ms
    band = min(n, max(band, band_bound(arrays, topology, bound, floor)))
    return _exact_pass(
        arrays, topology, settings, band, bound, start_ms=min(bound, lower * LIMIT_GROWTH), cap_ms=cap_ms
    )
