"""Offload to host memory in the planner (``planner.offload``) and the host link of the topology."""

import json
import math
from dataclasses import replace

import pytest
from brute_force import plan_at_brute_force_optimum
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.cli import cli
from pipeplan.errors import InfeasibleError, InputError
from pipeplan.plan import Plan
from pipeplan.planner.exhaustive import exhaustive_best
from pipeplan.planner.offload import offload_freed_copies, offload_ms
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.sharding import shard_memory_bytes
from pipeplan.planner.simulate import simulate_plan
from pipeplan.precision import Precision
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.runtime.sharding import check_shard
from pipeplan.topology import DeviceSpec, Level, Topology, parse_topology

MIXED = Precision("bfloat16", "float32")


def _one_layer(params: int = 10_000, saved: int = 20_000) -> Profile:
    layer = LayerProfile(0, "l0", "Linear", (), 1.0, 2.0, 100, params, saved, largest_param_bytes=params)
    return Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", (layer,))


def _gpus(memory: int, kind: str = "cuda", host: float | None = None, levels: int = 1) -> Topology:
    inner = (Level("host", 2, 1e9),) + ((Level("pod", 2, 1e8),) if levels == 2 else ())
    return Topology("t", DeviceSpec("d", memory, kind), inner, host_bandwidth_bytes_per_s=host)


def test_the_topology_reads_a_host_link_and_old_topologies_have_none() -> None:
    text = "name: t\ndevice: {name: a, memory: 8 GiB}\nlevels:\n  - {name: s, count: 2, bandwidth: 1 GB/s}\n"
    assert parse_topology(text).host_bandwidth_bytes_per_s is None
    linked = parse_topology(text + "host_link: {bandwidth: 16 GB/s}\n")
    assert linked.host_bandwidth_bytes_per_s == 16e9
    assert Topology.from_dict(linked.to_dict()) == linked
    assert "host_bandwidth_bytes_per_s" not in parse_topology(text).to_dict()  # old readers' form
    with pytest.raises(InputError, match=r"^<topology>:5: 'host_link.bandwidth': "):
        parse_topology(text + "host_link: {bandwidth: -3 GB/s}\n")
    with pytest.raises(InputError, match=r"unknown key 'speed'|'speed'"):
        parse_topology(text + "host_link: {speed: 3 GB/s}\n")
    with pytest.raises(InputError, match="host_bandwidth_bytes_per_s 0 must be a positive number"):
        Topology.from_dict({**linked.to_dict(), "host_bandwidth_bytes_per_s": 0})


def test_what_offload_frees_and_costs_per_replica() -> None:
    # bf16 + float32 masters + Adam: 18 bytes per parameter, 9 per compute byte; on 4 replicas
    p = 1000.0  # compute bytes
    # unsharded: 2 moments + the masters (2 bytes each per compute byte) go to the host: 9 -> 3
    assert shard_memory_bytes("none/optimizer", p, 0.0, 1, 0, "adam", MIXED, 4) == 3000.0
    # zero1 keeps a quarter of the moments and all masters: 6 -> 6 - 1 - 2 = 3
    assert shard_memory_bytes("zero1/optimizer", p, 0.0, 1, 0, "adam", MIXED, 4) == 3000.0
    # zero2: the gathered compute copy and the gradient shard stay: 3 -> 1 + 0.5
    assert shard_memory_bytes("zero2/optimizer", p, 0.0, 1, 0, "adam", MIXED, 4) == 1500.0
    # FSDP2 CPUOffloadPolicy: only the gathered copy (zero2) or gathered layers (fsdp) stay
    assert shard_memory_bytes("zero2/optimizer+params", p, 0.0, 1, 0, "adam", MIXED, 4) == 1000.0
    assert shard_memory_bytes("fsdp/optimizer+params", p, 0.0, 1, 0, "adam", MIXED, 4, 0.0, 200.0) == 400.0
    assert offload_freed_copies("zero2", "adam", MIXED, 4) == 0.0
    with pytest.raises(InputError, match="optimizer\\+params runs with shard zero2 or fsdp, not zero1"):
        offload_freed_copies("zero1/optimizer+params", "adam", MIXED, 4)
    # time: 1 GB of bf16 weights on 2 replicas, 10 GB/s host link, 8 GB/s host Adam (float32 masters)
    # optimizer: per step 1 GB of float32 gradients down + 0.5 GB of weights up, 1 GB of masters stepped
    assert offload_ms("zero1/optimizer", 1e9, 2, MIXED, 4, 1e10) == pytest.approx(150.0 + 125.0)
    # optimizer+params on fsdp, per micro-batch (4): 2 gathers of the 0.5 GB shard up, 1 GB down
    assert offload_ms("fsdp/optimizer+params", 1e9, 2, MIXED, 4, 1e10) == pytest.approx(4 * 200.0 + 125.0)
    assert offload_ms("zero2", 1e9, 2, MIXED, 4, 1e10) == 0.0


