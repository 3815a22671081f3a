"""The flush-schedule period bound (planner.flush_bound): below every simulated period,
Megatron's bubble for uniform pipelines, and pruning with it keeps partition's plan."""

import math
import sys
from dataclasses import replace
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.errors import InfeasibleError
from pipeplan.plan import Plan
from pipeplan.planner.cuts import CutFamily
from pipeplan.planner.flush_bound import flush_period_bound_ms
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.placement import FlatStage
from pipeplan.planner.simulate import simulate_plan
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.profiler.estimate import DEVICE_RATES, GPTShape, estimate_gpt
from pipeplan.schedules import names_where
from pipeplan.topology import DeviceSpec, Level, Topology
from tests.test_simulate import make_plan, make_profile, make_topology

partition_module = sys.modules[
    "pipeplan.planner.partition"
]  # the package re-exports the function under that name


def flat_of(plan: Plan) -> list[FlatStage]:
    return [FlatStage(stage.layer_start, stage.layer_end, stage.ranks, ()) for stage in plan.stages]


def bound_of(profile: Profile, plan: Plan) -> float:
    """The flush bound of ``plan``'s own stages, schedule and micro-batches."""
    family = CutFamily("prefix", len(profile.layers))
    return flush_period_bound_ms(
        profile, family, flat_of(plan), plan.schedule, plan.microbatches, plan.optimizer
    )


@st.composite
def plans(draw):
    n = draw(st.integers(2, 7))
    layers = tuple(
        LayerProfile(
            i,
            f"l{i}",
            "x",
            (i - 1,) if i else (),
            draw(st.floats(0.1, 5)),
            draw(st.floats(0.1, 5)),
            draw(st.integers(0, 10**6)),
            draw(st.integers(0, 10**6)),
            1000,
        )
        for i in range(n)
    )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 24, "float32", layers, optimizer_ms={"adam": 0.7})
    counts = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    topology = Topology(
        "t",
        DeviceSpec("d", 10**12),
        (Level("a", counts[0], draw(st.sampled_from([1e8, 1e9])), 0.01), Level("b", counts[1], 1e7, 0.05)),
    )
    bounded = names_where(lambda kind: kind.flush_period_bounded)  # 1f1b-flush, gpipe
    options = PartitionOptions(
        schedule=draw(st.sampled_from(bounded)),
        optimizer="adam",
        microbatches=draw(st.sampled_from([1, 2, 3, 6, 12, 24])),
        uniform=draw(st.booleans()),
    )
    return profile, topology, options


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_bound_never_exceeds_the_simulated_period(case):
    profile, topology, options = case
    plan = partition(profile, topology, options)
    for steady in (1, 8):
        period = simulate_plan(plan, profile, steady=steady).time_per_minibatch_ms
        assert 0 < bound_of(profile, plan) <= period * (1 + 1e-12)


@st.composite
def replicated_chains(draw):
    """A chain of 2-4 one-layer stages, each on 1-4 replicas, with its own times, by hand:
    replicated stages feeding slower ones, which partition would rarely choose."""
    stages = draw(st.integers(2, 4))
    forward = [draw(st.floats(0.1, 5)) for _ in range(stages)]
    backward = [draw(st.floats(0.1, 10)) for _ in range(stages)]
    replicas = [draw(st.integers(1, 4)) for _ in range(stages)]
    profile = make_profile(forward, backward)
    plan = make_plan(
        profile,
        make_topology(per_server=16, servers=1, latency_ms=draw(st.sampled_from([0.0, 0.01]))),
        list(range(stages + 1)),
        replicas,
        draw(st.sampled_from(names_where(lambda kind: kind.flush_period_bounded))),
        draw(st.sampled_from([1, 2, 4, 8, 16, 32])),  # the profile's batch is 32
    )
    return profile, plan


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replicated_chains())
def test_bound_holds_for_replicated_stages_feeding_slower_ones(case):
    profile, plan = case
    period = simulate_plan(plan, profile, steady=1).time_per_minibatch_ms
    assert 0 < bound_of(profile, plan) <= period * (1 + 1e-12)


def test_round_trip_term_bounds_a_replicated_stage_feeding_a_slower_one():
    """Stage 0 on 3 replicas (3 ms per micro-batch), stage 1 on 6 (9 ms), 48 micro-batches,
    1f1b-flush: each replica of stage 0 runs 16 micro-batches and keeps at most 2 in flight
    (its window min(M, 3 x 2) = 6 over 3 replicas), each for a round trip of 3 + 9 ms, so
    it needs 16 x 12 / 2 = 96 ms; its busy time alone (48) and stage 1's (3 + 8 x 9 = 75)
    say less. The simulation (no sends, free links) takes no less."""
    profile = replace(make_profile([48.0, 144.0], [96.0, 288.0]), batch_size=48)  # per minibatch
    plan = make_plan(profile, make_topology(), [0, 1, 2], [3, 6], "1f1b-flush", 48)
    assert bound_of(profile, plan) == pytest.approx(96.0, rel=1e-12)
    period = simulate_plan(plan, profile, steady=1).time_per_minibatch_ms
    assert 96.0 <= period <= 96.0 * 1.1


