"""Capture by tracing: an ``nn.Sequential`` as the chain of its children, another model with ``torch.fx``.

- ``"sequential"``: an ``nn.Sequential`` (nested ones flattened) is a chain of its children,
  never traced;
- ``"fx"``: any other model called with positional tensors is traced with ``torch.fx``
  (torch.nn's modules and the classes named in ``leaf_modules`` or ``opaque_modules`` are
  leaves); every ``call_module`` node starts a layer.

A model fx cannot trace (data-dependent Python, as in Hugging Face transformers), one that
returns no single tensor, or one called with keyword arguments is left to ``torch.export``
(``pipeplan.capture.exported``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx, nn

from pipeplan.capture.captured import CapturedGraph, LayerModule
from pipeplan.errors import InputError
from pipeplan.model_inputs import ModelInputs

__all__ = ["traced_graph"]


def traced_graph(
    model: nn.Module, sample_inputs: ModelInputs, leaf_modules: Sequence[str], opaque_modules: Sequence[str]
) -> CapturedGraph | None:
    """The chain of an ``nn.Sequential``, or the fx graph of ``model``; None where it needs
    ``torch.export``. O(ops)."""
    if not sample_inputs.positional:
        return None
    if isinstance(model, nn.Sequential):
        tensors = sample_inputs.tensors()
        if len(tensors) != 1:
            raise InputError(f"an nn.Sequential takes one input, but sample_batch gave {len(tensors)}")
        return _module_calls(_sequential_graph(model), "sequential", ())
    traced = _trace(model, frozenset(leaf_modules) | frozenset(opaque_modules))
    if traced is None:
        return None
    return _module_calls(traced, "fx", tuple(opaque_modules))


def _module_calls(graph_module: fx.GraphModule, kind: str, opaque: tuple[str, ...]) -> CapturedGraph:
    """The captured graph whose ``call_module`` nodes are the layers (each its own call)."""
    calls = [node for node in graph_module.graph.nodes if node.op == "call_module"]
    layer_modules = {
        node.name: LayerModule(str(node.target), type(graph_module.get_submodule(str(node.target))).__name__)
        for node in calls
    }
    return CapturedGraph(
        graph_module, kind, {node.name: node.name for node in calls}, layer_modules, opaque=opaque
    )


def _sequential_graph(model: nn.Sequential) -> fx.GraphModule:
    """A chain graph over the flattened children; children are never traced."""
    graph = fx.Graph()
    value = graph.placeholder("input_0")
    for qualified_name in _flatten_sequential(model, prefix=""):
        value = graph.call_module(qualified_name, (value,))
    graph.output(value)
    return fx.GraphModule(model, graph, class_name=type(model).__name__)


def _flatten_sequential(module: nn.Sequential, prefix: str) -> list[str]:
    names = []
    for child_name, child in module.named_children():
        qualified = f"{prefix}{child_name}"
        if isinstance(child, nn.Sequential):
            names.extend(_flatten_sequential(child, prefix=f"{qualified}."))
        else:
            names.append(qualified)
    if not names and not prefix:
        raise InputError("the nn.Sequential model has no layers")
    return names


class _LeafTracer(fx.Tracer):
    """torch.nn's own modules (as fx's default) and ``leaf_modules`` classes are leaves;
    a Sequential is traced through."""

    def __init__(self, leaf_modules: frozenset[str]) -> None:
        super().__init__()
        self.leaf_modules = leaf_modules

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if type(module).__name__ in self.leaf_modules:
            return True
        if isinstance(module, nn.Sequential):
            return False
        return super().is_leaf_module(module, qualified_name)


def _trace(model: nn.Module, leaf_modules: frozenset[str]) -> fx.GraphModule | None:
    """The fx graph of ``model``, or None when fx cannot trace it or it returns no single tensor."""
    tracer = _LeafTracer(leaf_modules)
    try:
        graph = tracer.trace(model)
    except Exception:  # data-dependent Python: torch.export takes it (build_layer_graph)
        return None
    output = next(node for node in graph.nodes if node.op == "output")
    if not isinstance(output.args[0], fx.Node):
        return None
    graph_module = fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
    graph_module.graph.eliminate_dead_code()
    graph_module.recompile()
    return graph_module
