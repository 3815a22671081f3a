"""Schedules as data: literal timetables, routing, warm-up and in-flight counts."""

from __future__ import annotations

import doctest
import math

import pytest

import pipeplan.schedule as schedule_module
from pipeplan.errors import InputError
from pipeplan.schedule import (
    SCHEDULE_NAMES,
    Action,
    Schedule,
    activations_in_flight,
    build_schedule,
    validate,
    warmup_forwards,
)


def orders(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, schedule.actions[w])) for w in schedule.workers]


def peak_in_flight(actions: tuple[Action, ...]) -> int:
    outstanding = peak = 0
    for action in actions:
        outstanding += (action.kind == "F") - (action.kind == "B")
        peak = max(peak, outstanding)
    return peak


def test_doctests() -> None:
    result = doctest.testmod(schedule_module)
    assert result.attempted >= 5 and result.failed == 0


@pytest.mark.parametrize("text", ["F3", "B3.1", "S3", "F0", "B12.7"])
def test_action_round_trip(text: str) -> None:
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("text", ["X3", "F", "F3.", "f3", "F-1"])
def test_action_parse_rejects(text: str) -> None:
    with pytest.raises(InputError, match="cannot parse action"):
        Action.parse(text)


# PipeDream's figure: 4 workers, NOAM 4; worker 1 runs F0..F3, then alternates B, F.
STRAIGHT_4 = """\
step  s0r0  s1r0  s2r0  s3r0
   0  F0    .     .     .
   1  F1    F0    .     .
   2  F2    F1    F0    .
   3  F3    F2    F1    F0
   4  .     .     .     B0
   5  .     .     B0    F1
   6  .     B0    F2    B1
   7  B0    F3    B1    F2
   8  F4    B1    F3    B2
   9  B1    F4    B2    F3
  10  F5    B2    F4    B3
  11  B2    F5    B3    F4
  12  F6    B3    F5    B4
  13  B3    F6    B4    F5
  14  F7    B4    F6    B5
  15  B4    F7    B5    F6
  16  .     B5    F7    B6
  17  B5    .     B6    F7
  18  .     B6    .     B7
  19  B6    .     B7    .
  20  .     B7    .     .
  21  B7    .     .     ."""


def test_straight_1f1b_rr_timetable() -> None:
    schedule = build_schedule("1f1b-rr", (1, 1, 1, 1), 8)
    assert schedule.grid() == STRAIGHT_4
    assert orders(schedule)[0] == (
        "F0 F1 F2 F3 B0 S0 F4 B1 S1 F5 B2 S2 F6 B3 S3 F7 B4 S4 B5 S5 B6 S6 B7 S7"
    )
    assert orders(schedule)[3].startswith("F0 B0 S0 F1 B1 S1 F2")


REPLICATED_2_1 = """\
step  s0r0  s0r1  s1r0
   0  F0    F1    .
   1  F2    F3    F0
   2  .     .     B0
   3  B0    .     F1
   4  .     .     B1
   5  .     B1    F2
   6  F4    F5    B2
   7  B2    .     F3
   8  .     .     B3
   9  .     B3    F4
  10  .     .     B4
  11  B4    .     F5
  12  .     .     B5
  13  .     B5    ."""


def test_replicated_2_1_routing_and_warmup() -> None:
    schedule = build_schedule("1f1b-rr", (2, 1), 6)
    # Even minibatches on replica 0, odd on replica 1; the single stage-1 worker takes all.
    assert orders(schedule) == [
        "F0 F2 B0 S0 F4 B2 S2 B4 S4",
        "F1 F3 B1 S1 F5 B3 S3 B5 S5",
        "F0 B0 S0 F1 B1 S1 F2 B2 S2 F3 B3 S3 F4 B4 S4 F5 B5 S5",
    ]
    assert [warmup_forwards((2, 1), s) for s in (0, 1)] == [1, 0]
    assert [schedule.replica_of(0, k) for k in range(6)] == [0, 1, 0, 1, 0, 1]
    assert {schedule.replica_of(1, k) for k in range(6)} == {0}
    assert schedule.grid() == REPLICATED_2_1


