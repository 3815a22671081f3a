"""The simulator: bubble law, agreement with the pipeline DP, links, all-reduce, memory."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pipeplan.errors import InputError
from pipeplan.plan import Plan, Predicted, StagePlan
from pipeplan.planner.simulate import (
    MAX_UNITS,
    OPTIMIZER_STATES,
    allreduce_ms,
    default_minibatches,
    simulate_plan,
    stage_costs,
)
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.schedules import names_where, noam, weight_versions
from pipeplan.topology import DeviceSpec, Level, Topology

GB = 1e9


def make_profile(
    forward: list[float],
    backward: list[float] | None = None,
    output_bytes: int = 0,
    param_bytes: int = 0,
    saved_bytes: int = 0,
    inputs: list[tuple[int, ...]] | None = None,
) -> Profile:
    """A chain (or the DAG ``inputs``) of layers with the given times (ms) and bytes."""
    backward = backward or [2 * f for f in forward]
    layers = tuple(
        LayerProfile(
            index=i,
            name=f"layer{i}",
            type="Linear",
            inputs=inputs[i] if inputs else ((i - 1,) if i else ()),
            forward_ms=f,
            backward_ms=b,
            output_bytes=output_bytes,
            param_bytes=param_bytes,
            saved_bytes=saved_bytes,
        )
        for i, (f, b) in enumerate(zip(forward, backward))
    )
    return Profile("model.py", "fingerprint", DeviceInfo("cpu", "test"), 32, "float32", layers)


def make_topology(
    per_server: int = 8,
    servers: int = 2,
    inside_bytes_per_s: float = 100 * GB,
    between_bytes_per_s: float = 1 * GB,
    latency_ms: float = 0.0,
    memory_bytes: int = 16 * 2**30,
) -> Topology:
    return Topology(
        "test",
        DeviceSpec("test-device", memory_bytes),
        (
            Level("server", per_server, inside_bytes_per_s, latency_ms),
            Level("cluster", servers, between_bytes_per_s, latency_ms),
        ),
    )


def make_plan(
    profile: Profile,
    topology: Topology,
    bounds: list[int],
    replicas: list[int],
    schedule: str = "1f1b-rr",
    microbatches: int = 1,
    ranks: list[tuple[int, ...]] | None = None,
    optimizer: str = "sgd",
) -> Plan:
    """A plan by hand, with the DP's figure: period = max_s compute_s / n_s (no comm)."""
    stages = []
    next_rank = 0
    for s, n in enumerate(replicas):
        start, end = bounds[s], bounds[s + 1]
        compute = sum(layer.compute_ms for layer in profile.layers[start:end])
        stage_ranks = ranks[s] if ranks else tuple(range(next_rank, next_rank + n))
        next_rank += n
        stages.append(StagePlan(s, start, end, n, stage_ranks, compute, 0.0, 0.0, compute / n, 0, 1, 1))
    period = max(stage.time_per_minibatch_ms for stage in stages)
    predicted = Predicted(period, profile.batch_size * 1e3 / period, 1.0, 1.0, period, period)
    return Plan(
        profile.fingerprint,
        profile.model,
        profile.batch_size,
        profile.dtype,
        topology,
        schedule,
        "pipeplan",
        optimizer,
        topology.world_size,
        noam(replicas),
        tuple(stages),
        predicted,
        0,
        microbatches,
    )


# --------------------------------------------------------------------------- bubble law


@pytest.mark.parametrize("schedule", names_where(lambda kind: kind.flush_period_bounded))  # 1f1b-flush, gpipe
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro", [1, 4, 8])
def test_bubble_law(schedule: str, stages: int, micro: int) -> None:
    profile = make_profile([1.0] * stages, [3.0] * stages)  # 4 ms per stage, no comm
    plan = make_plan(profile, make_topology(), list(range(stages + 1)), [1] * stages, schedule, micro)
    result = simulate_plan(plan, profile)
    assert result.time_per_minibatch_ms == pytest.approx((micro + stages - 1) / micro * 4.0)
    for stage in result.stages:
        assert stage.busy_ms == pytest.approx(4.0)
        assert stage.bubble_fraction == pytest.approx((stages - 1) / (micro + stages - 1))


