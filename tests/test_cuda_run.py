"""On a GPU (skipped without CUDA): an HF Llama profiled on CUDA in bf16, trained by one NCCL rank.

The runtime captures the stage on the CPU (or on meta) and runs it on the GPU: the torch.export
graph must carry the GPU as its device (``build_layer_graph(device=...)``). From ``--weights``
(a seeded ``save_pretrained``), the first loss is the model's own in bf16 in one process, and
the rank's memory is read from the CUDA allocator.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and PIPEPLAN_TEST_CUDA=1"),
]
pytest.importorskip("transformers")

from test_run_torchrun import torchrun  # noqa: E402

from pipeplan.cli import cli  # noqa: E402
from pipeplan.modelfile import load_model_file  # noqa: E402

MODEL = str(Path(__file__).parent / "fixtures" / "models" / "hf_family.py")
ONE_GPU = str(Path(__file__).parent.parent / "bench" / "one-h100.yaml")
BATCH = 4


@pytest.mark.parametrize("build", ["eager", "meta"])
def test_a_bf16_llama_trains_on_one_gpu_from_its_weights(
    tmp_path: Path, build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPEPLAN_HF_FAMILY", "llama")
    model_file = load_model_file(MODEL)
    torch.manual_seed(123)
    pretrained = model_file.build().to(torch.bfloat16)
    pretrained.save_pretrained(tmp_path / "hf")
    inputs, targets = model_file.batch(BATCH, 0)  # minibatch 0 of a seed-0 run
    with torch.no_grad():
        output = inputs.map(lambda t: t.cuda()).call(pretrained.cuda())
        reference = float(model_file.loss_fn(output, targets.cuda()))

    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "profile",
            MODEL,
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "-b",
            str(BATCH),
            "--build",
            build,
            "--warmup",
            "1",
            "--repeats",
            "2",
            "-o",
            str(tmp_path / "p.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        cli,
        [
            "partition",
            str(tmp_path / "p.json"),
            "--topology",
            ONE_GPU,
            "--schedule",
            "1f1b-flush",
            "--microbatches",
            "2",
            "-o",
            str(tmp_path / "plan.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    ran = torchrun(
        1,
        [
            str(tmp_path / "plan.json"),
            "--model",
            MODEL,
            "--steps",
            "3",
            "--lr",
            "1e-3",
            "--weights",
            str(tmp_path / "hf"),
            "--build",
            build,
            "--no-progress",
            "--metrics",
            str(tmp_path / "m.json"),
        ],
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["losses"][0] == pytest.approx(reference, rel=2e-2)  # bf16 rounding of two orders of ops
    assert metrics["losses"][-1] < metrics["losses"][0]
    stage = metrics["stages"][0]
    assert (
        stage["memory_kind"] == "cuda_allocated"
        and stage["peak_memory_bytes"] > stage["baseline_memory_bytes"]
    )
