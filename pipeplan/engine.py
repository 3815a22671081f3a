"""The event engine: start and end of every action of a schedule, given durations.

One sweep serves the simulator (``planner.simulate``), the planner's schedule choice, the
timelines and the schedules themselves: with unit durations (``unit_clock``) it is the
step clock of ``Schedule.steps()`` / ``grid()`` and the deadlock check of ``validate``.

Model. Worker ``(i, r)`` is replica r of pipeline position i (p positions). An action
with chunk c runs model stage ``q = c * p + i`` (``v`` chunks per worker, ``v * p``
model stages). Work unit ``u = minibatch * microbatches + microbatch`` runs on replica
``u % replicas[i]`` of position i. Each worker runs its actions in order:

- "F" (forward of q) starts when the worker is free and every activation from the
  producers of q has arrived; at its end q sends to each consumer.
- "B" (whole backward) and "I" (backward to the inputs only) start when the gradients
  from every consumer of q have arrived; at their end q sends gradients to its producers.
- "W" (weight gradients of an earlier "I") needs only its worker (the "I" ran before it
  on the same worker).
- "S" starts when every replica of the position reaches it and lasts the position's
  all-reduce + optimizer step; the minibatch completes when position 0 steps it.

A send occupies the directed link between the two ranks (messages in the sender's
order) and arrives ``latency`` later; sends do not block compute. Each worker's order is
fixed, so the timeline is the longest path through a DAG of tasks: a worklist sweep (a
blocked worker waits on the one key it needs and is woken when that key completes)
computes it in O(actions + sends), with no priority queue.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pipeplan.errors import InputError

if TYPE_CHECKING:  # pipeplan.schedule calls this engine for its own clock
    from pipeplan.schedule import Action, Schedule

__all__ = ["Durations", "Timeline", "LinkTime", "model_stage", "run_schedule", "unit_clock"]

Worker = tuple[int, int]  # (pipeline position, replica)
LinkTime = Callable[[int, int, float], tuple[float, float]]  # (src rank, dst rank, bytes) -> (occupy, latency) ms


@dataclass(frozen=True)
class Durations:
    """What each action takes, per micro-batch; indexed by model stage q (S: by position).

    ``backward_ms`` is the whole "B"; an "I" takes ``backward_input_ms`` and a "W"
    ``backward_weight_ms``. ``sends[q]`` lists (consumer model stage, bytes per
    micro-batch) of the activations q sends forward; the gradients go back the same way.
    ``allreduce_ms[q]`` and ``step_ms[q]`` are model stage q's share of the "S" of its
    position (its own parameters' all-reduce, then its optimizer step).
    """

    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    backward_input_ms: tuple[float, ...]
    backward_weight_ms: tuple[float, ...]
    allreduce_ms: tuple[float, ...]
    step_ms: tuple[float, ...]
    sends: tuple[tuple[tuple[int, float], ...], ...]

    def __post_init__(self) -> None:
        count = len(self.forward_ms)
        sizes = [len(self.backward_ms), len(self.backward_input_ms), len(self.backward_weight_ms),
                 len(self.allreduce_ms), len(self.step_ms), len(self.sends)]
        if any(n != count for n in sizes):
            raise InputError(f"durations of {count} model stages have fields of lengths {sizes}")


@dataclass
class Timeline:
    """The engine's answer (ms). ``busy`` per (model stage, replica); ``steps`` per worker."""

    starts: dict[Worker, list[float]]  # start of each action of the worker, in its order
    ends: dict[Worker, list[float]]
    completion: list[float]  # end of position 0's "S" of every minibatch
    busy: dict[tuple[int, int], list[tuple[float, float]]]  # (q, replica) -> compute and S share
    link_busy: dict[tuple[int, int], float]  # (src rank, dst rank) -> occupied ms
    makespan: float
    tasks: list[tuple[Any, ...]] = field(default_factory=list)  # (rank, category, name, start, dur, k, m, q, r)


def model_stage(schedule: Schedule, position: int, action: Action) -> int:
    """Model stage an action of pipeline ``position`` runs: chunk * positions + position."""
    return action.chunk * schedule.stages + position


def run_schedule(
    schedule: Schedule,
    durations: Durations,
    ranks: Sequence[Sequence[int]],
    link: LinkTime,
    record: bool = False,
) -> Timeline:
    """Start/end of every action of ``schedule``; ``ranks[i][r]`` is worker (i, r)'s rank.

    Raises ``InputError`` when the order deadlocks. Time O(actions + sends).
    """
    positions = schedule.stages
    stages = schedule.model_stages
    if len(durations.forward_ms) != stages:
        raise InputError(
            f"durations for {len(durations.forward_ms)} model stages, schedule {schedule.name} has "
            f"{positions} positions x {schedule.virtual_stages} virtual stages"
        )
    micro = schedule.microbatches
    replicas = schedule.stage_replicas
    producers: list[list[tuple[int, float]]] = [[] for _ in range(stages)]
    for q, out in enumerate(durations.sends):
        for t, size in out:
            producers[t].append((q, size))
    n_in = [len(p) for p in producers]
    n_out = [len(o) for o in durations.sends]
    s_ms = [0.0] * positions
    for q in range(stages):
        s_ms[q % positions] += durations.allreduce_ms[q] + durations.step_ms[q]
    link_cache: dict[tuple[int, int, float], tuple[float, float]] = {}

    arrive: dict[tuple[str, int, int], float] = {}  # ("F"|"B", q, unit) -> latest arrival
    count: dict[tuple[str, int, int], int] = defaultdict(int)
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    link_busy: dict[tuple[int, int], float] = defaultdict(float)
    waiting: dict[tuple[Any, ...], list[Worker]] = {}
    arrived: dict[tuple[int, int], list[float]] = {}
    steps_done: dict[Worker, int] = defaultdict(int)
    position = dict.fromkeys(schedule.actions, 0)
    free = dict.fromkeys(schedule.actions, 0.0)
    starts: dict[Worker, list[float]] = {w: [] for w in schedule.actions}
    ends: dict[Worker, list[float]] = {w: [] for w in schedule.actions}
    busy: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    completion = [0.0] * schedule.minibatches
    tasks: list[tuple[Any, ...]] = []
    ready = list(schedule.actions)

    def send(src: int, dst: int, size: float, at: float, label: str, k: int, m: int, q: int, r: int) -> float:
        key = (src, dst, size)
        if key not in link_cache:
            link_cache[key] = link(src, dst, size)
        occupy, latency = link_cache[key]
        start = max(link_free[(src, dst)], at)
        link_free[(src, dst)] = start + occupy
        link_busy[(src, dst)] += occupy
        if record and occupy + latency > 0:
            tasks.append((src, "send", f"send {label} ->r{dst}", start, occupy + latency, k, m, q, r))
        return start + occupy + latency

    def deliver(kind: str, targets: Sequence[tuple[int, float]], needed: Sequence[int], rank: int,
                end: float, label: str, k: int, m: int, q: int, r: int) -> None:
        unit = k * micro + m
        for t, size in targets:
            i = t % positions
            dst = ranks[i][unit % replicas[i]]
            at = send(rank, dst, size, end, label, k, m, q, r)
            key = (kind, t, unit)
            arrive[key] = max(arrive.get(key, 0.0), at)
            count[key] += 1
            if count[key] == needed[t]:
                ready.extend(waiting.pop(key, []))

    def finish(worker: Worker, start: float, end: float) -> None:
        starts[worker].append(start)
        ends[worker].append(end)
        free[worker] = end
        position[worker] += 1

    while ready:
        worker = ready.pop()
        i, r = worker
        rank = ranks[i][r]
        actions = schedule.actions[worker]
        while position[worker] < len(actions):
            action = actions[position[worker]]
            k, m = action.minibatch, action.microbatch
            if action.kind == "S":
                group = (i, steps_done[worker])
                members = arrived.setdefault(group, [])
                members.append(free[worker])
                if len(members) < replicas[i]:
                    waiting.setdefault(("S", *group), []).append(worker)
                    break
                start = max(members)
                end = start + s_ms[i]
                for peer in [*waiting.pop(("S", *group), []), worker]:
                    own = schedule.actions[peer][position[peer]].minibatch
                    if i == 0:
                        completion[own] = max(completion[own], end)
                    finish(peer, start, end)
                    steps_done[peer] += 1
                    at = start
                    for q in range(i, stages, positions):  # each model stage's share, in order
                        share = durations.allreduce_ms[q] + durations.step_ms[q]
                        if share > 0:
                            busy[(q, peer[1])].append((at, at + share))
                        if record and durations.allreduce_ms[q] > 0:
                            tasks.append((ranks[i][peer[1]], "allreduce", f"allreduce S{own}", at,
                                          durations.allreduce_ms[q], own, 0, q, peer[1]))
                        if record and durations.step_ms[q] > 0:
                            tasks.append((ranks[i][peer[1]], "step", f"S{own}", at + durations.allreduce_ms[q],
                                          durations.step_ms[q], own, 0, q, peer[1]))
                        at += share
                    if peer != worker:
                        ready.append(peer)
                continue
            q = model_stage(schedule, i, action)
            unit = k * micro + m
            if action.kind == "F":
                key = ("F", q, unit)
                if count[key] < n_in[q]:
                    waiting.setdefault(key, []).append(worker)
                    break
                start = max(free[worker], arrive.get(key, 0.0))
                end = start + durations.forward_ms[q]
                deliver("F", durations.sends[q], n_in, rank, end, str(action), k, m, q, r)
            elif action.kind in ("B", "I"):
                key = ("B", q, unit)
                if count[key] < n_out[q]:
                    waiting.setdefault(key, []).append(worker)
                    break
                start = max(free[worker], arrive.get(key, 0.0))
                took = durations.backward_ms[q] if action.kind == "B" else durations.backward_input_ms[q]
                end = start + took
                deliver("B", producers[q], n_out, rank, end, str(action), k, m, q, r)
            elif action.kind == "W":
                start = free[worker]
                end = start + durations.backward_weight_ms[q]
            else:
                raise InputError(f"worker s{i}r{r}: unknown action kind {action.kind!r} in {action}")
            finish(worker, start, end)
            if end > start:
                busy[(q, r)].append((start, end))
            if record:
                category = "forward" if action.kind == "F" else "backward"
                tasks.append((rank, category, str(action), start, end - start, k, m, q, r))
    stuck = [w for w in schedule.actions if position[w] < len(schedule.actions[w])]
    if stuck:
        where = ", ".join(f"s{w[0]}r{w[1]} at {schedule.actions[w][position[w]]}" for w in stuck[:4])
        raise InputError(f"schedule {schedule.name} deadlocks: {where}")
    makespan = max([e[-1] for e in ends.values() if e] + completion + list(link_free.values()) + [0.0])
    return Timeline(starts, ends, completion, dict(busy), dict(link_busy), makespan,
                    sorted(tasks, key=lambda t: (t[3], t[0])))


def unit_clock(schedule: Schedule) -> dict[Worker, tuple[int, ...]]:
    """Start step of every action with F, B, I and W one step each and S none.

    Model stage q hands to q + 1 only, with free sends: the step clock of
    ``Schedule.grid()``. Raises ``InputError`` when the order deadlocks.

    >>> from pipeplan.schedule import build_schedule
    >>> clock = unit_clock(build_schedule("1f1b-flush", (1, 1), 1, 2))
    >>> clock[(0, 0)], clock[(1, 0)]
    ((0, 1, 3, 5, 6), (1, 2, 3, 4, 5))
    """
    stages = schedule.model_stages
    one = (1.0,) * stages
    zero = (0.0,) * stages
    chain = tuple(((q + 1, 0.0),) if q + 1 < stages else () for q in range(stages))
    durations = Durations(one, one, one, one, zero, zero, chain)
    first = [sum(schedule.stage_replicas[:i]) for i in range(schedule.stages)]
    ranks = [[first[i] + r for r in range(n)] for i, n in enumerate(schedule.stage_replicas)]
    timeline = run_schedule(schedule, durations, ranks, lambda a, b, size: (0.0, 0.0))
    return {w: tuple(int(round(t)) for t in times) for w, times in timeline.starts.items()}
