"""The layer graph: a model cut into layers, and layers grouped into stage modules.

A *layer* is one leaf module call plus the parameter-free functional ops folded into
it. Three captures give the graph (``LayerGraph.kind``, recorded in the profile):

- ``"sequential"``: an ``nn.Sequential`` (nested ones flattened) is a chain of its children;
- ``"fx"``: any other model is traced with ``torch.fx`` (torch.nn's modules and the classes
  named in ``leaf_modules`` are leaves); every ``call_module`` node starts a layer;
- ``"export"``: where fx cannot trace the model (data-dependent Python, as in Hugging Face
  transformers) or the model returns more than one tensor, ``torch.export`` (non-strict)
  records its ATen ops (``pipeplan.capture``); the ops of one call of a layer module (a
  leaf, or a child of a repeated block: GPT-2's ``attn`` and ``mlp``) form a layer.

Every other op is folded into a neighbour:

- an op that yields a tensor joins the latest layer among its producers (``out + identity``
  joins the block's last layer), so a layer may read several earlier layers: a DAG;
- an op that yields no tensor (``x.size(1)``, a tuple from ``split``) or reads only model
  inputs and attributes (``torch.arange(T)``, ``self.wte.weight``) is copied into every
  layer that uses it, so only tensors ever cross a cut.

Layers are numbered in topological order; every edge goes from a lower to a higher
index, so any contiguous range of indices is a valid stage. ``LayerGraph.split`` builds
one ``fx.GraphModule`` per stage whose inputs and outputs name exactly the values that
cross its cuts, including skips that jump over several stages.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from pipeplan.errors import InputError

__all__ = ["LayerNode", "LayerGraph", "StageModule", "build_layer_graph", "MODEL_OUTPUT", "CAPTURES"]

CAPTURES = ("sequential", "fx", "export")  # LayerGraph.kind

MODEL_OUTPUT = "output"  # the value name of the model's result (consumed by the loss)


def model_input_name(position: int) -> str:
    return f"input:{position}"


@dataclass(frozen=True)
class LayerNode:
    index: int  # topological order
    name: str  # qualified name of the layer's module ("features.3", "blocks.0.attn.c_attn")
    type: str  # the module's class name
    inputs: tuple[int, ...]  # producer layers, each < index
    model_inputs: tuple[int, ...]  # positions of the model inputs the layer reads


@dataclass
class StageModule:
    index: int
    module: nn.Module  # forward(*inputs) -> tuple of outputs, in output_names order
    input_names: tuple[str, ...]  # "input:k" for model input k, else a value name
    # values later stages consume; MODEL_OUTPUT (what the model returns, as it returns it:
    # a tensor, ModelOutput, dict, tuple) on the last stage
    output_names: tuple[str, ...]
    producers: dict[str, int]  # input name -> producing stage (-1 for a model input)
    consumers: dict[str, tuple[int, ...]]  # output name -> consuming stages (> index)
    parameter_names: dict[str, str]  # local parameter name -> qualified name in the user's model

    def parameters_by_qualified_name(self) -> dict[str, nn.Parameter]:
        local = dict(self.module.named_parameters(remove_duplicate=False))
        return {qualified: local[name] for name, qualified in self.parameter_names.items()}


class LayerGraph:
    """A model as layers (``layers``) over one fx graph (``graph_module``).

    Build with ``build_layer_graph``; ``split`` groups layers into stage modules.
    """

    def __init__(
        self,
        model: nn.Module,
        graph_module: fx.GraphModule,
        layer_of_node: dict[str, int],
        layers: tuple[LayerNode, ...],
        kind: str,
        tensor_valued: frozenset[str],
        result_spec: pytree.TreeSpec | None = None,
        dropped_outputs: tuple[str, ...] = (),
    ) -> None:
        self.model = model
        self.tensor_valued = tensor_valued  # fx node names whose value is one tensor
        self.graph_module = graph_module
        self.layer_of_node = layer_of_node  # fx node name -> layer index
        self.layers = layers
        self.kind = kind  # one of CAPTURES
        # None: the graph's output is the model's one tensor; else the graph outputs a
        # flat tuple of tensors and result_spec rebuilds what the model returns
        self.result_spec = result_spec
        self.dropped_outputs = dropped_outputs  # output fields set to None (export only)
        self.fingerprint = _fingerprint(model, layers, kind)

    def __len__(self) -> int:
        return len(self.layers)

    def layer_modules(self) -> list[StageModule]:
        """One stage module per layer (used by the profiler)."""
        return self.split(list(range(len(self.layers))))

    def split(self, stage_of_layer: Sequence[int]) -> list[StageModule]:
        """Group layers into stages: layer i runs on stage ``stage_of_layer[i]``.

        Stage ids are 0..S-1, each used; every edge goes to the same or a later stage
        (a stage need not be contiguous in the layer order when the planner cuts a DAG at downsets). Runs in O(nodes).
        The last stage's module returns what the model returns (``MODEL_OUTPUT``).
        """
        _check_stage_ids(stage_of_layer, self.layers)
        stages = max(stage_of_layer) + 1
        graph = self.graph_module.graph
        stage_of_node = {
            node.name: stage_of_layer[self.layer_of_node[node.name]]
            for node in graph.nodes
            if node.op not in ("placeholder", "output")
        }
        result_nodes = self._result_nodes()

        def value_name(node: fx.Node) -> str:
            if node.op == "placeholder":
                return model_input_name(_placeholder_position(graph, node))
            return node.name

        def source_stage(node: fx.Node) -> int:
            return -1 if node.op == "placeholder" else stage_of_node[node.name]

        # Every value read by a node of another stage crosses a cut; record who reads it.
        readers: dict[str, set[int]] = {}
        for node in graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            for used in node.all_input_nodes:
                if source_stage(used) != stage_of_node[node.name]:
                    readers.setdefault(used.name, set()).add(stage_of_node[node.name])
        for result_node in result_nodes:
            if isinstance(result_node, fx.Node) and source_stage(result_node) != stages - 1:
                readers.setdefault(result_node.name, set()).add(stages - 1)
        nodes_by_name = {node.name: node for node in graph.nodes}
        for name in readers:
            produced = nodes_by_name[name]
            if produced.op != "placeholder" and name not in self.tensor_valued:
                raise InputError(
                    f"{produced.op} {produced.target} yields a non-tensor value that crosses "
                    f"a stage cut; only tensors can be sent between stages"
                )

        modules = []
        for stage in range(stages):
            modules.append(
                self._stage_module(stage, stages, stage_of_node, readers, value_name, result_nodes)
            )
        return modules

    def _result_nodes(self) -> list[Any]:
        output_node = next(node for node in self.graph_module.graph.nodes if node.op == "output")
        if self.result_spec is None:
            return [output_node.args[0]]
        return list(output_node.args[0])

    def _stage_module(
        self,
        stage: int,
        stages: int,
        stage_of_node: dict[str, int],
        readers: dict[str, set[int]],
        value_name: Any,
        result_nodes: list[Any],
    ) -> StageModule:
        source = self.graph_module.graph
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        input_names: list[str] = []
        producers: dict[str, int] = {}

        def lookup(node: fx.Node) -> fx.Node:
            if node not in env:  # a value from a model input or an earlier stage
                name = value_name(node)
                env[node] = graph.placeholder(_identifier(name))
                input_names.append(name)
                producers[name] = -1 if node.op == "placeholder" else stage_of_node[node.name]
            return env[node]

        for node in source.nodes:
            if node.op in ("placeholder", "output") or stage_of_node[node.name] != stage:
                continue
            env[node] = graph.node_copy(node, lookup)
        output_names: list[str] = []
        outputs: list[Any] = []
        consumers: dict[str, tuple[int, ...]] = {}
        for node in source.nodes:
            if node.op in ("placeholder", "output") or stage_of_node[node.name] != stage:
                continue
            later = sorted(s for s in readers.get(node.name, ()) if s > stage)
            if later:
                output_names.append(node.name)
                outputs.append(env[node])
                consumers[node.name] = tuple(later)
        if stage == stages - 1:
            output_names.append(MODEL_OUTPUT)
            # a non-node result is a constant (None for a dropped output field)
            outputs.extend(lookup(node) if isinstance(node, fx.Node) else node for node in result_nodes)
            consumers[MODEL_OUTPUT] = ()
        graph.output(tuple(outputs))
        graph_module = fx.GraphModule(self.graph_module, graph, class_name=f"Stage{stage}")
        module: nn.Module = graph_module
        if stage == stages - 1 and self.result_spec is not None:
            module = _RebuildOutput(graph_module, self.result_spec, len(result_nodes))
        return StageModule(
            index=stage,
            module=module,
            input_names=tuple(input_names),
            output_names=tuple(output_names),
            producers=producers,
            consumers=consumers,
            parameter_names=_qualified_parameter_names(module, self.model),
        )


class _RebuildOutput(nn.Module):
    """A last stage whose graph outputs flat tensors, returning the model's own structure.

    ``forward(*inputs)`` returns ``(*values for later stages, model output)``, the output
    rebuilt from the graph's last ``count`` values by ``spec`` (a ``ModelOutput``, dict...).
    """

    def __init__(self, graph: fx.GraphModule, spec: pytree.TreeSpec, count: int) -> None:
        super().__init__()
        self.graph = graph
        self.spec = spec
        self.count = count

    def forward(self, *inputs: Any) -> tuple[Any, ...]:
        flat = tuple(self.graph(*inputs))
        head, tail = flat[: len(flat) - self.count], flat[len(flat) - self.count :]
        return (*head, pytree.tree_unflatten(list(tail), self.spec))


def build_layer_graph(
    model: nn.Module, sample_inputs: tuple[torch.Tensor, ...], leaf_modules: Sequence[str] = ()
) -> LayerGraph:
    """Cut ``model`` into layers; ``sample_inputs`` runs once (no grad) to type each value.

    ``leaf_modules``: class names whose every call is one layer (fx and export captures).
    An export capture specialises shapes to ``sample_inputs``: run its stages on inputs of
    the same shapes (the runtime captures at the micro-batch size).

    >>> g = build_layer_graph(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
    ...                       (torch.zeros(3, 4),))
    >>> [(layer.name, layer.type, layer.inputs) for layer in g.layers]
    [('0', 'Linear', ()), ('1', 'ReLU', (0,)), ('2', 'Linear', (1,))]
    """
    leaves = frozenset(leaf_modules)
    if isinstance(model, nn.Sequential):
        if len(sample_inputs) != 1:
            raise InputError(
                f"an nn.Sequential takes one input, but sample_batch gave {len(sample_inputs)}"
            )
        return _fx_layer_graph(model, _sequential_graph(model), "sequential", sample_inputs)
    traced = _trace(model, leaves)
    if traced is not None:
        return _fx_layer_graph(model, traced, "fx", sample_inputs)
    from pipeplan.capture import export_graph, preserved_buffers

    if len(sample_inputs) == 0:
        raise InputError("sample_batch gave no model inputs")
    exported = export_graph(model, sample_inputs, leaves)
    graph_module = exported.graph_module
    with preserved_buffers(model):
        tensor_valued = _run_and_type(graph_module, sample_inputs)

    def layer_call(node: fx.Node) -> str | None:
        return exported.layer_call.get(node.name)

    def describe(call: str) -> tuple[str, str]:
        module = exported.layer_modules[call]
        return module.name, module.type

    layer_of_node = _group_nodes(graph_module, tensor_valued, layer_call)
    layers = _layer_nodes(graph_module, layer_of_node, layer_call, describe)
    return LayerGraph(model, graph_module, layer_of_node, layers, "export", frozenset(tensor_valued),
                      exported.out_spec, exported.dropped)


def _fx_layer_graph(
    model: nn.Module, graph_module: fx.GraphModule, kind: str, sample_inputs: tuple[torch.Tensor, ...]
) -> LayerGraph:
    """Layers of an fx graph whose ``call_module`` nodes are the layers."""

    def layer_call(node: fx.Node) -> str | None:
        return node.name if node.op == "call_module" else None

    targets = {n.name: str(n.target) for n in graph_module.graph.nodes if n.op == "call_module"}

    def describe(call: str) -> tuple[str, str]:
        return targets[call], type(graph_module.get_submodule(targets[call])).__name__

    tensor_valued = _run_and_type(graph_module, sample_inputs)
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


def _run_and_type(graph_module: fx.GraphModule, sample_inputs: tuple[torch.Tensor, ...]) -> set[str]:
    """Run the graph once; return the names of nodes whose value is a single tensor."""
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
        with torch.no_grad():
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


def _placeholder_position(graph: fx.Graph, node: fx.Node) -> int:
    return [n for n in graph.nodes if n.op == "placeholder"].index(node)


def _identifier(value_name: str) -> str:
    return value_name.replace(":", "_")


def _check_stage_ids(stage_of_layer: Sequence[int], layers: Sequence[LayerNode]) -> None:
    """Stage ids 0..S-1, each used, and no edge from a later stage to an earlier one."""
    if len(stage_of_layer) != len(layers):
        raise InputError(
            f"stage assignment covers {len(stage_of_layer)} layers, the model has {len(layers)}"
        )
    stages = max(stage_of_layer, default=-1) + 1
    unused = sorted(set(range(stages)) - set(stage_of_layer))
    if min(stage_of_layer, default=0) < 0 or unused:
        raise InputError(f"stage ids must be 0..{stages - 1}, each used (stage {unused[0] if unused else -1} is not)")
    for layer in layers:
        for producer in layer.inputs:
            if stage_of_layer[producer] > stage_of_layer[layer.index]:
                raise InputError(
                    f"layer {layer.index} (stage {stage_of_layer[layer.index]}) reads layer {producer} "
                    f"of the later stage {stage_of_layer[producer]}: every edge must go to the same or a later stage"
                )


def _qualified_parameter_names(module: nn.Module, model: nn.Module) -> dict[str, str]:
    """Map each local parameter name to its canonical name in the user's model (by identity)."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    names = {}
    for local, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) not in canonical:
            raise InputError(f"stage parameter {local} does not belong to the model")
        names[local] = canonical[id(parameter)]
    return names


def _fingerprint(model: nn.Module, layers: tuple[LayerNode, ...], kind: str) -> str:
    structure = {
        "kind": kind,
        "model": type(model).__name__,
        "layers": [[l.name, l.type, list(l.inputs), list(l.model_inputs)] for l in layers],
        "parameters": [[name, list(p.shape)] for name, p in model.named_parameters()],
    }
    digest = hashlib.sha256(json.dumps(structure, sort_keys=True).encode()).hexdigest()
    return f"sha256:{digest[:32]}"
