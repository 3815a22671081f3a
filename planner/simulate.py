"""Discrete-event simulation of a plan running a schedule on its topology.

Every worker (stage, replica) runs its ``pipeplan.schedule`` actions in order. A forward
starts when its worker is free and every input activation has arrived; a backward when
the gradients from every consuming stage have arrived; an "S" when all replicas of the
stage reach it (ring all-reduce, then the optimizer step). A send occupies the directed
link between the two ranks for ``bytes / bandwidth`` (messages on a link go in the
sender's order) and arrives ``latency`` later; sends do not block compute.

Because each worker's order is fixed, the timeline is the longest path through a DAG of
tasks: a worklist sweep (a blocked worker waits on the one key it needs and is woken
when that key completes) computes it in O(actions + sends), with no priority queue.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.planner.costs import layer_compute_ms, ring_allreduce_ms, update_ms
from pipeplan.planner.memory import OPTIMIZER_STATES, stage_memory_bytes
from pipeplan.plan import Plan
from pipeplan.profile import Profile
from pipeplan.schedule import Schedule, build_schedule, warmup_forwards, weight_versions
from pipeplan.topology import Topology
from pipeplan.trace import TraceEvent
from pipeplan.units import format_bytes

__all__ = [
    "OPTIMIZER_STATES",
    "StageCosts",
    "StageSim",
    "SimResult",
    "stage_costs",
    "stage_costs_from_plan",
    "link_time_ms",
    "allreduce_ms",
    "default_minibatches",
    "simulate",
    "simulate_plan",
    "choose_schedule",
]

SIMULATED = ("1f1b-rr", "1f1b-flush", "gpipe")  # the schedules this event sweep models

MAX_UNITS = 2_000_000  # refuse to simulate more (minibatches x micro-batches x stages)


@dataclass(frozen=True)
class StageCosts:
    """What one replica of a stage costs per whole minibatch (not per micro-batch)."""

    forward_ms: float
    backward_ms: float
    param_bytes: int
    saved_bytes: int  # activations autograd keeps for backward, one minibatch
    sends: tuple[tuple[int, int], ...]  # (consumer stage, bytes) of activations sent forward
    step_ms: float = 0.0  # the optimizer step after the gradient all-reduce


@dataclass(frozen=True)
class StageSim:
    """One stage's steady-state figures, averaged over its replicas (ms per minibatch)."""

    stage: int
    replicas: int
    busy_ms: float  # compute + all-reduce per pipeline period, per replica
    idle_ms: float  # period - busy
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

    @property
    def samples_per_s(self) -> float:
        return self.batch_size * 1000.0 / self.time_per_minibatch_ms

    @property
    def peak_memory_bytes(self) -> int:
        return max(stage.memory_bytes for stage in self.stages)

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
    # every stage hands something to the next one (at least the order of the pipeline)
    cut: dict[tuple[int, int], int] = {(s, s + 1): 0 for s in range(len(plan.stages) - 1)}
    sent: set[tuple[int, int]] = set()
    for layer in profile.layers:
        for producer in layer.inputs:
            key = (producer, stage_of[layer.index])
            if stage_of[producer] != stage_of[layer.index] and key not in sent:
                sent.add(key)
                edge = (stage_of[producer], stage_of[layer.index])
                cut[edge] = cut.get(edge, 0) + profile.layers[producer].output_bytes
    charged = plan.optimizer if plan.cost_model == "pipeplan" else None
    update = update_ms(profile, charged)
    # the loss and the minibatch draw: charged here to the stage's forwards
    extra = [c - l.compute_ms - u for c, l, u in zip(layer_compute_ms(profile, charged), profile.layers, update)]
    out = []
    for stage in plan.stages:
        layers = [profile.layers[i] for i in stage.layers]
        out.append(
            StageCosts(
                forward_ms=sum(layer.forward_ms for layer in layers) + sum(extra[i] for i in stage.layers),
                backward_ms=sum(layer.backward_ms for layer in layers),
                param_bytes=sum(layer.param_bytes for layer in layers),
                saved_bytes=sum(layer.saved_bytes for layer in layers),
                sends=tuple(sorted((t, b) for (s, t), b in cut.items() if s == stage.index)),
                step_ms=sum(update[i] for i in stage.layers),
            )
        )
    return out


