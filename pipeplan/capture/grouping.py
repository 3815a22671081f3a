"""Group a captured graph's nodes into layers: each module call is a layer, every other op is folded in.

A *layer* is one layer-module call (``CapturedGraph.layer_call``) plus the parameter-free
functional ops folded into it:

- an op that yields a tensor joins the latest layer among its producers (``out + identity``
  joins the block's last layer), so a layer may read several earlier layers: a DAG;
- an op that yields no tensor (``x.size(1)``, a tuple from ``split``) or reads only model
  inputs and attributes (``torch.arange(T)``, ``self.wte.weight``) is copied into every
  layer that uses it, so only tensors ever cross a cut.
"""

from __future__ import annotations

from torch import fx

from pipeplan.capture.captured import CapturedGraph
from pipeplan.capture.layer_graph import LayerNode
from pipeplan.errors import InputError

__all__ = ["group_into_layers"]


def group_into_layers(
    captured: CapturedGraph, tensor_valued: frozenset[str]
) -> tuple[dict[str, int], tuple[LayerNode, ...]]:
    """``(layer of each node by name, the layers)``; copies shared non-tensor nodes into the
    graph, once per using layer. ``tensor_valued``: the nodes whose value is one tensor. O(nodes)."""
    layer_of_node = _group_nodes(captured, tensor_valued)
    return layer_of_node, _layer_nodes(captured, layer_of_node)


def _group_nodes(captured: CapturedGraph, tensor_valued: frozenset[str]) -> dict[str, int]:
    """Assign every compute node to a layer; copy shared non-tensor nodes per layer.

    Pass 1 (topological): a node of a call other than the previous call's opens a new
    layer, a node of the same call joins it; any other tensor-valued op joins the latest
    layer among its producers. Pass 2 (reverse): ops left over (non-tensor
    values, ops on model inputs and attributes only) go to the layers of their users,
    copied once per using layer.
    """
    graph_module = captured.graph_module
    graph = graph_module.graph
    layer_of: dict[str, int] = {}
    anchor: dict[str, int] = {}  # latest layer any deferred node depends on
    deferred: list[fx.Node] = []
    layers = 0
    open_call: str | None = None
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        call = captured.layer_call.get(node.name)
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


def _layer_nodes(captured: CapturedGraph, layer_of: dict[str, int]) -> tuple[LayerNode, ...]:
    """Each layer's module (the first call in it), its producer layers and the model inputs it reads."""
    graph = captured.graph_module.graph
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
        call = captured.layer_call.get(node.name)
        if call is not None and not names[layer]:
            module = captured.layer_modules[call]
            names[layer], types[layer] = module.name, module.type
        for used in node.all_input_nodes:
            if used.op == "placeholder":
                model_inputs[layer].add(placeholders[used.name])
            elif layer_of[used.name] != layer:
                inputs[layer].add(layer_of[used.name])
    return tuple(
        LayerNode(i, names[i], types[i], tuple(sorted(inputs[i])), tuple(sorted(model_inputs[i])))
        for i in range(count)
    )
