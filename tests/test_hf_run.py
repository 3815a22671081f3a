"""Hugging Face models as built, end to end: profile -> partition -> 2 gloo ranks (torchrun).

GPT2LMHeadModel (its embedding and head are one tied tensor, split across the two
stages) and BertForSequenceClassification (token ids and an attention mask: two model
inputs) from tiny configs, nothing downloaded. 1F1B-Flush and GPipe must equal
single-process training on the same batches; 1F1B-RR trains and keeps tied copies equal.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "runtime"))  # reference.py, run alone too
from reference import train_reference  # noqa: E402
from test_run_torchrun import LR, assert_params_match, records, torchrun  # noqa: E402

from pipeplan.cli import cli  # noqa: E402
from pipeplan.plan import Plan  # noqa: E402
from pipeplan.profile import Profile  # noqa: E402
from pipeplan.profiler.profile_model import profile_model  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).parent.parent
MODELS = {
    "gpt2": str(ROOT / "docs" / "tutorial" / "hf_gpt2.py"),
    "bert": str(Path(__file__).parent / "fixtures" / "models" / "hf_bert.py"),
}
BATCH, STEPS = 8, 3


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("profiles")
    paths = {}
    for name, model in MODELS.items():
        profile = profile_model(model, batch_size=BATCH, device="cpu", warmup=0, repeats=1)
        assert profile.capture == "export"
        paths[name] = folder / f"{name}.json"
        profile.save(paths[name])
    return paths


def partition(profile: Path, schedule: str, microbatches: int, out: Path) -> Plan:
    result = CliRunner().invoke(
        cli,
        [
            "partition",
            str(profile),
            "--topology",
            "local-cpu",
            "--straight",
            "--tensor-parallel",
            "1",
            "--schedule",
            schedule,
            "--microbatches",
            str(microbatches),
            "-o",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert len(plan.stages) == 2
    return plan


def run(tmp_path: Path, model: str, plan: Path, steps: int, *extra: str) -> dict[int, dict]:
    result = torchrun(
        2,
        [
            str(plan),
            "--model",
            model,
            "--steps",
            str(steps),
            "--lr",
            str(LR),
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
            *extra,
        ],
        timeout=60.0,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return records(tmp_path / "rec")


@pytest.mark.parametrize(
    "name,schedule,extra",
    [
        ("gpt2", "1f1b-flush", ()),
        ("gpt2", "gpipe", ("--recompute",)),
        ("bert", "1f1b-flush", ()),
        ("bert", "gpipe", ()),
    ],
)
def test_flush_schedules_match_single_process_training(
    tmp_path: Path, profiles: dict[str, Path], name: str, schedule: str, extra: tuple[str, ...]
) -> None:
    plan = partition(profiles[name], schedule, 2, tmp_path / "plan.json")
    recs = run(tmp_path, MODELS[name], tmp_path / "plan.json", STEPS, *extra)
    reference, _ = train_reference(MODELS[name], STEPS, BATCH, LR)
    assert_params_match(recs, reference)
    if name == "gpt2":  # the embedding on stage 0 and the head on stage 1: one tensor, both updated
        layers = len(Profile.load(profiles[name]).layers)
        assert plan.stages[0].layer_start == 0 and plan.stages[1].layer_end == layers
        assert all("transformer.wte.weight" in rec["params"] for rec in recs.values())


def test_1f1b_rr_trains_gpt2_and_keeps_the_tied_copies_identical(
    tmp_path: Path, profiles: dict[str, Path]
) -> None:
    partition(profiles["gpt2"], "1f1b-rr", 1, tmp_path / "plan.json")
    recs = run(tmp_path, MODELS["gpt2"], tmp_path / "plan.json", 4)
    tied = [rec["params"]["transformer.wte.weight"] for rec in recs.values()]
    assert len(tied) == 2
    torch.testing.assert_close(tied[0], tied[1], rtol=0, atol=0)
    digests = [[d["transformer.wte.weight"] for d in rec["digests"]] for rec in recs.values()]
    assert digests[0] == digests[1] and len(digests[0]) == 4
    initial, _ = train_reference(MODELS["gpt2"], 0, BATCH, LR)  # no step: the initial weights
    assert not torch.equal(tied[0], initial["transformer.wte.weight"])  # it trained


def assert_weights_round_trip(tmp_path: Path, model: str, profile: Path, *build: str) -> None:
    """save_pretrained (sharded) -> run --weights on 2 stages starts from those weights (the first loss is
    theirs in one process; a tied embedding saved once reaches both stages); after training, export-weights
    -> from_pretrained holds the pipeline's weights (the same logits, exactly). One torchrun launch;
    ``build`` (``--build meta``): the stage is materialised alone and not initialised before the load."""
    from pipeplan.modelfile import load_model_file

    model_file = load_model_file(model)
    torch.manual_seed(123)  # other weights than the run's own seed-0 initialisation
    pretrained = model_file.build()
    pretrained.save_pretrained(tmp_path / "hf", max_shard_size="50KB")  # sharded, with its index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    tied = pretrained.get_output_embeddings().weight is pretrained.get_input_embeddings().weight
    inputs, targets = model_file.batch(BATCH, 0)  # minibatch 0 of a seed-0 run
    with torch.no_grad():
        first_loss = float(model_file.loss_fn(inputs.call(pretrained), targets))
        torch.manual_seed(0)
        seeded_loss = float(model_file.loss_fn(inputs.call(model_file.build()), targets))
    assert abs(first_loss - seeded_loss) > 1e-3  # the check below can tell the two apart

    partition(profile, "1f1b-flush", 2, tmp_path / "plan.json")
    recs = run(
        tmp_path,
        model,
        tmp_path / "plan.json",
        2,
        "--weights",
        str(tmp_path / "hf"),
        *build,
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--metrics",
        str(tmp_path / "m.json"),
    )
    losses = json.loads((tmp_path / "m.json").read_text())["losses"]
    assert losses[0] == pytest.approx(first_loss, rel=1e-5)

    out = tmp_path / "exported"
    result = CliRunner().invoke(
        cli,
        ["export-weights", str(tmp_path / "ckpt"), "--model", model, "-o", str(out)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert "save_pretrained" in result.output
    loaded = type(pretrained).from_pretrained(out)
    assert (loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight) == tied  # re-tied
    trained = model_file.build()
    params = {name: value for rec in recs.values() for name, value in rec["params"].items()}
    assert set(params) == {name for name, _ in trained.named_parameters()}
    trained.load_state_dict(params, strict=False)  # a tied head is the embedding's tensor
    with torch.no_grad():
        torch.testing.assert_close(inputs.call(loaded).logits, inputs.call(trained).logits, rtol=0, atol=0)
    embedding = next(
        name for name, p in trained.named_parameters() if p is trained.get_input_embeddings().weight
    )
    assert not torch.equal(params[embedding], pretrained.get_input_embeddings().weight)  # it trained


def test_pretrained_weights_in_and_exported_weights_out(tmp_path: Path, profiles: dict[str, Path]) -> None:
    """Test (c) on GPT-2 (tied wte / lm_head)."""
    assert_weights_round_trip(tmp_path, MODELS["gpt2"], profiles["gpt2"])


@pytest.mark.parametrize("family", ["llama", "llama_tied", "mixtral"])
def test_llama_pretrained_weights_in_and_exported_weights_out(
    tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Test (c) on a tiny LlamaForCausalLM (rotary, RMSNorm, grouped KV heads), untied and tied, each rank
    building only its stage on meta (rotary ``inv_freq``, a computed buffer, initialised; the rest loaded);
    and on Mixtral, whose checkpoint stores each expert apart under ``block_sparse_moe`` (merged and renamed
    on load as transformers does, split again by ``save_pretrained`` on export)."""
    monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
    model = str(Path(__file__).parent / "fixtures" / "models" / "hf_family.py")
    profile = profile_model(model, batch_size=BATCH, device="cpu", warmup=0, repeats=1)
    profile.save(tmp_path / "profile.json")
    assert_weights_round_trip(tmp_path, model, tmp_path / "profile.json", "--build", "meta")


