"""Schedules as data: which forward/backward/step each worker runs, in order.

A worker is ``(position, replica)``: pipeline position p (a group of devices) and a
replica in it. A schedule maps every worker to its ordered tuple of ``Action``s; the
simulator, the runtime and the timeline all read the same schedule, so every schedule
can be checked on the CPU without processes.

Virtual stages (interleaved 1F1B): with P positions and v chunks per device there are
v*P model stages; an action with chunk c on position i belongs to model stage c*P + i.
Without virtual stages (v = 1) position and model stage coincide.

Routing rule (PipeDream): work unit ``u = minibatch * microbatches + microbatch`` runs
on replica ``u % replicas[p]`` of every position p. Route by this global id, never by a
counter local to a rank.

Every schedule is one ``ScheduleKind`` in ``SCHEDULE_KINDS``: its facts (flushes,
gradient semantics, split backward, virtual stages, micro-batch rules) and its action
generator live there and nowhere else. The memory-relevant counts are shared with the
planner's memory model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence, Tuple, TypeVar

from pipeplan.errors import InputError

__all__ = [
    "SCHEDULE_KINDS",
    "SCHEDULE_NAMES",
    "ACTION_KINDS",
    "Action",
    "Schedule",
    "ScheduleKind",
    "schedule_kind",
    "build_schedule",
    "validate",
    "warmup_forwards",
    "interleaved_warmup",
    "noam",
    "weight_versions",
    "activations_in_flight",
    "peak_in_flight",
]

ACTION_KINDS = ("F", "B", "I", "W", "S")
Worker = Tuple[int, int]  # (position, replica)
T = TypeVar("T")


# --------------------------------------------------------------------------- counts


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


def interleaved_warmup(positions: int, position: int, virtual_stages: int) -> int:
    """Megatron's warm-up of interleaved 1F1B: forward chunk-micro-batches before the first B.

    (P - i - 1) * 2 + (v - 1) * P on position i of P, with v chunks per device (before
    capping at the v * m chunk-micro-batches of a minibatch).

    >>> [interleaved_warmup(4, i, 2) for i in range(4)]
    [10, 8, 6, 4]
    """
    return (positions - position - 1) * 2 + (virtual_stages - 1) * positions


def peak_in_flight(actions: Sequence["Action"]) -> int:
    """Most units (chunk-micro-batches) whose activations are held at once.

    A unit holds its activations from its "F" until its "B", or until its "W" when the
    backward is split (the weight gradient still reads the saved inputs). O(actions).

    >>> peak_in_flight([Action.parse(t) for t in "F0 F0.1 B0 F0.2 I0.1 W0.1 B0.2".split()])
    2
    """
    outstanding = peak = 0
    for action in actions:
        outstanding += (action.kind == "F") - (action.kind in ("B", "W"))
        peak = max(peak, outstanding)
    return peak


# --------------------------------------------------------------------------- actions


_ACTION_RE = re.compile(r"^([FBIWS])(\d+)(?:\.(\d+))?(?:c(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One step of one worker.

    ``kind``: "F" forward, "B" whole backward, "I" backward to the stage inputs only,
    "W" weight gradients of an earlier "I", "S" optimizer step (all-reduces the
    gradients among the position's replicas, then steps the optimizer of every chunk).
    ``minibatch`` is the global minibatch id, ``microbatch`` the micro-batch inside it,
    ``chunk`` the model chunk on the device (model stage ``chunk * P + position``).

    >>> str(Action("F", 3)), str(Action("B", 3, 1)), str(Action("S", 3)), str(Action("I", 0, 2, 1))
    ('F3', 'B3.1', 'S3', 'I0.2c1')
    >>> Action.parse("W3.1c2")
    Action(kind='W', minibatch=3, microbatch=1, chunk=2)
    """

    kind: str
    minibatch: int
    microbatch: int = 0
    chunk: int = 0

    def __str__(self) -> str:
        text = f"{self.kind}{self.minibatch}"
        if self.microbatch:
            text += f".{self.microbatch}"
        if self.chunk:
            text += f"c{self.chunk}"
        return text

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Invert ``str``: "F3" -> Action("F", 3); "B3.1c1" -> Action("B", 3, 1, 1)."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise InputError(
                f"cannot parse action {text!r} (expected e.g. 'F3', 'B3.1', 'I0.2c1', 'S3')"
            )
        kind, minibatch, microbatch, chunk = match.groups()
        return cls(kind, int(minibatch), int(microbatch or 0), int(chunk or 0))


