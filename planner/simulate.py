"""Discrete-event simulation of a plan running a schedule on its topology.

Every worker (position, replica) runs its ``pipeplan.schedules`` actions in order; the
timing rules (forwards wait for activations, backwards for gradients, "S" for every
replica; sends occupy links) and the sweep live in ``pipeplan.schedules.engine``. This module turns
a plan and a profile into per-stage durations and the engine's timeline into steady-state
figures: the pipeline period, each model stage's busy time and bubble, and peak memory.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipeplan.errors import InputError
from pipeplan.plan import Plan, StagePlan
from pipeplan.planner.cost_models import cost_model
from pipeplan.planner.costs import (
    ValueGraph,
    group_sum_ms,
    layer_compute_ms,
    on_gloo,
    stage_boundary_bytes,
    stage_deferred_bytes,
    update_ms,
)
from pipeplan.planner.memory import OPTIMIZER_STATES, backward_temporary_bytes
from pipeplan.planner.microbatch_time import BatchCurve, microbatch_share, stage_curve
from pipeplan.planner.recompute import gain_bytes, selective_freed_bytes
from pipeplan.planner.sharding import stage_shard_memory, stage_sync_ms
from pipeplan.planner.ties import tie_allreduce_ms
from pipeplan.profile import ASSUMED_INPUT_GRAD_SHARE, Profile
from pipeplan.schedules import Schedule, build_schedule, replica_lanes, schedule_kind, warmup_forwards
from pipeplan.schedules.engine import Durations, Timeline, collector_paused, run_schedule
from pipeplan.schedules.peak import chunk_weights, units_at_peak
from pipeplan.topology import Topology
from pipeplan.trace import TraceEvent

__all__ = [
    "OPTIMIZER_STATES",
    "StageCosts",
    "StageSim",
    "SimResult",
    "stage_costs",
    "stage_costs_from_plan",
    "input_grad_ms",
    "backward_split_note",
    "link_time_ms",
    "allreduce_ms",
    "default_minibatches",
    "simulate",
    "simulate_plan",
    "SimulationTooLarge",
]

MAX_UNITS = 2_000_000  # refuse to simulate more (minibatches x micro-batches x stages)


class SimulationTooLarge(InputError):
    """The plan needs more than ``MAX_UNITS`` simulated tasks."""


INPUT_GRAD_SHARE = ASSUMED_INPUT_GRAD_SHARE  # of a backward, an "I"'s part where not measured


@dataclass(frozen=True)
class StageCosts:
    """What one replica of a stage costs per whole minibatch (not per micro-batch)."""

    forward_ms: float
    backward_ms: float
    param_bytes: int
    saved_bytes: int  # activations autograd keeps for backward, one minibatch
    sends: tuple[tuple[int, int], ...]  # (consumer stage, bytes) of activations sent forward
    step_ms: float = 0.0  # the optimizer step after the gradient all-reduce
    allreduce_ms: float | None = None  # the replicas' all-reduce; None: ring formula on the gradient bytes
    tie_allreduce_ms: float = 0.0  # its parameters tied to other stages' all-reduce (planner.ties)
    largest_param_bytes: int = 0  # the stage's largest parameter (its gradient temporary; planner.memory)
    working_bytes: int = 0  # its hungriest layer's backward working memory, one minibatch (planner.memory)
    # activation recomputation (planner.recompute): saved bytes of the stage's largest
    # recomputable layer, one minibatch (re-materialised one micro-batch at a time); 0: none
    recompute_peak_bytes: int = 0
    # of backward_ms, the input gradients' part (a split backward's "I"; the rest is "W"):
    # the layers' measured parts (half for a layer not measured); None: INPUT_GRAD_SHARE of it
    backward_input_ms: float | None = None
    # forward / backward at measured batch sizes (planner.microbatch_time); None: proportional
    curve: BatchCurve | None = None
    # what a split backward's "I" keeps for its "W", one minibatch (costs.stage_deferred_bytes)
    deferred_bytes: int = 0


@dataclass(frozen=True)
class StageSim:
    """One stage's steady-state figures, averaged over its replicas (ms per minibatch)."""

    stage: int
    replicas: int
    busy_ms: float  # compute + all-reduce per pipeline period, per replica
    idle_ms: float  # period - the device's busy time (over all its chunks)
    bubble_fraction: float  # idle / period
    comm_ms: float  # busiest outgoing link's occupancy per minibatch of the pipeline
    memory_bytes: int  # peak per device: weights x versions, gradients, optimizer, activations
    in_flight: float  # peak minibatches' worth of saved activations


