"""The model file contract: a plain Python file the user writes.

Required names::

    def build_model() -> torch.nn.Module
    def sample_batch(batch_size: int) -> tuple[inputs, targets]
    # inputs: a Tensor, a tuple (positional) or a dict of keyword arguments (model(**inputs));
    # values are Tensors, None or constants (pipeplan.model_inputs)

Optional names::

    def loss_fn(output, target) -> Tensor        # output: what the model returns; default: default_loss
    def data_loader(batch_size, replica, replicas) -> Iterator[tuple[inputs, targets]]
    LEAF_MODULES = ["GPT2Block", ...]            # module classes kept whole as one layer each
    OPAQUE_MODULES = ["MyRouter", ...]           # module classes run as themselves, never traced into
    def make_optimizer(params) -> torch.optim.Optimizer  # params: the rank's parameters as named
                                                 # groups ("decay", "no_decay": biases and norms,
                                                 # weight_decay 0), each with "param_names"
    def make_lr_scheduler(optimizer) -> LR scheduler  # stepped once per training step
    TP_PLAN = {"layers.*.attention.wq": ColwiseParallel(), ...}  # tensor parallelism (torchtitan style)

Every failure (missing file, import error, missing name, a name that is not callable)
raises ``InputError`` with a one-line message.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeplan.errors import InputError, one_line
from pipeplan.model_inputs import ModelInputs, model_inputs

if TYPE_CHECKING:  # typing only: torch is imported where it is used
    import torch

__all__ = [
    "BUNDLED_MODELS",
    "ModelFile",
    "load_model_file",
    "default_loss",
    "output_logits",
    "parse_leaf_modules",
    "bundled_model_path",
    "resolve_model_path",
]

BUNDLED_MODELS = ("mlp", "vgg", "resnet", "gpt")  # configs/models/<name>.py


def default_loss(output: object, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer targets (class ids), mean squared error otherwise.

    The logits are ``output.logits`` when the output has them (a Hugging Face
    ``ModelOutput``), else the first tensor in it (a tuple, dict or dataclass). Shapes:
    (batch, classes) with (batch,) targets; (batch, seq, vocab) with (batch, seq) targets
    (flattened to tokens); (batch, classes, d1, ...) with (batch, d1, ...) targets
    (segmentation: ``F.cross_entropy`` takes them as they are).
    """
    import torch.nn.functional as F

    logits = output_logits(output)
    if not target.is_floating_point():
        language_model = logits.dim() == 3 and target.dim() == 2 and logits.shape[:2] == target.shape
        if language_model:  # (batch, seq, vocab) -> (batch*seq, vocab)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        return F.cross_entropy(logits, target)
    return F.mse_loss(logits, target)


def output_logits(output: object) -> torch.Tensor:
    """``output.logits`` if present, else the first tensor in ``output``; InputError if none."""
    import torch
    from torch.utils import _pytree as pytree

    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        output = [getattr(output, f.name) for f in dataclasses.fields(output)]
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise InputError(
        f"the model returned {type(output).__name__} with no tensor in it; "
        f"define loss_fn(output, target) in the model file"
    )


@dataclass(frozen=True)
class ModelFile:
    path: str
    build_model: Callable[[], Any]
    sample_batch: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], Any]
    data_loader: Callable[[int, int, int], Iterator[Any]] | None
    leaf_modules: tuple[str, ...] = ()  # LEAF_MODULES: class names whose calls are one layer each
    make_optimizer: Callable[[Any], Any] | None = None  # (named parameter groups) -> torch optimizer
    make_lr_scheduler: Callable[[Any], Any] | None = None  # (optimizer) -> LR scheduler
    # TP_PLAN: module path pattern -> torch ParallelStyle, as torchtitan writes them (None: built-in plans)
    tp_plan: dict[str, Any] | None = None
    opaque_modules: tuple[str, ...] = ()  # OPAQUE_MODULES: class names run as themselves (opaque layers)

    def batch(self, batch_size: int, seed: int) -> tuple[ModelInputs, object]:
        """``sample_batch(batch_size)`` with the CPU generator seeded by ``seed``, inputs as
        ``ModelInputs``.

        The CPU generator's state is restored afterwards, so drawing a batch never perturbs
        anything else (model init, dropout); ``sample_batch`` draws on the CPU.
        """
        import torch

        with torch.random.fork_rng(devices=[]):
            # the CPU generator alone: torch.manual_seed also queues a seed for every lazy
            # device (CUDA, XPU, MTIA), formatting the caller's stack each time, ~0.3 ms a
            # minibatch on a rank's critical path where no GPU is in use (issue 31)
            torch.random.default_generator.manual_seed(seed)
            try:
                inputs, targets = self.sample_batch(batch_size)
            except Exception as exc:  # the user's code: report it in one line
                raise InputError(f"{self.path}: sample_batch({batch_size}) raised {one_line(exc)}") from exc
        return model_inputs(inputs, self.path), targets

    def build(self) -> torch.nn.Module:
        import torch

        try:
            model = self.build_model()
        except Exception as exc:
            raise InputError(f"{self.path}: build_model() raised {one_line(exc)}") from exc
        if not isinstance(model, torch.nn.Module):
            raise InputError(
                f"{self.path}: build_model() returned {type(model).__name__}, expected a torch.nn.Module"
            )
        return model


