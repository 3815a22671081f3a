"""Which parameters a tensor-parallel stage splits: the model file's ``TP_PLAN``, transformers' plan, or built-in plans.

A plan is what torchtitan writes: module path -> ``ColwiseParallel()`` / ``RowwiseParallel()``
(Megatron's column-parallel then row-parallel linear pairs). Resolving it against the
user's model gives, per module, the dimension each parameter is split on, which depends
on the module's kind: ``nn.Linear`` keeps its weight as (out, in), Hugging Face's
``Conv1D`` (GPT-2) as (in, out), ``nn.Embedding`` as (rows, dim): column-parallel splits
the output features, row-parallel the input features (an embedding's rows: the
vocabulary-parallel embedding).

Precedence: the model file's ``TP_PLAN``; else the plan transformers declares for the model
(``tensor_parallel.library``: ``config.base_model_tp_plan``); else pipeplan's built-in plans.
Built-in plans are written per module class (GPT-2, BERT, Llama from Hugging Face, and
pipeplan's bundled GPT), so they hold wherever the blocks sit in the model. A vocabulary
-parallel embedding and head are planned only where they are not one tied tensor.
Everything here runs before any communication, so a refusal is one line on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from pipeplan.errors import InputError
from pipeplan.tensor_parallel.library import library_plan, library_styles, matches
from pipeplan.tensor_parallel.styles import COLWISE, ROWWISE

__all__ = [
    "Split",
    "FAMILIES",
    "COLWISE",
    "ROWWISE",
    "resolve_splits",
    "has_plan",
    "plan_source",
    "head_counts",
    "check_heads",
    "stage_splits",
]

# family -> {parent module class: {child path: style}}; the child is split as the style says
FAMILIES: dict[str, dict[str, dict[str, str]]] = {
    "HF GPT-2": {
        "GPT2Attention": {"c_attn": COLWISE, "c_proj": ROWWISE},
        "GPT2MLP": {"c_fc": COLWISE, "c_proj": ROWWISE},
    },
    "HF BERT": {
        "BertSelfAttention": {"query": COLWISE, "key": COLWISE, "value": COLWISE},
        "BertSelfOutput": {"dense": ROWWISE},
        "BertIntermediate": {"dense": COLWISE},
        "BertOutput": {"dense": ROWWISE},
    },
    "HF Llama": {
        "LlamaAttention": {"q_proj": COLWISE, "k_proj": COLWISE, "v_proj": COLWISE, "o_proj": ROWWISE},
        "LlamaMLP": {"gate_proj": COLWISE, "up_proj": COLWISE, "down_proj": ROWWISE},
        "LlamaModel": {"embed_tokens": ROWWISE},  # vocabulary-parallel, when not tied
        "LlamaForCausalLM": {"lm_head": COLWISE},
    },
    "pipeplan GPT": {
        "CausalSelfAttention": {"qkv": COLWISE, "proj": ROWWISE},
        "Block": {"mlp.0": COLWISE, "mlp.2": ROWWISE},
    },
}

# (style, module kind) -> {parameter: dim it is split on}; a parameter not named is replicated
_DIMS: dict[tuple[str, str], dict[str, int]] = {
    (COLWISE, "Linear"): {"weight": 0, "bias": 0},
    (ROWWISE, "Linear"): {"weight": 1},
    (COLWISE, "Conv1D"): {"weight": 1, "bias": 0},
    (ROWWISE, "Conv1D"): {"weight": 0},
    (COLWISE, "Embedding"): {"weight": 1},
    (ROWWISE, "Embedding"): {"weight": 0},
}


@dataclass(frozen=True)
class Split:
    """One plan entry's split: its module's parameters' dims (parameters not named stay whole)."""

    module: str  # qualified module path in the user's model
    style: str  # COLWISE | ROWWISE
    dims: tuple[tuple[str, int], ...]  # (parameter name, dim)


def resolve_splits(
    model: nn.Module, tp_plan: dict[str, Any] | None, degrees: set[int], where: str
) -> dict[str, Split]:
    """Qualified entry path -> ``Split`` for every module (or parameter) the plan splits; ``InputError`` on a refusal.

    ``degrees``: the plan's tensor-parallel degrees above 1; every split dimension must
    divide by each, and so must the attention heads of a known family.
    """
    styles = _styles(model, tp_plan, where)
    check_heads(model, degrees, where)
    modules = dict(model.named_modules())
    tied = _tied_parameters(model)
    splits = {}
    for path, style in styles.items():
        if path in modules:
            module_path, dims = path, _module_dims(modules[path], path, style, where)
        else:  # a parameter entry of transformers' plan (an MoE experts' stacked weight)
            module_path, _, name = path.rpartition(".")
            dims = _parameter_dims(model.get_parameter(path), name, style)
        module = modules[module_path]
        for name, dim in dims.items():
            param = getattr(module, name)
            if f"{module_path}.{name}" in tied:
                raise InputError(
                    f"{where}: the tensor-parallel plan splits {module_path}.{name}, which is tied to "
                    f"{tied[f'{module_path}.{name}']}; leave tied parameters whole"
                )
            for t in sorted(degrees):
                if param.shape[dim] % t:
                    raise InputError(
                        f"{where}: tensor_parallel {t} does not divide {module_path}.{name}'s dimension "
                        f"{dim} ({param.shape[dim]}), which the plan splits {style}"
                    )
        splits[path] = Split(module_path, style, tuple(dims.items()))
    return splits


