"""Sharded data parallelism of a stage's replicas in the planner (``planner.sharding``)."""

import math
import signal
from dataclasses import replace

import pytest
from brute_force import plan_at_brute_force_optimum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.plan import Plan
from pipeplan.planner.costs import level_sum_ms
from pipeplan.planner.exhaustive import exhaustive_best
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.sharding import shard_memory_bytes, shard_modes, shard_sync_ms
from pipeplan.planner.simulate import simulate_plan
from pipeplan.precision import Precision
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.topology import DeviceSpec, Level, Topology


def _chain(params: list[int], saved: int = 1000, dtype: str = "float32") -> Profile:
    layers = tuple(
        LayerProfile(
            i, f"l{i}", "Linear", (i - 1,) if i else (), 1.0, 2.0, 100, p, saved, largest_param_bytes=p
        )
        for i, p in enumerate(params)
    )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers)
    return replace(profile, dtype="bfloat16", master_dtype="float32") if dtype == "bfloat16" else profile


def test_memory_per_replica_under_each_mode():
    # bf16 compute, float32 masters, Adam: 18 bytes per parameter unsharded (Megatron's figure);
    # per compute byte 9; zero1 divides the 8 bytes of moments, zero2 also masters and gradients
    mixed = Precision("bfloat16", "float32")
    p = 1000.0  # compute-dtype bytes: 500 parameters
    got = [shard_memory_bytes(m, p, 0.0, 1, 0, "adam", mixed, 4) for m in ("none", "zero1", "zero2", "fsdp")]
    assert got == [9000.0, 9000.0 - 4 * 1000 * 0.75, 1000.0 + 8000.0 / 4, 8000.0 / 4]
    # fsdp gathers the largest layer and the next one (at most the whole stage)
    assert (
        shard_memory_bytes("fsdp", p, 0.0, 1, 0, "adam", mixed, 4, largest_layer_bytes=300.0)
        == 2000.0 + 600.0
    )
    # float32 without masters: the shard of the weights is kept beside the gathered copy
    assert shard_memory_bytes("zero2", p, 0.0, 1, 0, "sgd", Precision(), 2) == 1000.0 + 2 * 1000.0 / 2


def test_collectives_priced_on_the_replica_links():
    mixed = Precision("bfloat16", "float32")
    # 1 MB of bf16 weights, 2 MB of float32 gradients, 2 replicas on 1 GB/s
    ar = 2 * 0.5 * 2e6 / 1e9 * 1e3  # ring all-reduce: 2 ms
    assert shard_sync_ms("none", 1e6, 2, 1e9, 0.0, mixed, 3) == pytest.approx(ar)
    assert shard_sync_ms("zero1", 1e6, 2, 1e9, 0.0, mixed, 3) == pytest.approx(1.5 * ar)
    # per micro-batch: reduce-scatter of gradients + one (zero2) or two (fsdp) all-gathers
    assert shard_sync_ms("zero2", 1e6, 2, 1e9, 0.0, mixed, 3) == pytest.approx(3 * 0.5 * (2e6 + 1e6) / 1e6)
    assert shard_sync_ms("fsdp", 1e6, 2, 1e9, 0.0, mixed, 3) == pytest.approx(3 * 0.5 * (2e6 + 2e6) / 1e6)