def stage_costs_from_plan(plan: Plan, forward_fraction: float = 1.0 / 3.0) -> list[StageCosts]:
    """Costs when no profile is at hand: the plan's per-stage figures.

    Splits ``compute_ms`` into forward : backward as ``forward_fraction`` (backward about
    twice the forward), and turns ``communication_ms`` (activations out + gradients
    back) into bytes at the bandwidth joining the stage to the next one. Parameters and
    activations are not in a plan, so memory is the plan's own prediction.
    """
    out = []
    for stage in plan.stages:
        sends: tuple[tuple[int, int], ...] = ()
        if stage.index + 1 < len(plan.stages):
            nxt = plan.stages[stage.index + 1]
            level = plan.topology.levels[plan.topology.level_joining(stage.ranks[0], nxt.ranks[0])]
            one_way_ms = max(0.0, stage.communication_ms / 2.0 - level.latency_ms)
            sends = ((stage.index + 1, int(one_way_ms * level.bandwidth_bytes_per_s / 1e3)),)
        out.append(
            StageCosts(
                forward_ms=stage.compute_ms * forward_fraction,
                backward_ms=stage.compute_ms * (1.0 - forward_fraction),
                param_bytes=0,
                saved_bytes=0,
                sends=sends,
            )
        )
    return out


def link_time_ms(topology: Topology, rank_a: int, rank_b: int, size_bytes: float) -> tuple[float, float]:
    """(occupancy, latency) in ms of sending ``size_bytes`` from ``rank_a`` to ``rank_b``."""
    level = topology.level_joining(rank_a, rank_b)
    if level < 0:
        return 0.0, 0.0
    spec = topology.levels[level]
    return size_bytes * 1e3 / spec.bandwidth_bytes_per_s, spec.latency_ms


def allreduce_ms(topology: Topology, ranks: Sequence[int], param_bytes: float) -> float:
    """Ring all-reduce of ``param_bytes`` among ``ranks``: 2 (m-1)/m P / B + 2 (m-1) latency.

    B and the latency are those of the outermost level joining any two of the ranks.
    """
    m = len(ranks)
    if m < 2 or param_bytes <= 0:
        return 0.0
    level = max(topology.level_joining(ranks[0], other) for other in ranks[1:])
    spec = topology.levels[level]
    return float(ring_allreduce_ms(param_bytes, m, spec.bandwidth_bytes_per_s, spec.latency_ms))


# --------------------------------------------------------------------------- simulation


def default_minibatches(schedule: str, stage_replicas: Sequence[int], steady: int = 8) -> tuple[int, int, int]:
    """(total, warm-up, window) minibatches to simulate ``steady`` rounds of steady state.

    1f1b-rr: the warm-up and the drain each cover the in-flight minibatches of every
    worker, max_s n_s (W_s + 1), the window ``steady`` minibatches per replica of the most
    replicated stage; all rounded up to lcm(replicas). Flush schedules: one minibatch
    each side, ``steady`` in the window.
    """
    if schedule != "1f1b-rr":
        return steady + 2, 1, steady
    period = math.lcm(*stage_replicas)
    ahead = max(n * (warmup_forwards(stage_replicas, s) + 1) for s, n in enumerate(stage_replicas))
    warm = period * math.ceil(ahead / period)
    window = period * math.ceil(steady * max(stage_replicas) / period)
    return 2 * warm + window, warm, window