def _styles(model: nn.Module, tp_plan: dict[str, Any] | None, where: str) -> dict[str, str]:
    """Path -> COLWISE | ROWWISE from the plan that applies (module docstring's precedence)."""
    if tp_plan is not None:
        return _user_styles(model, tp_plan, where)
    library = library_plan(model)
    if library:
        return _untied(model, library_styles(model, library, where))
    styles = _builtin_styles(model)
    if not styles:
        raise InputError(no_plan_message(model, where))
    return styles


def _module_dims(module: nn.Module, path: str, style: str, where: str) -> dict[str, int]:
    kind = _kind(module)
    if (style, kind) not in _DIMS:
        raise InputError(
            f"{where}: the tensor-parallel plan splits {path} ({type(module).__name__}) "
            f"{style}; only nn.Linear, nn.Embedding and Hugging Face Conv1D modules split"
        )
    return {
        name: dim for name, dim in _DIMS[(style, kind)].items() if getattr(module, name, None) is not None
    }


def _parameter_dims(param: nn.Parameter, name: str, style: str) -> dict[str, int]:
    """A parameter entry's dim, as transformers shards one: column-parallel on its output
    features (dim ndim - 2; a vector's only dim), row-parallel on its input features (the
    last dim; a vector, a bias, stays whole)."""
    if style == COLWISE:
        return {name: max(param.dim() - 2, 0)}
    return {name: param.dim() - 1} if param.dim() >= 2 else {}