def _one_layer_on_a_gloo_pair() -> Plan:
    """The 1F1B-RR plan of one layer (1 ms forward, 1 ms backward, 1 byte of parameters) on
    two CPU devices joined by 0.5 ms of latency, within 60 s (a ``TimeoutError`` past them)."""
    layer = LayerProfile(0, "l0", "x", (), 1.0, 1.0, 0, 1, 0)
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", (layer,))
    levels = (Level("l0", 2, 1e6, latency_ms=0.5), Level("l1", 1, 1e6))
    topology = Topology("t", DeviceSpec("d", 10**9, "cpu"), levels)

    def stop(*_):
        raise TimeoutError("partition did not return in 60 s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)
    try:
        return partition(profile, topology, PartitionOptions(schedule="1f1b-rr"))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_an_unsharded_pair_on_gloo_sums_by_one_swap_as_every_stage_does():
    """Two replicas on gloo swap their gradients in one message (``costs.level_sum_ms``); the
    ``none`` mode of a stage the DP may shard priced a ring of two messages. With the DP's
    bounds on the swap, a pass at the lower bound found no plan and the limit never grew:
    ``partition`` looped forever on this one-layer model (found by tests/test_dp.py's brute
    force, one hypothesis run in about seven)."""
    level = Level("l0", 2, 1e6, latency_ms=0.5)
    swap, ring = 1.0 + 0.5, 2 * 0.5 * 1e3 / 1e6 * 1e3 + 2 * 0.5  # 1 kB of gradients: ms
    assert shard_sync_ms("none", 1e3, 2, 1e6, 0.5, Precision(), 1, on_gloo=True) == pytest.approx(swap)
    assert level_sum_ms(1e3, 2, level, on_gloo=True) == pytest.approx(swap)
    assert shard_sync_ms("none", 1e3, 2, 1e6, 0.5, Precision(), 1) == pytest.approx(ring)

    plan = _one_layer_on_a_gloo_pair()
    # one stage on both devices: half the 2 ms of compute each, above the 0.5 ms swap
    assert [stage.replicas for stage in plan.stages] == [2]
    assert plan.predicted.stage_bound_ms == pytest.approx(1.0)


def test_schedules_refuse_what_they_cannot_combine_with():
    with pytest.raises(InputError, match="--shard fsdp with schedule 1f1b-rr: .*weight versions"):
        shard_modes("fsdp", "1f1b-rr")
    assert shard_modes("auto", "1f1b-rr") == ("none", "zero1")
    assert shard_modes("auto", "gpipe") == ("none", "zero1")  # what `pipeplan run` runs
    assert shard_modes("fsdp", "gpipe") == ("fsdp",)
    with pytest.raises(InputError, match="--shard 'zero3' is not one of"):
        PartitionOptions(shard="zero3").validate()


def _two_devices(memory: int) -> Topology:
    return Topology("t", DeviceSpec("d", memory), (Level("host", 2, 1e9),))


def test_zero1_makes_a_plan_fit_that_none_cannot():
    # one layer of 10,000 float32 bytes, Adam: 40,000 bytes unsharded, 30,000 with zero1 on 2
    profile = _chain([10_000], saved=0)
    topo = _two_devices(35_000)
    with pytest.raises(InfeasibleError, match="no plan fits"):
        partition(profile, topo, PartitionOptions(schedule="gpipe", optimizer="adam", shard="none"))
    plan = partition(profile, topo, PartitionOptions(schedule="gpipe", optimizer="adam"))
    (stage,) = plan.stages
    assert (stage.replicas, stage.shard, stage.shard_degree) == (2, "zero1", 2)
    assert stage.memory_bytes == 30_000  # 10,000 weights + 10,000 gradient + 2 x 10,000 / 2 moments
    roomy = partition(profile, _two_devices(10**9), PartitionOptions(schedule="gpipe", optimizer="adam"))
    assert roomy.stages[0].shard == "none"  # fits unsharded and zero1 sends more: none


def test_a_layer_that_fits_only_sharded_is_not_declared_infeasible():
    # 6,158 B of float32 weights with Adam: 25,001 B unsharded (+ 369 B saved), 18,843 B with
    # zero1 on 2; the DP's early "a layer never fits" check must count the sharded figure
    layers = (
        LayerProfile(0, "l0", "x", (), 1.0, 1.0, 0, 6158, 369),
        LayerProfile(1, "l1", "x", (0,), 1.0, 1.0, 0, 0, 0),
    )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers)
    topo = Topology("t", DeviceSpec("d", 25_000), (Level("l0", 2, 1e6),))
    options = PartitionOptions(schedule="1f1b-rr", optimizer="adam")
    best, _ = exhaustive_best(profile, topo, options)
    plan = partition(profile, topo, options)
    assert plan.predicted.stage_bound_ms == pytest.approx(best)
    assert [(s.replicas, s.shard, s.memory_bytes) for s in plan.stages] == [(2, "zero1", 18_843)]


