"""The event engine: start and end of every action of a schedule, given durations.

One sweep serves the simulator (``planner.simulate``), the planner's schedule choice, the
timelines and the schedules themselves: with unit durations (``unit_clock``) it is the
step clock of ``grid`` and the deadlock check of ``validate``.

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
order) and arrives ``latency`` later. Each end of a message also spends the link's
overhead of its own worker's time (posting, waking, copying on cores the compute shares;
0 where a separate engine moves the bytes): the sender after the action that sends, the
receiver before the action that consumes it, once the message has arrived. A recorded
timeline shows them as "send" ("post F0.1") and "recv" tasks; they are not busy time.

Each worker's order is fixed, so the timeline is the longest path through a DAG of tasks:
a worklist sweep (a blocked worker waits on the one key it needs and is woken when that
key completes) computes it in O(actions + sends), with no priority queue.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pipeplan.errors import InputError
from pipeplan.schedules.actions import Action, Schedule

__all__ = [
    "Durations",
    "Timeline",
    "LinkTime",
    "collector_paused",
    "model_stage",
    "run_schedule",
    "unit_clock",
]

Worker = tuple[int, int]  # (pipeline position, replica)
LinkTime = Callable[
    [int, int, float], tuple[float, float, float]
]  # (src rank, dst rank, bytes) -> (occupy, latency, overhead at each end) ms


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
        sizes = [
            len(self.backward_ms),
            len(self.backward_input_ms),
            len(self.backward_weight_ms),
            len(self.allreduce_ms),
            len(self.step_ms),
            len(self.sends),
        ]
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
    tasks: list[tuple[Any, ...]] = field(
        default_factory=list
    )  # (rank, category, name, start, dur, k, m, q, r)


def action_ids(action: Action) -> tuple[int, int]:
    """(minibatch, micro-batch) of ``action``: a task's ids."""
    return action.minibatch, action.microbatch


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

    Actions must name minibatches in ``range(schedule.minibatches)`` and micro-batches
    in ``range(schedule.microbatches)``, as ``build_schedule`` makes them and ``validate``
    checks (arrivals are kept in flat arrays over those work units). Raises
    ``InputError`` when the order deadlocks. Time O(actions + sends), space O(model
    stages x work units).
    """
    if len(durations.forward_ms) != schedule.model_stages:
        raise InputError(
            f"durations for {len(durations.forward_ms)} model stages, schedule {schedule.name} has "
            f"{schedule.stages} positions x {schedule.virtual_stages} virtual stages"
        )
    with collector_paused():
        sweep = _Sweep(schedule, durations, ranks, link, record)
        sweep.run()
        return sweep.timeline()


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector inside the block; restore it after.

    The sweep makes millions of lasting objects (spans, times) and no reference cycles;
    each full collection would walk the whole growing timeline again (4 of 14 s for 185
    stages x 8,400 minibatches), and so would the first one after the pause if the
    timeline were still alive: a caller that drops the timeline (``planner.simulate``)
    keeps the pause until then. Reference counting frees everything as usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Link:
    """A directed link between two ranks: when it is next free and how long it was occupied (ms)."""

    __slots__ = ("free", "busy")

    def __init__(self) -> None:
        self.free = 0.0
        self.busy = 0.0


Slot = tuple[float, float, float, _Link]  # (occupy, latency, overhead ms, link) of one (message size, link)
# One destination of a worker's sends from one chunk: (replicas of the destination position,
# slots by destination replica (made at the first send), the destination's first arrival key,
# messages the destination waits for, the destination position's ranks, bytes per message)
Edge = tuple[int, dict[int, Slot], int, int, Sequence[int], float]
# One worker, as the sweep binds it at each switch: (position, replica, rank, actions, their
# count, append to its starts, append to its ends, its spans by chunk, its forward and its
# backward send edges by chunk)
Context = tuple[
    int,
    int,
    int,
    "Sequence[Action]",
    int,
    Callable[[float], None],
    Callable[[float], None],
    list[list[tuple[float, float]]],
    list[list[Edge]],
    list[list[Edge]],
]


class _Sweep:
    """The worklist sweep of ``run_schedule``, on integer-indexed state.

    Workers are numbered in ``schedule.actions`` order. The key of the activations
    (gradients) model stage q awaits for work unit u is ``q * units + u`` (``(stages + q)
    * units + u``); ``arrive`` and ``count`` are flat lists over those keys. A blocked
    worker waits on one key and is woken, in the order it blocked, when the key's last
    message is counted; the ready list is a stack. Every figure is computed with the
    same operations in the same order as the rules in the module docstring state, so the
    timeline is exactly that of a sweep over tuple-keyed dicts.
    """

    def __init__(
        self,
        schedule: Schedule,
        durations: Durations,
        ranks: Sequence[Sequence[int]],
        link: LinkTime,
        record: bool,
    ) -> None:
        self.schedule = schedule
        self.durations = durations
        self.link = link
        self.record = record
        positions = schedule.stages
        stages = schedule.model_stages
        self.units = schedule.minibatches * schedule.microbatches
        self.workers: list[Worker] = list(schedule.actions)
        self.rank_of = [ranks[i][r] for i, r in self.workers]
        self.ranks = ranks
        producers: list[list[tuple[int, float]]] = [[] for _ in range(stages)]
        for q, out in enumerate(durations.sends):
            for t, size in out:
                producers[t].append((q, size))
        self.producers = producers
        self.n_in = [len(p) for p in producers]
        self.n_out = [len(o) for o in durations.sends]
        self.s_ms = [0.0] * positions
        for q in range(stages):
            self.s_ms[q % positions] += durations.allreduce_ms[q] + durations.step_ms[q]
        self.link_cache: dict[tuple[int, int, float], tuple[float, float, float]] = {}
        self.links: dict[tuple[int, int], _Link] = {}  # in the order of their first send
        self.arrive = [0.0] * (2 * stages * self.units)
        self.count = [0] * (2 * stages * self.units)
        self.overhead = [0.0] * (2 * stages * self.units)  # the receiver's ms for the key's messages
        self.position = [0] * len(self.workers)
        self.free = [0.0] * len(self.workers)
        self.starts: list[list[float]] = [[] for _ in self.workers]
        self.ends: list[list[float]] = [[] for _ in self.workers]
        self.busy: dict[tuple[int, int], list[tuple[float, float]]] = {}  # in the order of their first span
        # spans[worker][chunk] is busy[(model stage, replica)], entered in busy at its first span
        self.spans: list[list[list[tuple[float, float]]]] = [
            [[] for _ in range(schedule.virtual_stages)] for _ in self.workers
        ]
        self.completion = [0.0] * schedule.minibatches
        self.tasks: list[tuple[Any, ...]] = []
        self.step_shares = [self.shares(i) for i in range(positions)]

    # ------------------------------------------------------------ tables
    def edges(self, worker: int, chunk: int, backward: bool) -> list[Edge]:
        """Destinations of worker's sends from ``chunk``: consumers (forward) or producers. O(sends of q)."""
        schedule = self.schedule
        positions, stages = schedule.stages, schedule.model_stages
        q = chunk * positions + self.workers[worker][0]
        targets = self.producers[q] if backward else self.durations.sends[q]
        needed = self.n_out if backward else self.n_in
        offset = stages if backward else 0
        out: list[Edge] = []
        for t, size in targets:
            i = t % positions
            out.append(
                (schedule.stage_replicas[i], {}, (offset + t) * self.units, needed[t], self.ranks[i], size)
            )
        return out

    def slot(self, src: int, edge: Edge, replica: int) -> Slot:
        """Make edge's slot of ``replica``: ``link`` called once per (src, dst, bytes). O(1)."""
        _, slots, _, _, ranks, size = edge
        dst = ranks[replica]
        key = (src, dst, size)
        if key not in self.link_cache:
            self.link_cache[key] = self.link(src, dst, size)
        occupy, latency, overhead = self.link_cache[key]
        pair = self.links.get((src, dst))
        if pair is None:
            pair = self.links[(src, dst)] = _Link()
        made = slots[replica] = (occupy, latency, overhead, pair)
        return made

    def shares(self, position: int) -> list[tuple[int, float, float, float]]:
        """(chunk, S share, all-reduce ms, step ms) of each model stage of ``position``, in order."""
        d = self.durations
        return [
            (q // self.schedule.stages, d.allreduce_ms[q] + d.step_ms[q], d.allreduce_ms[q], d.step_ms[q])
            for q in range(position, self.schedule.model_stages, self.schedule.stages)
        ]

    def step_spans(self, position: int, start: float) -> list[tuple[int, tuple[float, float]]]:
        """(chunk, busy span) of each model stage of ``position`` whose "S" share takes time,
        for an "S" starting at ``start``: the shares run back to back in model-stage order. O(chunks)."""
        out = []
        at = start
        for chunk, share, _, _ in self.step_shares[position]:
            if share > 0:
                out.append((chunk, (at, at + share)))
            at += share
        return out

    def record_step(self, worker: int, minibatch: int, start: float) -> None:
        """Record the all-reduce and optimizer step tasks (those that take time) of one "S" of ``worker``."""
        i, replica = self.workers[worker]
        rank = self.rank_of[worker]
        at = start
        for chunk, share, reduce_ms, step_ms in self.step_shares[i]:
            q = chunk * self.schedule.stages + i
            if reduce_ms > 0:
                self.tasks.append(
                    (rank, "allreduce", f"allreduce S{minibatch}", at, reduce_ms, minibatch, 0, q, replica)
                )
            if step_ms > 0:
                self.tasks.append(
                    (rank, "step", f"S{minibatch}", at + reduce_ms, step_ms, minibatch, 0, q, replica)
                )
            at += share

    def context(self, worker: int) -> Context:
        """What the sweep binds when it switches to ``worker`` (see ``Context``). O(sends of its stages)."""
        i, r = self.workers[worker]
        actions = self.schedule.actions[(i, r)]
        chunks = range(self.schedule.virtual_stages)
        return (
            i,
            r,
            self.rank_of[worker],
            actions,
            len(actions),
            self.starts[worker].append,
            self.ends[worker].append,
            self.spans[worker],
            [self.edges(worker, c, False) for c in chunks],
            [self.edges(worker, c, True) for c in chunks],
        )

    # ------------------------------------------------------------ sweep
    def run(self) -> None:
        """Run every worker as far as it can until none is ready. O(actions + sends).

        One loop over the actions with its state in locals and the sends and "S" inlined:
        a function call per action or message would cost as much as its arithmetic
        (~5 M actions and ~3 M messages for 185 stages x 8,400 minibatches).
        """
        schedule, record, tasks = self.schedule, self.record, self.tasks
        positions, stages, micro, units = (
            schedule.stages,
            schedule.model_stages,
            schedule.microbatches,
            self.units,
        )
        replicas = schedule.stage_replicas
        d = self.durations
        forward_ms, backward_ms = d.forward_ms, d.backward_ms
        input_ms, weight_ms = d.backward_input_ms, d.backward_weight_ms
        n_in, n_out = self.n_in, self.n_out
        arrive, count, overhead_of, busy = self.arrive, self.count, self.overhead, self.busy
        position, free = self.position, self.free
        starts, ends, spans_of, completion = self.starts, self.ends, self.spans, self.completion
        workers, s_ms = self.workers, self.s_ms
        all_actions = [schedule.actions[w] for w in workers]
        contexts = [self.context(w) for w in range(len(workers))]
        waiting: dict[int, list[int]] = {}  # arrival key -> blocked workers, in the order they blocked
        steps_done = [0] * len(workers)
        group_stride = 1 + max(context[4] for context in contexts)  # "S" group key: position * stride + step
        stepping: dict[int, list[int]] = {}  # group -> replicas waiting in that "S", in the order they came
        ready = list(range(len(workers)))
        while ready:
            w = ready.pop()
            pos, at_free = position[w], free[w]
            i, r, rank, actions, n_actions, start_of, end_of, w_spans, w_forward, w_backward = contexts[w]
            n_replicas = replicas[i]
            while pos < n_actions:
                action = actions[pos]
                kind = action.kind
                if kind == "S":
                    if n_replicas == 1:
                        start, peers = at_free, [w]
                    else:
                        group = i * group_stride + steps_done[w]
                        came = stepping.get(group)
                        if came is None:
                            came = stepping[group] = []
                        peers = came
                        if len(peers) + 1 < n_replicas:
                            peers.append(w)
                            break
                        del stepping[group]
                        start = max(map(free.__getitem__, peers), default=at_free)  # the last to come
                        if at_free > start:
                            start = at_free
                        peers.append(w)
                    end = start + s_ms[i]
                    step_spans = self.step_spans(i, start)  # one tuple per share, shared by the replicas
                    for peer in peers:  # the waiting replicas in the order they came, then this one
                        if i == 0 or record:
                            own = all_actions[peer][pos if peer == w else position[peer]].minibatch
                            if i == 0 and end > completion[own]:
                                completion[own] = end
                        starts[peer].append(start)
                        ends[peer].append(end)
                        steps_done[peer] += 1
                        for chunk, span in step_spans:
                            spans = spans_of[peer][chunk]
                            if not spans:
                                busy[(chunk * positions + i, workers[peer][1])] = spans
                            spans.append(span)
                        if record:
                            self.record_step(peer, own, start)
                        if peer != w:
                            position[peer] += 1
                            free[peer] = end
                            ready.append(peer)
                    pos += 1
                    at_free = end
                    continue
                chunk = action.chunk
                q = chunk * positions + i
                unit = action.minibatch * micro + action.microbatch
                if kind == "W":
                    start = at_free
                    end = start + weight_ms[q]
                    edges = []
                else:
                    if kind == "F":
                        key, awaited = q * units + unit, n_in[q]
                        took, edges = forward_ms[q], w_forward[chunk]
                    elif kind == "B" or kind == "I":
                        key, awaited = (stages + q) * units + unit, n_out[q]
                        took = backward_ms[q] if kind == "B" else input_ms[q]
                        edges = w_backward[chunk]
                    else:
                        raise InputError(f"worker s{i}r{r}: unknown action kind {kind!r} in {action}")
                    if count[key] < awaited:
                        waiting.setdefault(key, []).append(w)
                        break
                    start = arrive[key]
                    if not start > at_free:  # max(free, arrival), then the receiver's overhead
                        start = at_free
                    taken = overhead_of[key]
                    if taken:
                        if record:
                            tasks.append(
                                (rank, "recv", f"recv {action}", start, taken, *action_ids(action), q, r)
                            )
                        start += taken
                    end = start + took
                posted = end  # the sender's overhead for its messages follows the action
                for edge in edges:  # at the end, one message to each destination, queued on its link
                    target_replicas, slots, base, needed, target_ranks, _ = edge
                    replica = unit % target_replicas
                    try:
                        occupy, latency, overhead, pair = slots[replica]
                    except KeyError:  # the first message to that replica
                        occupy, latency, overhead, pair = self.slot(rank, edge, replica)
                    sent = pair.free
                    if end > sent:  # max(link free, end)
                        sent = end
                    pair.free = sent + occupy
                    pair.busy += occupy
                    if record and occupy + latency > 0:
                        tasks.append(
                            (
                                rank,
                                "send",
                                f"send {action} ->r{target_ranks[replica]}",
                                sent,
                                occupy + latency,
                                action.minibatch,
                                action.microbatch,
                                q,
                                r,
                            )
                        )
                    arrival = sent + occupy + latency
                    target = base + unit
                    if arrival > arrive[target]:
                        arrive[target] = arrival
                    if overhead:
                        posted += overhead
                        overhead_of[target] += overhead
                    arrived = count[target] + 1
                    count[target] = arrived
                    if arrived == needed and target in waiting:
                        ready.extend(waiting.pop(target))
                if record and posted > end:
                    tasks.append(
                        (rank, "send", f"post {action}", end, posted - end, *action_ids(action), q, r)
                    )
                start_of(start)
                end_of(end)
                at_free = posted
                pos += 1
                if end > start:
                    spans = w_spans[chunk]
                    if not spans:
                        busy[(q, r)] = spans
                    spans.append((start, end))
                if record:
                    tasks.append(
                        (
                            rank,
                            "forward" if kind == "F" else "backward",
                            str(action),
                            start,
                            end - start,
                            action.minibatch,
                            action.microbatch,
                            q,
                            r,
                        )
                    )
            position[w], free[w] = pos, at_free

    # ------------------------------------------------------------ answer
    def timeline(self) -> Timeline:
        """The ``Timeline`` of the finished sweep; ``InputError`` naming stuck workers. O(actions)."""
        schedule = self.schedule
        stuck = [(w, at) for w, at in zip(self.workers, self.position) if at < len(schedule.actions[w])]
        if stuck:
            where = ", ".join(f"s{w[0]}r{w[1]} at {schedule.actions[w][at]}" for w, at in stuck[:4])
            raise InputError(f"schedule {schedule.name} deadlocks: {where}")
        starts = dict(zip(self.workers, self.starts))
        ends = dict(zip(self.workers, self.ends))
        link_free = [pair.free for pair in self.links.values()]
        makespan = max([e[-1] for e in ends.values() if e] + self.completion + link_free + [0.0])
        link_busy = {key: pair.busy for key, pair in self.links.items()}
        return Timeline(
            starts,
            ends,
            self.completion,
            dict(self.busy),
            link_busy,
            makespan,
            sorted(self.tasks, key=lambda t: (t[3], t[0])),
        )


def unit_clock(schedule: Schedule) -> dict[Worker, tuple[int, ...]]:
    """Start step of every action with F, B, I and W one step each and S none.

    Each model stage hands to the next one along the layers only (q + 1, or the V's next:
    ``Schedule.pipeline_order``), with free sends: the step clock of ``grid``. Raises
    ``InputError`` when the order deadlocks.

    >>> from pipeplan.schedules.kinds import build_schedule
    >>> clock = unit_clock(build_schedule("1f1b-flush", (1, 1), 1, 2))
    >>> clock[(0, 0)], clock[(1, 0)]
    ((0, 1, 3, 5, 6), (1, 2, 3, 4, 5))
    """
    stages = schedule.model_stages
    one = (1.0,) * stages
    zero = (0.0,) * stages
    order = schedule.pipeline_order()
    after = {q: order[k + 1] for k, q in enumerate(order[:-1])}
    chain = tuple(((after[q], 0.0),) if q in after else () for q in range(stages))
    durations = Durations(one, one, one, one, zero, zero, chain)
    first = [sum(schedule.stage_replicas[:i]) for i in range(schedule.stages)]
    ranks = [[first[i] + r for r in range(n)] for i, n in enumerate(schedule.stage_replicas)]
    timeline = run_schedule(schedule, durations, ranks, lambda a, b, size: (0.0, 0.0, 0.0))
    return {w: tuple(int(round(t)) for t in times) for w, times in timeline.starts.items()}
