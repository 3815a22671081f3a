"""The layer graph: a model as layers over one fx graph, and layers grouped into stage modules.

A *layer* is one leaf module call plus the parameter-free functional ops folded into
it (``pipeplan.capture.build`` makes the graph, ``pipeplan.capture.grouping`` the
layers). Layers are numbered in topological order; every edge goes from a lower to a
higher index, so any contiguous range of indices is a valid stage. ``LayerGraph.split``
builds one ``fx.GraphModule`` per stage whose inputs and outputs name exactly the values
that cross its cuts, including skips that jump over several stages.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from pipeplan.errors import InputError

__all__ = ["CAPTURES", "MODEL_OUTPUT", "LayerGraph", "LayerNode", "StageModule", "model_input_name"]

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
    # local name -> qualified name of the model's persistent buffers the stage holds (BatchNorm
    # statistics): with parameter_names, the key of every tensor a checkpoint saves
    buffer_names: dict[str, str] = field(default_factory=dict)

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
        opaque_modules: tuple[str, ...] = (),
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
        self.opaque_modules = opaque_modules  # module classes run as themselves (opaque layers)
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
        value_name: Callable[[fx.Node], str],
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
            buffer_names=_qualified_buffer_names(module, self.model),
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

    def forward(self, *inputs: torch.Tensor) -> tuple[Any, ...]:
        flat = tuple(self.graph(*inputs))
        head, tail = flat[: len(flat) - self.count], flat[len(flat) - self.count :]
        return (*head, pytree.tree_unflatten(list(tail), self.spec))


def _placeholder_position(graph: fx.Graph, node: fx.Node) -> int:
    return [n for n in graph.nodes if n.op == "placeholder"].index(node)


def _identifier(value_name: str) -> str:
    return value_name.replace(":", "_")


def _check_stage_ids(stage_of_layer: Sequence[int], layers: Sequence[LayerNode]) -> None:
    """Stage ids 0..S-1, each used, and no edge from a later stage to an earlier one."""
    if len(stage_of_layer) != len(layers):
        raise InputError(f"stage assignment covers {len(stage_of_layer)} layers, the model has {len(layers)}")
    stages = max(stage_of_layer, default=-1) + 1
    unused = sorted(set(range(stages)) - set(stage_of_layer))
    if min(stage_of_layer, default=0) < 0 or unused:
        raise InputError(
            f"stage ids must be 0..{stages - 1}, each used (stage {unused[0] if unused else -1} is not)"
        )
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


def _qualified_buffer_names(module: nn.Module, model: nn.Module) -> dict[str, str]:
    """Local name -> name in the user's model of each persistent model buffer (by identity)."""
    persistent = set(model.state_dict(keep_vars=True))
    canonical: dict[int, str] = {}
    for name, buffer in model.named_buffers():
        if name in persistent:
            canonical.setdefault(id(buffer), name)
    return {
        local: canonical[id(buffer)]
        for local, buffer in module.named_buffers(remove_duplicate=False)
        if id(buffer) in canonical
    }


def _fingerprint(model: nn.Module, layers: tuple[LayerNode, ...], kind: str) -> str:
    structure = {
        "kind": kind,
        "model": type(model).__name__,
        "layers": [[l.name, l.type, list(l.inputs), list(l.model_inputs)] for l in layers],
        "parameters": [[name, list(p.shape)] for name, p in model.named_parameters()],
    }
    digest = hashlib.sha256(json.dumps(structure, sort_keys=True).encode()).hexdigest()
    return f"sha256:{digest[:32]}"
