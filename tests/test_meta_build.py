"""Models built on the meta device: capture from shapes, plan-independent weights, layer-by-layer
profiles, and a model refused whole by an address-space limit that profiles and trains on 2 ranks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeplan.capture import build_layer_graph
from pipeplan.capture.materialise import build_model, materialise
from pipeplan.errors import InputError
from pipeplan.modelfile import load_model_file, resolve_model_path
from pipeplan.runtime.stage import build_pipeline

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES / "runtime"))

from plans import make_plan  # noqa: E402
from reference import train_reference  # noqa: E402

pytestmark = pytest.mark.slow  # whole models: Hugging Face families, meta builds


@pytest.mark.parametrize("model", ["mlp", "resnet", str(FIXTURES / "runtime" / "tied.py")])
def test_capture_on_meta_gives_the_eager_layer_graph(model: str) -> None:
    model_file = load_model_file(resolve_model_path(model))
    inputs = model_file.batch(4, seed=0)[0]
    meta, lazy, _ = build_model(model_file.build, "meta", 0)
    assert lazy and all(p.is_meta for p in meta.parameters())
    eager = build_layer_graph(model_file.build(), inputs, model_file.leaf_modules)
    on_meta = build_layer_graph(meta, inputs, model_file.leaf_modules)
    assert on_meta.fingerprint == eager.fingerprint
    assert [layer.inputs for layer in on_meta.layers] == [layer.inputs for layer in eager.layers]


def test_stage_weights_do_not_depend_on_the_plan() -> None:
    path = str(FIXTURES / "runtime" / "tied.py")
    model_file = load_model_file(path)
    whole, _, _ = build_model(model_file.build, "meta", 0)
    materialise(whole, None, "cpu", 0)
    reference = dict(whole.named_parameters())
    for stages in ([[0, 1, 2], [3, 4]], [[0], [1, 2, 3], [4]]):
        plan = make_plan(path, stages, [1] * len(stages))
        for rank in range(len(stages)):
            spec = build_pipeline(model_file, plan, rank, 0, 8, build="meta")
            held = spec.stage.parameters_by_qualified_name()
            for name, value in held.items():
                torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)
            # only this rank's layers have storage: the rest of the model stays on meta
            assert not any(p.is_meta for p in held.values())
    # the tied head (stage 2 of the second plan) and the embedding are one tensor
    assert spec.stage.parameters_by_qualified_name()["wte.weight"].shape == (11, 8)


def test_modules_the_weights_overwrite_are_not_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run --weights`` on meta: a module holding only stage parameters gets storage, no initialisation
    (the weights fill it); a module with a buffer (BatchNorm's statistics) is initialised as always."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        other = nn.Sequential(nn.Linear(4, 4))
    calls: list[str] = []
    for cls in (nn.Linear, nn.BatchNorm1d):
        original = cls.reset_parameters
        monkeypatch.setattr(
            cls,
            "reset_parameters",
            lambda self, original=original: (calls.append(type(self).__name__), original(self))[1],
        )
    held = [*model[0].parameters(), *model[1].parameters(), *model[1].buffers()]  # a stage of the first two
    materialise(model, held, "cpu", seed=0, loaded_after=True)
    assert calls == ["BatchNorm1d"]
    assert not model[0].weight.is_meta and model[2].weight.is_meta  # storage for the stage's only
    assert torch.equal(model[1].running_var, torch.ones(4))
    calls.clear()
    materialise(other, [other[0].weight], "cpu", seed=0, loaded_after=True)  # its bias is not the stage's
    assert calls == ["Linear"]


def test_a_module_without_an_initialiser_is_one_line(tmp_path: Path) -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(InputError, match=r"module 1 \(Scale\) holds tensors but defines no reset_parameters"):
        materialise(model, None, "cpu", 0)


def test_layer_by_layer_profile_counts_the_bytes_of_the_whole_model() -> None:
    from pipeplan.profiler.profile_model import profile_model

    eager = profile_model("resnet", batch_size=2, device="cpu", warmup=0, repeats=1, build="eager")
    meta = profile_model("resnet", batch_size=2, device="cpu", warmup=0, repeats=1, build="meta")
    assert (eager.build, meta.build) == ("eager", "meta")
    assert meta.fingerprint == eager.fingerprint
    for mine, theirs in zip(meta.layers, eager.layers):
        assert (
            mine.param_bytes,
            mine.largest_param_bytes,
            mine.output_bytes,
            mine.parameters,
            mine.backward_working_bytes,
            mine.output_saved_by,
            mine.output_tensors,
        ) == (
            theirs.param_bytes,
            theirs.largest_param_bytes,
            theirs.output_bytes,
            theirs.parameters,
            theirs.backward_working_bytes,
            theirs.output_saved_by,
            theirs.output_tensors,
        ), mine.name
    assert meta.modules == eager.modules and meta.modules
    assert sum(l.saved_bytes for l in meta.layers) == sum(l.saved_bytes for l in eager.layers)
    assert meta.step_ms > 0 and meta.step_not_measured == ""  # small: measured whole too
    assert meta.step_saved_bytes == eager.step_saved_bytes


def test_identical_layers_are_timed_once_unless_asked() -> None:
    from pipeplan.profiler.profile_model import profile_model

    path = str(FIXTURES / "runtime" / "mlp.py")
    once = profile_model(path, batch_size=4, device="cpu", warmup=0, repeats=1, build="meta")
    every = profile_model(
        path, batch_size=4, device="cpu", warmup=0, repeats=1, build="meta", time_every_layer=True
    )
    assert all(layer.reused_from == -1 for layer in every.layers)
    reused = [layer for layer in once.layers if layer.reused_from >= 0]
    assert reused, [layer.type for layer in once.layers]
    for layer in reused:
        source = once.layers[layer.reused_from]
        assert (layer.type, layer.forward_ms, layer.backward_ms) == (
            source.type,
            source.forward_ms,
            source.backward_ms,
        )


def test_constants_the_model_makes_outlive_the_layer_by_layer_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Falcon's attention indexes its fused qkv with tensors it makes in forward; the exported graph
    keeps them as constants, shared by every layer split from it. The profile releases each layer's
    tensors once measured: the model's, never those constants (emptied, the whole step measured
    after the layers read freed memory: a segfault)."""
    pytest.importorskip("transformers")
    from pipeplan.profiler.layerwise import measure_layerwise
    from pipeplan.profiler.timing import make_timer

    monkeypatch.setenv("PIPEPLAN_HF_FAMILY", "falcon")
    model_file = load_model_file(HF_MODEL)
    network, lazy, _ = build_model(model_file.build, "meta", 0)
    inputs, targets = model_file.batch(2, seed=0)
    graph = build_layer_graph(network, inputs, model_file.leaf_modules)
    constants = {
        name: t.clone() for name, t in graph.graph_module.named_buffers() if "_pipeplan_constant" in name
    }
    assert lazy and constants and all(t.dtype == torch.int64 for t in constants.values())
    result = measure_layerwise(
        graph,
        network,
        inputs.tensors(),
        targets,
        model_file.loss_fn,
        make_timer("cpu"),
        0,
        1,
        "cpu",
        torch.float32,
        seed=0,
    )
    assert len(result.layers) == len(graph.layers)
    assert all(p.is_meta for p in network.parameters())  # every layer's storage handed back
    after = dict(graph.graph_module.named_buffers())
    for name, value in constants.items():
        assert after[name].untyped_storage().nbytes() == value.untyped_storage().nbytes(), name  # not freed
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)


