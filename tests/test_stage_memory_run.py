"""Each schedule's ranks hold what their plan charges: a tiny Llama profiled, planned on 2 CPU
devices with 4 micro-batches and trained on 2 gloo ranks; every rank's live tensors over the
first steps (``tensor_held_bytes``) within 15% of its planned memory.

Before the plan charged them (2 gloo ranks, 8 steps): ZB-H1's loss stage held 1.38x (the
gradients its "I" records for its "W"), interleaved 1F1B's ranks 1.28x and ZB-V's 1.28x (the
values a chunk received and the outputs it sent, kept until their backward).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_run_torchrun import env, torchrun

from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.partition import partition
from pipeplan.profile import Profile
from pipeplan.topology import resolve

pytestmark = pytest.mark.multiprocess

HF_MODEL = Path(__file__).resolve().parent / "fixtures" / "models" / "hf_family.py"
FAMILY = {"PIPEPLAN_HF_FAMILY": "llama", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def llama_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "profile.json"
    done = subprocess.run(
        [sys.executable, "-m", "pipeplan", "profile", str(HF_MODEL), "--batch-size", "8"]
        + ["--repeats", "2", "--threads", "1", "-o", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env(), **FAMILY},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return path


def test_the_profile_records_what_the_plan_charges(llama_profile: Path) -> None:
    layers = Profile.load(llama_profile).layers
    assert layers[0].deferred_weight_bytes == 0  # token ids need no gradient
    assert all(layer.deferred_weight_bytes > 0 for layer in layers[1:] if layer.param_bytes)
    assert all(layer.output_saved_by is not None and layer.output_tensors >= 1 for layer in layers)


@pytest.mark.parametrize(
    "schedule, virtual", [("1f1b-flush", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zb-v", 2)]
)
def test_every_rank_holds_what_its_plan_charges(
    tmp_path: Path, llama_profile: Path, schedule: str, virtual: int
) -> None:
    options = PartitionOptions(schedule=schedule, microbatches=4, straight=True, virtual_stages=virtual)
    partition(Profile.load(llama_profile), resolve("local-cpu"), options).save(tmp_path / "plan.json")
    metrics = tmp_path / "metrics.json"
    result = torchrun(
        2,
        [str(tmp_path / "plan.json"), "--model", str(HF_MODEL), "--steps", "8"]
        + ["--no-progress", "--metrics", str(metrics)],
        timeout=300,
        extra_env=FAMILY,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(metrics.read_text())["stages"]
    assert len(ranks) == 2
    for rank in ranks:
        ratio = rank["tensor_held_bytes"] / rank["predicted_memory_bytes"]
        assert abs(ratio - 1) <= 0.15, (schedule, rank["stage"], ratio)
