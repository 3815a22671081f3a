"""Opaque layers: modules ``torch.export`` does not trace into, run as themselves from the captured graph.

Under ``opaque_calls(model, classes, calls)`` every module of the named classes answers a
call with one ``pipeplan::opaque`` op over its input tensors, whose outputs have the shapes
and dtypes an eager run recorded (``recorded_calls``), so export records a single node and
never looks inside.
``run_opaque_calls`` then turns each such node into a ``call_module`` of an
``OpaqueLayer``: the user's module itself, called with the arguments it was called with
(tensors from the graph, every other value as recorded), returning its output tensors.
The stage that holds the layer trains the module's own parameters; autograd goes
through its eager code. Shapes are those of the sample inputs, as for any export capture.

``opaque_fallback`` is capture's fallback: where ``torch.export`` fails inside a module,
that module's class is made opaque and export runs again, up to ``MOST_OPAQUE`` classes.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

__all__ = [
    "MOST_OPAQUE",
    "OpaqueLayer",
    "holds_any",
    "opaque_calls",
    "opaque_fallback",
    "recorded_calls",
    "run_opaque_calls",
]

MOST_OPAQUE = 4  # module classes made opaque automatically before capture gives up

torch.library.define("pipeplan::opaque", "(Tensor[] inputs, int call) -> Tensor[]")


@dataclass
class _Call:
    """One call of an opaque module: its name, how to rebuild its arguments, its outputs."""

    id: int  # the op's call argument
    name: str  # qualified name in the user's model
    module: nn.Module
    in_spec: pytree.TreeSpec  # of (args, kwargs)
    in_leaves: list[Any]  # non-tensor leaves as called; TENSOR where the graph gives a tensor
    out_spec: pytree.TreeSpec
    out_leaves: list[Any]  # non-tensor output leaves; TENSOR for each output tensor
    out_meta: list[tuple[torch.Size, torch.dtype]]  # shape and dtype of each output tensor


class TENSOR:
    """Marks a tensor's place among a call's leaves (None is a value too); a class, so that
    copies of a stage (deepcopy, pickle) still hold this very object."""


_CALLS: dict[int, _Call] = {}  # call id -> call, for the op's fake kernel during export
_IDS = itertools.count()


@torch.library.register_fake("pipeplan::opaque")
def _opaque_fake(inputs: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    meta = _CALLS[call].out_meta
    device = inputs[0].device if inputs else torch.device("cpu")
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in meta]


class OpaqueLayer(nn.Module):
    """``forward(*tensors)``: the user's module called as it was (tensors put back into its
    arguments), returning its output tensors as a list."""

    def __init__(self, call: _Call) -> None:
        super().__init__()
        self.module = call.module
        self.qualified_name = call.name
        self.in_spec = call.in_spec
        self.in_leaves = call.in_leaves

    def forward(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        supply = iter(tensors)
        leaves = [next(supply) if leaf is TENSOR else leaf for leaf in self.in_leaves]
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        output = self.module(*args, **kwargs)
        return [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]


def _split(value: pytree.PyTree) -> tuple[list[Any], list[Any], pytree.TreeSpec]:
    """(tensors, leaves with each tensor replaced by TENSOR, spec) of a pytree."""
    leaves, spec = pytree.tree_flatten(value)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    return tensors, [TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec


def holds_any(model: nn.Module, classes: Collection[str]) -> bool:
    """Whether ``model`` holds a module of one of ``classes``."""
    return any(type(module).__name__ in classes for module in model.modules())


@contextmanager
def recorded_calls(model: nn.Module, classes: Collection[str]) -> Iterator[list[_Call]]:
    """While active, every call of a module of ``classes`` is recorded: run the model once
    inside, eagerly (no grad), to learn each call's outputs. Yields the calls (complete at
    the exit), in the order the model makes them."""
    calls: list[_Call] = []
    hooks = [
        module.register_forward_hook(_recorder(name, calls), with_kwargs=True)
        for name, module in model.named_modules()
        if type(module).__name__ in classes
    ]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


@contextmanager
def opaque_calls(model: nn.Module, classes: Collection[str], calls: list[_Call]) -> Iterator[None]:
    """While active, modules of ``classes`` are one ``pipeplan::opaque`` op per call.

    ``calls``: as ``recorded_calls`` recorded them; the export run inside must call the
    modules in the same order."""
    targets = [(name, module) for name, module in model.named_modules() if type(module).__name__ in classes]
    pending = iter(calls)
    originals = {}
    for name, module in targets:
        originals[name] = module.forward
        module.forward = _stand_in(pending)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, module in targets:
            module.forward = originals[name]  # type: ignore[method-assign]
        for call in calls:
            _CALLS.pop(call.id, None)


_Hook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], pytree.PyTree], None]


def _recorder(name: str, calls: list[_Call]) -> _Hook:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: pytree.PyTree) -> None:
        _, in_leaves, in_spec = _split((args, kwargs))
        out_tensors, out_leaves, out_spec = _split(output)
        call = _Call(
            next(_IDS),
            name,
            module,
            in_spec,
            in_leaves,
            out_spec,
            out_leaves,
            [(t.shape, t.dtype) for t in out_tensors],
        )
        _CALLS[call.id] = call
        calls.append(call)

    return hook


def _stand_in(pending: Iterator[_Call]) -> Callable[..., pytree.PyTree]:
    """A module's forward during export: the opaque op, then the recorded output structure."""

    def forward(*args: pytree.PyTree, **kwargs: pytree.PyTree) -> pytree.PyTree:
        call = next(pending)
        tensors, _, _ = _split((args, kwargs))
        outputs = iter(torch.ops.pipeplan.opaque(tensors, call.id))
        leaves = [next(outputs) if leaf is TENSOR else leaf for leaf in call.out_leaves]
        return pytree.tree_unflatten(leaves, call.out_spec)

    return forward


def run_opaque_calls(graph_module: fx.GraphModule, calls: list[_Call]) -> int:
    """Replace each ``pipeplan::opaque`` node by a ``call_module`` of its ``OpaqueLayer``; return how many."""
    by_id = {call.id: call for call in calls}
    replaced = 0
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.pipeplan.opaque.default:
            continue
        inputs, call_id = node.args
        call = by_id[int(call_id)]  # type: ignore[call-overload]
        target = f"_pipeplan_opaque_{replaced}"
        graph_module.add_submodule(target, OpaqueLayer(call))
        with graph.inserting_before(node):
            layer = graph.call_module(target, tuple(inputs))  # type: ignore[arg-type]
        layer.meta = dict(node.meta)
        node.replace_all_uses_with(layer)
        graph.erase_node(node)
        replaced += 1
    graph_module.recompile()
    return replaced


def opaque_fallback(failed_in: str, opaque: Sequence[str], reason: str) -> tuple[str, ...] | None:
    """The opaque classes for the next export attempt after ``torch.export`` failed (``reason``:
    ``Type: first line``) in a module of class ``failed_in`` (``""``: outside every module):
    ``opaque`` and ``failed_in``, which one line on stderr names. None where there is no class
    to add: none, one already opaque, or ``MOST_OPAQUE`` classes are already."""
    if not failed_in or failed_in in opaque or len(opaque) >= MOST_OPAQUE:
        return None
    sys.stderr.write(
        f"pipeplan: torch.export cannot trace {failed_in} ({reason}); running "
        f"{failed_in} as an opaque layer (--opaque-modules {failed_in})\n"
    )
    return (*opaque, failed_in)
