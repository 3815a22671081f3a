"""A rank's training state as flat, qualified-name keys, and back from any plan's step.

Keys of what one rank saves (``rank_state``)::

    model/<qualified name>             parameters and persistent buffers (replica 0 only)
    optim/<qualified name>/<key>       optimizer state of that parameter (exp_avg, step, ...)
    lr_scheduler                       the LR scheduler's state_dict (torch.save bytes)
    rng                                this rank's torch RNG state
    rng/tensor-<j>                     the RNG state of rank j of its tensor-parallel group (j >= 1)
    data/replica-<r>                   data loader r's state (a stateful loader; every rank reading it)

Every tensor is saved whole, also where a tensor-parallel stage holds it split: the
group's ranks gather it and its first rank writes it (``pipeplan.runtime.checkpoint.split``);
a rank loading it keeps its own shard.

Qualified names are the user's model's (``StageModule.parameter_names``), so a run under
another plan (other stages, replicas, schedule, world size) finds each of its tensors in
whichever rank folder of the step holds it (``CheckpointIndex``), and its optimizer
state moves with the parameter. Each rank reads only the keys it needs: DCP reads them
by offset, never a whole file.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from pipeplan.errors import InputError, first_line
from pipeplan.runtime.checkpoint.split import copy_whole, shard_like, whole
from pipeplan.runtime.checkpoint.store import rank_folder, read_manifests

if TYPE_CHECKING:  # types only: importing the stage (and capture) is not needed to read checkpoints
    from pipeplan.runtime.stage import PipelineSpec

__all__ = [
    "CheckpointIndex",
    "rank_state",
    "restore_rank",
    "load_model_tensors",
    "restore_rng",
    "rank_state_names",
    "rng_key",
    "SCHEDULER_KEY",
    "loader_keys",
    "read_loader_states",
]

SCHEDULER_KEY = "lr_scheduler"
_MODEL = "model/"
_OPTIM = "optim/"
_DATA = "data/replica-"


class CheckpointIndex:
    """Which rank folder of one verified step holds each key, with its saved shape and dtype."""

    def __init__(self, folders: Iterable[Path]) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.entries: dict[str, tuple[Path, Any]] = {}
        self.holders: dict[str, list[Path]] = {}  # every folder holding the key, in folder order
        for folder in folders:
            try:
                metadata = FileSystemReader(str(folder)).read_metadata()
            except Exception as exc:  # a verified folder DCP cannot read: say which, in one line
                raise InputError(f"checkpoint {folder} cannot be read: {first_line(exc)[:160]}") from exc
            for key, entry in metadata.state_dict_metadata.items():
                self.entries.setdefault(key, (folder, entry))
                self.holders.setdefault(key, []).append(folder)

    @classmethod
    def of_step(cls, directory: str, step: int) -> CheckpointIndex:
        return cls(
            rank_folder(directory, step, stage, replica)
            for stage, replica in sorted(read_manifests(directory, step))
        )

    def load(self, targets: dict[str, Any], folder: Path | None = None) -> None:
        """Fill ``targets`` (key -> tensor or ``io.BytesIO``) from the folders holding them
        (from ``folder`` when given)."""
        import torch.distributed.checkpoint as dcp

        by_folder: dict[Path, dict[str, Any]] = {}
        for key, target in targets.items():
            by_folder.setdefault(folder or self.entries[key][0], {})[key] = target
        for folder, part in by_folder.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # single-process read: intended
                try:
                    dcp.load(part, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
                except Exception as exc:
                    raise InputError(f"checkpoint {folder} cannot be read: {first_line(exc)[:160]}") from exc
            targets.update(part)  # DCP replaces saved bytes by a new buffer in ``part``

    def empty_like_saved(self, key: str) -> Any:
        """A tensor of the saved shape and dtype (or a buffer for saved bytes) to load ``key`` into."""
        entry = self.entries[key][1]
        if hasattr(entry, "size"):
            return torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        return io.BytesIO()


def rank_state_names(spec: PipelineSpec) -> dict[str, str]:
    """``spec.rank_module`` state_dict key -> qualified name (parameters and persistent buffers)."""
    names: dict[str, str] = {}
    for c, chunk in enumerate(spec.chunks):
        prefix = f"{c}." if spec.virtual_stages > 1 else ""
        for local, qualified in [*chunk.parameter_names.items(), *chunk.buffer_names.items()]:
            names[prefix + local] = qualified
    return names


def rng_key(tp_index: int) -> str:
    """The key of the RNG state of rank ``tp_index`` of a tensor-parallel group (``rng`` for the first)."""
    return "rng" if tp_index == 0 else f"rng/tensor-{tp_index}"


def rank_state(
    module: nn.Module,
    names: dict[str, str],
    optimizer: torch.optim.Optimizer | None,
    scheduler: LRScheduler | None = None,
    weights: bool = True,
    keep: bool = True,
    own_state: bool = False,
) -> dict[str, Any]:
    """This rank's state under qualified names (``names``: state_dict key -> qualified name).

    ``weights=False`` (replicas after the first: they hold the same tensors) saves the RNG
    only, and with ``own_state`` also ``optimizer``'s state (a sharded optimizer's share:
    each replica holds the state of its own parameters, ``pipeplan.runtime.sharding``).
    A split (DTensor) tensor is gathered whole, one at a time: every rank of its
    tensor-parallel group must call this, in the same order; ``keep=False`` (every rank
    of the group but the writer) drops each gathered tensor at once and returns the RNG only.
    """
    state: dict[str, Any] = {"rng": torch.get_rng_state()}
    if not weights and not own_state:
        return state

    def put(key: str, value: object) -> None:  # a tensor, or an optimizer state's other values
        value = whole(value)  # collective for a DTensor
        if keep:
            state[key] = value

    if weights:
        tensors = module.state_dict()
        for local, qualified in names.items():
            put(_MODEL + qualified, tensors[local])
    if optimizer is not None:
        qualified_of = _optimizer_names(module, names, optimizer)
        for index, values in optimizer.state_dict()["state"].items():
            for key, value in values.items():
                put(
                    f"{_OPTIM}{qualified_of[index]}/{key}", value if torch.is_tensor(value) else _bytes(value)
                )
    if scheduler is not None and keep and weights:
        state[SCHEDULER_KEY] = _bytes(scheduler.state_dict())
    return state


def restore_rank(
    index: CheckpointIndex,
    module: nn.Module,
    names: dict[str, str],
    optimizer: torch.optim.Optimizer | None,
    scheduler: LRScheduler | None = None,
) -> None:
    """Load this rank's weights, optimizer and scheduler state from ``index`` (any plan's step)."""
    load_model_tensors(index, module, names)
    if optimizer is not None:
        _restore_optimizer(index, module, names, optimizer)
    if scheduler is not None and SCHEDULER_KEY in index.entries:
        groups = len(optimizer.param_groups) if optimizer is not None else None
        scheduler.load_state_dict(_scheduler_state(index, groups))


def restore_rng(folder: Path, tp_index: int = 0) -> None:
    """This rank's RNG as it was saved in ``folder`` (same plan: dropout continues as it would);
    ``tp_index``: the rank's index in its tensor-parallel group."""
    index = CheckpointIndex([folder])
    key = rng_key(tp_index)
    if key in index.entries:
        rng = index.empty_like_saved(key)
        index.load({key: rng})
        torch.set_rng_state(rng)