def test_1f1b_rr_has_no_bubble_on_balanced_straight_pipeline() -> None:
    profile = make_profile([1.0] * 4, [3.0] * 4)
    result = simulate_plan(make_plan(profile, make_topology(), [0, 1, 2, 3, 4], [1] * 4), profile)
    assert result.time_per_minibatch_ms == pytest.approx(4.0)
    assert [s.bubble_fraction for s in result.stages] == pytest.approx([0.0] * 4, abs=1e-9)


# --------------------------------------------------------------------------- vs the DP


@pytest.mark.parametrize(
    "forward, bounds, replicas",
    [
        ([1.0, 2.0, 1.5, 0.5, 1.0], [0, 2, 3, 5], [1, 1, 1]),  # straight, unbalanced
        ([1.0] * 15 + [0.1], [0, 15, 16], [7, 1]),  # PipeDream's "15-1" shape
        ([1.0] * 4 + [0.1, 1.0, 1.0], [0, 4, 5, 7], [2, 1, 2]),  # replicated at both ends
        ([1.0] * 6 + [0.5, 0.5], [0, 6, 8], [3, 1]),
    ],
)
def test_1f1b_rr_steady_state_agrees_with_dp(forward, bounds, replicas) -> None:
    profile = make_profile(forward, output_bytes=1_000_000)  # 0.01 ms per message inside a server
    plan = make_plan(profile, make_topology(), bounds, replicas)
    result = simulate_plan(plan, profile)
    predicted = plan.predicted.time_per_minibatch_ms
    assert result.time_per_minibatch_ms == pytest.approx(predicted, rel=0.03)
    assert result.time_per_minibatch_ms >= predicted * (1 - 1e-9)  # never beats the bound


def test_lock_step_allreduce_costs_a_balanced_replicated_pipeline() -> None:
    # Replicas 0 and 1 of stage 0 all-reduce minibatches 2j and 2j+1 together, and the
    # single stage-1 worker returns 2j+1 one period (6 ms) after 2j: each replica idles
    # 6 ms per 12 ms cycle, so the period is 18 / 2 = 9 ms, not the DP's 6 ms.
    profile = make_profile([1.0] * 8)
    plan = make_plan(profile, make_topology(), [0, 4, 6, 8], [2, 1, 1])
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(6.0)
    assert simulate_plan(plan, profile).time_per_minibatch_ms == pytest.approx(9.0)


# --------------------------------------------------------------------------- links


def test_communication_bound_pipeline_runs_at_link_speed() -> None:
    # 0.5 GB over 1 GB/s between servers: 500 ms each way, each direction on its own
    # link, far above the 3 ms of compute per stage. With 2 minibatches in flight the
    # period is half the round trip: (F0 1 + send 500 + 2 + F1 1 + B1 2 + send 500 + 2
    # + B0 2) / 2 = 505 ms.
    profile = make_profile([1.0, 1.0], output_bytes=500_000_000)
    topology = make_topology(per_server=1, servers=2, latency_ms=2.0)
    plan = make_plan(profile, topology, [0, 1, 2], [1, 1])
    result = simulate_plan(plan, profile, record=True)
    assert result.time_per_minibatch_ms == pytest.approx(505.0, rel=1e-9)
    assert result.stages[0].comm_ms == pytest.approx(500.0, rel=0.01)
    assert result.stages[0].bubble_fraction == pytest.approx(1 - 3.0 / 505.0)
    sends = [e for e in result.events() if e.category == "send"]
    assert sends and all(e.duration_ms == pytest.approx(502.0) for e in sends)
    assert {(e.rank, e.name.split()[1][0]) for e in sends} == {(0, "F"), (1, "B")}
    # gpipe streams 8 micro-batch messages of 62.5 ms back to back each way: the first
    # forward, 500 ms of link + 2 ms latency, the last forward and backward on stage 1,
    # 500 + 2 ms back, the last backward on stage 0.
    flush = simulate_plan(plan, profile, schedule="gpipe", microbatches=8)
    expected = 1 / 8 + 502 + 1 / 8 + 2 / 8 + 502 + 2 / 8
    assert flush.time_per_minibatch_ms == pytest.approx(expected, rel=1e-9)