@dataclass(frozen=True)
class Schedule:
    """Every worker's ordered actions; indexed by ``(position, replica)``.

    Work unit ``u = minibatch * microbatches + microbatch`` runs on replica
    ``u % stage_replicas[p]`` of position p. ``stage_replicas`` has one entry per
    pipeline position; with ``virtual_stages`` v each position holds v model chunks.
    """

    name: str  # one of SCHEDULE_NAMES
    stage_replicas: tuple[int, ...]  # per pipeline position
    minibatches: int
    microbatches: int
    actions: dict[Worker, tuple[Action, ...]]  # (position, replica) -> ordered actions
    virtual_stages: int = 1  # model chunks per device

    @property
    def stages(self) -> int:
        """Pipeline positions (device groups)."""
        return len(self.stage_replicas)

    @property
    def model_stages(self) -> int:
        """Model stages: positions * virtual stages."""
        return len(self.stage_replicas) * self.virtual_stages

    @property
    def kind(self) -> "ScheduleKind":
        return schedule_kind(self.name)

    def model_stage(self, position: int, chunk: int) -> int:
        """Model stage that ``chunk`` on ``position`` runs: chunk * positions + position."""
        return chunk * self.stages + position

    @property
    def workers(self) -> list[Worker]:
        """All workers, position-major: (0, 0), (0, 1), ..., (P-1, n-1)."""
        return [(s, r) for s, n in enumerate(self.stage_replicas) for r in range(n)]

    def replica_of(self, stage: int, minibatch: int, microbatch: int = 0) -> int:
        """Replica of position ``stage`` that runs the unit (minibatch, microbatch)."""
        unit = minibatch * self.microbatches + microbatch
        return unit % self.stage_replicas[stage]

    def steps(self) -> dict[Worker, tuple[int, ...]]:
        """Unit-time clock of every action: F, B, I and W take one step, S takes none.

        Each action starts as soon as its worker is free and its inputs exist (the
        forward on the previous model stage, the input gradient of the next model stage
        from its "B" or "I", all replicas' matching "S"). Raises ``InputError`` when the
        order deadlocks.
        """
        from pipeplan.engine import unit_clock

        return unit_clock(self)

    def grid(self) -> str:
        """Step x worker timetable of the compute actions ("S" steps are not drawn).

        Cells read "F<minibatch>", with micro-batches "F<minibatch>.<microbatch>", with
        virtual stages a "c<chunk>" suffix.

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
            text = f"{action.kind}{action.minibatch}"
            if self.microbatches > 1:
                text += f".{action.microbatch}"
            if self.virtual_stages > 1:
                text += f"c{action.chunk}"
            cells[step][column] = text
        width = max([4] + [len(c) for row in cells for c in row] + [len(_label(w)) for w in workers])
        lines = ["step  " + "  ".join(_label(w).ljust(width) for w in workers).rstrip()]
        for step, row in enumerate(cells):
            lines.append(f"{step:4d}  " + "  ".join(c.ljust(width) for c in row).rstrip())
        return "\n".join(lines)


def _label(worker: Worker) -> str:
    return f"s{worker[0]}r{worker[1]}"


# --------------------------------------------------------------------------- kinds

Generator = Callable[[tuple[int, ...], int, int, int, int, int], list[Action]]
# (replicas per position, position, replica, minibatches, microbatches, virtual stages)


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule and every fact about it (the only place these facts live).

    ``gradients``: "exact" (every minibatch's gradient at the weights it started from;
    flush schedules), "stashed" (PipeDream 1F1B-RR: each minibatch's backward on the
    weights of its own forward, staleness depending on the stage), "delayed"
    (PipeDream-2BW: W(t+1) = W(t) - lr * grad f(W(t-1)), staleness 1 everywhere).
    """

    name: str
    summary: str  # one line for --help and reports
    flushes: bool  # the pipeline drains every minibatch (no overlap across minibatches)
    gradients: str  # "exact" | "stashed" | "delayed"
    split_backward: bool  # backward runs as "I" (input grads) then "W" (weight grads)
    virtual_stages: bool  # more than one model chunk per device (then v >= 2 is required)
    whole_minibatches: bool  # micro-batches must be 1
    generate: Generator
    # closed form of activations_in_flight (replicas, stage, microbatches); None: the action list's peak
    in_flight: Callable[[Sequence[int], int, int], float] | None = None

    # ------------------------------------------------------------ rules
    def check(
        self,
        stage_replicas: Sequence[int],
        microbatches: int,
        virtual_stages: int = 1,
        minibatches: int | None = None,
    ) -> None:
        """Raise a one-line ``InputError`` when the counts break this schedule's rules."""
        replicas = _replicas(stage_replicas)
        if microbatches < 1 or (minibatches is not None and minibatches < 1):
            raise InputError(
                f"minibatches and microbatches must be >= 1 (got {minibatches}, {microbatches})"
            )
        if self.virtual_stages:
            if virtual_stages < 2:
                raise InputError(
                    f"{self.name} needs virtual stages >= 2 (got {virtual_stages}); "
                    "with one chunk per device use 1f1b-flush"
                )
            if microbatches % len(replicas):
                raise InputError(
                    f"{self.name} needs micro-batches ({microbatches}) to be a multiple of "
                    f"the {len(replicas)} pipeline positions (Megatron's rule)"
                )
        elif virtual_stages != 1:
            raise InputError(f"{self.name} runs one model chunk per device (got virtual stages {virtual_stages})")
        if self.whole_minibatches and microbatches != 1:
            raise InputError(f"{self.name} runs whole minibatches (got microbatches={microbatches})")
        if self.gradients == "stashed" and minibatches is not None:
            period = math.lcm(*replicas)
            if minibatches % period:
                raise InputError(
                    f"{self.name} needs minibatches ({minibatches}) to be a multiple of "
                    f"lcm(replicas {list(replicas)}) = {period}, so replicas all-reduce in lock step"
                )
        if self.gradients == "delayed":
            least = max(n * (warmup_forwards(replicas, s) + 1) for s, n in enumerate(replicas))
            if microbatches < least:
                raise InputError(
                    f"{self.name} needs micro-batches ({microbatches}) >= {least} so that two "
                    f"weight versions suffice: every replica takes at least its warm-up of a "
                    f"minibatch's micro-batches (the pipeline depth without replication)"
                )

    # ------------------------------------------------------------ memory facts
    def weight_versions(self, stage_replicas: Sequence[int], stage: int) -> int:
        """Weight versions a replica of position ``stage`` keeps in use at once."""
        if self.gradients == "stashed":
            return warmup_forwards(stage_replicas, stage) + 1
        if self.gradients == "delayed":
            return 2
        return 1

    def in_flight_by_chunk(
        self, stage_replicas: Sequence[int], stage: int, microbatches: int = 1, virtual_stages: int = 1
    ) -> tuple[float, ...]:
        """Minibatches' worth of saved activations of each chunk on a device of ``stage``.

        Taken at the device's peak of units held (``peak_in_flight``) over one minibatch
        of the first replica; a unit of chunk c holds 1/M of chunk c's minibatch
        activations. O(M * v) from the action list.
        """
        replicas = _replicas(stage_replicas)
        actions = self.generate(replicas, stage, 0, 1 if self.flushes else 4, microbatches, virtual_stages)
        held: dict[tuple[int, int, int], int] = {}
        best: tuple[int, ...] = (0,) * virtual_stages
        for action in actions:
            key = (action.minibatch, action.microbatch, action.chunk)
            if action.kind == "F":
                held[key] = action.chunk
            elif action.kind in ("B", "W"):
                held.pop(key, None)
            if len(held) > sum(best):
                best = tuple(sum(1 for c in held.values() if c == chunk) for chunk in range(virtual_stages))
        return tuple(count / microbatches for count in best)

    def activations_in_flight(
        self, stage_replicas: Sequence[int], stage: int, microbatches: int = 1, virtual_stages: int = 1
    ) -> float:
        """Minibatches' worth of saved activations a replica of ``stage`` holds at its peak.

        1f1b-rr: W_s + 1 whole minibatches. 1f1b-flush: min(M, S - s) micro-batches of
        size 1/M each. gpipe: all M micro-batches, i.e. one whole minibatch. The others
        (interleaved-1f1b summed over the device's chunks, 2bw, zb-h1 held until "W"):
        the peak of their action list (``in_flight_by_chunk``).
        """
        if self.in_flight is not None:
            return self.in_flight(stage_replicas, stage, microbatches)
        return sum(self.in_flight_by_chunk(stage_replicas, stage, microbatches, virtual_stages))

    # ------------------------------------------------------------ pacing facts
    def minibatches_per_step(self, stage_replicas: Sequence[int]) -> int:
        """Minibatches in one training step: lcm(replicas) for stashed 1F1B-RR, else 1.

        >>> SCHEDULE_KINDS["1f1b-rr"].minibatches_per_step((2, 1, 3))
        6
        """
        return math.lcm(*stage_replicas) if self.gradients == "stashed" else 1

    def minibatches_in_flight(self, stage_replicas: Sequence[int]) -> int:
        """Minibatches overlapping in the pipeline: NOAM for 1F1B-RR, 2 for 2BW, else 1."""
        if self.gradients == "stashed":
            return noam(stage_replicas)
        if self.gradients == "delayed":
            return 2
        return 1

    def forward_version(self, minibatch: int, steps_done: int) -> int:
        """Weight version (optimizer steps applied) a forward of ``minibatch`` runs on.

        ``steps_done``: steps this worker has applied when the forward starts. Stashed and
        exact: the newest. Delayed (2BW): version ``minibatch - 1`` (the weights after the
        step of minibatch t - 2), version 0 for the first two minibatches.
        """
        if self.gradients == "delayed":
            return max(0, minibatch - 1)
        return steps_done

    def actions(
        self, stage_replicas: Sequence[int], minibatches: int, microbatches: int = 1, virtual_stages: int = 1
    ) -> dict[Worker, tuple[Action, ...]]:
        """Every worker's ordered actions (after ``check``)."""
        replicas = _replicas(stage_replicas)
        self.check(replicas, microbatches, virtual_stages, minibatches)
        try:
            return {
                (s, r): tuple(self.generate(replicas, s, r, minibatches, microbatches, virtual_stages))
                for s, n in enumerate(replicas)
                for r in range(n)
            }
        finally:
            _minibatch_actions.cache_clear()  # keep no Actions beyond the schedule that holds them


