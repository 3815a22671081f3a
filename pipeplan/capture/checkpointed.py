"""Activation recomputation of chosen layers of a stage (``Plan`` stages' ``recompute_layers``,
and the attention cores of its ``selective_layers``).

``checkpoint_layers`` fuses each chosen layer's fx nodes into a submodule
(``torch.fx.passes.utils.fuser_utils.fuse_by_partitions``: the layer's inputs become the
submodule's arguments, its values read outside it its outputs) and calls it through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the forward keeps only
the layer's inputs, and backward runs the layer's forward again before its own
backward. Each chosen layer is its own checkpoint (``pipeplan.planner.recompute``'s cost
model). The stage's parameters keep their objects; their local names gain the submodule's
prefix (``recompute_0.blocks.0.mlp.weight``), and ``parameter_names`` maps them to the
model's qualified names as before, so checkpoints and weights are unchanged.

``checkpoint_attention`` does the same for the attention core of each chosen layer
(``pipeplan.capture.attention_core``): only the scores, softmax, dropout and product
with v run again in backward; the rest of the layer saves what it always does.

The recomputed forward reads the parameters the modules hold when backward runs: stages
whose forward runs on other tensors (weight versions, bf16 compute copies through
``functional_call``) must not recompute (the planner and ``pipeplan run`` refuse them).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import fx
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions
from torch.utils.checkpoint import checkpoint

from pipeplan.capture.attention_core import attention_cores
from pipeplan.capture.layer_graph import (
    LayerGraph,
    StageModule,
    _qualified_buffer_names,
    _qualified_parameter_names,
    _RebuildOutput,
)
from pipeplan.errors import InputError

__all__ = [
    "checkpoint_layers",
    "checkpoint_attention",
    "checkpoint_stage",
    "CHECKPOINT_PREFIX",
    "SELECTIVE_PREFIX",
]

CHECKPOINT_PREFIX = "recompute_"  # the fused layers' submodule names: recompute_0, recompute_1, ...
SELECTIVE_PREFIX = "selective_"  # the fused attention cores' (selective recomputation)


def checkpoint_layers(graph: LayerGraph, stage: StageModule, layers: Collection[int]) -> StageModule:
    """``stage`` with each of ``layers`` (layer indices of ``graph`` in the stage) run under
    non-reentrant ``torch.utils.checkpoint``; ``stage`` itself when ``layers`` is empty.
    O(nodes of the stage)."""
    return checkpoint_stage(graph, stage, layers, ())


def checkpoint_attention(
    graph: LayerGraph, stage: StageModule, layers: Collection[int], checkpointed: bool = True
) -> StageModule:
    """``stage`` with the attention core of each of ``layers`` (``attention_cores``) fused into
    a submodule ``selective_<k>`` and, with ``checkpointed``, run under non-reentrant
    ``torch.utils.checkpoint`` (Korthikanti et al.'s selective recomputation: the core keeps
    its inputs, q, k, v and the mask, and runs again in backward); without it the submodule is
    called plainly (the profiler times it). ``InputError`` for a layer without a core of its own.
    O(nodes of the stage)."""
    return checkpoint_stage(graph, stage, (), layers, checkpointed)


def checkpoint_stage(
    graph: LayerGraph,
    stage: StageModule,
    recompute: Collection[int],
    selective: Collection[int],
    checkpointed: bool = True,
) -> StageModule:
    """``stage`` with its ``recompute`` layers whole and the attention cores of its
    ``selective`` layers each fused into a submodule and, with ``checkpointed``, called through
    ``torch.utils.checkpoint``; ``stage`` itself when both are empty. The fusions come first,
    the checkpoint calls last: a submodule read by ``get_attr`` (the checkpoint's argument)
    would lose its children to the next fusion's pruning. O(nodes of the stage)."""
    if not recompute and not selective:
        return stage
    module = _graph_module(stage)
    if recompute:
        chosen = set(recompute)
        partitions: dict[int, dict[fx.Node, int | None]] = {}
        for node in module.graph.nodes:
            layer = graph.layer_of_node.get(node.name, -1) if node.op not in ("placeholder", "output") else -1
            if layer in chosen:
                partitions.setdefault(layer, {})[node] = None
        module = _fuse(module, [partitions[layer] for layer in sorted(partitions)], CHECKPOINT_PREFIX)
    if selective:
        cores = attention_cores(module.graph, graph.layer_of_node)
        missing = sorted(set(selective) - set(cores))
        if missing:
            raise InputError(
                f"selective recomputation of layer(s) {missing}: no attention core (scaled_dot_product_attention, "
                f"or matmul-softmax-matmul) lies whole in them in stage {stage.index}'s captured graph"
            )
        cores_of = [dict.fromkeys(core) for layer in sorted(set(selective)) for core in cores[layer]]
        module = _fuse(module, cores_of, SELECTIVE_PREFIX)
    if checkpointed:
        module = _checkpointed(module, (CHECKPOINT_PREFIX, SELECTIVE_PREFIX))
    return _rebuilt(graph, stage, module)


def _graph_module(stage: StageModule) -> fx.GraphModule:
    outer = stage.module
    module = outer.graph if isinstance(outer, _RebuildOutput) else outer
    if not isinstance(module, fx.GraphModule):
        raise InputError(
            f"stage {stage.index} is not a captured fx graph ({type(module).__name__}): its layers "
            f"cannot run under torch.utils.checkpoint"
        )
    return module


def _fuse(module: fx.GraphModule, partitions: list[dict[fx.Node, int | None]], prefix: str) -> fx.GraphModule:
    """``module`` with each partition's nodes fused into a submodule ``<prefix><k>``."""
    fused = fuse_by_partitions(module, partitions, prefix=prefix)
    fused.delete_all_unused_submodules()  # the fused nodes' modules now live in the submodules only
    return fused


def _checkpointed(fused: fx.GraphModule, prefixes: tuple[str, ...]) -> fx.GraphModule:
    """``fused`` with every call of a submodule named ``<prefix><k>`` made through ``checkpoint``."""
    for node in list(fused.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith(prefixes):
            with fused.graph.inserting_before(node):
                submodule = fused.graph.get_attr(str(node.target))
                call = fused.graph.call_function(
                    checkpoint, (submodule, *node.args), {"use_reentrant": False}
                )
            node.replace_all_uses_with(call)
            fused.graph.erase_node(node)
    fused.graph.lint()
    fused.recompile()
    return fused


def _rebuilt(graph: LayerGraph, stage: StageModule, fused: fx.GraphModule) -> StageModule:
    outer = stage.module
    if isinstance(outer, _RebuildOutput):
        outer.graph = fused
        rebuilt: torch.nn.Module = outer
    else:
        rebuilt = fused
    return StageModule(
        index=stage.index,
        module=rebuilt,
        input_names=stage.input_names,
        output_names=stage.output_names,
        producers=stage.producers,
        consumers=stage.consumers,
        parameter_names=_qualified_parameter_names(rebuilt, graph.model),
        buffer_names=_qualified_buffer_names(rebuilt, graph.model),
    )
