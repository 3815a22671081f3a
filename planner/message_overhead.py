"""The message overhead that explains a measured run: what ``pipeplan calibrate`` writes.

A topology level's ``message_overhead`` (``Level.message_overhead_ms``) is what each end of
a message costs its own rank beside the latency: on gloo, the posting, the waking and the
copying on the cores the compute uses. It is a fact of the machine and its load, not of a
model: on the 2-vCPU dev VM the same bench fitted 231 us one day and 443 us another
(docs/benchmarks.md). So it is measured where the plan will run: a pipeline with next to no
compute is trained, and the overhead is the one at which the simulator predicts the time
that run measured.
"""

from __future__ import annotations

from dataclasses import replace

from pipeplan.errors import InputError
from pipeplan.plan import Plan
from pipeplan.planner.simulate import simulate_plan
from pipeplan.profile import Profile
from pipeplan.topology import Topology

__all__ = ["with_message_overhead", "fitted_message_overhead_ms"]

_FIRST_BRACKET_MS = 1.0  # the bisection's first upper end; doubled until it predicts enough
_LARGEST_MS = 1e4  # an overhead no machine has: a run slower than this predicts is not messages


def with_message_overhead(topology: Topology, overhead_ms: float, level: int = 0) -> Topology:
    """``topology`` with level ``level``'s message overhead set to ``overhead_ms``."""
    if not 0 <= level < len(topology.levels):
        raise InputError(f"topology {topology.name!r} has no level {level} (it has {len(topology.levels)})")
    levels = list(topology.levels)
    levels[level] = replace(levels[level], message_overhead_ms=overhead_ms)
    return replace(topology, levels=tuple(levels))


def fitted_message_overhead_ms(
    plan: Plan, profile: Profile, measured_ms: float, level: int = 0, tolerance_ms: float = 1e-4
) -> float:
    """The overhead (ms) of level ``level`` at which ``plan``'s simulated time per minibatch
    is ``measured_ms``: bisection, since the simulated time grows with it. 0.0 where the plan
    without any overhead already predicts ``measured_ms`` or more (the run lost nothing to
    its messages).

    >>> from pipeplan.planner.partition import PartitionOptions, partition
    >>> from pipeplan.profile import DeviceInfo, LayerProfile
    >>> from pipeplan.topology import preset
    >>> layers = tuple(LayerProfile(i, f"l{i}", "x", (i - 1,) if i else (), 1.0, 2.0, 0, 0, 64) for i in range(4))
    >>> profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers)
    >>> topology = with_message_overhead(preset("local-cpu"), 0.0)
    >>> plan = partition(profile, topology, PartitionOptions("1f1b-flush", microbatches=4, straight=True))
    >>> slow = replace(plan, topology=with_message_overhead(topology, 0.25))
    >>> round(fitted_message_overhead_ms(plan, profile, simulate_plan(slow, profile).time_per_minibatch_ms), 3)
    0.25
    """
    if not measured_ms > 0:
        raise InputError(f"measured time per minibatch {measured_ms} ms must be positive")

    def predicted_ms(overhead_ms: float) -> float:
        topology = with_message_overhead(plan.topology, overhead_ms, level)
        return simulate_plan(replace(plan, topology=topology), profile).time_per_minibatch_ms

    low, high = 0.0, _FIRST_BRACKET_MS
    if predicted_ms(low) >= measured_ms:
        return 0.0
    while predicted_ms(high) < measured_ms:
        if high >= _LARGEST_MS:
            raise InputError(
                f"no message overhead up to {_LARGEST_MS:.0f} ms explains {measured_ms:.3f} ms per "
                f"minibatch (the plan predicts {predicted_ms(0.0):.3f} ms without one)"
            )
        low, high = high, 2 * high
    while high - low > tolerance_ms:
        middle = (low + high) / 2
        low, high = (middle, high) if predicted_ms(middle) < measured_ms else (low, middle)
    return (low + high) / 2
