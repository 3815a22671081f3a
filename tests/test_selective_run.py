"""Selective recomputation run on 2 gloo ranks (issue 30): a plan whose stages recompute the
attention cores of their layers (``StagePlan.selective_layers``) trains a tiny eager-attention
Llama to the parameters of single-process training; a plan naming a layer without an
attention core is refused in one line."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from test_run_torchrun import FIXTURES, assert_params_match, records, torchrun

from pipeplan.errors import InputError
from pipeplan.modelfile import load_model_file
from pipeplan.plan import Plan
from pipeplan.runtime.stage import build_pipeline

sys.path.insert(0, str(FIXTURES))
from plans import make_plan  # noqa: E402
from reference import train_reference  # noqa: E402

pytestmark = pytest.mark.multiprocess

MODEL = str(FIXTURES / "eager_llama.py")
LR, STEPS, BATCH = 0.05, 2, 4


def _plan(selective: tuple[tuple[int, ...], tuple[int, ...]]) -> Plan:
    """Embedding and block 0 on rank 0, block 1 and the head on rank 1, 1F1B-flush, 2 micro-batches."""
    plan = make_plan(MODEL, [range(6), range(6, 12)], [1, 1], batch_size=BATCH, microbatches=2)
    stages = tuple(
        dataclasses.replace(s, selective_layers=layers) for s, layers in zip(plan.stages, selective)
    )
    return dataclasses.replace(plan, stages=stages)


def _args(plan: Plan, folder: Path, name: str) -> list[str]:
    path = folder / f"{name}.json"
    plan.save(path)
    args = [str(path), "--model", MODEL, "--steps", str(STEPS), "--lr", str(LR), "--no-progress"]
    return [*args, "--record", str(folder / f"rec-{name}")]


def test_selective_layers_train_as_one_process_and_a_layer_without_a_core_is_refused(tmp_path: Path) -> None:
    result = torchrun(2, _args(_plan(((3,), (7,))), tmp_path, "selective"), timeout=240.0)
    assert result.returncode == 0, result.stderr[-3000:]
    reference, _ = train_reference(MODEL, STEPS, BATCH, LR)
    assert_params_match(records(tmp_path / "rec-selective"), reference)
    with pytest.raises(InputError, match=r"selective recomputation of layer\(s\) \[2\]: no attention core"):
        build_pipeline(
            load_model_file(MODEL), _plan(((2,), ())), rank=0, seed=0, sample_batch_size=BATCH // 2
        )
