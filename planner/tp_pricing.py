"""Tensor parallelism in the planner: a t-way group of devices seen as one faster device.

A plan with tensor-parallel degree t (Megatron's PTD-P) runs every replica of every stage
on a group of t devices of the topology's innermost level (its fastest links), ranks
``g*t .. g*t + t - 1``. The planner prices such a plan exactly as a plan of the same
stages on a *group topology* (level 0 holding ``count / t`` groups, the other levels
unchanged) for a *split profile*, whose layers cost what one rank of a group pays:

    forward_t  = (forward - split_f) + split_f / (t * eff) + n_f * allreduce(bytes, t)
    backward_t = (backward - split_b) + split_b / (t * eff) + n_b * allreduce(bytes, t)
    params_t   = (params - split_p) + split_p / t          (saved bytes alike)

with the layer's ``tp_*`` fields (``pipeplan.profile``), ``eff`` the profile's
``tp_efficiency`` and the all-reduce a ring over level 0 (``costs.ring_allreduce_ms``).
The optimizer step scales with the bytes a rank holds. Each rank all-reduces its own
1/t of the gradients with its peers in the other replicas; the group topology's outer
bandwidths are 1/t of the unit's (``group_topology``). ``partition`` runs the exact DP once per degree (``degrees``), so a plan with t = 1
is today's plan and the best over t is exact over plans with one degree for all stages.

``expand_plan`` turns a plan of the group topology into the real one (replica-major
ranks, ``StagePlan.tensor_parallel``); ``group_view`` is its inverse for the simulator.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pipeplan.errors import InputError
from pipeplan.plan import Plan
from pipeplan.planner.costs import ring_allreduce_ms
from pipeplan.profile import LayerProfile, Profile
from pipeplan.topology import Topology

__all__ = [
    "degrees",
    "check_degree",
    "split_profile",
    "group_topology",
    "group_ranks",
    "expand_plan",
    "group_view",
    "plan_degree",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_degree(profile: Profile, topology: Topology, t: int) -> None:
    """One-line ``InputError`` unless every splitting layer of ``profile`` and the
    topology's innermost level can take tensor-parallel degree ``t``."""
    if t < 1:
        raise InputError(f"tensor-parallel degree must be >= 1 (got {t})")
    if t == 1:
        return
    inner = topology.levels[0]
    if inner.count % t:
        raise InputError(
            f"tensor-parallel degree {t} does not fit one {inner.name} of {inner.count} devices: tensor-parallel "
            f"groups stay within the topology's innermost level (its fastest links), so t must divide {inner.count}"
        )
    split = [layer for layer in profile.layers if layer.splits]
    if not split:
        raise InputError(
            f"tensor-parallel degree {t}: no layer of profile {profile.model} splits (no tp_units: the model "
            f"has no tensor-parallel plan, or its plan was refused, as `pipeplan profile` said; define TP_PLAN "
            f"in the model file, or estimate a transformer with `pipeplan estimate`)"
        )
    for layer in split:
        if layer.tp_units % t:
            raise InputError(
                f"tensor-parallel degree {t} does not divide layer {layer.index} ({layer.name})'s "
                f"{layer.tp_units} heads (or vocabulary entries)"
            )


def degrees(profile: Profile, topology: Topology, requested: int | None) -> list[int]:
    """Degrees to plan: ``[requested]`` (checked), or with None every t dividing the
    innermost level's count and every splitting layer's units (``[1]`` when no layer
    splits: the planner's path without tensor parallelism)."""
    if requested is not None:
        check_degree(profile, topology, requested)
        return [requested]
    if not any(layer.splits for layer in profile.layers):
        return [1]
    units = math.gcd(*(layer.tp_units for layer in profile.layers if layer.splits))
    return [t for t in _divisors(topology.levels[0].count) if units % t == 0]


