"""Schedules as data: literal timetables, routing, warm-up and in-flight counts."""

from __future__ import annotations

import doctest
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeplan.errors import InputError
from pipeplan.schedules import (
    DEFAULT_SCHEDULE,
    DEFAULT_TARGET_SCHEDULE,
    SCHEDULE_KINDS,
    SCHEDULE_NAMES,
    TARGET_SCHEDULES,
    Action,
    Schedule,
    activations_in_flight,
    build_schedule,
    checks,
    engine,
    grid,
    interleaved_warmup,
    kinds,
    names_where,
    peak_in_flight,
    schedule_kind,
    unit_clock,
    validate,
    warmup_forwards,
    weight_versions,
)
from pipeplan.schedules import actions as actions_module
from pipeplan.schedules import orders as orders_module


def orders(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, schedule.actions[w])) for w in schedule.workers]


def test_doctests() -> None:
    results = [doctest.testmod(module) for module in (actions_module, checks, engine, kinds, orders_module)]
    assert sum(r.attempted for r in results) >= 8 and sum(r.failed for r in results) == 0


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
    assert grid(schedule) == STRAIGHT_4
    assert orders(schedule)[0] == ("F0 F1 F2 F3 B0 S0 F4 B1 S1 F5 B2 S2 F6 B3 S3 F7 B4 S4 B5 S5 B6 S6 B7 S7")
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
    assert grid(schedule) == REPLICATED_2_1


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
        assert unit_clock(schedule)[(0, 0)][-1] == 2 * (4 + stages - 1)


def test_flush_and_gpipe_timetables() -> None:
    assert grid(build_schedule("1f1b-flush", (1, 1, 1, 1), 1, 4)) == FLUSH_4x4
    assert grid(build_schedule("gpipe", (1, 1, 1, 1), 1, 4)) == GPIPE_4x4


def test_flush_minibatches_do_not_overlap() -> None:
    schedule = build_schedule("1f1b-flush", (1, 1, 1), 3, microbatches=2)
    steps = unit_clock(schedule)
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


# flushes of one chunk with whole backwards (1f1b-flush, gpipe, ...): closed-form in-flight counts
FLUSH_NAMES = names_where(lambda kind: kind.flush_period_bounded)


@pytest.mark.parametrize("name", FLUSH_NAMES)
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


# --------------------------------------------------------------------------- uneven replicas

# The smallest deadlock of the old 1F1B-flush generator: replicas (1, 3, 1), M = 4. Each
# replica counted S - s of its own micro-batches, so s1r0 (micro-batches 0 and 3) ran
# F0 F3 before B0 while s0r0 runs F3 only after B0: a cycle. Now every replica runs its
# position's order (window D = 3, 3, 1 micro-batches) on its own micro-batches.
UNEVEN_1_3_1 = [
    "F0 F0.1 F0.2 B0 F0.3 B0.1 B0.2 B0.3 S0",
    "F0 B0 F0.3 B0.3 S0",
    "F0.1 B0.1 S0",
    "F0.2 B0.2 S0",
    "F0 B0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3 S0",
]


def test_uneven_replicas_smallest_deadlock_now_runs() -> None:
    flush = build_schedule("1f1b-flush", (1, 3, 1), 1, 4)
    validate(flush)
    assert orders(flush) == UNEVEN_1_3_1
    assert [orders_module.flush_window((1, 3, 1), s, 4) for s in range(3)] == [3, 3, 1]
    zb = build_schedule("zb-h1", (1, 3, 1), 1, 4)
    validate(zb)
    assert orders(zb)[1] == "F0 I0 F0.3 I0.3 W0 W0.3 S0"


@pytest.mark.slow
def test_planner_case_that_deadlocked_runs() -> None:
    # issue 20's planner hit this one (8 stages, 1,536 micro-batches)
    replicas = (32, 32, 74, 74, 74, 74, 95, 57)
    schedule = build_schedule("1f1b-flush", replicas, 3, 1536)
    validate(schedule)
    peaks = [max(peak_in_flight(schedule.actions[(s, r)]) for r in range(n)) for s, n in enumerate(replicas)]
    assert peaks == [8, 7, 4, 4, 4, 3, 2, 1]  # within 1F1B's S - s = 8, 7, ..., 1


