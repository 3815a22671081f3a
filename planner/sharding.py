"""Sharded data parallelism of a stage's replicas: what each mode keeps and what it sends.

A stage whose level-1 node runs on d > 1 devices (the replicas the DP places inside one
unit of the innermost level, e.g. the GPUs of one host; on a one-level topology all of
the stage's replicas) may shard among those d replicas:

- ``none``: every replica keeps everything; the gradients are ring all-reduced.
- ``zero1``: the optimizer's states are divided by d (torch's ``ZeroRedundancyOptimizer``:
  each replica steps its share of the parameters and broadcasts it). Sends the gradient
  all-reduce plus one all-gather of the stepped parameters (in the master dtype).
- ``zero2``: FSDP2 ``fully_shard(reshard_after_forward=False)``: masters, gradients and
  optimizer states divided by d; one compute copy of the parameters is gathered per
  micro-batch and kept from its forward to its backward. Sends per micro-batch one
  all-gather of the compute parameters and one reduce-scatter of the gradients.
- ``fsdp``: ``fully_shard(reshard_after_forward=True)`` on each layer: as zero2, but
  the parameters are gathered again for the backward and only one layer (and the next,
  prefetched) is whole at a time. Sends per micro-batch two all-gathers and one
  reduce-scatter.

Memory per replica, in bytes per compute-dtype parameter byte (v weight versions, S =
``Precision.state_copies``, k optimizer states, g = ``Precision.gradient_ratio``)::

    none   v + S
    zero1  v + S - g k (1 - 1/d)
    zero2  1 + (S + e) / d              e = 1 without mixed precision (the kept shard), else 0
    fsdp   (S + e) / d, plus min(P, 2 L) gathered bytes (L: the stage's largest layer)

All-gathers and reduce-scatters of x bytes cost (d-1)/d x / B + (d-1) latencies; an
all-reduce twice that. Schedules whose weights are stashed or delayed (1F1B-RR, 2BW) or
split the backward (ZB-H1) keep versions FSDP cannot gather: they plan ``none`` or
``zero1`` only; tensor-parallel stages and interleaved schedules plan ``none`` only.

``auto`` chooses among the modes ``pipeplan run`` runs for the plan: ``none`` and ``zero1``
everywhere, ``zero2`` and ``fsdp`` where FSDP2 runs them (``fsdp_runs``: a flush schedule
with one backward, float32, t = 1, one topology level so a stage's replicas form one
sharding group, no tied weights, no ``--recompute full``; zero2/fsdp stages then plan no
recomputation, which the runtime refuses on them).

A mode name may carry an offload (``planner.offload.variant``: ``fsdp/optimizer+params``):
its bytes are the mode's less what offload frees, its sync the mode's.
"""

from __future__ import annotations

import math

import numpy as np

from pipeplan.errors import InputError
from pipeplan.plan import Plan
from pipeplan.planner.costs import Elementwise, on_gloo, replica_sum_ms, ring_allreduce_ms
from pipeplan.planner.memory import live_weight_copies, optimizer_states, stage_memory_bytes
from pipeplan.planner.offload import FSDP_MODES, base_mode, offload_freed_copies, variant
from pipeplan.precision import Precision
from pipeplan.schedules import schedule_kind

__all__ = [
    "SHARD_CHOICES",
    "SHARD_MODES",
    "RUN_MODES",
    "fsdp_runs",
    "replica_microbatches",
    "shard_copies",
    "shard_memory_bytes",
    "shard_modes",
    "shard_sync_ms",
    "sync_floor_factor",
    "sync_floor_ms",
    "stage_shard_memory",
    "stage_sync_ms",
]

SHARD_MODES = ("none", "zero1", "zero2", "fsdp")  # least sharding first: ties keep the earlier
SHARD_CHOICES = ("auto",) + SHARD_MODES
# what ``pipeplan run`` runs under every schedule and precision, and so what ``auto`` chooses
# among; zero2 and fsdp are planned when asked for by name (``pipeplan run`` runs them for
# float32 flush schedules: pipeplan.runtime.sharding)
RUN_MODES = ("none", "zero1")


def fsdp_runs(
    schedule: str, mixed: bool, levels: int, tied: bool, recompute: str, tensor_parallel: int = 1
) -> bool:
    """Whether ``pipeplan run`` runs zero2 / fsdp for such a plan (``runtime.sharding.check_shard``):
    a flush schedule with one backward and one chunk, float32, t = 1, one topology level (a
    stage's replicas all in one sharding group), no weight tied across layers, no full recomputation."""
    kind = schedule_kind(schedule)
    return (
        kind.runs_tensor_parallel
        and not kind.virtual_stages
        and not mixed
        and levels == 1
        and not tied
        and recompute != "full"
        and tensor_parallel == 1
    )


