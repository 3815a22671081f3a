"""``pipeplan export-weights``: one checkpoint step as one state dict the library loads.

A Hugging Face model (one with ``save_pretrained``) is written as a ``save_pretrained``
folder that ``from_pretrained`` reads; any other model as ``model.safetensors``, written
by ``safetensors.torch.save_model`` (tied tensors once) for ``load_model`` to read back.
The model is built on the meta device and materialised once on the CPU, so the export
holds one copy of the weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from pipeplan.errors import InputError, first_line
from pipeplan.modelfile import ModelFile
from pipeplan.runtime.checkpoint.pretrained import _Checkpoint, open_weights
from pipeplan.runtime.checkpoint.state import load_model_tensors
from pipeplan.runtime.checkpoint.store import step_folders

__all__ = ["export_weights", "canonical_names"]


def canonical_names(model: nn.Module) -> dict[str, str]:
    """state_dict key -> the qualified name a checkpoint saves it under (tied tensors: the first)."""
    canonical: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        canonical.setdefault(id(tensor), name)
    return {key: canonical[id(tensor)] for key, tensor in model.state_dict(keep_vars=True).items()}


def export_weights(checkpoint: str, model_file: ModelFile, out: str) -> str:
    """Write the newest complete step of ``checkpoint`` (or that step folder) to ``out``; returns the format."""
    root = Path(checkpoint)
    if root.is_dir() and not step_folders(root) and not root.name.startswith("step-"):
        raise InputError(f"checkpoint {checkpoint} holds no step-N folders of a pipeplan checkpoint")
    source = open_weights(checkpoint, label="checkpoint")
    if not isinstance(source, _Checkpoint):
        raise InputError(f"checkpoint {checkpoint} is not a pipeplan checkpoint")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InputError(f"-o {out} already exists and is not an empty folder")
    model = _materialised(model_file)
    load_model_tensors(source.index, model, canonical_names(model))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_pretrained = getattr(model, "save_pretrained", None)
        if callable(save_pretrained):
            save_pretrained(str(staging))
            kind = "save_pretrained"
        else:
            from safetensors.torch import save_model

            save_model(model, str(staging / "model.safetensors"))
            kind = "safetensors"
        if target.exists():
            target.rmdir()
        os.replace(staging, target)  # the folder appears whole or not at all
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror or first_line(exc)}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return kind


def _materialised(model_file: ModelFile) -> nn.Module:
    """The model with CPU storage for every tensor, built on meta when the file allows it."""
    try:
        with torch.device("meta"):
            model = model_file.build()
    except Exception:  # not buildable on meta: an ordinary build (initialised, then overwritten)
        return model_file.build()
    tied: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), []).append(name)
    model.to_empty(device="cpu")  # gives each module its own new parameter: tie them again
    for names in tied.values():
        for alias in names[1:]:
            owner, _, attribute = alias.rpartition(".")
            setattr(model.get_submodule(owner), attribute, model.get_parameter(names[0]))
    return model
