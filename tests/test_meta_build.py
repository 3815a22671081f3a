"""Models built on the meta device: capture from shapes, plan-independent weights, layer-by-layer
profiles, and a model refused whole by an address-space limit that profiles and trains on 2 ranks."""

from __future__ import annotations

import json
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
        monkeypatch.setattr(cls, "reset_parameters",
                            lambda self, original=original: (calls.append(type(self).__name__), original(self))[1])
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
        assert (mine.param_bytes, mine.largest_param_bytes, mine.output_bytes, mine.parameters) == (
            theirs.param_bytes, theirs.largest_param_bytes, theirs.output_bytes, theirs.parameters), mine.name
    assert meta.modules == eager.modules and meta.modules
    assert sum(l.saved_bytes for l in meta.layers) == sum(l.saved_bytes for l in eager.layers)
    assert meta.step_ms > 0 and meta.step_not_measured == ""  # small: measured whole too
    assert meta.step_saved_bytes == eager.step_saved_bytes


def test_identical_layers_are_timed_once_unless_asked() -> None:
    from pipeplan.profiler.profile_model import profile_model

    path = str(FIXTURES / "runtime" / "mlp.py")
    once = profile_model(path, batch_size=4, device="cpu", warmup=0, repeats=1, build="meta")
    every = profile_model(path, batch_size=4, device="cpu", warmup=0, repeats=1, build="meta",
                          time_every_layer=True)
    assert all(layer.reused_from == -1 for layer in every.layers)
    reused = [layer for layer in once.layers if layer.reused_from >= 0]
    assert reused, [layer.type for layer in once.layers]
    for layer in reused:
        source = once.layers[layer.reused_from]
        assert (layer.type, layer.forward_ms, layer.backward_ms) == (source.type, source.forward_ms, source.backward_ms)


def test_out_of_memory_is_one_line_naming_the_allocation() -> None:
    from pipeplan.memory_errors import OutOfMemory, memory_step

    with pytest.raises(OutOfMemory, match=r"^out of memory while layer 3 ran \(an allocation of 2.00 GiB failed\); "
                                          r"lower --batch-size$"):
        with memory_step("layer 3 ran", "lower --batch-size"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")
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
    from test_run_torchrun import env, free_port

    script = tmp_path / "limited.py"
    script.write_text(LIMITED)
    model = str(FIXTURES / "runtime" / "wide.py")
    limited = {**env(), "MALLOC_ARENA_MAX": "2"}

    def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), str(HEADROOM), *args], capture_output=True,
                              text=True, timeout=timeout, env=limited)

    whole = run(["build", model])  # build_model() and one step, in one process: refused
    assert whole.returncode != 0 and "can't allocate memory" in whole.stderr, whole.stderr[-2000:]

    eager = run(["profile", model, "--build", "eager", "--device", "cpu", "-b", "8", "--warmup", "0",
                 "--repeats", "1", "-o", str(tmp_path / "eager.json")])
    assert eager.returncode == 2 and not (tmp_path / "eager.json").exists()
    assert eager.stderr.startswith("error: out of memory while ") and eager.stderr.count("\n") == 1, eager.stderr
    assert "allocation of 64.0 MiB failed" in eager.stderr and "--build meta" in eager.stderr

    profiled = run(["profile", model, "--build", "meta", "--device", "cpu", "-b", "8", "--warmup", "0",
                    "--repeats", "1", "-o", str(tmp_path / "profile.json")])
    assert profiled.returncode == 0, profiled.stderr[-2000:]
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["build"] == "meta" and profile["step_ms"] == 0
    assert "the whole model needs about" in profile["step_not_measured"]
    assert sum(layer["param_bytes"] for layer in profile["layers"]) == 8 * 4096 * 4097 * 4 + 4097 * 8 * 4
    # the blocks after the first are timed once (the first reads the model input, which needs no gradient)
    assert [layer["reused_from"] for layer in profile["layers"]] == [-1, -1, -1, 1] + [2, 1] * 6 + [-1]

    plan = make_plan(model, [list(range(8)), list(range(8, 17))], [1, 1], "1f1b-flush", batch_size=8,
                     microbatches=2)
    plan.save(tmp_path / "plan.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(script), str(HEADROOM), "run", str(tmp_path / "plan.json"), "--model", model,
           "--steps", "3", "--lr", "0.05", "--build", "meta", "--no-progress",
           "--metrics", str(tmp_path / "m.json")]
    trained = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=limited)
    assert trained.returncode == 0, trained.stderr[-3000:]
    # the same losses as the whole model trained in one process from the same (meta-seeded) weights
    _, losses = train_reference(model, 3, 8, 0.05, build="meta")
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["losses"] == pytest.approx(losses, rel=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2_moe"])
def test_a_bf16_profile_on_meta_captures_in_bf16_like_the_eager_one(family: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch.export graph bakes dtypes (an HF rotary embedding asserts its inv_freq buffer's):
    the layers of a meta build are captured in the profile's dtype, so they run in bf16 and the
    fingerprint is the eager bf16 profile's (the one `run --dtype bfloat16` captures)."""
    pytest.importorskip("transformers")
    from pipeplan.profiler.profile_model import profile_model

    monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
    model = str(FIXTURES / "models" / "hf_family.py")
    profiles = {build: profile_model(model, batch_size=2, device="cpu", dtype="bfloat16", warmup=0, repeats=1,
                                     build=build) for build in ("meta", "eager")}
    assert profiles["meta"].build == "meta" and profiles["meta"].capture == "export"
    assert profiles["meta"].fingerprint == profiles["eager"].fingerprint
    assert [layer.param_bytes for layer in profiles["meta"].layers] == [
        layer.param_bytes for layer in profiles["eager"].layers]


def test_fake_runs_of_a_meta_model_put_mixed_meta_and_cpu_results_on_meta() -> None:
    """``fake_mode_for``: a meta weight meeting a real CPU tensor gives a meta result (torch 2.11
    raised a device mismatch on an embedding of real token ids; 2.13 on the add below)."""
    from pipeplan.capture.materialise import fake_mode_for

    with torch.device("meta"):
        embedding = nn.Embedding(10, 4)
    with fake_mode_for(embedding):
        out = embedding(torch.randint(0, 10, (2, 3))) + torch.ones(2, 3, 4)
    assert out.device.type == "meta" and out.shape == (2, 3, 4)
