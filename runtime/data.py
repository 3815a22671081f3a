"""Minibatches for the stages that read data (the input stage, the loss stage, and any
stage that reads a model input directly).

Every such stage draws minibatch k itself, so no model input or target is ever sent:

- with ``data_loader(batch_size, replica, replicas)`` in model.py, minibatch k is item
  ``k // n0`` of loader ``k % n0`` (``n0`` = replicas of the input stage, the PipeDream
  sharding), each rank opening its own iterators and skipping the items of other
  replicas' minibatches, so every stage sees identical data for minibatch k;
- otherwise it is ``sample_batch(batch_size)`` with the CPU generator seeded by ``seed + k``, so
  runs are reproducible.

A loader with ``state_dict()`` / ``load_state_dict()`` (torchdata's ``StatefulDataLoader``)
is *stateful*: the source keeps its state before each item it may still need
(``loader_state``: what a checkpoint saves, as of the first item after the step) and a
resumed run continues from it (``restore_loaders``), reading nothing twice. Another loader
is re-opened and skipped ahead item by item to the resumed minibatch.

A minibatch is split into ``microbatches`` equal chunks along dim 0. Inputs given as keyword
arguments (a dict) reach the stages as their flat tensors (``ModelInputs.tensors``), the
order in which the captured graph takes them (model input ``k``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

import torch

from pipeplan.errors import InputError
from pipeplan.model_inputs import ModelInputs, model_inputs
from pipeplan.modelfile import ModelFile

__all__ = ["BatchSource"]

_STATE_WINDOW = 64  # minibatches behind the newest drawn whose loader state is kept (draw_ahead's most)


@dataclass
class BatchSource:
    model_file: ModelFile
    batch_size: int  # samples per minibatch
    microbatches: int
    seed: int
    loader_replicas: int  # n0: replicas of the input stage (data_loader sharding)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32  # floating-point inputs are cast to it
    target_dtype: torch.dtype | None = None  # floating-point targets are cast to it (None: ``dtype``)
    _loaders: dict[int, _Reader] = field(default_factory=dict)
    _resume: dict[int, tuple[int, Any]] = field(default_factory=dict)  # replica -> (position, state)
    _cache: dict[int, tuple[tuple[torch.Tensor, ...], Any]] = field(default_factory=dict)
    _chunks: dict[int, list[tuple[tuple[torch.Tensor, ...], Any]]] = field(default_factory=dict)
    _names: tuple[str, ...] | None = None  # the flat input tensors' argument names

    def __post_init__(self) -> None:
        if self.batch_size % self.microbatches:
            raise InputError(
                f"batch size {self.batch_size} is not divisible into {self.microbatches} micro-batches"
            )

    def microbatch(self, minibatch: int, microbatch: int) -> tuple[tuple[torch.Tensor, ...], Any]:
        """(flat input tensors, targets) of one micro-batch, on this rank's device.

        A minibatch is split once, at its first micro-batch, and its chunks kept while it may
        be in flight: every forward asked for it again, and cutting it each time cost 13.8 us
        per call against 2.2 us (a tiny Llama's minibatch of 8 in 4 micro-batches; issue 31)."""
        m = self.microbatches
        if m == 1:
            return self._minibatch(minibatch)
        chunks = self._chunks.get(minibatch)
        if chunks is None:
            inputs, targets = self._minibatch(minibatch)
            split = [t.tensor_split(m, dim=0) for t in inputs]
            chunks = [
                (tuple(s[j] for s in split), part) for j, part in enumerate(targets.tensor_split(m, dim=0))
            ]
            for old in [key for key in self._chunks if key not in self._cache]:  # the cache let it go
                del self._chunks[old]
            self._chunks[minibatch] = chunks
        return chunks[microbatch]

    def draw_ahead(self, minibatches: Iterable[int], most: int = 64, budget_bytes: int = 256 << 20) -> int:
        """Draw ``minibatches`` (global ids, in order) now, before the timed loop: at most
        ``most`` of them, while their tensors fit in ``budget_bytes``; returns how many.

        The run then takes them from the cache, as a training loop over a pre-built list
        of batches does; the draws are deterministic, so results do not change.
        """
        drawn = held = 0
        for k in minibatches:
            if drawn == most or (
                drawn and held * (drawn + 1) > budget_bytes * drawn
            ):  # the next would exceed it
                break
            inputs, targets = self._minibatch(k, evict=False)
            held += sum(t.numel() * t.element_size() for t in (*inputs, targets))
            drawn += 1
        return drawn

    def _minibatch(self, k: int, evict: bool = True) -> tuple[tuple[torch.Tensor, ...], Any]:
        """(flat input tensors, targets) of minibatch ``k``, placed on the device."""
        if evict:  # minibatches before k - 1 are done with (k - 1 may still be in flight)
            for old in [key for key in self._cache if key < k - 1]:
                del self._cache[old]
            oldest = k - 1 - _STATE_WINDOW  # a checkpoint may need a minibatch behind the newest drawn
            for replica, reader in self._loaders.items():
                reader.forget_before(-(-(oldest - replica) // self.loader_replicas))
        if k not in self._cache:
            drawn, targets = self._draw(k)
            inputs = drawn.tensors()
            if self._names is None:
                self._names = drawn.names()
            if drawn.names() != self._names:  # the stages read model input k by position
                raise InputError(
                    f"{self.model_file.path}: minibatch {k} has input tensors {list(drawn.names())}, "
                    f"an earlier one {list(self._names)}; every batch must give the same inputs"
                )
            if not isinstance(targets, torch.Tensor):
                raise InputError(
                    f"{self.model_file.path}: minibatch {k} targets are {type(targets).__name__}; "
                    f"pipeplan run splits and places targets, so they must be a Tensor"
                )
            for position, t in enumerate((*inputs, targets)):
                if t.shape[0] != self.batch_size:
                    raise InputError(
                        f"{self.model_file.path}: minibatch {k} tensor {position} has "
                        f"{t.shape[0]} samples, expected the plan's batch size {self.batch_size}"
                    )
            self._cache[k] = (
                tuple(self._placed(t, self.dtype) for t in inputs),
                self._placed(targets, self.target_dtype or self.dtype),
            )
        return self._cache[k]

    def _placed(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if value.is_floating_point():
            return value.to(device=self.device, dtype=dtype)
        return value.to(self.device)

    def _draw(self, k: int) -> tuple[ModelInputs, Any]:
        if self.model_file.data_loader is None:
            return self.model_file.batch(self.batch_size, seed=self.seed + k)
        replica, position = k % self.loader_replicas, k // self.loader_replicas
        reader = self._loaders.get(replica)
        if reader is None or position < reader.position:
            reader = self._open(replica, position)
        item = None
        while reader.position <= position:
            reader.remember()
            try:
                item = next(reader.iterator)
            except StopIteration as exc:
                raise InputError(
                    f"{self.model_file.path}: data_loader(replica={replica}) ended after "
                    f"{reader.position} minibatches; the run needs {position + 1}"
                ) from exc
            reader.position += 1
        inputs, targets = item  # type: ignore[misc]
        return model_inputs(inputs, self.model_file.path), targets

    def _open(self, replica: int, position: int) -> _Reader:
        """Loader ``replica``'s reader, continuing from its saved state when one was restored
        at or before ``position`` (else from the start, skipping ahead)."""
        assert self.model_file.data_loader is not None, "only a model file's data_loader opens readers"
        loader = self.model_file.data_loader(self.batch_size, replica, self.loader_replicas)
        start = 0
        saved = self._resume.pop(replica, None)
        if saved is not None and saved[0] <= position and _stateful(loader):
            loader.load_state_dict(saved[1])
            start = saved[0]
        reader = _Reader(loader, iter(loader), start)
        self._loaders[replica] = reader
        return reader

    @property
    def reads_loaders(self) -> bool:
        """True when minibatches come from the model file's ``data_loader``."""
        return self.model_file.data_loader is not None

    def loader_state(self, minibatch: int) -> dict[int, tuple[int, Any]]:
        """replica -> (position, state) of every stateful loader this rank opened, at the first
        item minibatch ``minibatch`` (global) or a later one needs; its state from before it read
        that item (the run may have drawn ahead)."""
        out: dict[int, tuple[int, Any]] = {}
        for replica, reader in self._loaders.items():
            if not _stateful(reader.loader):
                continue
            wanted = -(-(minibatch - replica) // self.loader_replicas)  # first position >= minibatch
            found = reader.state_at(max(wanted, 0))
            if found is not None:
                out[replica] = found
        return out

    def restore_loaders(self, saved: dict[int, tuple[int, Any]]) -> None:
        """Continue each loader from its saved (position, state) (``loader_state`` of a checkpoint)."""
        self._resume = dict(saved)
        self._loaders.clear()


@dataclass
class _Reader:
    """One opened loader: its iterator, the next item's position, and (a stateful loader) its
    state before each item still needed, so a checkpoint can name the state at its step."""

    loader: Iterable[Any]  # the model file's data_loader(...) result
    iterator: Iterator[Any]
    position: int  # of the next item
    states: dict[int, Any] = field(default_factory=dict)  # position -> state before reading it

    def remember(self) -> None:
        if _stateful(self.loader):
            self.states[self.position] = copy.deepcopy(self.loader.state_dict())

    def forget_before(self, position: int) -> None:
        """Drop the states of items before ``position`` (no checkpoint can need them again)."""
        for old in [p for p in self.states if p < position]:
            del self.states[old]

    def state_at(self, position: int) -> tuple[int, Any] | None:
        """(position, state) to continue from at ``position``; the current state when the
        loader has read nothing past it."""
        if position in self.states:
            return position, self.states[position]
        if position >= self.position and _stateful(self.loader):
            return self.position, copy.deepcopy(self.loader.state_dict())
        return None


class _StatefulLoader(Protocol):
    """What torchdata's ``StatefulDataLoader`` adds to an iterable: where it is, and going back there."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _stateful(loader: object) -> TypeGuard[_StatefulLoader]:
    """A loader that says where it is (torchdata's ``StatefulDataLoader``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )
