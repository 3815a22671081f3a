"""What torch.export emits for real models, captured and run stage by stage.

- a higher-order op whose body is a submodule of the exported graph (the autocast region
  of a rotary embedding);
- an in-place op on a value another layer produced (a residual ``h += x``);
- an opaque layer: a module export cannot trace (a branch on a tensor's value) run as itself.
Each split graph must equal the eager model, forward and gradients.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeplan.capture import build_layer_graph
from pipeplan.errors import InputError
from pipeplan.model_inputs import ModelInputs
from pipeplan.modelfile import load_model_file
from pipeplan.profiler.profile_model import profile_model

FIXTURES = Path(__file__).parent / "fixtures" / "models"


def run_split(graph, cut: int, tensors: tuple[torch.Tensor, ...]):
    """Run the graph as two stages cut before layer ``cut``; the model output."""
    stages = graph.split([0] * cut + [1] * (len(graph) - cut))
    values = {f"input:{k}": t for k, t in enumerate(tensors)}
    for stage in stages:
        outputs = stage.module(*(values[name] for name in stage.input_names))
        values.update(zip(stage.output_names, outputs))
    return values["output"]


def assert_same_step(model: nn.Module, graph, cut: int, inputs: ModelInputs) -> None:
    """Split output and parameter gradients equal the eager model's."""
    expected = inputs.call(model)
    expected.square().sum().backward()
    eager = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    output = run_split(graph, cut, inputs.tensors())
    torch.testing.assert_close(output, expected)
    output.square().sum().backward()
    for name, parameter in model.named_parameters():
        if eager[name] is None:  # the branch not taken leaves it without a gradient
            assert parameter.grad is None, name
        else:
            torch.testing.assert_close(parameter.grad, eager[name], msg=name)


class Rotary(nn.Module):
    """cos/sin of positions computed in float32 with autocast off, as HF's rotary embeddings do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], dtype=torch.float32)
        with torch.autocast(device_type="cpu", enabled=False):
            angles = positions[:, None] * torch.ones(x.shape[-1])[None, :]
            return angles.cos()


class RotaryModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = Rotary()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        cos = self.rotary(x)
        for block in self.blocks:
            x = block(x) * cos  # every block reads the region's result
        return x if scale is None else x * scale


def test_autocast_region_is_carried_into_the_graph_and_every_stage() -> None:
    torch.manual_seed(0)
    model = RotaryModel()
    inputs = ModelInputs((), {"x": torch.randn(2, 5, 8), "scale": None})  # keyword inputs: export
    graph = build_layer_graph(model, inputs)
    assert graph.kind == "export"
    bodies = [
        n
        for n in graph.graph_module.graph.nodes
        if n.op == "get_attr"
        and isinstance(getattr(graph.graph_module, str(n.target), None), torch.fx.GraphModule)
    ]
    assert bodies, "the autocast region's body is a submodule of the graph"
    assert [layer.name for layer in graph.layers] == ["rotary", "blocks.0", "blocks.1"]
    assert_same_step(model, graph, 2, inputs)  # stage 1 (blocks.1) reads the region's output


class Residual(nn.Module):
    """``h += x`` on a value the previous layer produced (HF ResNet's shortcut add)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        g = self.b(h)
        g += h  # in place on a's output, read again below
        return {"logits": self.head(g) + h}


def test_in_place_op_on_a_layer_input_runs_alone_and_split() -> None:
    torch.manual_seed(0)
    model = Residual()
    x = torch.randn(4, 6)
    graph = build_layer_graph(model, (x,))  # a dict output: export
    in_place = [n for n in graph.graph_module.graph.nodes if str(n.target).endswith("add_.Tensor")]
    assert graph.kind == "export" and not in_place
    # each layer alone, on leaf inputs that require grad, as the profiler runs it
    for cut in (1, 2):

        class Logits(nn.Module):
            def forward(self, x):  # noqa: ANN001
                return model(x)["logits"]

        output = run_split(graph, cut, (x,))["logits"]
        torch.testing.assert_close(output, Logits()(x))
    profile = profile_model(FIXTURES.parent / "models" / "two_inputs.py", batch_size=2, warmup=0, repeats=1)
    assert profile.capture == "fx"  # unchanged path for an fx model with inplace=True modules


def test_export_failure_in_a_module_makes_it_an_opaque_layer(capsys: pytest.CaptureFixture[str]) -> None:
    model_file = load_model_file(FIXTURES / "gated.py")  # `if x.sum() > 0` inside Gate
    torch.manual_seed(0)
    model = model_file.build()
    x = torch.randn(3, 4)
    graph = build_layer_graph(model, (x,))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipeplan: torch.export cannot trace Gate (")
    assert "running Gate as an opaque layer (--opaque-modules Gate)" in lines[0]
    assert (graph.kind, graph.opaque_modules) == ("export", ("Gate",))
    assert [(layer.name, layer.type) for layer in graph.layers] == [("gate", "Gate"), ("out", "Linear")]
    stage = graph.split([0, 1])[0]
    assert set(stage.parameter_names.values()) == {"gate.lin.weight", "gate.lin.bias"}
    for sign in (1.0, -1.0):  # both sides of the branch: the module runs as itself
        model.zero_grad(set_to_none=True)
        assert_same_step(model, graph, 1, ModelInputs((sign * x.abs(),)))
    # asked for: no message, the same layers
    graph = build_layer_graph(model_file.build(), (x,), opaque_modules=("Gate",))
    assert capsys.readouterr().err == "" and graph.opaque_modules == ("Gate",)


def test_export_failure_outside_every_module_is_one_line() -> None:
    model_file = load_model_file(FIXTURES / "gated_top.py")
    with pytest.raises(InputError) as info:
        build_layer_graph(model_file.build(), (torch.randn(2, 4),))
    message = str(info.value)
    assert message.startswith("torch.export cannot capture GatedTop at ") and "gated_top.py:16 " in message
    assert "\n" not in message


@pytest.mark.multiprocess
def test_profile_cli_names_the_opaque_module_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeplan",
            "profile",
            str(FIXTURES / "gated.py"),
            "-o",
            str(out),
            "--warmup",
            "0",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        line
        for line in result.stderr.splitlines()
        if line.startswith("pipeplan: torch.export cannot trace Gate")
    ]
    assert "capture: export, 2 layers, opaque modules: Gate" in result.stdout
