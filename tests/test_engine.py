"""The event engine against a plain reference sweep, exactly; the simulator's window figures
against their plain loops.

``reference_run_schedule`` is the engine as first written (tuple-keyed dicts, one call per
send): the optimised sweep must give the same timeline bit for bit, for every schedule.
"""

from __future__ import annotations

import doctest
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import pytest

import pipeplan.planner.simulate as simulate_module
import pipeplan.schedules.engine as engine_module
from pipeplan.errors import InputError
from pipeplan.planner.simulate import StageCosts, _held_at_peak, _inside_ms
from pipeplan.schedules import SCHEDULE_KINDS, SCHEDULE_NAMES, Action, Schedule, build_schedule
from pipeplan.schedules.engine import Durations, LinkTime, Timeline, run_schedule

# (replicas per position, micro-batches, virtual stages, minibatches) per schedule
SHAPES: dict[str, list[tuple[tuple[int, ...], int, int, int]]] = {
    "1f1b-rr": [((2, 1, 3), 1, 1, 12), ((1, 2, 2, 1), 1, 1, 8)],
    "1f1b-flush": [((2, 1, 3), 3, 1, 4), ((1, 1, 1, 1), 8, 1, 3)],
    "gpipe": [((2, 1, 3), 5, 1, 3)],
    "interleaved-1f1b": [((1, 1, 1), 6, 3, 3), ((2, 1), 4, 2, 3)],
    "2bw": [((2, 1, 3), 12, 1, 4)],
    "zb-h1": [((2, 1, 3), 6, 1, 3)],
}


def shapes(name: str) -> list[tuple[tuple[int, ...], int, int, int]]:
    """``SHAPES[name]``; for a schedule without one, a shape its kind's rules accept on
    replicas (2, 1, 3): 6 minibatches (a multiple of lcm(replicas)), the first of 6, 12, 1
    micro-batches, 2 chunks per device when it has virtual stages."""
    if name in SHAPES:
        return SHAPES[name]
    kind = SCHEDULE_KINDS[name]
    virtual = 2 if kind.virtual_stages else 1
    for micro in (6, 12, 1):
        try:
            kind.check((2, 1, 3), micro, virtual, 6)
        except InputError:
            continue
        return [((2, 1, 3), micro, virtual, 6)]
    raise AssertionError(f"{name}: no micro-batch count of 6, 12, 1 fits replicas (2, 1, 3)")