def test_latency_lengthens_the_1f1b_loop() -> None:
    profile = make_profile([1.0, 1.0])
    topology = make_topology(per_server=1, servers=2, latency_ms=0.25)
    plan = make_plan(profile, topology, [0, 1, 2], [1, 1])
    # 2 minibatches in flight share one loop F0 -> F1 -> B1 -> B0 of 6 ms compute plus
    # two 0.25 ms latencies: (6 + 0.5) / 2, above the DP's latency-free 3 ms
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(3.0)
    assert simulate_plan(plan, profile).time_per_minibatch_ms == pytest.approx(3.25)


def with_message_overhead(topology: Topology, overhead_ms: float) -> Topology:
    levels = tuple(replace(level, message_overhead_ms=overhead_ms) for level in topology.levels)
    return replace(topology, levels=levels)


@pytest.mark.parametrize("micro", [1, 2, 4, 8])
@pytest.mark.parametrize("forward_ms", [0.0, 1.0])
def test_a_message_overhead_holds_both_ends_where_latency_overlaps(micro: int, forward_ms: float) -> None:
    # 2 stages, 1F1B-flush: a minibatch sends 2 M messages (M activations, M gradients).
    # Each end of each costs its rank 0.25 ms it cannot overlap, so every message adds
    # 0.25 ms to the period, with or without compute: what bench/bench_exchange.py
    # measured on gloo (0.21-0.25 ms per message at every M), where no latency fits all M
    profile = make_profile([forward_ms or 1e-9] * 2)
    topology = make_topology(per_server=2, servers=1)
    plan = make_plan(profile, topology, [0, 1, 2], [1, 1], "1f1b-flush", micro)
    base = simulate_plan(plan, profile).time_per_minibatch_ms
    held = replace(plan, topology=with_message_overhead(topology, 0.25))
    assert simulate_plan(held, profile).time_per_minibatch_ms - base == pytest.approx(2 * micro * 0.25)
    # a latency as large overlaps: the 1 F and 1 B messages of a pipeline in flight at M = 1,
    # less than one per message beyond
    late = replace(plan, topology=make_topology(per_server=2, servers=1, latency_ms=0.25))
    added = simulate_plan(late, profile).time_per_minibatch_ms - base
    assert added == pytest.approx(0.5) if micro == 1 else added < 2 * micro * 0.25 - 0.25


def test_allreduce_ring_formula_and_data_parallel_period() -> None:
    topology = make_topology(per_server=2, servers=2, latency_ms=0.5)
    # ranks 0..3 span both servers: 2 (4-1)/4 * 1e9 B / 1e9 B/s = 1500 ms + 2*3*0.5 ms
    assert allreduce_ms(topology, [0, 1, 2, 3], 1e9) == pytest.approx(1503.0)
    assert allreduce_ms(topology, [0, 1], 1e9) == pytest.approx(1e9 * 1e3 / (100 * GB) + 1.0)
    assert allreduce_ms(topology, [2], 1e9) == 0.0
    gloo = replace(with_message_overhead(topology, 0.2), device=DeviceSpec("cpu", 2**30, "cpu"))
    # two ranks on gloo swap the tensor and add (runtime.collectives): 1e9 B at 100 GB/s and
    # one message (0.5 ms latency, 0.2 ms overhead), both directions at once
    assert allreduce_ms(gloo, [0, 1], 1e9) == pytest.approx(10.0 + 0.5 + 0.2)
    # four: gloo's all_reduce, priced as a ring of 2 (4 - 1) messages
    assert allreduce_ms(gloo, [0, 1, 2, 3], 1e9) == pytest.approx(1500.0 + 2 * 3 * (0.5 + 0.2))
    profile = make_profile([1.0, 1.0], param_bytes=250_000_000)  # 0.5 GB of parameters
    plan = make_plan(profile, topology, [0, 2], [4])
    result = simulate_plan(plan, profile)
    reduce = allreduce_ms(topology, [0, 1, 2, 3], 5e8)
    assert result.time_per_minibatch_ms == pytest.approx((6.0 + reduce) / 4)


