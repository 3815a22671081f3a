"""The flush-schedule period bound (planner.flush_bound): below every simulated period,
Megatron's bubble for uniform pipelines, and pruning with it keeps partition's plan."""

import math
import sys
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.plan import Plan
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.profiler.estimate import DEVICE_RATES, GPTShape, estimate_gpt
from pipeplan.topology import DeviceSpec, Level, Topology
from pipeplan.planner.cuts import CutFamily
from pipeplan.planner.flush_bound import flush_period_bound_ms
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.placement import FlatStage
from pipeplan.planner.simulate import simulate_plan

partition_module = sys.modules["pipeplan.planner.partition"]  # the package re-exports the function under that name


def flat_of(plan: Plan) -> list[FlatStage]:
    return [FlatStage(stage.layer_start, stage.layer_end, stage.ranks, ()) for stage in plan.stages]


@st.composite
def plans(draw):
    n = draw(st.integers(2, 7))
    layers = tuple(LayerProfile(i, f"l{i}", "x", (i - 1,) if i else (), draw(st.floats(0.1, 5)),
                                draw(st.floats(0.1, 5)), draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6)), 1000)
                   for i in range(n))
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 24, "float32", layers, optimizer_ms={"adam": 0.7})
    counts = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    topology = Topology("t", DeviceSpec("d", 10**12), (Level("a", counts[0], draw(st.sampled_from([1e8, 1e9])), 0.01),
                                                       Level("b", counts[1], 1e7, 0.05)))
    options = PartitionOptions(schedule=draw(st.sampled_from(["1f1b-flush", "gpipe"])), optimizer="adam",
                               microbatches=draw(st.sampled_from([1, 2, 3, 6, 12, 24])), uniform=draw(st.booleans()))
    return profile, topology, options


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_bound_never_exceeds_the_simulated_period(case):
    profile, topology, options = case
    plan = partition(profile, topology, options)
    for steady in (1, 8):
        period = simulate_plan(plan, profile, steady=steady).time_per_minibatch_ms
        bound = flush_period_bound_ms(profile, CutFamily("prefix", len(profile.layers)), flat_of(plan), topology,
                                      options.schedule, options.microbatches, "adam")
        assert 0 < bound <= period * (1 + 1e-12)


def test_uniform_pipeline_bound_is_megatrons_bubble():
    """p equal stages on d devices each, M micro-batches: W (1 + (p - 1) / (M / d)) + S_0,
    W = (F + B) / d, S_0 the first stage's ring all-reduce (no optimizer charged)."""
    p, d, micro = 4, 2, 16
    layers = tuple(LayerProfile(i, f"l{i}", "x", (i - 1,) if i else (), 1.0, 2.0, 8, 10**6, 8) for i in range(p))
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), micro, "float32", layers)
    topology = Topology("t", DeviceSpec("d", 10**12), (Level("node", d, 1e9, 0.0), Level("c", p, 1e8, 0.0)))
    flat = [FlatStage(s, s + 1, tuple(range(s * d, s * d + d)), ()) for s in range(p)]
    allreduce = 2 * (d - 1) / d * 10**6 / 1e9 * 1e3
    want = 3.0 / d * (1 + (p - 1) / (micro / d)) + allreduce
    got = flush_period_bound_ms(profile, CutFamily("prefix", p), flat, topology, "1f1b-flush", micro, None)
    assert got == pytest.approx(want, rel=1e-12)
    assert flush_period_bound_ms(profile, CutFamily("prefix", p), flat, topology, "zb-h1", micro, None) == 0.0


@pytest.mark.parametrize("schedule,micro", [("1f1b-flush", 64), ("1f1b-flush", 256), ("gpipe", 64)])
def test_pruning_by_the_bound_keeps_the_plan(schedule, micro):
    """A what-if GPT on 4 nodes x 8: the plan chosen with the bound pruning candidates
    equals the one chosen when every candidate is simulated (bound 0)."""
    profile = estimate_gpt(GPTShape(16, 2048, 16), DEVICE_RATES["a100-80gb"], 256)
    topology = Topology("t", DeviceSpec("A100", 80 * 2**30), (Level("node", 8, 300e9, 0.002), Level("c", 4, 200e9, 0.005)))
    options = PartitionOptions(schedule=schedule, microbatches=micro, optimizer="adam")
    pruned = partition(profile, topology, options)
    with mock.patch.object(partition_module, "flush_period_bound_ms", lambda *args: 0.0):
        every = partition(profile, topology, options)
    assert pruned == every
    assert math.isfinite(pruned.predicted.time_per_minibatch_ms)
