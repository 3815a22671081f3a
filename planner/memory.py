"""Per-device memory of a pipeline stage, and the in-flight counts the DP charges.

A replica of a stage keeps (bytes per device)::

    params * (weight_versions + 1 gradient + optimizer_states) + saved * activations_in_flight

``optimizer_states`` is 0 for SGD, 1 for momentum, 2 for Adam (and, where a stage keeps
more than one weight version, one more copy: the live weights beside the stashed
snapshots, ``parameter_copies``); ``params`` and ``saved``
are the profile's bytes, in its dtype. Under mixed precision (``pipeplan.precision``:
a bf16 profile plans bf16 compute with float32 masters) the weight versions are the
compute copies and the rest is float32, ``master / compute`` bytes per compute byte::

    params * (weight_versions + 2 * (1 master + 1 gradient + optimizer_states)) + saved * in_flight

(bf16, Adam, one version: 2 + 4 + 4 + 8 = 18 bytes per parameter, Megatron's figure). At its
peak a stage also holds one gradient temporary (``gradient_temporary_bytes``): the largest
parameter's freshly computed gradient, before it is added into the one kept. The counts are each
schedule's own, from the registry ``pipeplan.schedules.SCHEDULE_KINDS`` (shared with the
runtime and the simulator): with 1F1B-RR a replica of stage s stashes ``W_s + 1`` weight
versions and as many minibatches of activations, where ``W_s + 1 = ceil(after_s / n_s)``
with ``after_s`` the devices of stage s and every later stage and ``n_s`` its replicas;
2BW keeps two versions; the flush schedules one, with the activations their action
lists hold at their peak (interleaved 1F1B per chunk: ``in_flight_by_chunk``). Under a split
backward (zero-bubble schedules) each unit between its input and weight passes also holds
the gradients its "I" recorded for its "W" (``deferred_by_chunk`` units of the stage's
``deferred_weight_bytes``), beside its saved activations, which the retained graph keeps
until "W". The saved bytes a caller passes include the stage's boundaries: the values it
received and the outputs it sent, which the runtime keeps until their backward
(``costs.stage_boundary_bytes``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, overload

import numpy as np

from pipeplan.errors import InputError
from pipeplan.optimizers import STATE_COPIES
from pipeplan.precision import Precision
from pipeplan.schedules import schedule_kind
from pipeplan.schedules.peak import ChunkWeights

if TYPE_CHECKING:  # typing only
    from pipeplan.planner.costs import Elementwise

__all__ = [
    "OPTIMIZER_STATES",
    "optimizer_states",
    "parameter_copies",
    "stage_memory_bytes",
    "gradient_temporary_bytes",
    "backward_temporary_bytes",
    "live_weight_copies",
    "in_flight_after",
    "plan_stage_memory",
]

OPTIMIZER_STATES = STATE_COPIES  # parameter-sized buffers per optimizer


def optimizer_states(optimizer: str) -> int:
    """Parameter-sized optimizer buffers of ``optimizer`` (sgd 0, momentum 1, adam and adamw 2).

    torch keeps the moments in the parameters' dtype, so they are charged at parameter size.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise InputError(f"unknown optimizer {optimizer!r} (expected one of {', '.join(OPTIMIZER_STATES)})")
    return OPTIMIZER_STATES[optimizer]


@overload
def parameter_copies(versions: float, optimizer: str, precision: Precision = ...) -> float: ...
@overload
def parameter_copies(versions: np.ndarray, optimizer: str, precision: Precision = ...) -> np.ndarray: ...
def parameter_copies(
    versions: Elementwise, optimizer: str, precision: Precision = Precision()
) -> Elementwise:
    """Bytes per byte of (compute-dtype) parameters: the weight versions, the gradient,
    the optimizer's states and, under mixed precision, the masters (module docstring).
    Where a stage keeps several versions (1F1B-RR, 2BW), each is a snapshot beside the live
    weights the optimizer updates (``pipeplan.runtime.stash``): one more copy, unless the
    live weights are the float32 masters, which mixed precision counts already.

    >>> parameter_copies(1, "adam"), parameter_copies(1, "adam", Precision("bfloat16", "float32"))
    (4.0, 9.0)
    >>> parameter_copies(2, "sgd"), parameter_copies(2, "sgd", Precision("bfloat16", "float32"))
    (4.0, 6.0)
    """
    return (
        versions
        + live_weight_copies(versions, precision)
        + precision.state_copies(optimizer_states(optimizer))
    )


