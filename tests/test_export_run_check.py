"""``pipeplan.export.run_check``: stages run in-process as torch chains them, against the whole model.

Each refusal is what torch would fail on at run time (a stage fed fewer inputs than its
graph takes, a non-tensor or non-contiguous value sent, a model output torch's stage does
not return) or a disagreement with the whole model (a gradient lost at a cut).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeplan.capture import build_layer_graph
from pipeplan.export.run_check import StagedModel, StageRunError, check_staged
from pipeplan.export.stage_modules import carried_values, split_graph, staged_loss, tied_parameters
from pipeplan.model_inputs import ModelInputs


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.head.weight = nn.Parameter(self.a.weight[:2].detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.head(torch.tanh(self.b(h))) + x[:, :2]  # x skips to the last stage


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def staged_of(modules: list, loss: bool = False) -> StagedModel:
    return StagedModel(
        stages=tuple(modules),
        sources=(
            (),
            *(tuple((k - 1, i) for i in range(len(m.input_names))) for k, m in enumerate(modules) if k),
        ),
        parameters=tuple(m.qualified_parameters() for m in modules),
    )


@pytest.fixture
def chain() -> tuple[nn.Module, ModelInputs, torch.Tensor]:
    torch.manual_seed(0)
    return Chain(), ModelInputs((torch.randn(3, 4),)), torch.randn(3, 2)


def test_stage_modules_relay_a_skip_and_equal_the_whole_model(chain) -> None:
    model, inputs, target = chain
    graph = build_layer_graph(model, inputs)
    assert [layer.name for layer in graph.layers] == ["a", "b", "head"]
    modules = split_graph(graph, [0, 1, 2])
    # the model input x is read by the last stage: stage 0 sends it, stage 1 relays it
    carried = carried_values(graph.split([0, 1, 2]), 1)
    assert [names[0] for names in carried] == ["input:0", "input:0"] and [len(c) for c in carried] == [2, 2]
    assert [m.input_names for m in modules] == [("input:0",), *carried]
    loss = check_staged(
        staged_of(modules), model, inputs, inputs.tensors(), target, mse, staged_loss(modules, mse)
    )
    assert loss == pytest.approx(float(mse(model(*inputs.args), target).detach()), rel=1e-6)
    assert tied_parameters(modules) == {}


def test_a_stage_fed_fewer_inputs_than_its_graph_takes_is_refused(chain) -> None:
    # the failure of issue 32: torch feeds stage 0 the model inputs alone
    model, inputs, target = chain
    staged = StagedModel(
        stages=(lambda x, extra: (model.a(x) + extra,), lambda h: model.head(model.b(h))),
        sources=((), ((0, 0),)),
        parameters=({}, {}),
    )
    with pytest.raises(
        StageRunError, match=r"^stage 0 fails on the 1 input\(s\) torch feeds it \(TypeError: "
    ):
        check_staged(staged, model, inputs, inputs.tensors(), target, mse)


def test_what_torch_cannot_send_or_return_is_refused(chain) -> None:
    model, inputs, target = chain
    view = StagedModel(
        stages=(lambda x: (model.a(x).t(),), lambda h: model.head(model.b(h.t()))),
        sources=((), ((0, 0),)),
        parameters=({}, {}),
    )
    with pytest.raises(
        StageRunError, match="^stage 1 would receive output 0 of stage 0, a tensor that is not contiguous"
    ):
        check_staged(view, model, inputs, inputs.tensors(), target, mse)
    as_dict = StagedModel(
        stages=(lambda x: {"out": model.head(model.b(model.a(x)))},), sources=((),), parameters=({},)
    )
    with pytest.raises(
        StageRunError, match="^stage 0 returns a dict; torch's stage returns a tensor or a tuple"
    ):
        check_staged(as_dict, model, inputs, inputs.tensors(), target, mse, lambda o, t: mse(o["out"], t))


def test_a_gradient_lost_at_a_cut_is_refused(chain) -> None:
    model, inputs, target = chain
    detached = StagedModel(  # stage 0 sends a value cut off from its parameters
        stages=(
            lambda x: (torch.tanh(model.a(x)).detach(),),
            lambda h, x: model.head(torch.tanh(model.b(h))) + x[:, :2],
        ),
        sources=((), ((0, 0), (0, 1))),
        parameters=(
            dict(model.a.named_parameters(prefix="a")),
            {
                **dict(model.b.named_parameters(prefix="b")),
                **dict(model.head.named_parameters(prefix="head")),
            },
        ),
    )
    staged = StagedModel(
        stages=(lambda x: (detached.stages[0](x)[0], x), detached.stages[1]),
        sources=detached.sources,
        parameters=detached.parameters,
    )
    with pytest.raises(StageRunError, match=r"^parameter a\.weight gets no gradient from the stages, "):
        check_staged(staged, model, inputs, inputs.tensors(), target, mse)


def test_the_model_is_left_as_it_was(chain) -> None:
    model, inputs, target = chain
    model.register_buffer("count", torch.zeros(()))
    modules = split_graph(build_layer_graph(model, inputs), [0, 0, 1])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    check_staged(staged_of(modules), model, inputs, inputs.tensors(), target, mse, staged_loss(modules, mse))
    assert all(p.grad is None for p in model.parameters())  # gradients taken, never accumulated
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
