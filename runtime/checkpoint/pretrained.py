"""``run --weights PATH``: a rank copies only its stage's tensors from pretrained weights.

PATH is one of:

- a Hugging Face checkpoint folder (``save_pretrained``): ``model.safetensors``, or shards
  listed by ``model.safetensors.index.json``; or a single ``.safetensors`` file;
- a checkpoint folder of pipeplan's own (its newest complete step), or one ``step-N`` folder.

Tensors are found by the user's model's qualified names. A library saves a tied weight
once, under one of its names (GPT-2 keeps ``transformer.wte.weight`` and drops
``lm_head.weight``), so each name is also looked up under every other name of the same
tensor in the model (``tie_aliases``, from ``named_parameters(remove_duplicate=False)``):
each stage holding a tied weight loads it from that one saved tensor. A parameter that
transformers merges when it loads (an MoE layer's experts, saved one tensor per expert) is
made from its saved pieces as transformers makes it (``hf_conversion``). safetensors'
``safe_open`` and DCP both read one tensor at a time, so a rank reads its stage's bytes only
(a rank of a tensor-parallel stage reads each tensor whole and keeps its shard).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from pipeplan.errors import InputError, first_line
from pipeplan.modelfile import ModelFile
from pipeplan.runtime.checkpoint.hf_conversion import Conversion, convert, library_conversions
from pipeplan.runtime.checkpoint.split import copy_whole
from pipeplan.runtime.checkpoint.state import CheckpointIndex
from pipeplan.runtime.checkpoint.store import latest_complete_step, step_folders, step_problem

__all__ = ["load_weights", "library_layout", "tie_aliases", "open_weights"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def tie_aliases(model_file: ModelFile) -> dict[str, tuple[str, ...]]:
    """Qualified name -> every name of the same tensor in the model (built on the meta device).

    A model file that cannot be built on the meta device gets no aliases (names must
    then match exactly).
    """
    try:
        with torch.device("meta"):
            model = model_file.build()
    except Exception:  # not buildable on meta: exact names only
        return {}
    groups: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        groups.setdefault(id(tensor), []).append(name)
    return {names[0]: tuple(names) for names in groups.values() if len(names) > 1}


class _Safetensors:
    """Tensors of one or more safetensors files, read lazily by name."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files  # tensor name -> file holding it

    @classmethod
    def of(cls, path: Path) -> _Safetensors:
        from safetensors import safe_open

        if path.is_dir() and (path / _INDEX).is_file():
            try:
                weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise InputError(
                    f"--weights {path / _INDEX} is not a safetensors index: {first_line(exc)[:120]}"
                ) from exc
            return cls({name: path / shard for name, shard in weight_map.items()})
        single = path / _SINGLE if path.is_dir() else path
        try:
            with safe_open(str(single), framework="pt", device="cpu") as handle:
                return cls(dict.fromkeys(handle.keys(), single))
        except Exception as exc:
            raise InputError(
                f"--weights {single} cannot be read as safetensors: {first_line(exc)[:120]}"
            ) from exc

    def shape(self, name: str) -> tuple[int, ...]:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt", device="cpu") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        tensors = {}
        for file, part in by_file.items():
            try:
                with safe_open(str(file), framework="pt", device="cpu") as handle:
                    tensors.update({name: handle.get_tensor(name) for name in part})
            except Exception as exc:
                raise InputError(f"--weights {file} cannot be read: {first_line(exc)[:120]}") from exc
        return tensors


class _Checkpoint:
    """The model tensors of one verified step of a pipeplan checkpoint."""

    def __init__(self, index: CheckpointIndex) -> None:
        self.index = index
        self.files = {key[len("model/") :]: key for key in index.entries if key.startswith("model/")}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.index.entries[self.files[name]][1].size)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        targets = {self.files[name]: self.index.empty_like_saved(self.files[name]) for name in names}
        self.index.load(targets)
        return {name: targets[self.files[name]] for name in names}


def open_weights(path: str, label: str = "--weights") -> _Safetensors | _Checkpoint:
    """The weights at ``path`` (see the module docstring); ``InputError`` in one line otherwise.

    ``label`` names ``path`` in errors (the option or argument it came from).
    """
    root = Path(path)
    if not root.exists():
        raise InputError(f"{label} {path} does not exist")
    if root.is_dir() and step_folders(root):
        step, skipped = latest_complete_step(root, run_fingerprint=None)
        if step is None:
            reason = f" (step {skipped[0][0]}: {skipped[0][1]})" if skipped else ""
            raise InputError(f"{label} {path} holds no complete checkpoint step{reason}")
        return _Checkpoint(CheckpointIndex.of_step(str(root), step))
    if root.is_dir() and root.name.startswith("step-") and not (root / _SINGLE).exists():
        step = int(root.name[len("step-") :])
        problem = step_problem(root.parent, step, run_fingerprint=None)
        if problem is not None:
            raise InputError(f"{label} {path} is not a complete checkpoint step: {problem}")
        return _Checkpoint(CheckpointIndex.of_step(str(root.parent), step))
    if root.is_dir() and not (root / _INDEX).is_file() and not (root / _SINGLE).is_file():
        raise InputError(f"{label} {path} holds neither {_SINGLE}, {_INDEX} nor pipeplan checkpoint steps")
    return _Safetensors.of(root)


