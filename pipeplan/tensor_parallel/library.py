"""Transformers' own tensor-parallel plan of a model, read as pipeplan's split rules.

A transformers model whose config declares ``base_model_tp_plan`` carries the plan that
``from_pretrained(tp_plan="auto")`` applies: ``model.tp_plan``, the config's entries under
the base model's prefix (``model.layers.*.self_attn.q_proj: colwise``), the head's own
(``lm_head: colwise_gather_output``) and the vocabulary-parallel ``embed_tokens`` that
transformers adds. An entry names a module, or a parameter (MoE experts' stacked weights).

pipeplan runs a split stage in DTensor's global view (``tensor_parallel.apply``): DTensor's
sharding propagation places every activation and inserts the collectives a style's hooks
would. So a style comes down to the dimension it splits each parameter on (``STYLES``):

- ``colwise``, ``colwise_rep``, ``colwise_gather_output``: column-parallel (weight and bias
  on the output features); whether the output is gathered is DTensor's choice downstream;
- ``rowwise``, ``rowwise_rep``, ``rowwise_split_input``: row-parallel (weight on the input
  features, bias whole); a replicated input is split locally, at no cost;
- ``embedding_rowwise`` / ``embedding_colwise``: an embedding split on its rows (the
  vocabulary) or its dimension;
- ``replicated_with_grad_allreduce``, ``replicate``, ``all_reduce``, ``local_params``,
  ``mla_kv_a_proj``: split no parameter (their reductions are DTensor's own: a replicated
  norm weight reading a split activation gets a partial gradient, summed before the step).

- ``packed_colwise`` / ``packed_rowwise`` on MoE experts' stacked weights: column- / row-
  parallel as one block (gate and up halves not paired, so the output is gathered before
  the gating); ``moe_tp_experts``: no parameter (``tensor_parallel.experts`` gives the
  experts' grouped matmul its DTensor rules).

Refused in one line naming the entry (``REFUSED``): ``moe_identity_expert`` (not run),
``sequence_parallel`` (sequence parallelism is the plan's: ``StagePlan.sequence_parallel``), and any style this table does
not know.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from pipeplan.errors import InputError
from pipeplan.tensor_parallel.styles import COLWISE, ROWWISE

__all__ = ["STYLES", "REFUSED", "library_plan", "library_styles", "matches"]

# transformers style -> pipeplan's split kind; "" splits no parameter
STYLES: dict[str, str] = {
    "colwise": COLWISE,
    "colwise_rep": COLWISE,
    "colwise_gather_output": COLWISE,
    "rowwise": ROWWISE,
    "rowwise_rep": ROWWISE,
    "rowwise_split_input": ROWWISE,
    "embedding_rowwise": ROWWISE,
    "embedding_colwise": COLWISE,
    "replicated_with_grad_allreduce": "",
    "replicate": "",
    "all_reduce": "",
    "local_params": "",
    "mla_kv_a_proj": "",
    # MoE experts (tensor parallelism inside each expert; tensor_parallel.experts): the stacked
    # gate_up weight split on its features as one block (gate and up halves not paired: the
    # output is gathered before the gating), down_proj on its input features
    "packed_colwise": COLWISE,
    "packed_rowwise": ROWWISE,
    "moe_tp_experts": "",
}

# transformers style -> why pipeplan cannot run it
REFUSED: dict[str, str] = {
    "moe_identity_expert": "pipeplan has not run the zero experts it marks (LongCat-Flash)",
    "sequence_parallel": "pipeplan runs sequence parallelism from the plan (StagePlan.sequence_parallel), not from a tensor-parallel plan's entries",
}


def library_plan(model: nn.Module) -> dict[str, str]:
    """The model's transformers plan (qualified pattern -> style); empty unless its config declares one."""
    config = getattr(model, "config", None)
    declared = getattr(config, "base_model_tp_plan", None)
    plan = getattr(model, "tp_plan", None)
    if not declared or not isinstance(plan, dict):
        return {}
    return {str(pattern): str(style) for pattern, style in plan.items()}


def library_styles(model: nn.Module, plan: dict[str, str], where: str) -> dict[str, str]:
    """Qualified module or parameter path -> COLWISE | ROWWISE for every entry that splits a parameter.

    ``InputError`` naming the entry for a style pipeplan cannot run. An entry matching no
    module of this model (a plan written for a larger config) splits nothing.
    """
    family = f"{type(model).__name__} (transformers' tensor-parallel plan)"
    for pattern, style in plan.items():
        if style in REFUSED:
            raise InputError(
                f"{where}: {family} entry {pattern!r}: {style!r} cannot run: {REFUSED[style]}; "
                f"define TP_PLAN in the model file to split the rest"
            )
        if style not in STYLES:
            raise InputError(
                f"{where}: {family} entry {pattern!r}: unknown style {style!r} (pipeplan runs "
                f"{', '.join(sorted(STYLES))})"
            )
    targets = [path for path, _ in model.named_modules() if path]
    targets += [path for path, _ in model.named_parameters()]
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        kind = STYLES[style]
        if kind:
            styles.update(dict.fromkeys((path for path in targets if matches(pattern, path)), kind))
    return styles


def matches(pattern: str, path: str) -> bool:
    """``fnmatch`` atom by atom, as transformers and ``parallelize_module`` match (``layers.*.mlp``)."""
    atoms, parts = pattern.split("."), path.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))