def load_model_tensors(index: CheckpointIndex, module: nn.Module, names: dict[str, str]) -> None:
    """Copy ``model/<qualified>`` into every tensor of ``module``'s state (InputError if absent);
    a split (DTensor) parameter keeps its shard of the whole saved tensor."""
    targets = dict(module.state_dict(keep_vars=True))
    wanted: dict[str, torch.Tensor] = {}
    for local, qualified in names.items():
        tensor = targets[local]
        key = _MODEL + qualified
        if key not in index.entries:
            raise InputError(f"the checkpoint has no weight {qualified}")
        saved = tuple(index.entries[key][1].size)
        if saved != tuple(tensor.shape):
            raise InputError(
                f"checkpoint weight {qualified} has shape {list(saved)}, the model's is {list(tensor.shape)}"
            )
        wanted.setdefault(key, tensor)  # a tensor under two local names (tied) loads once
    loaded = {key: index.empty_like_saved(key) for key in wanted}
    index.load(loaded)
    for key, tensor in wanted.items():
        copy_whole(tensor, loaded[key])


def _restore_optimizer(
    index: CheckpointIndex, module: nn.Module, names: dict[str, str], optimizer: torch.optim.Optimizer
) -> None:
    keys_of: dict[str, list[str]] = {}
    for key in index.entries:
        if key.startswith(_OPTIM):
            qualified, _, name = key[len(_OPTIM) :].rpartition("/")
            keys_of.setdefault(qualified, []).append(name)
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    targets: dict[str, Any] = {}
    for qualified in _optimizer_names(module, names, optimizer).values():
        for name in keys_of.get(qualified, ()):
            targets[f"{_OPTIM}{qualified}/{name}"] = index.empty_like_saved(f"{_OPTIM}{qualified}/{name}")
    index.load(targets)
    for position, qualified in _optimizer_names(module, names, optimizer).items():
        values = {
            name: shard_like(params[position], _unwrap(targets[f"{_OPTIM}{qualified}/{name}"]))
            for name in keys_of.get(qualified, ())
        }  # a split parameter's states: its placements
        if values:
            state["state"][position] = values
    try:
        optimizer.load_state_dict(state)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise InputError(f"the checkpoint's optimizer state does not fit: {first_line(exc)[:160]}") from exc


