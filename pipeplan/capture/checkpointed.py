"""Activation recomputation of chosen layers of a stage (``Plan`` stages' ``recompute_layers``).

``checkpoint_layers`` fuses each chosen layer's fx nodes into a submodule
(``torch.fx.passes.utils.fuser_utils.fuse_by_partitions``: the layer's inputs become the
submodule's arguments, its values read outside it its outputs) and calls it through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the forward keeps only
the layer's inputs, and backward runs the layer's forward again before its own
backward. Each chosen layer is its own checkpoint (``pipeplan.planner.recompute``'s cost
model). The stage's parameters keep their objects; their local names gain the submodule's
prefix (``recompute_0.blocks.0.mlp.weight``), and ``parameter_names`` maps them to the
model's qualified names as before, so checkpoints and weights are unchanged.

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

from pipeplan.capture.layer_graph import (
    LayerGraph,
    StageModule,
    _qualified_buffer_names,
    _qualified_parameter_names,
    _RebuildOutput,
)

__all__ = ["checkpoint_layers", "CHECKPOINT_PREFIX"]

CHECKPOINT_PREFIX = "recompute_"  # the fused layers' submodule names: recompute_0, recompute_1, ...


def checkpoint_layers(graph: LayerGraph, stage: StageModule, layers: Collection[int]) -> StageModule:
    """``stage`` with each of ``layers`` (layer indices of ``graph`` in the stage) run under
    non-reentrant ``torch.utils.checkpoint``; ``stage`` itself when ``layers`` is empty.
    O(nodes of the stage)."""
    if not layers:
        return stage
    outer = stage.module
    module = outer.graph if isinstance(outer, _RebuildOutput) else outer
    assert isinstance(module, fx.GraphModule)
    chosen = set(layers)
    partitions: dict[int, dict[fx.Node, int | None]] = {}
    for node in module.graph.nodes:
        layer = graph.layer_of_node.get(node.name, -1) if node.op not in ("placeholder", "output") else -1
        if layer in chosen:
            partitions.setdefault(layer, {})[node] = None
    fused = fuse_by_partitions(
        module, [partitions[layer] for layer in sorted(partitions)], prefix=CHECKPOINT_PREFIX
    )
    fused.delete_all_unused_submodules()  # the layers' modules now live in their recompute_ submodules only
    for node in list(fused.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith(CHECKPOINT_PREFIX):
            with fused.graph.inserting_before(node):
                submodule = fused.graph.get_attr(str(node.target))
                call = fused.graph.call_function(
                    checkpoint, (submodule, *node.args), {"use_reentrant": False}
                )
            node.replace_all_uses_with(call)
            fused.graph.erase_node(node)
    fused.graph.lint()
    fused.recompile()
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