def test_microbatch_routing_uses_global_unit() -> None:
    schedule = build_schedule("gpipe", (1, 3), 2, microbatches=2)
    # units 0..3 = (0,0) (0,1) (1,0) (1,1) -> replicas 0 1 2 0 of stage 1
    assert [schedule.replica_of(1, k, m) for k in range(2) for m in range(2)] == [0, 1, 2, 0]
    assert orders(schedule)[1:] == ["F0 B0 S0 F1.1 B1.1 S1", "F0.1 B0.1 S0 S1", "S0 F1 B1 S1"]


FLUSH_M4 = {
    2: ["F0 F0.1 B0 F0.2 B0.1 F0.3 B0.2 B0.3 S0", "F0 B0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3 S0"],
    3: [
        "F0 F0.1 F0.2 B0 F0.3 B0.1 B0.2 B0.3 S0",
        "F0 F0.1 B0 F0.2 B0.1 F0.3 B0.2 B0.3 S0",
        "F0 B0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3 S0",
    ],
    4: [
        "F0 F0.1 F0.2 F0.3 B0 B0.1 B0.2 B0.3 S0",
        "F0 F0.1 F0.2 B0 F0.3 B0.1 B0.2 B0.3 S0",
        "F0 F0.1 B0 F0.2 B0.1 F0.3 B0.2 B0.3 S0",
        "F0 B0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3 S0",
    ],
}
GPIPE_M4 = "F0 F0.1 F0.2 F0.3 B0.3 B0.2 B0.1 B0 S0"

FLUSH_4x4 = """\
step  s0r0  s1r0  s2r0  s3r0
   0  F0.0  .     .     .
   1  F0.1  F0.0  .     .
   2  F0.2  F0.1  F0.0  .
   3  F0.3  F0.2  F0.1  F0.0
   4  .     .     .     B0.0
   5  .     .     B0.0  F0.1
   6  .     B0.0  F0.2  B0.1
   7  B0.0  F0.3  B0.1  F0.2
   8  .     B0.1  F0.3  B0.2
   9  B0.1  .     B0.2  F0.3
  10  .     B0.2  .     B0.3
  11  B0.2  .     B0.3  .
  12  .     B0.3  .     .
  13  B0.3  .     .     ."""

GPIPE_4x4 = """\
step  s0r0  s1r0  s2r0  s3r0
   0  F0.0  .     .     .
   1  F0.1  F0.0  .     .
   2  F0.2  F0.1  F0.0  .
   3  F0.3  F0.2  F0.1  F0.0
   4  .     F0.3  F0.2  F0.1
   5  .     .     F0.3  F0.2
   6  .     .     .     F0.3
   7  .     .     .     B0.3
   8  .     .     B0.3  B0.2
   9  .     B0.3  B0.2  B0.1
  10  B0.3  B0.2  B0.1  B0.0
  11  B0.2  B0.1  B0.0  .
  12  B0.1  B0.0  .     .
  13  B0.0  .     .     ."""


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_flush_and_gpipe_orders(stages: int) -> None:
    flush = build_schedule("1f1b-flush", (1,) * stages, 1, microbatches=4)
    gpipe = build_schedule("gpipe", (1,) * stages, 1, microbatches=4)
    assert orders(flush) == FLUSH_M4[stages]
    assert orders(gpipe) == [GPIPE_M4] * stages
    for schedule in (flush, gpipe):
        # one minibatch of M micro-batches takes 2 (M + S - 1) unit steps: the
        # optimizer step ("S", zero steps long) of stage 0 starts at that clock
        assert schedule.steps()[(0, 0)][-1] == 2 * (4 + stages - 1)


def test_flush_and_gpipe_timetables() -> None:
    assert build_schedule("1f1b-flush", (1, 1, 1, 1), 1, 4).grid() == FLUSH_4x4
    assert build_schedule("gpipe", (1, 1, 1, 1), 1, 4).grid() == GPIPE_4x4


def test_flush_minibatches_do_not_overlap() -> None:
    schedule = build_schedule("1f1b-flush", (1, 1, 1), 3, microbatches=2)
    steps = schedule.steps()
    first_of_1 = steps[(0, 0)][orders(schedule)[0].split().index("F1")]
    last_of_0 = max(
        step
        for w in schedule.workers
        for action, step in zip(schedule.actions[w], steps[w])
        if action.minibatch == 0 and action.kind == "B"
    )
    assert first_of_1 > last_of_0


