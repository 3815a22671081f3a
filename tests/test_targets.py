"""``partition --for``: the cuts an export target can express (``planner.targets``), the DP
restricted to them against brute force, the profile's module tree, and the CLI."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.cli import cli
from pipeplan.errors import InfeasibleError, InputError
from pipeplan.plan import Plan
from pipeplan.planner.costs import layer_arrays
from pipeplan.planner.cuts import prefix_family
from pipeplan.planner.exhaustive import evaluate, pipelines
from pipeplan.planner.partition import PartitionOptions, charged_optimizer, partition
from pipeplan.planner.placement import flatten
from pipeplan.planner.targets import most_stages, target_cuts, target_family
from pipeplan.profile import DeviceInfo, LayerProfile, ModuleRecord, Profile
from pipeplan.topology import DeviceSpec, Level, Topology


def profile_of(
    names: list[str],
    calls: dict[str, int],
    parameters: list[tuple[str, ...]] | None = None,
    inputs: list[tuple[int, ...]] | None = None,
    containers: tuple[str, ...] = (),
    compute: list[float] | None = None,
    model_inputs: list[tuple[int, ...]] | None = None,
) -> Profile:
    """A profile whose layer i runs module ``names[i]``; ``calls`` holds every module but the root."""
    n = len(names)
    layers = tuple(
        LayerProfile(
            i,
            names[i],
            "L",
            (inputs[i] if inputs else ((i - 1,) if i else ())),
            (compute[i] if compute else 1.0) / 2,
            (compute[i] if compute else 1.0) / 2,
            100,
            1000,
            100,
            parameters=parameters[i] if parameters else (),
            model_inputs=model_inputs[i] if model_inputs else ((0,) if i == 0 else ()),
        )
        for i in range(n)
    )
    modules = (ModuleRecord("", "M", 1),) + tuple(
        ModuleRecord(name, "ModuleList" if name in containers else "L", count, name in containers)
        for name, count in calls.items()
    )
    return Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers, modules=modules)


# --------------------------------------------------------------------------- the rules


def test_pipelining_cuts_before_modules_called_once() -> None:
    # layer 2 is a dropout called twice (layers 2 and 4), layer 3 a functional op of the root
    profile = profile_of(["a", "b", "drop", "add_1", "drop", "c"], {"a": 1, "b": 1, "drop": 2, "c": 1})
    cuts = target_cuts(profile, "pipelining")
    assert cuts.allowed == (1, 5)
    assert cuts.blocked == {
        2: "drop (called 2 times per forward pass)",
        3: "add_1 (a functional op, not a module)",
        4: "drop (called 2 times per forward pass)",
    }


def test_a_shared_parameter_blocks_torchtitan_between_its_users_not_pipelining() -> None:
    profile = profile_of(
        ["wte", "b", "c", "head"],
        {"wte": 1, "b": 1, "c": 1, "head": 1},
        parameters=[("wte.weight",), ("b.weight",), ("c.weight",), ("wte.weight",)],
    )
    cuts = target_cuts(profile, "torchtitan")
    assert cuts.allowed == ()
    assert set(cuts.blocked) == {1, 2, 3}
    assert cuts.blocked[2] == "parameter wte.weight (used by layers 0 (wte) and 3 (head))"
    # pipelining's export keeps a copy on each stage and sums their gradients
    assert target_cuts(profile, "pipelining").allowed == (1, 2, 3)


def test_torchtitan_cuts_between_units_only() -> None:
    # units: embed | layers.0 (2 layers) | layers.1 (2 layers) | head; "layers" is a ModuleList
    names = ["embed", "layers.0.x", "layers.0.y", "layers.1.x", "layers.1.y", "head"]
    calls = {
        "embed": 1,
        "layers": 0,
        "layers.0": 1,
        "layers.0.x": 1,
        "layers.0.y": 1,
        "layers.1": 1,
        "layers.1.x": 1,
        "layers.1.y": 1,
        "head": 1,
    }
    cuts = target_cuts(profile_of(names, calls, containers=("layers",)), "torchtitan")
    assert cuts.allowed == (1, 3, 5)
    assert cuts.blocked[2] == "layers.0 (L, a unit torchtitan keeps whole)"
    assert target_cuts(profile_of(names, calls, containers=("layers",)), "pipelining").allowed == (
        1,
        2,
        3,
        4,
        5,
    )


def test_torchtitan_refuses_a_functional_op_of_the_root() -> None:
    cuts = target_cuts(profile_of(["a", "add_1", "b"], {"a": 1, "b": 1}), "torchtitan")
    assert cuts.allowed == () and cuts.refusal.startswith("layer(s) 1 (add_1) are not modules")


def test_several_model_inputs_stay_in_the_first_stage() -> None:
    # input 1 (a mask) is read by layers 2 and 3: the first stage must hold both
    profile = profile_of(
        ["a", "b", "c", "d", "e"], dict.fromkeys("abcde", 1), model_inputs=[(0,), (), (1,), (1,), ()]
    )
    assert target_cuts(profile, "pipelining").allowed == (4,)


def test_a_profile_without_the_module_tree_refuses_in_one_line() -> None:
    profile = profile_of(["a", "b"], {"a": 1, "b": 1})
    old = Profile.from_dict({**profile.to_dict(), "modules": []})
    with pytest.raises(InputError) as error:
        target_cuts(old, "pipelining")
    assert str(error.value) == (
        "the profile of m has no module tree (made before pipeplan recorded it, or not "
        "measured by `pipeplan profile`): re-profile the model to plan --for pipelining"
    )


def test_family_holds_the_prefixes_at_allowed_boundaries() -> None:
    profile = profile_of(["a", "drop", "b", "drop"], {"a": 1, "drop": 2, "b": 1})
    family = target_family(target_cuts(profile, "pipelining"), profile)
    assert family.name == "pipelining-cuts" and family.states == 3
    assert [family.stage_layers(0, s) for s in range(3)] == [(), (0, 1), (0, 1, 2, 3)]


def test_no_output_jumps_over_a_stage() -> None:
    # layer 0 feeds layer 3 (a skip): the middle stage of a cut at 1 and at 2 would be jumped over
    profile = profile_of(["a", "b", "c", "d"], dict.fromkeys("abcd", 1), inputs=[(), (0,), (1,), (0, 2)])
    family = target_family(target_cuts(profile, "pipelining"), profile)
    assert family.states == 5  # {}, 1, 2, 3 layers, all
    ok = family.nested(4, 5)  # ok[length, start]
    middle = [(start, start + length) for length in range(1, 4) for start in range(1, 4 - length)]
    assert middle == [(1, 2), (2, 3), (1, 3)] and not any(ok[j - i, i] for i, j in middle)
    assert all(ok[j - i, i] for i, j in [(0, 1), (0, 2), (0, 3), (1, 4), (2, 4), (3, 4), (0, 4)])
    plan = partition(
        profile,
        Topology("t", DeviceSpec("d", 10**9), (Level("l", 3, 1e9),)),
        PartitionOptions(
            schedule="gpipe",
            straight=True,
            microbatches=8,
            use_fewer_devices=True,
            export_target="pipelining",
        ),
    )
    assert len(plan.stages) == 2  # three stages would need a middle one


def test_torchs_own_split_rules_out_stages_and_cuts() -> None:
    # pipeplan's layers are a chain; torch's pieces pass a value from before layer 1 to layer 2
    # (a mask built before the blocks) and cannot cut before layer 3 (a view would cross)
    profile = replace(
        profile_of(["a", "b", "c", "d", "e"], dict.fromkeys("abcde", 1)),
        pipelining_reach=(0, 2, 2, 3, 4),
        pipelining_blocked=("", "", "", "a view", ""),
    )
    cuts = target_cuts(profile, "pipelining")
    assert cuts.allowed == (1, 2, 4) and cuts.blocked == {3: "d (torch's own cut there: a view)"}
    assert target_cuts(profile, "torchtitan").allowed == (1, 2, 3, 4)  # torch's split is pipelining's alone
    family = target_family(cuts, profile)
    ok = family.nested(5, family.states)  # ok[length, start] over the states {}, 1, 2, 4, all
    assert not ok[1, 1]  # the stage [1, 2): layer 2 reads a value from before layer 1
    assert ok[2, 1] and ok[1, 0] and ok[1, 2] and ok[1, 3]  # [1, 4), [0, 1), [2, 4), [4, 5)
    assert most_stages(family) == 3
    plan = partition(
        profile,
        Topology("t", DeviceSpec("d", 10**9), (Level("l", 4, 1e9),)),
        PartitionOptions(
            schedule="gpipe",
            straight=True,
            microbatches=8,
            use_fewer_devices=True,
            export_target="pipelining",
        ),
    )
    assert [stage.layer_start for stage in plan.stages] == [0, 2, 4]  # equal layers: the 2|2|1 split
    with pytest.raises(InputError, match=r"can run m on at most 3 stage\(s\), not 4: .* --max-stages 3$"):
        partition(
            profile,
            Topology("t", DeviceSpec("d", 10**9), (Level("l", 4, 1e9),)),
            PartitionOptions(schedule="gpipe", straight=True, microbatches=8, export_target="pipelining"),
        )


def test_torchs_split_round_trips_and_is_validated(tmp_path: Path) -> None:
    profile = replace(
        profile_of(["a", "b", "c"], dict.fromkeys("abc", 1)),
        pipelining_reach=(0, 2, -1),
        pipelining_blocked=("", "", "no op follows the cut"),
    )
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    with pytest.raises(InputError, match="pipelining_reach must hold 3 layer indices"):
        replace(profile, pipelining_reach=(0, 3, -1))
    with pytest.raises(InputError, match="pipelining_blocked must hold 3 strings"):
        replace(profile, pipelining_blocked=("", ""))


# --------------------------------------------------------------------------- DP == brute force


@st.composite
def restricted_cases(draw):
    n = draw(st.integers(2, 7))
    unit = 0
    names, calls = [], {}
    for i in range(n):
        unit += draw(st.integers(0, 1)) if i else 0
        kind = draw(st.sampled_from(["module", "module", "module", "twice", "op"]))
        name = f"add_{i}" if kind == "op" else f"u{unit}.l{i}"
        names.append(name)
        if kind != "op":
            calls[f"u{unit}"] = 1
            calls[name] = 2 if kind == "twice" else 1
    tied = draw(st.one_of(st.none(), st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))))
    parameters = [(f"p{i}",) + (("tied",) if tied and i in tied else ()) for i in range(n)]
    inputs = [
        tuple(sorted({i - 1, *draw(st.lists(st.integers(0, max(i - 2, 0)), max_size=1))})) if i else ()
        for i in range(n)
    ]
    compute = [draw(st.floats(0.1, 5)) for _ in range(n)]
    profile = profile_of(names, calls, parameters, inputs, compute=compute)
    if draw(st.booleans()):  # torch's own split: how far back values reach, and cuts it cannot make
        reach = [draw(st.integers(-1, n - 1)) for _ in range(n)]
        blocked = [""] + [draw(st.sampled_from(["", "", "", "a view"])) for _ in range(n - 1)]
        profile = replace(profile, pipelining_reach=tuple(reach), pipelining_blocked=tuple(blocked))
    counts = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    levels = tuple(Level(f"l{k}", c, draw(st.sampled_from([1e6, 3e6, 1e7]))) for k, c in enumerate(counts))
    topology = Topology("t", DeviceSpec("d", draw(st.sampled_from([10**9, 40_000, 20_000]))), levels)
    options = PartitionOptions(
        schedule="gpipe",
        straight=True,
        microbatches=8,
        use_fewer_devices=draw(st.booleans()),
        cost_model=draw(st.sampled_from(["pipeplan", "pipedream"])),
        export_target=draw(st.sampled_from(["pipelining", "torchtitan"])),
    )
    return profile, topology, options


def brute_force(profile: Profile, topology: Topology, options: PartitionOptions, allowed: set[int]) -> float:
    """Best time (ms) over every straight plan of the layer order whose stages begin at ``allowed``
    layers and whose every layer output reaches at most the next stage."""
    arrays = layer_arrays(profile, charged_optimizer(options), prefix_family(len(profile.layers)))
    best = math.inf
    for tree in pipelines(
        len(topology.levels), 0, arrays.layers, topology.levels[-1].count, topology, options
    ):
        flat = flatten(tree, topology)
        stage_of = [q for q, stage in enumerate(flat) for _ in range(stage.start, stage.end)]
        torch_reach = profile.pipelining_reach if options.export_target == "pipelining" else ()
        if (
            all(stage.start == 0 or stage.start in allowed for stage in flat)
            and all(
                stage_of[layer.index] - stage_of[p] <= 1 for layer in profile.layers for p in layer.inputs
            )
            and all(
                q == len(flat) - 1 or stage.end > torch_reach[stage.start]
                for q, stage in enumerate(flat)
                if torch_reach
            )
        ):
            best = min(best, evaluate(tree, arrays, topology, options))
    return best


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(restricted_cases())
def test_restricted_dp_equals_brute_force_over_the_allowed_cuts(case) -> None:
    profile, topology, options = case
    cuts = target_cuts(profile, options.export_target)
    if cuts.refusal:  # torchtitan places modules: a functional op of the root rules every plan out
        with pytest.raises(InputError, match="runs no split of m: layer"):
            partition(profile, topology, options)
        return
    try:
        plan = partition(profile, topology, options)
    except (InfeasibleError, InputError):
        if options.cost_model == "pipeplan":
            assert brute_force(profile, topology, options, set(cuts.allowed)) == math.inf
        return
    assert plan.export_target == options.export_target
    assert {stage.layer_start for stage in plan.stages[1:]} <= set(cuts.allowed)
    assert all(stage.layers == tuple(range(stage.layer_start, stage.layer_end)) for stage in plan.stages)
    if options.cost_model == "pipeplan":  # PipeDream's own optimizer has no brute-force twin here
        best = brute_force(profile, topology, options, set(cuts.allowed))
        assert plan.predicted.stage_bound_ms == pytest.approx(best, rel=1e-9)


# --------------------------------------------------------------------------- the CLI


def cli_partition(*args: str):
    return CliRunner().invoke(cli, ["partition", *args])


def test_cli_prints_the_price_and_records_the_target(tmp_path: Path) -> None:
    # the unrestricted optimum cuts before layer 2 (a module called twice): --for pays for it
    profile = profile_of(
        ["a", "b", "drop", "c", "drop"],
        {"a": 1, "b": 1, "drop": 2, "c": 1},
        compute=[2.0, 2.0, 1.0, 1.0, 2.0],
    )
    profile.save(tmp_path / "profile.json")
    topology = "local-cpu"  # 2 devices
    free = cli_partition(
        str(tmp_path / "profile.json"),
        "--topology",
        topology,
        "--straight",
        "--schedule",
        "1f1b-flush",
        "--microbatches",
        "8",
        "-o",
        str(tmp_path / "free.json"),
    )
    assert free.exit_code == 0, free.output
    restricted = cli_partition(
        str(tmp_path / "profile.json"),
        "--topology",
        topology,
        "--for",
        "pipelining",
        "--microbatches",
        "8",
        "-o",
        str(tmp_path / "plan.json"),
    )
    assert restricted.exit_code == 0, restricted.output
    plan, best = Plan.load(tmp_path / "plan.json"), Plan.load(tmp_path / "free.json")
    assert plan.export_target == "pipelining" and plan.schedule == "1f1b-flush"
    assert [s.layer_start for s in plan.stages] == [0, 3] and [s.layer_start for s in best.stages] == [0, 2]
    ours, theirs = plan.predicted.time_per_minibatch_ms, best.predicted.time_per_minibatch_ms
    assert ours > theirs
    line = [text for text in restricted.output.splitlines() if text.startswith("--for pipelining")]
    assert line == [
        f"--for pipelining: {ours:.3f} ms/minibatch predicted with the cuts torch.distributed.pipelining "
        f"can express; the best plan with any cut (same schedule, one device per stage): {theirs:.3f} "
        f"ms/minibatch, {(ours / theirs - 1) * 100:+.1f}%"
    ]
    assert json.loads((tmp_path / "plan.json").read_text())["export_target"] == "pipelining"


def test_cli_names_what_blocks_when_no_cut_is_left(tmp_path: Path) -> None:
    profile = profile_of(
        ["wte", "drop", "drop", "head"],
        {"wte": 1, "drop": 2, "head": 2},
        parameters=[("wte.weight",), (), (), ("wte.weight",)],
    )
    profile.save(tmp_path / "profile.json")
    result = cli_partition(
        str(tmp_path / "profile.json"),
        "--topology",
        "local-cpu",
        "--for",
        "pipelining",
        "--microbatches",
        "2",
        "-o",
        str(tmp_path / "plan.json"),
    )
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --for pipelining: torch.distributed.pipelining can cut m at no layer boundary, too few for 2 "
        "stages; blocked by drop (called 2 times per forward pass) at 2 boundaries, head (called 2 times per "
        "forward pass) at 1 boundary (pass --use-fewer-devices or --max-stages 1)"
    ]
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--schedule", "1f1b-rr"],
            "--for pipelining plans 1f1b-flush, gpipe (got --schedule 1f1b-rr): "
            "torch.distributed.pipelining runs flush schedules, and pipeplan restricts the "
            "cuts of one chunk per device",
        ),
        (
            ["--schedule", "auto"],
            "--for pipelining plans 1f1b-flush or gpipe: pass one with --schedule, not auto",
        ),
        (
            ["--microbatches", "1"],
            "--for pipelining: 1f1b-flush runs as Schedule1F1B, which needs a micro-batch per "
            "stage: --microbatches 1 on up to 2 stages (pass --microbatches 2 or more, or "
            "--max-stages 1)",
        ),
        (
            ["--microbatches", "3"],
            "--for pipelining: the batch of 8 samples does not split into 3 equal "
            "micro-batches, as torch.distributed.pipelining splits it",
        ),
    ],
)
def test_cli_refuses_what_the_target_cannot_run(tmp_path: Path, args: list[str], message: str) -> None:
    profile_of(["a", "b", "c"], {"a": 1, "b": 1, "c": 1}).save(tmp_path / "profile.json")
    result = cli_partition(
        str(tmp_path / "profile.json"), "--topology", "local-cpu", "--for", "pipelining", *args
    )
    assert result.exit_code == 2 and result.output.strip().splitlines() == [f"error: {message}"]


# --------------------------------------------------------------------------- the contract


def test_module_tree_round_trips_and_old_profiles_load(tmp_path: Path) -> None:
    profile = profile_of(["a", "b"], {"a": 1, "b": 1}, parameters=[("a.weight",), ("b.weight",)])
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded == profile and loaded.modules[1] == ModuleRecord("a", "L", 1, False)
    old = profile.to_dict()
    old["schema"] = "pipeplan.profile/1"
    for key in ("modules", "tp_efficiency", "estimated"):
        old.pop(key)
    for layer in old["layers"]:
        for key in [k for k in layer if k.startswith("tp_")] + ["parameters"]:
            layer.pop(key)
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Profile.load(tmp_path / "old.json").modules == ()
    bad = {
        **profile.to_dict(),
        "modules": [{"name": "", "type": "M", "calls": 1}, {"name": "a", "type": "L", "calls": -1}],
    }
    with pytest.raises(InputError, match=r"profile module 'a': calls = -1 is outside"):
        Profile.from_dict(bad)


@pytest.mark.slow
def test_profiler_records_calls_and_parameters(tmp_path: Path) -> None:
    from pipeplan.profiler.profile_model import profile_model

    profile = profile_model("gpt", batch_size=2, warmup=0, repeats=1)
    modules = {m.name: m for m in profile.modules}
    assert modules[""].calls == 1 and modules["blocks"].calls == 1 and not modules["blocks"].container
    assert modules["blocks.0.attn.qkv"].calls == 1 and modules["blocks.0"].type == "Block"
    first, last = profile.layers[0], profile.layers[-1]
    assert first.name == "wte" and "wte.weight" in first.parameters
    assert "wte.weight" in last.parameters  # the tied head (F.linear(x, wte.weight)) in the last layer
