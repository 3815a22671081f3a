"""Selective recomputation and sequence parallelism in the planner (Korthikanti et al. 2022):
the estimated figures against the paper's Table 2, the DP against brute force, the plan
contract, sequence parallelism's memory and the one-line refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from brute_force import plan_at_brute_force_optimum
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.cli import cli
from pipeplan.errors import InputError
from pipeplan.plan import Plan
from pipeplan.planner import tp_pricing as tp
from pipeplan.planner.exhaustive import exhaustive_best
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.recompute import choose, selective_freed_bytes, selective_option
from pipeplan.planner.recompute_choice import recompute_candidates
from pipeplan.planner.simulate import stage_costs
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.profiler.estimate import DEVICE_RATES, GPTShape, estimate_gpt
from pipeplan.topology import DeviceSpec, Level, Topology

A100 = DEVICE_RATES["a100-80gb"]


def _chain(saved: list[int], selective: list[int], core_ms: list[float], forward: list[float]) -> Profile:
    """A chain whose layer i saves ``saved[i]``, keeps its producer's 100-byte output when
    recomputed whole and ``selective[i]`` (-1: no attention core) when only its core is."""
    layers = tuple(
        LayerProfile(
            i,
            f"l{i}",
            "Block",
            (i - 1,) if i else (),
            forward[i],
            2 * forward[i],
            100,
            100,
            s,
            selective_saved_bytes=min(sel, s),
            selective_recompute_ms=core if sel >= 0 else -1.0,
        )
        for i, (s, sel, core) in enumerate(zip(saved, selective, core_ms))
    )
    return Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers)


def test_estimated_block_bytes_are_the_papers_table_2() -> None:
    """Korthikanti et al., Table 2, per layer and rank: no recomputation s b h (34 + 5 a s / h);
    selective 34 s b h; full 2 s b h; tensor parallel t: s b h (10 + 24 / t + 5 a s / (h t)),
    selective s b h (10 + 24 / t); with sequence parallelism each divided by t (full: 2 s b h / t).
    The GPT-3 175B shape (a = 96, h = 12288, s = 2048), b = 1, t = 8."""
    shape, b, t = GPTShape(layers=2, hidden=12288, heads=96), 1, 8
    s, h, a = shape.seq_len, shape.hidden, shape.heads
    sbh = s * b * h
    block = estimate_gpt(shape, A100, b, recompute=False).layers[1]
    assert block.saved_bytes == int(sbh * (34 + 5 * a * s / h))
    assert block.selective_saved_bytes == 34 * sbh
    assert block.recompute_kept_bytes == 2 * sbh
    top = Topology("a", DeviceSpec("a", 80 * 2**30), (Level("node", 8, 300e9),))
    profile = estimate_gpt(shape, A100, b, recompute=False)
    plain = tp.split_profile(profile, top, t).layers[1]
    assert plain.saved_bytes == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), abs=1)
    assert plain.selective_saved_bytes == pytest.approx(sbh * (10 + 24 / t), abs=1)
    assert plain.recompute_kept_bytes == 2 * sbh  # the block's input, whole on every rank
    sp = tp.split_profile(profile, top, t, sequence_parallel=True).layers[1]
    assert sp.saved_bytes == pytest.approx(sbh * (34 + 5 * a * s / h) / t, abs=2)
    assert sp.selective_saved_bytes == pytest.approx(34 * sbh / t, abs=2)
    assert sp.recompute_kept_bytes == 2 * sbh / t
    # the attention core splits by heads; sequence parallelism divides the repeated kernels only
    assert (
        sp.selective_recompute_ms
        == plain.selective_recompute_ms
        == pytest.approx(block.selective_recompute_ms / t)
    )
    assert sp.forward_ms < plain.forward_ms and sp.forward_ms == pytest.approx(
        plain.forward_ms - (block.forward_ms - block.tp_split_forward_ms) * (1 - 1 / t)
    )


def test_estimated_attention_core_time_is_its_flops_and_traffic() -> None:
    """The core's ms: two batched GEMMs of 2 b s^2 h FLOPs each at their roofline plus the
    softmax and dropout traffic (4.5 a s 2-byte elements per token), a share of the block
    that grows with s / h; a profile estimated with full recomputation has no selective option."""
    shape, b = GPTShape(layers=1, hidden=12288, heads=96), 4
    block = estimate_gpt(shape, A100, b, recompute=False).layers[1]
    tokens, s, h, a = b * shape.seq_len, shape.seq_len, shape.hidden, shape.heads
    flops_s, bytes_s = A100.matmul_flops_per_s * 0.687, A100.memory_bandwidth_bytes_per_s * 0.8
    gemm = max(tokens * 2.0 * s * h / flops_s, tokens * (2.0 * h + a * s) * 2 / bytes_s)
    expected = (2 * gemm + tokens * 4.5 * a * s * 2 / bytes_s) * 1e3
    assert block.selective_recompute_ms == pytest.approx(expected, rel=1e-3)
    assert 0.05 < block.selective_recompute_ms / block.forward_ms < 0.25
    recomputed = estimate_gpt(shape, A100, b).layers[1]
    assert (recomputed.selective_saved_bytes, recomputed.selective_recompute_ms) == (-1, -1.0)


def test_candidates_and_choice_per_mode() -> None:
    profile = _chain([1000, 1000, 50], [300, -1, 40], [0.5, 0.0, 0.2], [1.0, 2.0, 4.0])
    assert selective_freed_bytes(profile) == [700.0, 0.0, 10.0]
    sel = selective_option(profile, (0, 1, 2), microbatches=2)
    assert (sel.selective, sel.layers, sel.extra_ms) == ((0, 2), (), pytest.approx(0.7))
    assert (sel.activation_bytes, sel.transient_bytes) == (2050.0 - 710.0, 350.0)
    auto = recompute_candidates(profile, (0, 1, 2), 2, "auto")
    assert [o.extra_ms for o in auto] == pytest.approx([0.0, 1.0, 3.0, 0.7])
    # auto: the least extra ms that fits (selective beats recomputing layers 0 and 1 whole)
    assert choose(auto, "auto", lambda o: o.activation_bytes <= 1400) is auto[-1]
    assert choose(auto, "auto", lambda o: o.activation_bytes <= 1100) is auto[1]
    assert choose(recompute_candidates(profile, (0, 1, 2), 2, "selective"), "selective", None) == sel
    assert choose(recompute_candidates(profile, (1,), 2, "selective"), "selective", None).selective == ()


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Profile, Topology, PartitionOptions]:
    n = draw(st.integers(2, 6))
    saved = [draw(st.integers(0, 4000)) for _ in range(n)]
    selective = [draw(st.integers(-1, 4000)) for _ in range(n)]
    core = [draw(st.floats(0.0, 2.0)) for _ in range(n)]
    forward = [draw(st.floats(0.1, 5.0)) for _ in range(n)]
    profile = _chain(saved, selective, core, forward)
    schedule = draw(st.sampled_from(["gpipe", "1f1b-flush"]))
    micro = draw(st.sampled_from([1, 2])) if schedule == "gpipe" else 1
    options = PartitionOptions(
        schedule=schedule,
        microbatches=micro,
        recompute=draw(st.sampled_from(["auto", "auto", "selective", "full", "none"])),
        straight=draw(st.booleans()),
    )
    memory = draw(st.sampled_from([10**9, 9000, 6000, 4000, 2500]))
    devices = draw(st.integers(1, 3))
    return profile, Topology("t", DeviceSpec("d", memory), (Level("n", devices, 1e9),)), options


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_dp_with_selective_equals_brute_force(case: tuple[Profile, Topology, PartitionOptions]) -> None:
    """The DP's optimum is brute force's (every split, replication and per-stage choice of
    none / selective / the first k recomputed whole), on chains under schedules whose
    in-flight count the DP charges exactly; each stage's recorded choice prices as planned."""
    profile, topology, options = case
    best, _ = exhaustive_best(profile, topology, options)
    plan = plan_at_brute_force_optimum(best, profile, topology, options)
    if plan is None:
        return
    freed = selective_freed_bytes(profile)
    for stage in plan.stages:
        assert stage.memory_bytes <= topology.device.memory_bytes
        assert not (stage.selective_layers and stage.recompute_layers)
        assert stage.recompute_ms == pytest.approx(
            sum(profile.layers[i].forward_ms for i in stage.recompute_layers)
            + sum(profile.layers[i].selective_recompute_ms for i in stage.selective_layers)
        )
        if stage.selective_layers:
            assert stage.selective_layers == tuple(i for i in stage.layers if freed[i] > 0)
        if options.recompute in ("none", "full"):
            assert stage.selective_layers == ()
        if options.recompute in ("none", "selective"):
            assert stage.recompute_layers == ()


