"""Tensor parallelism in the contracts and the planner: split costs, degrees, exactness."""

import json
import math
from dataclasses import replace

import pytest

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.plan import Plan
from pipeplan.planner import tp_pricing as tp
from pipeplan.planner.costs import ring_allreduce_ms
from pipeplan.planner.exhaustive import exhaustive_best
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.simulate import simulate_plan
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.schedules import SCHEDULE_KINDS, names_where, or_list
from pipeplan.topology import DeviceSpec, Level, Topology


def block(i: int, heads: int = 8, compute: float = 9.0) -> LayerProfile:
    """A transformer block: 1/9 of its time and 1/40 of its weights repeated on every rank."""
    return LayerProfile(
        i,
        f"h.{i}",
        "Block",
        (i - 1,) if i else (),
        compute / 3,
        2 * compute / 3,
        1000,
        4000,
        2000,
        tp_units=heads,
        tp_split_forward_ms=compute / 3 * 8 / 9,
        tp_split_backward_ms=2 * compute / 3 * 8 / 9,
        tp_split_param_bytes=3900,
        tp_split_saved_bytes=1500,
        tp_allreduce_bytes=1000,
        tp_forward_allreduces=2,
        tp_backward_allreduces=2,
    )


def gpt(n: int = 4, heads: int = 8) -> Profile:
    return Profile(
        "m",
        "fp",
        DeviceInfo("cuda", "x"),
        8,
        "float32",
        tuple(block(i, heads) for i in range(n)),
        optimizer_ms={"sgd": 1.0},
    )


def topology(inner: int = 4, outer: int = 2, memory: int = 10**6) -> Topology:
    return Topology("t", DeviceSpec("d", memory), (Level("node", inner, 1e9), Level("cluster", outer, 1e8)))


def test_split_profile_costs_by_hand():
    profile = gpt(1)
    split = tp.split_profile(profile, topology(), 2)
    layer = split.layers[0]
    ar = float(ring_allreduce_ms(1000.0, 2, 1e9))  # 2 (t-1)/t * 1000 B / 1e9 B/s = 1e-3 ms
    assert ar == pytest.approx(1e-3)
    assert layer.forward_ms == pytest.approx(3.0 - 8 / 3 + 8 / 3 / 2 + 2 * ar)
    assert layer.backward_ms == pytest.approx(6.0 - 16 / 3 + 16 / 3 / 2 + 2 * ar)
    assert (layer.param_bytes, layer.saved_bytes) == (100 + 1950, 500 + 750)
    assert split.optimizer_ms["sgd"] == pytest.approx(2050 / 4000)
    assert not layer.splits  # a split profile is not split again
    eff = tp.split_profile(Profile(**{**profile.__dict__, "tp_efficiency": 0.5}), topology(), 2).layers[0]
    assert eff.forward_ms == pytest.approx(3.0 - 8 / 3 + 8 / 3 / (2 * 0.5) + 2 * ar)


def test_degrees_and_one_line_refusals():
    assert tp.degrees(gpt(heads=8), topology(inner=8), None) == [1, 2, 4, 8]
    assert tp.degrees(gpt(heads=6), topology(inner=8), None) == [1, 2]
    plain = Profile(
        "m",
        "fp",
        DeviceInfo("cpu", "x"),
        8,
        "float32",
        (LayerProfile(0, "l0", "Linear", (), 1.0, 2.0, 4, 4, 4),),
    )
    assert tp.degrees(plain, topology(), None) == [1]
    with pytest.raises(InputError) as e:
        partition(gpt(heads=6), topology(inner=6), PartitionOptions(tensor_parallel=4))
    assert "\n" not in str(e.value) and "innermost level" in str(e.value)
    with pytest.raises(
        InputError, match=r"^tensor-parallel degree 4 does not divide layer 0 \(h.0\)'s 6 heads"
    ):
        partition(gpt(heads=6), topology(inner=8), PartitionOptions(tensor_parallel=4))
    with pytest.raises(InputError, match="no layer of profile m splits"):
        partition(plain, topology(), PartitionOptions(tensor_parallel=2))