def simulate(
    plan: Plan,
    costs: Sequence[StageCosts],
    schedule: str | None = None,
    microbatches: int | None = None,
    steady: int = 8,
    record: bool = False,
) -> SimResult:
    """Simulate ``plan`` under ``schedule`` (default: the plan's) with per-stage ``costs``.

    Flush schedules split each minibatch into ``microbatches`` (default: the plan's, at
    least the stage count for a pipeline) of 1/M of the compute and bytes. Returns the
    steady-state period over ``steady`` rounds after the warm-up, the bubble fraction
    and peak memory per stage; with ``record`` the task timeline too.
    Time O(stages x minibatches x micro-batches), plus the sends.
    """
    name = schedule or plan.schedule
    if name not in SIMULATED:
        raise InputError(f"unknown schedule {name!r} (expected one of {', '.join(SIMULATED)})")
    if len(costs) != len(plan.stages):
        raise InputError(f"{len(costs)} stage costs for a plan of {len(plan.stages)} stages")
    replicas = tuple(stage.replicas for stage in plan.stages)
    micro = 1 if name == "1f1b-rr" else (microbatches or max(plan.microbatches, 1))
    total, warm, window = default_minibatches(name, replicas, steady)
    if total * micro * len(replicas) > MAX_UNITS:
        raise InputError(
            f"simulating {name} on replicas {list(replicas)} needs {total} minibatches x "
            f"{micro} micro-batches x {len(replicas)} stages > {MAX_UNITS} tasks "
            f"(lcm of the replica counts is {math.lcm(*replicas)})"
        )
    built = build_schedule(name, replicas, total, micro)
    timeline = _run(plan, costs, built, record)
    done = timeline["completion"]
    first, last = warm - 1, warm - 1 + window
    period = (done[last] - done[first]) / window
    stages = _stage_figures(plan, costs, built, timeline, (done[first], done[last]), period)
    return SimResult(
        schedule=name,
        minibatches=total,
        microbatches=micro,
        batch_size=plan.batch_size,
        time_per_minibatch_ms=period,
        makespan_ms=timeline["makespan"],
        stages=tuple(stages),
        memory_limit_bytes=plan.topology.device.memory_bytes,
        window=(first, last),
        tasks=tuple(timeline["tasks"]),
    )


def simulate_plan(
    plan: Plan,
    profile: Profile | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    steady: int = 8,
    record: bool = False,
) -> SimResult:
    """``simulate`` with costs from ``profile`` (or from the plan's figures without one)."""
    costs = stage_costs(plan, profile) if profile is not None else stage_costs_from_plan(plan)
    result = simulate(plan, costs, schedule, microbatches, steady, record)
    if profile is None:
        # a plan carries no parameter or activation sizes: keep its own memory figures
        stages = tuple(
            replace(sim, memory_bytes=stage.memory_bytes)
            for sim, stage in zip(result.stages, plan.stages)
        )
        result = replace(result, stages=stages)
    return result