def _gpt_plan(mode: str, sequence_parallel: str = "auto", gib: int = 8, t: int | None = None) -> Plan:
    profile = estimate_gpt(GPTShape(layers=8, hidden=1024, heads=16), A100, 64, recompute=False)
    top = Topology("a", DeviceSpec("a", gib * 2**30), (Level("node", 8, 300e9), Level("hosts", 1, 25e9)))
    options = PartitionOptions(
        schedule="1f1b-flush",
        microbatches=8,
        optimizer="adam",
        recompute=mode,
        sequence_parallel=sequence_parallel,
        tensor_parallel=t,
    )
    return partition(profile, top, options)


def test_auto_is_never_slower_than_none_or_selective_and_picks_selective() -> None:
    """A what-if GPT (bf16 on float32 masters: an estimated profile plans recomputation at
    every degree and precision) in 8 GiB: ``auto`` recomputes attention cores, faster than
    ``none`` (which must split tensors 8 ways) and than ``full``; the simulator charges the
    stage what the planner recorded."""
    none, auto, full = _gpt_plan("none", "off"), _gpt_plan("auto", "off"), _gpt_plan("full", "off")
    assert (
        auto.predicted.time_per_minibatch_ms <= _gpt_plan("selective", "off").predicted.time_per_minibatch_ms
    )
    assert auto.predicted.time_per_minibatch_ms < 0.9 * none.predicted.time_per_minibatch_ms
    assert auto.predicted.time_per_minibatch_ms < full.predicted.time_per_minibatch_ms
    assert all(s.selective_layers == tuple(range(1, 9)) and not s.recompute_layers for s in auto.stages)
    assert auto.recompute == "auto" and full.recompute == "full"
    profile = estimate_gpt(GPTShape(layers=8, hidden=1024, heads=16), A100, 64, recompute=False)
    _, split = tp.group_view(auto, profile)
    assert split is not None
    costs = stage_costs(tp.group_view(auto, profile)[0], split)
    block = split.layers[1]
    assert costs[0].backward_ms == pytest.approx(
        sum(layer.backward_ms for layer in split.layers) + 8 * block.selective_recompute_ms
    )
    assert costs[0].saved_bytes == pytest.approx(
        sum(layer.saved_bytes for layer in split.layers)
        - 8 * (block.saved_bytes - block.selective_saved_bytes),
        abs=8,
    )


