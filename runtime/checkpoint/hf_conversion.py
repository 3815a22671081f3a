"""Hugging Face checkpoints whose tensors transformers converts when it loads them.

transformers 5 saves some parameters in another layout than the model holds them: an MoE
layer's experts one tensor per expert (``experts.3.gate_proj.weight``, ``experts.3.up_proj.weight``)
where the model holds one merged parameter (``experts.gate_up_proj``), Mixtral's
``block_sparse_moe`` under the name ``mlp``. ``from_pretrained`` renames and merges them with
the model's conversion mapping. ``run --weights`` does the same for the tensors of one stage:
the renames, the order of the pieces and the merge are transformers' own
(``get_model_conversion_mapping``, ``rename_source_key``, each converter's operations), so what a
stage loads is what ``from_pretrained`` would have put there.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Conversion", "library_conversions", "convert"]


@dataclass(frozen=True)
class Conversion:
    """How transformers fills one model parameter: from ``sources`` (saved names, in the order
    it reads them), each matched by ``patterns``, through ``converter`` (a WeightConverter; None
    for a saved tensor that is only renamed)."""

    target: str
    sources: tuple[str, ...]
    patterns: tuple[str, ...]
    converter: Any
    config: Any  # the model's config, which some operations read


def library_conversions(model: nn.Module, saved: Iterable[str]) -> dict[str, Conversion]:
    """Model parameter name -> its ``Conversion`` from the ``saved`` names, for every parameter
    that transformers would fill from saved tensors of other names (merged or renamed); {} for a
    model that is not a transformers model. ``model`` may be on the meta device."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # no transformers, or one without conversion mappings (before 5.0)
        return {}
    if not isinstance(model, PreTrainedModel):
        return {}
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    names = model.state_dict()
    found: dict[str, list[tuple[str, str | None]]] = {}
    for key in sorted(saved, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        if key in names:
            continue  # saved under the model's own name
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, names)
        if renamed in names:
            found.setdefault(renamed, []).append((key, pattern))
    return {
        target: Conversion(
            target,
            tuple(k for k, _ in pieces),
            tuple(p or "" for _, p in pieces),
            by_pattern.get(pieces[0][1] or ""),
            model.config,
        )
        for target, pieces in found.items()
    }


def convert(conversion: Conversion, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The parameter ``conversion.target`` made from its saved ``tensors`` (by saved name)."""
    if conversion.converter is None:  # a rename (Mixtral's block_sparse_moe -> mlp)
        return tensors[conversion.sources[0]]
    converter = copy.deepcopy(conversion.converter)  # it collects tensors: one instance per target
    for source, pattern in zip(conversion.sources, conversion.patterns):
        converter.add_tensor(conversion.target, source, pattern, tensors[source])
    result = converter.convert(conversion.target, config=conversion.config)
    value = result[conversion.target]
    return value[0] if isinstance(value, list) else value