def _stored_per_module(name: str, saved: Iterable[str]) -> str | None:
    """A saved name under ``name``'s module with a numbered child (``experts.0.gate_proj.weight``
    for the model's ``experts.gate_up_proj``): the library's per-module layout; None if none."""
    prefix = name.rsplit(".", 1)[0] + "."
    return next(
        (
            key
            for key in sorted(saved)
            if key.startswith(prefix) and key[len(prefix) :].split(".")[0].isdigit()
        ),
        None,
    )


def library_layout(model_file: ModelFile, path: str) -> dict[str, Conversion]:
    """The parameters transformers would merge from the weights at ``path`` (MoE experts saved
    one per expert; ``hf_conversion``), by qualified name; {} where nothing is merged or the
    model cannot be built on the meta device."""
    source = open_weights(path)
    if not isinstance(source, _Safetensors):
        return {}  # a pipeplan checkpoint holds the model's own names
    try:
        with torch.device("meta"):
            model = model_file.build()
    except Exception:  # not buildable on meta: exact names only
        return {}
    return library_conversions(model, source.files)


def load_weights(
    path: str,
    module: nn.Module,
    names: dict[str, str],
    aliases: dict[str, tuple[str, ...]],
    conversions: dict[str, Conversion] | None = None,
) -> int:
    """Copy this rank's tensors from ``path`` into ``module``; returns how many were read.

    ``names``: ``module`` state_dict key -> qualified name. Every parameter must be found
    (under its name or a tied alias, or made by one of ``conversions`` from the saved pieces)
    with its shape; buffers absent from the weights keep their initial values (a library may
    not save computed buffers).
    """
    source = open_weights(path)
    targets = dict(module.state_dict(keep_vars=True))
    parameters = {local for local, _ in module.named_parameters(remove_duplicate=False)}
    chosen: dict[str, list[torch.Tensor]] = {}  # saved name -> the tensors it fills
    merged = 0
    missing = []
    for local, qualified in names.items():
        saved = next((n for n in aliases.get(qualified, (qualified,)) if n in source.files), None)
        if saved is None and conversions and qualified in conversions:
            _load_converted(path, source, conversions[qualified], targets[local])
            merged += 1
            continue
        if saved is None:
            if local in parameters:
                missing.append(qualified)
            continue
        tensor = targets[local]
        if source.shape(saved) != tuple(tensor.shape):
            raise InputError(
                f"--weights {path}: {saved} has shape {list(source.shape(saved))}, "
                f"the model's {qualified} is {list(tensor.shape)}"
            )
        holders = chosen.setdefault(saved, [])
        if all(t is not tensor for t in holders):
            holders.append(tensor)
    if missing:
        stored_apart = next(
            ((name, key) for name in missing if (key := _stored_per_module(name, source.files))), None
        )
        if stored_apart is not None:
            raise InputError(
                f"--weights {path} stores {stored_apart[0]} as one tensor per module ({stored_apart[1]}, ...), which "
                f"transformers merges when it loads (MoE experts); pipeplan reads tensors by the model's names: "
                f"load the folder with from_pretrained, write it with safetensors.torch.save_model(model, FILE) "
                f"and pass FILE"
            )
        raise InputError(
            f"--weights {path} has no tensor {missing[0]} ({len(missing)} of this stage's "
            f"parameters are missing); are these the weights of this model?"
        )
    loaded = source.read(sorted(chosen))
    for saved, holders in chosen.items():
        for tensor in holders:
            copy_whole(tensor, loaded[saved])  # a split parameter: this rank's shard
    return len(loaded) + merged


def _load_converted(
    path: str, source: _Safetensors | _Checkpoint, conversion: Conversion, tensor: torch.Tensor
) -> None:
    """Fill ``tensor`` with the parameter transformers makes from its saved pieces."""
    value = convert(conversion, source.read(list(conversion.sources)))
    if tuple(value.shape) != tuple(tensor.shape):
        raise InputError(
            f"--weights {path}: {conversion.sources[0]} and {len(conversion.sources) - 1} more merge "
            f"into shape {list(value.shape)}, the model's {conversion.target} is {list(tensor.shape)}"
        )
    copy_whole(tensor, value)