def test_sequence_parallelism_lowers_a_split_stages_memory_by_the_repeated_share() -> None:
    """At t = 4 the same stages with and without sequence parallelism: the activations a stage
    keeps per micro-batch fall by the repeated share (10 s b h of each block, the layer norms'
    and dropouts') times (1 - 1/t), each plan records it, and it is never slower."""
    on, off = _gpt_plan("none", "on", gib=80, t=4), _gpt_plan("none", "off", gib=80, t=4)
    assert [s.layers for s in on.stages] == [s.layers for s in off.stages]
    assert all(s.sequence_parallel for s in on.stages) and not any(s.sequence_parallel for s in off.stages)
    profile = estimate_gpt(GPTShape(layers=8, hidden=1024, heads=16), A100, 64, recompute=False)
    for a, b in zip(on.stages, off.stages):
        repeated = sum(
            profile.layers[i].saved_bytes - profile.layers[i].tp_split_saved_bytes for i in a.layers
        )
        in_flight = min(on.microbatches, len(on.stages) - a.index) / on.microbatches
        expected = repeated * (1 - 1 / 4) * in_flight
        assert b.memory_bytes - a.memory_bytes == pytest.approx(expected, rel=1e-6, abs=16)
    assert on.predicted.time_per_minibatch_ms <= off.predicted.time_per_minibatch_ms


