"""Transformers' own tensor-parallel plans (``config.base_model_tp_plan``) split Hugging Face families.

Tiny configs from ``tests/fixtures/models/hf_family.py`` (nothing downloaded). The plan each
family declares resolves to pipeplan's splits (precedence: ``TP_PLAN``, transformers' plan,
built-in plans); a whole model split t=2 in one process (fake group) communicates as the
plan's Megatron count says (``CommDebugMode``); refusals are one line naming the entry or
the family. Mistral, Qwen3, Gemma 3, Phi-3 and Mixtral (experts split inside each expert)
go ``profile`` -> ``partition --tensor-parallel 2`` (2 x 2 CPU devices, 1F1B-Flush) -> 3
steps on 4 gloo ranks, and their losses and parameters equal the t=1 plan's on 2 ranks,
all in one 4-rank launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from ports import free_port  # noqa: E402
from test_run_torchrun import env, records  # noqa: E402

from pipeplan.errors import InputError  # noqa: E402
from pipeplan.modelfile import load_model_file  # noqa: E402
from pipeplan.tensor_parallel.library import matches  # noqa: E402
from pipeplan.tensor_parallel.plans import plan_source, resolve_splits  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = str(FIXTURES / "models" / "hf_family.py")
SPLIT = ["mistral", "qwen3", "gemma3", "phi3", "mixtral"]  # transformers' plan, run split
BATCH, MICROBATCHES, STEPS = 8, 2, 3
pytestmark = pytest.mark.slow  # Hugging Face families


def build(family: str, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
    torch.manual_seed(0)
    return load_model_file(MODEL).build()


def dims(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    return {path: dict(split.dims) for path, split in resolve_splits(model, None, {2}, "m.py").items()}


def test_library_plans_resolve_per_family(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each family's declared entries, matched to its modules: dims as transformers shards them."""
    mistral = build("mistral", monkeypatch)
    assert plan_source(mistral, None) == "transformers"
    split = dims(mistral)
    assert len(split) == 2 * 7 + 2  # 7 entries per layer, the vocabulary-parallel embedding, the head
    assert split["model.layers.0.self_attn.k_proj"] == {"weight": 0}
    assert split["model.layers.1.mlp.down_proj"] == {"weight": 1}
    assert split["model.embed_tokens"] == {"weight": 0} and split["lm_head"] == {"weight": 0}
    qwen3 = dims(build("qwen3", monkeypatch))  # q_norm / k_norm: replicated (their gradients summed)
    assert len(qwen3) == 16 and not any("norm" in path for path in qwen3)
    gemma3 = dims(build("gemma3", monkeypatch))  # tied embedding and head stay whole
    assert len(gemma3) == 14 and "lm_head" not in gemma3 and "model.embed_tokens" not in gemma3
    phi3 = dims(build("phi3", monkeypatch))  # fused qkv and gate_up: colwise_gather_output
    assert phi3["model.layers.0.self_attn.qkv_proj"] == {"weight": 0}
    assert phi3["model.layers.0.mlp.gate_up_proj"] == {"weight": 0}
    assert phi3["model.layers.0.self_attn.o_proj"] == {"weight": 1} and len(phi3) == 2 * 4 + 2
    mixtral = resolve_splits(build("mixtral", monkeypatch), None, {2}, "m.py")  # experts' stacked weights
    gate_up, down = (mixtral[f"model.layers.0.mlp.experts.{name}"] for name in ("gate_up_proj", "down_proj"))
    assert (gate_up.module, gate_up.dims) == (
        "model.layers.0.mlp.experts",
        (("gate_up_proj", 1),),
    )  # (E, 2I, H)
    assert (down.module, down.dims) == ("model.layers.0.mlp.experts", (("down_proj", 2),))  # (E, H, I)
    assert len(mixtral) == 2 * 6 + 2 and "model.layers.0.mlp.gate" not in mixtral  # the router stays whole