def test_flush_window_keeps_the_old_orders_when_replicas_do_not_grow() -> None:
    # n_s * (S - s) falling with s: each replica admits S - s of its own micro-batches, as before
    schedule = build_schedule("1f1b-flush", (2, 2, 1), 1, 8)
    assert orders(schedule)[:2] == [
        "F0 F0.2 F0.4 B0 F0.6 B0.2 B0.4 B0.6 S0",
        "F0.1 F0.3 F0.5 B0.1 F0.7 B0.3 B0.5 B0.7 S0",
    ]


def _kind_args(name: str, replicas: tuple[int, ...], micro: int, minibatches: int) -> tuple[int, int, int]:
    """(minibatches, micro-batches, virtual stages) near the drawn ones that ``name``'s rules accept
    (read from its kind's facts, so a new schedule is drawn too)."""
    kind = SCHEDULE_KINDS[name]
    if kind.gradients == "stashed":
        minibatches *= math.lcm(*replicas)
    if kind.whole_minibatches:
        return minibatches, 1, 1
    if kind.v_shape:  # any count, from DualPipeV's least (2P) on
        least = kind.least_microbatches_per_device * len(replicas)
        return minibatches, least + micro - 1 if least else micro, 2
    if kind.virtual_stages:  # Megatron's rule: a multiple of the positions in each replica's pipeline
        lanes = replicas[0] if kind.replica_pipelines and len(set(replicas)) == 1 else 1
        return minibatches, micro * len(replicas) * lanes, 2
    if kind.gradients == "delayed":
        least = max(n * (warmup_forwards(replicas, s) + 1) for s, n in enumerate(replicas))
        return minibatches, least + micro - 1, 1
    return minibatches, micro, 1


def _skip_connections(schedule: Schedule) -> engine.Durations:
    """Unit durations with every model stage sending to every later one along the layers (a DAG,
    not a chain; later in ``Schedule.pipeline_order``: q + 1, ... or the V's)."""
    q = schedule.model_stages
    one, zero = (1.0,) * q, (0.0,) * q
    order = schedule.pipeline_order()
    sends = tuple(tuple((t, 1.0) for t in order[order.index(s) + 1 :]) for s in range(q))
    return engine.Durations(one, one, one, one, zero, zero, sends)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(SCHEDULE_NAMES),
    replicas=st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple),
    micro=st.integers(1, 9),
    minibatches=st.integers(1, 3),
)
@example(name="1f1b-flush", replicas=(1, 3, 1), micro=4, minibatches=1)  # hypothesis's smallest deadlock
@example(name="zb-h1", replicas=(1, 3, 1), micro=4, minibatches=1)  # of the old generator
def test_every_input_runs_to_completion(
    name: str, replicas: tuple[int, ...], micro: int, minibatches: int
) -> None:
    """Every schedule, any replica counts: it validates (its unit-clock sweep finishes), runs in
    the engine with skip connections, and 1F1B's flush schedules keep 1F1B's bound per replica."""
    k, m, v = _kind_args(name, replicas, micro, minibatches)
    schedule = build_schedule(name, replicas, k, m, v)
    validate(schedule)
    ranks = [[sum(replicas[:i]) + r for r in range(n)] for i, n in enumerate(replicas)]
    timeline = engine.run_schedule(
        schedule, _skip_connections(schedule), ranks, lambda a, b, size: (0.0, 1.0, 0.0)
    )
    assert all(len(timeline.ends[w]) == len(schedule.actions[w]) for w in schedule.workers)
    for (s, _r), actions in schedule.actions.items():
        peak = peak_in_flight(actions)
        if name == "1f1b-flush":  # 1F1B: S - s micro-batches on every replica, the memory model's figure
            assert peak <= min(m, len(replicas) - s)
            assert peak <= activations_in_flight(name, replicas, s, m) * m + 1e-9
        elif name == "zb-h1":  # held until "W": 1F1B's window plus at most s deferred "W"
            assert peak <= min(m, len(replicas))


