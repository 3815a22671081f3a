"""A lower bound (ms) of a flush schedule's simulated period, its bubble included.

With 1F1B-flush or GPipe every minibatch k + 1 starts after position 0's "S" of
minibatch k (the engine's completion, ``pipeplan.schedules.engine``): a worker of stage
s can start its first forward no earlier than the forwards of one micro-batch through
stages 0..s-1 (f = F / M each; with times measured at micro-batch sizes, ``planner.microbatch_time``, the
forward of one micro-batch as the simulator charges it), then runs its ceil(M / n_s) micro-batches' forwards and
backwards, and the gradient of its last one goes back through stages s-1..0 (b = B / M
each) before position 0 all-reduces and steps (S_0). So

    period >= max_s [ ceil(M / n_s) (f_s + b_s) + sum_{s' < s} (f_s' + b_s') ] + S_0,

sends and waits only adding to it. For p equal stages on d replicas each that is
W (1 + (p - 1) / m) + S_0 with W = (F + B) / d and m = M / d: Megatron's bubble
(p - 1) / m (Narayanan et al., SC'21, section 2.2.1). ``planner.partition`` ranks and
prunes candidate plans with it before simulating any of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeplan.planner.costs import update_ms
from pipeplan.planner.cuts import CutFamily
from pipeplan.planner.microbatch_time import microbatch_share, stage_curve
from pipeplan.planner.placement import FlatStage
from pipeplan.planner.simulate import allreduce_ms
from pipeplan.precision import Precision
from pipeplan.profile import Profile
from pipeplan.schedules import names_where, schedule_kind
from pipeplan.topology import Topology

__all__ = ["BOUNDED_SCHEDULES", "flush_period_bound_ms"]

# one chunk, whole backwards, the next minibatch after S (``ScheduleKind.flush_period_bounded``)
BOUNDED_SCHEDULES = names_where(lambda kind: kind.flush_period_bounded)


def flush_period_bound_ms(
    profile: Profile,
    family: CutFamily,
    flat: Sequence[FlatStage],
    topology: Topology,
    schedule: str,
    microbatches: int,
    charged_optimizer: str | None,
) -> float:
    """The bound of the module docstring for the stages ``flat`` (cut states of
    ``family``, ranks of ``topology``) under ``schedule`` with ``microbatches``; 0.0 for
    a schedule it does not cover (``BOUNDED_SCHEDULES``). O(layers + stages).

    >>> from pipeplan.profile import DeviceInfo, LayerProfile
    >>> from pipeplan.topology import DeviceSpec, Level
    >>> layers = tuple(LayerProfile(i, str(i), "x", (), 1.0, 2.0, 0, 0, 0) for i in range(4))
    >>> profile = Profile("m", "f", DeviceInfo("cpu", "x"), 8, "float32", layers)
    >>> top = Topology("t", DeviceSpec("d", 1), (Level("n", 4, 1e9),))
    >>> flat = [FlatStage(2 * s, 2 * s + 2, (s,), ()) for s in range(2)]
    >>> flush_period_bound_ms(profile, CutFamily("prefix", 4), flat, top, "1f1b-flush", 4, None)  # 6 (1 + 1/4)
    7.5
    """
    if not schedule_kind(schedule).flush_period_bounded or not flat:
        return 0.0
    m = microbatches
    best, before = 0.0, 0.0
    for stage in flat:
        layers = family.stage_layers(stage.start, stage.end)
        per_micro = _microbatch_ms(profile, layers, m)
        best = max(best, before + math.ceil(m / stage.replicas) * per_micro)
        before += per_micro
    first = family.stage_layers(flat[0].start, flat[0].end)
    params = float(sum(profile.layers[i].param_bytes for i in first))
    grads = params * Precision(profile.dtype, profile.master_dtype).gradient_ratio  # as simulate's all-reduce
    step = update_ms(profile, charged_optimizer)
    return best + allreduce_ms(topology, flat[0].ranks, grads) + sum(step[i] for i in first)


def _microbatch_ms(profile: Profile, layers: Sequence[int], microbatches: int) -> float:
    """Forward + backward ms of one micro-batch through ``layers``, as ``planner.simulate``
    charges it (``planner.microbatch_time``). O(layers x measured sizes)."""
    curve = stage_curve(profile, layers)
    forward = sum(profile.layers[i].forward_ms for i in layers)
    backward = sum(profile.layers[i].backward_ms for i in layers)
    return forward * microbatch_share(curve, microbatches) + backward * microbatch_share(
        curve, microbatches, "backward"
    )