def _compatible(schedule: str, tensor_parallel: int) -> tuple[tuple[str, ...], str]:
    """Modes ``schedule`` can combine with, and why the others are left out."""
    kind = schedule_kind(schedule)
    if tensor_parallel > 1:
        return ("none",), "tensor-parallel stages are not sharded"
    if kind.virtual_stages:
        return ("none",), f"{schedule} is planned per chunk, without sharding"
    if not kind.runs_tensor_parallel:  # stashed or delayed weights, or a split backward
        return (
            "none",
            "zero1",
        ), f"{schedule} keeps weight versions or splits the backward, which FSDP cannot"
    return SHARD_MODES, ""


def shard_modes(
    request: str, schedule: str, tensor_parallel: int = 1, fsdp_run: bool = False
) -> tuple[str, ...]:
    """The modes a replicated stage may take: every compatible one ``pipeplan run`` runs for
    ``auto`` (zero2 and fsdp where ``fsdp_run``: ``fsdp_runs``), else the one asked
    (``InputError`` in one line when the schedule cannot combine with it)."""
    if request not in SHARD_CHOICES:
        raise InputError(f"--shard {request!r} is not one of {', '.join(SHARD_CHOICES)}")
    allowed, why = _compatible(schedule, tensor_parallel)
    if request == "auto":
        runs = RUN_MODES + (FSDP_MODES if fsdp_run else ())
        return tuple(mode for mode in allowed if mode in runs)
    if request not in allowed:
        raise InputError(f"--shard {request} with schedule {schedule}: {why}")
    return (request,)


def replica_microbatches(schedule: str, microbatches: int, replicas: int) -> int:
    """Micro-batches one of ``replicas`` replicas runs per minibatch (work unit u runs on
    replica u mod d, ``pipeplan.schedules.actions``); whole minibatches run 1."""
    if schedule_kind(schedule).whole_minibatches:
        return 1
    return math.ceil(microbatches / replicas)


def shard_copies(
    mode: str, versions: Elementwise, optimizer: str, precision: Precision, d: int
) -> Elementwise:
    """Bytes per compute-dtype parameter byte one replica keeps (module docstring), FSDP's
    gathered layers left out.

    >>> p = Precision("bfloat16", "float32")
    >>> [shard_copies(m, 1, "adam", p, 4) for m in ("none", "zero1", "zero2", "fsdp")]
    [9.0, 6.0, 3.0, 2.0]
    """
    freed = offload_freed_copies(mode, optimizer, precision, d)
    mode = base_mode(mode)
    states = optimizer_states(optimizer)
    copies = precision.state_copies(states)
    own = 0.0 if precision.mixed else 1.0
    weights = versions + live_weight_copies(versions, precision)
    if mode == "none":
        return weights + copies - freed
    if mode == "zero1":
        return weights + copies - precision.gradient_ratio * states * (1.0 - 1.0 / d) - freed
    if mode == "zero2":
        return 1.0 + (copies + own) / d - freed
    if mode == "fsdp":
        return (copies + own) / d - freed
    raise InputError(f"shard mode {mode!r} is not one of {', '.join(SHARD_MODES)}")


def shard_memory_bytes(
    mode: str,
    param_bytes: Elementwise,
    saved_bytes: Elementwise,
    versions: Elementwise,
    in_flight: Elementwise,
    optimizer: str,
    precision: Precision,
    d: int,
    temporary_bytes: Elementwise = 0.0,
    largest_layer_bytes: Elementwise = 0.0,
) -> Elementwise:
    """Bytes one of d sharding replicas keeps at its peak (``planner.memory.stage_memory_bytes``
    for ``none``); elementwise on numpy arrays.

    >>> shard_memory_bytes("zero1", 100, 10, 1, 2, "adam", Precision(), 2)
    320.0
    """
    gathered = np.minimum(param_bytes, 2.0 * largest_layer_bytes) if base_mode(mode) == "fsdp" else 0.0
    return (
        param_bytes * shard_copies(mode, versions, optimizer, precision, d)
        + gathered
        + saved_bytes * in_flight
        + temporary_bytes
    )


def shard_sync_ms(
    mode: str,
    param_bytes: Elementwise,
    d: int,
    bandwidth_bytes_per_s: float,
    latency_ms: float,
    precision: Precision,
    microbatches: int,
    on_gloo: bool = False,
) -> Elementwise:
    """Collectives (ms per minibatch) of one replica of d under ``mode`` (module docstring);
    ``param_bytes`` in the compute dtype, ``microbatches`` each replica runs. ``none`` sums
    the gradients as every unsharded stage does (``costs.replica_sum_ms``: two replicas
    ``on_gloo`` swap theirs in one message, where a ring takes two).

    >>> [round(float(shard_sync_ms(m, 1e6, 2, 1e9, 0.0, Precision("bfloat16", "float32"), 1)), 6) for m in SHARD_MODES]
    [2.0, 3.0, 1.5, 2.0]
    """
    if d <= 1:
        return param_bytes * 0.0
    mode = base_mode(mode)
    grads = param_bytes * precision.gradient_ratio
    share = (d - 1.0) / d / bandwidth_bytes_per_s * 1e3
    hops = (d - 1.0) * latency_ms
    if mode == "none":  # the same operations as the unsharded cost model's
        return replica_sum_ms(grads, d, bandwidth_bytes_per_s, latency_ms, on_gloo)
    if mode == "zero1":
        return 3.0 * grads * share + 3.0 * hops
    gathers = 1.0 if mode == "zero2" else 2.0
    if mode not in ("zero2", "fsdp"):
        raise InputError(f"shard mode {mode!r} is not one of {', '.join(SHARD_MODES)}")
    return microbatches * ((grads + gathers * param_bytes) * share + (1.0 + gathers) * hops)