def test_offload_makes_a_stage_fit_and_the_dp_agrees_with_the_brute_force() -> None:
    # 10,000 float32 weight bytes with Adam, 20,000 saved, gpipe with 4 micro-batches (gradient
    # temporary 10,000) on 2 GPUs of 40,000 B: none 70,000, zero1 60,000, zero2 and fsdp 60,000;
    # zero2 under CPUOffloadPolicy: 10,000 gathered + 20,000 + 10,000 = 40,000
    profile, topo = _one_layer(), _gpus(40_000, host=1e9)
    options = PartitionOptions(schedule="gpipe", optimizer="adam", microbatches=4, recompute="none")
    with pytest.raises(InfeasibleError, match="no plan fits"):
        partition(profile, topo, replace(options, offload="none"))
    assert exhaustive_best(profile, topo, replace(options, offload="none"))[0] == math.inf
    plan = partition(profile, topo, options)
    (stage,) = plan.stages
    assert (stage.shard, stage.shard_degree, stage.offload, stage.memory_bytes) == (
        "zero2",
        2,
        "optimizer+params",
        40_000,
    )
    # per micro-batch (2 on each replica): 5,000 B up + 5,000 B of gradients down at 1 GB/s,
    # and 5,000 B of float32 masters stepped at 8 GB/s
    assert stage.offload_ms == pytest.approx((2 * 10_000 / 1e9 + 5_000 / 8e9) * 1e3)
    assert plan.predicted.stage_bound_ms == pytest.approx(exhaustive_best(profile, topo, options)[0])
    assert plan.predicted.stage_bound_ms == pytest.approx(3.0 / 2 + stage.offload_ms)
    check_shard(plan, plan.schedule, mixed=False, recompute=False, custom_optimizer=False)  # run runs it
    simulated = simulate_plan(plan, profile)
    # the simulator charges the same offloaded bytes, with each replica's 2 micro-batches of
    # activations (half the minibatch; the planner's bound holds the whole minibatch's)
    assert [s.memory_bytes for s in simulated.stages] == [40_000 - 10_000]
    no_offload = partition(_one_layer(saved=0), _gpus(10**9), options)
    assert no_offload.stages[0].offload == "none"  # roomy: offload only costs time
    # no export carries the offload the plan's memory counts on: one line, each target
    from pipeplan.export import check_plan
    from pipeplan.export.megatron import _check_memory_options

    for check in (check_plan, _check_memory_options):
        with pytest.raises(
            InputError, match=r"^plan stage\(s\) \[0\] offload to host memory, .*--offload none`$"
        ):
            check(plan)