def test_precedence_tp_plan_then_transformers_then_built_in(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    llama = build("llama", monkeypatch)
    assert plan_source(llama, None) == "transformers"
    own = {"model.layers.*.mlp.up_proj": ColwiseParallel(), "model.layers.*.mlp.down_proj": RowwiseParallel()}
    assert plan_source(llama, own) == "TP_PLAN"
    assert sorted(resolve_splits(llama, own, {2}, "m.py")) == [
        f"model.layers.{i}.mlp.{m}" for i in range(2) for m in ("down_proj", "up_proj")
    ]
    assert plan_source(build("gpt2", monkeypatch), None) == "built-in"  # GPT-2 declares none


def _one_line(exc: pytest.ExceptionInfo[InputError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_refusals_name_the_entry_or_the_family(monkeypatch: pytest.MonkeyPatch) -> None:
    mistral = build("mistral", monkeypatch)
    mistral._tp_plan = {**mistral.tp_plan, "model.layers.*.mlp.up_proj": "sequence_parallel"}
    with pytest.raises(InputError) as exc:
        resolve_splits(mistral, None, {2}, "m.py")
    assert "entry 'model.layers.*.mlp.up_proj': 'sequence_parallel' cannot run: pipeplan runs sequence" in (
        _one_line(exc)
    )
    mistral._tp_plan = {"model.layers.*.mlp.up_proj": "grouped_gemm"}
    with pytest.raises(InputError) as exc:
        resolve_splits(mistral, None, {2}, "m.py")
    assert "entry 'model.layers.*.mlp.up_proj': unknown style 'grouped_gemm'" in _one_line(exc)
    config = transformers.GptOssConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    with pytest.raises(InputError) as exc:
        resolve_splits(transformers.GptOssForCausalLM(config), None, {2}, "gpt_oss.py")
    assert _one_line(exc) == (
        "gpt_oss.py: GptOssForCausalLM (transformers family 'gpt_oss') has no tensor-parallel plan: "
        "transformers declares no tensor-parallel plan for it (config.base_model_tp_plan is empty), "
        "pipeplan has no built-in plan for it (built in: HF GPT-2, HF BERT, HF Llama, pipeplan GPT); "
        "define TP_PLAN in the model file, e.g. TP_PLAN = {'model.layers.*.self_attn.q_proj': "
        "ColwiseParallel(), 'model.layers.*.self_attn.k_proj': ColwiseParallel(), "
        "'model.layers.*.self_attn.v_proj': ColwiseParallel(), 'model.layers.*.self_attn.o_proj': "
        "RowwiseParallel(), 'lm_head': ColwiseParallel()} (ColwiseParallel, RowwiseParallel from torch.distributed.tensor.parallel; "
        "check each pair: a column-parallel module's output feeds the row-parallel one)"
    )


def test_a_refused_plan_profiles_without_splits_and_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from types import SimpleNamespace

    from pipeplan.profiler.tensor_split import layer_layouts

    mistral = build("mistral", monkeypatch)
    layers = [SimpleNamespace(index=0, parameters=tuple(name for name, _ in mistral.named_parameters()))]
    assert list(layer_layouts(mistral, None, layers, "m.py")) == [0]
    assert capsys.readouterr().err == ""
    mistral._tp_plan = {**mistral.tp_plan, "model.layers.*.mlp.up_proj": "sequence_parallel"}
    assert layer_layouts(mistral, None, layers, "m.py") == {}
    assert capsys.readouterr().err == (
        "pipeplan: the profile carries no tensor-parallel splits: m.py: MistralForCausalLM "
        "(transformers' tensor-parallel plan) entry 'model.layers.*.mlp.up_proj': 'sequence_parallel' "
        "cannot run: pipeplan runs sequence parallelism from the plan (StagePlan.sequence_parallel), "
        "not from a tensor-parallel plan's entries; define TP_PLAN in "
        "the model file to split the rest\n"
    )


def megatron_count(model: torch.nn.Module) -> tuple[dict[str, int], dict[str, int]]:
    """The collectives transformers' plan implies, counted as pipeplan charges them (Megatron's):
    forward, an all-reduce per row-parallel module (a vocabulary-parallel embedding one) and an
    all-gather per output the plan gathers (``colwise_gather_output``); backward, one all-reduce
    per group of column-parallel modules reading one input, and one per parameter of a
    ``replicated_with_grad_allreduce`` module (its gradient summed over the group)."""
    plan, params = model.tp_plan, dict(model.named_parameters(remove_duplicate=False))
    tied = {name for name, p in params.items() if sum(q is p for q in params.values()) > 1}
    forward, backward, groups = {"all_reduce": 0, "all_gather_into_tensor": 0}, {"all_reduce": 0}, set()
    entries = [*model.named_modules(), *model.named_parameters()]  # an expert's stacked weight: an entry
    for path, module in entries:
        style = next((s for pattern, s in plan.items() if matches(pattern, path)), None)
        names = [path] if path in params else [f"{path}.{name}" for name, _ in module.named_parameters()]
        if style is None or any(name in tied for name in names):
            continue
        if style in ("rowwise", "rowwise_rep", "rowwise_split_input", "embedding_rowwise", "packed_rowwise"):
            forward["all_reduce"] += 1
        if style.startswith("colwise") or style == "packed_colwise":
            groups.add(path.rpartition(".")[0])
        if style == "colwise_gather_output":
            forward["all_gather_into_tensor"] += 1
        if style == "replicated_with_grad_allreduce":
            backward["all_reduce"] += len(list(module.parameters()))
    backward["all_reduce"] += len(groups)
    return {k: v for k, v in forward.items() if v}, backward


@pytest.mark.parametrize("family", SPLIT)
def test_split_families_communicate_as_their_plan_says(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One forward, and one backward with the gradients settled, of the whole model at t=2."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from pipeplan.capture import build_layer_graph
    from pipeplan.tensor_parallel.apply import compute_context, parallelize_stage, settle_gradients
    from pipeplan.tensor_parallel.plans import stage_splits

    network = build(family, monkeypatch)
    model_file = load_model_file(MODEL)
    inputs, targets = model_file.batch(4, 0)
    graph = build_layer_graph(network, inputs)
    stage = graph.split([0] * len(graph.layers))[0]
    splits = resolve_splits(network, None, {2}, MODEL)
    expected = megatron_count(network)
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        parallelize_stage(
            stage.module, stage_splits(stage.parameter_names, splits), init_device_mesh("cpu", (2,))
        )
        with compute_context("cpu"):
            with CommDebugMode() as mode:
                output = stage.module(*inputs.tensors())
            forward = mode.get_comm_counts()
            loss = model_file.loss_fn(output[-1], targets)
            with CommDebugMode() as mode:
                loss.backward()
                settle_gradients(stage.module)
            backward = mode.get_comm_counts()
    finally:
        dist.destroy_process_group()
    named = tuple({str(op).split(".")[-1]: n for op, n in c.items()} for c in (forward, backward))
    if family == "phi3":  # the gradients of q, k, v and gate, up slices of a gathered output,
        expected[1]["all_gather_into_tensor"] = 4 * 2  # split, are gathered (DTensor's slice backward)
    if family == "mixtral":  # the packed gate_up split as one block: its output gathered before
        expected[0]["all_gather_into_tensor"] += 2  # the gating, and the gating's gradient
        expected[1]["all_gather_into_tensor"] = 2 * 2  # (gate, up halves) gathered back
    assert named == expected


def test_meta_profiles_carry_the_library_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile built on meta splits as the eager one: units, split bytes, all-reduce counts."""
    from pipeplan.profiler.profile_model import profile_model

    monkeypatch.setenv("PIPEPLAN_HF_FAMILY", "phi3")
    kinds = {}
    for build_mode in ("eager", "meta"):
        profile = profile_model(MODEL, batch_size=4, device="cpu", warmup=0, repeats=1, build=build_mode)
        kinds[build_mode] = {
            layer.name: (
                layer.tp_units,
                layer.tp_split_param_bytes,
                layer.tp_forward_allreduces,
                layer.tp_backward_allreduces,
            )
            for layer in profile.layers
            if layer.splits
        }
    assert kinds["meta"] == kinds["eager"]
    # the fused qkv (64 rows) and gate_up (128) column-parallel, o_proj and down_proj row-parallel
    assert kinds["meta"]["model.layers.0.self_attn"] == (2, (64 * 32 + 32 * 32) * 4, 1, 1)
    assert kinds["meta"]["model.layers.1.mlp"] == (2, (128 * 32 + 32 * 64) * 4, 1, 1)
    assert kinds["meta"]["model.embed_tokens"] == (2, 96 * 32 * 4, 1, 0)  # vocabulary-parallel
    assert kinds["meta"]["lm_head"] == (2, 96 * 32 * 4, 0, 1)


def _partition(profile: Path, devices: int, t: int, out: Path) -> None:
    from click.testing import CliRunner

    from pipeplan.cli import cli

    topology = out.with_suffix(".yaml")
    topology.write_text(
        f"name: cpu{devices}\ndevice: {{name: cpu, memory: 4 GiB, kind: cpu}}\n"
        f"levels:\n  - {{name: host, count: {devices}, bandwidth: 5 GB/s, latency: 20 us}}\n"
    )
    args = ["partition", str(profile), "--topology", str(topology), "--straight", "--schedule", "1f1b-flush"]
    args += ["--microbatches", str(MICROBATCHES), "--tensor-parallel", str(t), "-o", str(out)]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.mark.multiprocess
def test_families_split_by_their_plan_train_as_unsplit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """profile -> partition t=2 (2 x 2 devices) and t=1 (2 devices) -> 3 steps each, one 4-rank launch."""
    from pipeplan.plan import Plan
    from pipeplan.profiler.profile_model import profile_model

    jobs: dict[int, list[dict]] = {2: [], 1: []}  # the 4-rank jobs first; ranks 2 and 3 then leave
    for family in SPLIT:
        monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
        # one warm-up pass: a first call's cost (37 ms for Gemma 3's first attention, 0.7 ms for
        # its second) would cut a stage of the embedding alone, which holds nothing to split
        profile = profile_model(MODEL, batch_size=BATCH, device="cpu", warmup=1, repeats=1)
        split = [layer for layer in profile.layers if layer.splits]
        blocks = [layer for layer in split if layer.name.startswith("model.layers.")]
        assert len(blocks) == 4, family  # attention and MLP of both layers
        for layer in blocks:  # one column -> row pair each; t must divide the 2 key/value heads
            assert (layer.tp_units, layer.tp_forward_allreduces, layer.tp_backward_allreduces) == (2, 1, 1)
            assert 0 < layer.tp_split_param_bytes <= layer.param_bytes
            assert 0 <= layer.tp_split_forward_ms <= layer.forward_ms
        profile.save(tmp_path / f"{family}.profile.json")
        for t, devices in ((2, 4), (1, 2)):
            plan_path = tmp_path / f"{family}-t{t}.plan.json"
            _partition(tmp_path / f"{family}.profile.json", devices, t, plan_path)
            plan = Plan.load(plan_path)
            assert [(s.tensor_parallel, s.replicas) for s in plan.stages] == [(t, 1), (t, 1)], family
            jobs[t].append(
                {
                    "family": family,
                    "model": MODEL,
                    "plan": str(plan_path),
                    "record": str(tmp_path / f"{family}-t{t}"),
                    "metrics": str(tmp_path / f"{family}-t{t}.metrics.json"),
                    "port": free_port(),
                    "steps": STEPS,
                    "lr": 0.05,
                    "world_size": 2 * t,
                }
            )
    script = str(FIXTURES / "runtime" / "run_families.py")
    master = {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, script, json.dumps(jobs[2] + jobs[1])],
            env={**env(), **master, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(4)
    ]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr[-3000:]
    for family in SPLIT:
        losses = {
            t: json.loads((tmp_path / f"{family}-t{t}.metrics.json").read_text())["losses"] for t in (1, 2)
        }
        assert len(losses[2]) == STEPS and losses[2] == pytest.approx(losses[1], rel=1e-5), family
        params = {}
        for t in (1, 2):
            recs = records(tmp_path / f"{family}-t{t}")
            assert sorted(recs) == list(range(2 * t)), family
            params[t] = {name: value for rec in recs.values() for name, value in rec["params"].items()}
        assert set(params[2]) == set(params[1])
        for name, value in params[2].items():
            torch.testing.assert_close(value, params[1][name], rtol=1e-5, atol=1e-6, msg=f"{family} {name}")
