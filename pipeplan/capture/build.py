"""Capture a model as a ``LayerGraph``: ``build_layer_graph`` runs the capture's steps, in this order.

A *layer* is one layer-module call plus the parameter-free functional ops folded into it.
Each step is a function of the module that owns it; none of them calls back into this one.

1. trace (``traced.py``, ``traced_graph``): an ``nn.Sequential`` is the chain of its
   children (``"sequential"``); another model called with positional tensors is traced
   with ``torch.fx`` (``"fx"``). None where fx cannot, and then:
2. build (``materialise.py``, ``capture_site``): a model built eagerly is exported where
   its sample inputs are; one built on meta on fake stand-ins on the device its stages
   will run on, so that its code takes that device's branches;
3. export (``exported.py``, ``export_graph``): ``torch.export`` (non-strict) records the
   ATen ops (``"export"``); the ops of one call of a layer module (a leaf, or a child of a
   repeated block: GPT-2's ``attn`` and ``mlp``) form a layer;
4. opaque fallback (``opaque.py``, ``opaque_fallback``, at each failed export): a module
   class the export fails in runs as itself, and the export runs again;
5. type (``tensor_values.py``, ``tensor_valued_nodes``): the graph runs once on the sample
   inputs (shapes only for a model on meta), which says which values are single tensors;
6. group into layers (``grouping.py``, ``group_into_layers``): every other op is folded into
   a module call's layer, or copied into each layer using it (only tensors cross a cut);
7. place (``materialise.py``, ``place_graph``): an exported graph reads the model's own
   tensors again, and the devices it recorded are the stages' device.

Fx is tried before the build step: only an export runs where the build step says.
``layer_graph.py`` holds the result (``LayerGraph``: its layers, fingerprint and ``split``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipeplan.capture.exported import export_graph, preserved_buffers
from pipeplan.capture.grouping import group_into_layers
from pipeplan.capture.layer_graph import LayerGraph
from pipeplan.capture.materialise import CaptureSite, capture_site, place_graph
from pipeplan.capture.tensor_values import tensor_valued_nodes
from pipeplan.capture.traced import traced_graph
from pipeplan.errors import InputError
from pipeplan.model_inputs import ModelInputs, model_inputs

__all__ = ["build_layer_graph"]


def build_layer_graph(
    model: nn.Module,
    sample_inputs: ModelInputs | tuple[torch.Tensor, ...],
    leaf_modules: Sequence[str] = (),
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
    it in ops such as ``arange`` and in its tensor-metadata checks (``capture_site``).

    >>> g = build_layer_graph(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
    ...                       (torch.zeros(3, 4),))
    >>> [(layer.name, layer.type, layer.inputs) for layer in g.layers]
    [('0', 'Linear', ()), ('1', 'ReLU', (0,)), ('2', 'Linear', (1,))]
    """
    inputs = _as_model_inputs(sample_inputs)
    site: CaptureSite | None = None  # where an export ran (a trace runs nowhere in particular)
    captured = traced_graph(model, inputs, leaf_modules, opaque_modules)  # 1. trace
    if captured is not None:
        tensor_valued = tensor_valued_nodes(captured.graph_module, inputs.tensors(), model)  # 5. type
    else:
        with capture_site(model, inputs, device) as site:  # 2. build
            exported_inputs = site.sample_inputs
            # 3. export, and 4. the opaque fallback at each failure
            captured = export_graph(model, exported_inputs, leaf_modules, opaque_modules)
            with preserved_buffers(model):  # 5. type (the run must not move BatchNorm statistics)
                tensor_valued = tensor_valued_nodes(captured.graph_module, exported_inputs.tensors(), model)
    layer_of_node, layers = group_into_layers(captured, tensor_valued)  # 6. group into layers
    if site is not None:
        place_graph(captured.graph_module, model, site)  # 7. place
    return LayerGraph(
        model,
        captured.graph_module,
        layer_of_node,
        layers,
        captured.kind,
        tensor_valued,
        captured.result_spec,
        captured.dropped,
        captured.opaque,
    )


def _as_model_inputs(sample_inputs: ModelInputs | tuple[torch.Tensor, ...]) -> ModelInputs:
    if isinstance(sample_inputs, ModelInputs):
        return sample_inputs
    if len(sample_inputs) == 0:
        raise InputError("sample_batch gave no model inputs")
    return model_inputs(tuple(sample_inputs), "sample_batch")