def test_auto_offloads_only_what_pipeplan_run_runs() -> None:
    profile, options = _one_layer(), PartitionOptions(schedule="gpipe", optimizer="adam", microbatches=4)
    tight = _gpus(40_000)
    # a CPU device's memory is its host's: auto never offloads, asking is refused in one line
    with pytest.raises(InfeasibleError):
        partition(profile, _gpus(40_000, kind="cpu"), replace(options, recompute="none"))
    with pytest.raises(InputError, match="^--offload all on a CPU topology: .*offload frees nothing$"):
        partition(profile, _gpus(40_000, kind="cpu"), replace(options, offload="all"))
    # FSDP2 offloads parameters: all needs zero2 or fsdp, which 1f1b-rr cannot gather
    with pytest.raises(InputError, match="^--offload all offloads parameters with FSDP2: it needs"):
        partition(profile, tight, replace(options, shard="zero1", offload="all"))
    # optimizer alone is planned when asked (pipeplan run refuses it), never by auto
    asked = partition(profile, _gpus(50_000), replace(options, offload="optimizer", recompute="none"))
    assert {(s.shard, s.offload) for s in asked.stages} == {("zero1", "optimizer")}
    # auto plans none where pipeplan run runs no FSDP2: mixed precision, two levels, 1f1b-rr
    mixed = replace(profile, dtype="bfloat16", master_dtype="float32")
    for case, topo, opts in (
        (mixed, tight, options),
        (profile, _gpus(40_000, levels=2), options),
        (profile, tight, replace(options, schedule="1f1b-rr", microbatches=1)),
    ):
        try:
            plan = partition(case, topo, replace(opts, recompute="none"))
        except InfeasibleError:
            continue
        assert all(s.offload == "none" and s.shard in ("none", "zero1") for s in plan.stages)


def test_auto_shards_fsdp_where_it_runs_and_only_it_fits() -> None:
    # 4 layers of 2,500 B float32 weights (10,000 B), Adam, 1,250 B saved each, gpipe x 4 on
    # 2 GPUs of 35,000 B; per device: none 40,000 + 5,000 + 2,500 (gradient temporary) = 47,500;
    # zero1 and zero2 30,000 + 7,500 = 37,500; fsdp 20,000 + 5,000 (2 gathered layers) + 7,500
    layers = tuple(
        LayerProfile(i, f"l{i}", "Linear", (i - 1,) if i else (), 1.0, 2.0, 100, 2_500, 1_250, largest_param_bytes=2_500)
        for i in range(4)
    )  # fmt: skip
    profile = replace(_one_layer(), layers=layers)
    options = PartitionOptions(
        schedule="gpipe", optimizer="adam", microbatches=4, recompute="none", offload="none"
    )
    plan = partition(profile, _gpus(35_000), options)
    assert [(s.replicas, s.shard, s.memory_bytes) for s in plan.stages] == [(2, "fsdp", 32_500)]
    check_shard(plan, plan.schedule, mixed=False, recompute=False, custom_optimizer=False)  # run runs it
    assert plan.predicted.stage_bound_ms == pytest.approx(exhaustive_best(profile, _gpus(35_000), options)[0])
    # a weight two layers use (a tie): pipeplan run's FSDP2 refuses it, so auto keeps zero1 / none
    tied = tuple(replace(layer, parameters=("w",)) for layer in layers)
    kept = partition(replace(profile, layers=tied), _gpus(35_000), options)
    assert all(s.shard in ("none", "zero1") for s in kept.stages), kept.stages
    # and on two topology levels (a stage's replicas would shard within a host only)
    split = partition(profile, _gpus(35_000, levels=2), options)
    assert all(s.shard in ("none", "zero1") for s in split.stages), split.stages


