"""The torch.distributed.pipelining baseline: 2 gloo CPU ranks vs one process."""

from __future__ import annotations

import importlib.util
import math
import textwrap
import time
from pathlib import Path

import pytest

from pipeplan.errors import InputError, RuntimeFailure

BENCH = Path(__file__).resolve().parents[1] / "bench" / "pipelining_baseline.py"

TINY_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build_model():
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def sample_batch(batch_size):
        x = torch.randn(batch_size, 6)
        return x, (x[:, :3] * 2.0).argmax(dim=1)
    """
)


@pytest.fixture(scope="module")
def baseline():
    spec = importlib.util.spec_from_file_location("pipelining_baseline_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def tiny_model(tmp_path: Path) -> str:
    path = tmp_path / "tiny.py"
    path.write_text(TINY_MODEL)
    return str(path)


@pytest.mark.multiprocess
def test_pipelined_losses_match_single_process(baseline, tiny_model: str) -> None:
    kwargs = {"batch_size": 8, "steps": 4, "lr": 0.5}
    piped = baseline.run_pipelining_baseline(tiny_model, [2], microbatches=2, timeout_s=60, **kwargs)
    single = baseline.run_single_process_baseline(tiny_model, **kwargs)
    assert piped["ranks"] == 2 and piped["microbatches"] == 2
    assert len(piped["losses"]) == len(single["losses"]) == 4
    # 1F1B averages equal micro-batch gradients: the same SGD trajectory as one process
    assert piped["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=1e-6)
    for run in (piped, single):
        assert math.isfinite(run["samples_per_s"]) and run["samples_per_s"] > 0
        assert run["time_per_minibatch_ms"] == pytest.approx(8 / run["samples_per_s"] * 1e3, rel=1e-9)
    # training moved the weights: losses are not all equal to the first one
    assert max(abs(loss - single["losses"][0]) for loss in single["losses"][1:]) > 1e-4


def test_bad_arguments_fail_before_launching(baseline, tiny_model: str, tmp_path: Path) -> None:
    with pytest.raises(
        InputError, match=r"Schedule1F1B needs microbatches >= ranks \(microbatches: 1, ranks: 2\)"
    ):
        baseline.run_pipelining_baseline(tiny_model, [2], 8, 1, 2, 0.1)
    with pytest.raises(InputError, match="schedule 'GPipe' is not one of Schedule1F1B, "):
        baseline.run_pipelining_baseline(tiny_model, [2], 8, 2, 2, 0.1, schedule="GPipe")
    with pytest.raises(
        InputError, match="ScheduleInterleaved1F1B with 2 stages per rank does not fit 3 stages"
    ):
        baseline.run_pipelining_baseline(
            tiny_model, [1, 2], 8, 2, 2, 0.1, schedule="ScheduleInterleaved1F1B", virtual_stages=2
        )
    with pytest.raises(InputError, match="batch size 9 does not split into 2 equal micro-batches"):
        baseline.run_pipelining_baseline(tiny_model, [2], 9, 2, 2, 0.1)
    with pytest.raises(InputError, match=r"boundaries \[5\] must increase strictly within 1..4"):
        baseline.run_pipelining_baseline(tiny_model, [5], 8, 2, 2, 0.1)
    not_sequential = tmp_path / "block.py"
    not_sequential.write_text(TINY_MODEL.replace("return nn.Sequential(", "return nn.ModuleDict(); (", 1))
    with pytest.raises(InputError, match="splits an nn.Sequential, build_model\\(\\) returned ModuleDict"):
        baseline.run_pipelining_baseline(str(not_sequential), [2], 8, 2, 2, 0.1)


@pytest.mark.multiprocess
def test_timeout_kills_the_launch(baseline, tiny_model: str) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match="exceeded its timeout of 0.5 s"):
        baseline.run_pipelining_baseline(tiny_model, [2], 8, 2, 50, 0.1, timeout_s=0.5)
    assert time.monotonic() - start < 10
