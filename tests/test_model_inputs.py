"""Model inputs as users call the model: a tensor, a tuple, or a dict of keyword arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeplan.capture import build_layer_graph
from pipeplan.errors import InputError
from pipeplan.model_inputs import model_inputs
from pipeplan.modelfile import load_model_file
from pipeplan.runtime.data import BatchSource

KEYWORD_MODEL = """
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, ids=None, features=None, mask=None, scale=1.0):
        h = self.a(features) * scale
        if mask is not None:
            h = h * mask[..., None]
        return self.b(h).sum(1) + ids.float().mean(1, keepdim=True)


def build_model():
    return Scaled()


def sample_batch(batch_size):
    # keyword order differs from the signature; a None value and a constant ride along
    batch = {"features": torch.randn(batch_size, 3, 4), "mask": None, "scale": 0.5,
             "ids": torch.randint(0, 9, (batch_size, 3))}
    return batch, torch.randn(batch_size, 2)


def data_loader(batch_size, replica, replicas):
    torch.manual_seed(100 + replica)
    while True:
        yield sample_batch(batch_size)
"""


def test_flat_tensors_names_and_calls() -> None:
    x, ids = torch.randn(2, 3), torch.arange(4).reshape(2, 2)
    inputs = model_inputs({"features": x, "mask": None, "scale": 2.0, "ids": ids}, "f.py")
    assert inputs.names() == ("features", "ids") and inputs.tensors() == (x, ids)
    assert not inputs.positional and len(inputs) == 4
    moved = inputs.map(lambda t: t + 1)
    assert moved.kwargs["mask"] is None and moved.kwargs["scale"] == 2.0
    torch.testing.assert_close(moved.kwargs["ids"], ids + 1)
    assert inputs.call(lambda **kw: sorted(kw)) == ["features", "ids", "mask", "scale"]
    with pytest.raises(TypeError, match="inputs.call"):
        (lambda *a: a)(*inputs)
    positional = model_inputs((x, None, ids), "f.py")
    assert positional.names() == ("0", "2") and not positional.positional
    single = model_inputs(x, "f.py")
    assert single.positional and single.args == (x,) and (lambda a: a)(*single) is x
    with pytest.raises(InputError, match="input 1 is list"):
        model_inputs((x, [1]), "f.py")
    with pytest.raises(InputError, match="no input tensor"):
        model_inputs({"mask": None}, "f.py")


def test_keyword_batch_captures_and_every_stage_reads_its_inputs(tmp_path: Path) -> None:
    path = tmp_path / "keyword.py"
    path.write_text(KEYWORD_MODEL)
    model_file = load_model_file(path)
    torch.manual_seed(0)
    model = model_file.build()
    inputs, _ = model_file.batch(4, seed=0)
    assert inputs.names() == ("features", "ids")
    graph = build_layer_graph(model, inputs)
    assert graph.kind == "export" and [layer.name for layer in graph.layers] == ["a", "b"]
    # features is input 0 (read by layer a), ids input 1 (read where the last layer adds it)
    assert 0 in graph.layers[0].model_inputs and graph.layers[1].model_inputs == (1,)
    stages = graph.split([0, 1])
    assert stages[1].producers["input:1"] == -1  # the second stage draws the ids itself
    values = dict(zip(("input:0", "input:1"), inputs.tensors()))
    for stage in stages:
        values.update(zip(stage.output_names, stage.module(*(values[n] for n in stage.input_names))))
    torch.testing.assert_close(values["output"], inputs.call(model))


def test_batch_source_gives_flat_tensors_of_keyword_batches(tmp_path: Path) -> None:
    path = tmp_path / "keyword.py"
    path.write_text(KEYWORD_MODEL)
    model_file = load_model_file(path)
    source = BatchSource(model_file, batch_size=4, microbatches=2, seed=0, loader_replicas=1)
    (features, ids), targets = source.microbatch(0, 1)
    assert features.shape == (2, 3, 4) and ids.shape == (2, 3) and targets.shape == (2, 2)
    expected = next(model_file.data_loader(4, 0, 1))[0]  # type: ignore[misc]
    torch.testing.assert_close(features, expected["features"][2:])
