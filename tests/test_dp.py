"""The hierarchical DP against hand-derived optima and against brute force."""

import math
from dataclasses import replace
from unittest import mock

import pytest
from brute_force import plan_at_brute_force_optimum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.errors import InfeasibleError
from pipeplan.planner.costs import ValueGraph, layer_arrays, ring_allreduce_ms, stage_boundary_bytes
from pipeplan.planner.dp import DPSettings, reconstruct, solve, tables
from pipeplan.planner.dp.bounds import band_bound, data_parallel_bound_ms, lower_bound_ms
from pipeplan.planner.exhaustive import exhaustive_best
from pipeplan.planner.memory import plan_stage_memory
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.precision import Precision
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.topology import DeviceSpec, Level, Topology


def chain(compute_ms, params, outputs, saved):
    layers = tuple(
        LayerProfile(i, f"l{i}", "Linear", () if i == 0 else (i - 1,), c / 4, 3 * c / 4, o, p, s)
        for i, (c, p, o, s) in enumerate(zip(compute_ms, params, outputs, saved))
    )
    return Profile("m", "fp", DeviceInfo("cpu", "test"), 32, "float32", layers)


def two_by_two(memory_bytes=10**12):
    return Topology(
        "2x2",
        DeviceSpec("d", memory_bytes),
        (Level("server", 2, 1e9), Level("cluster", 2, 1e8)),
    )


HAND = chain([4.0] * 4, [10**6] * 4, [10**5] * 4, [10**5] * 4)


def test_hand_checked_2x2():
    """4 layers of 4 ms, 1 MB of parameters and 100 kB of output each, on 2 servers x 2
    devices (1 GB/s inside a server, 100 MB/s between servers).

    - Data parallel: inside a server max(16/2, 2(1/2) 4e6/1e9 s = 4 ms) = 8 ms; across
      servers max(8/2, 2(1/2) 4e6/1e8 s = 40 ms) = 40 ms.
    - Total compute is 16 ms on 4 devices, so nothing beats 4 ms.
    - Servers as two stages [0,2) | [2,4): inside each server the 2 layers replicated on
      2 devices cost max(8/2, 2(1/2) 2e6/1e9 s = 2 ms) = 4 ms; the cut between servers
      costs 2 * 1e5 / 1e8 s = 2 ms; period max(4, 2, 4) = 4 ms: optimal.
    - [0,1) | [1,4) would give max(max(4/2, 1 ms), 2, server 2 with 12 ms of layers) >= 6 ms.
    With 1F1B-RR the input stage (2 replicas of 4 devices) keeps ceil(4/2) = 2 minibatches.
    """
    plan = partition(HAND, two_by_two(), PartitionOptions())
    assert plan.predicted.stage_bound_ms == pytest.approx(4.0)
    # the simulated period adds each replicated stage's 2 ms all-reduce after its compute
    assert plan.predicted.simulated and plan.predicted.time_per_minibatch_ms == pytest.approx(5.0)
    assert plan.predicted.data_parallel_ms == pytest.approx(40.0)
    assert plan.predicted.speedup_vs_data_parallel == pytest.approx(8.0)
    assert plan.predicted.speedup_vs_single_device == pytest.approx(16.0 / 5.0)
    assert [(s.layer_start, s.layer_end, s.ranks) for s in plan.stages] == [(0, 2, (0, 1)), (2, 4, (2, 3))]
    assert plan.in_flight == 2
    assert plan.stages[0].in_flight == 2 and plan.stages[1].in_flight == 1
    # memory: params * (2 stashed versions + the live weights + grad) + saved * in flight
    assert plan.stages[0].memory_bytes == 2 * 10**6 * (2 + 1 + 1) + 2 * 10**5 * 2


def test_hand_checked_memory_changes_the_plan():
    """Same case with 7 MB per device: the replicated [0,2) stage needs 8.4 MB (2 stashed
    versions and the live weights), so server 0 runs [0,1) and [1,2) on one device each (in
    flight 4 and 3: 1 MB x (4 + 1 + 1) + 0.1 MB x 4 = 6.4 MB and 5.3 MB); the period stays
    max(4, 2e5/1e9 s = 0.2, 4, 2, 4) = 4 ms."""
    plan = partition(HAND, two_by_two(7 * 10**6), PartitionOptions())
    assert plan.predicted.stage_bound_ms == pytest.approx(4.0)
    assert [(s.layer_start, s.layer_end, s.replicas) for s in plan.stages] == [
        (0, 1, 1),
        (1, 2, 1),
        (2, 4, 2),
    ]
    assert [s.memory_bytes for s in plan.stages] == [6_400_000, 5_300_000, 4_200_000]
    assert all(s.memory_bytes <= 7 * 10**6 for s in plan.stages)


