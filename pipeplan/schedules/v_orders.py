"""V-shaped orders beyond ZB-V: the controllable-memory family (V-Half, V-Min) and DualPipeV.

Every order here runs two chunks per device in a V (``actions.v_segment``): chunk 0 of
position i is model stage i, chunk 1 model stage P + i, holding the layers mirrored
around the middle. An order is a list of (kind, micro-batch, chunk) for one position;
``_per_minibatch`` lays it out per minibatch (they all flush).

- V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024):
  one *building block* per memory setting (``V_BLOCKS``), the slots at which position i
  runs F of chunk 0, F of chunk 1, I of chunk 1 and I of chunk 0 of one micro-batch. The
  block repeats every 6 slots (2 F + 2 I + 2 W of a micro-batch at unit cost), so the
  activations a device holds at its peak are its block's lifespans over 6: about 1/2
  (V-Half) and 1/3 (V-Min) of 1F1B's. Each "W" takes the first free slot after its "I"
  (oldest first); the device runs its actions in slot order. The block's slots obey every
  dependency (a forward one slot after the one it reads, a backward likewise), so the
  slot timetable witnesses that the orders run to completion.
- DualPipeV (DeepSeek-V3's DualPipe folded into a V): the phases torch.distributed.pipelining's
  ``ScheduleDualPipeV`` runs, with its overlapped F/B pairs as F then B. Whole backwards
  ("B") and split ones ("I" ... "W") mix. Needs micro-batches >= 2P, as torch does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import lru_cache

from pipeplan.schedules.actions import Action

__all__ = [
    "V_BLOCKS",
    "block_order",
    "dualpipev_order",
    "v_block_orders",
    "worker_dualpipev",
    "worker_v_half",
    "worker_v_min",
]

Order = list[tuple[str, int, int]]  # (kind, micro-batch, chunk) of one position
Block = tuple[int, int, int, int]  # slots of F chunk 0, F chunk 1, I chunk 1, I chunk 0
PERIOD = 6  # slots per micro-batch on a device: F, F, I, I, W, W at unit cost
SQUEEZE_LIMIT = 2**16  # P^2 x M beyond which the orders are not squeezed (``v_block_orders``)


def _v_min_block(positions: int) -> list[Block]:
    """V-Min: lifespans summing to about 4P slots per device, 2P/3 chunk-micro-batches held.

    >>> _v_min_block(2)
    [(0, 3, 4, 7), (1, 2, 5, 6)]
    """
    gap = 2 if positions % 3 == 0 else 0  # keeps the four slots distinct modulo 6
    return [
        (i, 2 * positions - 1 - i, 2 * positions + gap + i, 4 * positions + gap - 1 - i)
        for i in range(positions)
    ]


def _v_half_block(positions: int) -> list[Block]:
    """V-Half: lifespans summing to about 6P slots per device, P chunk-micro-batches held.

    >>> _v_half_block(2)
    [(0, 4, 8, 13), (2, 3, 10, 12)]
    """
    gap = 3 if positions % 2 == 0 else 0
    return [
        (2 * i, 3 * positions - i - 2, 3 * positions + gap + 2 * i - 1, 6 * positions + gap - i - 2)
        for i in range(positions)
    ]


V_BLOCKS: dict[str, Callable[[int], list[Block]]] = {"v-half": _v_half_block, "v-min": _v_min_block}


def block_order(blocks: list[Block], position: int, microbatches: int) -> Order:
    """Position ``position``'s order: its block repeated every ``PERIOD`` slots, "W"s in free slots.

    Micro-batch m's F of chunk 0 takes slot ``block[0] + 6m`` and so on; each "W" takes the
    first free slot after its "I" (the oldest waiting first), the rest follow the last
    slot. O(M log M).

    >>> " ".join(f"{k}{m}c{c}" for k, m, c in block_order(_v_min_block(2), 1, 2))
    'F0c0 F0c1 I0c1 I0c0 F1c0 F1c1 W0c1 W0c0 I1c1 I1c0 W1c1 W1c0'
    """
    f0, f1, i1, i0 = blocks[position]
    slots: dict[int, tuple[str, int, int]] = {}
    for m in range(microbatches):
        for offset, kind, chunk in ((f0, "F", 0), (f1, "F", 1), (i1, "I", 1), (i0, "I", 0)):
            slot = offset + PERIOD * m
            if slot in slots:
                raise AssertionError(f"building block of position {position} puts two actions at slot {slot}")
            slots[slot] = (kind, m, chunk)
    order: Order = []
    waiting: deque[tuple[int, int]] = deque()
    for slot in range(max(slots) + 1):
        action = slots.get(slot)
        if action is not None:
            order.append(action)
            if action[0] == "I":
                waiting.append(action[1:])
        elif waiting:
            order.append(("W", *waiting.popleft()))
    order += [("W", m, c) for m, c in waiting]
    return order


def _peak(order: Order) -> int:
    """Most chunk-micro-batches ``order`` holds at once (from "F" to "W" or "B")."""
    held = peak = 0
    for kind, _, _ in order:
        held += (kind == "F") - (kind in ("B", "W"))
        peak = max(peak, held)
    return peak


def _feeds(
    position: int, chunk: int, positions: int
) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(the (position, chunk) whose forward this one's reads, the one whose backward it reads) in the V."""
    last = positions - 1
    before: tuple[int, int] | None
    after: tuple[int, int] | None
    if chunk == 0:
        before = (position - 1, 0) if position else None
        after = (last, 1) if position == last else (position + 1, 0)
    else:
        before = (last, 0) if position == last else (position + 1, 1)
        after = (position - 1, 1) if position else None
    return before, after


