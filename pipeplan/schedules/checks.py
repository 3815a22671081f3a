"""Checks of a schedule's orders (``validate``) and its step x worker timetable (``grid``)."""

from __future__ import annotations

from pipeplan.errors import InputError
from pipeplan.schedules.actions import ACTION_KINDS, Schedule, Worker, label
from pipeplan.schedules.engine import unit_clock
from pipeplan.schedules.kinds import schedule_kind

__all__ = ["grid", "validate"]


def validate(schedule: Schedule) -> None:
    """Raise ``InputError`` naming the first violation of the schedule rules.

    Checks: each worker runs every (unit, chunk) routed to it once forward and once
    backward ("B", or "I" then "W"), forward first; each unit visits every model stage;
    replicas of a position have the same number of "S"; the weight versions in use stay
    within the kind's count and exist when a forward needs them; and the order does not
    deadlock (a unit-time sweep finishes). O(actions).
    """
    kind = schedule_kind(schedule.name)
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
                raise InputError(
                    f"worker s{s}r{r}: {action} names chunk {action.chunk} of {schedule.virtual_stages}"
                )
            if schedule.replica_of(s, action.minibatch, action.microbatch) != r:
                raise InputError(
                    f"worker s{s}r{r}: {action} at position {position} belongs to replica "
                    f"{schedule.replica_of(s, action.minibatch, action.microbatch)}"
                )
            if _foreign(action.kind, kind.split_backward, kind.mixes_backward):
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
    unit_clock(schedule)  # raises on deadlock


def _units(schedule: Schedule, items: set[tuple[int, int, int]]) -> list[tuple[int, ...]]:
    """The first three (minibatch, microbatch[, chunk]) items, for messages."""
    width = 3 if schedule.virtual_stages > 1 else 2
    return [item[:width] for item in sorted(items)[:3]]


def _check_versions(schedule: Schedule, worker: Worker) -> None:
    """Weight versions in use on ``worker`` stay within its kind's count. O(actions)."""
    kind = schedule_kind(schedule.name)
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
                    f"worker {label(worker)}: {action} needs weight version {version} "
                    f"but only {steps} steps ran before it"
                )
            version_of[item] = version
            in_use = len(set(version_of.values()))
            if in_use > allowed:
                raise InputError(
                    f"worker {label(worker)}: {action} makes {in_use} weight versions in use, "
                    f"more than the {allowed} {kind.name} keeps"
                )
        elif action.kind in ("B", "W"):
            version_of.pop(item, None)


def grid(schedule: Schedule) -> str:
    """Step x worker timetable of the compute actions ("S" steps are not drawn).

    Cells read "F<minibatch>", with micro-batches "F<minibatch>.<microbatch>", with
    virtual stages a "c<chunk>" suffix; steps are ``unit_clock``'s.

    >>> from pipeplan.schedules.kinds import build_schedule
    >>> print(grid(build_schedule("1f1b-rr", (1, 1), 3)))
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
    clock = unit_clock(schedule)
    workers = schedule.workers
    drawn = [
        (column, step, action)
        for column, worker in enumerate(workers)
        for action, step in zip(schedule.actions[worker], clock[worker])
        if action.kind != "S"
    ]
    cells = [["."] * len(workers) for _ in range(1 + max(step for _, step, _ in drawn))]
    for column, step, action in drawn:
        text = f"{action.kind}{action.minibatch}"
        if schedule.microbatches > 1:
            text += f".{action.microbatch}"
        if schedule.virtual_stages > 1:
            text += f"c{action.chunk}"
        cells[step][column] = text
    width = max([4] + [len(c) for row in cells for c in row] + [len(label(w)) for w in workers])
    lines = ["step  " + "  ".join(label(w).ljust(width) for w in workers).rstrip()]
    for step, row in enumerate(cells):
        lines.append(f"{step:4d}  " + "  ".join(c.ljust(width) for c in row).rstrip())
    return "\n".join(lines)


def _foreign(action_kind: str, split_backward: bool, mixes_backward: bool) -> bool:
    """Whether an action of ``action_kind`` has no place in a schedule of these backward facts:
    "I"/"W" outside a split backward, "B" in one that does not mix whole backwards in."""
    if action_kind in ("I", "W"):
        return not split_backward
    return action_kind == "B" and split_backward and not mixes_backward