def sync_floor_ms(
    modes: tuple[str, ...],
    param_bytes: Elementwise,
    d: int,
    bandwidth_bytes_per_s: float,
    latency_ms: float,
    precision: Precision,
    microbatches: int,
    on_gloo: bool = False,
) -> Elementwise:
    """The least ``shard_sync_ms`` over ``modes``: a lower bound of a replicated stage's sync."""
    out = shard_sync_ms(
        modes[0], param_bytes, d, bandwidth_bytes_per_s, latency_ms, precision, microbatches, on_gloo
    )
    for mode in modes[1:]:
        out = np.minimum(
            out,
            shard_sync_ms(
                mode, param_bytes, d, bandwidth_bytes_per_s, latency_ms, precision, microbatches, on_gloo
            ),
        )
    return out


def sync_floor_factor(modes: tuple[str, ...], precision: Precision) -> float:
    """A factor f <= 1 with ``shard_sync_ms(mode) >= f * ring all-reduce`` for every mode in
    ``modes`` and any d and micro-batch count: the DP's lower bounds scale their all-reduce
    by it. Only zero2 and fsdp under mixed precision send less than the all-reduce of the
    float32 gradients (g + 1 or g + 2 bytes against 2 g per compute byte).

    >>> sync_floor_factor(SHARD_MODES, Precision("bfloat16", "float32")), sync_floor_factor(SHARD_MODES, Precision())
    (0.75, 1.0)
    """
    g = precision.gradient_ratio
    factor = 1.0
    modes = tuple(base_mode(mode) for mode in modes)
    if "zero2" in modes:
        factor = min(factor, (g + 1.0) / (2.0 * g))
    if "fsdp" in modes:
        factor = min(factor, (g + 2.0) / (2.0 * g))
    return factor


def stage_sync_ms(plan: Plan, q: int, param_bytes: float) -> float:
    """The sync (ms per minibatch) of stage ``q`` of ``plan`` with ``param_bytes`` of compute
    weights under its shard mode, on the level-1 links of its sharding groups; when its
    replicas span several groups, plus the ring all-reduce of its gradients over them all
    (an upper bound of the DP's overlapped figure)."""
    stage = plan.stages[q]
    level = plan.topology.levels[0]
    d = stage.shard_degree
    micro = replica_microbatches(plan.schedule, max(plan.microbatches, 1), stage.replicas)
    sync = float(
        shard_sync_ms(
            stage.shard,
            param_bytes,
            d,
            level.bandwidth_bytes_per_s,
            level.message_ms,
            plan.precision,
            micro,
            on_gloo(plan.topology),
        )
    )
    if stage.replicas > d:
        joining = plan.topology.level_joining(stage.ranks[0], stage.ranks[-1])
        outer = plan.topology.levels[max(joining, 0)]
        sync += float(
            ring_allreduce_ms(
                param_bytes * plan.precision.gradient_ratio,
                stage.replicas // d,
                outer.bandwidth_bytes_per_s,
                outer.message_ms,
            )
        )
    return sync


def stage_shard_memory(
    plan: Plan,
    q: int,
    param_bytes: float,
    saved_bytes: float,
    versions: float,
    in_flight: float,
    temporary_bytes: float,
) -> float:
    """Bytes one replica of stage ``q`` of ``plan`` keeps under its shard mode (the
    simulator's per-stage memory). fsdp's gathered layers are charged as the whole stage's
    parameters (an upper bound: the simulator's costs have no per-layer parameter bytes)."""
    stage = plan.stages[q] if q < len(plan.stages) else None
    mode = variant(stage.shard, stage.offload) if stage is not None else "none"
    if mode == "none":
        return stage_memory_bytes(
            param_bytes, saved_bytes, versions, in_flight, plan.optimizer, plan.precision, temporary_bytes
        )
    assert stage is not None
    return float(
        shard_memory_bytes(
            mode,
            param_bytes,
            saved_bytes,
            versions,
            in_flight,
            plan.optimizer,
            plan.precision,
            stage.shard_degree,
            temporary_bytes,
            param_bytes / 2.0,
        )
    )
