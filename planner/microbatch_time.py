"""A stage's time per micro-batch: measured at micro-batch sizes, or proportional.

A layer costs a fixed part per call (kernel launches, Python, the framework's dispatch)
plus a part that grows with its batch, so one micro-batch of ``B / M`` samples takes more
than ``1 / M`` of the whole minibatch's time. A profile with ``timed_batch_sizes`` holds
each layer's forward and backward at those sizes (the last is the profiled batch ``B``);
the time of one micro-batch is then read off the stage's curve, piecewise linear in the
batch size between measured sizes. Below the smallest measured size (and for a profile
without the curve: older files, meta-built, imported and estimated profiles) it is taken
as proportional to the batch: ``T(b) = T(b_0) b / b_0``.

The planner and the simulator keep their costs per whole minibatch (``StageCosts``); this
module turns them into one micro-batch's share, ``T(B / M) / T(B)``, which is ``1 / M``
under the proportional model. The same share scales whatever was charged with the stage's
times (the loss, a tensor-parallel split), so a split profile keeps its curve's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeplan.profile import Profile

__all__ = ["BatchCurve", "stage_curve", "time_at_ms", "microbatch_share", "PROPORTIONAL_NOTE"]

PROPORTIONAL_NOTE = (
    "time per micro-batch taken as proportional to its size (the profile has no times at "
    "smaller batch sizes: profile it again to measure them)"
)


@dataclass(frozen=True)
class BatchCurve:
    """A stage's forward and backward ms at measured batch sizes (samples, ascending; the last
    is the profiled batch). Indexed alike: ``forward_ms[k]`` is at ``batch_sizes[k]``."""

    batch_sizes: tuple[int, ...]
    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]


def stage_curve(profile: Profile, layers: Sequence[int]) -> BatchCurve | None:
    """The sum of ``layers``' measured curves; None when ``profile`` has none. O(layers x sizes).

    Piecewise-linear interpolation is linear in the values, so interpolating the sum is the
    sum of the layers' interpolations.
    """
    sizes = profile.timed_batch_sizes
    if not sizes:
        return None
    chosen = [profile.layers[i] for i in layers]
    forward = tuple(sum(layer.forward_ms_at[k] for layer in chosen) for k in range(len(sizes)))
    backward = tuple(sum(layer.backward_ms_at[k] for layer in chosen) for k in range(len(sizes)))
    return BatchCurve(sizes, forward, backward)


def time_at_ms(sizes: Sequence[int], times_ms: Sequence[float], samples: float) -> float:
    """Time at ``samples`` per call: piecewise linear between measured sizes, proportional
    beyond them (from the nearest measured size). O(sizes).

    >>> time_at_ms((1, 4), (2.0, 5.0), 2)
    3.0
    >>> time_at_ms((2, 4), (3.0, 5.0), 1)  # proportional below the smallest
    1.5
    """
    if samples <= sizes[0]:
        return times_ms[0] * samples / sizes[0]
    for k in range(1, len(sizes)):
        if samples <= sizes[k]:
            lo, hi = sizes[k - 1], sizes[k]
            return times_ms[k - 1] + (times_ms[k] - times_ms[k - 1]) * (samples - lo) / (hi - lo)
    return times_ms[-1] * samples / sizes[-1]


def microbatch_share(curve: BatchCurve | None, microbatches: int, part: str = "forward") -> float:
    """One micro-batch's time over the whole minibatch's, ``T(B / M) / T(B)``, of the ``part``
    ("forward" or "backward") of ``curve``; ``1 / M`` without a curve or a measured time.

    >>> curve = BatchCurve((1, 2, 4), (3.0, 4.0, 6.0), (0.0, 0.0, 0.0))
    >>> microbatch_share(curve, 4)  # 3 ms of 6: a micro-batch of 1 costs half the minibatch
    0.5
    >>> microbatch_share(curve, 4, "backward")  # nothing measured: proportional
    0.25
    """
    if curve is None or microbatches <= 1:
        return 1.0 / max(microbatches, 1)
    times = curve.forward_ms if part == "forward" else curve.backward_ms
    whole = times[-1]
    if whole <= 0.0:
        return 1.0 / microbatches
    return time_at_ms(curve.batch_sizes, times, curve.batch_sizes[-1] / microbatches) / whole