def test_refusals_are_one_line() -> None:
    with pytest.raises(InputError, match=r"^--recompute selective with schedule 2bw: pipeplan plans"):
        PartitionOptions(schedule="2bw", recompute="selective").validate()
    with pytest.raises(InputError, match=r"^--sequence-parallel on with tensor-parallel degree 1"):
        PartitionOptions(sequence_parallel="on", tensor_parallel=1).validate()
    with pytest.raises(InputError, match=r"^--sequence-parallel 'yes' is not one of auto, on, off"):
        PartitionOptions(sequence_parallel="yes").validate()
    with pytest.raises(InputError, match=r"^--recompute selective is planned with --cost-model pipeplan"):
        PartitionOptions(schedule="1f1b-flush", recompute="selective", cost_model="pipedream").validate()
    # a measured bf16 profile on float32 masters: pipeplan's runtime does not recompute it
    measured = dataclasses.replace(
        _chain([1000, 1000], [300, 300], [0.1, 0.1], [1.0, 1.0]), dtype="bfloat16", master_dtype="float32"
    )
    with pytest.raises(InputError, match=r"^--recompute selective is not run under mixed precision"):
        partition(
            measured,
            Topology("t", DeviceSpec("d", 10**9), (Level("n", 2, 1e9),)),
            PartitionOptions(schedule="1f1b-flush", recompute="selective"),
        )


def test_older_plans_and_profiles_load_and_fields_are_validated() -> None:
    plan = _gpt_plan("auto", "auto", gib=80, t=4)
    old = plan.to_dict()
    for stage in old["stages"]:
        del stage["selective_layers"], stage["sequence_parallel"]
    loaded = Plan.from_dict(old)
    assert all(s.selective_layers == () and not s.sequence_parallel for s in loaded.stages)
    assert Plan.from_dict(plan.to_dict()) == plan
    bad = plan.to_dict()
    bad["stages"][0]["selective_layers"] = [10**6]
    with pytest.raises(
        InputError, match=r"^plan stage 0: selective_layers \[1000000\] are not distinct layers"
    ):
        Plan.from_dict(bad)
    one = plan.to_dict()
    for stage in one["stages"]:
        stage["tensor_parallel"], stage["sequence_parallel"] = 1, True
    with pytest.raises(InputError, match=r"sequence_parallel with tensor_parallel 1"):
        Plan.from_dict(one)
    profile = estimate_gpt(
        GPTShape(layers=2, hidden=64, heads=4, seq_len=16, vocab=32), A100, 1, recompute=False
    )
    data = profile.to_dict()
    for layer in data["layers"]:
        del layer["selective_saved_bytes"], layer["selective_recompute_ms"]
    assert all(layer.selective_saved_bytes == -1 for layer in Profile.from_dict(data).layers)
    data["layers"][1]["selective_saved_bytes"] = data["layers"][1]["saved_bytes"] + 1
    with pytest.raises(
        InputError, match=r"selective_saved_bytes = \d+ is not -1 or a byte count <= saved_bytes"
    ):
        Profile.from_dict(data)


