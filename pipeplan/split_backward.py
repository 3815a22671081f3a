"""A backward split in two (zero-bubble schedules): input gradients now, weight gradients later.

``backward_input`` runs autograd from a stage's outputs to its inputs only, with
``retain_graph=True``. On the way it records the gradient flowing into every
*boundary node*: a node on a path from the outputs to the inputs that also leads to a
parameter (for ``y = x @ W.T + b`` the ``addmm`` node). ``backward_weight`` later
starts autograd at those nodes with the recorded gradients and differentiates down to
the parameters only, so the work of the input pass is not repeated: a Linear layer's
weight pass is the one matrix product ``grad_y.T @ x``.

Parameters that share boundary nodes form one group and are differentiated together;
where a group has several boundary nodes, each node's incoming gradient is pinned to
the recorded one so that no gradient is counted twice. (The same method as
``torch.distributed.pipelining``'s ``stage_backward_input`` / ``stage_backward_weight``.)

Cost: one walk of the stage's autograd graph, O(nodes + edges), per ``backward_input``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightGradients", "backward_input", "backward_weight", "add_gradient"]


@dataclass(eq=False)
class _Group:
    params: list[torch.Tensor]  # leaves whose gradients this group computes
    nodes: list[Node]  # boundary nodes; none: differentiate from the stage outputs
    grads: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)


@dataclass(eq=False)
class WeightGradients:
    """What ``backward_weight`` needs: the graph (kept alive) and the recorded gradients."""

    groups: list[_Group]
    outputs: list[torch.Tensor]  # keep the graph alive; the roots of groups without nodes
    output_grads: list[torch.Tensor]

    def recorded(self) -> list[torch.Tensor]:
        """The gradients recorded at the boundary nodes: what the weight pass reads, held from
        the input pass until then beside the retained graph."""
        return [g for group in self.groups for grads in group.grads for g in grads or () if g is not None]


def _node_of(tensor: torch.Tensor) -> Node | None:
    """The autograd node producing ``tensor``: its grad_fn, or a leaf's AccumulateGrad."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if not tensor.requires_grad:
        return None
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below ``roots``: node -> nodes that feed gradient into it."""
    consumers: dict[Node, list[Node]] = {root: [] for root in roots}
    stack = list(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in consumers:
                consumers[child] = []
                stack.append(child)
            consumers[child].append(node)
    return consumers


def _above(
    starts: list[Node], consumers: dict[Node, list[Node]], stop: set[Node]
) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` along reverse edges, not passing ``stop``; and the ``stop`` nodes hit."""
    reached = set(starts)
    hit: set[Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        for parent in consumers.get(node, ()):
            if parent in stop:
                hit.add(parent)
            elif parent not in reached:
                reached.add(parent)
                stack.append(parent)
    return reached, hit


def _groups(
    inputs: list[Node], params: list[torch.Tensor], consumers: dict[Node, list[Node]]
) -> list[_Group]:
    """Parameters grouped by the boundary nodes they reach (union of overlapping sets)."""
    on_input_paths, _ = _above(inputs, consumers, set()) if inputs else (set(), set())
    groups: list[_Group] = []
    from_outputs = _Group([], [])
    for param in params:
        node = _node_of(param)
        if node is None or node not in consumers:
            continue  # not used by this unit's graph: no gradient
        _, boundary = _above([node], consumers, on_input_paths)
        if not boundary:
            from_outputs.params.append(param)
            continue
        group = _Group([param], list(boundary))
        for other in [g for g in groups if boundary.intersection(g.nodes)]:
            groups.remove(other)
            group.params += other.params
            group.nodes += [n for n in other.nodes if n not in boundary]
        groups.append(group)
    return groups + ([from_outputs] if from_outputs.params else [])


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradients]:
    """Gradients of ``inputs`` (None where an input needs none), and the deferred weight work.

    ``outputs``/``output_grads``: the stage's differentiable outputs (or its loss, with
    a gradient of ones) and their gradients. ``params``: the leaves whose gradients
    ``backward_weight`` will accumulate into ``.grad``.
    """
    roots = [n for n in map(_node_of, outputs) if n is not None]
    consumers = _consumers(roots)
    wanted = [x for x in inputs if x.requires_grad]
    input_nodes = [n for n in map(_node_of, wanted) if n is not None and n in consumers]
    groups = _groups(input_nodes, [p for p in params if p.requires_grad], consumers)
    handles = []
    for group in groups:
        group.grads = [None] * len(group.nodes)
        for i, node in enumerate(group.nodes):

            def record(
                grad_outputs: tuple[torch.Tensor | None, ...], group: _Group = group, i: int = i
            ) -> None:
                group.grads[i] = tuple(grad_outputs)

            handles.append(node.register_prehook(record))
    found: Sequence[torch.Tensor | None] = ()
    try:
        if input_nodes:
            found = torch.autograd.grad(
                list(outputs), wanted, list(output_grads), retain_graph=True, allow_unused=True
            )
    finally:
        for handle in handles:
            handle.remove()
    by_input = {id(x): g for x, g in zip(wanted, found)}
    return [by_input.get(id(x)) for x in inputs], WeightGradients(groups, list(outputs), list(output_grads))


def backward_weight(work: WeightGradients) -> None:
    """Accumulate the deferred weight gradients into ``.grad`` of the parameters; drops the graph.

    One group's gradients are alive at a time: each is added and let go before the next
    group's are computed (a loop variable kept them past that: two layers' at once, measured).
    """
    for group in work.groups:
        _accumulate(group.params, _group_gradients(group, work))
    work.groups.clear()
    work.outputs.clear()
    work.output_grads.clear()


def _group_gradients(group: _Group, work: WeightGradients) -> Sequence[torch.Tensor | None]:
    """The gradients of one group's parameters, from its boundary nodes' recorded gradients.
    A group without any (every parameter of a first stage, whose input needs no gradient)
    runs a plain backward from the stage's outputs into ``.grad``, as one backward would:
    each gradient is added as it is made, not all of them held at once, and none is returned."""
    if not group.nodes:
        torch.autograd.backward(work.outputs, work.output_grads, inputs=group.params, retain_graph=True)
        return ()
    edges, seeds = [], []
    for node, grads in zip(group.nodes, group.grads):
        for i, g in enumerate(grads or ()):
            if g is not None:
                edges.append(GradientEdge(node, i))
                seeds.append(g)
    if not edges:
        return ()
    pins: list[Any] = []
    if len(group.nodes) > 1:  # each boundary node's recorded gradient is final
        for node, grads in zip(group.nodes, group.grads):
            pins.append(node.register_prehook(lambda _g, saved=grads: saved))
    try:
        targets = [GradientEdge(_node_of(p), 0) for p in group.params]  # type: ignore[arg-type]
        return torch.autograd.grad(edges, targets, seeds, retain_graph=True, allow_unused=True)
    finally:
        for pin in pins:
            pin.remove()


def _accumulate(params: list[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    for param, grad in zip(params, grads):
        if grad is not None:
            param.grad = add_gradient(param.grad, grad)


def add_gradient(kept: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """The gradient to keep once ``new`` is added to ``kept``: ``new`` itself at first, then
    ``kept`` added into in place, as autograd's AccumulateGrad does (an out-of-place sum holds
    the old gradient, the new one and their sum at once)."""
    if kept is None:
        return new
    with torch.no_grad():
        return kept.add_(new)