def test_group_ranks_are_replica_major_inside_a_node():
    top = topology(inner=4, outer=2)
    grouped = tp.group_topology(top, 2)
    assert [lv.count for lv in grouped.levels] == [2, 2]
    # device-to-device inside a node; across nodes a group's 1/t share of the node's links
    assert [lv.bandwidth_bytes_per_s for lv in grouped.levels] == [1e9, 0.5e8]
    assert [tp.group_ranks(top, 2, g) for g in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b-flush"])
def test_each_degree_is_the_exhaustive_optimum_of_its_split_problem(schedule):
    profile, top = gpt(4), topology(inner=4, outer=2, memory=15_000)
    micro = 1 if schedule != "1f1b-flush" else 2
    # unsharded replicas (zero1 would let t = 1 fit: tests/test_sharding.py)
    options = PartitionOptions(schedule=schedule, optimizer="adam", microbatches=micro, shard="none")
    times = {}
    for t in (1, 2, 4):
        best, _ = exhaustive_best(tp.split_profile(profile, top, t), tp.group_topology(top, t), options)
        fixed = replace(options, tensor_parallel=t)
        if best == math.inf:  # at t = 1 a whole block's Adam state never fits 15,000 B
            with pytest.raises(InfeasibleError, match=f"^with tensor-parallel degree {t} .*no plan fits"):
                partition(profile, top, fixed)
            continue
        plan = partition(profile, top, fixed)
        assert plan.predicted.stage_bound_ms == pytest.approx(best, rel=1e-9)
        assert all(s.tensor_parallel == t and len(s.ranks) == s.replicas * t for s in plan.stages)
        assert plan.used_ranks == tuple(range(8))
        times[t] = plan.predicted.time_per_minibatch_ms
    assert 1 not in times and times  # tensor parallelism plans what t = 1 cannot
    chosen = partition(profile, top, options)
    assert chosen.predicted.time_per_minibatch_ms == pytest.approx(min(times.values()))
    assert chosen.stages[0].tensor_parallel == min(times, key=lambda t: (times[t], t))


# 1f1b-rr, 2bw, zb-h1
@pytest.mark.parametrize("schedule", names_where(lambda kind: not kind.runs_tensor_parallel))
def test_schedules_the_runtime_cannot_split_plan_degree_one(schedule):
    # `pipeplan run` refuses split stages under these schedules: the planner never makes one
    profile, top = gpt(4), topology(inner=4, outer=2, memory=10**9)
    micro = 1 if SCHEDULE_KINDS[schedule].whole_minibatches else 8
    options = PartitionOptions(schedule=schedule, optimizer="adam", microbatches=micro)
    assert {s.tensor_parallel for s in partition(profile, top, options).stages} == {1}
    allowed = or_list(names_where(lambda kind: kind.runs_tensor_parallel))
    with pytest.raises(
        InputError,
        match=rf"^tensor-parallel degree 2 with schedule {schedule}: pipeplan runs "
        rf"split stages with {allowed} only$",
    ):
        partition(profile, top, replace(options, tensor_parallel=2))


def test_plans_without_split_layers_are_unchanged():
    plain = Profile(
        "m",
        "fp",
        DeviceInfo("cpu", "x"),
        8,
        "float32",
        tuple(
            LayerProfile(i, f"l{i}", "Linear", (i - 1,) if i else (), 1.0 + i, 2.0, 400, 4000, 400)
            for i in range(4)
        ),
    )
    top = topology()
    plan = partition(plain, top, PartitionOptions(tensor_parallel=None))
    assert plan == partition(plain, top, PartitionOptions(tensor_parallel=1))
    assert all(s.tensor_parallel == 1 for s in plan.stages)


def test_plan_round_trip_and_group_view(tmp_path):
    plan = partition(
        gpt(4),
        topology(memory=10**9),
        PartitionOptions(schedule="1f1b-flush", microbatches=2, tensor_parallel=2),
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    raw = json.loads(path.read_text())
    assert raw["schema"] == "pipeplan.plan/2" and raw["stages"][0]["tensor_parallel"] == 2
    again = Plan.load(path)
    assert again == plan
    stage = plan.stages[0]
    assert stage.replica_ranks(0) == stage.ranks[:2]
    assert plan.stage_of_rank(stage.ranks[1]) == (0, 0) and plan.stage_of_rank(stage.ranks[2])[1] == 1
    # re-simulating the saved plan gives its own prediction (group view of the plan)
    again_sim = simulate_plan(again, gpt(4))
    assert again_sim.time_per_minibatch_ms == pytest.approx(plan.predicted.time_per_minibatch_ms)


def test_version_1_plans_load_and_bad_rank_counts_refuse(tmp_path):
    plan = partition(gpt(4), topology(memory=10**9), PartitionOptions(tensor_parallel=1))
    raw = plan.to_dict()
    raw["schema"] = "pipeplan.plan/1"
    for stage in raw["stages"]:
        del stage["tensor_parallel"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    assert Plan.load(path) == plan
    raw["stages"][0]["tensor_parallel"] = 2
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match=r"replicas \d+ x tensor_parallel 2 but ranks"):
        Plan.load(path)


def test_version_1_profiles_load(tmp_path):
    profile = gpt(2)
    raw = profile.to_dict()
    assert raw["schema"] == "pipeplan.profile/2"
    raw["schema"] = "pipeplan.profile/1"
    for layer in raw["layers"]:
        for key in [k for k in layer if k.startswith("tp_")]:
            del layer[key]
    del raw["tp_efficiency"], raw["estimated"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    loaded = Profile.load(path)
    assert not any(layer.splits for layer in loaded.layers) and loaded.estimated == ""
    raw["layers"][0]["tp_split_forward_ms"] = 99.0  # more than the layer's forward
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match="tp_split_forward_ms = 99.0 is outside"):
        Profile.load(path)
    assert math.isfinite(loaded.layers[0].forward_ms)


def test_partition_cli_refuses_bad_degrees_in_one_line(tmp_path):
    from click.testing import CliRunner

    from pipeplan.cli import cli

    profile = tmp_path / "gpt.json"
    gpt(4, heads=6).save(profile)
    runner = CliRunner()
    for degree, message in [
        (
            "16",
            "error: tensor-parallel degree 16 does not fit one server of 8 devices: tensor-parallel groups stay "
            "within the topology's innermost level (its fastest links), so t must divide 8",
        ),
        (
            "4",
            "error: tensor-parallel degree 4 does not divide layer 0 (h.0)'s 6 heads (or vocabulary entries)",
        ),
        ("two", "error: --tensor-parallel must be a positive integer or auto (got 'two')"),
    ]:
        out = tmp_path / f"plan-{degree}.json"
        result = runner.invoke(
            cli,
            [
                "partition",
                str(profile),
                "--topology",
                "cluster-b",
                "--tensor-parallel",
                degree,
                "-o",
                str(out),
            ],
        )
        assert result.exit_code == 2 and result.output.strip() == message
        assert not out.exists()
    result = runner.invoke(
        cli,
        [
            "partition",
            str(profile),
            "--topology",
            "cluster-b",
            "--tensor-parallel",
            "2",
            "--schedule",
            "1f1b-flush",
            "--microbatches",
            "4",
            "-o",
            str(tmp_path / "p.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "tensor-parallel 2" in result.output
    assert {s.tensor_parallel for s in Plan.load(tmp_path / "p.json").stages} == {2}
