"""Hugging Face families through ``partition --for pipelining`` -> ``export`` -> torch's own schedules.

Every family ``pipeplan run`` trains split in ``tests/test_hf_families.py`` (rotary decoders
Llama, Mistral and Gemma 3, Qwen2 with its embedding tied to the head across the cut,
Mixtral's MoE, T5, BART and Whisper with keyword inputs, ViT, HF ResNet), built from tiny
configs (nothing downloaded), is profiled, planned for 2 stages ``--for pipelining`` and
exported; the exported snippet trains 3 steps under torch's ``Schedule1F1B`` on 2 gloo ranks
and must give ``pipeplan run``'s losses (rel 1e-5), the tied copies equal after training.
Llama also runs ``ScheduleInterleaved1F1B`` (4 stages on 2 ranks), and plans cut at random
boundaries of three families, which export accepts, each run one step under torch. All
cases share one launch of 2 ranks (``tests/fixtures/export/compare_engines.py``).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")

from ports import free_port  # noqa: E402
from test_export_targets import launch, plan_for, run_cli  # noqa: E402

from pipeplan.cli import cli  # noqa: E402
from pipeplan.plan import Plan  # noqa: E402
from pipeplan.profiler.profile_model import profile_model  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = str(FIXTURES / "models" / "hf_family.py")
FAMILIES = ["llama", "mistral", "qwen2", "gemma3", "mixtral", "t5", "bart", "whisper", "vit", "resnet"]
RANDOM_CUTS = ["mistral", "t5", "vit"]  # one plan each, cut at a random boundary
BATCH, MICROBATCHES, STEPS, LR = 4, 2, 3, 0.05

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def export(name: str, plan: Path, folder: Path) -> str:
    """``pipeplan export --to pipelining`` to ``folder/name.py``; the CLI's output (exit code 0)."""
    return run_cli(
        "export", str(plan), "--to", "pipelining", "--model", MODEL, "-o", str(folder / f"{name}.py")
    )


def case(name: str, family: str, plan: Path, folder: Path, steps: int = STEPS) -> dict:
    """The launch case training ``folder/name.py`` (exported) and ``plan`` (pipeplan run)."""
    return {
        "name": name,
        "model": MODEL,
        "plan": str(plan),
        "snippet": str(folder / f"{name}.py"),
        "steps": steps,
        "lr": LR,
        "ports": [free_port(), free_port()],
        "env": {"PIPEPLAN_HF_FAMILY": family},
    }


def profile_and_plan(family: str, folder: Path, *extra: str) -> Path:
    """Profile ``family`` (one measured pass) and plan it for 2 ranks; the plan's path."""
    profile = folder / f"{family}.profile.json"
    if not profile.exists():
        profile_model(MODEL, batch_size=BATCH, device="cpu", warmup=0, repeats=1, threads=1).save(profile)
    out = folder / f"{family}{'.'.join(('', *extra)).replace('-', '')}.plan.json"
    if not extra:
        plan_for(profile, "pipelining", out)
        return out
    run_cli("partition", str(profile), "--topology", "local-cpu", "--straight", "-o", str(out), *extra)
    return out


def random_cut(plan_path: Path, rng: random.Random, out: Path) -> tuple[Path, int]:
    """``plan_path``'s 2 stages moved to a boundary drawn at random; (its path, the boundary)."""
    plan = Plan.load(plan_path)
    layers = plan.stages[-1].layer_end
    cut = rng.randrange(1, layers)
    bounds = [(0, cut), (cut, layers)]
    stages = tuple(
        replace(stage, layer_start=a, layer_end=b, layers=tuple(range(a, b)))
        for stage, (a, b) in zip(plan.stages, bounds)
    )
    replace(plan, stages=stages, export_target=None).save(out)
    return out, cut


def test_families_run_under_torchs_schedules_with_pipeplans_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = time.perf_counter()
    cases, chosen = [], {}
    for family in FAMILIES:
        monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
        output = export(family, profile_and_plan(family, tmp_path), tmp_path)
        chosen[family] = output.splitlines()[1]
        assert output.splitlines()[2].startswith("checked: every stage ran forward and backward"), output
        cases.append(case(family, family, tmp_path / f"{family}.plan.json", tmp_path))
    # the tied embedding (stage 0) and head (stage 1) of Qwen2 straddle the cut
    assert '"model.embed_tokens.weight": (0, 1),' in (tmp_path / "qwen2.py").read_text()
    monkeypatch.setenv("PIPEPLAN_HF_FAMILY", "llama")
    interleaved = profile_and_plan(
        "llama", tmp_path, "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--microbatches", "4"
    )
    assert len(Plan.load(interleaved).stages) == 4
    assert "ScheduleInterleaved1F1B" in export("llama_interleaved", interleaved, tmp_path)
    cases.append(case("llama_interleaved", "llama", interleaved, tmp_path))
    rng = random.Random(32)
    drawn = {}
    for family in RANDOM_CUTS:
        monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
        refused = 0
        for _ in range(5):  # the first cut export accepts
            path, cut = random_cut(
                tmp_path / f"{family}.plan.json", rng, tmp_path / f"{family}_cut.plan.json"
            )
            result = CliRunner().invoke(
                cli,
                [
                    "export",
                    str(path),
                    "--to",
                    "pipelining",
                    "--model",
                    MODEL,
                    "-o",
                    str(tmp_path / f"{family}_cut.py"),
                ],
            )
            if result.exit_code == 0:
                break
            assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
            refused += 1
        assert refused < 5, family
        drawn[family] = (cut, refused)
        cases.append(case(f"{family}_cut", family, path, tmp_path, steps=1))
    prepared = time.perf_counter() - started
    launch(cases, tmp_path, timeout_s=900.0)
    for job in cases:
        torch_run = json.loads((tmp_path / f"{job['name']}.pipelining.json").read_text())
        ours = json.loads((tmp_path / f"{job['name']}.pipeplan.json").read_text())["losses"]
        assert len(ours) == job["steps"], job["name"]
        assert torch_run["losses"] == pytest.approx(ours, rel=1e-5, abs=1e-6), (job["name"], chosen)
        if job["steps"] > 1:
            assert max(abs(loss - ours[0]) for loss in ours[1:]) > 1e-5, job["name"]  # the weights moved
    qwen2 = json.loads((tmp_path / "qwen2.pipelining.json").read_text())
    assert qwen2["tied_spread"] == {"model.embed_tokens.weight": 0.0}  # the copies stayed identical
    print(
        f"prepared in {prepared:.1f} s, launch {time.perf_counter() - started - prepared:.1f} s; "
        f"random cuts {drawn}; {chosen}"
    )