def test_out_of_memory_is_one_line_naming_the_allocation() -> None:
    from pipeplan.memory_errors import OutOfMemory, memory_step

    with pytest.raises(
        OutOfMemory,
        match=r"^out of memory while layer 3 ran \(an allocation of 2.00 GiB failed\); "
        r"lower --batch-size$",
    ):
        with memory_step("layer 3 ran", "lower --batch-size"):
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)"
            )
    with pytest.raises(ValueError):  # anything else passes through
        with memory_step("layer 3 ran", "lower --batch-size"):
            raise ValueError("not memory")


LIMITED = textwrap.dedent("""
    # Run `pipeplan ARGS` (or "build MODEL": build it whole and take one step) with the address
    # space limited to what this process maps after its imports plus HEADROOM bytes.
    import resource, sys
    import torch, pipeplan.cli, pipeplan.runtime.train, pipeplan.profiler.profile_model
    headroom = int(sys.argv[1])
    mapped = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom, mapped + headroom))
    if sys.argv[2] == "build":
        from pipeplan.modelfile import load_model_file
        model_file = load_model_file(sys.argv[3])
        model = model_file.build()
        inputs, targets = model_file.batch(8, 0)
        model_file.loss_fn(model(*inputs), targets).backward()
        sys.exit(0)
    sys.argv = ["pipeplan", *sys.argv[2:]]
    pipeplan.cli.main()
""")
# wide.py: 512 MiB of weights, 1 GiB with their gradients in one process; a rank of two
# stages holds half of both (measured: it trains with 640 MiB of headroom, not with 500)
HEADROOM = 800 << 20