@dataclass(frozen=True)
class SimResult:
    schedule: str
    minibatches: int  # simulated
    microbatches: int
    batch_size: int
    time_per_minibatch_ms: float  # steady-state pipeline period
    makespan_ms: float  # end of the last task
    stages: tuple[StageSim, ...]
    memory_limit_bytes: int
    window: tuple[int, int]  # minibatch ids whose completions bound the steady-state window
    tasks: tuple[tuple[Any, ...], ...] = field(default=(), repr=False)  # raw, see events()
    virtual_stages: int = 1  # model stages q and q + p share the devices of position q % p

    @property
    def device_memory_bytes(self) -> tuple[int, ...]:
        """Peak bytes per device of each pipeline position: the sum over its model stages."""
        positions = len(self.stages) // self.virtual_stages
        return tuple(sum(stage.memory_bytes for stage in self.stages[i::positions]) for i in range(positions))

    @property
    def samples_per_s(self) -> float:
        return self.batch_size * 1000.0 / self.time_per_minibatch_ms

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.device_memory_bytes)

    @property
    def fits_memory(self) -> bool:
        return self.peak_memory_bytes <= self.memory_limit_bytes

    def events(self) -> list[TraceEvent]:
        """The task timeline (empty unless simulated with ``record=True``)."""
        out = []
        for rank, category, name, start, duration, k, m, s, r in self.tasks:
            out.append(TraceEvent(name, category, start, duration, rank, k, m, s, r))
        return out


# --------------------------------------------------------------------------- costs


