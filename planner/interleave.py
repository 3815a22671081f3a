"""Planning ``interleaved-1f1b`` and the V schedules (``zb-v``, ``v-half``, ``v-min``,
``dualpipev``): the planner picks p, d, v and the chunk boundaries.

With p pipeline positions, each on d replicas (PTD-P: the pipeline copied d times, position
i on ranks ``i*d .. i*d + d - 1``, each replica running its own pipeline on M / d
micro-batches, every chunk's gradients all-reduced among its d replicas on the links that
join them), and v chunks per device, the layer chain (the profile's topological order) is
cut into v * p contiguous chunks that minimise the largest chunk's compute
(``balanced_cuts``, exact against brute force: chunks hold different numbers of layers
where layers differ); chunk q runs on position q % p. ZB-V (v = 2 in a V): model stage
q = c * p + i runs piece i for c = 0 and piece 2p - 1 - i for c = 1, the layers mirrored
around the middle. Every (p, d) with p * d devices (``pipeline_shapes``; d = 1 only with
``straight`` or a schedule without ``replica_pipelines``: the V schedules) and every v in ``VIRTUAL_CANDIDATES`` (or the user's) is simulated and the
fastest plan that fits device memory (the sum over a device's chunks, with the registry's
activations in flight per chunk) is kept. The approximation: the cuts balance chunks, not
the sum over a device's chunks nor the bubble; the simulation compares p, d and v only.
Recomputation (estimated profiles, ``recompute.schedule_plans_recompute``) is one mode for
the whole plan, as Megatron's flags are global: each candidate is built under every mode
``--recompute`` allows (``recompute_modes``) and the simulation compares them too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.plan import Plan, StagePlan
from pipeplan.planner.assemble import assemble_plan
from pipeplan.planner.cost_models import cost_model
from pipeplan.planner.costs import LayerArrays, layer_arrays, on_gloo, transfer_ms
from pipeplan.planner.memory import plan_stage_memory, stage_memory_bytes
from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.predict import predict
from pipeplan.planner.recompute import StageRecompute, gain_bytes, selective_freed_bytes
from pipeplan.planner.recompute_choice import recompute_candidates
from pipeplan.planner.simulate import SimulationTooLarge, allreduce_ms, durations, stage_costs
from pipeplan.planner.tp_pricing import group_view
from pipeplan.profile import Profile
from pipeplan.schedules import schedule_kind, v_segment
from pipeplan.schedules.peak import chunk_weights
from pipeplan.topology import Topology
from pipeplan.units import format_bytes

__all__ = [
    "VIRTUAL_CANDIDATES",
    "balanced_cuts",
    "interleaved_plan",
    "partition_interleaved",
    "chunk_recompute",
    "pipeline_shapes",
    "plan_interleaved_shape",
    "rechunk",
    "recompute_modes",
]

VIRTUAL_CANDIDATES = (2, 3, 4)  # chunks per device the planner tries


def balanced_cuts(costs: Sequence[float], parts: int) -> list[int]:
    """Boundaries ``[0, c1, ..., n]`` of ``parts`` contiguous non-empty pieces of ``costs``
    whose largest sum is smallest (to 1e-9 relative). O(n log(1/eps)).

    >>> balanced_cuts([1, 1, 1, 1, 4], 2)
    [0, 4, 5]
    >>> balanced_cuts([1, 2, 3, 4], 4)
    [0, 1, 2, 3, 4]
    """
    n = len(costs)
    if not 1 <= parts <= n:
        raise InputError(f"cannot cut {n} layers into {parts} non-empty chunks")

    def greedy(limit: float) -> list[int]:
        cuts, total = [0], 0.0
        for i, c in enumerate(costs):
            if total + c > limit and i > cuts[-1]:
                cuts.append(i)
                total = 0.0
            total += c
        return cuts + [n]

    low, high = max(costs), max(sum(costs), max(costs))
    for _ in range(100):
        if high - low <= 1e-9 * max(high, 1e-12):
            break
        mid = (low + high) / 2.0
        if len(greedy(mid)) - 1 <= parts:
            high = mid
        else:
            low = mid
    cuts = greedy(high)
    while len(cuts) - 1 < parts:  # split the longest piece (never raises the largest sum)
        q = max(range(len(cuts) - 1), key=lambda k: cuts[k + 1] - cuts[k])
        cuts.insert(q + 1, cuts[q] + 1)
    return cuts


def interleaved_plan(
    profile: Profile,
    topology: Topology,
    options: PartitionOptions,
    arrays: LayerArrays,
    positions: int,
    virtual: int,
    ranks: Sequence[int] | None = None,
    replicas: int = 1,
    recompute: str = "none",
) -> tuple[Plan | None, int]:
    """(plan before simulation, peak bytes per device) of v * p balanced chunks, each on
    ``replicas`` devices; (None, a lower bound of the peak) when its weights and optimizer
    state alone overflow device memory (with ``options.memory_check``).

    Position i runs on ``ranks[i]`` (default: rank i) without replicas, on ranks
    ``i*d .. i*d + d - 1`` with d replicas; a chunk's all-reduce is the ring's on the
    outermost level joining its d ranks (``simulate.allreduce_ms``). ``recompute`` ("none",
    "selective" or "full"): every chunk's choice of that mode (``chunk_recompute``), its
    recomputed forwards in the chunk's compute, a device's largest transient charged to its
    first chunk (as ``planner.simulate`` charges it).
    """
    micro = options.microbatches
    optimizer = options.optimizer
    chunks = positions * virtual
    per_layer = [arrays.compute(i, i + 1) for i in range(arrays.layers)]
    cuts = balanced_cuts(per_layer, chunks)
    stage_replicas = (replicas,) * positions
    groups = (
        [tuple(range(i * replicas, (i + 1) * replicas)) for i in range(positions)]
        if ranks is None
        else [(rank,) for rank in ranks]
    )
    rank_of = [group[0] for group in groups]
    static = _static_device_bytes(arrays, cuts, positions, options.optimizer)
    if options.memory_check and static > topology.device.memory_bytes:
        # its weights and optimizer state alone do not fit: skip the activations' count
        # (an action list of every position); the figure is a lower bound of the peak
        return None, int(static)
    device_bytes = [0.0] * positions
    segment = _segments(options.schedule, positions, chunks)  # model stage -> its piece of the layers
    stage_at = {piece: q for q, piece in enumerate(segment)}
    recompute_any = recompute != "none"
    gains = gain_bytes(profile) if recompute_any else None
    choices = [
        chunk_recompute(profile, range(cuts[segment[q]], cuts[segment[q] + 1]), micro, recompute, gains)
        for q in range(chunks)
    ]
    activation = [
        (
            arrays.saved(cuts[segment[q]], cuts[segment[q] + 1])
            if not recompute_any
            else choices[q].activation_bytes
        )
        + arrays.boundary(cuts[segment[q]], cuts[segment[q] + 1], packed_copy=on_gloo(topology))
        for q in range(chunks)
    ]
    deferred = [arrays.deferred(cuts[segment[q]], cuts[segment[q] + 1]) for q in range(chunks)]
    # what a unit of each chunk of a device holds (the simulator's weights): the device's
    # chunks are charged at its peak of bytes
    weights = [chunk_weights(activation[i::positions], deferred[i::positions]) for i in range(positions)]
    stages = []
    for q in range(chunks):
        i, c = q % positions, q // positions
        start, end = cuts[segment[q]], cuts[segment[q] + 1]
        choice = choices[q]
        comm = 0.0
        if segment[q] + 1 < chunks:
            after = stage_at[segment[q] + 1] % positions
            level = topology.levels[topology.level_joining(rank_of[i], rank_of[after])]
            comm = float(transfer_ms(arrays.cut_bytes[end], level.bandwidth_bytes_per_s, level.latency_ms))
        memory, versions, in_flight = plan_stage_memory(
            options.schedule,
            stage_replicas,
            i,
            arrays.params(start, end),
            activation[q],
            optimizer,
            micro,
            virtual,
            chunk=c,
            precision=arrays.precision,
            largest_param_bytes=max(
                arrays.largest(cuts[segment[k]], cuts[segment[k] + 1]) for k in range(i, chunks, positions)
            ),
            transient_bytes=max(choices[k].transient_bytes for k in range(i, chunks, positions))
            if c == 0
            else 0.0,
            working_bytes=max(
                arrays.working(cuts[segment[k]], cuts[segment[k] + 1]) for k in range(i, chunks, positions)
            ),
            deferred_bytes=deferred[q],
            chunk_weights=weights[i],
        )
        device_bytes[i] += memory
        compute = arrays.compute(start, end) + choice.extra_ms
        reduce = allreduce_ms(topology, groups[i], arrays.sync_bytes(start, end))
        stages.append(
            StagePlan(
                index=q,
                layer_start=start,
                layer_end=end,
                replicas=replicas,
                ranks=groups[i],
                compute_ms=compute,
                allreduce_ms=reduce,
                communication_ms=comm,
                time_per_minibatch_ms=max(compute / replicas, reduce, comm),
                memory_bytes=memory,
                weight_versions=versions,
                in_flight=max(1, math.ceil(in_flight)),
                recompute_layers=choice.layers,
                selective_layers=choice.selective,
                recompute_ms=choice.extra_ms,
            )
        )
    time_ms = max(stage.time_per_minibatch_ms for stage in stages)
    plan = assemble_plan(profile, topology, options, arrays, tuple(stages), time_ms, virtual)
    return plan, int(max(device_bytes))


def chunk_recompute(
    profile: Profile,
    layers: Sequence[int],
    microbatches: int,
    mode: str,
    gains: Sequence[float] | None = None,
) -> StageRecompute:
    """A chunk's recomputation under ``mode`` for the whole plan (Megatron's global flags):
    ``none``; ``selective`` every layer with an attention core (``recompute.selective_option``);
    ``full`` every recomputable layer (``--recompute-granularity full --recompute-method
    uniform``: ``recompute.stage_options``' last); ``gains``: the profile's ``gain_bytes``.
    O(layers) with ``gains``."""
    if mode == "none":
        return StageRecompute((), 0.0, float(sum(profile.charged_saved_bytes[i] for i in layers)), 0.0)
    return recompute_candidates(profile, layers, microbatches, mode, gains)[-1]


def _static_device_bytes(arrays: LayerArrays, cuts: Sequence[int], positions: int, optimizer: str) -> float:
    """The fullest device's weights, gradients and optimizer state (nothing in flight):
    a lower bound of its peak (``planner.memory``), O(chunks)."""
    chunks = len(cuts) - 1
    return max(
        float(
            stage_memory_bytes(
                sum(arrays.params(cuts[q], cuts[q + 1]) for q in range(i, chunks, positions)),
                0.0,
                1,
                0.0,
                optimizer,
                arrays.precision,
            )
        )
        for i in range(positions)
    )


def _segments(schedule: str, positions: int, chunks: int) -> list[int]:
    """The piece of the layer chain each model stage runs: q itself, or its place in a V
    (``v_segment``: position i holds pieces i and 2p - 1 - i) for a V-shaped schedule.

    >>> _segments("zb-v", 2, 4), _segments("interleaved-1f1b", 2, 4)
    ([0, 1, 3, 2], [0, 1, 2, 3])
    """
    if schedule_kind(schedule).v_shape:
        return [v_segment(q, positions) for q in range(chunks)]
    return list(range(chunks))


def pipeline_shapes(world_size: int, layers: int, options: PartitionOptions) -> list[tuple[int, int]]:
    """(p, d): p positions of d replicas each to plan, fewest replicas first.

    Without replicas p = every device (or ``max_stages``), at most half the layers, as
    before; unless ``straight``, also every p * d = devices with d > 1, p >= 2 and at most
    ``max_stages`` and half the layers.

    >>> pipeline_shapes(8, 40, PartitionOptions(schedule="interleaved-1f1b"))
    [(8, 1), (4, 2), (2, 4)]
    >>> pipeline_shapes(8, 6, PartitionOptions(schedule="interleaved-1f1b", straight=True))
    [(3, 1)]
    """
    cap = min(options.max_stages or world_size, layers // 2)
    shapes = [(min(world_size, cap), 1)]
    if not options.straight:
        shapes += [(world_size // d, d) for d in range(2, world_size + 1) if world_size % d == 0]
    return [(p, d) for k, (p, d) in enumerate(shapes) if 2 <= p <= cap and (p, d) not in shapes[:k]]


def partition_interleaved(
    profile: Profile, topology: Topology, options: PartitionOptions, beat_ms: float = math.inf
) -> Plan | None:
    """The fastest plan that fits, over the shapes ``pipeline_shapes`` and v
    (``options.virtual_stages`` or the candidates), each simulated over one minibatch (a
    flush schedule repeats it). O(shapes * v * (layers + one simulation)).

    Candidates are simulated in the order of a lower bound of their period (``_fastest``);
    None when no bound is below ``beat_ms`` (another plan already wins).
    Raises a one-line ``InputError`` when no shape can run (too few devices or layers,
    or micro-batches that break Megatron's rule for every shape), ``InfeasibleError``
    naming the smallest memory that would fit when none fits.
    """
    kind = schedule_kind(options.schedule)
    model = cost_model(options.cost_model)
    arrays = layer_arrays(profile, model.charged_optimizer(options.optimizer))
    shapes = pipeline_shapes(topology.world_size, arrays.layers, options)
    if not shapes:
        raise InputError(
            f"{kind.name} needs at least 2 devices and 4 layers (got {topology.world_size} devices, "
            f"{arrays.layers} layers)"
        )
    wanted = options.virtual_stages
    candidates = (2,) if kind.v_shape else VIRTUAL_CANDIDATES
    smallest = math.inf
    memory = topology.device.memory_bytes
    refusals: list[str] = []
    fitting: list[Plan] = []
    if not kind.replica_pipelines:  # replicas sharing one order (zb-v): one device per position
        shapes = [(p, d) for p, d in shapes if d == 1]
    for positions, d in shapes:
        virtuals = [wanted] if wanted else [v for v in candidates if v * positions <= arrays.layers]
        if wanted and wanted * positions > arrays.layers:
            refusals.append(
                f"{wanted} chunks on {positions} devices need {wanted * positions} layers (got {arrays.layers})"
            )
            continue
        try:
            kind.check((d,) * positions, options.microbatches, max(virtuals))
        except InputError as exc:
            refusals.append(str(exc))
            continue
        for v in virtuals:
            plans, peak = _recompute_variants(profile, topology, options, arrays, positions, v, d)
            smallest = min(smallest, peak)
            fitting += plans
    if not fitting and not math.isfinite(smallest):
        raise InputError(refusals[0])
    if fitting:
        return _fastest(fitting, profile, beat_ms)
    raise InfeasibleError(
        f"no {kind.name} plan fits in {format_bytes(memory)} per device (positions x replicas "
        f"{', '.join(f'{p}x{d}' for p, d in shapes)}); the smallest needs {format_bytes(smallest)} "
        "(or more, where its weights and optimizer state alone overflow)"
    )


def recompute_modes(mode: str) -> tuple[str, ...]:
    """The plan-wide recomputation modes to try for ``options.recompute`` ``mode``: ``auto``
    none, selective and full (Megatron's flags are global); an explicit mode only itself."""
    return ("none", "selective", "full") if mode == "auto" else (mode,)


def _recompute_variants(
    profile: Profile,
    topology: Topology,
    options: PartitionOptions,
    arrays: LayerArrays,
    positions: int,
    virtual: int,
    replicas: int,
) -> tuple[list[Plan], float]:
    """(the plans of one shape that fit, one per recomputation mode of ``recompute_modes``,
    the least peak bytes per device among them). Not tried: a mode after one that fits
    without recomputation, and full after selective fits where selective recomputes less
    on every layer (``_selective_dominates``): the same chunks with no more extra forwards
    are never slower."""
    plans: list[Plan] = []
    smallest = math.inf
    for mode in recompute_modes(options.recompute):
        if (
            mode == "full"
            and plans
            and plans[-1].stages[0].selective_layers
            and _selective_dominates(profile)
        ):
            break
        plan, peak = interleaved_plan(
            profile, topology, options, arrays, positions, virtual, replicas=replicas, recompute=mode
        )
        smallest = min(smallest, peak)
        if plan is None:  # its weights alone overflow: so do every mode's
            break
        if not (options.memory_check and peak > topology.device.memory_bytes):
            plans.append(plan)
            if mode == "none":
                break
    return plans, smallest


def _selective_dominates(profile: Profile) -> bool:
    """Whether selective recomputation's extra ms is at most full's on every layer: each layer
    with an attention core that frees bytes is also recomputable, its core no slower than
    its forward. O(layers)."""
    gains, freed = gain_bytes(profile), selective_freed_bytes(profile)
    return all(
        freed[i] <= 0 or (gains[i] > 0 and layer.selective_recompute_ms <= layer.forward_ms)
        for i, layer in enumerate(profile.layers)
    )


def _fastest(plans: Sequence[Plan], profile: Profile, beat_ms: float = math.inf) -> Plan | None:
    """The fastest simulated of ``plans`` (ties to the earlier), simulated in the order of
    ``_work_bound_ms`` and no further than a bound above the best (or ``beat_ms``): None when
    every bound is above ``beat_ms``. A plan too large to simulate wins only when none simulates."""
    bounds = [_work_bound_ms(plan, profile) for plan in plans]
    best: tuple[float, int, Plan] | None = None
    unsimulated: Plan | None = None
    for k in sorted(range(len(plans)), key=lambda k: (bounds[k], k)):
        limit = min(beat_ms, best[0] if best is not None else math.inf)
        if bounds[k] > limit * (1 + 1e-9):
            break  # a period is never below its bound: no later plan can win
        try:
            plan = predict(plans[k], profile, steady=1)  # a flush repeats its minibatch
        except SimulationTooLarge:  # its bubble-free figure ranks with no simulated plan
            unsimulated = unsimulated or plans[k]
            continue
        time_ms = plan.predicted.time_per_minibatch_ms
        if (
            best is None
            or time_ms < best[0] * (1 - 1e-9)
            or (time_ms <= best[0] * (1 + 1e-9) and k < best[1])
        ):
            best = (time_ms, k, plan)
    if best is not None:
        return best[2]
    return unsimulated if bounds and min(bounds) <= beat_ms * (1 + 1e-9) else None


def _work_bound_ms(plan: Plan, profile: Profile) -> float:
    """A lower bound of ``plan``'s simulated period (ms per minibatch): the busiest device's
    forwards and backwards of one replica's M // d micro-batches, at the simulator's own
    per-micro-batch durations (``simulate.durations``). O(stages + layers)."""
    grouped, split = group_view(plan, profile)
    assert split is not None
    timing = durations(grouped, stage_costs(grouped, split), grouped.microbatches)
    positions = len(grouped.stages) // grouped.virtual_stages
    units = grouped.microbatches // grouped.stages[0].replicas
    return max(
        units
        * sum(timing.forward_ms[q] + timing.backward_ms[q] for q in range(i, len(grouped.stages), positions))
        for i in range(positions)
    )


def plan_interleaved_shape(
    profile: Profile, topology: Topology, options: PartitionOptions, positions: int
) -> Plan:
    """The plan of ``positions`` positions on every device (d = devices / p replicas each)
    and ``options.virtual_stages`` chunks per device, memory-checked and simulated: what
    pipeplan predicts for a configuration chosen elsewhere (Megatron's own t, p, d, v).
    ``InputError`` when the counts do not lay out; ``InfeasibleError`` when it does not fit."""
    kind = schedule_kind(options.schedule)
    virtual = options.virtual_stages or 2
    d, left = divmod(topology.world_size, positions)
    arrays = layer_arrays(profile, cost_model(options.cost_model).charged_optimizer(options.optimizer))
    if left or virtual * positions > arrays.layers:
        raise InputError(
            f"{positions} positions x {virtual} chunks on {topology.world_size} devices and "
            f"{arrays.layers} layers: the devices must split into whole positions, a layer per chunk"
        )
    kind.check((d,) * positions, options.microbatches, virtual)
    plans, peak = _recompute_variants(profile, topology, options, arrays, positions, virtual, d)
    fastest = _fastest(plans, profile)
    if fastest is None:
        raise InfeasibleError(
            f"{kind.name} on {positions} positions x {d} replicas x {virtual} chunks needs "
            f"{format_bytes(peak)} per device or more (has {format_bytes(topology.device.memory_bytes)})"
        )
    return fastest


def rechunk(
    plan: Plan, profile: Profile, schedule: str, virtual: int = 2, microbatches: int | None = None
) -> Plan:
    """``plan``'s devices running ``schedule`` (one of virtual stages): v * p balanced chunks, simulated.

    For comparing a one-chunk plan with interleaving on the same devices (``pipeplan
    simulate -s all``). Needs a straight plan (one device per stage): ``InputError`` else.
    """
    if any(stage.replicas != 1 for stage in plan.stages) or plan.virtual_stages != 1:
        raise InputError(
            "interleaving needs a straight plan of one chunk per device (partition with --straight)"
        )
    positions = len(plan.stages)
    micro = microbatches or positions * max(1, math.ceil(plan.microbatches / positions))
    options = PartitionOptions(
        schedule=schedule,
        cost_model=plan.cost_model,
        optimizer=plan.optimizer,
        microbatches=micro,
        virtual_stages=virtual,
        memory_check=False,  # a comparison on the same devices: its memory is reported, not checked
    )
    arrays = layer_arrays(profile, cost_model(plan.cost_model).charged_optimizer(plan.optimizer))
    schedule_kind(options.schedule).check((1,) * positions, micro, virtual)
    if virtual * positions > arrays.layers:
        raise InputError(
            f"{virtual} chunks on {positions} devices need {virtual * positions} layers (got {arrays.layers})"
        )
    chunked, _ = interleaved_plan(
        profile, plan.topology, options, arrays, positions, virtual, [stage.ranks[0] for stage in plan.stages]
    )
    assert chunked is not None  # only a memory check returns none
    return predict(chunked, profile)
