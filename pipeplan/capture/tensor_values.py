"""Which values of a captured graph are single tensors: the graph run once on the sample inputs.

Only tensors cross a stage cut, so grouping (``pipeplan.capture.grouping``) needs to know
which nodes yield one: an op that yields a tensor joins a layer, any other is copied into
every layer that uses it. A model on meta runs on meta inputs, one under ``fake_stand_ins``
on fake tensors: shapes and dtypes only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from pipeplan.capture.materialise import sample_run
from pipeplan.errors import InputError

__all__ = ["tensor_valued_nodes"]


def tensor_valued_nodes(
    graph_module: fx.GraphModule, sample_inputs: tuple[torch.Tensor, ...], model: nn.Module
) -> frozenset[str]:
    """Run the graph once (no grad); the names of the nodes whose value is a single tensor. O(ops)."""
    tensor_valued: set[str] = set()

    class Typer(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            value = super().run_node(node)
            if isinstance(value, torch.Tensor):
                tensor_valued.add(node.name)
            return value

    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sample_inputs):
        raise InputError(
            f"the model's forward takes {len(placeholders)} inputs, "
            f"but sample_batch gave {len(sample_inputs)}"
        )
    try:
        inputs, shapes = sample_run(model, sample_inputs)
        with torch.no_grad(), shapes:
            Typer(graph_module).run(*inputs)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise InputError(f"the model raised on the sample batch: {type(exc).__name__}: {reason}") from exc
    return frozenset(tensor_valued)
