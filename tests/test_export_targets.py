"""The test zoo through ``partition --for`` then ``export``: the exported split runs on torch.distributed.pipelining.

Each model (the bundled MLP, VGG without dropout, ResNet; Hugging Face ViT, GPT-2 with an
untied head and BERT from tiny configs) is profiled once, planned ``--for pipelining``
(2 stages, 1F1B-Flush) and exported; one launch of 2 gloo ranks trains every exported
split under torch's Schedule1F1B and the same plan under ``pipeplan run``: the losses
must agree and every rank must hold exactly its plan stage's parameters. ``--for
torchtitan`` plans export a fragment whose units are the stages' own. The bundled GPT
(its head reuses the embedding weight) has no cut either engine runs: one line says so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

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
    output = run_cli("partition", str(profile), "--topology", "local-cpu", "--for", target,
                     "--microbatches", str(MICROBATCHES), "-o", str(out))
    assert f"--for {target}: " in output and " ms/minibatch predicted" in output
    plan = Plan.load(out)
    assert plan.export_target == target and len(plan.stages) == 2 and plan.schedule == "1f1b-flush"
    return plan


def stage_parameters(profile: Profile, plan: Plan) -> list[list[str]]:
    return [sorted({name for i in stage.layers for name in profile.layers[i].parameters}) for stage in plan.stages]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cases: list[dict], folder: Path, timeout_s: float = 420.0) -> None:
    """Two ranks of ``compare_engines.py`` (RANK/WORLD_SIZE set as torchrun would), killed after ``timeout_s`` s."""
    (folder / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(FIXTURES / "export" / "compare_engines.py"), str(folder / "cases.json"), str(folder)]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(2)]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        for process in ranks:
            os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the engines ran past {timeout_s} s")
    for process, output in zip(ranks, outputs):
        assert process.returncode == 0, output[-3000:]


@pytest.mark.multiprocess
def test_planned_for_pipelining_exports_and_runs_with_pipeplans_losses(profiles: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    cases, expected = [], {}
    for name, model in MODELS.items():
        plan = plan_for(profiles[name], "pipelining", tmp_path / f"{name}.plan.json")
        run_cli("export", str(tmp_path / f"{name}.plan.json"), "--to", "pipelining", "--model", model,
                "-o", str(tmp_path / f"{name}.split.py"))
        cases.append({"name": name, "model": model, "plan": str(tmp_path / f"{name}.plan.json"),
                      "snippet": str(tmp_path / f"{name}.split.py"), "steps": STEPS, "lr": LR,
                      "ports": [free_port(), free_port()]})
        expected[name] = stage_parameters(Profile.load(profiles[name]), plan)
    launch(cases, tmp_path)
    for name in MODELS:
        torch_run = json.loads((tmp_path / f"{name}.pipelining.json").read_text())
        ours = json.loads((tmp_path / f"{name}.pipeplan.json").read_text())["losses"]
        assert len(ours) == STEPS and torch_run["microbatches"] == [MICROBATCHES] * STEPS, name
        assert torch_run["losses"] == pytest.approx(ours, rel=1e-5, abs=1e-6), name
        assert max(abs(loss - ours[0]) for loss in ours[1:]) > 1e-5, name  # the weights moved
        # torch cut where the plan did: each rank holds exactly its stage's parameters
        assert torch_run["parameters_by_rank"] == expected[name], name


@pytest.mark.parametrize("kind", ["leaf_modules", "opaque_modules"])
def test_export_rebuilds_the_plans_leaf_and_opaque_layers(kind: str, tmp_path: Path) -> None:
    """A plan made from a profile with --leaf-modules / --opaque-modules exports (the layer
    graph is rebuilt with the plan's classes, so the fingerprints agree)."""
    model = str(FIXTURES / "export" / "blocks.py")
    profile_model(model, batch_size=BATCH, warmup=0, repeats=1, threads=1, **{kind: ("Block",)}).save(
        tmp_path / "blocks.json")
    names = [layer.name for layer in Profile.load(tmp_path / "blocks.json").layers]
    assert names == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    plan = plan_for(tmp_path / "blocks.json", "pipelining", tmp_path / "p.json")
    assert getattr(plan, kind) == ("Block",)
    output = run_cli("export", str(tmp_path / "p.json"), "--to", "pipelining", "--model", model)
    first = names[plan.stages[1].layer_start]
    assert f'SPLIT_SPEC = {{"{first}": SplitPoint.BEGINNING}}' in output


def test_planned_for_torchtitan_exports_the_stages_units(profiles: dict[str, Path], tmp_path: Path) -> None:
    for name, model in MODELS.items():
        profile = Profile.load(profiles[name])
        plan = plan_for(profiles[name], "torchtitan", tmp_path / f"{name}.plan.json")
        output = run_cli("export", str(tmp_path / f"{name}.plan.json"), "--to", "torchtitan", "--model", model)
        parts = tomllib.loads(output)["parallelism"]["module_fqns_per_model_part"]
        containers = {m.name for m in profile.modules if m.container}
        for stage, part in zip(plan.stages, parts):  # the units of a stage's layers are its part's
            units = set()
            for i in stage.layers:
                head = profile.layers[i].name.split(".")
                units.add(".".join(head[:2]) if head[0] in containers and len(head) > 1 else head[0])
            assert units <= set(part), (name, units, part)
        assert sorted(unit for part in parts for unit in part) == sorted(
            {unit for part in parts for unit in part}), name  # every unit once


def test_tied_gpt_has_no_cut_and_says_why(tmp_path: Path) -> None:
    profile_model("gpt", batch_size=4, warmup=0, repeats=1, threads=1).save(tmp_path / "gpt.json")
    for target in ("pipelining", "torchtitan"):
        result = CliRunner().invoke(cli, ["partition", str(tmp_path / "gpt.json"), "--topology", "local-cpu",
                                          "--for", target, "--microbatches", "2", "-o", str(tmp_path / "p.json")])
        assert result.exit_code == 2
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "can cut gpt at no layer boundary, too few for 2 stages" in lines[0]
        assert "parameter wte.weight (used by layers 0 (wte) and 15 (ln_f))" in lines[0]
        one = CliRunner().invoke(cli, ["partition", str(tmp_path / "gpt.json"), "--topology", "local-cpu", "--for",
                                       target, "--microbatches", "2", "--use-fewer-devices", "-o",
                                       str(tmp_path / "p.json")])
        assert one.exit_code == 0 and len(Plan.load(tmp_path / "p.json").stages) == 1


def test_export_agrees_with_the_planners_rules_at_every_boundary(profiles: dict[str, Path]) -> None:
    """Every boundary the planner allows exports; every one it blocks for a module reason, export refuses."""
    from pipeplan.errors import InputError
    from pipeplan.export import model_structure, split_points, torchtitan_parts
    from pipeplan.planner.targets import target_cuts

    for name in ("resnet", "vit"):
        profile = Profile.load(profiles[name])
        cuts_pp, cuts_tt = target_cuts(profile, "pipelining"), target_cuts(profile, "torchtitan")
        made = run_cli("partition", str(profiles[name]), "--topology", "local-cpu", "--straight", "--schedule",
                       "gpipe", "--microbatches", "2", "-o", str(profiles[name].parent / f"{name}.any.json"))
        assert "wrote" in made
        plan = Plan.load(profiles[name].parent / f"{name}.any.json")
        structure = model_structure(MODELS[name], plan)
        n = len(profile.layers)
        for c in range(1, n):
            stage_of = [0] * c + [1] * (n - c)
            for cuts, check in ((cuts_pp, lambda: split_points(structure, stage_of)),
                                (cuts_tt, lambda: torchtitan_parts(structure, stage_of, 2))):
                if c in cuts.allowed:
                    check()
                elif "parameter" not in cuts.blocked.get(c, "parameter") and "model input" not in cuts.blocked[c]:
                    with pytest.raises(InputError):
                        check()