def test_the_plans_all_reduce_figure_is_the_simulators() -> None:
    """A data-parallel plan's printed all-reduce (the cost model's) and the sum the simulator
    charges are one figure: a gloo pair's one swap (it was priced as a ring of 2 before,
    one message too many), 4 ranks' ring, NCCL's ring."""
    level = with_message_overhead(make_topology(latency_ms=0.5), 0.2).levels[0]
    profile = make_profile([10.0] * 2, param_bytes=5_000_000)  # 10 MB of gradients
    for devices, kind in ((2, "cpu"), (4, "cpu"), (2, "gpu")):
        topology = Topology("test", DeviceSpec(kind, 2**34, kind), (replace(level, count=devices),))
        plan = partition_module.partition(profile, topology, partition_module.PartitionOptions())
        (stage,) = plan.stages
        assert stage.replicas == devices
        assert stage.allreduce_ms == pytest.approx(allreduce_ms(topology, list(stage.ranks), 1e7))
        if devices == 2 and kind == "cpu":  # 10 MB at 100 GB/s and one message
            assert stage.allreduce_ms == pytest.approx(0.1 + 0.5 + 0.2)


# --------------------------------------------------------------------------- costs, memory


def test_stage_costs_send_skip_connections_once_per_consumer_stage() -> None:
    # 0 -> 1 -> 2 -> 3, plus skips 0 -> 2 and 0 -> 3; stages {0}, {1}, {2, 3}
    inputs = [(), (0,), (1, 0), (2, 0)]
    profile = make_profile([1.0, 2.0, 3.0, 4.0], output_bytes=100, param_bytes=10, inputs=inputs)
    plan = make_plan(profile, make_topology(), [0, 1, 2, 4], [1, 1, 1])
    costs = stage_costs(plan, profile)
    assert costs[0].sends == ((1, 100), (2, 100))  # layer 0 once to stage 2, not twice
    assert costs[1].sends == ((2, 100),)
    assert costs[2].sends == ()
    assert [c.forward_ms for c in costs] == [1.0, 2.0, 7.0]
    assert [c.param_bytes for c in costs] == [10, 10, 20]
    result = simulate_plan(plan, profile, record=True)
    names = sorted(e.name for e in result.events() if e.category == "send" and e.minibatch == 0)
    assert names == [
        "send B0 ->r0",
        "send B0 ->r0",
        "send B0 ->r1",
        "send F0 ->r1",
        "send F0 ->r2",
        "send F0 ->r2",
    ]


def test_memory_counts_versions_optimizer_and_activations() -> None:
    profile = make_profile([1.0] * 4, param_bytes=1000, saved_bytes=100)
    plan = make_plan(profile, make_topology(), [0, 1, 2, 3, 4], [1] * 4, optimizer="adam")
    rr = simulate_plan(plan, profile)
    flush = simulate_plan(plan, profile, schedule="1f1b-flush", microbatches=4)
    for s in range(4):
        versions = weight_versions("1f1b-rr", (1,) * 4, s)
        extra = 1 + OPTIMIZER_STATES["adam"]
        live = 1 if versions > 1 else 0  # the live weights beside stashed snapshots (runtime/stash.py)
        assert rr.stages[s].memory_bytes == 1000 * (versions + live + extra) + 100 * (4 - s)
        # 4 micro-batches accumulate: one layer's gradient temporary (its 1000 B: no largest recorded)
        assert flush.stages[s].memory_bytes == math.ceil(1000 * (1 + extra) + 100 * (4 - s) / 4 + 1000)
    assert rr.peak_memory_bytes > flush.peak_memory_bytes
    tight = replace(plan, topology=make_topology(memory_bytes=flush.peak_memory_bytes))
    assert simulate_plan(tight, profile, schedule="1f1b-flush", microbatches=4).fits_memory
    assert not simulate_plan(tight, profile).fits_memory