def test_torchtitan_fragment_carries_selective_checkpointing() -> None:
    from pipeplan.export.torchtitan import TorchtitanExport, activation_checkpoint_mode

    plan = _gpt_plan("selective", "off")
    mode, note = activation_checkpoint_mode(plan)
    assert mode == "selective" and "op-level selective checkpointing" in note
    fragment = TorchtitanExport("m", "1f1b-flush", "1F1B", 1, 2, 8, 4, (("a",),), mode, note).toml()
    assert '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"\n' in fragment
    left = dataclasses.replace(
        plan, stages=(dataclasses.replace(plan.stages[0], selective_layers=()), *plan.stages[1:])
    )
    if len(plan.stages) > 1:
        assert "which the plan leaves without" in activation_checkpoint_mode(left)[1]


def test_partition_cli_and_report_show_selective_and_sequence_parallel_stages(tmp_path: Path) -> None:
    """``partition --recompute selective --sequence-parallel on`` of an estimated GPT prints
    each stage's selective layers and ms and the sequence-parallel degree; ``report``'s
    lines say the same from the plan."""
    from pipeplan.cli.report import recompute_lines

    profile = estimate_gpt(GPTShape(layers=4, hidden=1024, heads=16), A100, 8, recompute=False)
    profile.save(tmp_path / "gpt.json")
    (tmp_path / "top.yaml").write_text(
        "name: a100x8\ndevice: {name: a100, memory: 80GiB}\nlevels:\n  - {name: node, count: 8, bandwidth: 300GB/s}\n"
    )
    args = ["partition", str(tmp_path / "gpt.json"), "--topology", str(tmp_path / "top.yaml")]
    args += [
        "--schedule",
        "1f1b-flush",
        "--microbatches",
        "4",
        "--tensor-parallel",
        "2",
        "-o",
        str(tmp_path / "p.json"),
    ]
    result = CliRunner().invoke(
        cli, [*args, "--recompute", "selective", "--sequence-parallel", "on"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    plan = Plan.load(tmp_path / "p.json")
    assert all(s.sequence_parallel and s.tensor_parallel == 2 for s in plan.stages)
    assert "tensor-parallel 2 + sequence-parallel" in result.output
    assert "selective" in result.output and "attention cores (selective)" in result.output
    lines = recompute_lines(plan.to_dict())
    chosen = [s for s in plan.stages if s.selective_layers]
    assert chosen and any(
        f"stage {s.index} recomputes the attention core of {len(s.selective_layers)} of {len(s.layers)} layers "
        f"(selective), sequence-parallel over 2: +" in line
        for s in chosen
        for line in lines
    )
    simulated = CliRunner(env={"COLUMNS": "250"}).invoke(
        cli,
        ["simulate", str(tmp_path / "p.json"), "--profile", str(tmp_path / "gpt.json")],
        catch_exceptions=False,
    )
    assert simulated.exit_code == 0, simulated.output
    first = plan.stages[0]
    row = f"selective {len(first.selective_layers)} of {len(first.layers)} layers, +"
    assert "seq-par" in simulated.output and "2-way" in simulated.output and row in simulated.output
    refused = CliRunner().invoke(cli, [*args[:-6], "--tensor-parallel", "1", "--sequence-parallel", "on"])
    assert refused.exit_code != 0 and "--sequence-parallel on with tensor-parallel degree 1" in refused.output


def test_run_refuses_selective_recomputation_on_tensor_parallel_stages_in_one_line() -> None:
    from types import SimpleNamespace
    from typing import cast

    from pipeplan.precision import Precision
    from pipeplan.runtime.config import RunConfig, check_layer_recompute

    plan = _gpt_plan("selective", "on", gib=80, t=2)
    config = SimpleNamespace(plan=plan, schedule=plan.schedule, precision=Precision("float32", None))
    with pytest.raises(InputError, match=r"^the plan recomputes layers of tensor-parallel stage\(s\) \[0"):
        check_layer_recompute(cast(RunConfig, config))
    plain = dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(s, selective_layers=()) for s in plan.stages)
    )
    check_layer_recompute(cast(RunConfig, SimpleNamespace(plan=plain, schedule=plan.schedule)))
