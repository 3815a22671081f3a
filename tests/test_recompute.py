"""Activation recomputation per stage: the profile's figures, the DP's choice against brute
force, the plan contract, the simulator's charge and the checkpointed stage module."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from brute_force import plan_at_brute_force_optimum
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from pipeplan.capture import build_layer_graph
from pipeplan.capture.checkpointed import checkpoint_layers
from pipeplan.cli import cli
from pipeplan.errors import InfeasibleError, InputError
from pipeplan.plan import Plan
from pipeplan.planner.exhaustive import exhaustive_best
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.recompute import choose, gain_bytes, kept_bytes, stage_options
from pipeplan.planner.simulate import simulate_plan, stage_costs
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.topology import DeviceSpec, Level, Topology

FIXTURE_PROFILE = Path(__file__).parent / "fixtures" / "runtime" / "recompute_blocks.profile.json"


def _chain(
    saved: list[int],
    outputs: list[int],
    forward: list[float] | None = None,
    working: list[int] | None = None,
) -> Profile:
    forward = forward or [1.0] * len(saved)
    working = working or [-1] * len(saved)
    layers = tuple(
        LayerProfile(
            i,
            f"l{i}",
            "Block",
            (i - 1,) if i else (),
            forward[i],
            2 * forward[i],
            outputs[i],
            100,
            s,
            backward_working_bytes=working[i],
        )
        for i, s in enumerate(saved)
    )
    return Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers)


def _topology(devices: int, memory: int) -> Topology:
    return Topology("t", DeviceSpec("d", memory), (Level("n", devices, 1e9),))


def test_kept_bytes_are_the_inputs_unless_recorded() -> None:
    profile = _chain([1000, 1000, 50], [200, 300, 8])
    assert kept_bytes(profile) == [0, 200, 300]  # no input: nothing kept; else the producer's output
    assert gain_bytes(profile) == [1000.0, 800.0, 0.0]  # layer 2 frees nothing: never recomputed
    recorded = dataclasses.replace(
        profile, layers=(dataclasses.replace(profile.layers[0], recompute_kept_bytes=64), *profile.layers[1:])
    )
    assert kept_bytes(recorded)[0] == 64


def test_stage_options_recompute_the_first_layers_that_gain() -> None:
    profile = _chain([1000, 1000, 50], [200, 300, 8], forward=[1.0, 2.0, 4.0])
    options = stage_options(profile, (0, 1, 2), microbatches=2)
    assert [o.layers for o in options] == [(), (0,), (0, 1)]
    assert [o.extra_ms for o in options] == [0.0, 1.0, 3.0]
    assert [o.activation_bytes for o in options] == [2050.0, 1050.0, 250.0]
    assert [o.transient_bytes for o in options] == [0.0, 500.0, 500.0]  # 1000 bytes / 2 micro-batches
    assert choose(options, "none", None) is options[0] and choose(options, "full", None) is options[-1]
    assert choose(options, "auto", lambda o: o.activation_bytes + o.transient_bytes <= 1600) is options[1]
    assert choose(options, "auto", lambda o: False) is None


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Profile, Topology, PartitionOptions]:
    n = draw(st.integers(2, 6))
    saved = [draw(st.integers(0, 4000)) for _ in range(n)]
    outputs = [draw(st.integers(0, 1500)) for _ in range(n)]
    forward = [draw(st.floats(0.1, 5.0)) for _ in range(n)]
    working = [draw(st.sampled_from([-1, 0, 700, 2500])) for _ in range(n)]
    profile = _chain(saved, outputs, forward, working)
    schedule = draw(st.sampled_from(["gpipe", "1f1b-flush"]))
    micro = draw(st.sampled_from([1, 2])) if schedule == "gpipe" else 1
    options = PartitionOptions(
        schedule=schedule,
        microbatches=micro,
        recompute=draw(st.sampled_from(["auto", "auto", "full", "none"])),
        straight=draw(st.booleans()),
    )
    memory = draw(st.sampled_from([10**9, 9000, 6000, 4000, 2500]))
    return profile, _topology(draw(st.integers(1, 3)), memory), options


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_dp_choice_equals_brute_force(case: tuple[Profile, Topology, PartitionOptions]) -> None:
    """On chains (the DP bisects over the recomputed layers of each stage) under schedules
    whose in-flight count the DP charges exactly (gpipe, 1f1b-flush with one micro-batch):
    the DP's optimum is brute force's over every split, replication and per-stage choice."""
    profile, topology, options = case
    best, _ = exhaustive_best(profile, topology, options)
    plan = plan_at_brute_force_optimum(best, profile, topology, options)
    if plan is None:
        return
    for stage in plan.stages:
        assert stage.memory_bytes <= topology.device.memory_bytes
        assert stage.recompute_ms == pytest.approx(
            sum(profile.layers[i].forward_ms for i in stage.recompute_layers)
        )
        if options.recompute == "none":
            assert stage.recompute_layers == ()


def test_a_stage_holds_its_hungriest_backward_beside_its_activations() -> None:
    """3 layers of 1000 bytes saved on one device, 2 micro-batches (gpipe: both in flight):
    the stage holds 3000 saved bytes, its parameters (100 bytes each, SGD: weights and one
    gradient, 600), the gradient temporary of its largest parameter (100, as M > 1) and one
    micro-batch of its hungriest layer's backward working memory (1800 / 2 = 900): 4600. With
    5000 bytes it fits without recomputation; with 4200 only by recomputing the first layer
    (its 1000 saved bytes become 0, the layer re-materialised in backward holds 500),
    where a profile without the working figure (3700 bytes) plans none at 4200."""
    saved, outputs = [1000] * 3, [10] * 3
    options = PartitionOptions(schedule="gpipe", microbatches=2, optimizer="sgd")
    plan = partition(_chain(saved, outputs, working=[200, 1800, 400]), _topology(1, 5000), options)
    assert plan.stages[0].memory_bytes == 3000 + 600 + 100 + 900
    assert plan.stages[0].recompute_layers == ()
    simulated = simulate_plan(plan, _chain(saved, outputs, working=[200, 1800, 400]))
    assert simulated.stages[0].memory_bytes == plan.stages[0].memory_bytes
    plan = partition(_chain(saved, outputs, working=[200, 1800, 400]), _topology(1, 4200), options)
    assert plan.stages[0].recompute_layers == (0,)
    assert plan.stages[0].memory_bytes == 2000 + 600 + 100 + 900 + 500
    unmeasured = partition(_chain(saved, outputs), _topology(1, 4200), options)
    assert unmeasured.stages[0].recompute_layers == ()
    assert unmeasured.stages[0].memory_bytes == 3000 + 600 + 100


def test_recomputation_pays_first_where_1f1b_holds_most() -> None:
    """8 equal layers on 4 devices under 1f1b-flush with 4 micro-batches: stage s holds 4 - s
    of them, so the recomputed layers fall along the pipeline (2 layers x 4000 bytes saved,
    400 kept, in 5000 bytes: stage 0 recomputes both, stage 1 one, the others none). Without
    recomputation the DP, which charges every 1f1b-flush stage min(M, K) / M of a minibatch
    (``flush_in_flight``), finds no plan."""
    profile = _chain([4000] * 8, [400] * 8)
    topology = _topology(4, 5000)
    options = PartitionOptions(schedule="1f1b-flush", microbatches=4, straight=True)
    with pytest.raises(InfeasibleError, match="--recompute auto"):
        partition(profile, topology, dataclasses.replace(options, recompute="none"))
    plan = partition(profile, topology, options)
    assert [len(stage.layers) for stage in plan.stages] == [2, 2, 2, 2]
    assert [len(stage.recompute_layers) for stage in plan.stages] == [2, 1, 0, 0]
    assert [stage.recompute_ms for stage in plan.stages] == [2.0, 1.0, 0.0, 0.0]
    assert all(stage.memory_bytes <= 5000 for stage in plan.stages)
    assert [stage.compute_ms for stage in plan.stages] == [
        8.0,
        7.0,
        6.0,
        6.0,
    ]  # 2 x (1 + 2) ms + forwards again


def test_one_stage_recomputes_and_a_straight_layout_without_one_says_so() -> None:
    """A single stage plans recomputation (the colleague's report on bench/llama_long.py:
    its 60.6 MiB ``none`` plan was one stage at tensor-parallel degree 2, where measured
    profiles recompute nothing). On one device, 3 layers of 4000 bytes saved, 1 micro-batch:
    ``none`` keeps 12000 bytes, ``full`` 800 (layers 1 and 2 keep their 400-byte inputs, layer
    0 reads none) plus one layer re-materialised, 4000; between the two, ``none`` is refused and ``full`` and ``auto`` plan one stage as
    brute force does. On 2 devices one device a stage (straight) with --max-stages 1 no
    layout exists at any memory: the message says so, not that a layer needs memory."""
    profile = _chain([4000] * 3, [400] * 3)
    options = PartitionOptions(schedule="1f1b-flush", microbatches=1, straight=True)
    memory = {
        mode: partition(profile, _topology(1, 10**9), dataclasses.replace(options, recompute=mode))
        .stages[0]
        .memory_bytes
        for mode in ("none", "full")
    }
    assert memory["none"] - memory["full"] == 12000 - (800 + 4000)
    topology = _topology(1, (memory["none"] + memory["full"]) // 2)
    with pytest.raises(InfeasibleError, match="no plan fits"):
        partition(profile, topology, dataclasses.replace(options, recompute="none"))
    # auto: the fewest layers that fit, 9000 bytes = 600 of parameters + 400 + 4000 + 4000
    for mode, layers in (("full", (0, 1, 2)), ("auto", (0, 1))):
        plan = partition(profile, topology, dataclasses.replace(options, recompute=mode))
        assert len(plan.stages) == 1 and plan.stages[0].recompute_layers == layers
        assert plan.stages[0].memory_bytes <= topology.device.memory_bytes == 9000
        best, _ = exhaustive_best(profile, topology, dataclasses.replace(options, recompute=mode))
        assert plan.predicted.stage_bound_ms == pytest.approx(best, rel=1e-9) == 9.0 + len(layers)
    two = _topology(2, 10**9)
    for mode in ("none", "full", "auto"):
        capped = dataclasses.replace(options, recompute=mode, max_stages=1)
        with pytest.raises(InfeasibleError) as refused:
            partition(profile, two, capped)
        assert str(refused.value) == (
            "no plan lays out 2 devices at one device a stage (straight) with --max-stages 1: at most "
            "1 stage(s), whatever the memory (pass --use-fewer-devices, or drop --straight to let a "
            "stage hold replicas)"
        )
        assert exhaustive_best(profile, two, capped)[0] == math.inf
        fewer = partition(profile, two, dataclasses.replace(capped, use_fewer_devices=True))
        assert len(fewer.stages) == 1 and fewer.stages[0].ranks == (0,)


def test_schedules_without_recomputation_refuse_it_in_one_line() -> None:
    profile = _chain([4000] * 4, [400] * 4)
    for schedule in ("1f1b-rr", "zb-h1", "2bw"):
        with pytest.raises(InputError) as caught:
            partition(profile, _topology(2, 10**9), PartitionOptions(schedule=schedule, recompute="full"))
        assert "\n" not in str(caught.value) and "1f1b-flush or gpipe" in str(caught.value)
    plan = partition(profile, _topology(2, 10**9), PartitionOptions(schedule="1f1b-rr"))  # auto: none there
    assert plan.recompute == "none" and not any(stage.recompute_layers for stage in plan.stages)


def test_plan_records_recomputation_and_old_plans_load(tmp_path: Path) -> None:
    profile = _chain([4000] * 4, [400] * 4)
    plan = partition(profile, _topology(2, 10**9), PartitionOptions(schedule="gpipe", recompute="full"))
    assert plan.recompute == "full" and all(stage.recompute_layers == stage.layers for stage in plan.stages)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    old = json.loads((tmp_path / "plan.json").read_text())
    del old["recompute"]
    for stage in old["stages"]:
        del stage["recompute_layers"], stage["recompute_ms"]
    loaded = Plan.from_dict(old)
    assert loaded.recompute == "none" and all(
        not s.recompute_layers and s.recompute_ms == 0.0 for s in loaded.stages
    )
    bad = json.loads((tmp_path / "plan.json").read_text())
    bad["stages"][0]["recompute_layers"] = [7]  # no layer of the stage
    with pytest.raises(InputError, match="recompute_layers"):
        Plan.from_dict(bad)


def test_old_profiles_load_and_derive_what_is_kept(tmp_path: Path) -> None:
    profile = _chain([4000] * 3, [400] * 3)
    data = profile.to_dict()
    for layer in data["layers"]:
        del layer["recompute_kept_bytes"]
    (tmp_path / "p.json").write_text(json.dumps(data))
    loaded = Profile.load(tmp_path / "p.json")
    assert [layer.recompute_kept_bytes for layer in loaded.layers] == [-1, -1, -1]
    assert kept_bytes(loaded) == [0, 400, 400]


def test_simulator_charges_the_recomputed_forwards_and_their_memory() -> None:
    profile = _chain([4000] * 4, [400] * 4, forward=[1.0, 2.0, 3.0, 4.0])
    options = PartitionOptions(schedule="gpipe", microbatches=2, recompute="full", straight=True)
    plan = partition(profile, _topology(2, 10**9), options)
    assert len(plan.stages) == 2
    costs = stage_costs(plan, profile)
    for stage, cost in zip(plan.stages, costs):
        layers = [profile.layers[i] for i in stage.layers]
        assert cost.backward_ms == pytest.approx(sum(l.backward_ms + l.forward_ms for l in layers))
        assert cost.saved_bytes == sum(kept_bytes(profile)[i] for i in stage.layers)
    simulated = simulate_plan(plan, profile)
    assert [s.memory_bytes for s in simulated.stages] == [s.memory_bytes for s in plan.stages]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)[0]
    return total, out


def test_checkpointed_layers_keep_less_and_give_the_same_gradients() -> None:
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(64, 8)
    graph = build_layer_graph(model, (x,), ["_Block"])
    stage = graph.split([0] * len(graph.layers))[0]
    plain_bytes, plain = _saved_bytes(stage.module, x)
    plain.square().sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    checkpointed = checkpoint_layers(graph, stage, [0, 1])
    kept_bytes_, out = _saved_bytes(checkpointed.module, x)
    out.square().sum().backward()
    assert torch.equal(out, plain)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0)
    assert kept_bytes_ < plain_bytes  # blocks 0 and 1 save nothing through autograd's hooks
    assert sorted(checkpointed.parameter_names.values()) == sorted(stage.parameter_names.values())
    assert any(local.startswith("recompute_") for local in checkpointed.parameter_names)


def test_partition_cli_refuses_none_and_shows_what_auto_recomputes(tmp_path: Path) -> None:
    topology = tmp_path / "t.yaml"
    topology.write_text(
        "name: two\ndevice: {name: cpu, memory: 650 MiB, kind: cpu}\nlevels:\n  - {name: host, count: 2, bandwidth: 10 Gbit/s}\n"
    )
    args = ["partition", str(FIXTURE_PROFILE), "--topology", str(topology), "--schedule", "1f1b-flush"]
    args += ["--microbatches", "2", "-o", str(tmp_path / "plan.json")]
    refused = CliRunner().invoke(cli, [*args, "--recompute", "none"])
    assert refused.exit_code == 2 and "no plan fits" in refused.output
    planned = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert planned.exit_code == 0, planned.output
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.recompute == "auto" and len(plan.stages[0].recompute_layers) == 3
    assert "recomputation (auto)" in planned.output and "device memory 650.0 MiB" in planned.output


def test_torchtitan_fragment_carries_the_activation_checkpoint_mode() -> None:
    from pipeplan.export.torchtitan import TorchtitanExport, activation_checkpoint_mode

    profile = _chain([4000] * 8, [400] * 8)
    options = PartitionOptions(schedule="1f1b-flush", microbatches=4, straight=True)
    partial = partition(profile, _topology(4, 5000), options)  # recomputes 2, 1, 0, 0 layers
    mode, note = activation_checkpoint_mode(partial)
    assert mode == "full" and "stage 0: 2 of 2, stage 1: 1 of 2, stage 2: 0 of 2" in note
    plain = partition(profile, _topology(4, 10**9), options)
    assert activation_checkpoint_mode(plain) == ("none", "")
    full = partition(profile, _topology(4, 10**9), dataclasses.replace(options, recompute="full"))
    assert activation_checkpoint_mode(full) == ("full", "")
    fragment = TorchtitanExport("m", "1f1b-flush", "1F1B", 4, 1, 8, 4, (("a",),) * 4, mode, note).toml()
    assert '[activation_checkpoint]\nmode = "full"\n' in fragment and f"# {note}\n" in fragment


@pytest.mark.parametrize("build", ["eager", "meta"])
def test_profiler_measures_what_a_recomputed_layer_keeps(build: str) -> None:
    """Each layer keeps its input tensors: the minibatch (8 x 8 floats) for the first, the
    previous layer's output (8 x 16 floats) for the others."""
    from pipeplan.profiler.profile_model import profile_model

    profile = profile_model(
        str(Path(__file__).parent / "fixtures" / "runtime" / "mlp.py"),
        batch_size=8,
        warmup=0,
        repeats=1,
        build=build,
        whole_step=False,
    )
    assert [layer.recompute_kept_bytes for layer in profile.layers] == [256, 512, 512, 512, 512, 512]
    assert kept_bytes(profile) == [256, 512, 512, 512, 512, 512]


