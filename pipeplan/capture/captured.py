"""A captured graph before it is cut into layers: what the trace or the export step hands on.

``traced.py`` (a chain for an ``nn.Sequential``, ``torch.fx``) and ``exported.py``
(``torch.export``) each give a ``CapturedGraph``: the fx graph over the model's flat input
tensors, and which module call each node belongs to. ``grouping.py`` folds the other
nodes into those calls' layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx
from torch.utils import _pytree as pytree

__all__ = ["CapturedGraph", "LayerModule"]


@dataclass(frozen=True)
class LayerModule:
    name: str  # qualified name in the user's model ("transformer.h.0.attn")
    type: str  # class name ("GPT2Attention")


@dataclass(frozen=True)
class CapturedGraph:
    graph_module: fx.GraphModule  # inputs: the model's flat input tensors
    kind: str  # how it was captured: one of CAPTURES (pipeplan.capture.layer_graph)
    layer_call: dict[str, str]  # node name -> module call key of its layer (absent: folded)
    layer_modules: dict[str, LayerModule]  # module call key -> the module
    # None: the graph outputs the model's one tensor; else it outputs a flat tuple of
    # tensors and result_spec rebuilds what the model returns (a ModelOutput, dict, tuple)
    result_spec: pytree.TreeSpec | None = None
    dropped: tuple[str, ...] = ()  # output fields set to None (values export cannot carry)
    opaque: tuple[str, ...] = ()  # module classes run as themselves (opaque layers)