def test_buffer_only_values_take_no_gradient_back(tmp_path: Path) -> None:
    # issue 31: a Llama's rotary cos and sin cross the cut computed from buffers alone; the
    # consumer made every received float require grad, computed their gradients in every
    # attention layer and sent zeros back (2 of 3 gradient messages). Now the header says
    # the producer takes none back, and training still equals the single process's.
    model = str(ROOT / "tests" / "fixtures" / "models" / "hf_family.py")  # llama by default
    assert os.environ.get("PIPEPLAN_HF_FAMILY", "llama") == "llama"
    profile = profile_model(model, batch_size=BATCH, device="cpu", warmup=0, repeats=1)
    profile.save(tmp_path / "profile.json")
    partition(tmp_path / "profile.json", "1f1b-flush", 2, tmp_path / "plan.json")
    trace = tmp_path / "trace.json"
    recs = run(tmp_path, model, tmp_path / "plan.json", STEPS, "--trace", str(trace))
    reference, _ = train_reference(model, STEPS, BATCH, LR)
    assert_params_match(recs, reference)
    events = json.loads(trace.read_text())["traceEvents"]
    forward = [
        e for e in events if e.get("cat") == "recv" and e["pid"] == 1 and e["name"].startswith("recv F")
    ]
    backward = [
        e for e in events if e.get("cat") == "recv" and e["pid"] == 0 and e["name"].startswith("recv B")
    ]
    # one header per value crossing the cut: the hidden state(s), and the rotary cos and sin
    values = [e for e in events if e["pid"] == 0 and e["name"].endswith("(header)")]
    units = STEPS * 2
    assert len(values) >= 3
    assert len(forward) == units  # the values of a unit travel as one message (issue 31)
    assert {e["args"]["values"] for e in forward} == {len(values)}
    assert len(backward) == units  # their gradients too, one message per unit
    assert {e["args"]["values"] for e in backward} == {len(values) - 2}  # all but cos' and sin's
