"""Action orders: each schedule's generator of one worker's ordered actions."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TypeVar

from pipeplan.schedules.actions import Action, interleaved_warmup, replica_lanes, warmup_forwards

T = TypeVar("T")


def _local_microbatches(
    replicas: tuple[int, ...], stage: int, replica: int, minibatch: int, microbatches: int
) -> list[int]:
    n = replicas[stage]  # the m with (minibatch * M + m) % n == replica: every n-th from the first
    return list(range((replica - minibatch * microbatches) % n, microbatches, n))


def worker_1f1b_rr(
    replicas: tuple[int, ...],
    stage: int,
    replica: int,
    minibatches: int,
    microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """W_s + 1 forwards, then B (+S), F alternating, then drain the backwards (+S).

    The replica's minibatches are ``replica, replica + n, ...``; its Actions are taken
    from tables shared by every worker (``_minibatch_actions``) and laid out with slices,
    so a worker costs O(its actions) at C speed.
    """
    n = replicas[stage]
    forwards, backwards, steps = (_minibatch_actions(kind, minibatches)[replica::n] for kind in "FBS")
    ahead = min(len(forwards), warmup_forwards(replicas, stage) + 1)
    steady = len(forwards) - ahead  # minibatches whose B, S are followed by a later F
    return (
        list(forwards[:ahead])
        + _interleave(backwards[:steady], steps[:steady], forwards[ahead:])
        + _interleave(backwards[steady:], steps[steady:])
    )


@lru_cache(maxsize=3)
def _minibatch_actions(kind: str, minibatches: int) -> tuple[Action, ...]:
    """``Action(kind, k)`` for every minibatch k < ``minibatches``, shared by the workers of a build.

    An Action is immutable, so one object can stand in every worker's order. Cleared
    at the end of each ``ScheduleKind.actions``. O(minibatches).
    """
    return tuple(Action(kind, k) for k in range(minibatches))


def _interleave(*columns: Sequence[T]) -> list[T]:
    """``[a0, b0, c0, a1, b1, c1, ...]`` of equally long columns a, b, c. O(total).

    >>> _interleave("abc", "xyz")
    ['a', 'x', 'b', 'y', 'c', 'z']
    """
    width = len(columns)
    out = list(columns[0]) * width  # any list of the right length: every slot is written below
    for j, column in enumerate(columns):
        out[j::width] = column
    return out


def flush_window(replicas: Sequence[int], stage: int, microbatches: int) -> int:
    """D_s: micro-batches of a minibatch position ``stage`` forwards before its first backward (1F1B).

    Counted over the whole position (all its replicas), by micro-batch index. Without
    replication it is 1F1B's min(M, S - s). With replication the largest window that
    (a) never grows downstream (D_s <= D_{s-1}: what keeps the orders deadlock-free, see
    ``_1f1b_order``) and (b) lets no replica hold more than 1F1B's S - s micro-batches
    (D_s <= n_s * (S - s), n_s the replicas of s): min(M, min over t <= s of n_t * (S - t)).
    Windows that grow downstream (n_s * (S - s) rising with s, e.g. replicas 1, 3, 1)
    deadlocked when each replica counted S - s of its own micro-batches. O(stage).

    >>> [flush_window((1, 1, 1, 1), s, 8) for s in range(4)]
    [4, 3, 2, 1]
    >>> [flush_window((1, 3, 1), s, 8) for s in range(3)]
    [3, 3, 1]
    """
    stages = len(replicas)
    return min([microbatches] + [n * (stages - t) for t, n in enumerate(replicas[: stage + 1])])


def _1f1b_order(local: Sequence[int], window: int) -> list[tuple[str, int]]:
    """A replica's 1F1B order: the position's order, F(0..D-1) then B(m), F(m + D) alternating,
    restricted to the replica's micro-batches ``local``. O(L log L) for L local micro-batches.

    Each action's slot in the position's order is a key: B(m) at 2m, F(m) right after
    B(m - D) at 2(m - D) + 1. Every dependency goes to an equal or larger key: the worker's
    own order rises; F(m) on s feeds F(m) on t > s (key 2(m - D_t) + 1 >= 2(m - D_s) + 1
    because D_t <= D_s); B(m) on t feeds B(m) on s (same key 2m); the last stage's F(m)
    precedes its B(m). Chains of equal keys only run forward through stages (F) or backward
    (B), so no cycle; a minibatch's "S" (a barrier of the position's replicas) follows all
    its keys and precedes the next minibatch's. So every order built this way runs to
    completion, with any replica counts and any producer -> consumer stages. A replica
    holds the local ones of D consecutive micro-batches at most: ceil(D / n) <= S - s.

    >>> " ".join(f"{k}{m}" for k, m in _1f1b_order(range(6), 2))
    'F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5'
    >>> " ".join(f"{k}{m}" for k, m in _1f1b_order([1, 4], 2))
    'F1 B1 F4 B4'
    """
    keyed = [(2 * (m - window) + 1, "F", m) for m in local] + [(2 * m, "B", m) for m in local]
    return [(kind, m) for _, kind, m in sorted(keyed)]


def worker_1f1b_flush(
    replicas: tuple[int, ...],
    stage: int,
    replica: int,
    minibatches: int,
    microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """Per minibatch: the position's 1F1B order (``flush_window`` forwards, then B, F
    alternating, then the drain) on the replica's micro-batches, then one "S"."""
    window = flush_window(replicas, stage, microbatches)
    out: list[Action] = []
    for k in range(minibatches):
        local = _local_microbatches(replicas, stage, replica, k, microbatches)
        out += [Action(kind, k, m) for kind, m in _1f1b_order(local, window)]
        out.append(Action("S", k))
    return out