def load_model_file(path: str | os.PathLike[str]) -> ModelFile:
    """Import the user's model file and check its names."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"model file {str(path)!r} does not exist")
    module_name = f"pipeplan_user_model_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise InputError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses / pickling inside the file need it
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        line = _user_line(exc, file)
        raise InputError(f"{path}{line}: cannot import: {one_line(exc)}") from exc
    names: dict[str, Any] = {}
    for name, required in (
        ("build_model", True),
        ("sample_batch", True),
        ("loss_fn", False),
        ("data_loader", False),
        ("make_optimizer", False),
        ("make_lr_scheduler", False),
    ):
        value = getattr(module, name, None)
        if value is None:
            if required:
                raise InputError(f"{path}: defines no {name}() (required by the model file contract)")
            continue
        if not callable(value):
            raise InputError(f"{path}: {name} is {type(value).__name__}, expected a function")
        names[name] = value
    return ModelFile(
        path=str(path),
        build_model=names["build_model"],
        sample_batch=names["sample_batch"],
        loss_fn=names.get("loss_fn", default_loss),
        data_loader=names.get("data_loader"),
        leaf_modules=_leaf_modules(getattr(module, "LEAF_MODULES", ()), path),
        make_optimizer=names.get("make_optimizer"),
        make_lr_scheduler=names.get("make_lr_scheduler"),
        tp_plan=_tp_plan(getattr(module, "TP_PLAN", None), path),
        opaque_modules=_leaf_modules(getattr(module, "OPAQUE_MODULES", ()), path, "OPAQUE_MODULES"),
    )


def _tp_plan(value: object, path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``TP_PLAN`` as a dict of module path patterns to styles (checked by the runtime)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise InputError(
            f"{path}: TP_PLAN is {type(value).__name__}, expected a dict of module path patterns "
            f"to torch.distributed.tensor.parallel styles"
        )
    return dict(value)


def _leaf_modules(value: object, path: str | os.PathLike[str], what: str = "LEAF_MODULES") -> tuple[str, ...]:
    """``LEAF_MODULES`` (or ``OPAQUE_MODULES``) as a tuple of class names (strings, or the classes themselves)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise InputError(f"{path}: {what} is {type(value).__name__}, expected a list of module class names")
    names = []
    for item in value:
        name = item if isinstance(item, str) else getattr(item, "__name__", None)
        if not isinstance(name, str) or not name:
            raise InputError(f"{path}: {what} holds {item!r}, expected a module class name")
        names.append(name)
    return tuple(names)


def parse_leaf_modules(text: str | None) -> tuple[str, ...]:
    """``"GPT2Block, LlamaDecoderLayer"`` -> ``("GPT2Block", "LlamaDecoderLayer")``."""
    if not text:
        return ()
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _user_line(exc: BaseException, file: Path) -> str:
    """':<line>' of the deepest frame inside the user's file, or '' when none."""
    line = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == file.resolve():
            line = f":{frame.lineno}"
    if not line and isinstance(exc, SyntaxError) and exc.lineno:
        line = f":{exc.lineno}"
    return line


def bundled_model_path(name: str) -> str:
    """Path of a bundled example model (``mlp``, ``vgg``, ``resnet``, ``gpt``) in pipeplan.configs.models."""
    from importlib import resources

    candidate = resources.files("pipeplan.configs.models") / f"{name}.py"
    if not candidate.is_file():
        raise InputError(f"no bundled model named {name!r}")
    return str(candidate)


def resolve_model_path(model: str | os.PathLike[str]) -> str:
    """A model file path, or the path of the bundled model named ``model`` (mlp, vgg, resnet, gpt)."""
    text = str(model)
    if Path(text).is_file():
        return text
    if text in BUNDLED_MODELS:
        return bundled_model_path(text)
    raise InputError(
        f"model file {text!r} does not exist (nor is it a bundled model: {', '.join(BUNDLED_MODELS)})"
    )