def _fitting_args(name: str, replicas: tuple[int, ...], minibatches: int) -> tuple[int, int]:
    """(microbatches, virtual stages) that fit ``replicas``: the first of 2, 6, 1 micro-batches
    ``name``'s rules accept (1f1b-rr: 1; 1f1b-flush, gpipe, zb-h1: 2; interleaved-1f1b, 2bw: 6)."""
    kind = SCHEDULE_KINDS[name]
    virtual = 2 if kind.virtual_stages else 1
    for micro in (2, 6, 1):
        try:
            kind.check(replicas, micro, virtual, minibatches)
        except InputError:
            continue
        return micro, virtual
    raise AssertionError(f"{name}: no micro-batch count of 2, 6, 1 fits replicas {replicas}")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_built_schedule_validates(name: str) -> None:
    micro, virtual = _fitting_args(name, (2, 2, 1), 4)
    validate(build_schedule(name, (2, 2, 1), 4, micro, virtual))


# --------------------------------------------------------------------------- registry


KNOWN_FACTS = {  # name -> (flushes, gradients, split backward, virtual stages, whole minibatches)
    "1f1b-rr": (False, "stashed", False, False, True),
    "1f1b-flush": (True, "exact", False, False, False),
    "gpipe": (True, "exact", False, False, False),
    "interleaved-1f1b": (True, "exact", False, True, False),
    "2bw": (False, "delayed", False, False, False),
    "zb-h1": (True, "exact", True, False, False),
}


def test_registry_names_and_facts() -> None:
    """SCHEDULE_NAMES is the registry's, in its order; the known schedules keep their facts
    (a new schedule is appended: these hold with it)."""
    assert SCHEDULE_NAMES == tuple(SCHEDULE_KINDS)
    assert SCHEDULE_NAMES[: len(KNOWN_FACTS)] == tuple(KNOWN_FACTS)
    for name, facts in KNOWN_FACTS.items():
        k = SCHEDULE_KINDS[name]
        got = (k.flushes, k.gradients, k.split_backward, k.virtual_stages, k.whole_minibatches)
        assert got == facts, name
    with pytest.raises(InputError, match="unknown schedule 'pipedream' .*interleaved-1f1b, 2bw, zb-h1"):
        schedule_kind("pipedream")


def test_registry_engine_runtime_and_default_facts() -> None:
    """What export, the runtime and partition read: torch classes, torchtitan names,
    tensor parallelism, recompute, the flush-period bound and the defaults."""
    engines = {
        name: (k.engine.torch_class, k.engine.torchtitan_name)
        for name, k in SCHEDULE_KINDS.items()
        if k.engine and name in KNOWN_FACTS
    }
    assert engines == {
        "1f1b-flush": ("Schedule1F1B", "1F1B"),
        "gpipe": ("ScheduleGPipe", "GPipe"),
        "interleaved-1f1b": ("ScheduleInterleaved1F1B", "Interleaved1F1B"),
        "zb-h1": ("ScheduleInterleavedZeroBubble", "InterleavedZeroBubble"),
    }
    assert SCHEDULE_KINDS["1f1b-rr"].exported_as == "1F1B-RR (PipeDream weight stashing, no flush)"
    known = set(KNOWN_FACTS)
    split = {"1f1b-flush", "gpipe", "interleaved-1f1b"}
    assert set(names_where(lambda k: k.runs_tensor_parallel)) & known == split
    assert set(names_where(lambda k: k.supports_recompute)) & known == {"gpipe"}
    assert set(names_where(lambda k: k.flush_period_bounded)) & known == {"1f1b-flush", "gpipe"}
    assert set(TARGET_SCHEDULES) & known == {"1f1b-flush", "gpipe"}
    assert len(names_where(lambda k: k.default)) == 1 and DEFAULT_SCHEDULE == "1f1b-rr"
    assert len(names_where(lambda k: k.default_for_targets)) == 1 and DEFAULT_TARGET_SCHEDULE == "1f1b-flush"
    assert DEFAULT_TARGET_SCHEDULE in TARGET_SCHEDULES
    for name in TARGET_SCHEDULES:  # --for plans one chunk per device with the DP's cuts
        assert SCHEDULE_KINDS[name].flush_period_bounded, name


