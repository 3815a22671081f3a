"""The bundled example models: valid model files, traceable, deterministic, learnable, scalable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeplan.capture import build_layer_graph
from pipeplan.modelfile import bundled_model_path, load_model_file
from pipeplan.profiler.memory import param_bytes
from pipeplan.profiler.profile_model import BUNDLED_MODELS, profile_model


def load(name: str):
    model_file = load_model_file(bundled_model_path(name))
    torch.manual_seed(0)
    return model_file, model_file.build()


@pytest.mark.parametrize("name", BUNDLED_MODELS)
def test_bundled_model_runs_traces_and_is_deterministic(name: str) -> None:
    model_file, model = load(name)
    inputs, targets = model_file.batch(4, seed=0)
    again, targets_again = model_file.batch(4, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(inputs, again)) and torch.equal(targets, targets_again)
    assert not torch.equal(model_file.batch(4, seed=1)[0][0], inputs[0])
    loss = model_file.loss_fn(model(*inputs), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    graph = build_layer_graph(model, inputs)
    assert graph.kind == ("sequential" if name in ("mlp", "vgg") else "fx")
    # the stage modules, run in order, reproduce the model (eval: no dropout, BN running stats)
    model.eval()
    values = {f"input:{k}": value for k, value in enumerate(inputs)}
    with torch.no_grad():
        for stage in graph.layer_modules():
            values.update(zip(stage.output_names, stage.module(*(values[n] for n in stage.input_names))))
        torch.testing.assert_close(values["output"], model(*inputs))


def test_vgg_is_nested_sequential_with_sixteen_weight_layers() -> None:
    _, model = load("vgg")
    layers = build_layer_graph(model, (torch.zeros(1, 3, 32, 32),)).layers
    weighted = [layer for layer in layers if layer.type in ("Conv2d", "Linear")]
    assert len(weighted) == 16  # 13 convolutions + 3 Linear: VGG-16
    assert layers[0].name == "features.0" and layers[-1].name == "classifier.6"
    assert "Flatten" in [layer.type for layer in layers]


def test_gpt_head_is_tied_to_the_token_embedding() -> None:
    model_file, model = load("gpt")
    inputs, targets = model_file.batch(2, seed=0)
    assert inputs[0].shape == targets.shape == (2, 64) and inputs[0].dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[0][:, 1:])  # next-token targets
    graph = build_layer_graph(model, inputs)
    stages = graph.layer_modules()
    first = set(stages[0].parameter_names.values())
    last = set(stages[-1].parameter_names.values())
    assert "wte.weight" in first and "wte.weight" in last
    assert graph.layers[-1].name == "ln_f"
    # the head layer (ln_f + the tied projection) holds ln_f's weight and bias and the embedding
    assert param_bytes(stages[-1].module.parameters()) == (2 * 128 + 512 * 128) * 4
    assert stages[-1].parameters_by_qualified_name()["wte.weight"] is model.wte.weight


def test_env_vars_scale_the_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPEPLAN_GPT_LAYERS", "3")
    monkeypatch.setenv("PIPEPLAN_GPT_DIM", "32")
    monkeypatch.setenv("PIPEPLAN_GPT_SEQ", "16")
    model_file, model = load("gpt")
    assert len(model.blocks) == 3 and model.wte.weight.shape[1] == 32
    assert model_file.batch(2, seed=0)[0][0].shape == (2, 16)
    monkeypatch.setenv("PIPEPLAN_MLP_DIM", "64")
    monkeypatch.setenv("PIPEPLAN_MLP_LAYERS", "2")
    _, mlp = load("mlp")
    assert [m.out_features for m in mlp if isinstance(m, nn.Linear)] == [64, 64, 10]
    monkeypatch.setenv("PIPEPLAN_VGG_WIDTH", "4")
    monkeypatch.setenv("PIPEPLAN_IMAGE_SIZE", "64")
    vgg_file, vgg = load("vgg")
    assert vgg.features[0].out_channels == 4 and vgg_file.batch(1, seed=0)[0][0].shape == (1, 3, 64, 64)
    assert vgg.classifier[0].in_features == 4 * 8 * 2 * 2
    monkeypatch.setenv("PIPEPLAN_RESNET_BLOCKS", "1,1,1,1")
    _, resnet = load("resnet")
    assert len(resnet.stages) == 4


@pytest.mark.slow
@pytest.mark.parametrize("name, steps", [("mlp", 15), ("gpt", 30)])
def test_bundled_tasks_are_learnable(name: str, steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPEPLAN_MLP_DIM", "256")  # the task, not the width, makes it learnable
    model_file, model = load(name)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        inputs, targets = model_file.batch(8, seed=step)
        loss = model_file.loss_fn(model(*inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


@pytest.mark.parametrize("name", BUNDLED_MODELS)
def test_cpu_profile_of_each_bundled_model_is_quick_and_complete(name: str) -> None:
    profile = profile_model(name, batch_size=4, device="cpu", warmup=0, repeats=1, threads=1)
    assert profile.model == name and profile.fingerprint.startswith("sha256:")
    assert all(layer.output_bytes > 0 for layer in profile.layers)
    assert sum(layer.param_bytes for layer in profile.layers) >= sum(
        p.numel() * 4 for p in load(name)[1].parameters()
    )
    assert profile.step_ms > 0 and profile.sum_layers_ms > 0
