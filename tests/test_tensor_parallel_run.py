"""Tensor x pipeline x data in ``pipeplan run``: gloo ranks against single-process training, plans, refusals.

The multi-process cases train 2 steps of 1F1B-Flush (2 micro-batches, gradients clipped
to a global norm below theirs) on 4 CPU ranks and compare the logged norms and losses
and every rank's whole parameters (split ones gathered) with plain training on the same
batches: Hugging Face GPT-2 at t=2 x p=2 (its tied embedding and head on two stages),
BERT at t=2 x d=2 (two model inputs), a model file's own ``TP_PLAN`` at t=2 x p=2, Llama
at t=2 x d=2 (vocabulary-parallel embedding and head), the bundled GPT (fx capture) at
t=2 x p=2, and Llama at t=2 x p=2 planned by ``partition --tensor-parallel 2`` from a
measured profile. Llama at t=2 x p=2 in bf16 mixed precision is compared with the mixed-precision
rule in one process (``reference.train_reference_mixed``). Checkpoints of split stages resume
under other plans (t=2 x p=2 -> t=1 x p=2 -> t=2 x p=1) and ``--weights`` fills split stages,
both against one process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from test_run_torchrun import FIXTURES, LR, assert_params_match, records, torchrun  # noqa: E402

from pipeplan.errors import InputError  # noqa: E402
from pipeplan.modelfile import load_model_file  # noqa: E402
from pipeplan.plan import Plan  # noqa: E402
from pipeplan.runtime.config import (  # noqa: E402
    BuildConfig,
    CheckpointConfig,
    OptimizerConfig,
    RunConfig,
    ScheduleConfig,
)
from pipeplan.runtime.stage import PipelineSpec, build_pipeline  # noqa: E402
from pipeplan.runtime.train import _check_tensor_parallel  # noqa: E402
from pipeplan.tensor_parallel.plans import resolve_splits  # noqa: E402

sys.path.insert(0, str(FIXTURES))
from plans import make_plan  # noqa: E402
from reference import train_reference_loop  # noqa: E402
from test_train_loop import log_lines  # noqa: E402

ROOT = Path(__file__).parent.parent
GPT2 = str(ROOT / "docs" / "tutorial" / "hf_gpt2.py")  # 13 layers, 4 heads, tied wte / lm_head
BERT = str(ROOT / "tests" / "fixtures" / "models" / "hf_bert.py")  # 2 heads, ids + attention mask
USER_PLAN = str(ROOT / "tests" / "fixtures" / "models" / "tp_plan_mlp.py")  # 8 layers, TP_PLAN
BUNDLED_GPT = str(ROOT / "configs" / "models" / "gpt.py")
MLP = str(FIXTURES / "mlp.py")
LLAMA = str(
    ROOT / "tests" / "fixtures" / "models" / "hf_family.py"
)  # LlamaForCausalLM: 4 heads, 2 kv heads, untied
STEPS, BATCH, CLIP = 2, 8, 0.05
pytestmark = pytest.mark.slow  # whole models (Llama, BERT, GPT-2) split over ranks


def _layers(model: str) -> int:
    from pipeplan.capture import build_layer_graph

    model_file = load_model_file(model)
    torch.manual_seed(0)
    return len(build_layer_graph(model_file.build(), model_file.batch(BATCH // 2, 0)[0]))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "model,replicas,stages",
    [
        (GPT2, 1, 2),  # t=2 x p=2
        (BERT, 2, 1),  # t=2 x d=2
        (USER_PLAN, 1, 2),  # the model file's TP_PLAN, t=2 x p=2
        (LLAMA, 2, 1),  # t=2 x d=2 (t=2 x p=2: the planner's plan, below)
        (BUNDLED_GPT, 1, 2),  # fx capture: Megatron's collectives around nn.Linear calls
    ],
    ids=["gpt2-t2xp2", "bert-t2xd2", "tp_plan-t2xp2", "llama-t2xd2", "gpt-t2xp2"],
)
def test_tensor_parallel_flush_matches_single_process(
    tmp_path: Path, model: str, replicas: int, stages: int
) -> None:
    n = _layers(model)
    cut = [list(range(n))] if stages == 1 else [list(range(n // 2)), list(range(n // 2, n))]
    plan = make_plan(
        model,
        cut,
        [replicas] * stages,
        "1f1b-flush",
        batch_size=BATCH,
        microbatches=2,
        tensor_parallel=[2] * stages,
    )
    plan.save(tmp_path / "plan.json")
    _run_matches_single_process(tmp_path, model, replicas, stages)


def _train_on_four_ranks(tmp_path: Path, model: str, lr: float) -> dict:
    """``tmp_path/plan.json`` trained on 4 ranks for STEPS steps (clipped, recorded, logged):
    each rank's record."""
    result = torchrun(
        4,
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            str(STEPS),
            "--lr",
            str(lr),
            "--clip-grad-norm",
            str(CLIP),
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
            "--metrics",
            str(tmp_path / "metrics.json"),
            "--log-dir",
            str(tmp_path / "log"),
        ],
        timeout=240.0,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    recs = records(tmp_path / "rec")
    assert sorted(recs) == [0, 1, 2, 3]
    return recs