def stage_costs(plan: Plan, profile: Profile) -> list[StageCosts]:
    """Per-stage compute, parameters, saved activations and cut bytes from the profile.

    A layer whose output feeds layers in later stages sends ``output_bytes`` once to
    each consuming stage (a skip connection goes straight to its consumer). O(layers +
    edges).
    """
    if plan.profile_fingerprint != profile.fingerprint:
        raise InputError(
            f"plan was made for profile {plan.profile_fingerprint[:12]} but the profile is "
            f"{profile.fingerprint[:12]} ({profile.model})"
        )
    stage_of = [-1] * len(profile.layers)
    for stage in plan.stages:
        for layer in stage.layers:
            stage_of[layer] = stage.index
    if -1 in stage_of:
        raise InputError(f"plan leaves layer {stage_of.index(-1)} of the profile in no stage")
    # every stage hands something to the next one along the layers (at least the order of the pipeline)
    order = list(plan.pipeline_order())
    cut: dict[tuple[int, int], int] = dict.fromkeys(zip(order, order[1:]), 0)
    sent: set[tuple[int, int]] = set()
    for consumer in profile.layers:
        for producer in consumer.inputs:
            key = (producer, stage_of[consumer.index])
            if stage_of[producer] != stage_of[consumer.index] and key not in sent:
                sent.add(key)
                edge = (stage_of[producer], stage_of[consumer.index])
                cut[edge] = cut.get(edge, 0) + profile.layers[producer].output_bytes
    charged = cost_model(plan.cost_model).charged_optimizer(plan.optimizer)
    update = update_ms(profile, charged)
    # the loss and the minibatch draw: charged here to the stage's forwards
    extra = [
        c - l.compute_ms - u for c, l, u in zip(layer_compute_ms(profile, charged), profile.layers, update)
    ]
    gains, freed = gain_bytes(profile), selective_freed_bytes(profile)
    ties = tie_allreduce_ms(plan, profile)
    values, packed_copy = ValueGraph.of(profile), on_gloo(plan.topology)
    out = []
    for stage in plan.stages:
        layers = [profile.layers[i] for i in stage.layers]
        recompute_ms, freed_bytes, peak_bytes = _recompute_costs(profile, stage, gains, freed)
        out.append(
            StageCosts(
                forward_ms=sum(layer.forward_ms for layer in layers) + sum(extra[i] for i in stage.layers),
                # the recomputed layers' forwards run again in backward (planner.recompute)
                backward_ms=sum(layer.backward_ms for layer in layers) + recompute_ms,
                param_bytes=sum(layer.param_bytes for layer in layers),
                saved_bytes=int(
                    sum(profile.charged_saved_bytes[i] for i in stage.layers)
                    - freed_bytes
                    + stage_boundary_bytes(values, stage.layers, packed_copy)
                ),
                sends=tuple(sorted((t, b) for (s, t), b in cut.items() if s == stage.index)),
                # offload's host-link copies and host step (planner.offload) beside the step
                step_ms=sum(update[i] for i in stage.layers) + stage.offload_ms,
                largest_param_bytes=max((layer.largest_tensor_bytes for layer in layers), default=0),
                working_bytes=max((profile.charged_working_bytes[i] for i in stage.layers), default=0),
                tie_allreduce_ms=ties[stage.index],
                recompute_peak_bytes=int(peak_bytes),
                backward_input_ms=sum(layer.input_grad_ms for layer in layers),
                curve=stage_curve(profile, stage.layers),
                deferred_bytes=int(
                    stage_deferred_bytes(
                        0 in stage.layers, float(sum(layer.charged_deferred_bytes for layer in layers))
                    )
                ),
            )
        )
    return out


def _recompute_costs(
    profile: Profile, stage: StagePlan, gains: Sequence[float], freed: Sequence[float]
) -> tuple[float, float, float]:
    """(extra backward ms, bytes freed per minibatch, transient peak bytes per minibatch) of
    the stage's recomputation (``planner.recompute``): its fully recomputed layers' forwards
    and largest saved bytes, or its selective layers' attention cores."""
    full = stage.recompute_layers
    selective = stage.selective_layers
    peak = max(
        [profile.layers[i].saved_bytes for i in stage.layers if full and gains[i] > 0]
        + [freed[i] for i in selective],
        default=0.0,
    )
    return (
        sum(profile.layers[i].forward_ms for i in full)
        + sum(max(0.0, profile.layers[i].selective_recompute_ms) for i in selective),
        sum(gains[i] for i in full) + sum(freed[i] for i in selective),
        float(peak),
    )


def stage_costs_from_plan(plan: Plan, forward_fraction: float = 1.0 / 3.0) -> list[StageCosts]:
    """Costs when no profile is at hand: the plan's per-stage figures.

    Splits ``compute_ms`` into forward : backward as ``forward_fraction`` (backward about
    twice the forward), and turns ``communication_ms`` (activations out + gradients
    back) into bytes at the bandwidth joining the stage to the next one along the layers; the all-reduce
    is the plan's ``allreduce_ms``. Parameters and activations are not in a plan, so
    memory is the plan's own prediction.
    """
    order = list(plan.pipeline_order())
    after = dict(zip(order, order[1:]))
    out = []
    for stage in plan.stages:
        sends: tuple[tuple[int, int], ...] = ()
        if stage.index in after:
            nxt = plan.stages[after[stage.index]]
            joining = plan.topology.level_joining(stage.ranks[0], nxt.ranks[0])
            size = 0
            if joining >= 0:
                level = plan.topology.levels[joining]
                one_way_ms = max(0.0, stage.communication_ms / 2.0 - level.latency_ms)
                size = int(one_way_ms * level.bandwidth_bytes_per_s / 1e3)
            sends = ((nxt.index, size),)
        out.append(
            StageCosts(
                forward_ms=stage.compute_ms * forward_fraction,
                backward_ms=stage.compute_ms * (1.0 - forward_fraction),
                param_bytes=0,
                saved_bytes=0,
                sends=sends,
                allreduce_ms=stage.allreduce_ms,
            )
        )
    return out