def reference_run_schedule(
    schedule: Schedule,
    durations: Durations,
    ranks: Sequence[Sequence[int]],
    link: LinkTime,
    record: bool = False,
) -> Timeline:
    """The engine's rules, written plainly: a worklist over tuple-keyed dicts."""
    positions, stages, micro = schedule.stages, schedule.model_stages, schedule.microbatches
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
    arrive: dict[tuple[str, int, int], float] = {}
    overhead_at: dict[tuple[str, int, int], float] = defaultdict(float)  # the receiver's ms per key
    count: dict[tuple[str, int, int], int] = defaultdict(int)
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    link_busy: dict[tuple[int, int], float] = defaultdict(float)
    waiting: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    arrived: dict[tuple[int, int], list[float]] = {}
    steps_done: dict[tuple[int, int], int] = defaultdict(int)
    position = dict.fromkeys(schedule.actions, 0)
    free = dict.fromkeys(schedule.actions, 0.0)
    starts: dict[tuple[int, int], list[float]] = {w: [] for w in schedule.actions}
    ends: dict[tuple[int, int], list[float]] = {w: [] for w in schedule.actions}
    busy: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    completion = [0.0] * schedule.minibatches
    tasks: list[tuple[Any, ...]] = []
    ready = list(schedule.actions)

    def send(
        src: int, dst: int, size: float, at: float, label: str, k: int, m: int, q: int, r: int
    ) -> tuple[float, float]:
        occupy, latency, overhead = link(src, dst, size)
        start = max(link_free[(src, dst)], at)
        link_free[(src, dst)] = start + occupy
        link_busy[(src, dst)] += occupy
        if record and occupy + latency > 0:
            tasks.append((src, "send", f"send {label} ->r{dst}", start, occupy + latency, k, m, q, r))
        return start + occupy + latency, overhead

    def deliver(
        kind: str,
        targets: Sequence[tuple[int, float]],
        needed: Sequence[int],
        rank: int,
        end: float,
        action: Action,
        q: int,
        r: int,
    ) -> float:
        """Send to every target; the sender is free again after each message's overhead."""
        unit = action.minibatch * micro + action.microbatch
        posted = end
        for t, size in targets:
            i = t % positions
            at, overhead = send(
                rank,
                ranks[i][unit % replicas[i]],
                size,
                end,
                str(action),
                action.minibatch,
                action.microbatch,
                q,
                r,
            )
            posted += overhead
            key = (kind, t, unit)
            arrive[key] = max(arrive.get(key, 0.0), at)
            overhead_at[key] += overhead
            count[key] += 1
            if count[key] == needed[t]:
                ready.extend(waiting.pop(key, []))
        return posted

    while ready:
        worker = ready.pop()
        i, r = worker
        actions = schedule.actions[worker]
        while position[worker] < len(actions):
            action = actions[position[worker]]
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
                    starts[peer].append(start)
                    ends[peer].append(end)
                    free[peer] = end
                    position[peer] += 1
                    steps_done[peer] += 1
                    at = start
                    for q in range(i, stages, positions):
                        reduce_ms, step_ms = durations.allreduce_ms[q], durations.step_ms[q]
                        share = reduce_ms + step_ms
                        if share > 0:
                            busy[(q, peer[1])].append((at, at + share))
                        if record and reduce_ms > 0:
                            tasks.append(
                                (
                                    ranks[i][peer[1]],
                                    "allreduce",
                                    f"allreduce S{own}",
                                    at,
                                    reduce_ms,
                                    own,
                                    0,
                                    q,
                                    peer[1],
                                )
                            )
                        if record and step_ms > 0:
                            tasks.append(
                                (
                                    ranks[i][peer[1]],
                                    "step",
                                    f"S{own}",
                                    at + reduce_ms,
                                    step_ms,
                                    own,
                                    0,
                                    q,
                                    peer[1],
                                )
                            )
                        at += share
                    if peer != worker:
                        ready.append(peer)
                continue
            q = action.chunk * positions + i
            key = ("F" if action.kind == "F" else "B", q, action.minibatch * micro + action.microbatch)
            if action.kind == "W":
                start = free[worker]
                end = posted = start + durations.backward_weight_ms[q]
            else:
                if count[key] < (n_in[q] if action.kind == "F" else n_out[q]):
                    waiting.setdefault(key, []).append(worker)
                    break
                start = max(free[worker], arrive.get(key, 0.0))
                if overhead_at[key]:
                    if record:
                        ids = (action.minibatch, action.microbatch, q, r)
                        tasks.append((ranks[i][r], "recv", f"recv {action}", start, overhead_at[key], *ids))
                    start += overhead_at[key]
                took = {
                    "F": durations.forward_ms,
                    "B": durations.backward_ms,
                    "I": durations.backward_input_ms,
                }
                end = start + took[action.kind][q]
                if action.kind == "F":
                    posted = deliver("F", durations.sends[q], n_in, ranks[i][r], end, action, q, r)
                else:
                    posted = deliver("B", producers[q], n_out, ranks[i][r], end, action, q, r)
                if record and posted > end:
                    ids = (action.minibatch, action.microbatch, q, r)
                    tasks.append((ranks[i][r], "send", f"post {action}", end, posted - end, *ids))
            starts[worker].append(start)
            ends[worker].append(end)
            free[worker] = posted
            position[worker] += 1
            if end > start:
                busy[(q, r)].append((start, end))
            if record:
                category = "forward" if action.kind == "F" else "backward"
                tasks.append(
                    (
                        ranks[i][r],
                        category,
                        str(action),
                        start,
                        end - start,
                        action.minibatch,
                        action.microbatch,
                        q,
                        r,
                    )
                )
    assert all(position[w] == len(schedule.actions[w]) for w in schedule.actions), "deadlock"
    makespan = max([e[-1] for e in ends.values() if e] + completion + list(link_free.values()) + [0.0])
    return Timeline(
        starts,
        ends,
        completion,
        dict(busy),
        dict(link_busy),
        makespan,
        sorted(tasks, key=lambda t: (t[3], t[0])),
    )