def live_weight_copies(versions: Elementwise, precision: Precision) -> Elementwise:
    """1 where a stage keeps several weight versions as snapshots beside its live weights
    (``pipeplan.runtime.stash``) and those live weights are not the float32 masters that
    mixed precision charges already; else 0. Elementwise on numpy arrays.

    >>> live_weight_copies(1, Precision()), live_weight_copies(3, Precision())
    (0.0, 1.0)
    """
    if precision.mixed:
        return 0.0
    if isinstance(versions, np.ndarray):
        return np.where(versions > 1, 1.0, 0.0)
    return 1.0 if versions > 1 else 0.0


@overload
def stage_memory_bytes(
    param_bytes: float,
    saved_bytes: float,
    versions: float,
    in_flight: float,
    optimizer: str,
    precision: Precision = ...,
    temporary_bytes: float = ...,
) -> float: ...
@overload
def stage_memory_bytes(
    param_bytes: Elementwise,
    saved_bytes: Elementwise,
    versions: Elementwise,
    in_flight: Elementwise,
    optimizer: str,
    precision: Precision = ...,
    temporary_bytes: Elementwise = ...,
) -> Elementwise: ...
def stage_memory_bytes(
    param_bytes: Elementwise,
    saved_bytes: Elementwise,
    versions: Elementwise,
    in_flight: Elementwise,
    optimizer: str,
    precision: Precision = Precision(),
    temporary_bytes: Elementwise = 0.0,
) -> Elementwise:
    """Bytes one replica keeps at its peak; elementwise on numpy arrays.

    >>> stage_memory_bytes(100, 10, versions=3, in_flight=3, optimizer="adam")
    630.0
    """
    return (
        param_bytes * parameter_copies(versions, optimizer, precision)
        + saved_bytes * in_flight
        + temporary_bytes
    )


@overload
def gradient_temporary_bytes(
    largest_param_bytes: float, microbatches: int, precision: Precision = ...
) -> float: ...
@overload
def gradient_temporary_bytes(
    largest_param_bytes: np.ndarray, microbatches: int, precision: Precision = ...
) -> Elementwise: ...
def gradient_temporary_bytes(
    largest_param_bytes: Elementwise, microbatches: int, precision: Precision = Precision()
) -> Elementwise:
    """Bytes of the gradient temporary a stage holds at its peak, beside its kept gradients.

    A backward computes each parameter's gradient into a new tensor. A replica's first
    micro-batch keeps it as ``.grad``; each later one's is a temporary that autograd adds
    into ``.grad`` and frees. Under mixed precision every backward's compute-dtype gradient
    is such a temporary, added into the float32 master's (``pipeplan.runtime.mixed_precision``).
    One exists at a time: the largest parameter's, at worst (``LayerProfile.largest_param_bytes``,
    in the profile's dtype; elementwise on numpy arrays). Charged whenever a minibatch has more
    than one micro-batch, also to a replica that runs only one of them (a bound, kept so the
    charge does not depend on the replicas). pipeplan's optimizers step fused
    (``pipeplan.optimizers``): the step adds none.

    >>> gradient_temporary_bytes(64, microbatches=1), gradient_temporary_bytes(64, microbatches=4)
    (0.0, 64)
    """
    return largest_param_bytes if precision.mixed or microbatches > 1 else 0.0