@pytest.mark.parametrize(
    "name, replicas, micro, virtual, match",
    [
        (
            "interleaved-1f1b",
            (1, 1),
            3,
            2,
            r"micro-batches \(3\) to be a multiple of the 2 pipeline positions",
        ),
        ("interleaved-1f1b", (1, 1), 4, 1, r"virtual stages >= 2 \(got 1\)"),
        ("zb-h1", (1, 1), 4, 2, r"one model chunk per device \(got virtual stages 2\)"),
        ("2bw", (1, 1, 1), 2, 1, r"micro-batches \(2\) >= 3"),
        ("2bw", (2, 3), 3, 1, r"micro-batches \(3\) >= 6"),
    ],
)
def test_kind_rules_refuse_in_one_line(
    name: str, replicas: tuple[int, ...], micro: int, virtual: int, match: str
) -> None:
    with pytest.raises(InputError, match=match) as caught:
        build_schedule(name, replicas, 2, micro, virtual)
    assert "\n" not in str(caught.value)


# Megatron's interleaved 1F1B, P = 2 devices, v = 2 chunks (model stages 0..3: device 0
# holds chunks c0 = stage 0 and c1 = stage 2), m = 4: device 0 warms up with
# (2-0-1)*2 + (2-1)*2 = 4 forwards, device 1 with 2.
INTERLEAVED_2x2_M4 = """\
step  s0r0    s1r0
   0  F0.0c0  .
   1  F0.1c0  F0.0c0
   2  F0.0c1  F0.1c0
   3  F0.1c1  F0.0c1
   4  F0.2c0  B0.0c1
   5  B0.0c1  F0.1c1
   6  F0.3c0  B0.1c1
   7  B0.1c1  F0.2c0
   8  F0.2c1  B0.0c0
   9  B0.0c0  F0.3c0
  10  F0.3c1  B0.1c0
  11  B0.1c0  F0.2c1
  12  .       B0.2c1
  13  B0.2c1  F0.3c1
  14  .       B0.3c1
  15  B0.3c1  B0.2c0
  16  B0.2c0  B0.3c0
  17  B0.3c0  ."""


def test_interleaved_timetable() -> None:
    schedule = build_schedule("interleaved-1f1b", (1, 1), 1, 4, virtual_stages=2)
    validate(schedule)
    assert grid(schedule) == INTERLEAVED_2x2_M4
    assert orders(schedule) == [
        "F0 F0.1 F0c1 F0.1c1 F0.2 B0c1 F0.3 B0.1c1 F0.2c1 B0 F0.3c1 B0.1 B0.2c1 B0.3c1 B0.2 B0.3 S0",
        "F0 F0.1 F0c1 B0c1 F0.1c1 B0.1c1 F0.2 B0 F0.3 B0.1 F0.2c1 B0.2c1 F0.3c1 B0.3c1 B0.2 B0.3 S0",
    ]
    assert [schedule.model_stage(p, c) for c in range(2) for p in range(2)] == [0, 1, 2, 3]
    assert [interleaved_warmup(4, i, 2) for i in range(4)] == [10, 8, 6, 4]


@pytest.mark.parametrize("positions, virtual, micro", [(2, 2, 4), (2, 3, 6), (4, 2, 8), (3, 2, 6)])
def test_interleaved_in_flight_is_megatron_warmup(positions: int, virtual: int, micro: int) -> None:
    replicas = (1,) * positions
    schedule = build_schedule("interleaved-1f1b", replicas, 2, micro, virtual)
    validate(schedule)
    for (p, _), actions in schedule.actions.items():
        peak = min(interleaved_warmup(positions, p, virtual) + 1, micro * virtual)
        assert peak_in_flight(actions) == peak
        in_flight = activations_in_flight("interleaved-1f1b", replicas, p, micro, virtual)
        assert in_flight == pytest.approx(peak / micro)