def test_without_profile_uses_plan_figures() -> None:
    profile = make_profile([1.0, 2.0, 1.0])
    plan = make_plan(profile, make_topology(), [0, 1, 3], [1, 1])
    result = simulate_plan(plan, None)
    assert result.time_per_minibatch_ms == pytest.approx(plan.predicted.time_per_minibatch_ms)
    assert [s.memory_bytes for s in result.stages] == [s.memory_bytes for s in plan.stages]


def test_rejects_a_profile_of_another_model() -> None:
    profile = make_profile([1.0, 1.0])
    plan = make_plan(profile, make_topology(), [0, 1, 2], [1, 1])
    other = replace(profile, fingerprint="another")
    with pytest.raises(InputError, match="plan was made for profile fingerprint"):
        simulate_plan(plan, other)


def test_rejects_simulations_too_large() -> None:
    profile = make_profile([1.0, 1.0, 1.0])
    topology = make_topology(per_server=16, servers=64)
    plan = make_plan(profile, topology, [0, 1, 2, 3], [509, 503, 1])  # lcm 256,027
    with pytest.raises(InputError, match=f"> {MAX_UNITS} tasks.*lcm of the replica counts is 256027"):
        simulate_plan(plan, profile)


def test_default_minibatches_cover_warmup_window_and_drain() -> None:
    assert default_minibatches("1f1b-rr", (1, 1, 1, 1), 8) == (16, 4, 8)
    total, warm, window = default_minibatches("1f1b-rr", (2, 3), 8)
    assert warm % 6 == 0 and window % 6 == 0 and window >= 24 and total == 2 * warm + window
    assert default_minibatches("gpipe", (2, 3), 5) == (6, 1, 5)


def test_events_cover_every_task() -> None:
    profile = make_profile([1.0, 1.0, 1.0], param_bytes=1000)
    plan = make_plan(profile, make_topology(), [0, 1, 3], [2, 1])
    result = simulate_plan(plan, profile, record=True)
    events = result.events()
    n = result.minibatches
    assert sum(e.category == "forward" for e in events) == 2 * n
    assert sum(e.category == "backward" for e in events) == 2 * n
    assert sum(e.category == "allreduce" for e in events) == n  # stage 0 only (2 replicas)
    assert {e.rank for e in events if e.stage == 0} == {0, 1}
    assert max(e.end_ms for e in events) == pytest.approx(result.makespan_ms)
    for rank in {e.rank for e in events}:
        compute = sorted((e.start_ms, e.end_ms) for e in events if e.rank == rank and e.tid == 0)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(compute, compute[1:]))  # no overlap


# --------------------------------------------------------------------------- real planner

partition_module = pytest.importorskip("pipeplan.planner.partition")


def test_simulation_agrees_with_planner_on_straight_pipeline() -> None:
    profile = make_profile(
        [1.0, 2.0, 1.5, 0.5, 1.0, 3.0, 0.7, 1.2], output_bytes=100_000, param_bytes=1000, saved_bytes=1000
    )
    options = partition_module.PartitionOptions(straight=True)
    plan = partition_module.partition(profile, make_topology(per_server=4, servers=1), options)
    assert [s.replicas for s in plan.stages] == [1, 1, 1, 1]
    result = simulate_plan(plan, profile)
    assert result.time_per_minibatch_ms == pytest.approx(plan.predicted.time_per_minibatch_ms, rel=0.03)


def test_simulation_agrees_with_planner_on_replicated_pipeline() -> None:
    # compute-heavy layers with few parameters, then two light layers with many:
    # the planner replicates the first stage ("7-1"), like PipeDream's VGG plans.
    profile = make_profile([2.0] * 6 + [0.2] * 2, output_bytes=1_000_000)
    layers = tuple(
        replace(layer, param_bytes=10_000 if layer.index < 6 else 400_000_000) for layer in profile.layers
    )
    profile = replace(profile, layers=layers)
    topology = make_topology(per_server=8, servers=1, inside_bytes_per_s=10 * GB)
    plan = partition_module.partition(profile, topology, partition_module.PartitionOptions())
    assert [s.replicas for s in plan.stages] == [7, 1]
    result = simulate_plan(plan, profile)
    assert result.time_per_minibatch_ms == pytest.approx(plan.predicted.time_per_minibatch_ms, rel=0.03)