def _run_matches_single_process(tmp_path: Path, model: str, replicas: int, stages: int) -> None:
    """Run ``tmp_path/plan.json`` on 4 ranks: norms, losses and every rank's whole parameters
    equal one process's training on the same batches."""
    recs = _train_on_four_ranks(tmp_path, model, LR)
    ref = train_reference_loop(model, STEPS, BATCH, lambda p: torch.optim.SGD(p, lr=LR), clip_grad_norm=CLIP)
    assert min(ref["norms"]) > CLIP  # every step clips: the norm over split gradients counts
    assert [line["grad_norm"] for line in log_lines(tmp_path / "log")] == pytest.approx(
        ref["norms"], rel=1e-5
    )
    assert_params_match(recs, ref["params"])  # every rank: whole parameters equal to plain training
    losses = ref["losses"]
    for rank, rec in recs.items():  # replica-major groups: ranks 2r, 2r+1 form one replica
        assert (rec["stage"], rec["replica"]) == ((rank // 2, 0) if stages == 2 else (0, rank // 2))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["losses"] == pytest.approx(losses, rel=1e-5)  # one loss per step, not one per rank


@pytest.mark.multiprocess
def test_llama_profile_partition_run_with_tensor_parallel(tmp_path: Path) -> None:
    """A measured profile carries the splits: ``profile`` -> ``partition --tensor-parallel 2`` -> ``run``."""
    from click.testing import CliRunner

    from pipeplan.cli import cli
    from pipeplan.profile import Profile
    from pipeplan.profiler.profile_model import profile_model

    profile = profile_model(LLAMA, batch_size=BATCH, device="cpu", warmup=0, repeats=1)
    profile.save(tmp_path / "profile.json")
    split = {layer.name: layer for layer in profile.layers if layer.splits}
    assert sorted(split) == [
        "lm_head",
        "model.embed_tokens",
        *(f"model.layers.{i}.{m}" for i in range(2) for m in ("mlp", "self_attn")),
    ]
    attention, mlp = split["model.layers.0.self_attn"], split["model.layers.0.mlp"]
    assert attention.tp_units == 2  # gcd of 4 heads and 2 key/value heads
    assert attention.tp_split_param_bytes == (32 * 32 + 2 * 16 * 32 + 32 * 32) * 4  # q, k, v, o (no biases)
    assert mlp.tp_split_param_bytes == 3 * 64 * 32 * 4 == mlp.param_bytes
    # Megatron's count: one column -> row pair each; the vocabulary-parallel embedding one forward
    assert (attention.tp_forward_allreduces, attention.tp_backward_allreduces) == (1, 1)
    assert attention.tp_allreduce_bytes == attention.output_bytes == BATCH * 16 * 32 * 4
    embedding = split["model.embed_tokens"]
    assert (embedding.tp_forward_allreduces, embedding.tp_backward_allreduces) == (1, 0)
    assert (split["lm_head"].tp_forward_allreduces, split["lm_head"].tp_backward_allreduces) == (0, 1)
    for layer in split.values():  # measured shares: within the layer's own figures
        assert (
            0 <= layer.tp_split_forward_ms <= layer.forward_ms
            and 0 <= layer.tp_split_saved_bytes <= layer.saved_bytes
        )
    assert mlp.tp_split_saved_bytes > 0  # the MLP's wide activations split
    assert Profile.load(tmp_path / "profile.json") == profile
    from pipeplan.reporting.profile_table import summary_lines

    assert any(
        line.startswith("tensor parallelism: 6 layers split (t must divide 2); of their forward ")
        and "(shares measured at t=2)" in line
        for line in summary_lines(profile)
    )
    (tmp_path / "cpu4.yaml").write_text(
        "name: cpu4\ndevice: {name: cpu, memory: 4 GiB, kind: cpu}\n"
        "levels:\n  - {name: host, count: 4, bandwidth: 5 GB/s, latency: 20 us}\n"
    )
    result = CliRunner().invoke(
        cli,
        [
            "partition",
            str(tmp_path / "profile.json"),
            "--topology",
            str(tmp_path / "cpu4.yaml"),
            "--straight",
            "--schedule",
            "1f1b-flush",
            "--microbatches",
            "2",
            "--tensor-parallel",
            "2",
            "-o",
            str(tmp_path / "plan.json"),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    plan = Plan.load(tmp_path / "plan.json")
    assert [(s.tensor_parallel, s.replicas) for s in plan.stages] == [(2, 1), (2, 1)]  # t=2 x p=2
    _run_matches_single_process(tmp_path, LLAMA, 1, 2)


@pytest.mark.multiprocess
def test_llama_bf16_with_float32_masters_matches_the_mixed_precision_rule(tmp_path: Path) -> None:
    """bf16 mixed precision split t=2 x p=2 (4 gloo ranks, 1F1B-Flush, 2 micro-batches, SGD, clipped):
    the layers run on bf16 DTensor copies with their float32 DTensor masters' placements, and
    the run follows the rule in one process (``train_reference_mixed``).

    Not to the last bit: a row-parallel matmul (and a column-parallel input's gradient) is two
    bf16 partial sums, each rounded, then all-reduced in bf16, where one process rounds the
    whole sum once. So losses and masters are held to the unsplit GPT-2 bf16 test's tolerances
    (export graph vs eager HF code, which round in places of their own: 1e-4 relative, 2e-4),
    measured here 2.6e-5 and 3.3e-5. Those would also pass copies never refreshed after the
    step (measured 7.6e-5 and 1.7e-4), so the updates (final - initial masters) are compared
    too: within 2% of the rule's in all (measured 0.54%; the bf16 rule's own update differs from
    float32's by 0.55%; stale copies: 3.9%), each tensor within 3% (measured <= 1.3%). lr 1 (not
    LR) so that a norm weight near 1 moves by ~100 float32 spacings. Losses and gradient norms
    within 1% of float32 training.
    """
    from reference import train_reference_mixed

    from pipeplan.capture.materialise import build_model

    lr = 1.0
    n = _layers(LLAMA)
    plan = make_plan(
        LLAMA,
        [list(range(n // 2)), list(range(n // 2, n))],
        [1, 1],
        "1f1b-flush",
        batch_size=BATCH,
        microbatches=2,
        tensor_parallel=[2, 2],
        dtype="bfloat16",
    )
    assert (plan.dtype, plan.master_dtype) == ("bfloat16", "float32")
    plan.save(tmp_path / "plan.json")
    recs = _train_on_four_ranks(tmp_path, LLAMA, lr)
    for rank, rec in recs.items():
        assert (rec["stage"], rec["replica"]) == (rank // 2, 0)
        assert rec["masters"] and {dtype for dtype, _ in rec["masters"].values()} == {"float32"}
        for name, (dtype, placements) in rec["compute"].items():  # the copy: bf16, the master's placements
            assert dtype == "bfloat16" and placements == rec["masters"][name][1] and placements, name
        assert any(p.startswith("Shard") for _, placements in rec["masters"].values() for p in placements)

    masters, losses = train_reference_mixed(
        LLAMA, STEPS, BATCH, lr, microbatches=2, optimizer="sgd", clip_grad_norm=CLIP
    )
    run_losses = json.loads((tmp_path / "metrics.json").read_text())["losses"]
    assert run_losses == pytest.approx(losses, rel=1e-4)
    final = {name: value for rec in recs.values() for name, value in rec["params"].items()}
    assert set(final) == set(masters)
    model_file = load_model_file(LLAMA)
    initial = {
        name: p.detach() for name, p in build_model(model_file.build, "eager", 0)[0].named_parameters()
    }
    for name, value in final.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, masters[name], rtol=0, atol=2e-4, msg=name)
        update, expected = value - initial[name], masters[name] - initial[name]
        assert float((update - expected).norm()) <= 0.03 * float(expected.norm()), name
    update, expected = (
        torch.cat([(d[name] - initial[name]).flatten() for name in sorted(masters)]) for d in (final, masters)
    )
    assert float((update - expected).norm()) <= 0.02 * float(expected.norm())
    float32 = train_reference_loop(
        LLAMA, STEPS, BATCH, lambda p: torch.optim.SGD(p, lr=lr), clip_grad_norm=CLIP
    )
    assert run_losses == pytest.approx(float32["losses"], rel=1e-2)
    assert min(float32["norms"]) > CLIP  # every step clips
    assert [line["grad_norm"] for line in log_lines(tmp_path / "log")] == pytest.approx(
        float32["norms"], rel=1e-2
    )


def test_plan_with_tensor_parallel_round_trips(tmp_path: Path) -> None:
    plan = make_plan(GPT2, [list(range(7)), list(range(7, 13))], [2, 1], tensor_parallel=[2, 2])
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan
    assert [s.ranks for s in loaded.stages] == [(0, 1, 2, 3), (4, 5)]
    assert [s.tensor_parallel for s in loaded.stages] == [2, 2]
    assert loaded.world_size == 6
    assert loaded.stage_of_rank(3) == (0, 1) and loaded.stage_of_rank(5) == (1, 0)


def test_groups_exchange_one_copy_of_every_value() -> None:
    """Stage 0: 2 replicas x t=2 (ranks 0-3); stage 1: 1 replica x t=4 (ranks 4-7)."""
    ranks = ((0, 1, 2, 3), (4, 5, 6, 7))

    def spec(stage: int, tp_index: int) -> PipelineSpec:
        return PipelineSpec(None, stage, 0, ranks, {}, {}, "", tensor_parallel=(2, 4), tp_index=tp_index)

    # unit 1 runs on replica 1 of stage 0 (ranks 2, 3): each of stage 1's 4 ranks gets one copy
    assert [spec(0, k).send_peers(1, 1) for k in range(2)] == [(4, 6), (5, 7)]
    assert [spec(1, k).recv_peer(0, 1) for k in range(4)] == [2, 3, 2, 3]
    # gradients back: stage 1's ranks 4, 5 send to ranks 2, 3 (6, 7 send none: same values)
    assert [spec(1, k).send_peers(0, 1) for k in range(4)] == [(2,), (3,), (), ()]
    assert [spec(0, k).recv_peer(1, 1) for k in range(2)] == [4, 5]
    assert spec(0, 0).replicas == (2, 1)


def _dims(model: torch.nn.Module, tp_plan: dict | None = None) -> dict[str, dict[str, int]]:
    return {path: dict(split.dims) for path, split in resolve_splits(model, tp_plan, {2}, "m.py").items()}


def test_builtin_plans_split_the_column_row_pairs() -> None:
    gpt2 = _dims(load_model_file(GPT2).build())
    assert gpt2["transformer.h.0.attn.c_attn"] == {"weight": 1, "bias": 0}  # Conv1D: (in, out)
    assert gpt2["transformer.h.1.mlp.c_proj"] == {"weight": 0}
    assert len(gpt2) == 8 and "lm_head" not in gpt2  # the tied embedding and head stay whole
    bert = _dims(load_model_file(BERT).build())
    assert bert["bert.encoder.layer.0.attention.self.query"] == {"weight": 0, "bias": 0}
    assert bert["bert.encoder.layer.1.output.dense"] == {"weight": 1}
    assert len(bert) == 2 * 6
    gpt = _dims(load_model_file(BUNDLED_GPT).build())
    assert set(gpt) == {
        f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")
    }
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    llama = _dims(transformers.LlamaForCausalLM(config))
    assert llama["model.embed_tokens"] == {"weight": 0} and llama["lm_head"] == {
        "weight": 0
    }  # vocabulary-parallel
    assert llama["model.layers.0.mlp.down_proj"] == {"weight": 1} and len(llama) == 9


def _one_line(exc: pytest.ExceptionInfo[InputError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_refusals_are_one_line(tmp_path: Path) -> None:
    gpt2 = load_model_file(GPT2).build()
    with pytest.raises(InputError) as exc:
        resolve_splits(gpt2, None, {3}, "m.py")
    assert "tensor_parallel 3 does not divide the model's 4 attention heads" in _one_line(exc)
    with pytest.raises(InputError) as exc:
        resolve_splits(load_model_file(MLP).build(), None, {2}, "mlp.py")
    assert _one_line(exc).startswith(
        "mlp.py: Sequential has no tensor-parallel plan: pipeplan has no built-in plan"
    )
    assert "e.g. TP_PLAN = {'0': ColwiseParallel(), '2': RowwiseParallel()" in _one_line(exc)
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(InputError) as exc:
        resolve_splits(gpt2, {"transformer.h.*.attn.q_proj": ColwiseParallel()}, {2}, "m.py")
    assert "TP_PLAN names 'transformer.h.*.attn.q_proj', which is no module of GPT2LMHeadModel" in _one_line(
        exc
    )
    with pytest.raises(InputError) as exc:
        resolve_splits(gpt2, {"transformer.h.*.attn": object()}, {2}, "m.py")
    assert "TP_PLAN['transformer.h.*.attn'] is object; pipeplan splits with ColwiseParallel" in _one_line(exc)
    with pytest.raises(InputError) as exc:
        resolve_splits(gpt2, {"lm_head": ColwiseParallel()}, {2}, "m.py")
    assert "tied to transformer.wte.weight" in _one_line(exc)
    # a split stage holding none of the plan's modules (GPT-2's embeddings only)
    plan = make_plan(GPT2, [[0, 1, 2], list(range(3, 13))], [1, 1], tensor_parallel=[2, 1])
    with pytest.raises(InputError) as exc:
        build_pipeline(load_model_file(GPT2), plan, 0, 0, BATCH)
    assert (
        "plan stage 0 has tensor_parallel 2, but the tensor-parallel plan splits none of its modules"
        in _one_line(exc)
    )


@pytest.mark.parametrize(
    "schedule,extra,expected",
    [
        ("1f1b-rr", {}, "not 1f1b-rr"),
        ("2bw", {"build": BuildConfig(dtype="bfloat16")}, "not 2bw"),
        ("zb-h1", {"checkpoints": CheckpointConfig(directory="ckpt", weights="hf")}, "not zb-h1"),
        (
            "1f1b-flush",
            {
                "checkpoints": CheckpointConfig(directory="ckpt", weights="hf"),
                "build": BuildConfig(dtype="bfloat16"),
            },
            None,
        ),
        ("gpipe", {"checkpoints": CheckpointConfig(directory="ckpt", resume=True)}, None),
    ],
)
def test_what_a_split_run_does_not_do_is_refused(schedule: str, extra: dict, expected: str | None) -> None:
    """In one line, in float32 as in bf16 mixed precision; mixed precision, checkpoints and
    --weights run split (``None``: nothing refused)."""
    plan = make_plan(GPT2, [list(range(13))], [1], schedule, tensor_parallel=[2])
    config = RunConfig(
        plan=plan,
        model_path=GPT2,
        steps=1,
        optim=OptimizerConfig(optimizer="sgd", lr=LR),
        pipeline=ScheduleConfig(schedule=schedule, microbatches=1),
        **extra,
    )
    if expected is None:
        _check_tensor_parallel(config)
        return
    with pytest.raises(InputError, match=expected) as exc:
        _check_tensor_parallel(config)
    _one_line(exc)


def _llama_plans(tmp_path: Path, optimizer: str, **plans: tuple[int, int]) -> None:
    """``tmp_path/<name>.json`` for each name -> (t, stages): 1F1B-Flush, 2 micro-batches, one replica."""
    n = _layers(LLAMA)
    for name, (t, stages) in plans.items():
        cut = [list(range(n))] if stages == 1 else [list(range(n // 2)), list(range(n // 2, n))]
        make_plan(
            LLAMA,
            cut,
            [1] * stages,
            "1f1b-flush",
            batch_size=BATCH,
            microbatches=2,
            optimizer=optimizer,
            tensor_parallel=[t] * stages,
        ).save(tmp_path / f"{name}.json")


def _launch(ranks: int, tmp_path: Path, plan: str, *args: str) -> str:
    """``pipeplan run tmp_path/<plan>.json`` on ``ranks`` gloo ranks (bounded); returns its stderr."""
    result = torchrun(
        ranks, [str(tmp_path / f"{plan}.json"), "--model", LLAMA, "--no-progress", *args], timeout=240.0
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer,lr,atol", [("momentum", LR, 1e-6), ("adam", 1e-3, 1e-5)])
def test_split_checkpoints_hold_whole_tensors_and_resume_under_any_plan(
    tmp_path: Path, optimizer: str, lr: float, atol: float
) -> None:
    """Llama, clipped, SGD with momentum or Adam (their states are DTensors with the parameters'
    placements; Adam's ``step`` a plain scalar): 2 steps at t=2 x p=2 (4 ranks) -> resumed at
    t=1 x p=2 (2 ranks) for steps 3-4 -> resumed at t=2 x p=1 (2 ranks, one stage split whole)
    for steps 5-6. Each part's losses and its parameters at its end equal one process's
    uninterrupted training; the first checkpoint holds whole tensors in one folder per stage,
    with the RNG of the group's second rank beside the first's. Adam's atol: an unsplit
    t=1 x p=2 run without checkpoints is 3.8e-6 off one process already (Adam scales the
    embedding's micro-batch-summed gradient by its own tiny moments); this chain measured 2.9e-6."""
    from pipeplan.runtime.checkpoint.state import CheckpointIndex

    _llama_plans(tmp_path, optimizer, t2p2=(2, 2), t1p2=(1, 2), t2p1=(2, 1))
    ckpt = [
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "1",
        "--clip-grad-norm",
        str(CLIP),
        "--lr",
        str(lr),
    ]
    parts = [("t2p2", 4, 2), ("t1p2", 2, 4), ("t2p1", 2, 6)]
    for plan, ranks, steps in parts:
        resume = ["--resume"] if steps > 2 else []
        err = _launch(
            ranks,
            tmp_path,
            plan,
            *ckpt,
            *resume,
            "--steps",
            str(steps),
            "--record",
            str(tmp_path / f"rec-{plan}"),
            "--metrics",
            str(tmp_path / f"{plan}.metrics.json"),
        )
        if resume:
            assert f"resume: step {steps - 2} was saved under another plan" in err
        if plan == "t2p2":
            step = tmp_path / "ckpt" / "step-000002"
            assert sorted(p.name for p in step.iterdir()) == [
                "stage-00-replica-0",
                "stage-00-replica-0.json",
                "stage-01-replica-0",
                "stage-01-replica-0.json",
            ]
            index = CheckpointIndex.of_step(str(tmp_path / "ckpt"), 2)
            whole = {name: tuple(p.shape) for name, p in load_model_file(LLAMA).build().named_parameters()}
            assert {
                k[len("model/") :]: tuple(e.size)
                for k, (_, e) in index.entries.items()
                if k.startswith("model/")
            } == whole
            state = "momentum_buffer" if optimizer == "momentum" else "exp_avg_sq"
            assert {
                k[len("optim/") :].rpartition("/")[0]: tuple(e.size)
                for k, (_, e) in index.entries.items()
                if k.endswith(f"/{state}")
            } == whole
            assert len(index.holders["rng"]) == len(index.holders["rng/tensor-1"]) == 2
    make = (
        (lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9))
        if optimizer == "momentum"
        else (lambda p: torch.optim.Adam(p, lr=lr))
    )
    for plan, ranks, steps in parts:
        ref = train_reference_loop(LLAMA, steps, BATCH, make, clip_grad_norm=CLIP)
        metrics = json.loads((tmp_path / f"{plan}.metrics.json").read_text())
        assert metrics["first_step"] == steps - 2
        assert metrics["losses"] == pytest.approx(ref["losses"][steps - 2 :], rel=1e-5), plan
        recs = records(tmp_path / f"rec-{plan}")
        assert sorted(recs) == list(range(ranks))
        params = {name: value for rec in recs.values() for name, value in rec["params"].items()}
        assert set(params) == set(ref["params"])
        for name, value in params.items():
            torch.testing.assert_close(value, ref["params"][name], rtol=1e-5, atol=atol, msg=name)


@pytest.mark.multiprocess
def test_split_stages_start_from_pretrained_weights(tmp_path: Path) -> None:
    """``--weights`` (a sharded ``save_pretrained`` folder of other weights than the run's seed)
    at t=2 x p=2: the first loss is those weights' in one process, and one step ends where one
    process's step from them ends (each rank kept its shards of the whole tensors)."""
    model_file = load_model_file(LLAMA)
    torch.manual_seed(123)
    pretrained = model_file.build()
    pretrained.save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    inputs, targets = model_file.batch(BATCH, 0)  # minibatch 0 of a seed-0 run
    loss_tensor = model_file.loss_fn(inputs.call(pretrained), targets)
    loss_tensor.backward()
    loss = float(loss_tensor.detach())
    with torch.no_grad():
        torch.manual_seed(0)
        seeded_loss = float(model_file.loss_fn(inputs.call(model_file.build()), targets))
        stepped = {name: p - LR * p.grad for name, p in pretrained.named_parameters()}
    assert abs(loss - seeded_loss) > 1e-3  # the check below can tell the two apart
    _llama_plans(tmp_path, "sgd", t2p2=(2, 2))
    _launch(
        4,
        tmp_path,
        "t2p2",
        "--lr",
        str(LR),
        "--weights",
        str(tmp_path / "hf"),
        "--steps",
        "1",
        "--record",
        str(tmp_path / "rec"),
        "--metrics",
        str(tmp_path / "metrics.json"),
    )
    assert json.loads((tmp_path / "metrics.json").read_text())["losses"] == pytest.approx([loss], rel=1e-5)
    assert_params_match(records(tmp_path / "rec"), stepped)


def test_layer_layouts_count_megatrons_allreduces() -> None:
    """A whole GPT-2 block: 2 and 2; the bundled GPT's layers one module each; no plan: nothing."""
    from types import SimpleNamespace

    from pipeplan.profiler.tensor_split import layer_layouts

    def layers(model: torch.nn.Module, prefixes: list[str]) -> list[SimpleNamespace]:
        names = [name for name, _ in model.named_parameters()]
        return [
            SimpleNamespace(index=i, parameters=tuple(n for n in names if n.startswith(prefix + ".")))
            for i, prefix in enumerate(prefixes)
        ]

    gpt2 = load_model_file(GPT2).build()
    block = layer_layouts(gpt2, None, layers(gpt2, ["transformer.wte", "transformer.h.0"]), "m.py")
    assert list(block) == [1]  # the tied embedding stays whole
    assert (block[1].forward_allreduces, block[1].backward_allreduces, block[1].units) == (2, 2, 4)
    w = 64  # c_attn, c_proj, c_fc, c_proj weights and the column-parallel biases (a row's bias stays whole)
    assert block[1].param_bytes == 4 * (w * 3 * w + 3 * w + w * w + w * 4 * w + 4 * w + 4 * w * w)
    gpt = load_model_file(BUNDLED_GPT).build()
    parts = layer_layouts(
        gpt, None, layers(gpt, ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.0"]), "gpt.py"
    )
    assert [(p.forward_allreduces, p.backward_allreduces) for p in parts.values()] == [(0, 1), (1, 0), (0, 1)]
    assert layer_layouts(load_model_file(MLP).build(), None, [], "mlp.py") == {}


@pytest.mark.parametrize(
    "model,forward,backward",
    [
        # Megatron's count: 2 all-reduces per block each way; the vocabulary-parallel embedding one
        # forward, the column-parallel head one backward and its output gathered where it leaves
        (LLAMA, {"all_reduce": 5, "all_gather_into_tensor": 1}, {"all_reduce": 5}),
        (BERT, {"all_reduce": 4}, {"all_reduce": 4}),
        # a fused qkv (GPT-2's c_attn, the bundled GPT's qkv): splitting its sharded output into
        # q, k, v gathers it (not Megatron's)
        (
            GPT2,
            {"all_reduce": 4, "all_gather_into_tensor": 2},
            {"all_reduce": 4, "all_gather_into_tensor": 4},
        ),
        (
            BUNDLED_GPT,
            {"all_reduce": 4, "all_gather_into_tensor": 2},
            {"all_reduce": 4, "all_gather_into_tensor": 4},
        ),
    ],
    ids=["llama", "bert", "gpt2", "gpt"],
)
def test_split_stage_communicates_where_megatron_does(model: str, forward: dict, backward: dict) -> None:
    """Collectives of one forward and one backward of the whole model split t=2 (one process, fake group)."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from pipeplan.capture import build_layer_graph
    from pipeplan.tensor_parallel.apply import compute_context, parallelize_stage
    from pipeplan.tensor_parallel.plans import stage_splits

    model_file = load_model_file(model)
    torch.manual_seed(0)
    network = model_file.build()
    inputs, targets = model_file.batch(4, 0)
    graph = build_layer_graph(network, inputs)
    stage = graph.split([0] * len(graph.layers))[0]
    splits = resolve_splits(network, None, {2}, model)
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        parallelize_stage(
            stage.module, stage_splits(stage.parameter_names, splits), init_device_mesh("cpu", (2,))
        )
        counts = []
        with compute_context("cpu"):
            with CommDebugMode() as mode:
                output = stage.module(*inputs.tensors())
            counts.append(mode.get_comm_counts())
            loss = model_file.loss_fn(output[-1], targets)
            with CommDebugMode() as mode:
                loss.backward()
            counts.append(mode.get_comm_counts())
    finally:
        dist.destroy_process_group()
    named = [{str(op).split(".")[-1]: n for op, n in c.items()} for c in counts]
    assert named == [forward, backward]


def test_bf16_copies_of_a_split_stage_keep_placements_and_sum_gradients_in_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mixed precision on the split Llama (one process, fake group of 2): each compute copy is a
    bf16 DTensor with its float32 master's placements, cast on the local shard; two micro-batches'
    bf16 gradients reach the masters as float32 DTensors, summed in float32, and leave the
    copies; ``refresh`` copies the stepped masters shard by shard."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only

    from pipeplan.capture import build_layer_graph
    from pipeplan.capture.materialise import meta_stand_ins, rebind
    from pipeplan.runtime import mixed_precision
    from pipeplan.runtime.mixed_precision import MixedPrecision, cast_buffers
    from pipeplan.tensor_parallel.apply import compute_context, parallelize_stage
    from pipeplan.tensor_parallel.plans import stage_splits

    model_file = load_model_file(LLAMA)
    torch.manual_seed(0)
    network = model_file.build()
    inputs, targets = model_file.batch(4, 0)  # two micro-batches of 2
    with meta_stand_ins(network, torch.bfloat16):  # captured in bf16, as the runtime does
        graph = build_layer_graph(network, model_file.batch(2, 0)[0])
        stage = graph.split([0] * len(graph.layers))[0]
    rebind([stage.module], network)
    seen: dict[int, list[torch.Tensor]] = {}  # id(master) -> each bf16 gradient handed to it
    add_grad = mixed_precision._add_grad
    monkeypatch.setattr(
        mixed_precision,
        "_add_grad",
        lambda master, copy: (
            seen.setdefault(id(master), []).append(copy.grad.detach().clone()),
            add_grad(master, copy),
        ),
    )
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        cast_buffers(stage.module, torch.bfloat16)
        parallelize_stage(
            stage.module,
            stage_splits(stage.parameter_names, resolve_splits(network, None, {2}, LLAMA)),
            init_device_mesh("cpu", (2,)),
        )
        mixed = MixedPrecision(torch.bfloat16, [stage.module])
        masters = list(stage.module.parameters())
        for master in masters:
            copy = mixed.copy_of(master)
            assert isinstance(master, DTensor) and isinstance(copy, DTensor)
            assert (master.dtype, copy.dtype, copy.placements) == (
                torch.float32,
                torch.bfloat16,
                master.placements,
            )
            assert torch.equal(copy.to_local(), master.to_local().bfloat16())
        assert any(p.is_shard() for master in masters for p in master.placements)
        with compute_context("cpu"):
            for part in range(2):
                output = mixed.forward(stage.module, [t.tensor_split(2)[part] for t in inputs.tensors()])
                floats = tree_map_only(torch.Tensor, lambda t: t.float(), output[-1])
                model_file.loss_fn(floats, targets.tensor_split(2)[part]).backward()
        for master in masters:
            first, second = seen[id(master)]
            assert first.dtype == torch.bfloat16 and first.placements == second.placements
            grad = master.grad
            assert (
                isinstance(grad, DTensor)
                and grad.dtype == torch.float32
                and grad.placements == first.placements
            )
            assert torch.equal(grad.to_local(), first.to_local().float() + second.to_local().float())
            assert mixed.copy_of(master).grad is None
        with torch.no_grad():
            for master in masters:
                master.to_local().add_(0.5)
        mixed.refresh()
        for master in masters:
            assert torch.equal(mixed.copy_of(master).to_local(), master.to_local().bfloat16())
    finally:
        dist.destroy_process_group()


def test_a_split_that_cannot_be_timed_is_charged_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer whose split raises (an op DTensor cannot shard) gets shares 0 and a warning, not a failed profile."""
    from types import SimpleNamespace

    import pipeplan.tensor_parallel.apply as apply
    from pipeplan.capture import build_layer_graph
    from pipeplan.profiler import tensor_split
    from pipeplan.profiler.timing import make_timer

    def cannot_split(*args: object) -> None:
        raise NotImplementedError("no sharding rule for aten.custom")

    monkeypatch.setattr(apply, "parallelize_stage", cannot_split)
    model_file = load_model_file(LLAMA)
    torch.manual_seed(0)
    network = model_file.build()
    inputs, _ = model_file.batch(4, 0)
    graph = build_layer_graph(network, inputs)
    layers = [
        SimpleNamespace(index=node.index, parameters=tuple(stage.parameter_names.values()))
        for node, stage in zip(graph.layers, graph.layer_modules())
    ]
    layouts = tensor_split.layer_layouts(network, None, layers, "m.py")
    expected = r"could not be timed \(NotImplementedError: no sharding rule for aten.custom\); its split shares are 0"
    with pytest.warns(UserWarning, match=expected):
        shares = tensor_split.measure_shares(
            graph, inputs.tensors(), layouts, 2, make_timer(torch.device("cpu")), 0, "cpu"
        )
    assert sorted(shares) == sorted(layouts) and set(shares.values()) == {
        tensor_split.SplitShare(0.0, 0.0, 0.0)
    }
