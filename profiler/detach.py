"""Stage outputs handed to the next stage's measurement as fresh leaves.

The profilers (``measure``, ``layerwise``, ``selective``) run the stages one after another
and feed each one's outputs to the next; ``detached`` cuts the graph between them, keeping
each tensor's ``requires_grad`` so that a consumer differentiates what its producer would.
"""

__all__ = ["detached"]


def detached(value: object) -> object:
    """``value`` (a tensor, or the model's output structure) with every tensor detached."""
    import torch
    from torch.utils import _pytree as pytree

    def detach(leaf: object) -> object:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.detach().requires_grad_(leaf.requires_grad)

    return pytree.tree_map(detach, value)
