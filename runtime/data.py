"""Minibatches for the stages that read data (the input stage, the loss stage, and any
stage that reads a model input directly).

Every such stage draws minibatch k itself, so no model input or target is ever sent:

- with ``data_loader(batch_size, replica, replicas)`` in model.py, minibatch k is item
  ``k // n0`` of loader ``k % n0`` (``n0`` = replicas of the input stage, the PipeDream
  sharding), each rank opening its own iterators and skipping the items of other
  replicas' minibatches, so every stage sees identical data for minibatch k;
- otherwise it is ``sample_batch(batch_size)`` under ``torch.manual_seed(seed + k)``, so
  runs are reproducible.

A minibatch is split into ``microbatches`` equal chunks along dim 0. Inputs given as keyword
arguments (a dict) reach the stages as their flat tensors (``ModelInputs.tensors``), the
order in which the captured graph takes them (model input ``k``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeplan.errors import InputError
from pipeplan.model_inputs import ModelInputs, model_inputs
from pipeplan.modelfile import ModelFile

__all__ = ["BatchSource"]


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
    _loaders: dict[int, tuple[Iterator[Any], int]] = field(default_factory=dict)
    _cache: dict[int, tuple[tuple[torch.Tensor, ...], Any]] = field(default_factory=dict)
    _names: tuple[str, ...] | None = None  # the flat input tensors' argument names

    def __post_init__(self) -> None:
        if self.batch_size % self.microbatches:
            raise InputError(
                f"batch size {self.batch_size} is not divisible into {self.microbatches} micro-batches"
            )

    def microbatch(self, minibatch: int, microbatch: int) -> tuple[tuple[torch.Tensor, ...], Any]:
        """(flat input tensors, targets) of one micro-batch, on this rank's device."""
        inputs, targets = self._minibatch(minibatch)
        m = self.microbatches
        if m == 1:
            return inputs, targets
        chunk = tuple(t.tensor_split(m, dim=0)[microbatch] for t in inputs)
        return chunk, targets.tensor_split(m, dim=0)[microbatch]

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
        iterator, next_position = self._loaders.get(replica, (None, 0))
        if iterator is None or position < next_position:
            iterator = iter(self.model_file.data_loader(self.batch_size, replica, self.loader_replicas))
            next_position = 0
        item = None
        while next_position <= position:
            try:
                item = next(iterator)
            except StopIteration as exc:
                raise InputError(
                    f"{self.model_file.path}: data_loader(replica={replica}) ended after "
                    f"{next_position} minibatches; the run needs {position + 1}"
                ) from exc
            next_position += 1
        self._loaders[replica] = (iterator, next_position)
        inputs, targets = item  # type: ignore[misc]
        return model_inputs(inputs, self.model_file.path), targets
