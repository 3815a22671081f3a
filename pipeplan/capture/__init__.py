"""Graph capture: everything that turns a user's model into a ``LayerGraph`` of layers and stage modules."""

from pipeplan.capture.build import build_layer_graph
from pipeplan.capture.exported import capture_error
from pipeplan.capture.layer_graph import (
    CAPTURES,
    MODEL_OUTPUT,
    LayerGraph,
    LayerNode,
    StageModule,
    model_input_name,
)
from pipeplan.capture.modules import module_records

__all__ = [
    "CAPTURES",
    "MODEL_OUTPUT",
    "LayerGraph",
    "LayerNode",
    "StageModule",
    "build_layer_graph",
    "capture_error",
    "model_input_name",
    "module_records",
]