def _replicas(stage_replicas: Sequence[int]) -> tuple[int, ...]:
    replicas = tuple(int(n) for n in stage_replicas)
    if not replicas or any(n < 1 for n in replicas):
        raise InputError(f"stage replicas must be >= 1 for every stage (got {list(replicas)})")
    return replicas


# --------------------------------------------------------------------------- generators


def _local_microbatches(
    replicas: tuple[int, ...], stage: int, replica: int, minibatch: int, microbatches: int
) -> list[int]:
    n = replicas[stage]
    return [m for m in range(microbatches) if (minibatch * microbatches + m) % n == replica]


def _worker_1f1b_rr(
    replicas: tuple[int, ...], stage: int, replica: int, minibatches: int, microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """W_s + 1 forwards, then B (+S), F alternating, then drain the backwards (+S).

    The replica's minibatches are ``replica, replica + n, ...``; its Actions are taken
    from tables shared by every worker (``_minibatch_actions``) and laid out with slices,
    so a worker costs O(its actions) at C speed.
    """
    n = replicas[stage]
    forwards, backwards, steps = (_minibatch_actions(kind, minibatches)[replica::n] for kind in "FBS")
    ahead = min(len(forwards), warmup_forwards(replicas, stage) + 1)
    steady = len(forwards) - ahead  # minibatches whose B, S are followed by a later F
    return (
        list(forwards[:ahead])
        + _interleave(backwards[:steady], steps[:steady], forwards[ahead:])
        + _interleave(backwards[steady:], steps[steady:])
    )


@lru_cache(maxsize=3)
def _minibatch_actions(kind: str, minibatches: int) -> tuple[Action, ...]:
    """``Action(kind, k)`` for every minibatch k < ``minibatches``, shared by the workers of a build.

    An Action is immutable, so one object can stand in every worker's order. Cleared
    at the end of each ``ScheduleKind.actions``. O(minibatches).
    """
    return tuple(Action(kind, k) for k in range(minibatches))


def _interleave(*columns: Sequence[T]) -> list[T]:
    """``[a0, b0, c0, a1, b1, c1, ...]`` of equally long columns a, b, c. O(total).

    >>> _interleave("abc", "xyz")
    ['a', 'x', 'b', 'y', 'c', 'z']
    """
    width = len(columns)
    out = list(columns[0]) * width  # any list of the right length: every slot is written below
    for j, column in enumerate(columns):
        out[j::width] = column
    return out


def _worker_1f1b_flush(
    replicas: tuple[int, ...], stage: int, replica: int, minibatches: int, microbatches: int,
    virtual_stages: int,
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
    replicas: tuple[int, ...], stage: int, replica: int, minibatches: int, microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """Per minibatch: all forwards, all backwards in reverse order, one "S"."""
    out: list[Action] = []
    for k in range(minibatches):
        local = _local_microbatches(replicas, stage, replica, k, microbatches)
        out += [Action("F", k, m) for m in local]
        out += [Action("B", k, m) for m in reversed(local)]
        out.append(Action("S", k))
    return out


def _worker_interleaved(
    replicas: tuple[int, ...], stage: int, replica: int, minibatches: int, microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """Megatron's interleaved 1F1B, per minibatch (it flushes).

    A position's m micro-batches times v chunks make m*v chunk-micro-batches, numbered
    k in Megatron's order: groups of P micro-batches run chunk 0, then chunk 1, ..., so
    the forward of k is chunk (k mod P*v) // P of micro-batch (k // (P*v)) * P + k mod P;
    backwards walk the chunks in reverse. Warm-up runs ``interleaved_warmup`` forwards,
    then F, B alternate, then the drain. A replica runs the units routed to it in the
    position's order (a sub-order of a deadlock-free order cannot deadlock).
    """
    positions = len(replicas)
    group = positions * virtual_stages
    total = microbatches * virtual_stages

    def unit(index: int, forward: bool) -> tuple[int, int]:
        chunk = (index % group) // positions
        micro = (index // group) * positions + index % positions
        return micro, chunk if forward else virtual_stages - 1 - chunk

    ahead = min(total, interleaved_warmup(positions, stage, virtual_stages))
    order = [("F", *unit(i, True)) for i in range(ahead)]
    for i in range(total - ahead):
        order += [("F", *unit(ahead + i, True)), ("B", *unit(i, False))]
    order += [("B", *unit(i, False)) for i in range(total - ahead, total)]
    out: list[Action] = []
    for k in range(minibatches):
        local = set(_local_microbatches(replicas, stage, replica, k, microbatches))
        out += [Action(kind, k, micro, chunk) for kind, micro, chunk in order if micro in local]
        out.append(Action("S", k))
    return out


def _worker_2bw(
    replicas: tuple[int, ...], stage: int, replica: int, minibatches: int, microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """PipeDream-2BW: 1F1B over the stream of micro-batches, no flush.

    The replica's units (all minibatches' micro-batches routed to it, in order) run as
    1F1B-RR runs minibatches: W_s + 1 forwards, then B, F alternating, then the drain.
    "S" of minibatch t (coalesced gradients of its micro-batches) comes right after the
    worker's last backward of t, before any backward of a later minibatch; every replica
    steps every minibatch.
    """
    units = [
        (k, m) for k in range(minibatches)
        for m in _local_microbatches(replicas, stage, replica, k, microbatches)
    ]
    ahead = min(len(units), warmup_forwards(replicas, stage) + 1)
    out = [Action("F", k, m) for k, m in units[:ahead]]
    stepped = 0
    for i, (k, m) in enumerate(units):
        out.append(Action("B", k, m))
        following = units[i + 1][0] if i + 1 < len(units) else minibatches
        out += [Action("S", t) for t in range(stepped, following)]
        stepped = max(stepped, following)
        if i + ahead < len(units):
            out.append(Action("F", *units[i + ahead]))
    out += [Action("S", t) for t in range(stepped, minibatches)]
    return out


def _worker_zb_h1(
    replicas: tuple[int, ...], stage: int, replica: int, minibatches: int, microbatches: int,
    virtual_stages: int,
) -> list[Action]:
    """ZB-H1: the 1F1B-flush order with each backward split into "I" then "W".

    Per minibatch: min(M, S - s) forwards; then "I", F alternating as 1F1B's B, F; the
    "W" of a micro-batch runs right after an "I" once position s has deferred s of them
    (later positions wait longer for their first input gradient, so they keep more "W"
    to fill that bubble); the deferred ones drain before the minibatch's "S".
    Activations are held until "W": min(M, S) units at the peak, 1F1B's peak.
    """
    out: list[Action] = []
    for k in range(minibatches):
        local = _local_microbatches(replicas, stage, replica, k, microbatches)
        ahead = min(len(local), len(replicas) - stage)
        out += [Action("F", k, m) for m in local[:ahead]]
        deferred: list[int] = []
        for i, m in enumerate(local):
            out.append(Action("I", k, m))
            deferred.append(m)
            if len(deferred) > stage:
                out.append(Action("W", k, deferred.pop(0)))
            if i + ahead < len(local):
                out.append(Action("F", k, local[i + ahead]))
        out += [Action("W", k, m) for m in deferred]
        out.append(Action("S", k))
    return out


def _rr_in_flight(stage_replicas: Sequence[int], stage: int, microbatches: int) -> float:
    return float(warmup_forwards(stage_replicas, stage) + 1)  # W_s + 1 whole minibatches


def _flush_in_flight(stage_replicas: Sequence[int], stage: int, microbatches: int) -> float:
    return min(microbatches, len(stage_replicas) - stage) / microbatches  # S - s micro-batches


def _gpipe_in_flight(stage_replicas: Sequence[int], stage: int, microbatches: int) -> float:
    return 1.0  # all M micro-batches: one whole minibatch


SCHEDULE_KINDS: dict[str, ScheduleKind] = {
    kind.name: kind
    for kind in (
        ScheduleKind("1f1b-rr", "PipeDream 1F1B-RR: weight stashing, no flush", flushes=False,
                     gradients="stashed", split_backward=False, virtual_stages=False,
                     whole_minibatches=True, generate=_worker_1f1b_rr, in_flight=_rr_in_flight),
        ScheduleKind("1f1b-flush", "1F1B with a flush per minibatch (PipeDream-Flush)", flushes=True,
                     gradients="exact", split_backward=False, virtual_stages=False,
                     whole_minibatches=False, generate=_worker_1f1b_flush, in_flight=_flush_in_flight),
        ScheduleKind("gpipe", "GPipe: all forwards, then all backwards, per minibatch", flushes=True,
                     gradients="exact", split_backward=False, virtual_stages=False,
                     whole_minibatches=False, generate=_worker_gpipe, in_flight=_gpipe_in_flight),
        ScheduleKind("interleaved-1f1b", "Megatron interleaved 1F1B: v model chunks per device",
                     flushes=True, gradients="exact", split_backward=False, virtual_stages=True,
                     whole_minibatches=False, generate=_worker_interleaved),
        ScheduleKind("2bw", "PipeDream-2BW: two weight versions, one step of delay, no flush",
                     flushes=False, gradients="delayed", split_backward=False, virtual_stages=False,
                     whole_minibatches=False, generate=_worker_2bw),
        ScheduleKind("zb-h1", "zero bubble H1: 1F1B with weight gradients deferred", flushes=True,
                     gradients="exact", split_backward=True, virtual_stages=False,
                     whole_minibatches=False, generate=_worker_zb_h1),
    )
}
SCHEDULE_NAMES = tuple(SCHEDULE_KINDS)


def schedule_kind(name: str) -> ScheduleKind:
    """The registered kind called ``name``; ``InputError`` naming the known ones."""
    kind = SCHEDULE_KINDS.get(name)
    if kind is None:
        raise InputError(f"unknown schedule {name!r} (expected one of {', '.join(SCHEDULE_NAMES)})")
    return kind


def weight_versions(schedule: str, stage_replicas: Sequence[int], stage: int) -> int:
    """Weight versions a replica of ``stage`` keeps: W_s + 1 for 1f1b-rr, 2 for 2bw, else 1."""
    return schedule_kind(schedule).weight_versions(stage_replicas, stage)


def activations_in_flight(
    schedule: str, stage_replicas: Sequence[int], stage: int, microbatches: int = 1,
    virtual_stages: int = 1,
) -> float:
    """Minibatches' worth of saved activations a replica of ``stage`` holds at its peak.

    See ``ScheduleKind.activations_in_flight``; ``ValueError`` for an unknown name.
    """
    if schedule not in SCHEDULE_KINDS:
        raise ValueError(f"unknown schedule {schedule!r}")
    return SCHEDULE_KINDS[schedule].activations_in_flight(stage_replicas, stage, microbatches, virtual_stages)


# --------------------------------------------------------------------------- building


def build_schedule(
    name: str, stage_replicas: Sequence[int], minibatches: int, microbatches: int = 1,
    virtual_stages: int = 1,
) -> Schedule:
    """Every worker's action order for schedule ``name`` (one of ``SCHEDULE_NAMES``).

    Runs in O(workers + positions * minibatches * microbatches * virtual_stages).

    >>> s = build_schedule("1f1b-rr", (2, 1), 4)
    >>> [" ".join(map(str, s.actions[w])) for w in s.workers]
    ['F0 F2 B0 S0 B2 S2', 'F1 F3 B1 S1 B3 S3', 'F0 B0 S0 F1 B1 S1 F2 B2 S2 F3 B3 S3']
    >>> s = build_schedule("gpipe", (1, 1), 1, microbatches=2)
    >>> [" ".join(map(str, s.actions[w])) for w in s.workers]
    ['F0 F0.1 B0.1 B0 S0', 'F0 F0.1 B0.1 B0 S0']
    """
    kind = schedule_kind(name)
    replicas = _replicas(stage_replicas)
    actions = kind.actions(replicas, minibatches, microbatches, virtual_stages)
    return Schedule(name, replicas, minibatches, microbatches, actions, virtual_stages)


# --------------------------------------------------------------------------- checking


def validate(schedule: Schedule) -> None:
    """Raise ``InputError`` naming the first violation of the schedule rules.

    Checks: each worker runs every (unit, chunk) routed to it once forward and once
    backward ("B", or "I" then "W"), forward first; each unit visits every model stage;
    replicas of a position have the same number of "S"; the weight versions in use stay
    within the kind's count and exist when a forward needs them; and the order does not
    deadlock (a unit-time sweep finishes). O(actions).
    """
    kind = schedule.kind
    for (s, r), actions in schedule.actions.items():
        forward: set[tuple[int, int, int]] = set()
        backward: set[tuple[int, int, int]] = set()
        inputs_done: set[tuple[int, int, int]] = set()
        for position, action in enumerate(actions):
            item = (action.minibatch, action.microbatch, action.chunk)
            if action.kind == "S":
                continue
            if action.kind not in ACTION_KINDS:
                raise InputError(f"worker s{s}r{r}: unknown action kind {action.kind!r}")
            if not 0 <= action.chunk < schedule.virtual_stages:
                raise InputError(f"worker s{s}r{r}: {action} names chunk {action.chunk} of {schedule.virtual_stages}")
            if schedule.replica_of(s, action.minibatch, action.microbatch) != r:
                raise InputError(
                    f"worker s{s}r{r}: {action} at position {position} belongs to replica "
                    f"{schedule.replica_of(s, action.minibatch, action.microbatch)}"
                )
            if (action.kind in ("I", "W")) != kind.split_backward and action.kind != "F":
                raise InputError(f"worker s{s}r{r}: {action} does not belong to a {kind.name} schedule")
            if action.kind == "F":
                if item in forward:
                    raise InputError(f"worker s{s}r{r}: {action} runs twice")
                forward.add(item)
            elif action.kind == "W":
                if item not in inputs_done or item in backward:
                    raise InputError(
                        f"worker s{s}r{r}: {action} at position {position} has no earlier "
                        f"input gradient or runs twice"
                    )
                backward.add(item)
            else:
                done = inputs_done if action.kind == "I" else backward
                if item not in forward or item in done:
                    raise InputError(
                        f"worker s{s}r{r}: {action} at position {position} has no earlier "
                        f"forward or runs twice"
                    )
                done.add(item)
        if forward != backward:
            missing = _units(schedule, forward - backward)
            raise InputError(f"worker s{s}r{r}: forwards without backward {missing}")
        expected = {
            (k, m, c)
            for k in range(schedule.minibatches)
            for m in range(schedule.microbatches)
            for c in range(schedule.virtual_stages)
            if schedule.replica_of(s, k, m) == r
        }
        if forward != expected:
            missing = _units(schedule, expected - forward)
            raise InputError(f"worker s{s}r{r}: units {missing} never visit stage {s}")
        _check_versions(schedule, (s, r))
    for s, n in enumerate(schedule.stage_replicas):
        counts = [sum(a.kind == "S" for a in schedule.actions[(s, r)]) for r in range(n)]
        if len(set(counts)) > 1:
            raise InputError(f"stage {s}: replicas run different numbers of steps {counts}")
    schedule.steps()  # raises on deadlock


def _units(schedule: Schedule, items: set[tuple[int, int, int]]) -> list[tuple[int, ...]]:
    """The first three (minibatch, microbatch[, chunk]) items, for messages."""
    width = 3 if schedule.virtual_stages > 1 else 2
    return [item[:width] for item in sorted(items)[:3]]


def _check_versions(schedule: Schedule, worker: Worker) -> None:
    """Weight versions in use on ``worker`` stay within its kind's count. O(actions)."""
    kind = schedule.kind
    allowed = kind.weight_versions(schedule.stage_replicas, worker[0])
    steps = 0
    version_of: dict[tuple[int, int, int], int] = {}
    for action in schedule.actions[worker]:
        item = (action.minibatch, action.microbatch, action.chunk)
        if action.kind == "S":
            steps += 1
        elif action.kind == "F":
            version = kind.forward_version(action.minibatch, steps)
            if version > steps:
                raise InputError(
                    f"worker {_label(worker)}: {action} needs weight version {version} "
                    f"but only {steps} steps ran before it"
                )
            version_of[item] = version
            in_use = len(set(version_of.values()))
            if in_use > allowed:
                raise InputError(
                    f"worker {_label(worker)}: {action} makes {in_use} weight versions in use, "
                    f"more than the {allowed} {kind.name} keeps"
                )
        elif action.kind in ("B", "W"):
            version_of.pop(item, None)