def test_a_stage_fits_only_sharded_and_recomputing():
    # one layer: 10,000 float32 weight bytes with Adam, 20,000 saved bytes (no input: all freed
    # by recomputation), gpipe with 4 micro-batches (gradient temporary 10,000) in 50,000 bytes:
    # none 70,000; zero1 on 2: 60,000; recomputing: 40,000 + 20,000 / 4 + 10,000 = 55,000;
    # zero1 and recomputing: 30,000 + 5,000 + 10,000 = 45,000, its forward again in compute
    layer = LayerProfile(0, "l0", "Linear", (), 1.0, 2.0, 100, 10_000, 20_000, largest_param_bytes=10_000)
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", (layer,))
    topo = _two_devices(50_000)
    # without offload (optimizer+params on zero2 would fit it alone: tests/test_offload.py)
    options = PartitionOptions(schedule="gpipe", optimizer="adam", microbatches=4, offload="none")
    for alone in (replace(options, shard="none"), replace(options, recompute="none")):
        with pytest.raises(InfeasibleError, match="no plan fits"):
            partition(profile, topo, alone)
        assert exhaustive_best(profile, topo, alone)[0] == math.inf
    plan = partition(profile, topo, options)
    (stage,) = plan.stages
    assert (stage.replicas, stage.shard, stage.shard_degree, stage.recompute_layers) == (2, "zero1", 2, (0,))
    assert (stage.memory_bytes, stage.compute_ms, stage.recompute_ms) == (45_000, 4.0, 1.0)
    assert plan.predicted.stage_bound_ms == exhaustive_best(profile, topo, options)[0] == 2.0
    assert [s.memory_bytes for s in simulate_plan(plan, profile).stages] == [45_000]