def link_time_ms(
    topology: Topology, rank_a: int, rank_b: int, size_bytes: float
) -> tuple[float, float, float]:
    """(occupancy, latency, each end's overhead) in ms of sending ``size_bytes`` from ``rank_a`` to ``rank_b``."""
    level = topology.level_joining(rank_a, rank_b)
    if level < 0:
        return 0.0, 0.0, 0.0
    spec = topology.levels[level]
    return size_bytes * 1e3 / spec.bandwidth_bytes_per_s, spec.latency_ms, spec.message_overhead_ms


allreduce_ms = group_sum_ms  # the replicas' gradient sum, as the simulator charges it


# --------------------------------------------------------------------------- simulation


def default_minibatches(
    schedule: str, stage_replicas: Sequence[int], steady: int = 8
) -> tuple[int, int, int]:
    """(total, warm-up, window) minibatches to simulate ``steady`` rounds of steady state.

    Stashed gradients (1f1b-rr): the warm-up and the drain each cover the in-flight
    minibatches of every worker, max_s n_s (W_s + 1), the window ``steady`` minibatches
    per replica of the most replicated stage; all rounded up to lcm(replicas). Flush
    schedules: one minibatch of warm-up, then ``steady`` in the window, and no drain: a
    worker's actions of minibatch k + 1 follow its "S" of k, and every forward of k + 1
    follows position 0's first, after its "S" of k (the window's end), so nothing after
    the window reaches back into it. Others (2bw): the minibatches in flight each side.
    """
    kind = schedule_kind(schedule)
    if kind.flushes:
        return steady + 1, 1, steady
    if kind.gradients != "stashed":
        warm = kind.minibatches_in_flight(stage_replicas)
        return 2 * warm + steady, warm, steady
    period = math.lcm(*stage_replicas)
    ahead = max(n * (warmup_forwards(stage_replicas, s) + 1) for s, n in enumerate(stage_replicas))
    warm = period * math.ceil(ahead / period)
    window = period * math.ceil(steady * max(stage_replicas) / period)
    return 2 * warm + window, warm, window


def plan_positions(plan: Plan) -> int:
    """Pipeline positions (device groups) of ``plan``: its model stages / virtual stages."""
    return len(plan.stages) // plan.virtual_stages


def simulation_shape(
    plan: Plan, schedule: str | None = None, microbatches: int | None = None
) -> tuple[str, int, int]:
    """(schedule, micro-batches, virtual stages) that simulating ``plan`` under ``schedule`` uses.

    The plan's own by default; micro-batches default to the plan's (1 for a schedule of
    whole minibatches). Raises a one-line ``InputError`` when the plan's chunks do not
    suit the schedule or the counts break its rules.
    """
    name = schedule or plan.schedule
    kind = schedule_kind(name)
    virtual = plan.virtual_stages
    if kind.virtual_stages != (virtual > 1):
        raise InputError(
            f"plan has {virtual} virtual stage(s) per device; schedule {name} "
            + (
                "needs at least 2 (partition with --schedule " + name + ")"
                if kind.virtual_stages
                else "runs one (partition again for it)"
            )
        )
    micro = 1 if kind.whole_minibatches else (microbatches or max(plan.microbatches, 1))
    replicas = tuple(stage.replicas for stage in plan.stages[: plan_positions(plan)])
    kind.check(replicas, micro, virtual)
    return name, micro, virtual