@pytest.mark.multiprocess
def test_a_model_refused_whole_profiles_and_trains_on_two_ranks(tmp_path: Path) -> None:
    from ports import free_port
    from test_run_torchrun import env

    script = tmp_path / "limited.py"
    script.write_text(LIMITED)
    model = str(FIXTURES / "runtime" / "wide.py")
    # a hash seed of its own: pipeplan does not re-execute itself, which would re-run the script
    # under the limit it set, and fail to raise it to the new process's size
    limited = {**env(), "MALLOC_ARENA_MAX": "2", "PYTHONHASHSEED": "0"}

    def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script), str(HEADROOM), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=limited,
        )

    whole = run(["build", model])  # build_model() and one step, in one process: refused
    assert whole.returncode != 0 and "can't allocate memory" in whole.stderr, whole.stderr[-2000:]

    eager = run(
        [
            "profile",
            model,
            "--build",
            "eager",
            "--device",
            "cpu",
            "-b",
            "8",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "-o",
            str(tmp_path / "eager.json"),
        ]
    )
    assert eager.returncode == 2 and not (tmp_path / "eager.json").exists()
    assert eager.stderr.startswith("error: out of memory while ") and eager.stderr.count("\n") == 1, (
        eager.stderr
    )
    assert "allocation of 64.0 MiB failed" in eager.stderr and "--build meta" in eager.stderr

    profiled = run(
        [
            "profile",
            model,
            "--build",
            "meta",
            "--device",
            "cpu",
            "-b",
            "8",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "-o",
            str(tmp_path / "profile.json"),
        ]
    )
    assert profiled.returncode == 0, profiled.stderr[-2000:]
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["build"] == "meta" and profile["step_ms"] == 0
    assert "the whole model needs about" in profile["step_not_measured"]
    assert sum(layer["param_bytes"] for layer in profile["layers"]) == 8 * 4096 * 4097 * 4 + 4097 * 8 * 4
    # the blocks after the first are timed once (the first reads the model input, which needs no gradient)
    assert [layer["reused_from"] for layer in profile["layers"]] == [-1, -1, -1, 1] + [2, 1] * 6 + [-1]

    plan = make_plan(
        model, [list(range(8)), list(range(8, 17))], [1, 1], "1f1b-flush", batch_size=8, microbatches=2
    )
    plan.save(tmp_path / "plan.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(script),
        str(HEADROOM),
        "run",
        str(tmp_path / "plan.json"),
        "--model",
        model,
        "--steps",
        "3",
        "--lr",
        "0.05",
        "--build",
        "meta",
        "--no-progress",
        "--metrics",
        str(tmp_path / "m.json"),
    ]
    trained = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=limited)
    assert trained.returncode == 0, trained.stderr[-3000:]
    # the same losses as the whole model trained in one process from the same (meta-seeded) weights
    _, losses = train_reference(model, 3, 8, 0.05, build="meta")
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["losses"] == pytest.approx(losses, rel=1e-4)


# every family of tests/fixtures/models/hf_family.py (test_the_family_list_is_the_fixtures)
HF_FAMILIES = [
    "llama",
    "llama_tied",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "phi3",
    "olmo",
    "gpt_neox",
    "mixtral",
    "qwen2_moe",
    "deepseek_v3",
    "falcon",
    "modernbert",
    "gpt2",
    "bert",
    "t5",
    "bart",
    "whisper",
    "vit",
    "resnet",
]
HF_MODEL = str(FIXTURES / "models" / "hf_family.py")


