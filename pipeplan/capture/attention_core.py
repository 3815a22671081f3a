"""The attention cores of a captured graph: what selective recomputation recomputes.

Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models")
recompute only a transformer block's attention core: the scores ``q k^T``, their
scaling and mask, the softmax, the dropout on it and the product with ``v``, the part
whose saved activations grow with the square of the sequence. In a captured graph
(``torch.fx`` or ``torch.export``) a core is one of:

- a fused attention call: ``F.scaled_dot_product_attention`` (the bundled GPT, Hugging
  Face's ``sdpa_attention_forward``) or one of its ATen kernels;
- the explicit chain Hugging Face's ``eager_attention_forward`` writes: a matmul of two
  activations, then elementwise scaling / masking / casts, a softmax, dropout or casts,
  and a matmul whose first operand is the chain.

``attention_cores`` finds them, each as its fx nodes, keyed by the layer
(``LayerGraph.layer_of_node``) that holds the whole core; a core whose nodes fall in two
layers (an eager attention grouped into its ``k_proj`` and ``v_proj`` layers) is left
out: its layers have no selective option. Layers kept whole (leaf and opaque modules)
show no core either. ``pipeplan.capture.checkpointed.checkpoint_attention`` runs the
cores under ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import fx

__all__ = ["attention_cores"]


def _aten(name: str) -> list[object]:
    """The default overload of ``torch.ops.aten.<name>`` where this torch has it."""
    packet = getattr(torch.ops.aten, name, None)
    return [packet.default] if packet is not None and hasattr(packet, "default") else []


_FUSED: set[object] = {
    F.scaled_dot_product_attention,
    *_aten("scaled_dot_product_attention"),
    *_aten("_scaled_dot_product_flash_attention_for_cpu"),
    *_aten("_scaled_dot_product_flash_attention"),
    *_aten("_scaled_dot_product_efficient_attention"),
    *_aten("_scaled_dot_product_cudnn_attention"),
}
_MATMULS: set[object] = {
    operator.matmul,
    torch.matmul,
    torch.bmm,
    torch.ops.aten.matmul.default,
    torch.ops.aten.bmm.default,
}
_SOFTMAXES: set[object] = {
    torch.softmax,
    F.softmax,
    torch.ops.aten.softmax.int,
    torch.ops.aten._softmax.default,
    torch.ops.aten._safe_softmax.default,
}
# elementwise steps between the scores and the softmax (scale, mask, casts), and between
# the softmax and the product with v (dropout, casts)
_BEFORE: set[object] = {
    operator.mul,
    operator.truediv,
    operator.add,
    torch.mul,
    torch.div,
    torch.add,
    torch.masked_fill,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.div.Tensor,
    torch.ops.aten.add.Tensor,
    torch.ops.aten.masked_fill.Scalar,
    torch.ops.aten.to.dtype,
    torch.ops.aten._to_copy.default,
}
_AFTER: set[object] = {
    F.dropout,
    torch.dropout,
    torch.ops.aten.dropout.default,
    torch.ops.aten.to.dtype,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.alias.default,
}
_METHODS_BEFORE = frozenset({"mul", "div", "add", "masked_fill", "to", "float", "type_as"})
_METHODS_AFTER = frozenset({"to", "float", "type_as"})
_CHECKS: set[object] = {
    torch.ops.aten._assert_tensor_metadata.default
}  # no value: follow the node they check


def _is(node: object, targets: set[object], methods: frozenset[str] = frozenset()) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in targets
    return node.op == "call_method" and node.target in methods


def _is_matmul(node: object) -> bool:
    """A product of two activations (no operand a parameter read by ``get_attr``)."""
    return (
        _is(node, _MATMULS, frozenset({"matmul", "bmm"}))
        and isinstance(node, fx.Node)
        and all(isinstance(a, fx.Node) and a.op != "get_attr" for a in node.args[:2])
    )


def _value_users(node: fx.Node) -> list[fx.Node]:
    return [user for user in node.users if not _is(user, _CHECKS)]


def _explicit_core(softmax: fx.Node) -> list[fx.Node] | None:
    """The chain matmul -> ... -> ``softmax`` -> ... -> matmul around ``softmax``, or None."""
    before: list[fx.Node] = []
    node = softmax.args[0]
    while isinstance(node, fx.Node) and not _is_matmul(node):
        if not _is(node, _BEFORE, _METHODS_BEFORE) or len(_value_users(node)) != 1:
            return None
        before.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node) or len(_value_users(node)) != 1:
        return None
    chain = [node, *reversed(before), softmax]
    while True:
        users = _value_users(chain[-1])
        if len(users) != 1:
            return None
        user = users[0]
        if _is_matmul(user) and user.args[0] is chain[-1]:
            chain.append(user)
            break
        if not _is(user, _AFTER, _METHODS_AFTER) or user.args[0] is not chain[-1]:
            return None
        chain.append(user)
    checks = [user for node in chain for user in node.users if _is(user, _CHECKS)]
    return chain + checks


def attention_cores(graph: fx.Graph, layer_of_node: Mapping[str, int]) -> dict[int, list[list[fx.Node]]]:
    """Layer index -> the attention cores it holds whole, each as its nodes. O(nodes)."""
    cores: dict[int, list[list[fx.Node]]] = {}
    for node in graph.nodes:
        if _is(node, _FUSED):
            found: list[fx.Node] | None = [node]
        elif _is(node, _SOFTMAXES, frozenset({"softmax"})):
            found = _explicit_core(node)
        else:
            continue
        if found is None:
            continue
        layers = {layer_of_node.get(member.name, -1) for member in found}
        if len(layers) == 1 and min(layers) >= 0:
            cores.setdefault(min(layers), []).append(found)
    return cores
