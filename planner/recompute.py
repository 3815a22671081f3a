"""Activation recomputation per stage: what each layer keeps and frees, and which layers a
stage recomputes (``pipeplan partition --recompute``).

A layer run under ``torch.utils.checkpoint`` (non-reentrant) keeps only its input tensors
for backward, ``kept`` bytes (``LayerProfile.recompute_kept_bytes``, measured by the
profiler: the distinct tensors the layer reads; where not recorded,
its producers' ``output_bytes`` plus the minibatch's ``input_bytes`` when it reads a
model input: ``kept_bytes``), instead of its ``saved_bytes``, and runs its forward again
in backward (``forward_ms`` more per minibatch). Only a layer that frees bytes,
``gain = saved - kept > 0``, is *recomputable*; the others never are.

Cost model of a stage whose recomputable layers are ``R`` (in layer order) and which
recomputes the first ``k`` of them (Megatron-LM's ``--recompute-method block``, per stage)::

    activations(k) = sum(saved over the stage) - sum(gain over the first k of R)
    transient(k)   = 0 if k == 0 else max(saved over R) / M
    extra_ms(k)    = sum(forward_ms over the first k of R)

A stage holds ``in_flight * activations(k) + transient(k)`` besides its parameter copies
(``planner.memory``): the transient is one micro-batch of the layer being recomputed
(a bound: the largest recomputable layer of the stage, exact for a stage of equal blocks).
The recomputed forward runs inside the stage's backward: ``extra_ms`` adds to its compute.
Selective recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models"): a layer with an attention core (``LayerProfile.selective_saved_bytes``
>= 0) may recompute only that core (scores, softmax, dropout on the scores, scores x V), keeping
``selective_saved`` instead of ``saved`` and adding ``selective_recompute_ms``. A stage under
selective recomputation runs it on every such layer ``S`` of the stage (Megatron's
``--recompute-granularity selective``)::

    activations = sum(saved over the stage) - sum(saved - selective_saved over S)
    transient   = max(saved - selective_saved over S) / M   (one core re-materialised)
    extra_ms    = sum(selective_recompute_ms over S)

Modes: ``none`` (k = 0), ``full`` (k = |R|: every recomputable layer), ``selective`` (S),
``auto`` (the fastest of none, S and every k that fits the device; of the full choices the
least k that fits, as ``extra_ms`` grows with k). A stage never mixes selective and full
recomputation (Megatron's one granularity per run). The DP (``planner.dp``) chooses per
stage, with its split and replicas, among none, S (``SelectiveRanges``) and k: k by
bisection on a chain (memory falls as k grows once k > 0), between 0 and |R| on the cut
states of a DAG (the exact per-stage choice is then made on the placed stages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeplan.errors import InputError
from pipeplan.profile import Profile
from pipeplan.schedules import names_where, or_list, schedule_kind

__all__ = [
    "RECOMPUTE_MODES",
    "StageRecompute",
    "kept_bytes",
    "gain_bytes",
    "stage_options",
    "choose",
    "check_recompute_mode",
    "schedule_recomputes",
    "schedule_plans_recompute",
    "effective_mode",
    "range_extra_ms",
    "least_activation_bytes",
    "selective_option",
    "SelectiveRanges",
    "selective_freed_bytes",
    "planned_on_estimates",
]

RECOMPUTE_MODES = ("auto", "none", "selective", "full")


@dataclass(frozen=True)
class StageRecompute:
    """One choice for a stage: its recomputed layers and what they cost and keep."""

    layers: tuple[int, ...]  # the recomputed layers (the first k recomputable ones)
    extra_ms: float  # their forwards again, per minibatch
    activation_bytes: float  # what the stage keeps per minibatch in flight
    transient_bytes: float  # one micro-batch of the largest recomputable layer (0 when k = 0)
    selective: tuple[int, ...] = ()  # the layers whose attention core only is recomputed


def kept_bytes(profile: Profile) -> list[int]:
    """Per layer: bytes kept under recomputation (module docstring), measured or derived."""
    out = []
    for layer in profile.layers:
        if layer.recompute_kept_bytes >= 0:
            out.append(layer.recompute_kept_bytes)
            continue
        inputs = sum(profile.layers[p].output_bytes for p in dict.fromkeys(layer.inputs))
        out.append(inputs + (profile.input_bytes if layer.model_inputs else 0))
    return out


def gain_bytes(profile: Profile) -> list[float]:
    """Per layer: bytes recomputing it frees per minibatch (0: not recomputable)."""
    return [
        max(0.0, float(layer.saved_bytes - kept)) for layer, kept in zip(profile.layers, kept_bytes(profile))
    ]


def stage_options(
    profile: Profile, layers: Sequence[int], microbatches: int, gains: Sequence[float] | None = None
) -> list[StageRecompute]:
    """The choices k = 0..|R| of a stage of ``layers`` (module docstring); ``gains``: the
    profile's ``gain_bytes`` when already computed. O(layers^2) (O(layers) with ``gains``,
    plus the tuples of recomputed layers)."""
    gains = gain_bytes(profile) if gains is None else gains
    recomputable = [i for i in sorted(layers) if gains[i] > 0]
    saved = float(sum(profile.charged_saved_bytes[i] for i in layers))
    transient = max((profile.layers[i].saved_bytes for i in recomputable), default=0) / microbatches
    out = [StageRecompute((), 0.0, saved, 0.0)]
    extra, freed = 0.0, 0.0
    for k, layer in enumerate(recomputable, start=1):
        extra += profile.layers[layer].forward_ms
        freed += gains[layer]
        out.append(StageRecompute(tuple(recomputable[:k]), extra, saved - freed, transient))
    return out


def selective_freed_bytes(profile: Profile) -> list[float]:
    """Per layer: bytes recomputing its attention core frees per minibatch (0: no core)."""
    return [
        float(layer.saved_bytes - layer.selective_saved_bytes)
        if layer.selective_saved_bytes >= 0 and layer.selective_recompute_ms >= 0
        else 0.0
        for layer in profile.layers
    ]


def selective_option(
    profile: Profile, layers: Sequence[int], microbatches: int, freed: Sequence[float] | None = None
) -> StageRecompute:
    """The selective choice of a stage of ``layers`` (module docstring): every layer with an
    attention core that frees bytes recomputes it. O(layers)."""
    freed = selective_freed_bytes(profile) if freed is None else freed
    chosen = tuple(i for i in sorted(layers) if freed[i] > 0)
    saved = float(sum(profile.charged_saved_bytes[i] for i in layers))
    return StageRecompute(
        (),
        float(sum(profile.layers[i].selective_recompute_ms for i in chosen)),
        saved - sum(freed[i] for i in chosen),
        max((freed[i] for i in chosen), default=0.0) / microbatches,
        chosen,
    )


def choose(
    options: Sequence[StageRecompute], mode: str, fits: Callable[[StageRecompute], bool] | None
) -> StageRecompute | None:
    """The choice ``mode`` makes among a stage's ``options`` (``recompute_choice
    .recompute_candidates``: no recomputation first, ``full``'s and ``selective``'s own choice
    last); ``fits`` says whether a choice fits the device (None: memory unchecked). ``auto``:
    the least extra ms among those that fit (the earliest on ties), None when none fits."""
    if mode == "none":
        return options[0]
    if mode in ("full", "selective"):
        return options[-1]
    if fits is None:
        return options[0]
    return min(
        (option for option in options if fits(option)), key=lambda option: option.extra_ms, default=None
    )


def schedule_recomputes(schedule: str) -> bool:
    """Whether ``pipeplan run`` checkpoints chosen layers under ``schedule``."""
    return schedule_kind(schedule).recomputes_layers


def schedule_plans_recompute(schedule: str, estimated: bool) -> bool:
    """Whether the planner may choose recomputation under ``schedule``: where ``pipeplan
    run`` runs it, and for an ``estimated`` profile (a plan for Megatron-LM) also under
    interleaved 1F1B (chunks, whole backwards, no V: one mode for the whole plan,
    ``planner.interleave``)."""
    kind = schedule_kind(schedule)
    chunked = kind.virtual_stages and not kind.split_backward and not kind.v_shape
    return kind.recomputes_layers or (estimated and chunked)


def check_recompute_mode(
    mode: str, schedule: str, tensor_parallel: int | None, estimated: bool = False
) -> None:
    """One-line ``InputError`` for a mode that is unknown, or that asks recomputation of a
    schedule (or, of a measured profile, a tensor-parallel degree) that does not run it;
    ``auto`` never refuses (it plans none there). ``estimated``: the profile is a what-if
    (``pipeplan estimate``), planned for another engine (``planned_on_estimates``)."""
    if mode not in RECOMPUTE_MODES:
        raise InputError(f"--recompute {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if mode in ("auto", "none"):
        return
    if not schedule_plans_recompute(schedule, estimated):
        allowed = or_list(names_where(lambda kind: kind.recomputes_layers))
        chunked = or_list(
            names_where(lambda kind: schedule_plans_recompute(kind.name, True) and not kind.recomputes_layers)
        )
        raise InputError(
            f"--recompute {mode} with schedule {schedule}: pipeplan plans per-layer recomputation with "
            f"{allowed} (and {chunked} for estimated profiles) only"
        )
    if tensor_parallel not in (None, 1) and not estimated:
        raise InputError(
            f"--recompute {mode} with tensor-parallel degree {tensor_parallel}: pipeplan runs recomputed "
            f"layers of stages without tensor parallelism only (pass --tensor-parallel 1, or plan an "
            f"estimated profile for another engine)"
        )


def planned_on_estimates(estimated: bool, tensor_parallel: int, mixed: bool) -> bool:
    """Whether recomputation may be planned: always for an ``estimated`` profile (a plan for
    another engine: Megatron-LM, torchtitan; ``pipeplan run`` refuses what it does not run),
    else only where pipeplan's runtime runs it (t = 1, no mixed precision: a recomputed
    forward would read the current float32 masters, not the bf16 copy)."""
    return estimated or (tensor_parallel == 1 and not mixed)


def effective_mode(mode: str, schedule: str, tensor_parallel: int, estimated: bool = False) -> str:
    """``mode`` as planned: ``auto`` is ``none`` where the schedule (or, for a measured
    profile, the degree) runs none."""
    if mode == "auto" and (
        not schedule_plans_recompute(schedule, estimated) or (tensor_parallel > 1 and not estimated)
    ):
        return "none"
    return mode


@dataclass(frozen=True)
class SelectiveRanges:
    """Selective recomputation of ranges of cut states (elementwise arrays, one per range):
    the bytes it frees per minibatch, its extra ms, and its transient bytes (already / M)."""

    freed: np.ndarray
    extra_ms: np.ndarray
    transient: np.ndarray

    def at(self, where: tuple) -> SelectiveRanges:
        return SelectiveRanges(self.freed[where], self.extra_ms[where], self.transient[where])

    def bytes(self, saved: np.ndarray, in_flight: float) -> np.ndarray:
        """Activation bytes (in flight plus transient) of ranges that save ``saved``."""
        return in_flight * (saved - self.freed) + self.transient


def range_extra_ms(
    gain: np.ndarray,
    forward_ms: np.ndarray,
    transient: np.ndarray,
    saved: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    in_flight: float,
    spare: np.ndarray,
    mode: str,
    bisect: bool,
    selective: SelectiveRanges | None = None,
) -> np.ndarray:
    """Extra ms of ``mode``'s choice for every range [starts, ends) of cut states, inf where
    none fits ``spare`` bytes (the device's memory less the parameter copies); ``gain`` and
    ``forward_ms`` are sums over the states, ``transient`` and ``saved`` per range.
    ``bisect`` (a chain): every k; else k in {0, |R|}; ``selective``: the ranges' selective
    choice (None: none). O(log range) array passes."""
    full = _full_extra_ms(gain, forward_ms, transient, saved, starts, ends, in_flight, spare, mode, bisect)
    if selective is None or mode in ("none", "full"):
        return full
    selective_ms = np.where(selective.bytes(saved, in_flight) <= spare, selective.extra_ms, np.inf)
    return selective_ms if mode == "selective" else np.minimum(full, selective_ms)


def _full_extra_ms(
    gain: np.ndarray,
    forward_ms: np.ndarray,
    transient: np.ndarray,
    saved: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    in_flight: float,
    spare: np.ndarray,
    mode: str,
    bisect: bool,
) -> np.ndarray:
    """``range_extra_ms`` without the selective choice."""
    freed_all = gain[ends] - gain[starts]
    full_fits = in_flight * (saved - freed_all) + transient <= spare
    if mode == "none":
        return np.where(in_flight * saved <= spare, 0.0, np.inf)
    full_ms = forward_ms[ends] - forward_ms[starts]
    if mode == "full":
        return np.where(full_fits, full_ms, np.inf)
    none_fits = in_flight * saved <= spare
    if not bisect:
        return np.where(none_fits, 0.0, np.where(full_fits, full_ms, np.inf))
    # least state p in (start, end] with the layers before p recomputed fitting (memory falls with p)
    top = len(gain) - 1  # ranges past the last state are no stages (their values are masked)
    low, high = np.minimum(starts + 1, top), np.minimum(np.maximum(ends, starts + 1), top)
    while np.any(open_ := low < high):
        middle = (low + high) // 2
        ok = in_flight * (saved - (gain[middle] - gain[starts])) + transient <= spare
        high, low = np.where(open_ & ok, middle, high), np.where(open_ & ~ok, middle + 1, low)
    part_ms = forward_ms[low] - forward_ms[starts]
    return np.where(none_fits, 0.0, np.where(full_fits, part_ms, np.inf))


def least_activation_bytes(
    gain: np.ndarray,
    transient: np.ndarray,
    saved: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    in_flight: float,
    mode: str,
    selective: SelectiveRanges | None = None,
) -> np.ndarray:
    """The fewest activation bytes (in flight plus transient) ``mode`` lets ranges keep."""
    none = in_flight * saved
    full = in_flight * (saved - (gain[ends] - gain[starts])) + transient
    chosen = selective.bytes(saved, in_flight) if selective is not None else none
    if mode == "none":
        return none
    if mode == "selective":
        return chosen
    return full if mode == "full" else np.minimum(np.minimum(none, full), chosen)
