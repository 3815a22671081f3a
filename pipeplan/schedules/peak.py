"""The moment a worker's held activations peak, from its action list: one rule for the planner
(``ScheduleKind.in_flight_by_chunk``) and the simulator (``planner.simulate``).

A unit (one micro-batch of one chunk) is held from its "F" to its "B", or to its "W" when the
backward is split; from its "I" to its "W" it also holds what its "I" recorded for its "W"
(deferred). Given per-chunk weights (the bytes a unit holds, and holds besides while deferred)
the peak is the first moment of the most bytes held; without them, of the most units held, and
among those the one with the most deferred (the larger figure: a deferred unit holds more).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from pipeplan.errors import InputError
from pipeplan.schedules.actions import Action

__all__ = ["ChunkWeights", "chunk_weights", "units_at_peak"]

# what a unit of each chunk holds from its "F", and besides from its "I" to its "W" (bytes)
ChunkWeights = tuple[tuple[float, ...], tuple[float, ...]]


def chunk_weights(saved_bytes: Sequence[float], deferred_bytes: Sequence[float]) -> ChunkWeights:
    """The weights of a device's chunks from what a unit of each saves and defers: a unit
    weighs at least 1, so that a chunk that saves nothing still counts as held.

    >>> chunk_weights([0, 8], [0, 2])
    ((1.0, 8.0), (0.0, 2.0))
    """
    return tuple(float(max(b, 1)) for b in saved_bytes), tuple(float(b) for b in deferred_bytes)


def units_at_peak(
    actions: Sequence[Action], chunks: int, weights: ChunkWeights | None = None
) -> tuple[list[int], list[int]]:
    """(units held, of those units past their "I") of each of ``chunks`` chunks at the peak of
    ``actions`` (module docstring); all 0 when nothing is ever held. O(actions), vectorised
    with numpy (the running sum adds in the actions' order, as a loop would).

    >>> order = [Action.parse(t) for t in "F0 F0.1 F0.2 B0.2 I0 I0.1 W0 W0.1".split()]
    >>> units_at_peak(order, 1)  # the most units: three, after F0.2
    ([3], [0])
    >>> units_at_peak(order, 1, ((1.0,), (5.0,)))  # a deferred unit weighs 6: two outweigh three
    ([2], [2])
    """
    if not actions:
        return [0] * chunks, [0] * chunks
    codes = np.frombuffer("".join(map(_kind_of, actions)).encode(), dtype=np.uint8)
    if len(codes) != len(actions):
        raise InputError("action kinds must be one letter each")
    weight_passes = (codes == ord("W")).astype(np.int64)
    step = (codes == ord("F")).astype(np.int64) - (codes == ord("B")) - weight_passes
    deferred = (codes == ord("I")).astype(np.int64) - weight_passes
    if chunks == 1:
        chunk = np.zeros(len(actions), dtype=np.int64)
    else:
        chunk = np.fromiter(map(_chunk_of, actions), dtype=np.int64, count=len(actions))
    if weights is None:  # units first; a deferred unit below one unit breaks the ties
        unit_bytes, deferred_bytes = np.ones(chunks), np.full(chunks, 1.0 / (len(actions) + 1))
    else:
        unit_bytes, deferred_bytes = np.asarray(weights[0], dtype=float), np.asarray(weights[1], dtype=float)
    held = np.cumsum(step * unit_bytes[chunk] + deferred * deferred_bytes[chunk])
    peak = int(held.argmax())
    if not held[peak] > 0.0:
        return [0] * chunks, [0] * chunks
    return _counts(chunk[: peak + 1], step[: peak + 1], chunks), _counts(
        chunk[: peak + 1], deferred[: peak + 1], chunks
    )


def _counts(chunk: np.ndarray, step: np.ndarray, chunks: int) -> list[int]:
    counts = np.bincount(chunk, weights=step, minlength=chunks)
    return [int(count) for count in counts.astype(np.int64)]  # whole numbers, exact in float64


_kind_of = attrgetter("kind")
_chunk_of = attrgetter("chunk")