def input_grad_ms(costs: StageCosts) -> float:
    """A stage's input-gradient ms per minibatch ("I"; "W" is the rest of ``backward_ms``):
    its layers' measured parts, or ``INPUT_GRAD_SHARE`` of the backward without a profile.

    >>> input_grad_ms(StageCosts(1.0, 4.0, 0, 0, (), backward_input_ms=3.0)), input_grad_ms(StageCosts(1.0, 4.0, 0, 0, ()))
    (3.0, 2.0)
    """
    if costs.backward_input_ms is None:
        return costs.backward_ms * INPUT_GRAD_SHARE
    return min(costs.backward_input_ms, costs.backward_ms)


def _input_share(costs: StageCosts) -> float:
    """The input gradient's share of the stage's backward (``input_grad_ms``)."""
    return input_grad_ms(costs) / costs.backward_ms if costs.backward_ms > 0 else INPUT_GRAD_SHARE


def backward_split_note(profile: Profile | None) -> str:
    """One line saying where a split backward's "I" and "W" times come from, for the CLIs.

    >>> backward_split_note(None)
    'split backward: input / weight gradients assumed 50/50 of each backward (no profile)'
    """
    share = f"{INPUT_GRAD_SHARE * 100:.0f}/{(1 - INPUT_GRAD_SHARE) * 100:.0f}"
    if profile is None:
        return f"split backward: input / weight gradients assumed {share} of each backward (no profile)"
    timed = [layer for layer in profile.layers if layer.backward_ms > 0]
    missing = sum(layer.backward_input_ms is None for layer in timed)
    backward = sum(layer.backward_ms for layer in timed)
    inputs = sum(layer.input_grad_ms for layer in timed)
    whole = f"input gradients {inputs:.3f} ms of the backward's {backward:.3f} ms per minibatch"
    if missing == 0:
        how = "estimated from FLOPs" if profile.estimated else "measured"
        return f"split backward: {whole} ({how} per layer)"
    return (
        f"split backward: {whole}; ASSUMED {share} for {missing} of {len(timed)} layers "
        "(the profile did not measure them: profile again to measure the split)"
    )


def durations(plan: Plan, costs: Sequence[StageCosts], microbatches: int) -> Durations:
    """Per micro-batch durations of every model stage; I and W split B as ``input_grad_ms``.
    A micro-batch's compute is its share of the minibatch's (``planner.microbatch_time``:
    measured at its size where the profile has the times, else 1/M).
    The replicas all-reduce gradients in the plan's gradient dtype (``Precision.gradient_ratio``:
    float32 gradients of bf16 weights under mixed precision); stages sharing a tied parameter
    add its all-reduce (``planner.ties``)."""
    ranks = [stage.ranks for stage in plan.stages]
    ratio = plan.precision.gradient_ratio
    reduce = [
        (
            c.allreduce_ms
            if c.allreduce_ms is not None
            else allreduce_ms(plan.topology, ranks[q], c.param_bytes * ratio)
            if plan.stages[q].shard == "none"
            else stage_sync_ms(plan, q, c.param_bytes)
        )
        + c.tie_allreduce_ms
        for q, c in enumerate(costs)
    ]
    forward = [c.forward_ms * microbatch_share(c.curve, microbatches) for c in costs]
    backward = [c.backward_ms * microbatch_share(c.curve, microbatches, "backward") for c in costs]
    return Durations(
        forward_ms=tuple(forward),
        backward_ms=tuple(backward),
        backward_input_ms=tuple(b * _input_share(c) for b, c in zip(backward, costs)),
        backward_weight_ms=tuple(b * (1.0 - _input_share(c)) for b, c in zip(backward, costs)),
        allreduce_ms=tuple(reduce),
        step_ms=tuple(c.step_ms for c in costs),
        sends=tuple(tuple((t, b / microbatches) for t, b in c.sends) for c in costs),
    )