def _squeeze(orders: list[Order], peaks: list[int], margin: int) -> list[Order] | None:
    """The devices' orders as a unit-time sweep runs them, pulling ready actions ahead where a
    device would idle; None when the sweep stalls.

    Each slot every device runs the first action of its order that is ready (its inputs done
    by the slot before) and first of its (kind, chunk) stream; an "F" taken out of turn only
    while the device holds at most its block order's peak minus ``margin`` after it. The
    sweep is a timetable every dependency of which runs forward in time, so the orders read
    off it run to completion. O(slots x positions x look-ahead).
    """
    positions = len(orders)
    pending = [list(order) for order in orders]
    forward: set[tuple[int, int, int]] = set()
    backward: set[tuple[int, int, int]] = set()
    inputs: set[tuple[int, int, int]] = set()
    held = [0] * positions
    out: list[Order] = [[] for _ in range(positions)]
    while any(pending):
        ran: list[tuple[int, tuple[str, int, int]]] = []
        for i in range(positions):
            pick = _ready_action(
                pending[i], i, positions, forward, backward, inputs, held[i], peaks[i] - margin
            )
            if pick is not None:
                ran.append((i, pending[i].pop(pick)))
        if not ran:
            return None
        for i, (kind, micro, chunk) in ran:
            out[i].append((kind, micro, chunk))
            held[i] += (kind == "F") - (kind in ("B", "W"))
            {"F": forward, "B": backward, "I": inputs, "W": set()}[kind].add((i, chunk, micro))
            if kind == "I":
                backward.add((i, chunk, micro))
    return out


def _ready_action(
    pending: list[tuple[str, int, int]],
    position: int,
    positions: int,
    forward: set[tuple[int, int, int]],
    backward: set[tuple[int, int, int]],
    inputs: set[tuple[int, int, int]],
    held: int,
    cap: int,
) -> int | None:
    """Index in ``pending`` of the action ``_squeeze`` runs next on ``position``, or None."""
    blocked: set[tuple[str, int]] = set()
    for index, (kind, micro, chunk) in enumerate(pending[: 4 * positions + 4]):
        stream = (kind, chunk)
        if stream in blocked:
            continue
        blocked.add(stream)
        before, after = _feeds(position, chunk, positions)
        if kind == "F":
            ready = before is None or (*before, micro) in forward
            ready = ready and (index == 0 or held + 1 <= cap)
        elif kind in ("I", "B"):
            ready = (position, chunk, micro) in forward and (after is None or (*after, micro) in backward)
        else:
            ready = (position, chunk, micro) in inputs
        if ready:
            return index
    return None