def group_topology(topology: Topology, t: int) -> Topology:
    """``topology`` with level 0 holding groups of ``t`` devices (one group = one device).

    Level 0's bandwidth is device to device (a ring among groups runs t rings side by
    side, each of one rank's bytes). The levels above join whole units over all their
    links, of which the split profile's bytes (one rank's) are 1/t: their bandwidth is
    divided by t, so that a gradient all-reduce across units costs what the whole
    replica's bytes cost without tensor parallelism, and a group's activations cross at
    1/t of the unit's links.
    """
    if t == 1:
        return topology
    inner = topology.levels[0]
    outer = tuple(
        replace(level, bandwidth_bytes_per_s=level.bandwidth_bytes_per_s / t) for level in topology.levels[1:]
    )
    return replace(topology, levels=(replace(inner, count=inner.count // t),) + outer)


def _input_grad_after_split(layer: LayerProfile, backward_ms: float, divisor: float) -> float | None:
    """The split layer's input-gradient ms out of its new ``backward_ms`` (None: not measured).

    Its weight gradients ("W") are those of split weights, so they divide by t (x efficiency)
    like the split part they belong to; where W exceeds that part (it cannot, measured on
    the same layer, unless by noise) the layer keeps its input share of the backward.
    ``divisor``: t x ``tp_efficiency``."""
    if layer.backward_input_ms is None:
        return None
    weight_ms = layer.backward_ms - layer.backward_input_ms
    if weight_ms <= layer.tp_split_backward_ms and layer.tp_split_backward_ms > 0:
        return max(0.0, min(backward_ms, backward_ms - weight_ms / divisor))
    share = layer.backward_input_ms / layer.backward_ms if layer.backward_ms > 0 else 0.0
    return min(backward_ms, backward_ms * share)


def split_profile(profile: Profile, topology: Topology, t: int, sequence_parallel: bool = False) -> Profile:
    """What one rank of a ``t``-way group pays per layer (module docstring), with Megatron's
    sequence parallelism when ``sequence_parallel`` (``_sequence_parallel``). O(layers)."""
    if t == 1:
        return profile
    inner = topology.levels[0]
    eff = profile.tp_efficiency

    def allreduce(layer_bytes: int) -> float:
        return float(ring_allreduce_ms(float(layer_bytes), t, inner.bandwidth_bytes_per_s, inner.message_ms))

    layers = []
    for layer in profile.layers:
        if not layer.splits:
            layers.append(layer)
            continue
        ar = allreduce(layer.tp_allreduce_bytes) if layer.tp_allreduce_bytes else 0.0
        if sequence_parallel:
            layer = _sequence_parallel(layer, t)
        saved = layer.saved_bytes - layer.tp_split_saved_bytes + math.ceil(layer.tp_split_saved_bytes / t)
        selective_saved, selective_ms = _selective_after_split(layer, saved, t * eff, t)
        backward_ms = (
            layer.backward_ms
            - layer.tp_split_backward_ms
            + layer.tp_split_backward_ms / (t * eff)
            + layer.tp_backward_allreduces * ar
        )
        layers.append(
            replace(
                layer,
                forward_ms=layer.forward_ms
                - layer.tp_split_forward_ms
                + layer.tp_split_forward_ms / (t * eff)
                + layer.tp_forward_allreduces * ar,
                backward_ms=backward_ms,
                backward_input_ms=_input_grad_after_split(layer, backward_ms, t * eff),
                param_bytes=layer.param_bytes
                - layer.tp_split_param_bytes
                + math.ceil(layer.tp_split_param_bytes / t),
                saved_bytes=saved,
                selective_saved_bytes=selective_saved,
                selective_recompute_ms=selective_ms,
                largest_param_bytes=_largest_after_split(layer, t),
                tp_units=0,
                tp_split_forward_ms=0.0,
                tp_split_backward_ms=0.0,
                tp_split_param_bytes=0,
                tp_split_saved_bytes=0,
                tp_allreduce_bytes=0,
                tp_forward_allreduces=0,
                tp_backward_allreduces=0,
            )
        )
    before = sum(layer.param_bytes for layer in profile.layers)
    after = sum(layer.param_bytes for layer in layers)
    share = after / before if before else 1.0  # a rank steps the bytes it holds
    return replace(
        profile,
        layers=tuple(layers),
        optimizer_ms={name: ms * share for name, ms in profile.optimizer_ms.items()},
    )


def _selective_after_split(layer: LayerProfile, saved: int, divisor: float, t: int) -> tuple[int, float]:
    """The split layer's (selective_saved_bytes, selective_recompute_ms): its attention core
    splits by heads, so the bytes it frees divide by t and its ms by t x efficiency
    (``divisor``); -1 stays -1."""
    if layer.selective_saved_bytes < 0:
        return layer.selective_saved_bytes, layer.selective_recompute_ms
    freed = math.ceil((layer.saved_bytes - layer.selective_saved_bytes) / t)
    ms = layer.selective_recompute_ms
    return saved - freed, ms / divisor if ms >= 0 else ms


def _sequence_parallel(layer: LayerProfile, t: int) -> LayerProfile:
    """``layer`` under Megatron's sequence parallelism (Korthikanti et al. 2022, section 4.2.2),
    before the tensor-parallel split: the parts repeated on every rank of a t-way group (the
    layer norms, dropouts and residual adds: activations ``saved - tp_split_saved``, time
    ``forward - tp_split_forward``, backward alike) run on s / t of the sequence, so they
    divide by t, and so does the input a fully recomputed layer keeps
    (``recompute_kept_bytes``: sequence-sharded). Each all-reduce becomes a reduce-scatter
    and an all-gather of the same tensor: on a ring each moves half an all-reduce's bytes,
    so the collectives' time is unchanged. A bound for a vocab-parallel embedding, whose
    lookups stay whole before its reduce-scatter. Parameters do not change."""
    saved = layer.tp_split_saved_bytes + math.ceil((layer.saved_bytes - layer.tp_split_saved_bytes) / t)
    backward_ms = layer.tp_split_backward_ms + (layer.backward_ms - layer.tp_split_backward_ms) / t
    kept = layer.recompute_kept_bytes
    selective = layer.selective_saved_bytes
    input_ms = layer.backward_input_ms
    return replace(
        layer,
        saved_bytes=saved,
        forward_ms=layer.tp_split_forward_ms + (layer.forward_ms - layer.tp_split_forward_ms) / t,
        backward_ms=backward_ms,
        recompute_kept_bytes=math.ceil(kept / t) if kept >= 0 else kept,
        # the weight gradients are all in the split part
        backward_input_ms=None
        if input_ms is None
        else max(0.0, backward_ms - (layer.backward_ms - input_ms)),
        selective_saved_bytes=saved - (layer.saved_bytes - selective) if selective >= 0 else selective,
    )


def group_ranks(topology: Topology, t: int, group: int) -> tuple[int, ...]:
    """The ``t`` global ranks of device ``group`` of ``group_topology(topology, t)``.

    >>> from pipeplan.topology import DeviceSpec, Level
    >>> top = Topology("x", DeviceSpec("d", 1), (Level("node", 4, 1.0), Level("c", 2, 1.0)))
    >>> group_ranks(top, 2, 3)  # node 1, its second pair
    (6, 7)
    """
    per_node = topology.levels[0].count // t
    base = (group // per_node) * topology.levels[0].count + (group % per_node) * t
    return tuple(range(base, base + t))


def expand_plan(
    plan: Plan,
    topology: Topology,
    t: int,
    baselines_ms: tuple[float, float] | None = None,
    sequence_parallel: bool = False,
) -> Plan:
    """A plan of ``group_topology(topology, t)`` on the real ``topology``: each group
    rank becomes its ``t`` ranks (replica-major), every stage ``tensor_parallel = t`` (and
    ``sequence_parallel`` as planned: the split profile's, ``split_profile``).
    The per-device figures stay the split profile's (what one rank pays); the baselines
    (single device, pure data parallelism, ms) are ``baselines_ms`` when given (the real
    profile's, without tensor parallelism)."""
    if t == 1:
        return plan
    stages = tuple(
        replace(
            stage,
            tensor_parallel=t,
            sequence_parallel=sequence_parallel,
            ranks=tuple(rank for group in stage.ranks for rank in group_ranks(topology, t, group)),
        )
        for stage in plan.stages
    )
    predicted = plan.predicted
    if baselines_ms is not None:
        period = predicted.time_per_minibatch_ms
        single, dp = baselines_ms
        predicted = replace(
            predicted,
            single_device_ms=single,
            data_parallel_ms=dp,
            speedup_vs_single_device=single / period if period > 0 else math.inf,
            speedup_vs_data_parallel=dp / period if period > 0 else math.inf,
        )
    return replace(
        plan, topology=topology, world_size=topology.world_size, stages=stages, predicted=predicted
    )


def plan_degree(plan: Plan) -> int:
    """The plan's one tensor-parallel degree; ``InputError`` when stages differ."""
    found = {stage.tensor_parallel for stage in plan.stages}
    if len(found) > 1:
        raise InputError(
            f"plan stages use different tensor-parallel degrees {sorted(found)}; pipeplan predicts plans with one"
        )
    return found.pop()


def group_view(plan: Plan, profile: Profile | None) -> tuple[Plan, Profile | None]:
    """The inverse of ``expand_plan``: (the plan on the group topology, the split profile),
    both unchanged when t = 1. ``InputError`` (one line) when a stage's ranks are not
    whole groups of the innermost level."""
    t = plan_degree(plan)
    if t == 1:
        return plan, profile
    if profile is not None:
        check_degree(profile, plan.topology, t)
    elif plan.topology.levels[0].count % t:
        raise InputError(
            f"plan tensor-parallel degree {t} does not divide its innermost level's "
            f"{plan.topology.levels[0].count} devices"
        )
    grouped = group_topology(plan.topology, t)
    stages = []
    for stage in plan.stages:
        groups = []
        for replica in range(stage.replicas):
            ranks = stage.replica_ranks(replica)
            if ranks[0] % t or ranks != group_ranks(plan.topology, t, _group_of(plan.topology, t, ranks[0])):
                raise InputError(
                    f"plan stage {stage.index}: replica {replica}'s ranks {list(ranks)} are not one aligned "
                    f"tensor-parallel group of {t} devices within a {plan.topology.levels[0].name}"
                )
            groups.append(_group_of(plan.topology, t, ranks[0]))
        stages.append(replace(stage, tensor_parallel=1, sequence_parallel=False, ranks=tuple(groups)))
    view = replace(plan, topology=grouped, world_size=grouped.world_size, stages=tuple(stages))
    sequence_parallel = any(stage.sequence_parallel for stage in plan.stages)
    return view, split_profile(profile, plan.topology, t, sequence_parallel) if profile is not None else None


def _group_of(topology: Topology, t: int, rank: int) -> int:
    """The group (device of the group topology) holding global ``rank``."""
    inner = topology.levels[0].count
    return (rank // inner) * (inner // t) + (rank % inner) // t


def _largest_after_split(layer: LayerProfile, t: int) -> int:
    """A bound on the largest parameter a rank holds of ``layer`` split t ways: a split
    weight's shard, or a weight left whole (no larger than the bytes left whole)."""
    if not layer.largest_param_bytes:
        return 0  # not recorded: the planner reads the layer's whole (split) bytes
    whole = layer.param_bytes - layer.tp_split_param_bytes
    return max(
        math.ceil(min(layer.largest_param_bytes, layer.tp_split_param_bytes) / t),
        min(layer.largest_param_bytes, whole),
    )