def test_partition_simulate_and_report_show_the_offload_and_its_assumption(tmp_path) -> None:
    from pipeplan.cli.report import offload_lines

    _one_layer().save(tmp_path / "profile.json")
    topo = tmp_path / "t.yaml"
    topo.write_text(
        "name: t\ndevice: {name: a, memory: 40000 B}\nlevels:\n  - {name: s, count: 2, bandwidth: 1 GB/s}\n"
    )
    out = tmp_path / "plan.json"
    wide = {"COLUMNS": "220"}
    common = ["partition", str(tmp_path / "profile.json"), "--topology", str(topo), "--optimizer", "adam"]
    common += ["--schedule", "gpipe", "--microbatches", "4", "--recompute", "none"]
    result = CliRunner().invoke(cli, [*common, "-o", str(out)], env=wide)
    assert result.exit_code == 0, result.output
    assert "offload" in result.output and "optimizer+params, +" in result.output
    assert "assumed host link of 25 GB/s (PCIe Gen4 x16 effective" in result.output
    plan = Plan.load(out)
    assert plan.stages[0].offload == "optimizer+params"
    simulated = CliRunner().invoke(
        cli, ["simulate", str(out), "--profile", str(tmp_path / "profile.json")], env=wide
    )
    assert simulated.exit_code == 0 and "optimizer+params, +" in simulated.output, simulated.output
    (line,) = offload_lines(json.loads(out.read_text()))
    assert line.startswith("stage 0 offloads optimizer+params to host memory: +")
    assert "planned memory 39.1 KiB of 39.1 KiB per device" in line
    cpu = topo.read_text().replace("name: a,", "name: a, kind: cpu,")
    (tmp_path / "cpu.yaml").write_text(cpu)
    refused = CliRunner().invoke(
        cli, [*common[:2], "--topology", str(tmp_path / "cpu.yaml"), *common[4:], "--offload", "all"]
    )
    assert refused.exit_code == 2 and "error: --offload all on a CPU topology" in refused.output
    assert "Traceback" not in refused.output


def test_old_plans_load_without_offload_and_bad_offloads_are_one_line(tmp_path) -> None:
    plan = partition(_one_layer(saved=0), _gpus(10**9), PartitionOptions(schedule="gpipe"))
    data = plan.to_dict()
    for stage in data["stages"]:
        stage.pop("offload"), stage.pop("offload_ms")  # a plan written before offload
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert {(s.offload, s.offload_ms) for s in Plan.load(tmp_path / "old.json").stages} == {("none", 0.0)}
    data["stages"][0].update(offload="disk")
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match="^plan stage 0: offload 'disk' is not one of none, optimizer"):
        Plan.load(tmp_path / "bad.json")


@st.composite
def _auto_cases(draw):
    """float32 chains on one level of 2-4 GPUs, gpipe / 1f1b-flush, memories tight enough that
    auto needs zero2, fsdp or offload: where ``auto`` chooses among them."""
    n = draw(st.integers(1, 4))
    layers = tuple(
        LayerProfile(
            i, f"l{i}", "x", (i - 1,) if i else (), draw(st.floats(0.1, 5)), draw(st.floats(0.1, 5)),
            draw(st.integers(0, 4000)), p, draw(st.integers(0, 3000)), largest_param_bytes=draw(st.integers(0, p)),
        )
        for i, p in enumerate(draw(st.integers(0, 6000)) for _ in range(n))
    )  # fmt: skip
    levels = (Level("l0", draw(st.integers(2, 4)), draw(st.sampled_from([1e6, 1e7]))),)
    memory = draw(st.sampled_from([8_000, 12_000, 20_000, 30_000]))
    host = draw(st.sampled_from([None, 1e6, 1e8]))
    schedule = draw(st.sampled_from(["gpipe", "1f1b-flush"]))
    options = PartitionOptions(
        schedule=schedule,
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        microbatches=draw(st.sampled_from([1, 2, 4])) if schedule == "gpipe" else 1,
        straight=draw(st.booleans()),
        recompute=draw(st.sampled_from(["auto", "none"])),
    )
    topology = Topology("t", DeviceSpec("d", memory), levels, host_bandwidth_bytes_per_s=host)
    return replace(_one_layer(), layers=layers), topology, options


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_auto_cases())
def test_dp_equals_the_brute_force_where_auto_shards_fsdp_and_offloads(case) -> None:
    profile, topology, options = case
    best, _ = exhaustive_best(profile, topology, options)
    plan = plan_at_brute_force_optimum(best, profile, topology, options)
    if plan is None:
        return
    check_shard(plan, plan.schedule, mixed=False, recompute=False, custom_optimizer=False)  # run runs it
    for stage in plan.stages:
        assert stage.memory_bytes <= topology.device.memory_bytes
        if stage.shard in ("zero2", "fsdp"):  # auto plans them without recomputation (run refuses it)
            assert stage.recompute_layers == ()
        if stage.offload != "none":
            assert stage.offload == "optimizer+params" and stage.shard in ("zero2", "fsdp")