def simulate(
    plan: Plan,
    costs: Sequence[StageCosts],
    schedule: str | None = None,
    microbatches: int | None = None,
    steady: int = 8,
    record: bool = False,
) -> SimResult:
    """Simulate ``plan`` under ``schedule`` (default: the plan's) with per-stage ``costs``.

    Micro-batch schedules split each minibatch into ``microbatches`` (default: the
    plan's) of 1/M of the compute and bytes. Returns the steady-state period over
    ``steady`` rounds after the warm-up, the bubble fraction and peak memory per model
    stage; with ``record`` the task timeline too. Time O(stages x minibatches x
    micro-batches), plus the sends (``pipeplan.schedules.engine``).
    """
    name, micro, virtual = simulation_shape(plan, schedule, microbatches)
    if len(costs) != len(plan.stages):
        raise InputError(f"{len(costs)} stage costs for a plan of {len(plan.stages)} stages")
    positions = plan_positions(plan)
    replicas = tuple(stage.replicas for stage in plan.stages[:positions])
    total, warm, window = default_minibatches(name, replicas, steady)
    lanes = _lanes(name, replicas, micro, virtual, record)
    if total * (micro // lanes) * len(plan.stages) > MAX_UNITS:  # one lane's tasks (``_lanes``)
        raise SimulationTooLarge(
            f"simulating {name} on replicas {list(replicas)} needs {total} minibatches x "
            f"{micro // lanes} micro-batches x {len(plan.stages)} stages > {MAX_UNITS} tasks "
            f"(lcm of the replica counts is {math.lcm(*replicas)})"
        )
    shown = plan if lanes == 1 else _one_lane(plan)
    ranks = [stage.ranks for stage in shown.stages[:positions]]
    with collector_paused():  # until the timeline is dropped (see collector_paused)
        built = build_schedule(
            name, tuple(n // lanes for n in replicas), total, micro // lanes, virtual_stages=virtual
        )
        timeline = run_schedule(
            built,
            durations(plan, costs, micro),
            ranks,
            lambda a, b, size: link_time_ms(plan.topology, a, b, size),
            record,
        )
        done = timeline.completion
        first, last = warm - 1, warm - 1 + window
        period = (done[last] - done[first]) / window
        stages = _stage_figures(shown, costs, built, timeline, (done[first], done[last]), period)
        makespan, tasks = timeline.makespan, tuple(timeline.tasks)
        del built, timeline, done
    if lanes > 1:
        kind = schedule_kind(name)
        stages = [
            _all_lanes(
                sim,
                lanes,
                costs[sim.stage],
                plan,
                kind.weight_versions(replicas, sim.stage % positions),
                replicas[sim.stage % positions],
                _temporary_bytes(costs, sim.stage, positions, micro, plan),
            )
            for sim in stages
        ]
    return SimResult(
        schedule=name,
        minibatches=total,
        microbatches=micro,
        batch_size=plan.batch_size,
        time_per_minibatch_ms=period,
        makespan_ms=makespan,
        stages=tuple(stages),
        memory_limit_bytes=plan.topology.device.memory_bytes,
        window=(first, last),
        tasks=tasks,
        virtual_stages=virtual,
    )


def _lanes(name: str, replicas: tuple[int, ...], micro: int, virtual: int, record: bool) -> int:
    """d when a flush schedule runs d independent identical pipelines (``replica_lanes``: every stage on d
    replicas, M a multiple of d: replica r of every stage runs the micro-batches m = r mod
    d, and replicas meet only at the step), else 1. Simulating one of them with M / d
    micro-batches of the same durations gives the same period, busy times and memory in
    1/d of the work. Not when the timeline of every worker is recorded."""
    kind = schedule_kind(name)
    if record or (virtual != 1 and not kind.replica_pipelines) or not kind.flushes:
        return 1
    return replica_lanes(replicas, micro)


def _one_lane(plan: Plan) -> Plan:
    """``plan`` cut to replica 0 of every stage (its first rank), for ``_lanes``."""
    stages = tuple(
        replace(
            stage,
            replicas=1,
            ranks=stage.ranks[:1],
            tensor_parallel=1,
            shard="none",
            shard_degree=1,
            offload="none",
        )
        for stage in plan.stages
    )
    return replace(plan, stages=stages)


def _all_lanes(
    sim: StageSim,
    lanes: int,
    costs: StageCosts,
    plan: Plan,
    versions: int,
    replicas: int,
    temporary_bytes: float,
) -> StageSim:
    """A stage's figures from one lane (``_lanes``): the same busy time per replica; the
    micro-batches held at the peak, the same count, are 1/lanes as much of a minibatch."""
    in_flight = sim.in_flight / lanes
    memory = stage_shard_memory(
        plan,
        sim.stage,
        costs.param_bytes,
        costs.saved_bytes,
        versions,
        in_flight,
        temporary_bytes,
    )
    return replace(sim, replicas=replicas, in_flight=in_flight, memory_bytes=int(math.ceil(memory)))


def _temporary_bytes(
    costs: Sequence[StageCosts], q: int, positions: int, microbatches: int, plan: Plan
) -> float:
    """Model stage ``q``'s gradient temporary and backward working memory (``planner.memory``):
    a device's, charged to its first chunk."""
    if q >= positions:
        return 0.0
    largest = max(c.largest_param_bytes for c in costs[q::positions])
    working = max(c.working_bytes for c in costs[q::positions])
    recompute = max(c.recompute_peak_bytes for c in costs[q::positions]) / microbatches
    return float(backward_temporary_bytes(largest, working, microbatches, plan.precision)) + recompute


def simulate_plan(
    plan: Plan,
    profile: Profile | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    steady: int = 8,
    record: bool = False,
) -> SimResult:
    """``simulate`` with costs from ``profile`` (or from the plan's figures without one).

    A plan with tensor-parallel degree t > 1 is simulated on its group topology with
    the split profile (``planner.tp_pricing.group_view``): the timeline's workers
    are then tensor-parallel groups."""
    from pipeplan.planner.tp_pricing import group_view

    plan, profile = group_view(plan, profile)
    costs = stage_costs(plan, profile) if profile is not None else stage_costs_from_plan(plan)
    result = simulate(plan, costs, schedule, microbatches, steady, record)
    if profile is None:
        # a plan carries no parameter or activation sizes: keep its own memory figures
        stages = tuple(
            replace(sim, memory_bytes=stage.memory_bytes) for sim, stage in zip(result.stages, plan.stages)
        )
        result = replace(result, stages=stages)
    return result


def _stage_figures(
    plan: Plan,
    costs: Sequence[StageCosts],
    schedule: Schedule,
    timeline: Timeline,
    span: tuple[float, float],
    period: float,
) -> list[StageSim]:
    """Busy/idle/bubble of every model stage within the steady window; peak memory from the order.

    O(actions) for the memory peaks (vectorised), O(spans in the window + (q, r) log spans)
    for the busy times, O(links) for the communication.
    """
    t0, t1 = span
    minibatches = max((t1 - t0) / period, 1e-12) if period > 0 else 1.0
    positions = schedule.stages
    kind = schedule_kind(schedule.name)
    held = {
        (i, r): _held_at_peak(schedule, i, schedule.actions[(i, r)], costs)
        for i, n in enumerate(schedule.stage_replicas)
        for r in range(n)
    }
    inside = {key: _inside_ms(spans, t0, t1) for key, spans in timeline.busy.items()}
    device_busy_ms: dict[tuple[int, int], float] = {}
    for (q, r), parts in inside.items():
        key = (q % positions, r)
        device_busy_ms[key] = device_busy_ms.get(key, 0.0) + sum(parts) / minibatches
    busiest = _busiest_link_ms(timeline.link_busy)
    out = []
    for stage in plan.stages:
        q = stage.index
        i = q % positions
        busy_total = 0.0
        for r in range(stage.replicas):
            for part in inside.get((q, r), []):
                busy_total += part
        busy_ms = busy_total / stage.replicas / minibatches
        comm_ms = (
            max((busiest[rank] for rank in stage.ranks if rank in busiest), default=0.0)
            / schedule.minibatches
        )
        worst = max(range(stage.replicas), key=lambda r: held[(i, r)][0][q // positions])
        in_flight = held[(i, worst)][0][q // positions] / schedule.microbatches
        deferred = held[(i, worst)][1][q // positions] / schedule.microbatches
        versions = kind.weight_versions(schedule.stage_replicas, i)
        memory = stage_shard_memory(
            plan,
            q,
            costs[q].param_bytes,
            costs[q].saved_bytes,
            versions,
            in_flight,
            _temporary_bytes(costs, q, positions, schedule.microbatches, plan)
            + costs[q].deferred_bytes * deferred,
        )
        device_busy = sum(device_busy_ms.get((i, r), 0.0) for r in range(stage.replicas)) / stage.replicas
        idle = max(0.0, period - device_busy)  # the device's idle time: it runs all its chunks
        out.append(
            StageSim(
                stage=q,
                replicas=stage.replicas,
                busy_ms=busy_ms,
                idle_ms=idle,
                bubble_fraction=idle / period if period > 0 else 0.0,
                comm_ms=comm_ms,
                memory_bytes=int(math.ceil(memory)),
                in_flight=in_flight,
            )
        )
    return out


def _inside_ms(spans: Sequence[tuple[float, float]], t0: float, t1: float) -> list[float]:
    """Time (ms) each span spends inside [t0, t1], for the spans that overlap it, in order.

    The spans of one (model stage, replica) come from one worker in its order, so they
    are sorted and disjoint: two bisections find the overlapping run, and the spans left
    out would each add exactly 0.0. O(log spans + overlapping spans).

    >>> _inside_ms([(0.0, 1.0), (1.0, 2.5), (3.0, 4.0), (5.0, 6.0)], 2.0, 3.5)
    [0.5, 0.5]
    """
    lo = bisect_right(spans, t0, key=_span_end)  # first span ending after t0
    hi = bisect_left(spans, t1, lo=lo, key=_span_start)  # first span starting at or after t1
    return [max(0.0, min(end, t1) - max(start, t0)) for start, end in spans[lo:hi]]


def _span_start(span: tuple[float, float]) -> float:
    return span[0]


def _span_end(span: tuple[float, float]) -> float:
    return span[1]


def _busiest_link_ms(link_busy: dict[tuple[int, int], float]) -> dict[int, float]:
    """Occupancy (ms) of each sending rank's busiest outgoing link. O(links)."""
    busiest: dict[int, float] = {}
    for (src, _), occupied in link_busy.items():
        if src not in busiest or occupied > busiest[src]:
            busiest[src] = occupied
    return busiest


def _held_at_peak(
    schedule: Schedule, position: int, actions: Sequence[Any], costs: Sequence[StageCosts]
) -> tuple[list[int], list[int]]:
    """Units of each chunk a worker holds when its held bytes peak, and of those, the units
    between their "I" and "W" (a split backward): ``schedules.peak.units_at_peak``, the
    planner's rule, with a unit of chunk c weighing max(saved bytes of c, 1), and from its "I"
    to its "W" also the chunk's ``deferred_bytes``.

    >>> from pipeplan.schedules import Action
    >>> costs = [StageCosts(1.0, 2.0, 0, 8, ())]
    >>> _held_at_peak(build_schedule("gpipe", (1,), 1, 2), 0, [Action.parse(t) for t in "F0 F0.1 B0.1 B0".split()], costs)
    ([2], [0])
    """
    chunks = len(costs) // schedule.stages
    unit = [costs[c * schedule.stages + position] for c in range(chunks)]
    weights = chunk_weights([cost.saved_bytes for cost in unit], [cost.deferred_bytes for cost in unit])
    try:
        return units_at_peak(actions, chunks, weights)
    except InputError as exc:
        raise InputError(f"worker of position {position}: {exc}") from exc


# --------------------------------------------------------------------------- choice