def random_case(stages: int, seed: int) -> tuple[Durations, LinkTime]:
    """Durations with skip connections, some zero times and sizes; links by rank distance."""
    rng = random.Random(seed)

    def ms(low: float, high: float) -> float:
        return 0.0 if rng.random() < 0.2 else rng.uniform(low, high)

    sends = tuple(
        tuple((t, rng.choice([0.0, 1e6, rng.uniform(0.0, 3e6)])) for t in (q + 1, q + 2) if t < stages)
        for q in range(stages)
    )
    durations = Durations(*(tuple(ms(0.1, 2.0) for _ in range(stages)) for _ in range(6)), sends)
    latency = rng.choice([0.0, 0.05])
    overhead = 0.03  # each end of a message; links with (a + b) % 5 == 0 have none

    def link(a: int, b: int, size: float) -> tuple[float, float, float]:
        if (a + b) % 5 == 0:
            return 0.0, 0.0, 0.0
        return size / (1e9 if abs(a - b) < 2 else 1e8), latency, overhead

    return durations, link


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("record", [False, True])
def test_engine_matches_reference_sweep_exactly(name: str, record: bool) -> None:
    for seed, (replicas, micro, virtual, minibatches) in enumerate(shapes(name)):
        schedule = build_schedule(name, replicas, minibatches, micro, virtual_stages=virtual)
        durations, link = random_case(schedule.model_stages, seed)
        first = [sum(replicas[:i]) for i in range(len(replicas))]
        ranks = [[first[i] + r for r in range(n)] for i, n in enumerate(replicas)]
        got = run_schedule(schedule, durations, ranks, link, record)
        want = reference_run_schedule(schedule, durations, ranks, link, record)
        assert got == want  # floats compared exactly
        assert list(got.busy) == list(want.busy) and list(got.link_busy) == list(want.link_busy)
        assert bool(got.tasks) == record


def test_window_figures_match_plain_loops() -> None:
    rng = random.Random(7)
    for _ in range(50):
        at, spans = 0.0, []
        for _ in range(rng.randrange(0, 30)):
            at += rng.choice([0.0, rng.uniform(0.0, 2.0)])
            spans.append((at, at + rng.uniform(1e-3, 3.0)))
            at = spans[-1][1]
        t0 = rng.uniform(-1.0, at + 1.0)
        t1 = t0 + rng.uniform(0.0, at)
        plain = sum(max(0.0, min(end, t1) - max(start, t0)) for start, end in spans)
        assert sum(_inside_ms(spans, t0, t1)) == plain
    costs = [  # 2 positions x 2 chunks; a split backward's "I" to "W" weighs deferred_bytes more
        StageCosts(1.0, 2.0, 0, saved, (), deferred_bytes=deferred)
        for saved, deferred in ((3, 0), (0, 4), (5, 1), (2, 7))
    ]
    for name, replicas, micro, virtual in (("interleaved-1f1b", (1, 1), 4, 2), ("zb-h1", (1, 2), 4, 1)):
        schedule = build_schedule(name, replicas, 3, micro, virtual_stages=virtual)
        for (i, _), actions in schedule.actions.items():
            assert _held_at_peak(schedule, i, actions, costs[: 2 * virtual]) == plain_held_at_peak(
                schedule, i, actions, costs[: 2 * virtual]
            )


def plain_held_at_peak(
    schedule: Schedule, position: int, actions: Sequence[Action], costs: Sequence[StageCosts]
) -> tuple[list[int], list[int]]:
    count = [0] * (len(costs) // schedule.stages)
    waiting = list(count)  # past "I", before "W"
    best, held, most = (list(count), list(waiting)), 0.0, 0.0
    for action in actions:
        cost = costs[action.chunk * schedule.stages + position]
        if action.kind in ("F", "B", "W"):
            step = 1 if action.kind == "F" else -1
            count[action.chunk] += step
            held += step * max(cost.saved_bytes, 1)
        if action.kind in ("I", "W"):
            step = 1 if action.kind == "I" else -1
            waiting[action.chunk] += step
            held += step * cost.deferred_bytes
        if held > most:
            most, best = held, (list(count), list(waiting))
    return best


def test_doctests() -> None:
    for module in (engine_module, simulate_module):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0
