"""Capture a model as a ``LayerGraph``: a chain for ``nn.Sequential``, ``torch.fx`` tracing, or ``torch.export``.

A *layer* is one leaf module call plus the parameter-free functional ops folded into
it. Three captures give the graph (``LayerGraph.kind``, recorded in the profile):

- ``"sequential"``: an ``nn.Sequential`` (nested ones flattened) is a chain of its children;
- ``"fx"``: any other model is traced with ``torch.fx`` (torch.nn's modules and the classes
  named in ``leaf_modules`` are leaves); every ``call_module`` node starts a layer;
- ``"export"``: where fx cannot trace the model (data-dependent Python, as in Hugging Face
  transformers) or the model returns more than one tensor, ``torch.export`` (non-strict)
  records its ATen ops (``pipeplan.capture.exported``); the ops of one call of a layer
  module (a leaf, or a child of a repeated block: GPT-2's ``attn`` and ``mlp``) form a layer.

Every other op is folded into a neighbour:

- an op that yields a tensor joins the latest layer among its producers (``out + identity``
  joins the block's last layer), so a layer may read several earlier layers: a DAG;
- an op that yields no tensor (``x.size(1)``, a tuple from ``split``) or reads only model
  inputs and attributes (``torch.arange(T)``, ``self.wte.weight``) is copied into every
  layer that uses it, so only tensors ever cross a cut.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from pipeplan.capture.exported import export_graph, preserved_buffers
from pipeplan.capture.layer_graph import LayerGraph, LayerNode
from pipeplan.capture.materialise import fake_mode_for, fake_stand_ins, on_meta, rebind
from pipeplan.errors import InputError
from pipeplan.model_inputs import ModelInputs, model_inputs

__all__ = ["build_layer_graph"]


def build_layer_graph(
    model: nn.Module, sample_inputs: ModelInputs | tuple[torch.Tensor, ...], leaf_modules: Sequence[str] = (),
    opaque_modules: Sequence[str] = (),
    device: torch.device | str | None = None,
) -> LayerGraph:
    """Cut ``model`` into layers; ``sample_inputs`` runs once (no grad) to type each value.

    ``sample_inputs``: a tuple of tensors (positional), or ``ModelInputs`` (keyword
    arguments, ``None`` values). The graph takes the flat tensors (``ModelInputs.tensors``);
    a model called with anything but positional tensors is captured with ``torch.export``.

    ``leaf_modules``: class names whose every call is one layer (fx and export captures).
    ``opaque_modules``: class names whose every call is one layer run as the module itself,
    never traced into (fx: a leaf; export: ``pipeplan.capture.opaque``); export adds the
    class of a module it fails in (``LayerGraph.opaque_modules`` lists them all).
    An export capture specialises shapes to ``sample_inputs``: run its stages on inputs of
    the same shapes (the runtime captures at the micro-batch size). A model on the meta
    device is captured from shapes alone. ``device`` is where the stages will run (None:
    where the sample inputs are; the CPU for a model on meta): an export capture records
    it in ops such as ``arange`` and in its tensor-metadata checks. A model on meta is
    exported on fake tensors there (``fake_stand_ins``), so its code takes the branches it
    takes on that device (a kernel or a dtype chosen by device, as Hugging Face MoE experts
    choose); a model with storage is exported where its sample inputs are, and the devices
    recorded are then made ``device``.

    >>> g = build_layer_graph(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
    ...                       (torch.zeros(3, 4),))
    >>> [(layer.name, layer.type, layer.inputs) for layer in g.layers]
    [('0', 'Linear', ()), ('1', 'ReLU', (0,)), ('2', 'Linear', (1,))]
    """
    leaves = frozenset(leaf_modules)
    if not isinstance(sample_inputs, ModelInputs):
        if len(sample_inputs) == 0:
            raise InputError("sample_batch gave no model inputs")
        sample_inputs = model_inputs(tuple(sample_inputs), "sample_batch")
    tensors = sample_inputs.tensors()
    if sample_inputs.positional and isinstance(model, nn.Sequential):
        if len(tensors) != 1:
            raise InputError(
                f"an nn.Sequential takes one input, but sample_batch gave {len(tensors)}"
            )
        return _fx_layer_graph(model, _sequential_graph(model), "sequential", tensors)
    traced = _trace(model, leaves | frozenset(opaque_modules)) if sample_inputs.positional else None
    if traced is not None:
        graph = _fx_layer_graph(model, traced, "fx", tensors)
        graph.opaque_modules = tuple(opaque_modules)
        return graph
    lazy = on_meta(model)
    target = torch.device(device) if device is not None else (torch.device("cpu") if lazy else _inputs_device(tensors))
    if lazy:  # exported on fake tensors on the target device, so its code takes that device's branches
        sample_inputs = sample_inputs.map(lambda tensor: tensor.to(target))
        tensors = sample_inputs.tensors()
    with fake_stand_ins(model, target) if lazy else contextlib.nullcontext():
        exported = export_graph(model, sample_inputs, leaves, opaque_modules)
        graph_module = exported.graph_module
        with preserved_buffers(model):
            tensor_valued = _run_and_type(graph_module, tensors, model)
    if lazy:
        rebind([graph_module], model)  # the model's meta tensors, not the stand-ins
    captured_on = target if lazy else _inputs_device(tensors)
    if target != captured_on:
        _devices_to(graph_module, captured_on, target)

    def layer_call(node: fx.Node) -> str | None:
        return exported.layer_call.get(node.name)

    def describe(call: str) -> tuple[str, str]:
        module = exported.layer_modules[call]
        return module.name, module.type

    layer_of_node = _group_nodes(graph_module, tensor_valued, layer_call)
    layers = _layer_nodes(graph_module, layer_of_node, layer_call, describe)
    graph = LayerGraph(model, graph_module, layer_of_node, layers, "export", frozenset(tensor_valued),
                       exported.out_spec, exported.dropped)
    graph.opaque_modules = exported.opaque
    return graph


def _fx_layer_graph(
    model: nn.Module, graph_module: fx.GraphModule, kind: str, sample_inputs: tuple[torch.Tensor, ...]
) -> LayerGraph:
    """Layers of an fx graph whose ``call_module`` nodes are the layers."""

    def layer_call(node: fx.Node) -> str | None:
        return node.name if node.op == "call_module" else None

    targets = {n.name: str(n.target) for n in graph_module.graph.nodes if n.op == "call_module"}

    def describe(call: str) -> tuple[str, str]:
        return targets[call], type(graph_module.get_submodule(targets[call])).__name__

    tensor_valued = _run_and_type(graph_module, sample_inputs, model)
    layer_of_node = _group_nodes(graph_module, tensor_valued, layer_call)
    layers = _layer_nodes(graph_module, layer_of_node, layer_call, describe)
    return LayerGraph(model, graph_module, layer_of_node, layers, kind, frozenset(tensor_valued))


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


def _devices_to(graph_module: fx.GraphModule, source: torch.device, target: torch.device) -> None:
    """An export records the device it ran on (the sample inputs') in factory ops
    (``arange``, ``full``) and ``_assert_tensor_metadata``; make them ``target``, the
    device the stages will run on."""
    for module in graph_module.modules():  # higher-order ops' bodies too
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                node.args = tuple(target if _is(arg, source) else arg for arg in node.args)
                node.kwargs = {k: target if _is(v, source) else v for k, v in node.kwargs.items()}
            module.recompile()


def _inputs_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """The device of the sample inputs (the CPU when there are none)."""
    return next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _run_and_type(
    graph_module: fx.GraphModule, sample_inputs: tuple[torch.Tensor, ...], model: nn.Module
) -> set[str]:
    """Run the graph once; return the names of nodes whose value is a single tensor.

    A model on meta runs on meta inputs, one under ``fake_stand_ins`` on fake tensors:
    shapes and dtypes only.
    """
    if on_meta(model):
        sample_inputs = tuple(value.to("meta") for value in sample_inputs)
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
        with torch.no_grad(), contextlib.nullcontext() if on_meta(model) else fake_mode_for(model):
            Typer(graph_module).run(*sample_inputs)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise InputError(
            f"the model raised on the sample batch: {type(exc).__name__}: {reason}"
        ) from exc
    return tensor_valued


def _group_nodes(
    graph_module: fx.GraphModule, tensor_valued: set[str], layer_call: Callable[[fx.Node], str | None]
) -> dict[str, int]:
    """Assign every compute node to a layer; copy shared non-tensor nodes per layer.

    ``layer_call(node)`` names the layer-module call a node belongs to (None: fold it).
    Pass 1 (topological): a node of a call other than the previous call's opens a new
    layer, a node of the same call joins it; any other tensor-valued op joins the latest
    layer among its producers. Pass 2 (reverse): ops left over (non-tensor
    values, ops on model inputs and attributes only) go to the layers of their users,
    copied once per using layer.
    """
    graph = graph_module.graph
    layer_of: dict[str, int] = {}
    anchor: dict[str, int] = {}  # latest layer any deferred node depends on
    deferred: list[fx.Node] = []
    layers = 0
    open_call: str | None = None
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        call = layer_call(node)
        if call is not None:
            if call != open_call:
                layers += 1
                open_call = call
            layer_of[node.name] = layers - 1
            continue
        latest = max(
            (layer_of.get(used.name, anchor.get(used.name, -1)) for used in node.all_input_nodes),
            default=-1,
        )
        if node.op != "get_attr" and node.name in tensor_valued and latest >= 0:
            layer_of[node.name] = latest
        else:
            anchor[node.name] = latest
            deferred.append(node)
    if layers == 0:
        raise InputError("the model calls no submodule; pipeplan's layers are module calls")
    last_layer = layers - 1
    for node in reversed(deferred):
        user_layers: dict[int, list[fx.Node]] = {}
        for user in list(node.users):
            layer = last_layer if user.op == "output" else layer_of[user.name]
            user_layers.setdefault(layer, []).append(user)
        if not user_layers:  # unused: keep it with its inputs so nothing dangles
            layer_of[node.name] = max(anchor[node.name], 0)
            continue
        ordered = sorted(user_layers)
        layer_of[node.name] = ordered[0]
        for layer in ordered[1:]:
            with graph.inserting_before(node):
                copy = graph.node_copy(node, lambda used: used)
            layer_of[copy.name] = layer
            for user in user_layers[layer]:
                user.replace_input_with(node, copy)
    graph.lint()
    graph_module.recompile()
    return layer_of


def _layer_nodes(
    graph_module: fx.GraphModule,
    layer_of: dict[str, int],
    layer_call: Callable[[fx.Node], str | None],
    describe: Callable[[str], tuple[str, str]],
) -> tuple[LayerNode, ...]:
    graph = graph_module.graph
    placeholders = {n.name: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    count = max(layer_of.values()) + 1
    names = [""] * count
    types = [""] * count
    inputs: list[set[int]] = [set() for _ in range(count)]
    model_inputs: list[set[int]] = [set() for _ in range(count)]
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        layer = layer_of[node.name]
        call = layer_call(node)
        if call is not None and not names[layer]:
            names[layer], types[layer] = describe(call)
        for used in node.all_input_nodes:
            if used.op == "placeholder":
                model_inputs[layer].add(placeholders[used.name])
            elif layer_of[used.name] != layer:
                inputs[layer].add(layer_of[used.name])
    return tuple(
        LayerNode(i, names[i], types[i], tuple(sorted(inputs[i])), tuple(sorted(model_inputs[i])))
        for i in range(count)
    )


def _is(value: Any, device: torch.device) -> bool:
    return isinstance(value, torch.device) and value == device
