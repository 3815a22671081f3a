"""The layer graph: layers of Sequential and traced models, and stage splits."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.capture import MODEL_OUTPUT, build_layer_graph
from pipeplan.errors import InputError


class Residual(nn.Module):
    """a -> b -> c (+ a) -> d: the skip edge a -> c jumps over b."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        z = self.c(F.relu(self.b(h))) + h
        return self.d(z)


class TiedLM(nn.Module):
    """Embedding and output head share one weight; positions come from the input's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 16)
        self.wpe = nn.Embedding(10, 16)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        batch, length = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(length, device=idx.device))
        h = self.ln(x)
        x = x + self.fc(h).view(batch, length, h.size(-1))
        return F.linear(x, self.wte.weight)


def run_stages(stages, inputs):
    values = {f"input:{k}": t for k, t in enumerate(inputs)}
    for stage in stages:
        for name in stage.input_names:
            assert stage.producers[name] < stage.index
        outputs = stage.module(*[values[name] for name in stage.input_names])
        assert len(outputs) == len(stage.output_names)
        values.update(zip(stage.output_names, outputs))
    return values[MODEL_OUTPUT]


def all_contiguous_splits(layers: int, stages: int):
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield [s for s in range(stages) for _ in range(bounds[s], bounds[s + 1])]


def test_sequential_nested_is_flattened_chain():
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 8)), nn.Linear(8, 2))
    graph = build_layer_graph(model, (torch.zeros(3, 4),))
    assert graph.kind == "sequential"
    assert [layer.name for layer in graph.layers] == ["0", "1.0", "1.1", "2"]
    assert [layer.inputs for layer in graph.layers] == [(), (0,), (1,), (2,)]
    assert graph.layers[0].model_inputs == (0,)


def test_residual_has_skip_edge_and_folds_functional_ops():
    graph = build_layer_graph(Residual(), (torch.randn(3, 8),))
    assert graph.kind == "fx"
    assert [layer.name for layer in graph.layers] == ["a", "b", "c", "d"]
    # relu folds into b, the add into c, which reads a directly: the skip edge.
    assert graph.layers[2].inputs == (0, 1)
    assert graph.layers[3].inputs == (2,)


@pytest.mark.parametrize(
    "model_cls,inputs",
    [
        (Residual, (torch.randn(3, 8),)),
        (TiedLM, (torch.randint(0, 50, (2, 7)),)),
    ],
)
def test_every_split_computes_the_model(model_cls, inputs):
    torch.manual_seed(0)
    model = model_cls()
    graph = build_layer_graph(model, inputs)
    expected = model(*inputs)
    for stages in range(1, len(graph.layers) + 1):
        for assignment in all_contiguous_splits(len(graph.layers), stages):
            split = graph.split(assignment)
            assert len(split) == stages
            torch.testing.assert_close(run_stages(split, inputs), expected)


def test_skip_over_two_stages_is_sent_directly():
    graph = build_layer_graph(Residual(), (torch.randn(3, 8),))
    stages = graph.split([0, 1, 2, 3])
    assert stages[0].consumers["a"] == (1, 2)  # b on stage 1, the skip into c on stage 2
    assert stages[2].producers == {"relu": 1, "a": 0}
    assert stages[3].output_names == (MODEL_OUTPUT,)


def test_tied_weight_appears_in_both_stages_under_one_name():
    graph = build_layer_graph(TiedLM(), (torch.randint(0, 50, (2, 7)),))
    first, last = graph.split([0, 0, 1, 1])
    assert "wte.weight" in first.parameter_names.values()
    assert "wte.weight" in last.parameter_names.values()
    assert (
        first.parameters_by_qualified_name()["wte.weight"]
        is last.parameters_by_qualified_name()["wte.weight"]
    )
    # Only tensors cross: the shape ints are recomputed where needed.
    assert all(name == "input:0" or not name.startswith("getitem") for name in last.input_names)


def test_fingerprint_depends_on_structure():
    inputs = (torch.randn(3, 8),)
    a = build_layer_graph(Residual(), inputs).fingerprint
    assert a == build_layer_graph(Residual(), inputs).fingerprint
    other = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    assert build_layer_graph(other, inputs).fingerprint != a


def test_untraceable_model_names_why_and_suggests_sequential():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
                return self.lin(x)
            return x

    # neither fx nor torch.export can take it: one line with the file:line of the branch
    with pytest.raises(
        InputError, match=r"cannot capture Branchy at .*test_graph.py:\d+ .*nn.Sequential"
    ) as info:
        build_layer_graph(Branchy(), (torch.randn(2, 4),))
    assert "\n" not in str(info.value)


def test_tuple_output_is_rebuilt_on_the_last_stage():
    class TwoOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.out = nn.Linear(4, 2)

        def forward(self, x):
            h = self.lin(x)
            return self.out(h), h

    model = TwoOut()
    x = torch.randn(2, 4)
    graph = build_layer_graph(model, (x,))
    assert graph.kind == "export" and [layer.name for layer in graph.layers] == ["lin", "out"]
    first, last = graph.split([0, 1])
    (h,) = first.module(x)
    result = last.module(h)[-1]
    expected = model(x)
    assert isinstance(result, tuple) and len(result) == 2
    torch.testing.assert_close(result[0], expected[0])
    torch.testing.assert_close(result[1], expected[1])


def test_model_raising_on_sample_batch_is_an_input_error():
    with pytest.raises(InputError, match="raised on the sample batch"):
        build_layer_graph(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 5),))


@pytest.mark.parametrize("assignment", [[1, 1, 1, 1], [0, 2, 2, 2], [0, 1, 0, 1], [0, 0, 0]])
def test_bad_stage_assignment(assignment):
    graph = build_layer_graph(Residual(), (torch.randn(3, 8),))
    with pytest.raises(InputError):
        graph.split(assignment)