def worker_gpipe(
    replicas: tuple[int, ...],
    stage: int,
    replica: int,
    minibatches: int,
    microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """Per minibatch: all forwards, all backwards in reverse order, one "S"."""
    out: list[Action] = []
    for k in range(minibatches):
        local = _local_microbatches(replicas, stage, replica, k, microbatches)
        out += [Action("F", k, m) for m in local]
        out += [Action("B", k, m) for m in reversed(local)]
        out.append(Action("S", k))
    return out


def worker_interleaved(
    replicas: tuple[int, ...],
    stage: int,
    replica: int,
    minibatches: int,
    microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """Megatron's interleaved 1F1B, per minibatch (it flushes).

    A position's m micro-batches times v chunks make m*v chunk-micro-batches, numbered
    k in Megatron's order: groups of P micro-batches run chunk 0, then chunk 1, ..., so
    the forward of k is chunk (k mod P*v) // P of micro-batch (k // (P*v)) * P + k mod P;
    backwards walk the chunks in reverse. Warm-up runs ``interleaved_warmup`` forwards,
    then F, B alternate, then the drain. With every position on d replicas and M a
    multiple of d (``replica_lanes``, PTD-P), each replica runs Megatron's order of M / d
    micro-batches on its own ones (a pipeline of its own, meeting the others at "S").
    Otherwise a replica runs the units routed to it in the position's order (a sub-order
    of a deadlock-free order cannot deadlock).
    """
    positions = len(replicas)
    lanes = replica_lanes(replicas, microbatches)
    order = _interleaved_order(positions, stage, microbatches // lanes, virtual_stages)
    out: list[Action] = []
    for k in range(minibatches):
        local = _local_microbatches(replicas, stage, replica, k, microbatches)
        if lanes > 1:  # its own pipeline: local[j] is the lane's micro-batch j
            out += [Action(kind, k, local[j], chunk) for kind, j, chunk in order]
        else:
            routed = set(local)
            out += [Action(kind, k, micro, chunk) for kind, micro, chunk in order if micro in routed]
        out.append(Action("S", k))
    return out


def _interleaved_order(
    positions: int, position: int, microbatches: int, virtual_stages: int
) -> list[tuple[str, int, int]]:
    """Megatron's interleaved order of one device: (kind, micro-batch, chunk). O(M * v).

    >>> " ".join(f"{k}{m}c{c}" for k, m, c in _interleaved_order(2, 1, 2, 2))
    'F0c0 F1c0 F0c1 B0c1 F1c1 B1c1 B0c0 B1c0'
    """
    forwards, backwards = _interleaved_units(positions, microbatches, virtual_stages)
    total = len(forwards)
    ahead = min(total, interleaved_warmup(positions, position, virtual_stages))
    steady = total - ahead  # F of unit ahead + i, then B of unit i
    return (
        list(forwards[:ahead]) + _interleave(forwards[ahead:], backwards[:steady]) + list(backwards[steady:])
    )


@lru_cache(maxsize=4)
def _interleaved_units(
    positions: int, microbatches: int, virtual_stages: int
) -> tuple[tuple[tuple[str, int, int], ...], tuple[tuple[str, int, int], ...]]:
    """(forwards, backwards) in Megatron's unit order, shared by every position of a build:
    unit k's forward is chunk (k mod P*v) // P of micro-batch (k // (P*v)) * P + k mod P,
    its backward the same micro-batch on chunk v - 1 - that. O(M * v)."""
    group = positions * virtual_stages
    forwards = tuple(
        ("F", (k // group) * positions + k % positions, (k % group) // positions)
        for k in range(microbatches * virtual_stages)
    )
    backwards = tuple(("B", micro, virtual_stages - 1 - chunk) for _, micro, chunk in forwards)
    return forwards, backwards


def worker_2bw(
    replicas: tuple[int, ...],
    stage: int,
    replica: int,
    minibatches: int,
    microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """PipeDream-2BW: 1F1B over the stream of micro-batches, no flush.

    The replica's units (all minibatches' micro-batches routed to it, in order) run as
    1F1B-RR runs minibatches: W_s + 1 forwards, then B, F alternating, then the drain.
    "S" of minibatch t (coalesced gradients of its micro-batches) comes right after the
    worker's last backward of t, before any backward of a later minibatch; every replica
    steps every minibatch.
    """
    units = [
        (k, m)
        for k in range(minibatches)
        for m in _local_microbatches(replicas, stage, replica, k, microbatches)
    ]
    ahead = min(len(units), warmup_forwards(replicas, stage) + 1)
    out = [Action("F", k, m) for k, m in units[:ahead]]
    stepped = 0
    for i, (k, m) in enumerate(units):
        out.append(Action("B", k, m))
        following = units[i + 1][0] if i + 1 < len(units) else minibatches
        out += [Action("S", t) for t in range(stepped, following)]
        stepped = max(stepped, following)
        if i + ahead < len(units):
            out.append(Action("F", *units[i + ahead]))
    out += [Action("S", t) for t in range(stepped, minibatches)]
    return out


def worker_zb_h1(
    replicas: tuple[int, ...],
    stage: int,
    replica: int,
    minibatches: int,
    microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """ZB-H1: the 1F1B-flush order with each backward split into "I" then "W".

    Per minibatch: 1F1B-flush's order (``_1f1b_order``) with "I" in place of "B"; the
    "W" of a micro-batch runs right after an "I" once position s has deferred s of them
    (later positions wait longer for their first input gradient, so they keep more "W"
    to fill that bubble); the deferred ones drain before the minibatch's "S". A "W"
    needs only its own worker, so the orders run to completion as 1F1B-flush's do.
    Activations are held until "W": min(M, S) units at the peak without replication, 1F1B's peak.
    """
    window = flush_window(replicas, stage, microbatches)
    out: list[Action] = []
    for k in range(minibatches):
        local = _local_microbatches(replicas, stage, replica, k, microbatches)
        deferred: list[int] = []
        for kind, m in _1f1b_order(local, window):
            if kind == "F":
                out.append(Action("F", k, m))
                continue
            out.append(Action("I", k, m))
            deferred.append(m)
            if len(deferred) > stage:
                out.append(Action("W", k, deferred.pop(0)))
        out += [Action("W", k, m) for m in deferred]
        out.append(Action("S", k))
    return out


def zbv_order(positions: int, position: int, microbatches: int) -> list[tuple[str, int, int]]:
    """ZB-V's order of one device: (kind, micro-batch, chunk) of chunks 0 (model stage i) and 1 (its mirror).

    Qi et al. (ICLR 2024, section 6), with the phases torch.distributed.pipelining's
    ``ScheduleZBVZeroBubble`` also runs, for position i of P and n = max(M, 2P - 1)
    micro-batches: warm-up 2(P - i) - 1 forwards of chunk 0, then i times (F1, F0), then
    P - i times (F1, I1, W1); steady (F0 while any is left, I0, W0, F1, I1, W1) until chunk 1
    has run every forward; cool-down i times (I0, I1), P - i times (I0, W0), then the
    deferred W of chunk 1, then of chunk 0. Micro-batches >= M (the padding up to 2P - 1)
    are dropped from every device alike. O(M + P).

    >>> " ".join(f"{k}{m}c{c}" for k, m, c in zbv_order(2, 1, 3))
    'F0c0 F0c1 F1c0 F1c1 I0c1 W0c1 F2c0 I0c0 W0c0 F2c1 I1c1 W1c1 I1c0 I2c1 I2c0 W1c0 W2c1 W2c0'
    """
    n = max(microbatches, 2 * positions - 1)
    i = position
    order: list[tuple[str, int, int]] = []
    nxt = {("F", 0): 0, ("F", 1): 0, ("I", 0): 0, ("I", 1): 0, ("W", 0): 0, ("W", 1): 0}

    def run(kind: str, chunk: int) -> None:
        order.append((kind, nxt[(kind, chunk)], chunk))
        nxt[(kind, chunk)] += 1

    for _ in range(2 * (positions - i) - 1):
        run("F", 0)
    for _ in range(i):
        run("F", 1)
        run("F", 0)
    for _ in range(positions - i):
        run("F", 1)
        run("I", 1)
        run("W", 1)
    while nxt[("F", 1)] < nxt[("F", 0)] or nxt[("F", 0)] < n:
        if nxt[("F", 0)] < n:
            run("F", 0)
        run("I", 0)
        run("W", 0)
        run("F", 1)
        run("I", 1)
        run("W", 1)
    for _ in range(i):
        run("I", 0)
        run("I", 1)
    for _ in range(positions - i):
        run("I", 0)
        run("W", 0)
    while nxt[("W", 1)] < nxt[("I", 1)]:
        run("W", 1)
    while nxt[("W", 0)] < nxt[("I", 0)]:
        run("W", 0)
    return [(kind, m, c) for kind, m, c in order if m < microbatches]


def worker_zbv(
    replicas: tuple[int, ...],
    stage: int,
    replica: int,
    minibatches: int,
    microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """ZB-V, per minibatch (it flushes): ``zbv_order`` of the position, then one "S".

    Two chunks per device in a V: chunk 0 of position i is model stage i, chunk 1 model
    stage P + i, which the planner fills with the layers mirrored around the middle
    (``actions.v_segment``: segment 2P - 1 - i), so the last device's two chunks are
    consecutive and the first device runs the first and the last layers. A replica runs the
    units routed to it in the position's order.
    """
    order = zbv_order(len(replicas), stage, microbatches)
    out: list[Action] = []
    for k in range(minibatches):
        local = set(_local_microbatches(replicas, stage, replica, k, microbatches))
        out += [Action(kind, k, micro, chunk) for kind, micro, chunk in order if micro in local]
        out.append(Action("S", k))
    return out


def clear_caches() -> None:
    """Drop the cached per-minibatch action tuples (keep no Actions beyond their schedule)."""
    _minibatch_actions.cache_clear()
    _interleaved_units.cache_clear()