def _run(plan: Plan, costs: Sequence[StageCosts], schedule: Schedule, record: bool) -> dict[str, Any]:
    """The worklist sweep: start/end of every task; completion time of every minibatch."""
    topology = plan.topology
    micro = schedule.microbatches
    replicas = schedule.stage_replicas
    ranks = [stage.ranks for stage in plan.stages]
    fwd = [c.forward_ms / micro for c in costs]
    bwd = [c.backward_ms / micro for c in costs]
    sends = [tuple((t, b / micro) for t, b in c.sends) for c in costs]
    producers: list[list[tuple[int, float]]] = [[] for _ in costs]
    for s, out in enumerate(sends):
        for t, size in out:
            producers[t].append((s, size))
    n_in = [len(p) for p in producers]
    n_out = [len(o) for o in sends]
    reduce_ms = [allreduce_ms(topology, ranks[s], costs[s].param_bytes) for s in range(len(costs))]
    step_ms = [cost.step_ms for cost in costs]
    link_cache: dict[tuple[int, int, float], tuple[float, float]] = {}

    def link(a: int, b: int, size: float) -> tuple[float, float]:
        key = (a, b, size)
        if key not in link_cache:
            link_cache[key] = link_time_ms(topology, a, b, size)
        return link_cache[key]

    arrive_f: dict[tuple[int, int], float] = {}  # (stage, unit) -> latest activation arrival
    count_f: dict[tuple[int, int], int] = defaultdict(int)
    arrive_b: dict[tuple[int, int], float] = {}  # (stage, unit) -> latest gradient arrival
    count_b: dict[tuple[int, int], int] = defaultdict(int)
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    link_busy: dict[tuple[int, int], float] = defaultdict(float)
    waiting: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    arrived: dict[tuple[int, int], list[float]] = {}
    steps_done: dict[tuple[int, int], int] = defaultdict(int)
    position = dict.fromkeys(schedule.actions, 0)
    free = dict.fromkeys(schedule.actions, 0.0)
    busy: dict[tuple[int, int], list[tuple[float, float]]] = {w: [] for w in schedule.actions}
    completion = [0.0] * schedule.minibatches
    tasks: list[tuple[Any, ...]] = []
    ready = list(schedule.actions)

    def send(src: int, dst: int, size: float, at: float, name: str, k: int, m: int, s: int, r: int) -> float:
        occupy, latency = link(src, dst, size)
        start = max(link_free[(src, dst)], at)
        link_free[(src, dst)] = start + occupy
        link_busy[(src, dst)] += occupy
        if record and occupy + latency > 0:
            tasks.append((src, "send", f"send {name} ->r{dst}", start, occupy + latency, k, m, s, r))
        return start + occupy + latency

    while ready:
        worker = ready.pop()
        s, r = worker
        rank = ranks[s][r]
        actions = schedule.actions[worker]
        while position[worker] < len(actions):
            action = actions[position[worker]]
            k, m = action.minibatch, action.microbatch
            unit = k * micro + m
            if action.kind == "S":
                group = (s, steps_done[worker])
                members = arrived.setdefault(group, [])
                members.append(free[worker])
                if len(members) < replicas[s]:
                    waiting.setdefault(("S", *group), []).append(worker)
                    break
                start = max(members)
                end = start + reduce_ms[s] + step_ms[s]
                for peer in [*waiting.pop(("S", *group), []), worker]:
                    step_of = schedule.actions[peer][position[peer]].minibatch  # this peer's own
                    if s == 0:
                        completion[step_of] = max(completion[step_of], end)
                    free[peer] = end
                    position[peer] += 1
                    steps_done[peer] += 1
                    if end > start:
                        busy[peer].append((start, end))
                    if record and reduce_ms[s] > 0:
                        tasks.append(
                            (ranks[s][peer[1]], "allreduce", f"allreduce S{step_of}", start, reduce_ms[s],
                             step_of, 0, s, peer[1])
                        )
                    if record and step_ms[s] > 0:
                        tasks.append(
                            (ranks[s][peer[1]], "step", f"S{step_of}", start + reduce_ms[s], step_ms[s],
                             step_of, 0, s, peer[1])
                        )
                    if peer != worker:
                        ready.append(peer)
                continue
            key = (s, unit)
            if action.kind == "F":
                if count_f[key] < n_in[s]:
                    waiting.setdefault(("F", s, unit), []).append(worker)
                    break
                start = max(free[worker], arrive_f.get(key, 0.0))
                end = start + fwd[s]
                for t, size in sends[s]:
                    dst = ranks[t][unit % replicas[t]]
                    at = send(rank, dst, size, end, str(action), k, m, s, r)
                    target = (t, unit)
                    arrive_f[target] = max(arrive_f.get(target, 0.0), at)
                    count_f[target] += 1
                    if count_f[target] == n_in[t]:
                        ready.extend(waiting.pop(("F", t, unit), []))
            else:
                if count_b[key] < n_out[s]:
                    waiting.setdefault(("B", s, unit), []).append(worker)
                    break
                start = max(free[worker], arrive_b.get(key, 0.0))
                end = start + bwd[s]
                for p, size in producers[s]:
                    dst = ranks[p][unit % replicas[p]]
                    at = send(rank, dst, size, end, str(action), k, m, s, r)
                    target = (p, unit)
                    arrive_b[target] = max(arrive_b.get(target, 0.0), at)
                    count_b[target] += 1
                    if count_b[target] == n_out[p]:
                        ready.extend(waiting.pop(("B", p, unit), []))
            free[worker] = end
            position[worker] += 1
            busy[worker].append((start, end))
            if record:
                category = "forward" if action.kind == "F" else "backward"
                tasks.append((rank, category, str(action), start, end - start, k, m, s, r))
    stuck = [w for w in schedule.actions if position[w] < len(schedule.actions[w])]
    if stuck:
        where = ", ".join(f"s{w[0]}r{w[1]} at {schedule.actions[w][position[w]]}" for w in stuck[:4])
        raise InfeasibleError(f"schedule {schedule.name} deadlocks in simulation: {where}")
    makespan = max([end for intervals in busy.values() for _, end in intervals[-1:]] + [0.0])
    makespan = max([makespan, *completion, *link_free.values()])
    return {
        "completion": completion,
        "busy": busy,
        "link_busy": link_busy,
        "makespan": makespan,
        "tasks": sorted(tasks, key=lambda t: (t[3], t[0])),
    }


