"""Hugging Face families as users build and call them: profile -> partition (2 stages) -> run.

Tiny configs from ``tests/fixtures/models/hf_family.py`` (nothing downloaded): rotary
decoders (Llama, Mistral with a sliding window, Qwen2 with its embedding tied to the head
across the cut, Gemma 3), MoE routing (Mixtral), T5 (ids, mask and decoder ids as a tuple),
BART and Whisper (keyword dicts), ViT and HF ResNet (in-place residual adds). Each runs
1F1B-Flush on 2 gloo ranks, all families in one launch, and must equal single-process
training on the same batches. More families go through profile and partition.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")

from ports import free_port  # noqa: E402
from test_run_torchrun import LR, assert_params_match, env, records  # noqa: E402

from pipeplan.cli import cli  # noqa: E402
from pipeplan.plan import Plan  # noqa: E402
from pipeplan.profiler.profile_model import profile_model  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES / "runtime"))
from reference import train_reference  # noqa: E402

MODEL = str(FIXTURES / "models" / "hf_family.py")
RUN = ["resnet", "llama", "mistral", "qwen2", "gemma3", "mixtral", "t5", "bart", "whisper", "vit"]
PLAN_ONLY = ["qwen3", "phi3", "olmo", "gpt_neox", "qwen2_moe", "deepseek_v3", "modernbert", "gpt2", "bert"]
# family -> layers (module calls, pipeplan's granularity); every capture is torch.export
LAYERS = {
    "llama": 12,
    "mistral": 12,
    "qwen2": 12,
    "qwen3": 12,
    "gemma3": 16,
    "phi3": 16,
    "olmo": 12,
    "gpt_neox": 17,
    "mixtral": 12,
    "qwen2_moe": 12,
    "deepseek_v3": 12,
    "modernbert": 17,
    "gpt2": 13,
    "bert": 15,
    "t5": 19,
    "bart": 35,
    "whisper": 36,
    "vit": 16,
    "resnet": 27,
}
BATCH, MICROBATCHES, STEPS = 4, 2, 2
# BatchNorm normalises over a micro-batch: ResNet equals whole-batch training with one
ONE_MICROBATCH = {"resnet"}


def messages_per_unit(trace: Path) -> dict[str, int]:
    """The most messages one unit sent each way (headers aside), from a run's ``--trace``;
    the units that sent any."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    counts: dict[tuple[str, str], int] = {}
    for event in events:
        if event.get("cat") == "send" and "header" not in event["name"]:
            kind, unit = event["name"].split()[:2]  # "send F3.1 ->r1"
            key = (f"{kind} {unit[0]}", unit[1:])
            counts[key] = counts.get(key, 0) + 1
    most: dict[str, int] = {}
    for (direction, _), count in counts.items():
        most[direction] = max(most.get(direction, 0), count)
    return most


def plan_family(family: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Plan:
    """Profile (one measured pass) and partition into 2 stages with 1F1B-Flush."""
    monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
    profile = profile_model(MODEL, batch_size=BATCH, device="cpu", warmup=0, repeats=1)
    assert (profile.capture, len(profile.layers)) == ("export", LAYERS[family])
    profile.save(folder / f"{family}.profile.json")
    out = folder / f"{family}.plan.json"
    result = CliRunner().invoke(
        cli,
        [
            "partition",
            str(folder / f"{family}.profile.json"),
            "--topology",
            "local-cpu",
            "--straight",
            "--tensor-parallel",
            "1",
            "--schedule",
            "1f1b-flush",
            "--microbatches",
            str(1 if family in ONE_MICROBATCH else MICROBATCHES),
            "-o",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert len(plan.stages) == 2
    return plan


pytestmark = pytest.mark.slow  # whole models: Hugging Face families, meta builds


@pytest.mark.parametrize("family", PLAN_ONLY)
def test_family_profiles_and_partitions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    plan_family(family, tmp_path, monkeypatch)


@pytest.mark.multiprocess
def test_families_train_on_two_ranks_as_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = []
    for family in RUN:  # profiles and plans: 10 captures in this process
        plan = plan_family(family, tmp_path, monkeypatch)
        if family == "qwen2":  # the tied embedding (stage 0) and head (stage 1) straddle the cut
            assert plan.stages[0].layer_start == 0 and plan.stages[1].layer_end == LAYERS[family]
        jobs.append(
            {
                "family": family,
                "model": MODEL,
                "plan": str(tmp_path / f"{family}.plan.json"),
                "record": str(tmp_path / family),
                "port": free_port(),
                "steps": STEPS,
                "lr": LR,
                **({"trace": str(tmp_path / "t5.trace.json")} if family == "t5" else {}),
            }
        )
    script = str(FIXTURES / "runtime" / "run_families.py")
    master = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, script, json.dumps(jobs)],
            env={**env(), **master, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr[-3000:]
    for family in RUN:
        monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
        reference, _ = train_reference(MODEL, STEPS, BATCH, LR)
        recs = records(tmp_path / family)
        assert len(recs) == 2, family
        assert_params_match(recs, reference)
        if family == "t5":  # several values cross the cut each way: one message per unit
            assert messages_per_unit(tmp_path / "t5.trace.json") == {"send F": 1, "send B": 1}
        if family == "qwen2":  # one tensor, held by both stages, updated alike
            tied = [rec["params"]["model.embed_tokens.weight"] for rec in recs.values()]
            assert len(tied) == 2
            torch.testing.assert_close(tied[0], tied[1], rtol=0, atol=0)
