"""Sharded replicas in the DP: a level-1 stage on d > 1 devices takes its fastest mode that fits.

A stage of level 1 replicated on ``units`` devices costs, for each mode of
``DPSettings.shard`` (``planner.sharding``), ``max((compute + recomputed) / units, sync)``
where it fits in device memory with that mode's bytes at d = ``units``, and inf elsewhere;
its value is the least over the modes. Sharding divides the parameter side of a device's
bytes (``_shard_parameter_bytes``); the activation side is recomputation's, chosen per mode
on what that mode leaves of the device (``context.recompute_extra_ms``, the unsharded
stage's rule on another parameter side). That is one stage cost function in place of another, so the DP
stays exact on it; ``stage_shard`` makes the same choice for one placed stage (ties keep
the mode with less sharding, as the DP's min does with the modes in that order). The DP's
lower bounds use the least sync of any mode (``DPContext.allreduce_ms``) and the least
memory of any mode at the most replicas level 1 allows (``least_need_bytes``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipeplan.planner.costs import LayerArrays, on_gloo
from pipeplan.planner.dp.context import (
    INF,
    DPContext,
    DPSettings,
    activation_need_bytes,
    recompute_extra_ms,
    versions_in_flight,
)
from pipeplan.planner.memory import backward_temporary_bytes
from pipeplan.planner.offload import FSDP_MODES, base_mode, offload_ms
from pipeplan.planner.sharding import replica_microbatches, shard_memory_bytes, shard_sync_ms

__all__ = ["largest_layer_range", "least_need_bytes", "sharded_stage_values"]


def largest_layer_range(arrays: LayerArrays, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Parameter bytes of the largest layer of every stage [starts, ends) (elementwise; 0
    when the arrays carry no per-layer parameter bytes)."""
    if arrays.layer_param_bytes is None:
        return np.zeros(np.broadcast(starts, ends).shape)
    return dataclasses.replace(arrays, largest_param_bytes=arrays.layer_param_bytes).largest_range(
        starts, ends
    )


def _largest_layers(ctx: DPContext) -> np.ndarray:
    """``largest_layer_range`` over the DP's band arrays ``[l, i]`` (memoised on ``ctx``)."""
    if ctx.largest_layers is None:
        lengths = np.arange(ctx.span + 1)[:, None]
        starts = np.arange(ctx.rows)[None, :]
        s_idx, e_idx = np.minimum(starts, ctx.n), np.minimum(starts + lengths, ctx.n)
        ctx.largest_layers = largest_layer_range(ctx.arrays, s_idx, e_idx)
    return ctx.largest_layers


def _shard_parameter_bytes(
    settings: DPSettings,
    mode: str,
    params: np.ndarray,
    tau: int,
    units: int,
    temporary: np.ndarray,
    largest_layer: np.ndarray | float,
) -> np.ndarray:
    """Bytes but the activations one of ``units`` replicas keeps under ``mode`` (weight
    versions, gradients, optimizer states, fsdp's gathered layers, the gradient temporary)."""
    versions, in_flight = versions_in_flight(settings, tau)
    zero = np.zeros(np.shape(params))
    return np.asarray(
        shard_memory_bytes(
            mode,
            params,
            zero,
            versions,
            in_flight,
            settings.optimizer,
            settings.precision,
            units,
            temporary,
            largest_layer,
        )
    )


def sharded_stage_values(ctx: DPContext, tau: int, units: int, where: tuple) -> np.ndarray:
    """Value (ms) of the ranges ``[l, i]`` at ``where`` as one level-1 stage on ``units``
    devices: the least over the shard modes of max((compute + recomputed) / units, sync),
    inf where no mode fits (with the recomputation each mode leaves room for)."""
    settings = ctx.settings
    lv = ctx.levels[0]
    valid = ctx.valid[where]
    compute, params = ctx.compute[where], ctx.params[where]
    temporary = (
        backward_temporary_bytes(
            ctx.largest[where], ctx.working[where], settings.microbatches, settings.precision
        )
        + ctx.deferred[where]
    )
    micro = replica_microbatches(settings.schedule, settings.microbatches, units)
    fsdp = any(base_mode(mode) == "fsdp" for mode in settings.shard)
    largest = _largest_layers(ctx)[where] if fsdp else 0.0
    best = np.full(np.shape(compute), INF)
    for mode in settings.shard:
        sync = shard_sync_ms(
            mode,
            params,
            units,
            lv.bandwidth_bytes_per_s,
            lv.message_ms,
            settings.precision,
            micro,
            on_gloo(ctx.topology),
        )
        parameters = _shard_parameter_bytes(settings, mode, params, tau, units, temporary, largest)
        if base_mode(mode) in FSDP_MODES and not settings.fsdp_recomputes:
            extra = _fits_whole(ctx, tau, where, parameters)
        else:
            extra = recompute_extra_ms(ctx, tau, where, parameters)
        host = offload_ms(mode, params, units, settings.precision, micro, settings.host_bandwidth_bytes_per_s)
        value = np.maximum((compute + extra) / units + host, sync)
        np.minimum(best, np.where(valid, value, INF), out=best)
    return best


def _fits_whole(ctx: DPContext, tau: int, where: tuple, parameter_bytes: np.ndarray) -> np.ndarray:
    """0 where the ranges at ``where`` fit without recomputation beside ``parameter_bytes``
    (or memory is unchecked), inf elsewhere (``recompute_extra_ms`` under ``none``)."""
    if not ctx.settings.memory_check:
        return np.zeros(np.shape(parameter_bytes))
    _, in_flight = versions_in_flight(ctx.settings, tau)
    fits = parameter_bytes + ctx.saved[where] * in_flight <= ctx.topology.device.memory_bytes
    return np.where(fits, 0.0, INF)


def least_need_bytes(
    settings: DPSettings,
    params: np.ndarray,
    saved: np.ndarray,
    tau: int,
    largest: np.ndarray,
    working: np.ndarray,
    most: int,
    arrays: LayerArrays | None = None,
    starts: np.ndarray | None = None,
    ends: np.ndarray | None = None,
) -> np.ndarray:
    """The least bytes a device needs for ranges of ``params`` and ``saved`` bytes under any
    mode of ``settings.shard`` with at most ``most`` replicas sharing (fsdp's gathered layers
    left out), with the fewest activation bytes recomputation allows (given ``arrays`` and
    the ranges' ``starts`` and ``ends``: ``context.activation_need_bytes``): a lower bound
    for the DP's memory bounds."""
    temporary = backward_temporary_bytes(largest, working, settings.microbatches, settings.precision)
    modes = settings.shard if most > 1 else ("none",)
    if "none" not in modes:
        modes = ("none",) + modes  # a stage on one device does not shard
    out = None
    for mode in modes:
        need = _shard_parameter_bytes(settings, mode, params, tau, most, temporary, 0.0)
        out = need if out is None else np.minimum(out, need)
    assert out is not None
    return out + activation_need_bytes(settings, saved, tau, arrays, starts, ends)