def test_infeasible_names_the_layer():
    with pytest.raises(InfeasibleError, match=r"layer \d .* needs"):
        partition(HAND, two_by_two(10**6), PartitionOptions())


def test_straight_and_max_stages():
    straight = partition(HAND, two_by_two(), PartitionOptions(straight=True))
    assert [s.replicas for s in straight.stages] == [1, 1, 1, 1]
    assert straight.predicted.stage_bound_ms == pytest.approx(4.0)
    one = partition(HAND, two_by_two(), PartitionOptions(max_stages=1))
    assert len(one.stages) == 1 and one.predicted.stage_bound_ms == pytest.approx(40.0)


def _precision(mixed: bool, profile: Profile) -> Profile:
    """``profile`` as bf16 weights on float32 masters (memory charged 18 B per 2-byte
    parameter with Adam, gradients all-reduced in float32) when ``mixed``."""
    return replace(profile, dtype="bfloat16", master_dtype="float32") if mixed else profile


@st.composite
def cases(draw):
    n = draw(st.integers(1, 6))
    layers = []
    for i in range(n):
        extra = draw(st.lists(st.integers(0, max(i - 1, 0)), max_size=1)) if i > 1 else []
        inputs = tuple(sorted({i - 1, *extra})) if i else ()
        layers.append(
            LayerProfile(
                i,
                f"l{i}",
                "x",
                inputs,
                draw(st.floats(0.1, 5)),
                draw(st.floats(0.1, 5)),
                draw(st.integers(0, 4000)),
                draw(st.integers(0, 8000)),
                draw(st.integers(0, 3000)),
            )
        )
    profile = _precision(
        draw(st.booleans()), Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", tuple(layers))
    )
    if draw(st.booleans()):  # who saved each output: the stages' boundaries are charged
        profile = _with_boundaries(draw, profile)
    counts = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    levels = tuple(
        Level(
            f"l{k}",
            c,
            draw(st.sampled_from([1e6, 3e6, 1e7])),
            draw(st.sampled_from([0.0, 0.0, 0.5])),  # latency, ms
            draw(st.sampled_from([0.0, 0.05, 0.3])),  # message overhead, ms
        )
        for k, c in enumerate(counts)
    )
    memory = draw(st.sampled_from([10**9, 40_000, 25_000, 15_000]))
    # on CPUs (gloo) two replicas sum by one swap, elsewhere by a ring: the DP, its bounds and
    # the brute force price both alike (costs.level_sum_ms)
    kind = draw(st.sampled_from(["gpu", "cpu"]))
    topology = Topology("t", DeviceSpec("d", memory, kind), levels)
    fewer = draw(st.booleans())
    options = PartitionOptions(
        schedule=draw(st.sampled_from(["1f1b-rr", "gpipe"])),
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        straight=draw(st.booleans()),
        use_fewer_devices=fewer,
        max_stages=draw(st.sampled_from([None, None, 1, 2, 3])),
        # the DP charges idle units' devices to in-flight counts (conservative), so the
        # exact-equality claim with idle devices holds without the memory check
        memory_check=not fewer or draw(st.booleans()) and memory == 10**9,
    )
    return profile, topology, options