def test_the_family_list_is_the_fixtures() -> None:
    pytest.importorskip("transformers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_family_list", HF_MODEL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert HF_FAMILIES == list(module.FAMILIES)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_a_profile_on_meta_captures_the_eager_profiles_layers(
    family: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Hugging Face family profiles layer by layer from a meta build, in float32 and bfloat16, with
    the eager build's layers: tied embeddings and heads (llama_tied, qwen2, gemma3; one tensor, which
    each layer reading it materialises and releases in turn) and MoE experts (mixtral, qwen2_moe,
    deepseek_v3: transformers picks their grouped_mm kernel and histc dtype by device, dtype and
    compilation, so the capture runs on fake tensors on the profiling device, as export would there).
    A torch.export graph bakes dtypes (an HF rotary embedding asserts its inv_freq buffer's): the
    layers of a meta build are captured in the profile's dtype, as `run --dtype bfloat16` captures them."""
    pytest.importorskip("transformers")
    from pipeplan.profiler.profile_model import profile_model

    monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
    profiles = {
        build: profile_model(
            HF_MODEL, batch_size=1, device="cpu", dtype=dtype, warmup=0, repeats=1, build=build
        )
        for build in ("meta", "eager")
    }
    assert profiles["meta"].build == "meta" and profiles["meta"].capture == "export"
    assert profiles["meta"].fingerprint == profiles["eager"].fingerprint
    assert [
        (layer.param_bytes, layer.output_bytes, layer.parameters) for layer in profiles["meta"].layers
    ] == [(layer.param_bytes, layer.output_bytes, layer.parameters) for layer in profiles["eager"].layers]
    assert profiles["meta"].modules == profiles["eager"].modules
    # the backward's working bytes too: the same output gradients handed in (none to the encoder
    # state a seq2seq model's head passes through, which the loss leaves alone), the same inputs'
    assert [layer.backward_working_bytes for layer in profiles["meta"].layers] == [
        layer.backward_working_bytes for layer in profiles["eager"].layers
    ]
    # who saved each output and its tensors: a stage's boundaries are charged alike
    assert [(layer.output_saved_by, layer.output_tensors) for layer in profiles["meta"].layers] == [
        (layer.output_saved_by, layer.output_tensors) for layer in profiles["eager"].layers
    ]
    assert profiles["meta"].step_ms > 0  # small: the whole step too, every parameter materialised at once


def test_fake_runs_of_a_meta_model_see_the_device_the_graph_will_run_on() -> None:
    """``fake_mode_for``: a meta model runs on fake tensors on the given device (a real CPU input
    mixes in), under the compiling flag torch.export sets; its meta tensors come back after."""
    from torch._subclasses.fake_tensor import FakeTensor

    from pipeplan.capture.materialise import fake_mode_for

    with torch.device("meta"):
        embedding = nn.Embedding(10, 4)
    weight = embedding.weight
    with fake_mode_for(embedding, "cpu"):
        assert isinstance(embedding.weight, FakeTensor) and embedding.weight.device.type == "cpu"
        assert torch.compiler.is_compiling()
        out = embedding(torch.randint(0, 10, (2, 3))) + torch.ones(2, 3, 4)
    assert isinstance(out, FakeTensor) and out.device.type == "cpu" and out.shape == (2, 3, 4)
    assert embedding.weight is weight and weight.is_meta and not torch.compiler.is_compiling()


@pytest.mark.multiprocess
def test_tied_and_moe_models_built_on_meta_train_on_two_ranks_as_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`profile --build meta` -> partition -> `run --build meta` on 2 gloo ranks (one launch) of Qwen2 (its
    embedding on stage 0 tied to the head on stage 1), Qwen2-MoE and Falcon (constants made in forward,
    whole step measured after the layers): each rank materialises only its stage,
    and the run equals the model built eagerly in one process from the same (meta-seeded) weights, from
    the first loss on (the pipeline runs the captured graph, the reference the model's own forward)."""
    pytest.importorskip("transformers")
    from click.testing import CliRunner
    from ports import free_port
    from test_run_torchrun import LR, assert_params_match, env, records

    from pipeplan.cli import cli
    from pipeplan.plan import Plan
    from pipeplan.profiler.profile_model import profile_model

    batch, steps, families = 4, 2, ("qwen2", "qwen2_moe", "falcon")
    jobs = []
    for family in families:
        monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
        profile = profile_model(HF_MODEL, batch_size=batch, device="cpu", warmup=0, repeats=1, build="meta")
        profile.save(tmp_path / f"{family}.profile.json")
        plan_path = tmp_path / f"{family}.plan.json"
        result = CliRunner().invoke(
            cli,
            [
                "partition",
                str(tmp_path / f"{family}.profile.json"),
                "--topology",
                "local-cpu",
                "--straight",
                "--tensor-parallel",
                "1",
                "--schedule",
                "1f1b-flush",
                "--microbatches",
                "2",
                "-o",
                str(plan_path),
            ],
            catch_exceptions=False,
        )
        assert result.exit_code == 0, result.output
        plan = Plan.load(plan_path)
        assert len(plan.stages) == 2
        if family == "qwen2":  # the tied embedding (stage 0) and head (stage 1) straddle the cut
            assert plan.stages[0].layer_start == 0 and plan.stages[1].layer_end == len(profile.layers)
        jobs.append(
            {
                "family": family,
                "model": HF_MODEL,
                "plan": str(plan_path),
                "record": str(tmp_path / family),
                "port": free_port(),
                "steps": steps,
                "lr": LR,
                "build": "meta",
                "metrics": str(tmp_path / f"{family}.metrics.json"),
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
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr[-3000:]
    for family in families:
        monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
        reference, losses = train_reference(HF_MODEL, steps, batch, LR, build="meta")
        metrics = json.loads((tmp_path / f"{family}.metrics.json").read_text())
        assert metrics["losses"] == pytest.approx(losses, rel=1e-5), family
        recs = records(tmp_path / family)
        assert len(recs) == 2, family
        assert_params_match(recs, reference)
        if family == "qwen2":  # one tensor, held by both stages, updated alike
            tied = [rec["params"]["model.embed_tokens.weight"] for rec in recs.values()]
            torch.testing.assert_close(tied[0], tied[1], rtol=0, atol=0)


def test_the_whole_step_counts_float32_masters_under_mixed_precision() -> None:
    """Float32: parameters, gradients and Adam's two moments (4 x). bf16 mixed precision: the bf16
    copies and their gradients, and float32 masters, master gradients and moments (2 + 8 = 10 x
    the bf16 bytes): a stage that fits in float32 terms may not fit as it will run."""
    from pipeplan.precision import Precision
    from pipeplan.profiler.meta_profile import whole_step_fits

    gib = 1 << 30
    assert whole_step_fits(10 * gib, 2 * gib, 60 * gib) == (True, "")  # 42 GiB <= 0.7 x 60
    fits, why = whole_step_fits(4 * gib, 2 * gib, 60 * gib, Precision("bfloat16", "float32"))  # 42 GiB
    assert fits
    fits, why = whole_step_fits(5 * gib, 2 * gib, 60 * gib, Precision("bfloat16", "float32"))  # 52 GiB
    assert not fits and why == (
        "the whole model needs about 52.0 GiB (parameters, gradients, Adam state, "
        "float32 masters, activations), more than 70% of the 60.0 GiB available"
    )


@pytest.mark.parametrize("family", ["gpt2", "t5", "whisper", "modernbert", "llama"])
def test_meta_built_weights_follow_the_librarys_scheme_whatever_is_materialised(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hugging Face model initialises children first, then each parent's ``_init_weights``, which
    sets its children's tensors by their place: GPT-2's and ModernBERT's output projections scaled
    by depth, T5's projections by its dimensions (0.06 here, not 1), Whisper's sinusoidal positions.
    Materialised module by module, a meta build ends with the library's values where they are fixed
    (buffers, constant and frozen parameters) and its spread where they are drawn, and a module's
    values do not depend on what else is materialised with it (the plan)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
    model_file = load_model_file(str(FIXTURES / "models" / "hf_family.py"))
    torch.manual_seed(0)
    eager = model_file.build()
    whole, _, _ = build_model(model_file.build, "meta", 0)
    materialise(whole, None, "cpu", 0)
    built = dict(whole.named_parameters())
    for name, value in eager.named_parameters():
        if not value.requires_grad or bool(torch.all(value == value.flatten()[0])):
            torch.testing.assert_close(built[name], value, msg=name)  # fixed: sinusoids, ones, zeros
        elif value.numel() >= 256:
            assert built[name].std().item() == pytest.approx(value.std().item(), rel=0.25), name
    fixed_buffers = dict(whole.named_buffers())
    for name, value in eager.named_buffers():
        torch.testing.assert_close(fixed_buffers[name], value, msg=name)
    block = next(m for n, m in whole.named_modules() if re.search(r"\.(h|layers?|block)\.0$", n))
    alone, _, _ = build_model(model_file.build, "meta", 0)
    names = {id(p): n for n, p in whole.named_parameters()}
    wanted = {names[id(p)] for p in block.parameters()}
    materialise(alone, [p for n, p in alone.named_parameters() if n in wanted], "cpu", 0)
    for name, value in alone.named_parameters():
        if name in wanted:
            torch.testing.assert_close(value, built[name], rtol=0, atol=0, msg=name)