def test_estimated_gpt_without_recomputation_plans_it_per_stage() -> None:
    """A what-if GPT (bf16 throughout) estimated without recomputation, its blocks keeping
    their input when recomputed, on 8 A100s: in 4 GiB ``none`` fits nowhere while ``auto``
    recomputes where each stage must (an estimated profile plans it at every tensor-parallel
    degree), no slower than ``full``; in 8 GiB ``auto`` beats ``none`` (which splits tensors
    8 ways) by recomputing some layers on a smaller degree."""
    from pipeplan.profiler.estimate import DEVICE_RATES, GPTShape, estimate_gpt

    shape = GPTShape(layers=8, hidden=1024, heads=16)
    profile = estimate_gpt(shape, DEVICE_RATES["a100-80gb"], 64, recompute=False, mixed_precision=False)
    block = profile.layers[1]
    assert block.recompute_kept_bytes == 64 * 2048 * 1024 * 2 < block.saved_bytes

    def topology(gib: int) -> Topology:
        return Topology(
            "a100", DeviceSpec("a100", gib * 2**30), (Level("node", 8, 300e9), Level("hosts", 1, 25e9))
        )

    def plan(gib: int, mode: str) -> Plan:
        options = PartitionOptions(
            schedule="1f1b-flush", microbatches=8, optimizer="adam", recompute=mode, sequence_parallel="off"
        )
        return partition(profile, topology(gib), options)

    with pytest.raises(InfeasibleError):
        plan(4, "none")
    auto, full = plan(4, "auto"), plan(4, "full")
    for chosen in (auto, full):
        assert all(s.memory_bytes <= 4 * 2**30 for s in chosen.stages)
    assert any(s.recompute_layers or s.selective_layers for s in auto.stages)
    assert auto.predicted.time_per_minibatch_ms <= full.predicted.time_per_minibatch_ms
    none8, auto8 = plan(8, "none"), plan(8, "auto")
    assert none8.stages[0].tensor_parallel == 8 and auto8.stages[0].tensor_parallel < 8
    assert any(s.recompute_layers or s.selective_layers for s in auto8.stages)
    assert auto8.predicted.time_per_minibatch_ms < 0.95 * none8.predicted.time_per_minibatch_ms
