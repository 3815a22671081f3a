"""Selective recomputation (Korthikanti et al.): the attention core found in captured graphs,
run under ``torch.utils.checkpoint``, and measured by the profiler (issue 30)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from pipeplan.capture import build_layer_graph
from pipeplan.capture.attention_core import attention_cores
from pipeplan.capture.checkpointed import SELECTIVE_PREFIX, checkpoint_attention, checkpoint_stage
from pipeplan.errors import InputError
from pipeplan.modelfile import ModelFile, load_model_file
from pipeplan.plan import Plan, StagePlan
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.profiler.measure import measure_layers
from pipeplan.profiler.memory import count_saved
from pipeplan.profiler.timing import CpuTimer

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "runtime"))

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "configs" / "models" / "gpt.py")
EAGER_LLAMA = str(Path(__file__).parent / "fixtures" / "runtime" / "eager_llama.py")


def _graph(path: str, batch: int = 2):  # type: ignore[no-untyped-def]
    model_file = load_model_file(path)
    torch.manual_seed(0)
    model = model_file.build()
    inputs, targets = model_file.batch(batch, seed=0)
    return model_file, model, inputs, targets, build_layer_graph(model, inputs)


def _step(model_file: ModelFile, module: torch.nn.Module, graph, inputs, targets):  # type: ignore[no-untyped-def]
    """Saved bytes of one forward of the one-stage ``module`` and the gradients of its backward."""
    graph.model.zero_grad()
    tensors = inputs.tensors()
    with count_saved(exclude=graph.model.parameters()) as counter:
        output = module(
            *(tensors[int(name.split(":")[1])] for name in graph.split([0] * len(graph))[0].input_names)
        )
    model_file.loss_fn(output[-1], targets).backward()
    return counter.saved_bytes, {name: p.grad.clone() for name, p in graph.model.named_parameters()}


@pytest.mark.slow  # a Hugging Face Llama
def test_attention_cores_are_found_fused_and_as_an_explicit_chain() -> None:
    *_, gpt = _graph(GPT)
    cores = attention_cores(gpt.graph_module.graph, gpt.layer_of_node)
    assert {gpt.layers[k].name for k in cores} == {"blocks.0.attn.qkv", "blocks.1.attn.qkv"}
    assert all(len(found) == 1 and len(found[0]) == 1 for found in cores.values())  # one sdpa call each
    *_, llama = _graph(EAGER_LLAMA)
    cores = attention_cores(llama.graph_module.graph, llama.layer_of_node)
    assert len(cores) == 2
    for found in cores.values():
        targets = [str(node.target) for node in found[0]]
        assert targets[0] == targets[-2] == "aten.matmul.default" and "aten.softmax.int" in targets
        assert "aten.dropout.default" in targets


@pytest.mark.parametrize("path", [pytest.param(EAGER_LLAMA, marks=pytest.mark.slow), GPT])
def test_checkpointed_cores_give_the_same_gradients_and_save_less(path: str) -> None:
    model_file, model, inputs, targets, graph = _graph(path)
    plain_bytes, expected = _step(model_file, graph.split([0] * len(graph))[0].module, graph, inputs, targets)
    cores = attention_cores(graph.graph_module.graph, graph.layer_of_node)
    stage = checkpoint_attention(graph, graph.split([0] * len(graph))[0], sorted(cores))
    selective_bytes, grads = _step(model_file, stage.module, graph, inputs, targets)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=0, msg=name)
    assert selective_bytes < plain_bytes
    if path == EAGER_LLAMA:  # per layer: its probabilities (batch, heads, seq, seq) are not kept,
        probabilities, mask = 2 * 4 * 32 * 32 * 4, 2 * 1 * 32 * 32 * 4  # its additive mask is (an input)
        assert plain_bytes - selective_bytes == 2 * (probabilities - mask)
    fused = [
        name
        for name, _ in stage.module.named_modules()
        if name.rpartition(".")[2].startswith(SELECTIVE_PREFIX)
    ]
    assert len(fused) == len(cores)
    assert sorted(stage.parameter_names.values()) == sorted(name for name, _ in model.named_parameters())


def test_selective_and_full_recomputation_combine_and_a_layer_without_a_core_is_refused() -> None:
    model_file, _, inputs, targets, graph = _graph(GPT)
    _, expected = _step(model_file, graph.split([0] * len(graph))[0].module, graph, inputs, targets)
    stage = checkpoint_stage(graph, graph.split([0] * len(graph))[0], [4, 5], [2, 9])
    _, grads = _step(model_file, stage.module, graph, inputs, targets)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=0, msg=name)
    with pytest.raises(InputError) as refused:
        checkpoint_attention(graph, graph.split([0] * len(graph))[0], [3])
    assert "\n" not in str(refused.value) and "layer(s) [3]" in str(refused.value)


@pytest.mark.slow  # a Hugging Face Llama, profiled
def test_the_profiler_measures_the_selective_option_of_attention_layers() -> None:
    model_file, _, inputs, targets, graph = _graph(EAGER_LLAMA)
    layers, _ = measure_layers(graph, inputs.tensors(), targets, model_file.loss_fn, CpuTimer(), 1, 2)
    cores = attention_cores(graph.graph_module.graph, graph.layer_of_node)
    for layer in layers:
        if layer.index in cores:
            assert 0 <= layer.selective_saved_bytes < layer.saved_bytes
            assert layer.selective_recompute_ms > 0
        else:
            assert (layer.selective_saved_bytes, layer.selective_recompute_ms) == (-1, -1.0)
    # the layers' figures add up to what the whole graph saves with every core checkpointed
    whole = graph.split([0] * len(graph))[0]
    plain_bytes, _ = _step(model_file, whole.module, graph, inputs, targets)
    stage = checkpoint_attention(graph, graph.split([0] * len(graph))[0], sorted(cores))
    selective_bytes, _ = _step(model_file, stage.module, graph, inputs, targets)
    freed = sum(layer.saved_bytes - layer.selective_saved_bytes for layer in layers if layer.index in cores)
    assert plain_bytes - selective_bytes == freed


def test_profile_and_plan_carry_the_fields_and_refuse_bad_values(tmp_path: Path) -> None:
    layer = LayerProfile(
        0, "a", "Block", (), 1.0, 2.0, 8, 8, 100, selective_saved_bytes=40, selective_recompute_ms=0.5
    )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", (layer,))
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").layers[0] == layer
    old = profile.to_dict()
    for item in old["layers"]:
        del item["selective_saved_bytes"], item["selective_recompute_ms"]
    loaded = Profile.from_dict(old)
    assert (loaded.layers[0].selective_saved_bytes, loaded.layers[0].selective_recompute_ms) == (-1, -1.0)
    bad = profile.to_dict()
    bad["layers"][0]["selective_saved_bytes"] = -5
    with pytest.raises(InputError, match="selective_saved_bytes = -5 is not -1 or a byte count"):
        Profile.from_dict(bad)
    stage = StagePlan(0, 0, 2, 1, (0,), 1.0, 0.0, 0.0, 1.0, 1, 1, 1, selective_layers=(1,))
    assert stage.selective_layers == (1,) and stage.sequence_parallel is False


def _gpt_plan(**changes: object) -> dict:  # type: ignore[type-arg]
    from plans import make_plan

    plan = make_plan(GPT, [range(8), range(8, 16)], [1, 1], batch_size=4, microbatches=2)
    stages = (dataclasses.replace(plan.stages[0], **changes), plan.stages[1])  # type: ignore[arg-type]
    return dataclasses.replace(plan, stages=stages).to_dict()


def test_plans_refuse_selective_layers_outside_the_stage_or_fully_recomputed() -> None:
    assert Plan.from_dict(_gpt_plan(selective_layers=(2,))).stages[0].selective_layers == (2,)
    for changes, message in (
        ({"selective_layers": (9,)}, "selective_layers [9] are not distinct layers of the stage"),
        ({"selective_layers": (2, 2)}, "selective_layers [2, 2] are not distinct"),
        ({"selective_layers": (2,), "recompute_layers": (2,)}, "outside its recompute_layers [2]"),
        ({"sequence_parallel": True}, "sequence_parallel with tensor_parallel 1"),
    ):
        with pytest.raises(
            InputError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
        ):
            Plan.from_dict(_gpt_plan(**changes))


@pytest.mark.slow  # a Hugging Face Llama, profiled twice
def test_layer_by_layer_profiles_measure_the_same_selective_bytes() -> None:
    """A meta build (``pipeplan.profiler.layerwise``: one layer materialised at a time) measures
    each attention layer's selective bytes, and every layer's backward working bytes, as the
    eager build does."""
    from pipeplan.profiler.profile_model import profile_model

    eager = profile_model(EAGER_LLAMA, batch_size=2, device="cpu", warmup=0, repeats=1, build="eager")
    meta = profile_model(EAGER_LLAMA, batch_size=2, device="cpu", warmup=0, repeats=1, build="meta")
    pairs = [(a.selective_saved_bytes, b.selective_saved_bytes) for a, b in zip(eager.layers, meta.layers)]
    assert [a for a, _ in pairs] == [b for _, b in pairs]
    assert sum(a >= 0 for a, _ in pairs) == 2
    assert all(
        (layer.selective_recompute_ms > 0) == (layer.selective_saved_bytes >= 0) for layer in meta.layers
    )
    working = [layer.backward_working_bytes for layer in eager.layers]
    assert [layer.backward_working_bytes for layer in meta.layers] == working
    # an attention layer's backward holds its softmax's gradients, (batch, heads, seq, seq) float32
    # each: the probabilities' handed to softmax's backward and the scores' it makes
    *_, graph = _graph(EAGER_LLAMA)
    cores = attention_cores(graph.graph_module.graph, graph.layer_of_node)
    probabilities = 2 * 4 * 32 * 32 * 4
    assert len(cores) == 2 and all(2 * probabilities < working[k] < 3 * probabilities for k in cores)