@st.composite
def cases(draw):
    n = draw(st.integers(1, 4))
    params = [draw(st.integers(0, 6000)) for _ in range(n)]
    layers = tuple(
        LayerProfile(
            i,
            f"l{i}",
            "x",
            (i - 1,) if i else (),
            draw(st.floats(0.1, 5)),
            draw(st.floats(0.1, 5)),
            draw(st.integers(0, 4000)),
            p,
            draw(st.integers(0, 3000)),
            largest_param_bytes=draw(st.integers(0, p)),
            backward_working_bytes=draw(st.sampled_from([-1, 0, 3000, 9000])),
        )  # fmt: skip
        for i, p in enumerate(params)
    )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers)
    if draw(st.booleans()):
        profile = replace(profile, dtype="bfloat16", master_dtype="float32")
    counts = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    levels = tuple(Level(f"l{k}", c, draw(st.sampled_from([1e6, 3e6, 1e7]))) for k, c in enumerate(counts))
    memory = draw(st.sampled_from([10**9, 60_000, 30_000, 25_000, 15_000]))
    schedule = draw(st.sampled_from(["gpipe", "1f1b-flush", "1f1b-rr"]))
    modes = ["auto", "none", "zero1"] + (["zero2", "fsdp"] if schedule != "1f1b-rr" else [])
    # recomputation too (both compose per stage): full only where it runs (not 1f1b-rr, not mixed)
    recompute = ["auto", "none"] + (
        ["full"] if schedule != "1f1b-rr" and profile.master_dtype is None else []
    )
    options = PartitionOptions(
        schedule=schedule,
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        # the DP charges every 1f1b-flush stage the first stage's in-flight count (exact at M = 1)
        microbatches=draw(st.sampled_from([1, 2, 4])) if schedule == "gpipe" else 1,
        shard=draw(st.sampled_from(modes)),
        straight=draw(st.booleans()),
        recompute=draw(st.sampled_from(recompute)),
        # offload (planner.offload) with each mode; "all" without zero2 / fsdp and any explicit
        # offload on a CPU topology are refused alike by both
        offload=draw(st.sampled_from(["auto", "none", "optimizer", "all"])),
    )
    kind = draw(st.sampled_from(["cuda", "cuda", "cpu"]))
    host = draw(st.sampled_from([None, 1e6, 1e8]))
    return (
        profile,
        Topology("t", DeviceSpec("d", memory, kind), levels, host_bandwidth_bytes_per_s=host),
        options,
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_dp_with_sharding_equals_exhaustive(case):
    """The DP and the brute force agree on every shard request, memory and precision."""
    profile, topology, options = case
    try:
        best, _ = exhaustive_best(profile, topology, options)
    except InputError as exc:
        with pytest.raises(InputError, match=str(exc).split(":")[0]):
            partition(profile, topology, options)
        return
    plan = plan_at_brute_force_optimum(best, profile, topology, options)
    if plan is None:
        return
    for stage in plan.stages:
        assert stage.memory_bytes <= topology.device.memory_bytes
        if options.shard not in ("auto", "none") and stage.shard_degree > 1:
            assert stage.shard == options.shard
        if options.offload in ("optimizer", "all") and stage.shard_degree > 1:
            assert stage.offload == ("optimizer" if options.offload == "optimizer" else "optimizer+params")
        if options.offload == "none" or topology.device.kind == "cpu":
            assert stage.offload == "none"


def test_partition_simulate_and_report_show_each_stages_sharding(tmp_path):
    from click.testing import CliRunner

    from pipeplan.cli import cli
    from pipeplan.cli.report import memory_table
    from pipeplan.plan import Plan

    _chain([10_000], saved=0).save(tmp_path / "profile.json")
    topo = tmp_path / "t.yaml"
    topo.write_text(
        "name: t\ndevice: {name: a, memory: 35000 B}\nlevels:\n  - {name: s, count: 2, bandwidth: 1 GB/s}\n"
    )
    common = ["partition", str(tmp_path / "profile.json"), "--topology", str(topo), "--optimizer", "adam"]
    refused = CliRunner().invoke(cli, [*common, "--schedule", "gpipe", "--shard", "none"])
    assert refused.exit_code == 2 and "error: no plan fits" in refused.output
    bad = CliRunner().invoke(cli, [*common, "--schedule", "1f1b-rr", "--shard", "fsdp"])
    assert bad.exit_code == 2 and "error: --shard fsdp with schedule 1f1b-rr:" in bad.output
    assert "Traceback" not in bad.output
    out = tmp_path / "plan.json"
    wide = {"COLUMNS": "200"}
    result = CliRunner().invoke(cli, [*common, "--schedule", "gpipe", "-o", str(out)], env=wide)
    assert result.exit_code == 0, result.output
    assert "shard" in result.output and "zero1/2" in result.output
    plan = Plan.load(out)
    assert (plan.stages[0].shard, plan.stages[0].shard_degree, plan.stages[0].memory_bytes) == (
        "zero1",
        2,
        30_000,
    )
    simulated = CliRunner().invoke(
        cli, ["simulate", str(out), "--profile", str(tmp_path / "profile.json")], env=wide
    )
    assert simulated.exit_code == 0, simulated.output
    assert "zero1/2" in simulated.output
    from pipeplan.planner.simulate import simulate_plan

    sim = simulate_plan(plan, _chain([10_000], saved=0))
    assert sim.stages[0].memory_bytes == 30_000  # the simulator charges the plan's sharded figure
    # and its sync: all-reduce (2 x 1/2 x 10,000 B) + all-gather (1/2 x 10,000 B) at 1 GB/s
    assert plan.stages[0].allreduce_ms == pytest.approx(15_000 / 1e9 * 1e3)
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(memory_table([{"stage": 0, "replica": 0, "rank": 0}], [s.__dict__ for s in plan.stages]))
    assert "zero1/2" in console.export_text()


def test_old_plans_load_unsharded_and_bad_shards_are_one_line(tmp_path):
    import json

    from pipeplan.plan import Plan

    _chain([10_000], saved=0).save(tmp_path / "profile.json")
    plan = partition(_chain([10_000], saved=0), _two_devices(10**9), PartitionOptions(schedule="gpipe"))
    data = plan.to_dict()
    for stage in data["stages"]:
        stage.pop("shard"), stage.pop("shard_degree")  # a plan written before sharding
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert {(s.shard, s.shard_degree) for s in Plan.load(tmp_path / "old.json").stages} == {("none", 1)}
    data["stages"][0].update(shard="zero1", shard_degree=3)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(
        InputError, match="plan stage 0: shard_degree 3 must be an integer >= 1 dividing its 2 replicas"
    ):
        Plan.load(tmp_path / "bad.json")


def test_a_pass_whose_limit_cannot_grow_ends_without_pruning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The DP's passes end even where a bound disagrees with the tables it prunes: with the
    sharded none mode priced as a ring again (the fault above), the limit stays at the lower
    bound, and the next pass runs without pruning and finds the plan the tables hold. On
    the solver before, this looped forever."""
    from pipeplan.planner.dp import sharded

    def ring(mode, params, units, bandwidth, latency, precision, micro, on_gloo=False):
        return shard_sync_ms(mode, params, units, bandwidth, latency, precision, micro)

    monkeypatch.setattr(sharded, "shard_sync_ms", ring)
    plan = _one_layer_on_a_gloo_pair()
    # the tables' own figure: both devices, at the ring's 1.001 ms (the bound said 1.0)
    assert [stage.replicas for stage in plan.stages] == [2]
    assert plan.predicted.stage_bound_ms == pytest.approx(1.001)