def _with_boundaries(draw, profile: Profile) -> Profile:
    """``profile`` recording who saved each layer's output (some of its readers, the first
    counting its bytes) and its tensors, so that a stage holds what it receives and sends
    (``costs.stage_boundary_bytes``) in the DP's fit test and the brute force's alike."""
    readers = [[q.index for q in profile.layers if p.index in q.inputs] for p in profile.layers]
    layers = tuple(
        replace(
            layer,
            output_saved_by=tuple(draw(st.lists(st.sampled_from(rs), unique=True))) if rs else (),
            output_tensors=draw(st.integers(1, 2)),
        )
        for layer, rs in zip(profile.layers, readers)
    )
    return replace(profile, layers=layers)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_dp_equals_exhaustive(case):
    profile, topology, options = case
    best, _ = exhaustive_best(profile, topology, options)
    plan = plan_at_brute_force_optimum(best, profile, topology, options)
    if plan is None:
        return
    # simulated: no stage is busier than the period
    period = plan.predicted.time_per_minibatch_ms
    assert plan.predicted.simulated
    assert max(s.time_per_minibatch_ms for s in plan.stages) <= period * (1 + 1e-9)
    replicas = [s.replicas for s in plan.stages]
    graph = ValueGraph.of(profile)
    for q, stage in enumerate(plan.stages):  # never a memory-infeasible plan
        boundary = stage_boundary_bytes(graph, stage.layers, packed_copy=topology.device.kind == "cpu")
        memory, _, _ = plan_stage_memory(
            options.schedule,
            replicas,
            q,
            sum(l.param_bytes for l in profile.layers[stage.layer_start : stage.layer_end]),
            sum(l.saved_bytes for l in profile.layers[stage.layer_start : stage.layer_end]) + boundary,
            options.optimizer,
            precision=plan.precision,
            largest_param_bytes=max(
                l.largest_tensor_bytes for l in profile.layers[stage.layer_start : stage.layer_end]
            ),
        )
        if stage.shard == "none" and not (stage.recompute_layers or stage.selective_layers):
            assert memory == stage.memory_bytes
        else:  # sharded replicas (tests/test_sharding.py) or recomputed layers: no more than
            # plain (as much where nothing shards: no bytes, or ZeRO-1 of SGD's absent state)
            assert stage.memory_bytes <= memory
        if options.memory_check:
            assert stage.memory_bytes <= topology.device.memory_bytes


# --- pruning (planner.dp prunes entries above a limit; results must not change) ---


