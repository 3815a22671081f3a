"""``--checkpoint-every auto``: the most frequent interval whose measured cost stays under a target.

CheckFreq's policy: a checkpoint every ``k`` steps costs its snapshot (training waits) plus,
when asynchronous, whatever of the persist the ``k`` steps after it do not hide (the next
snapshot waits for it), plus what the persist slows the steps it overlaps (its copy,
hashing and writing share the host with training: ``interference_ms``, the extra time of
the steps run while it was in flight over a step run without one)::

    overhead(k) = (snapshot_ms + max(0, persist_ms - k * step_ms) + interference_ms) / (k * step_ms)

``choose_interval`` returns the smallest ``k`` with ``overhead(k) <= target``. A synchronous
save hides nothing: its whole write is in ``snapshot_ms`` and ``persist_ms`` is 0.

``AutoInterval`` re-chooses at every checkpoint from the latest measurements, so the
interval follows a cost that changes (a slower disk, a larger state). Every rank must
checkpoint the same steps, so the run agrees on the measurements first (the maximum over
its ranks, ``pipeplan.runtime.train``): all ranks then choose the same ``k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["IntervalChoice", "AutoInterval", "choose_interval", "overhead_pct"]

_MOST_STEPS = 1_000_000  # bound on the interval searched (a checkpoint at least this often)


@dataclass(frozen=True)
class IntervalChoice:
    """An interval (steps between checkpoints) and the overhead it predicts (% of training time)."""

    every: int
    predicted_overhead_pct: float


def overhead_pct(
    every: int, step_ms: float, snapshot_ms: float, persist_ms: float, interference_ms: float = 0.0
) -> float:
    """Predicted checkpoint overhead in % of training time at one checkpoint per ``every`` steps.

    >>> round(overhead_pct(10, 100.0, 20.0, 500.0), 1)  # the persist hides behind 10 steps
    2.0
    >>> round(overhead_pct(2, 100.0, 20.0, 500.0), 1)  # 300 ms of it does not
    160.0
    """
    interval_ms = every * step_ms
    return 100.0 * (snapshot_ms + max(0.0, persist_ms - interval_ms) + interference_ms) / interval_ms


def choose_interval(
    step_ms: float, snapshot_ms: float, persist_ms: float, target_pct: float, interference_ms: float = 0.0
) -> IntervalChoice:
    """The smallest interval whose predicted overhead is at most ``target_pct``; O(log k) steps.

    ``step_ms``: a training step without checkpoints; ``snapshot_ms``: what training waits
    for at a checkpoint (the whole save when synchronous); ``persist_ms``: the write behind
    training (0 when synchronous); ``interference_ms``: what one persist slows training.

    >>> choose_interval(100.0, 20.0, 500.0, 3.5)
    IntervalChoice(every=6, predicted_overhead_pct=3.3333333333333335)
    >>> choose_interval(100.0, 0.5, 0.0, 3.5).every  # cheaper than the target: every step
    1
    """
    step_ms = max(step_ms, 1e-6)

    def fits(every: int) -> bool:
        return overhead_pct(every, step_ms, snapshot_ms, persist_ms, interference_ms) <= target_pct

    # overhead(k) does not increase with k: bisect the first k that fits
    low, high = 1, max(1, math.ceil(100.0 * (snapshot_ms + interference_ms) / (target_pct * step_ms)))
    while not fits(high) and high < _MOST_STEPS:
        high = min(2 * high, _MOST_STEPS)
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return IntervalChoice(low, overhead_pct(low, step_ms, snapshot_ms, persist_ms, interference_ms))


@dataclass
class AutoInterval:
    """The checkpoint steps of ``--checkpoint-every auto``: the first after step 1, then the
    chosen interval, re-chosen at every checkpoint from that checkpoint's measurements."""

    target_pct: float
    every: int = 1
    next_step: int = 1
    predicted_overhead_pct: float | None = None

    def due(self, completed: int) -> bool:
        return completed >= self.next_step

    def update(
        self,
        completed: int,
        step_ms: float,
        snapshot_ms: float,
        persist_ms: float,
        interference_ms: float = 0.0,
    ) -> bool:
        """Choose the interval after a checkpoint at step ``completed``; True when it changed."""
        choice = choose_interval(step_ms, snapshot_ms, persist_ms, self.target_pct, interference_ms)
        changed = choice.every != self.every or self.predicted_overhead_pct is None
        self.every, self.predicted_overhead_pct = choice.every, choice.predicted_overhead_pct
        self.next_step = completed + choice.every
        return changed
