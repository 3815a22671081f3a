"""``reconstruct``: the stage tree the filled tables chose, retraced with each table's tau."""

from __future__ import annotations

import math
from collections.abc import Callable

from pipeplan.errors import InfeasibleError
from pipeplan.planner.costs import transfer_ms
from pipeplan.planner.dp.context import DPContext, DPSolution, StageNode, table_entry
from pipeplan.planner.dp.tables import level_table, split_choices, stage_table

__all__ = ["reconstruct"]


def _close(a: float, b: float) -> bool:
    return a == b or (math.isfinite(a) and abs(a - b) <= 1e-12 * max(1.0, abs(b)))


RestValue = Callable[[int, int, int], float]


def _reconstruct_level(
    ctx: DPContext, band: int, level: int, start: int, end: int, m: int, q: int, tau: int
) -> tuple[StageNode, ...]:
    """The pipeline achieving A_level(start, end, m, q) at ``tau``."""
    if level == 0:
        return ()
    table = level_table(ctx, level, tau)
    # follow the tau the table was filled with: inner taus derive from it
    filled_tau = 0 if ctx.track_tau and ctx.tau_cache.get(level) else ctx.tau_key(tau)
    target = table_entry(table[m], q, end - start, start)
    return _pick(
        ctx,
        band,
        level,
        start,
        end,
        m,
        q,
        filled_tau,
        target,
        lambda s, mm, qq: table_entry(table[mm], qq, end - s, s),
    )


def _pick(
    ctx: DPContext,
    band: int,
    level: int,
    start: int,
    end: int,
    m: int,
    q: int,
    tau: int,
    target: float,
    rest_value: RestValue,
) -> tuple[StageNode, ...]:
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
        value = table_entry(stage_table(ctx, level, m, single_tau), q, length, start)
        if _close(value, target):
            inner = _reconstruct_level(
                ctx, band, level - 1, start, end, lv_units(ctx, level - 1), q, single_tau
            )
            return (StageNode(level, start, end, m, inner),)
    cut = transfer_ms(ctx.cut, lv.bandwidth_bytes_per_s, lv.latency_ms)
    for first_units in split_choices(ctx.settings, m):
        if m - first_units < 1:
            continue
        inner_tau = math.ceil((tau + (m - first_units) * per_unit) / first_units)
        first = stage_table(ctx, level, first_units, inner_tau)
        for t in range(1, min(length - 1, band) + 1):
            split = start + t
            pairs = [(0, 0)] if not ctx.bounded else [(q1, q - 1 - q1) for q1 in range(q)]
            for q1, q2 in pairs:
                value = max(
                    table_entry(first, q1, t, start),
                    float(cut[split]),
                    rest_value(split, m - first_units, q2),
                )
                if _close(value, target):
                    inner = _reconstruct_level(
                        ctx, band, level - 1, start, split, lv_units(ctx, level - 1), q1, inner_tau
                    )
                    head = StageNode(level, start, split, first_units, inner)
                    tail = _follow(ctx, band, level, split, end, m - first_units, q2, tau, rest_value)
                    return (head,) + tail
    if ctx.settings.use_fewer_devices and m > 1:
        return _follow(ctx, band, level, start, end, m - 1, q, tau, rest_value)
    raise InfeasibleError(f"internal: no choice reproduces {target} ms at level {level}")


def _follow(
    ctx: DPContext,
    band: int,
    level: int,
    start: int,
    end: int,
    m: int,
    q: int,
    tau: int,
    rest_value: RestValue,
) -> tuple[StageNode, ...]:
    return _pick(ctx, band, level, start, end, m, q, tau, rest_value(start, m, q), rest_value)


def lv_units(ctx: DPContext, level: int) -> int:
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
        ctx,
        solution.band,
        top_level,
        0,
        n,
        u,
        ctx.q - 1,
        0,
        float(suffix[u, ctx.q - 1, 0]),
        lambda s, mm, qq: float(suffix[mm, qq, s]),
    )