@st.composite
def large_world_cases(draw):
    """Up to 3 levels of up to 5 units (worlds beyond EXACT_TAU_WORLD round tau) and
    memory that binds at some in-flight counts."""
    n = draw(st.integers(1, 14))
    layers = []
    for i in range(n):
        extra = draw(st.lists(st.integers(0, max(i - 1, 0)), max_size=1)) if i > 1 else []
        layers.append(
            LayerProfile(
                i,
                f"l{i}",
                "x",
                tuple(sorted({i - 1, *extra})) if i else (),
                draw(st.floats(0.0, 5)),
                draw(st.floats(0.0, 5)),
                draw(st.integers(0, 4000)),
                draw(st.integers(0, 8000)),
                draw(st.integers(0, 3000)),
            )
        )
    profile = _precision(
        draw(st.booleans()), Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", tuple(layers))
    )
    counts = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    levels = tuple(
        Level(f"l{k}", c, draw(st.sampled_from([1e6, 3e6, 1e7])), draw(st.sampled_from([0.0, 0.001])))
        for k, c in enumerate(counts)
    )
    memory = draw(st.sampled_from([10**9, 10**6, 200_000, 60_000, 25_000]))
    settings = DPSettings(
        schedule=draw(st.sampled_from(["1f1b-rr", "1f1b-rr", "gpipe"])),
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        straight=draw(st.booleans()),
        max_stages=draw(st.sampled_from([None, None, 2, 4])),
        use_fewer_devices=draw(st.booleans()),
        memory_check=draw(st.booleans()),
        precision=Precision(profile.dtype, profile.master_dtype),
    )
    return profile, Topology("t", DeviceSpec("d", memory), levels), settings


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(large_world_cases())
def test_pruned_equals_unpruned(case):
    """Same optimum and plan (ties included) with and without pruning; the bounds that
    steer the passes hold."""
    profile, topology, dp_settings = case
    arrays = layer_arrays(profile)
    pruned = solve(arrays, topology, dp_settings)
    full = solve(arrays, topology, dp_settings, prune=False)
    assert pruned.time_ms == full.time_ms
    if math.isfinite(full.time_ms):
        assert reconstruct(pruned) == reconstruct(full)
        assert lower_bound_ms(arrays, topology, dp_settings) <= full.time_ms * (1 + 1e-12)
    assert data_parallel_bound_ms(arrays, topology, dp_settings) >= full.time_ms * (1 - 1e-12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(large_world_cases(), st.sampled_from([0.5, 1.0 - 1e-6, 1.0, 1.0 + 1e-6, 3.0]))
def test_capped_solve_is_exact_up_to_its_cap(case, ratio):
    """``cap_ms``: the unpruned optimum and plan when the optimum is within the cap
    (at it too), no plan (inf) above it."""
    profile, topology, dp_settings = case
    arrays = layer_arrays(profile)
    full = solve(arrays, topology, dp_settings, prune=False)
    if not math.isfinite(full.time_ms):
        assert not math.isfinite(solve(arrays, topology, dp_settings, cap_ms=1.0).time_ms)
        return
    cap = full.time_ms * ratio
    capped = solve(arrays, topology, dp_settings, cap_ms=cap)
    if full.time_ms <= cap:
        assert capped.time_ms == full.time_ms and reconstruct(capped) == reconstruct(full)
    else:
        assert capped.time_ms == math.inf


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(large_world_cases(), st.integers(1, 4))
def test_sparse_and_blocked_combines_equal_unpruned(case, block):
    """Every live-choice combine taken sparsely (``SPARSE_SPEEDUP`` 0, ``SHORT_RANGES`` 0)
    and the dense one in blocks of a few starts: still the unpruned optimum and plan."""
    profile, topology, dp_settings = case
    arrays = layer_arrays(profile)
    full = solve(arrays, topology, dp_settings, prune=False)
    with (
        mock.patch.object(tables, "SPARSE_SPEEDUP", 0),
        mock.patch.object(tables, "COLUMN_BLOCK", block),
        mock.patch.object(tables, "SHORT_RANGES", 0),
    ):
        pruned = solve(arrays, topology, dp_settings)
    assert pruned.time_ms == full.time_ms
    if math.isfinite(full.time_ms):
        assert reconstruct(pruned) == reconstruct(full)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(large_world_cases(), st.sampled_from(["1f1b-flush", "gpipe", "1f1b-rr"]))
def test_top_combine_one_unit_count_at_a_time_equals_unpruned(case, schedule):
    """The top level's combine over every first-stage unit count at once, taken one count
    per numpy step (``TOP_BLOCK_ELEMENTS`` 1), with pruned passes (windows of live starts):
    the unpruned optimum and plan, flush schedules (no tau) included."""
    profile, topology, dp_settings = case
    dp_settings = DPSettings(
        schedule,
        dp_settings.optimizer,
        dp_settings.straight,
        dp_settings.max_stages,
        dp_settings.use_fewer_devices,
        dp_settings.memory_check,
        precision=dp_settings.precision,
    )
    arrays = layer_arrays(profile)
    full = solve(arrays, topology, dp_settings, prune=False)
    with mock.patch.object(tables, "TOP_BLOCK_ELEMENTS", 1):
        pruned = solve(arrays, topology, dp_settings)
    assert pruned.time_ms == full.time_ms
    if math.isfinite(full.time_ms):
        assert reconstruct(pruned) == reconstruct(full)


def test_data_parallel_bound_is_the_whole_model_on_every_device():
    """One stage of every layer on all 4 devices: compute / 4, or the all-reduce when it is
    slower; inf when straight (no replication) or when the model does not fit."""
    profile = chain([1.0, 3.0], [4 * 10**5, 4 * 10**5], [0, 0], [10**5, 10**5])
    arrays = layer_arrays(profile)
    topology = two_by_two()
    top, inner = topology.levels[-1], topology.levels[0]
    params = 8 * 10**5
    inner_ms = max(
        4.0 / inner.count,
        ring_allreduce_ms(params, inner.count, inner.bandwidth_bytes_per_s, inner.latency_ms),
    )
    want = max(
        inner_ms / top.count, ring_allreduce_ms(params, top.count, top.bandwidth_bytes_per_s, top.latency_ms)
    )
    assert data_parallel_bound_ms(arrays, topology, DPSettings()) == pytest.approx(want, rel=1e-12)
    assert data_parallel_bound_ms(arrays, topology, DPSettings(straight=True)) == math.inf
    tiny = Topology("t", DeviceSpec("d", 10**6), topology.levels)
    assert data_parallel_bound_ms(arrays, tiny, DPSettings()) == math.inf


def test_band_bound_matches_a_scan():
    """The binary search finds the longest range a linear scan finds."""
    profile = chain(
        [0.5, 3.0, 0.1, 0.1, 2.0, 0.7, 0.2, 4.0],
        [10**6, 0, 5 * 10**6, 0, 10**5, 10**6, 0, 0],
        [10**5] * 8,
        [10**5] * 8,
    )
    arrays = layer_arrays(profile)
    topology = two_by_two()
    lv = topology.levels[-1]
    for bound_ms in (0.5, 1.0, 2.0, 3.5, 6.0, 20.0):
        best = 0
        for i in range(8):
            for j in range(i + 1, 9):
                compute, params = arrays.compute(i, j), arrays.params(i, j)
                low = min(
                    max(compute / (m * 2), 2 * (m - 1) / m * params / lv.bandwidth_bytes_per_s * 1e3)
                    for m in (1, 2)
                )
                if low <= bound_ms * (1 + 1e-12):
                    best = max(best, j - i)
        assert band_bound(arrays, topology, bound_ms) == max(best, 1)


def test_large_world_plan_reconstructs():
    """800 layers of 64 MiB of parameters on 8 x 8 x 64 devices: in-flight counts are
    rounded to powers of two; the plan follows the tables it was computed from (this
    once failed with 'no choice reproduces'). Every top-level cut moves 8 MiB over
    25 GB/s: 2 * 8 MiB / 25e9 B/s = 0.67108864 ms bounds the period."""
    layers = tuple(
        LayerProfile(
            i, f"l{i}", "Block", () if i == 0 else (i - 1,), 0.4, 0.8, 8 * 2**20, 64 * 2**20, 2 * 2**20
        )
        for i in range(800)
    )
    profile = Profile("m", "fp", DeviceInfo("cuda", "x"), 32, "bfloat16", layers)
    topology = Topology(
        "8x8x64",
        DeviceSpec("H100", 80 * 2**30),
        (Level("node", 8, 450e9), Level("rack", 8, 100e9), Level("pod", 64, 25e9)),
    )
    plan = partition(profile, topology, PartitionOptions())
    assert plan.predicted.stage_bound_ms == pytest.approx(2 * 8 * 2**20 / 25e9 * 1e3, rel=1e-12)
    assert not plan.predicted.simulated  # too large to simulate: the cost model's figure
    assert sum(len(s.ranks) for s in plan.stages) <= 4096
    assert all(s.memory_bytes <= 80 * 2**30 for s in plan.stages)
    assert plan.stages[0].layer_start == 0 and plan.stages[-1].layer_end == 800


def test_refuses_in_one_line_before_allocating_tables_over_the_limit(monkeypatch):
    """Issue 13 item 9: the estimate (8 B x [units, band, N + band] per table) is checked
    before any table exists; over the limit, one line naming the figures."""
    from pipeplan.planner.dp import table_bytes

    arrays = layer_arrays(HAND)
    need = table_bytes(arrays, two_by_two(), DPSettings(), 4)
    # q = 1, band 4, rows 4 + 4 + 1 = 9; per row 2 (2 + 1) + 2 (2 + 2) + 8 = 22 tables' rows
    assert need == 8 * 5 * 9 * 22
    monkeypatch.setenv("PIPEPLAN_PLANNER_MEMORY", str(need - 1))
    with pytest.raises(
        InfeasibleError, match=r"^planning 4 cut states on 4 devices .* over the planner's limit"
    ):
        partition(HAND, two_by_two(), PartitionOptions())
    monkeypatch.setenv("PIPEPLAN_PLANNER_MEMORY", str(need))
    assert partition(HAND, two_by_two(), PartitionOptions()).predicted.stage_bound_ms == pytest.approx(4.0)


@pytest.mark.parametrize("devices", [1, 2])
def test_a_whole_model_stage_pays_the_minibatch_draw_once_as_the_brute_force(devices):
    """``data_ms`` (drawing the minibatch) is charged to a first and a last stage: a stage that
    is both pays it once (``LayerArrays.compute``), in the DP's range sums as in the brute force."""
    profile = replace(chain([4.0, 1.0, 1.0], [10**5] * 3, [10**7] * 3, [10**4] * 3), data_ms=2.0)
    topology = Topology("t", DeviceSpec("d", 10**9), (Level("l", devices, 1e9),))
    options = PartitionOptions(optimizer="sgd", use_fewer_devices=True, straight=True)
    best, _ = exhaustive_best(profile, topology, options)
    plan = partition(profile, topology, options)
    assert plan.predicted.stage_bound_ms == pytest.approx(best, rel=1e-9)
    if devices == 1:  # the whole model, the draw paid once: 6 ms of layers + 2 ms, not 10 ms
        assert best == pytest.approx(8.0)