@overload
def backward_temporary_bytes(
    largest_param_bytes: float, working_bytes: float, microbatches: int, precision: Precision = ...
) -> float: ...
@overload
def backward_temporary_bytes(
    largest_param_bytes: np.ndarray, working_bytes: np.ndarray, microbatches: int, precision: Precision = ...
) -> Elementwise: ...
def backward_temporary_bytes(
    largest_param_bytes: Elementwise,
    working_bytes: Elementwise,
    microbatches: int,
    precision: Precision = Precision(),
) -> Elementwise:
    """What a stage holds at its peak beside its kept gradients and saved activations: the
    gradient temporary (``gradient_temporary_bytes``) plus one micro-batch of its hungriest
    layer's backward working memory (``working_bytes``, one minibatch's: the output gradients
    handed in and what the backward allocates, ``LayerProfile.backward_working_bytes``). Both
    are maxima over the stage's layers, charged together (a bound: they may peak in different
    layers). Elementwise on numpy arrays.

    >>> backward_temporary_bytes(64, 400, microbatches=4)
    164.0
    """
    return (
        gradient_temporary_bytes(largest_param_bytes, microbatches, precision) + working_bytes / microbatches
    )


def in_flight_after(devices_from_stage: int, replicas: int) -> int:
    """1F1B-RR minibatches in flight at a stage: ceil(devices of it and later stages / replicas).

    Equals ``pipeplan.schedules.weight_versions("1f1b-rr", ...)`` for every stage:

    >>> [in_flight_after(after, 1) for after in (4, 3, 2, 1)]
    [4, 3, 2, 1]
    """
    return math.ceil(devices_from_stage / replicas)


def plan_stage_memory(
    schedule: str,
    stage_replicas: Sequence[int],
    stage: int,
    param_bytes: float,
    saved_bytes: float,
    optimizer: str,
    microbatches: int = 1,
    virtual_stages: int = 1,
    chunk: int | None = None,
    precision: Precision = Precision(),
    largest_param_bytes: float = 0.0,
    transient_bytes: float = 0.0,
    working_bytes: float = 0.0,
    deferred_bytes: float = 0.0,
    chunk_weights: ChunkWeights | None = None,
) -> tuple[int, int, float]:
    """(memory bytes, weight versions, activations in flight) of one replica of ``stage``.

    With ``chunk``, the bytes of that one chunk of the device (its share of the device's
    peak; the device's gradient temporary is charged to its first chunk); without, the
    whole stage's. ``largest_param_bytes``: the stage's largest parameter (0: none charged).
    ``transient_bytes``: what a recomputed layer re-materialises in backward
    (``planner.recompute``), held beside everything else at the peak. ``working_bytes``: the
    stage's largest backward working memory, one minibatch (``backward_temporary_bytes``).
    ``deferred_bytes``: what the stage's (or chunk's) input pass keeps for its weight pass, one
    minibatch (``costs.stage_deferred_bytes``), charged for its units between the two.
    ``chunk_weights``: with ``chunk``, what every chunk of the device holds per unit (and per
    unit past its "I"), so that each chunk is charged its units at the device's peak of bytes
    (``ScheduleKind.in_flight_by_chunk``), not of units.
    """
    kind = schedule_kind(schedule)
    versions = kind.weight_versions(stage_replicas, stage)
    if chunk is None:
        in_flight = kind.activations_in_flight(stage_replicas, stage, microbatches, virtual_stages)
        deferred = sum(kind.deferred_by_chunk(stage_replicas, stage, microbatches, virtual_stages))
    else:
        in_flight = kind.in_flight_by_chunk(
            stage_replicas, stage, microbatches, virtual_stages, chunk_weights
        )[chunk]
        deferred = kind.deferred_by_chunk(stage_replicas, stage, microbatches, virtual_stages, chunk_weights)[
            chunk
        ]
    temporary = (
        0.0
        if chunk
        else backward_temporary_bytes(largest_param_bytes, working_bytes, microbatches, precision)
    )
    temporary += transient_bytes + deferred_bytes * deferred
    memory = stage_memory_bytes(
        param_bytes, saved_bytes, versions, in_flight, optimizer, precision, temporary
    )
    return int(math.ceil(memory)), versions, in_flight