def test_choose_schedule_prefers_throughput_within_memory() -> None:
    from pipeplan.planner.auto import choose_schedule

    profile = make_profile([1.0] * 8, param_bytes=1000, saved_bytes=1000)
    options = partition_module.PartitionOptions(microbatches=4, straight=True)
    every = choose_schedule(profile, make_topology(per_server=4, servers=1), options, every_candidate=True)
    name, microbatches, reason = every
    # the default search prunes the slower candidates: the same choice, fewer figures
    pruned = choose_schedule(profile, make_topology(per_server=4, servers=1), options)
    assert pruned[:2] == every[:2] and "pruned (provably slower)" in pruned[2]
    # balanced straight pipeline: 1F1B-RR and 2BW have no bubble (1F1B-RR, with fewer
    # micro-batches, wins the tie), flush schedules (4+4-1)/4, interleaved (v=2) 6 (1 + 3/8),
    # ZB-H1 7.5
    assert (name, microbatches) == ("1f1b-rr", 1)
    assert reason.startswith("1f1b-rr (M=1, v=1) simulates 6.000 ms/minibatch")
    for text in (
        "1f1b-flush M=4 10.500 ms",
        "gpipe M=4 10.500 ms",
        "interleaved-1f1b M=4 8.250 ms",
        "2bw M=4 6.000 ms",
        "zb-h1 M=4 7.500 ms",
    ):
        assert text in reason
    # activations dominate (1 GiB per layer): 1F1B-RR keeps 4 minibatches on stage 0,
    # the others at most one; with 3 GiB per device no 1F1B-RR plan fits, 2BW does
    heavy = make_profile([1.0] * 8, saved_bytes=1 << 30)
    tight = make_topology(per_server=4, servers=1, memory_bytes=3 << 30)
    name, _, reason = choose_schedule(heavy, tight, options, every_candidate=True)
    assert name == "2bw" and "1f1b-rr M=1" not in reason
    assert "1f1b-flush M=4 10.500 ms" in reason


def test_choose_schedule_tries_micro_batch_counts_when_not_given() -> None:
    from pipeplan.planner.auto import choose_schedule

    # Two devices, activations too big for 1F1B-RR's two minibatches in flight on stage 0:
    # a micro-batch schedule must win, and with M > 1 so that it pipelines at all.
    heavy = make_profile([1.0] * 8, saved_bytes=1 << 30)
    tight = make_topology(per_server=2, servers=1, memory_bytes=5 << 30)
    options = partition_module.PartitionOptions(straight=True)
    name, microbatches, reason = choose_schedule(heavy, tight, options, every_candidate=True)
    assert name == "2bw" and microbatches == 2  # every 2BW count takes 12 ms: the fewest wins
    assert reason.startswith("2bw (M=2, v=1) simulates 12.000 ms/minibatch")
    assert "1f1b-flush M=8 13.500 ms" in reason and "zb-h1 M=8 12.500 ms" in reason


def test_the_last_stage_is_charged_the_loss_memory() -> None:
    """The loss's saved bytes count as the last layer's (as its time does), its backward's
    working bytes as the last layer's at least: one micro-batch of each at 1F1B-flush's last
    stage (M = 2: 1 of 2 in flight), nothing at the first."""
    from pipeplan.planner.options import PartitionOptions
    from pipeplan.planner.partition import partition

    base = make_profile([1.0] * 4, param_bytes=1000, saved_bytes=4000)
    options = PartitionOptions(schedule="1f1b-flush", microbatches=2, straight=True, max_stages=2)
    topology = make_topology(per_server=2, servers=1)
    without = partition(base, topology, options)
    with_loss = partition(replace(base, loss_saved_bytes=6000, loss_working_bytes=10000), topology, options)
    assert [s.layers for s in with_loss.stages] == [s.layers for s in without.stages] == [(0, 1), (2, 3)]
    assert with_loss.stages[0].memory_bytes == without.stages[0].memory_bytes
    assert with_loss.stages[1].memory_bytes - without.stages[1].memory_bytes == 6000 / 2 + 10000 / 2