REPLICA_SETS = [(1,), (1, 1), (2, 1), (1, 2), (3, 1, 1), (2, 3), (1, 2, 1), (4, 2, 1, 1), (3, 5, 2)]


@pytest.mark.parametrize("replicas", REPLICA_SETS)
def test_1f1b_rr_in_flight_matches_memory_model(replicas: tuple[int, ...]) -> None:
    schedule = build_schedule("1f1b-rr", replicas, 3 * math.lcm(*replicas))
    validate(schedule)
    for (stage, _), actions in schedule.actions.items():
        local = sum(a.kind == "F" for a in actions)
        expected = activations_in_flight("1f1b-rr", replicas, stage)
        assert peak_in_flight(actions) == min(expected, local)
        assert sum(a.kind == "S" for a in actions) == local  # one step per backward


@pytest.mark.parametrize("name", ["1f1b-flush", "gpipe"])
@pytest.mark.parametrize("replicas", REPLICA_SETS)
@pytest.mark.parametrize("micro", [1, 3, 4])
def test_flush_schedules_validate(name: str, replicas: tuple[int, ...], micro: int) -> None:
    schedule = build_schedule(name, replicas, 2, micro)
    validate(schedule)
    if replicas == (1,) * len(replicas):
        for (stage, _), actions in schedule.actions.items():
            peak = peak_in_flight(actions) / micro
            assert peak == pytest.approx(activations_in_flight(name, replicas, stage, micro))


def test_rr_needs_multiple_of_lcm() -> None:
    with pytest.raises(InputError, match=r"minibatches \(5\).*lcm\(replicas \[2, 3\]\) = 6"):
        build_schedule("1f1b-rr", (2, 3), 5)


@pytest.mark.parametrize(
    "args, match",
    [
        (("pipedream", (1,), 1), "unknown schedule 'pipedream'"),
        (("gpipe", (1, 0), 1), r"replicas must be >= 1.*\[1, 0\]"),
        (("gpipe", (1,), 0), r"got 0, 1"),
        (("1f1b-rr", (1,), 2, 2), "microbatches=2"),
    ],
)
def test_build_rejects(args: tuple, match: str) -> None:
    with pytest.raises(InputError, match=match):
        build_schedule(*args)


def test_validate_catches_backward_before_forward() -> None:
    good = build_schedule("1f1b-rr", (1, 1), 2)
    bad_order = dict(good.actions)
    bad_order[(1, 0)] = tuple(Action.parse(t) for t in "B0 F0 S0 F1 B1 S1".split())
    with pytest.raises(InputError, match="s1r0: B0 at position 0 has no earlier forward"):
        validate(Schedule("1f1b-rr", (1, 1), 2, 1, bad_order))


def test_validate_catches_missing_unit_and_step_mismatch() -> None:
    good = build_schedule("1f1b-rr", (2, 1), 2)
    missing = dict(good.actions)
    missing[(1, 0)] = tuple(Action.parse(t) for t in "F0 B0 S0".split())
    with pytest.raises(InputError, match=r"units \[\(1, 0\)\] never visit stage 1"):
        validate(Schedule("1f1b-rr", (2, 1), 2, 1, missing))
    steps = dict(good.actions)
    steps[(0, 1)] = tuple(Action.parse(t) for t in "F1 B1".split())
    with pytest.raises(InputError, match=r"different numbers of steps \[1, 0\]"):
        validate(Schedule("1f1b-rr", (2, 1), 2, 1, steps))


def test_validate_catches_deadlock() -> None:
    good = build_schedule("1f1b-rr", (1, 1), 2)
    crossed = dict(good.actions)
    # stage 1 wants F1 before B0, stage 0 wants B0 before F1: a cycle
    crossed[(0, 0)] = tuple(Action.parse(t) for t in "F0 B0 S0 F1 B1 S1".split())
    crossed[(1, 0)] = tuple(Action.parse(t) for t in "F0 F1 B0 S0 B1 S1".split())
    with pytest.raises(InputError, match="deadlocks"):
        validate(Schedule("1f1b-rr", (1, 1), 2, 1, crossed))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_built_schedule_validates(name: str) -> None:
    validate(build_schedule(name, (2, 2, 1), 4, 1 if name == "1f1b-rr" else 2))