@lru_cache(maxsize=16)
def v_block_orders(
    name: str, positions: int, microbatches: int
) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Every position's order of the ``V_BLOCKS[name]`` schedule: the block orders, squeezed
    (``_squeeze``) at the first margin of 1..3 that keeps every device within its block order's
    peak; the block orders themselves when none does, or when P^2 M > ``SQUEEZE_LIMIT`` (the
    sweep costs O(P^2 M): about 0.5 s at the limit, P = 32 and M = 64).

    >>> " ".join(f"{k}{m}c{c}" for k, m, c in block_order(_v_half_block(4), 0, 8)[:8])
    'F0c0 F1c0 F0c1 F2c0 I0c1 W0c1 F1c1 F3c0'
    >>> " ".join(f"{k}{m}c{c}" for k, m, c in v_block_orders("v-half", 4, 8)[0][:8])
    'F0c0 F1c0 F2c0 F3c0 F0c1 I0c1 W0c1 F1c1'
    >>> [_peak(list(order)) for order in v_block_orders("v-half", 4, 8)]
    [6, 6, 6, 6]
    """
    orders = [block_order(V_BLOCKS[name](positions), i, microbatches) for i in range(positions)]
    peaks = [_peak(order) for order in orders]
    if positions * positions * microbatches > SQUEEZE_LIMIT:
        return tuple(tuple(order) for order in orders)
    for margin in (1, 2, 3):
        squeezed = _squeeze(orders, peaks, margin)
        if squeezed is not None and all(_peak(o) <= p for o, p in zip(squeezed, peaks)):
            return tuple(tuple(order) for order in squeezed)
    return tuple(tuple(order) for order in orders)


def dualpipev_order(positions: int, position: int, microbatches: int) -> Order:
    """DualPipeV's order of one device, as torch's ``ScheduleDualPipeV`` computes it.

    Position r of P, M >= 2P micro-batches: 2(P - r - 1) forwards of chunk 0; r + 1 times
    (F0, F1); P - r - 1 times (I1, a deferred W, F1); M - 2P + r + 1 times (F0, B1, F1, B0)
    (torch overlaps each F with the B after it); P - r - 1 times (B1, F1, B0); r + 1 times
    (B1, B0), the second half of them split (I, W deferred); P - r - 1 times (a W, I0);
    the remaining W's. Micro-batch indices count per chunk and kind (a "B" and an "I"
    share theirs). O(M).

    >>> " ".join(f"{k}{m}c{c}" for k, m, c in dualpipev_order(2, 1, 4))
    'F0c0 F0c1 F1c0 F1c1 F2c0 B0c1 F2c1 B0c0 F3c0 B1c1 F3c1 B1c0 B2c1 B2c0 I3c1 I3c0 W3c1 W3c0'
    """
    last = positions - 1 - position  # devices after this one
    order: Order = []
    done = {("F", 0): 0, ("F", 1): 0, ("I", 0): 0, ("I", 1): 0}
    deferred: deque[tuple[int, int]] = deque()

    def forward(chunk: int) -> None:
        order.append(("F", done[("F", chunk)], chunk))
        done[("F", chunk)] += 1

    def backward(chunk: int, split: bool) -> None:
        micro = done[("I", chunk)]
        order.append(("I" if split else "B", micro, chunk))
        done[("I", chunk)] += 1
        if split:
            deferred.append((micro, chunk))

    def weights() -> None:
        if deferred:
            order.append(("W", *deferred.popleft()))

    for _ in range(2 * last):
        forward(0)
    for _ in range(position + 1):
        forward(0)
        forward(1)
    for _ in range(last):
        backward(1, split=True)
        weights()
        forward(1)
    for _ in range(microbatches - 2 * positions + position + 1):
        forward(0)
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    for _ in range(last):
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    half = (position + 1) // 2
    split = False
    for i in range(position + 1):
        split = split or (i == half and position % 2 == 1)
        backward(1, split)
        split = split or (i == half and position % 2 == 0)
        backward(0, split)
    for _ in range(last):
        weights()
        backward(0, split)
    while deferred:
        weights()
    return order


def _per_minibatch(
    order: Order, replicas: tuple[int, ...], stage: int, replica: int, minibatches: int, microbatches: int
) -> list[Action]:
    """The position's ``order`` on the replica's micro-batches of each minibatch, then one "S"."""
    n = replicas[stage]
    out: list[Action] = []
    for k in range(minibatches):
        out += [Action(kind, k, m, c) for kind, m, c in order if (k * microbatches + m) % n == replica]
        out.append(Action("S", k))
    return out


def worker_v_half(
    replicas: tuple[int, ...],
    stage: int,
    replica: int,
    minibatches: int,
    microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """V-Half, per minibatch: ``block_order`` of the V-Half block, then one "S"."""
    order = list(v_block_orders("v-half", len(replicas), microbatches)[stage])
    return _per_minibatch(order, replicas, stage, replica, minibatches, microbatches)


def worker_v_min(
    replicas: tuple[int, ...],
    stage: int,
    replica: int,
    minibatches: int,
    microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """V-Min, per minibatch: ``block_order`` of the V-Min block, then one "S"."""
    order = list(v_block_orders("v-min", len(replicas), microbatches)[stage])
    return _per_minibatch(order, replicas, stage, replica, minibatches, microbatches)


def worker_dualpipev(
    replicas: tuple[int, ...],
    stage: int,
    replica: int,
    minibatches: int,
    microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """DualPipeV, per minibatch: ``dualpipev_order`` of the position, then one "S"."""
    order = dualpipev_order(len(replicas), stage, microbatches)
    return _per_minibatch(order, replicas, stage, replica, minibatches, microbatches)