def test_interleaved_replicated_runs_the_positions_order() -> None:
    schedule = build_schedule("interleaved-1f1b", (1, 2), 1, 4, virtual_stages=2)
    validate(schedule)
    # units 0, 2 on replica 0 and 1, 3 on replica 1 of position 1, in the unreplicated order
    assert orders(schedule)[1:] == [
        "F0 F0c1 B0c1 F0.2 B0 F0.2c1 B0.2c1 B0.2 S0",
        "F0.1 F0.1c1 B0.1c1 F0.3 B0.1 F0.3c1 B0.3c1 B0.3 S0",
    ]


# ZB-H1, 3 stages, 4 micro-batches, F = I = W = one step: 1F1B's order with B replaced by
# I, and position s deferring s weight-gradient actions W into its bubble. The whole
# minibatch takes 14 steps = 3 * M + (S - 1) (1F1B with B = I + W: 3 * M + 3 * (S - 1)).
ZB_H1_3x4 = """\
step  s0r0  s1r0  s2r0
   0  F0.0  .     .
   1  F0.1  F0.0  .
   2  F0.2  F0.1  F0.0
   3  .     .     I0.0
   4  .     I0.0  F0.1
   5  I0.0  F0.2  I0.1
   6  W0.0  I0.1  F0.2
   7  F0.3  W0.0  I0.2
   8  I0.1  F0.3  W0.0
   9  W0.1  I0.2  F0.3
  10  I0.2  W0.1  I0.3
  11  W0.2  I0.3  W0.1
  12  I0.3  W0.2  W0.2
  13  W0.3  W0.3  W0.3"""


def test_zb_h1_timetable() -> None:
    schedule = build_schedule("zb-h1", (1, 1, 1), 1, 4)
    validate(schedule)
    assert grid(schedule) == ZB_H1_3x4
    assert orders(schedule) == [
        "F0 F0.1 F0.2 I0 W0 F0.3 I0.1 W0.1 I0.2 W0.2 I0.3 W0.3 S0",
        "F0 F0.1 I0 F0.2 I0.1 W0 F0.3 I0.2 W0.1 I0.3 W0.2 W0.3 S0",
        "F0 I0 F0.1 I0.1 F0.2 I0.2 W0 F0.3 I0.3 W0.1 W0.2 W0.3 S0",
    ]


@pytest.mark.parametrize("stages, micro", [(2, 4), (3, 4), (4, 8), (4, 2)])
def test_zb_h1_memory_is_1f1b_peak(stages: int, micro: int) -> None:
    replicas = (1,) * stages
    zb = build_schedule("zb-h1", replicas, 1, micro)
    flush = build_schedule("1f1b-flush", replicas, 1, micro)
    validate(zb)
    peaks = [peak_in_flight(zb.actions[w]) for w in zb.workers]
    assert max(peaks) == max(peak_in_flight(flush.actions[w]) for w in flush.workers)
    for s in range(stages):
        assert activations_in_flight("zb-h1", replicas, s, micro) == pytest.approx(peaks[s] / micro)
    if micro >= stages:  # bubble S - 1 steps (1F1B with B = I + W: 3 (S - 1))
        assert unit_clock(zb)[(0, 0)][-1] == 3 * micro + stages - 1


# PipeDream-2BW, 2 stages, 2 micro-batches, 3 minibatches: 1F1B over the stream of
# micro-batches with no flush; "S" of minibatch t right after the worker's last B of t.
TWO_BW_2x2 = """\
step  s0r0  s1r0
   0  F0.0  .
   1  F0.1  F0.0
   2  .     B0.0
   3  B0.0  F0.1
   4  F1.0  B0.1
   5  B0.1  F1.0
   6  F1.1  B1.0
   7  B1.0  F1.1
   8  F2.0  B1.1
   9  B1.1  F2.0
  10  F2.1  B2.0
  11  B2.0  F2.1
  12  .     B2.1
  13  B2.1  ."""


