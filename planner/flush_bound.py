"""A lower bound (ms) of a flush schedule's simulated period, its bubble included.

With 1F1B-flush or GPipe every minibatch k + 1 starts after position 0's "S" of
minibatch k (the engine's completion, ``pipeplan.schedules.engine``). A replica of stage
s starts its first forward no earlier than the forwards of one micro-batch through stages
0..s-1 (f_s' each: a micro-batch's forward as the simulator charges it, at its measured
size where the profile has the times, ``planner.microbatch_time``), and the gradient of
its last backward goes back through stages s-1..0 (b_s' each) before position 0 steps
(S_0). So

    period >= max_s [ T_s + sum_{s' < s} (f_s' + b_s') ] + S_0,

sends and waits only adding to it, where T_s is the time from the replica's first forward
to its last backward:
- it runs c_s = ceil(M / n_s) micro-batches one at a time: T_s >= c_s (f_s + b_s);
- at most K_s of them are in flight at once (the schedule's ``activations_in_flight``),
  each for at least its round trip L_s = sum_{s' >= s} (f_s' + b_s') through the stages
  from s on. The intervals' lengths sum to c_s L_s and at most K_s overlap, so
  T_s >= c_s L_s / K_s. This is what a replicated stage feeding a slower one pays: 1F1B's
  window keeps too few micro-batches in flight to hide their round trip.

S_0 is position 0's optimizer step alone. Its sync is left out: it depends on the shard
mode the stage gets later (``planner.sharding``), and a sharded stage's grouped
collectives can take less than one ring all-reduce over all its replicas.

For p equal stages on d replicas each this is W (1 + (p - 1) / m) + S_0 with
W = (F + B) / d and m = M / d: Megatron's bubble (p - 1) / m (Narayanan et al., SC'21,
section 2.2.1). ``planner.partition`` ranks and prunes candidate plans with it before
simulating any of them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from pipeplan.planner.costs import update_ms
from pipeplan.planner.cuts import CutFamily
from pipeplan.planner.microbatch_time import microbatch_share, stage_curve
from pipeplan.planner.placement import FlatStage
from pipeplan.profile import Profile
from pipeplan.schedules import names_where, schedule_kind

__all__ = ["BOUNDED_SCHEDULES", "flush_period_bound_ms"]

# one chunk, whole backwards, the next minibatch after S (``ScheduleKind.flush_period_bounded``)
BOUNDED_SCHEDULES = names_where(lambda kind: kind.flush_period_bounded)


def flush_period_bound_ms(
    profile: Profile,
    family: CutFamily,
    flat: Sequence[FlatStage],
    schedule: str,
    microbatches: int,
    charged_optimizer: str | None,
) -> float:
    """The bound of the module docstring for the stages ``flat`` (cut states of
    ``family``) under ``schedule`` with ``microbatches``; 0.0 for
    a schedule it does not cover (``BOUNDED_SCHEDULES``). O(layers + stages) for 1f1b-flush and gpipe.

    >>> from pipeplan.profile import DeviceInfo, LayerProfile
    >>> layers = tuple(LayerProfile(i, str(i), "x", (), 1.0, 2.0, 0, 0, 0) for i in range(4))
    >>> profile = Profile("m", "f", DeviceInfo("cpu", "x"), 8, "float32", layers)
    >>> flat = [FlatStage(2 * s, 2 * s + 2, (s,), ()) for s in range(2)]
    >>> flush_period_bound_ms(profile, CutFamily("prefix", 4), flat, "1f1b-flush", 4, None)  # 6 (1 + 1/4)
    7.5
    """
    kind = schedule_kind(schedule)
    if not kind.flush_period_bounded or not flat:
        return 0.0
    m = microbatches
    replicas = [stage.replicas for stage in flat]
    per_micro = [_microbatch_ms(profile, family.stage_layers(stage.start, stage.end), m) for stage in flat]
    round_trip = list(itertools.accumulate(reversed(per_micro)))[::-1]  # L_s
    best, before = 0.0, 0.0
    for s, stage in enumerate(flat):
        count = math.ceil(m / stage.replicas)
        held = min(count, max(1, math.ceil(kind.activations_in_flight(replicas, s, m) * m - 1e-9)))
        span = max(count * per_micro[s], count * round_trip[s] / held)
        best = max(best, before + span)
        before += per_micro[s]
    step = update_ms(profile, charged_optimizer)
    return best + sum(step[i] for i in family.stage_layers(flat[0].start, flat[0].end))


def _microbatch_ms(profile: Profile, layers: Sequence[int], microbatches: int) -> float:
    """Forward + backward ms of one micro-batch through ``layers``, as ``planner.simulate``
    charges it (``planner.microbatch_time``). O(layers x measured sizes)."""
    curve = stage_curve(profile, layers)
    forward = sum(profile.layers[i].forward_ms for i in layers)
    backward = sum(profile.layers[i].backward_ms for i in layers)
    return forward * microbatch_share(curve, microbatches) + backward * microbatch_share(
        curve, microbatches, "backward"
    )
