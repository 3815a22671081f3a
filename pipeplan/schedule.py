"""Schedules as data: which forward/backward/step each worker runs, in order.

A worker is ``(stage, replica)``. A schedule maps every worker to its ordered tuple of
``Action``s; the simulator, the runtime and the timeline all read the same schedule,
so 1F1B-RR can be checked on the CPU without processes.

Routing rule (PipeDream): work unit ``u = minibatch * microbatches + microbatch`` runs
on replica ``u % replicas[s]`` of every stage s. Route by this global id, never by a
counter local to a rank.

The memory-relevant counts below are shared with the planner's memory model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence, Tuple

from pipeplan.errors import InputError

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "Schedule",
    "build_schedule",
    "validate",
    "warmup_forwards",
    "noam",
    "weight_versions",
    "activations_in_flight",
]

SCHEDULE_NAMES = ("1f1b-rr", "1f1b-flush", "gpipe")


def noam(stage_replicas: Sequence[int]) -> int:
    """Minibatches in flight in the whole 1F1B-RR pipeline: ceil(workers / replicas of stage 0)."""
    return math.ceil(sum(stage_replicas) / stage_replicas[0])


def warmup_forwards(stage_replicas: Sequence[int], stage: int) -> int:
    """W_s: extra forwards a replica of ``stage`` admits in 1F1B-RR (PipeDream's warm-up).

    The replica runs W_s + 1 forwards before its first backward, so W_s + 1 minibatches
    (and, with weight stashing, W_s + 1 weight versions) are in flight on it.

    PipeDream: ceil(R / n_0) - 1 for the input stage and
    floor((R - 1 - sum_{i<s} n_i) / n_s) for stage s > 0, with R the total workers.

    >>> [warmup_forwards([1, 1, 1, 1], s) for s in range(4)]
    [3, 2, 1, 0]
    >>> [warmup_forwards([2, 1, 1], s) for s in range(3)]
    [1, 1, 0]
    """
    workers = sum(stage_replicas)
    if stage == 0:
        return noam(stage_replicas) - 1
    before = sum(stage_replicas[:stage])
    return max(0, (workers - 1 - before) // stage_replicas[stage])


def weight_versions(schedule: str, stage_replicas: Sequence[int], stage: int) -> int:
    """Weight versions a replica of ``stage`` keeps: W_s + 1 with stashing (1f1b-rr), else 1."""
    if schedule == "1f1b-rr":
        return warmup_forwards(stage_replicas, stage) + 1
    return 1


def activations_in_flight(
    schedule: str, stage_replicas: Sequence[int], stage: int, microbatches: int = 1
) -> float:
    """Minibatches' worth of saved activations a replica of ``stage`` holds at its peak.

    1f1b-rr: W_s + 1 whole minibatches. 1f1b-flush: min(M, S - s) micro-batches of size
    1/M each. gpipe: all M micro-batches, i.e. one whole minibatch.
    """
    if schedule == "1f1b-rr":
        return float(warmup_forwards(stage_replicas, stage) + 1)
    stages = len(stage_replicas)
    if schedule == "1f1b-flush":
        return min(microbatches, stages - stage) / microbatches
    if schedule == "gpipe":
        return 1.0
    raise ValueError(f"unknown schedule {schedule!r}")


# --------------------------------------------------------------------------- actions


_ACTION_RE = re.compile(r"^([FBS])(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One step of one worker: ``kind`` "F" forward, "B" backward, "S" optimizer step.

    An "S" all-reduces the gradients among the stage's replicas, then steps the
    optimizer. ``minibatch`` is the global minibatch id, ``microbatch`` the micro-batch
    inside it (0 for 1F1B-RR).

    >>> str(Action("F", 3)), str(Action("B", 3, 1)), str(Action("S", 3))
    ('F3', 'B3.1', 'S3')
    >>> Action.parse("B3.1")
    Action(kind='B', minibatch=3, microbatch=1)
    """

    kind: str
    minibatch: int
    microbatch: int = 0

    def __str__(self) -> str:
        if self.microbatch:
            return f"{self.kind}{self.minibatch}.{self.microbatch}"
        return f"{self.kind}{self.minibatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Invert ``str``: "F3" -> Action("F", 3); "B3.1" -> Action("B", 3, 1)."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise InputError(f"cannot parse action {text!r} (expected e.g. 'F3', 'B3.1', 'S3')")
        kind, minibatch, microbatch = match.groups()
        return cls(kind, int(minibatch), int(microbatch or 0))


Worker = Tuple[int, int]  # (stage, replica)


@dataclass(frozen=True)
class Schedule:
    """Every worker's ordered actions; indexed by ``(stage, replica)``.

    Work unit ``u = minibatch * microbatches + microbatch`` runs on replica
    ``u % stage_replicas[s]`` of stage s.
    """

    name: str  # "1f1b-rr" | "1f1b-flush" | "gpipe"
    stage_replicas: tuple[int, ...]
    minibatches: int
    microbatches: int
    actions: dict[Worker, tuple[Action, ...]]  # (stage, replica) -> ordered actions

    @property
    def stages(self) -> int:
        return len(self.stage_replicas)

    @property
    def workers(self) -> list[Worker]:
        """All workers, stage-major: (0, 0), (0, 1), ..., (S-1, n-1)."""
        return [(s, r) for s, n in enumerate(self.stage_replicas) for r in range(n)]

    def replica_of(self, stage: int, minibatch: int, microbatch: int = 0) -> int:
        """Replica of ``stage`` that runs the unit (minibatch, microbatch)."""
        unit = minibatch * self.microbatches + microbatch
        return unit % self.stage_replicas[stage]

    def steps(self) -> dict[Worker, tuple[int, ...]]:
        """Unit-time clock of every action: F and B take one step, S takes none.

        Each action starts as soon as its worker is free and its inputs exist (the
        forward on the previous stage, the backward on the next stage, all replicas'
        matching "S"). Raises ``InputError`` when the order deadlocks.
        """
        return _unit_clock(self)

    def grid(self) -> str:
        """Step x worker timetable of forwards and backwards ("S" steps are not drawn).

        Cells read "F<minibatch>" or, with micro-batches, "F<minibatch>.<microbatch>".

        >>> print(build_schedule("1f1b-rr", (1, 1), 3).grid())
        step  s0r0  s1r0
           0  F0    .
           1  F1    F0
           2  .     B0
           3  B0    F1
           4  F2    B1
           5  B1    F2
           6  .     B2
           7  B2    .
        """
        clock = self.steps()
        workers = self.workers
        drawn = [
            (column, step, action)
            for column, worker in enumerate(workers)
            for action, step in zip(self.actions[worker], clock[worker])
            if action.kind != "S"
        ]
        cells = [["."] * len(workers) for _ in range(1 + max(step for _, step, _ in drawn))]
        for column, step, action in drawn:
            cells[step][column] = (
                f"{action.kind}{action.minibatch}.{action.microbatch}"
                if self.microbatches > 1
                else str(action)
            )
        width = max([4] + [len(c) for row in cells for c in row] + [len(_label(w)) for w in workers])
        lines = ["step  " + "  ".join(_label(w).ljust(width) for w in workers).rstrip()]
        for step, row in enumerate(cells):
            lines.append(f"{step:4d}  " + "  ".join(c.ljust(width) for c in row).rstrip())
        return "\n".join(lines)


def _label(worker: Worker) -> str:
    return f"s{worker[0]}r{worker[1]}"


# --------------------------------------------------------------------------- building


def build_schedule(
    name: str, stage_replicas: Sequence[int], minibatches: int, microbatches: int = 1
) -> Schedule:
    """Every worker's action order for ``name`` ("1f1b-rr", "1f1b-flush" or "gpipe").

    Runs in O(workers + stages * minibatches * microbatches).

    >>> s = build_schedule("1f1b-rr", (2, 1), 4)
    >>> [" ".join(map(str, s.actions[w])) for w in s.workers]
    ['F0 F2 B0 S0 B2 S2', 'F1 F3 B1 S1 B3 S3', 'F0 B0 S0 F1 B1 S1 F2 B2 S2 F3 B3 S3']
    >>> s = build_schedule("gpipe", (1, 1), 1, microbatches=2)
    >>> [" ".join(map(str, s.actions[w])) for w in s.workers]
    ['F0 F0.1 B0.1 B0 S0', 'F0 F0.1 B0.1 B0 S0']
    """
    replicas = tuple(int(n) for n in stage_replicas)
    if not replicas or any(n < 1 for n in replicas):
        raise InputError(f"stage replicas must be >= 1 for every stage (got {list(replicas)})")
    if minibatches < 1 or microbatches < 1:
        raise InputError(
            f"minibatches and microbatches must be >= 1 (got {minibatches}, {microbatches})"
        )
    if name == "1f1b-rr":
        if microbatches != 1:
            raise InputError(f"1f1b-rr runs whole minibatches (got microbatches={microbatches})")
        period = math.lcm(*replicas)
        if minibatches % period:
            raise InputError(
                f"1f1b-rr needs minibatches ({minibatches}) to be a multiple of "
                f"lcm(replicas {list(replicas)}) = {period}, so replicas all-reduce in lock step"
            )
        build = _worker_1f1b_rr
    elif name == "1f1b-flush":
        build = _worker_1f1b_flush
    elif name == "gpipe":
        build = _worker_gpipe
    else:
        raise InputError(f"unknown schedule {name!r} (expected one of {', '.join(SCHEDULE_NAMES)})")
    actions = {
        (s, r): tuple(build(replicas, s, r, minibatches, microbatches))
        for s, n in enumerate(replicas)
        for r in range(n)
    }
    return Schedule(name, replicas, minibatches, microbatches, actions)


def _worker_1f1b_rr(
    replicas: tuple[int, ...], stage: int, replica: int, minibatches: int, microbatches: int
) -> list[Action]:
    """W_s + 1 forwards, then B (+S), F alternating, then drain the backwards (+S)."""
    units = range(replica, minibatches, replicas[stage])
    ahead = min(len(units), warmup_forwards(replicas, stage) + 1)
    out = [Action("F", k) for k in units[:ahead]]
    for i, k in enumerate(units):
        out += [Action("B", k), Action("S", k)]
        if i + ahead < len(units):
            out.append(Action("F", units[i + ahead]))
    return out


def _local_microbatches(
    replicas: tuple[int, ...], stage: int, replica: int, minibatch: int, microbatches: int
) -> list[int]:
    n = replicas[stage]
    return [m for m in range(microbatches) if (minibatch * microbatches + m) % n == replica]


def _worker_1f1b_flush(
    replicas: tuple[int, ...], stage: int, replica: int, minibatches: int, microbatches: int
) -> list[Action]:
    """Per minibatch: min(M, S - s) forwards, then B, F alternating, drain, one "S"."""
    out: list[Action] = []
    for k in range(minibatches):
        local = _local_microbatches(replicas, stage, replica, k, microbatches)
        ahead = min(len(local), len(replicas) - stage)
        out += [Action("F", k, m) for m in local[:ahead]]
        for i, m in enumerate(local):
            out.append(Action("B", k, m))
            if i + ahead < len(local):
                out.append(Action("F", k, local[i + ahead]))
        out.append(Action("S", k))
    return out


def _worker_gpipe(
    replicas: tuple[int, ...], stage: int, replica: int, minibatches: int, microbatches: int
) -> list[Action]:
    """Per minibatch: all forwards, all backwards in reverse order, one "S"."""
    out: list[Action] = []
    for k in range(minibatches):
        local = _local_microbatches(replicas, stage, replica, k, microbatches)
        out += [Action("F", k, m) for m in local]
        out += [Action("B", k, m) for m in reversed(local)]
        out.append(Action("S", k))
    return out


# --------------------------------------------------------------------------- checking


def validate(schedule: Schedule) -> None:
    """Raise ``InputError`` naming the first violation of the schedule rules.

    Checks: each worker runs every unit routed to it once in F and once in B, F before
    B; each unit visits every stage; replicas of a stage have the same number of "S";
    and the order does not deadlock (a unit-time sweep finishes). O(actions).
    """
    for (s, r), actions in schedule.actions.items():
        forward: set[tuple[int, int]] = set()
        backward: set[tuple[int, int]] = set()
        for position, action in enumerate(actions):
            unit = (action.minibatch, action.microbatch)
            if action.kind == "S":
                continue
            if schedule.replica_of(s, *unit) != r:
                raise InputError(
                    f"worker s{s}r{r}: {action} at position {position} belongs to replica "
                    f"{schedule.replica_of(s, *unit)}"
                )
            if action.kind == "F":
                if unit in forward:
                    raise InputError(f"worker s{s}r{r}: {action} runs twice")
                forward.add(unit)
            else:
                if unit not in forward or unit in backward:
                    raise InputError(
                        f"worker s{s}r{r}: {action} at position {position} has no earlier "
                        f"forward or runs twice"
                    )
                backward.add(unit)
        if forward != backward:
            missing = sorted(forward - backward)[:3]
            raise InputError(f"worker s{s}r{r}: forwards without backward {missing}")
        expected = {
            (k, m)
            for k in range(schedule.minibatches)
            for m in range(schedule.microbatches)
            if schedule.replica_of(s, k, m) == r
        }
        if forward != expected:
            missing = sorted(expected - forward)[:3]
            raise InputError(f"worker s{s}r{r}: units {missing} never visit stage {s}")
    for s, n in enumerate(schedule.stage_replicas):
        counts = [sum(a.kind == "S" for a in schedule.actions[(s, r)]) for r in range(n)]
        if len(set(counts)) > 1:
            raise InputError(f"stage {s}: replicas run different numbers of steps {counts}")
    _unit_clock(schedule)


def _unit_clock(schedule: Schedule) -> dict[Worker, tuple[int, ...]]:
    """Start step of every action, F/B one step each, S zero; InputError on deadlock.

    A worklist sweep over the dependency DAG: a blocked worker waits on the one key it
    needs and is woken when that key completes. O(actions).
    """
    last = schedule.stages - 1
    done: dict[tuple[str, int, int, int], int] = {}  # (kind, stage, minibatch, micro) -> end
    waiting: dict[tuple[Any, ...], list[Worker]] = {}
    arrived: dict[tuple[int, int], list[int]] = {}  # (stage, step ordinal) -> ready steps
    position = dict.fromkeys(schedule.actions, 0)
    free = dict.fromkeys(schedule.actions, 0)
    steps_done = dict.fromkeys(schedule.actions, 0)
    starts: dict[Worker, list[int]] = {w: [] for w in schedule.actions}
    ready = list(schedule.actions)

    def advance(worker: Worker, start: int, duration: int) -> None:
        starts[worker].append(start)
        free[worker] = start + duration
        position[worker] += 1

    while ready:
        worker = ready.pop()
        s = worker[0]
        actions = schedule.actions[worker]
        while position[worker] < len(actions):
            action = actions[position[worker]]
            k, m = action.minibatch, action.microbatch
            if action.kind == "S":
                group = (s, steps_done[worker])
                members = arrived.setdefault(group, [])
                members.append(free[worker])
                if len(members) < schedule.stage_replicas[s]:
                    waiting.setdefault(("S", *group), []).append(worker)
                    break
                at = max(members)
                for peer in [*waiting.pop(("S", *group), []), worker]:
                    advance(peer, at, 0)
                    steps_done[peer] += 1
                    if peer != worker:
                        ready.append(peer)
                continue
            need: tuple[str, int, int, int] | None = None
            if action.kind == "F" and s > 0:
                need = ("F", s - 1, k, m)
            elif action.kind == "B" and s < last:
                need = ("B", s + 1, k, m)
            if need is not None and need not in done:
                waiting.setdefault(need, []).append(worker)
                break
            advance(worker, max(free[worker], done[need] if need is not None else 0), 1)
            key = (action.kind, s, k, m)
            done[key] = free[worker]
            ready.extend(waiting.pop(key, []))
    stuck = [w for w in schedule.actions if position[w] < len(schedule.actions[w])]
    if stuck:
        where = ", ".join(f"{_label(w)} at {schedule.actions[w][position[w]]}" for w in stuck[:4])
        raise InputError(f"schedule {schedule.name} deadlocks: {where}")
    return {w: tuple(v) for w, v in starts.items()}