def _untied(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """``styles`` without the entries holding a tied parameter (a tied embedding and head stay whole)."""
    tied = _tied_parameters(model)
    params = dict(model.named_parameters())
    kept = {}
    for path, style in styles.items():
        names = [path] if path in params else [f"{path}.{n}" for n in ("weight", "bias")]
        if not any(name in tied for name in names):
            kept[path] = style
    return kept


def has_plan(model: nn.Module, tp_plan: dict[str, Any] | None) -> bool:
    """Whether ``resolve_splits`` has a plan to resolve: ``TP_PLAN``, transformers' plan or a built-in one."""
    return plan_source(model, tp_plan) != ""


def plan_source(model: nn.Module, tp_plan: dict[str, Any] | None) -> str:
    """Which plan splits ``model``: "TP_PLAN", "transformers", "built-in", or "" (none)."""
    if tp_plan is not None:
        return "TP_PLAN"
    if library_plan(model):
        return "transformers"
    return "built-in" if _builtin_styles(model) else ""


def no_plan_message(model: nn.Module, where: str) -> str:
    """The one-line refusal for a model without a plan: its family, and a ``TP_PLAN`` sketched
    from its own module names (linear layers of its repeated blocks)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = type(model).__name__ + (f" (transformers family {model_type!r})" if model_type else "")
    declared = (
        "transformers declares no tensor-parallel plan for it (config.base_model_tp_plan is empty), "
        if model_type
        else ""
    )
    sketch = _sketch(model)
    example = (
        f"e.g. TP_PLAN = {{{sketch}}} (ColwiseParallel, RowwiseParallel from "
        f"torch.distributed.tensor.parallel; check each pair: a column-parallel module's output "
        f"feeds the row-parallel one)"
        if sketch
        else "naming its nn.Linear modules ColwiseParallel() then RowwiseParallel() in pairs"
    )
    return (
        f"{where}: {family} has no tensor-parallel plan: {declared}pipeplan has no built-in plan "
        f"for it (built in: {', '.join(FAMILIES)}); define TP_PLAN in the model file, {example}"
    )


_ROW_NAMES = (
    "o_proj",
    "out_proj",
    "down_proj",
    "dense",
    "fc2",
    "c_proj",
    "wo",
    "w2",
    "proj",
    "dense_4h_to_h",
)


def _sketch(model: nn.Module, limit: int = 6) -> str:
    """``"pattern": Style()`` entries for the model's linear layers, a block's number as ``*``.

    A name that ends a block (``o_proj``, ``down_proj``, ...) is row-parallel, its siblings
    column-parallel; where no sibling has such a name they alternate, column then row.
    """
    children: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            atoms = path.split(".")
            parent = ".".join("*" if atom.isdigit() else atom for atom in atoms[:-1])
            names = children.setdefault(parent, [])
            if atoms[-1] not in names:
                names.append(atoms[-1])
    entries = []
    for parent, names in children.items():
        named_rows = any(name in _ROW_NAMES for name in names)
        for k, name in enumerate(names):
            row = name in _ROW_NAMES if named_rows else k % 2 == 1
            pattern = f"{parent}.{name}" if parent else name
            entries.append(f"{pattern!r}: {'Row' if row else 'Col'}wiseParallel()")
    return ", ".join(entries[:limit])


def check_heads(model: nn.Module, degrees: set[int], where: str) -> None:
    """``InputError`` when a degree does not divide the attention (or key/value) heads."""
    heads = head_counts(model)
    for t in sorted(degrees):
        for name, count in heads.items():
            if count % t:
                raise InputError(
                    f"{where}: tensor_parallel {t} does not divide the model's {count} attention "
                    f"heads ({name}); choose a degree dividing {count}"
                )


def head_counts(model: nn.Module) -> dict[str, int]:
    """The model's attention head counts by attribute name (config or bundled GPT); a degree must divide each."""
    heads: dict[str, int] = {}
    config = getattr(model, "config", None)
    for name in ("num_attention_heads", "n_head", "num_key_value_heads"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            heads[name] = value
    for module in model.modules():
        count = getattr(module, "heads", None)
        if type(module).__name__ == "CausalSelfAttention" and isinstance(count, int):
            heads["heads"] = count
    return heads


def _builtin_styles(model: nn.Module) -> dict[str, str]:
    tied = _tied_parameters(model)
    styles: dict[str, str] = {}
    for family in FAMILIES.values():
        for parent_path, parent in model.named_modules():
            children = family.get(type(parent).__name__)
            if not children:
                continue
            for child, style in children.items():
                path = f"{parent_path}.{child}" if parent_path else child
                try:
                    module = model.get_submodule(path)
                except AttributeError:
                    continue
                if any(f"{path}.{name}" in tied for name, _ in module.named_parameters(recurse=False)):
                    continue  # a tied embedding and head stay whole
                styles[path] = style
    return styles


def _user_styles(model: nn.Module, tp_plan: dict[str, Any], where: str) -> dict[str, str]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    paths = [path for path, _ in model.named_modules() if path]
    styles: dict[str, str] = {}
    for pattern, style in tp_plan.items():
        if isinstance(style, ColwiseParallel):
            kind = COLWISE
        elif isinstance(style, RowwiseParallel):
            kind = ROWWISE
        elif _is_layout_hint(style):
            kind = ""  # activations keep DTensor layouts of their own (see tensor_parallel.apply)
        else:
            raise InputError(
                f"{where}: TP_PLAN[{pattern!r}] is {type(style).__name__}; pipeplan splits with "
                f"ColwiseParallel and RowwiseParallel (SequenceParallel and PrepareModule* are "
                f"accepted as layout hints)"
            )
        matched = [p for p in paths if matches(pattern, p)]
        if not matched:
            raise InputError(
                f"{where}: TP_PLAN names {pattern!r}, which is no module of {type(model).__name__}"
            )
        if kind:
            styles.update(dict.fromkeys(matched, kind))
    return styles


def _is_layout_hint(style: object) -> bool:
    """A style that only places activations (it splits no parameter): torchtitan's plans
    use them around attention and norms; a split stage keeps DTensor's own layouts."""
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        SequenceParallel,
    )

    return isinstance(
        style, (PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput, SequenceParallel)
    )


def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "Linear"
    if isinstance(module, nn.Embedding):
        return "Embedding"
    return type(module).__name__  # "Conv1D" for Hugging Face's GPT-2 projections


def _tied_parameters(model: nn.Module) -> dict[str, str]:
    """Every name of a parameter held under several names -> one of its other names."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {
        name: next(other for other in group if other != name)
        for group in names.values()
        if len(group) > 1
        for name in group
    }


def stage_splits(parameter_names: dict[str, str], splits: dict[str, Split]) -> dict[str, dict[str, int]]:
    """A stage's share of ``splits``: local module path -> {parameter: dim}.

    ``parameter_names`` maps the stage module's parameter names to qualified ones.
    """
    local_of = {qualified: local for local, qualified in parameter_names.items()}
    out: dict[str, dict[str, int]] = {}
    for split in splits.values():
        for name, dim in split.dims:
            local_name = local_of.get(f"{split.module}.{name}")
            if local_name is not None:
                module_path, _, param = local_name.rpartition(".")
                out.setdefault(module_path, {})[param] = dim
    return out