def test_2bw_timetable_and_versions() -> None:
    schedule = build_schedule("2bw", (1, 1), 3, 2)
    validate(schedule)
    assert grid(schedule) == TWO_BW_2x2
    assert orders(schedule) == [
        "F0 F0.1 B0 F1 B0.1 S0 F1.1 B1 F2 B1.1 S1 F2.1 B2 B2.1 S2",
        "F0 B0 F0.1 B0.1 S0 F1 B1 F1.1 B1.1 S1 F2 B2 F2.1 B2.1 S2",
    ]
    kind = schedule_kind("2bw")
    # minibatch t runs on the weights after t - 1 steps (0 for the first two)
    assert [kind.forward_version(t, steps_done=t) for t in range(4)] == [0, 0, 1, 2]
    assert weight_versions("2bw", (1, 1), 0) == 2
    assert kind.minibatches_in_flight((1, 1)) == 2


@pytest.mark.parametrize("replicas, micro", [((1, 1, 1, 1), 4), ((2, 1), 4), ((1, 2, 1), 4), ((2, 3), 6)])
def test_2bw_keeps_two_versions(replicas: tuple[int, ...], micro: int) -> None:
    schedule = build_schedule("2bw", replicas, 6, micro)
    validate(schedule)  # includes: versions in use <= 2, each exists when needed
    for _worker, actions in schedule.actions.items():
        assert [a.minibatch for a in actions if a.kind == "S"] == list(range(6))


def test_validate_catches_a_third_weight_version() -> None:
    # one stage stepping twice before any backward: F0, F1 on version 0, F2 on 1, F3 on 2
    order = tuple(Action.parse(t) for t in "F0 S0 F1 S1 F2 S2 F3 B0 B1 B2 B3 S3".split())
    with pytest.raises(
        InputError, match="s0r0: F3 makes 3 weight versions in use, more than the 2 2bw keeps"
    ):
        validate(Schedule("2bw", (1,), 4, 1, {(0, 0): order}))
    early = tuple(Action.parse(t) for t in "F0 F1 F2 S0 B0 B1 B2 S1 S2".split())
    with pytest.raises(InputError, match="s0r0: F2 needs weight version 1 but only 0 steps ran"):
        validate(Schedule("2bw", (1,), 3, 1, {(0, 0): early}))


def test_validate_catches_weight_before_input_gradient() -> None:
    good = build_schedule("zb-h1", (1, 1), 1, 2)
    bad = dict(good.actions)
    bad[(1, 0)] = tuple(Action.parse(t) for t in "F0 W0 I0 F0.1 I0.1 W0.1 S0".split())
    with pytest.raises(InputError, match="s1r0: W0 at position 1 has no earlier input gradient"):
        validate(Schedule("zb-h1", (1, 1), 1, 2, bad))


def test_action_with_chunk_round_trips() -> None:
    for text in ("F0c1", "I3.2c3", "W0.1", "S4"):
        assert str(Action.parse(text)) == text
    assert Action.parse("I3.2c3") == Action("I", 3, 2, 3)


def test_plan_virtual_stages_share_the_positions_ranks() -> None:
    import dataclasses
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "runtime"))
    from plans import make_plan

    model = str(Path(__file__).parent / "fixtures" / "runtime" / "dag.py")
    plan = make_plan(
        model, [[0], [1, 2], [3], [4, 5]], [1] * 4, "interleaved-1f1b", microbatches=2, virtual_stages=2
    )
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (0,), (1,)] and plan.world_size == 2
    assert plan.to_dict()["virtual_stages"] == 2
    moved = dataclasses.replace(plan.stages[2], ranks=(1,))
    with pytest.raises(InputError, match=r"stage 2: ranks \[1\] differ from those of stage 0"):
        dataclasses.replace(plan, stages=(*plan.stages[:2], moved, plan.stages[3]))
    with pytest.raises(InputError, match="4 stages, not a multiple of its 3 virtual stages"):
        dataclasses.replace(plan, virtual_stages=3)