def test_uniform_pipeline_bound_is_megatrons_bubble():
    """p equal stages on d devices each, M micro-batches: W (1 + (p - 1) / (M / d)) + S_0,
    W = (F + B) / d, S_0 the first stage's step (none charged; its sync is left out)."""
    p, d, micro = 4, 2, 16
    layers = tuple(
        LayerProfile(i, f"l{i}", "x", (i - 1,) if i else (), 1.0, 2.0, 8, 10**6, 8) for i in range(p)
    )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), micro, "float32", layers)
    flat = [FlatStage(s, s + 1, tuple(range(s * d, s * d + d)), ()) for s in range(p)]
    want = 3.0 / d * (1 + (p - 1) / (micro / d))
    got = flush_period_bound_ms(profile, CutFamily("prefix", p), flat, "1f1b-flush", micro, None)
    assert got == pytest.approx(want, rel=1e-12)
    assert flush_period_bound_ms(profile, CutFamily("prefix", p), flat, "zb-h1", micro, None) == 0.0


@pytest.mark.parametrize("schedule,micro", [("1f1b-flush", 64), ("1f1b-flush", 256), ("gpipe", 64)])
def test_pruning_by_the_bound_keeps_the_plan(schedule, micro):
    """A what-if GPT on 4 nodes x 8: the plan chosen with the bound pruning candidates
    equals the one chosen when every candidate is simulated (bound 0)."""
    profile = estimate_gpt(GPTShape(16, 2048, 16), DEVICE_RATES["a100-80gb"], 256)
    topology = Topology(
        "t", DeviceSpec("A100", 80 * 2**30), (Level("node", 8, 300e9, 0.002), Level("c", 4, 200e9, 0.005))
    )
    options = PartitionOptions(schedule=schedule, microbatches=micro, optimizer="adam")
    pruned = partition(profile, topology, options)
    with mock.patch.object(partition_module, "flush_period_bound_ms", lambda *args: 0.0):
        every = partition(profile, topology, options)
    assert pruned == every
    assert math.isfinite(pruned.predicted.time_per_minibatch_ms)


def chain_profile(layers: int, saved_bytes: int) -> Profile:
    return Profile(
        "m",
        "fp",
        DeviceInfo("cpu", "x"),
        8,
        "float32",
        tuple(
            LayerProfile(i, f"l{i}", "x", (i - 1,) if i else (), 1.0, 2.0, 8, 0, saved_bytes)
            for i in range(layers)
        ),
    )


def test_fewest_stages_prove_infeasibility_without_passes():
    """8 layers of 1 MB saved, gpipe (a whole minibatch in flight), 2.5 MB per device: at
    least 4 stages of 2 layers; on 3 devices nothing fits, on 4 a plan does (as unpruned)."""
    from pipeplan.planner.costs import layer_arrays
    from pipeplan.planner.dp import DPSettings, solve
    from pipeplan.planner.dp.bounds import fewest_stages

    arrays = layer_arrays(chain_profile(8, 10**6))
    for devices, feasible in ((3, False), (4, True)):
        topology = Topology("t", DeviceSpec("d", int(2.5e6)), (Level("n", devices, 1e9),))
        settings = DPSettings(schedule="gpipe")
        assert fewest_stages(arrays, topology, settings) == 4
        assert math.isfinite(solve(arrays, topology, settings).time_ms) == feasible
        assert (
            solve(arrays, topology, settings).time_ms
            == solve(arrays, topology, settings, prune=False).time_ms
        )
    small = Topology("t", DeviceSpec("d", int(0.5e6)), (Level("n", 16, 1e9),))
    assert (
        fewest_stages(arrays, small, DPSettings(schedule="gpipe")) == math.inf
    )  # one layer alone is too big


def test_uniform_plans_when_the_dp_charge_finds_nothing():
    """8 layers on 2 x 8 devices, the first saving 8 MB, 1f1b-flush with 8 micro-batches,
        3 MB per device: the DP charges any stage min(M, K) / M = 8/8 of its activations (K = 8
        = the stages it might plan), so the first layer fits nowhere; a uniform pipeline of p
        stages holds min(M, p - s) / M: one stage on all 16 devices holds 1/8 of 8 MB, and
        is planned (before, the DP's failure hid it). Without recomputation: with it, the DP fits
    the first layer by recomputing it (tests/test_recompute.py)."""
    layers = tuple(
        LayerProfile(i, f"l{i}", "x", (i - 1,) if i else (), 1.0, 2.0, 8, 0, 8 * 10**6 if i == 0 else 1000)
        for i in range(8)
    )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers)
    topology = Topology("t", DeviceSpec("d", 3 * 10**6), (Level("n", 2, 1e9), Level("c", 8, 1e8)))
    plan = partition(
        profile,
        topology,
        PartitionOptions(schedule="1f1b-flush", microbatches=8, uniform=True, recompute="none"),
    )
    assert [(s.replicas, len(s.layers)) for s in plan.stages] == [(16, 8)]
    assert plan.stages[0].memory_bytes <= 3 * 10**6 and plan.predicted.simulated
    with pytest.raises(InfeasibleError):
        partition(
            profile,
            topology,
            PartitionOptions(schedule="1f1b-flush", microbatches=8, uniform=False, recompute="none"),
        )