def _optimizer_names(
    module: nn.Module, names: dict[str, str], optimizer: torch.optim.Optimizer
) -> dict[int, str]:
    """Optimizer state index (parameters numbered across param groups) -> qualified name."""
    local_of = {id(p): local for local, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {position: names[local_of[id(p)]] for position, p in enumerate(params)}


def _load_object(index: CheckpointIndex, key: str, folder: Path | None = None) -> Any:
    targets = {key: index.empty_like_saved(key)}
    index.load(targets, folder)  # replaces the placeholder buffer with the saved bytes
    return _unwrap(targets[key])


def _scheduler_state(index: CheckpointIndex, groups: int | None) -> dict[str, Any]:
    """A saved LR-scheduler state for an optimizer of ``groups`` param groups.

    Schedulers keep per-group lists (``base_lrs``, ``_last_lr``, LambdaLR's ``_lr_lambdas``).
    Under another plan a stage may hold another number of groups (pipeplan's decay /
    no_decay groups leave empty ones out): a state saved with as many groups is taken;
    else per-group lists whose entries are all equal (one curve for every group) are
    resized; a state whose groups differ cannot be mapped and is refused in one line.
    """
    states = [_load_object(index, SCHEDULER_KEY, folder) for folder in index.holders[SCHEDULER_KEY]]
    saved = [len(state["base_lrs"]) if isinstance(state.get("base_lrs"), list) else None for state in states]
    for state, count in zip(states, saved):
        if groups is None or count is None or count == groups:
            return state
    assert groups is not None
    state, count = dict(states[0]), saved[0]
    for key, value in state.items():
        if isinstance(value, list) and len(value) == count:
            if any(item != value[0] for item in value):
                raise InputError(
                    f"the checkpoint's LR scheduler has {count} param groups with different "
                    f"{key.lstrip('_')}, this stage's optimizer has {groups}; no saved stage matches"
                )
            state[key] = [value[0]] * groups
    return state


def _unwrap(value: object) -> Any:  # a loaded entry: a tensor, or a saved object's bytes
    if isinstance(value, io.BytesIO):
        value.seek(0)
        return torch.load(value, weights_only=True)
    return value


def _bytes(value: object) -> io.BytesIO:  # any object torch.save writes
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def loader_keys(states: dict[int, tuple[int, Any]], replicas: int) -> dict[str, Any]:
    """``data/replica-<r>`` keys of loader states (replica -> (position, state)) sharded over
    ``replicas`` loaders."""
    return {
        f"{_DATA}{replica}": _bytes({"replicas": replicas, "position": position, "state": state})
        for replica, (position, state) in states.items()
    }


def read_loader_states(index: CheckpointIndex, replicas: int) -> dict[int, tuple[int, Any]]:
    """replica -> (position, state) of the loaders saved in ``index``'s step, when they were
    sharded over as many ``replicas`` (under another sharding: none, the run skips ahead)."""
    out: dict[int, tuple[int, Any]] = {}
    for key in index.entries:
        if key.startswith(_DATA):
            saved = _load_object(index, key)
            if isinstance(saved, dict) and saved.get("replicas") == replicas:
                out[int(key[len(_DATA) :])] = (int(saved["position"]), saved["state"])
    return out
