"""The test zoo through ``partition --for`` then ``export``: the exported split runs on torch.distributed.pipelining.

Each model (the bundled MLP, VGG without dropout, ResNet; Hugging Face ViT, GPT-2 with an
untied head and BERT from tiny configs) is profiled once, planned ``--for pipelining``
(2 stages, 1F1B-Flush) and exported; one launch of 2 gloo ranks trains every exported
split under torch's Schedule1F1B and the same plan under ``pipeplan run``: the losses
must agree and every rank must hold exactly its plan stage's parameters. ``--for
torchtitan`` plans export a fragment whose units are the stages' own. The bundled GPT
(its head reuses the embedding weight) has no cut either engine runs: one line says so.
ViT and GPT-2 on 4 stages, BERT on 3 and ResNet on 4 run the same way in one launch of
4 ranks, where torch's own placement of parameter-free ops decides which cuts run
(``Profile.pipelining_reach``); export checks torch's split before writing it, and
rebuilds the layers with the plan's leaf and opaque module classes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner
from ports import free_port

os.environ["HF_HUB_OFFLINE"] = "1"

from pipeplan.cli import cli  # noqa: E402
from pipeplan.plan import Plan  # noqa: E402
from pipeplan.profile import Profile  # noqa: E402
from pipeplan.profiler.profile_model import profile_model  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = {
    "mlp": "mlp",
    "vgg": str(FIXTURES / "export" / "vgg_no_dropout.py"),
    "resnet": "resnet",
    "vit": str(Path(__file__).parents[1] / "docs" / "export" / "hf_vit.py"),
    "gpt2": str(FIXTURES / "models" / "hf_gpt2_untied.py"),
    "bert": str(FIXTURES / "models" / "hf_bert.py"),
}
BATCH, MICROBATCHES, STEPS, LR = 8, 2, 3, 0.05


def run_cli(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("zoo")
    paths = {}
    for name, model in MODELS.items():
        paths[name] = folder / f"{name}.profile.json"
        profile_model(model, batch_size=BATCH, device="cpu", warmup=0, repeats=1, threads=1).save(paths[name])
    return paths


def plan_for(profile: Path, target: str, out: Path) -> Plan:
    output = run_cli(
        "partition",
        str(profile),
        "--topology",
        "local-cpu",
        "--for",
        target,
        "--microbatches",
        str(MICROBATCHES),
        "-o",
        str(out),
    )
    assert f"--for {target}: " in output and " ms/minibatch predicted" in output
    plan = Plan.load(out)
    assert plan.export_target == target and len(plan.stages) == 2 and plan.schedule == "1f1b-flush"
    return plan


def stage_parameters(profile: Profile, plan: Plan) -> list[list[str]]:
    return [
        sorted({name for i in stage.layers for name in profile.layers[i].parameters}) for stage in plan.stages
    ]


def launch(cases: list[dict], folder: Path, timeout_s: float = 420.0, world: int = 2) -> None:
    """``world`` ranks of ``compare_engines.py`` (RANK, WORLD_SIZE set as torchrun would), killed after
    ``timeout_s`` s."""
    (folder / "cases.json").write_text(json.dumps(cases))
    env = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    command = [
        sys.executable,
        str(FIXTURES / "export" / "compare_engines.py"),
        str(folder / "cases.json"),
        str(folder),
    ]
    ranks = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        for process in ranks:
            os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the engines ran past {timeout_s} s")
    failed = [
        f"rank {r}: {output[-2000:]}"
        for r, (process, output) in enumerate(zip(ranks, outputs))
        if process.returncode != 0
    ]
    assert not failed, "\n".join(failed)


def export_case(name: str, plan_path: Path, folder: Path, ranks: int) -> dict:
    """``export --to pipelining`` the plan to a snippet; the launch case that trains it both ways."""
    run_cli(
        "export",
        str(plan_path),
        "--to",
        "pipelining",
        "--model",
        MODELS[name],
        "-o",
        str(folder / f"{name}.split.py"),
    )
    return {
        "name": name,
        "model": MODELS[name],
        "plan": str(plan_path),
        "snippet": str(folder / f"{name}.split.py"),
        "steps": STEPS,
        "lr": LR,
        "ports": [free_port(), free_port()],
        "ranks": ranks,
    }


def check_engines_agree(folder: Path, expected: dict[str, list[list[str]]], microbatches: int) -> None:
    for name in expected:
        torch_run = json.loads((folder / f"{name}.pipelining.json").read_text())
        ours = json.loads((folder / f"{name}.pipeplan.json").read_text())["losses"]
        assert len(ours) == STEPS and torch_run["microbatches"] == [microbatches] * STEPS, name
        assert torch_run["losses"] == pytest.approx(ours, rel=1e-5, abs=1e-6), name
        assert max(abs(loss - ours[0]) for loss in ours[1:]) > 1e-5, name  # the weights moved
        # torch cut where the plan did: each rank holds exactly its stage's parameters
        assert torch_run["parameters_by_rank"] == expected[name], name


@pytest.mark.multiprocess
def test_planned_for_pipelining_exports_and_runs_with_pipeplans_losses(
    profiles: dict[str, Path], tmp_path: Path
) -> None:
    cases, expected = [], {}
    for name in MODELS:
        plan = plan_for(profiles[name], "pipelining", tmp_path / f"{name}.plan.json")
        cases.append(export_case(name, tmp_path / f"{name}.plan.json", tmp_path, 2))
        expected[name] = stage_parameters(Profile.load(profiles[name]), plan)
    launch(cases, tmp_path)
    check_engines_agree(tmp_path, expected, MICROBATCHES)


def cpu_topology(devices: int, folder: Path) -> Path:
    """local-cpu with ``devices`` CPU processes."""
    path = folder / f"cpu{devices}.yaml"
    path.write_text(
        f"name: cpu{devices}\ndevice: {{name: cpu, memory: 4 GiB, kind: cpu}}\n"
        f"levels:\n  - {{name: host, count: {devices}, bandwidth: 5 GB/s, latency: 20 us}}\n"
    )
    return path


MULTI_STAGE = {"vit": 4, "bert": 3, "gpt2": 4, "resnet": 4}  # model -> stages (devices)


@pytest.mark.multiprocess
def test_multi_stage_plans_for_pipelining_run_under_torch(profiles: dict[str, Path], tmp_path: Path) -> None:
    """3 and 4 stages, where torch's placement of parameter-free ops (an attention mask built
    before the blocks, a residual's input) decides which cuts run: the profile's
    pipelining_reach keeps the DP to stages nothing skips; one launch of 4 ranks."""
    cases, expected = [], {}
    for name, stages in MULTI_STAGE.items():
        profile = Profile.load(profiles[name])
        plan_path = tmp_path / f"{name}.plan.json"
        run_cli(
            "partition",
            str(profiles[name]),
            "--topology",
            str(cpu_topology(stages, tmp_path)),
            "--for",
            "pipelining",
            "--microbatches",
            "4",
            "-o",
            str(plan_path),
        )
        plan = Plan.load(plan_path)
        assert len(plan.stages) == stages and len(profile.pipelining_reach) == len(profile.layers), name
        for stage in plan.stages[:-1]:  # nothing from before a stage is read after it, in torch's own split
            assert profile.pipelining_reach[stage.layer_start] < stage.layer_end, (name, stage.index)
        cases.append(export_case(name, plan_path, tmp_path, stages))
        expected[name] = stage_parameters(profile, plan)
    launch(cases, tmp_path, world=4)
    check_engines_agree(tmp_path, expected, 4)


def test_torchs_own_split_is_profiled_and_export_checks_it(tmp_path: Path) -> None:
    """A mask built before the blocks: pipeplan's layers are a chain (each block's layer
    recomputes it), torch's pieces pass it from the first stage to every block's stage."""
    model = str(FIXTURES / "export" / "mask_net.py")
    profile_model(model, batch_size=BATCH, warmup=0, repeats=1, threads=1).save(tmp_path / "mask.json")
    profile = Profile.load(tmp_path / "mask.json")
    assert profile.is_chain and [layer.name for layer in profile.layers] == ["embed", "a", "b", "head"]
    assert profile.pipelining_reach == (0, 2, 2, 3)  # a value from before a is read by b (layer 2)
    assert not any(profile.pipelining_blocked)
    four = [
        "--topology",
        str(cpu_topology(4, tmp_path)),
        "--microbatches",
        "4",
        "-o",
        str(tmp_path / "p.json"),
    ]
    refused = CliRunner().invoke(
        cli, ["partition", str(tmp_path / "mask.json"), "--for", "pipelining", *four]
    )
    assert refused.exit_code == 2 and refused.output.count("\n") == 1
    assert (
        "torch.distributed.pipelining can run" in refused.output
        and "at most 3 stage(s), not 4" in refused.output
    )
    run_cli("partition", str(tmp_path / "mask.json"), "--for", "pipelining", "--use-fewer-devices", *four)
    assert [(s.layer_start, s.layer_end) for s in Plan.load(tmp_path / "p.json").stages] == [
        (0, 1),
        (1, 3),
        (3, 4),
    ]
    run_cli("export", str(tmp_path / "p.json"), "--to", "pipelining", "--model", model)
    # without --for the DP takes a stage of its own for a: torch's own split would crash, so
    # export writes pipeplan's stage modules (they relay the mask) and says why in one line
    run_cli("partition", str(tmp_path / "mask.json"), "--straight", "--schedule", "1f1b-flush", *four)
    assert len(Plan.load(tmp_path / "p.json").stages) == 4
    output = run_cli(
        "export",
        str(tmp_path / "p.json"),
        "--to",
        "pipelining",
        "--model",
        model,
        "-o",
        str(tmp_path / "s.py"),
    )
    why = output.splitlines()[1]
    assert why.startswith(
        "stages: pipeplan's stage modules in PipelineStage, since torch.distributed.pipelining's own split of "
    )
    assert "at a, b, head: a value stage 0 computes" in why
    assert "is read by stages 1, 2, not by the next stage alone" in why
    assert "STAGE_OF_LAYER = (0, 1, 2, 3)" in (tmp_path / "s.py").read_text()


@pytest.mark.parametrize("kind", ["leaf_modules", "opaque_modules"])
def test_export_rebuilds_the_plans_leaf_and_opaque_layers(kind: str, tmp_path: Path) -> None:
    """A plan made from a profile with --leaf-modules / --opaque-modules exports (the layer
    graph is rebuilt with the plan's classes, so the fingerprints agree)."""
    model = str(FIXTURES / "export" / "blocks.py")
    profile_model(model, batch_size=BATCH, warmup=0, repeats=1, threads=1, **{kind: ("Block",)}).save(
        tmp_path / "blocks.json"
    )
    names = [layer.name for layer in Profile.load(tmp_path / "blocks.json").layers]
    assert names == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    plan = plan_for(tmp_path / "blocks.json", "pipelining", tmp_path / "p.json")
    assert getattr(plan, kind) == ("Block",)
    output = run_cli("export", str(tmp_path / "p.json"), "--to", "pipelining", "--model", model)
    first = names[plan.stages[1].layer_start]
    assert f'SPLIT_SPEC = {{"{first}": SplitPoint.BEGINNING}}' in output


@pytest.mark.slow
def test_planned_for_torchtitan_exports_the_stages_units(profiles: dict[str, Path], tmp_path: Path) -> None:
    for name, model in MODELS.items():
        profile = Profile.load(profiles[name])
        plan = plan_for(profiles[name], "torchtitan", tmp_path / f"{name}.plan.json")
        output = run_cli(
            "export", str(tmp_path / f"{name}.plan.json"), "--to", "torchtitan", "--model", model
        )
        parts = tomllib.loads(output)["parallelism"]["module_fqns_per_model_part"]
        containers = {m.name for m in profile.modules if m.container}
        for stage, part in zip(plan.stages, parts):  # the units of a stage's layers are its part's
            units = set()
            for i in stage.layers:
                head = profile.layers[i].name.split(".")
                units.add(".".join(head[:2]) if head[0] in containers and len(head) > 1 else head[0])
            assert units <= set(part), (name, units, part)
        assert sorted(unit for part in parts for unit in part) == sorted(
            {unit for part in parts for unit in part}
        ), name  # every unit once


def test_tied_gpt_has_no_torchtitan_cut_and_exports_tied_stages_to_pipelining(tmp_path: Path) -> None:
    profile_model("gpt", batch_size=4, warmup=0, repeats=1, threads=1).save(tmp_path / "gpt.json")
    args = ["partition", str(tmp_path / "gpt.json"), "--topology", "local-cpu", "--microbatches", "2"]
    result = CliRunner().invoke(cli, [*args, "--for", "torchtitan", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "can cut gpt at no layer boundary, too few for 2 stages" in lines[0]
    assert "parameter wte.weight (used by layers 0 (wte) and 15 (ln_f))" in lines[0]
    one = CliRunner().invoke(
        cli, [*args, "--for", "torchtitan", "--use-fewer-devices", "-o", str(tmp_path / "p.json")]
    )
    assert one.exit_code == 0 and len(Plan.load(tmp_path / "p.json").stages) == 1
    # pipelining: the tied embedding and head on two stages, their gradients summed
    plan = plan_for(tmp_path / "gpt.json", "pipelining", tmp_path / "tied.json")
    assert plan.stages[0].layer_start == 0 and plan.stages[1].layer_end == 16
    output = run_cli("export", str(tmp_path / "tied.json"), "--to", "pipelining", "--model", "gpt")
    assert (
        "# Stages: pipeplan's stage modules in PipelineStage, since parameter wte.weight is used by "
        in output
    )
    assert '"wte.weight": (0, 1),' in output


@pytest.mark.slow
def test_export_agrees_with_the_planners_rules_at_every_boundary(profiles: dict[str, Path]) -> None:
    """Every boundary the planner allows exports; every one it blocks for a module reason, export refuses;
    for ViT, torch's own split of every 2-stage plan is checked too."""
    from pipeplan.errors import InputError
    from pipeplan.export import model_structure, split_points, torchtitan_parts
    from pipeplan.export.pipelining import check_torch_split
    from pipeplan.planner.targets import target_cuts

    def pipelining(structure, plan: Plan, stage_of: list[int], traced: bool) -> None:
        points = split_points(structure, stage_of)
        if traced:
            cut = stage_of.index(1)
            two = [
                replace(plan.stages[0], layers=tuple(range(cut)), layer_start=0, layer_end=cut),
                replace(
                    plan.stages[1],
                    layers=tuple(range(cut, len(stage_of))),
                    layer_start=cut,
                    layer_end=len(stage_of),
                ),
            ]
            check_torch_split(replace(plan, stages=tuple(two)), structure, points)

    for name in ("resnet", "vit"):
        profile = Profile.load(profiles[name])
        cuts_pp, cuts_tt = target_cuts(profile, "pipelining"), target_cuts(profile, "torchtitan")
        made = run_cli(
            "partition",
            str(profiles[name]),
            "--topology",
            "local-cpu",
            "--straight",
            "--schedule",
            "gpipe",
            "--microbatches",
            "2",
            "-o",
            str(profiles[name].parent / f"{name}.any.json"),
        )
        assert "wrote" in made
        plan = Plan.load(profiles[name].parent / f"{name}.any.json")
        structure = model_structure(MODELS[name], plan)
        n = len(profile.layers)
        for c in range(1, n):
            stage_of = [0] * c + [1] * (n - c)
            for cuts, check in (
                (cuts_pp, lambda: pipelining(structure, plan, stage_of, name == "vit")),
                (cuts_tt, lambda: torchtitan_parts(structure, stage_of, 2)),
            ):
                if c in cuts.allowed:
                    check()
                elif (
                    "parameter" not in cuts.blocked.get(c, "parameter")
                    and "model input" not in cuts.blocked[c]
                ):
                    with pytest.raises(InputError):
                        check()


@pytest.mark.slow
def test_vit_three_stage_splits_the_planner_allows_are_those_torch_runs(profiles: dict[str, Path]) -> None:
    """Every 3-stage split of ViT at the cuts --for pipelining allows: the DP's family admits it
    exactly when torch's own ``pipeline()`` split passes no value past the next stage."""
    from pipeplan.capture.torch_split import split_faults
    from pipeplan.export import model_structure, split_points
    from pipeplan.planner.targets import target_cuts, target_family

    profile = Profile.load(profiles["vit"])
    cuts = target_cuts(profile, "pipelining")
    family = target_family(cuts, profile)
    assert family.stage_ok is not None
    plan = plan_for(profiles["vit"], "pipelining", profiles["vit"].parent / "vit.three.json")
    structure = model_structure(MODELS["vit"], plan)
    assert structure.trace is not None
    n, runs = len(profile.layers), []
    for i, a in enumerate(cuts.allowed, 1):  # state i of the family is the prefix of a layers
        for j, b in enumerate(cuts.allowed[i:], i + 1):
            allowed = bool(family.stage_ok[0, i] and family.stage_ok[i, j] and family.stage_ok[j, -1])
            faults = split_faults(
                structure.trace(split_points(structure, [0] * a + [1] * (b - a) + [2] * (n - b)))
            )
            assert allowed == (not faults), (a, b, faults)
            runs.append(allowed)
    assert 0 < sum(runs) < len(runs)  # both kinds occur


@pytest.mark.slow
def test_a_split_that_traces_but_fails_when_run_exports_stage_modules(tmp_path: Path) -> None:
    """Issue 32's untied Mistral: torch's pipeline() traces it at model.layers.2, but its stage 0
    expects an input the schedule never feeds it (under torchrun: StopIteration in
    torch/fx/interpreter.py). Running the stages in-process finds it; export writes pipeplan's
    stage modules, which ran, and says why."""
    model = str(FIXTURES / "export" / "mistral_untied.py")
    profile_model(model, batch_size=8, warmup=0, repeats=1, threads=1).save(tmp_path / "m.json")
    run_cli(
        "partition", str(tmp_path / "m.json"), "--topology", "local-cpu", "--for", "pipelining",
        "--microbatches", "4", "-o", str(tmp_path / "p.json"),
    )  # fmt: skip
    output = run_cli("export", str(tmp_path / "p.json"), "--to", "pipelining", "--model", model)
    assert "# Stages: pipeplan's stage modules in PipelineStage, since torch's pipeline() split at " in output
    assert " fails when run: stage 0 fails on the 1 input(s) torch feeds it (RuntimeError: " in output
    assert "# Checked: every stage ran forward and backward on one micro-batch" in output
    assert "TIED = {}" in output