def _stage_figures(
    plan: Plan,
    costs: Sequence[StageCosts],
    schedule: Schedule,
    timeline: dict[str, Any],
    span: tuple[float, float],
    period: float,
) -> list[StageSim]:
    """Busy/idle/bubble within the steady window; peak memory from the action order."""
    t0, t1 = span
    minibatches = max((t1 - t0) / period, 1e-12) if period > 0 else 1.0
    out = []
    for stage in plan.stages:
        s = stage.index
        busy_total = 0.0
        for r in range(stage.replicas):
            for start, end in timeline["busy"][(s, r)]:
                busy_total += max(0.0, min(end, t1) - max(start, t0))
        busy_ms = busy_total / stage.replicas / minibatches
        comm = [
            occupied
            for (src, _), occupied in timeline["link_busy"].items()
            if src in stage.ranks
        ]
        comm_ms = max(comm, default=0.0) / schedule.minibatches
        peak = max(_peak_outstanding(schedule.actions[(s, r)]) for r in range(stage.replicas))
        in_flight = peak / schedule.microbatches
        versions = weight_versions(schedule.name, schedule.stage_replicas, s)
        memory = stage_memory_bytes(costs[s].param_bytes, costs[s].saved_bytes, versions, in_flight, plan.optimizer)
        idle = max(0.0, period - busy_ms)
        out.append(
            StageSim(
                stage=s,
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


def _peak_outstanding(actions: Sequence[Any]) -> int:
    outstanding = peak = 0
    for action in actions:
        outstanding += (action.kind == "F") - (action.kind == "B")
        peak = max(peak, outstanding)
    return peak


# --------------------------------------------------------------------------- choice


def _candidates(options: Any, batch_size: int, world_size: int) -> list[tuple[str, int]]:
    """(schedule, micro-batches) pairs to try: flush schedules need M > 1 to pipeline at all.

    Unless the user fixed ``options.microbatches``, flush schedules try the powers of two
    M = 2, 4, ... that divide the batch, up to 4 micro-batches per device (at most 64).

    >>> from types import SimpleNamespace
    >>> _candidates(SimpleNamespace(microbatches=1), batch_size=24, world_size=2)
    [('1f1b-rr', 1), ('1f1b-flush', 2), ('1f1b-flush', 4), ('1f1b-flush', 8), ('gpipe', 2), ('gpipe', 4), ('gpipe', 8)]
    """
    if options.microbatches > 1:
        counts = [options.microbatches]
    else:
        limit = min(batch_size, 4 * world_size, 64)
        counts = [2**k for k in range(1, 7) if 2**k <= limit and batch_size % 2**k == 0] or [1]
    return [("1f1b-rr", 1)] + [(name, m) for name in SIMULATED if name != "1f1b-rr" for m in counts]


def choose_schedule(profile: Profile, topology: Topology, options: Any) -> tuple[str, int, str]:
    """(schedule, micro-batches, one-line reason): the best simulated throughput that fits.

    For each schedule, plans with ``pipeplan.planner.partition.partition`` (``options``
    with its ``schedule`` replaced), simulates the plan and drops those whose simulated
    peak memory exceeds the device's. Raises ``InfeasibleError`` when none fits.
    """
    from dataclasses import replace as replace_options

    from pipeplan.planner.partition import partition

    results: list[tuple[str, int, SimResult]] = []
    refused: list[str] = []
    for name, microbatches in _candidates(options, profile.batch_size, topology.world_size):
        label = name if microbatches == options.microbatches or name == "1f1b-rr" else f"{name} (M={microbatches})"
        try:
            plan = partition(
                profile, topology, replace_options(options, schedule=name, microbatches=microbatches)
            )
        except InfeasibleError as exc:
            refused.append(f"{label}: {exc}")
            continue
        result = simulate_plan(plan, profile)
        if result.fits_memory:
            results.append((label, microbatches, result))
        else:
            refused.append(
                f"{label}: needs {format_bytes(result.peak_memory_bytes)} > "
                f"{format_bytes(result.memory_limit_bytes)} per device"
            )
    if not results:
        raise InfeasibleError("no schedule fits memory (" + "; ".join(refused) + ")")
    results.sort(key=lambda item: item[2].time_per_minibatch_ms)
    label, microbatches, result = results[0]
    best = label.split(" ")[0]
    others = ", ".join(f"{n} {r.time_per_minibatch_ms:.3f} ms" for n, _, r in results[1:])
    reason = (
        f"{label} simulates {result.time_per_minibatch_ms:.3f} ms/minibatch "
        f"({result.samples_per_s:.1f} samples/s) in {format_bytes(result.peak_memory_bytes)} "
        f"of {format_bytes(result.memory_limit_bytes)} per device"
    )
    if others:
        reason += f"; vs {others}"
    if refused:
        reason += "; refused " + "; ".join(refused)
    return best, microbatches, reason
