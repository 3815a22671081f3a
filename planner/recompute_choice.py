"""A placed stage's recomputation with its exact memory (``planner.recompute``'s choice, on
``planner.memory``'s rule): what ``partition`` records per stage and brute force prices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeplan.planner.memory import plan_stage_memory
from pipeplan.planner.recompute import StageRecompute, choose, selective_option, stage_options
from pipeplan.precision import Precision
from pipeplan.profile import Profile

__all__ = ["StageChoice", "choose_for_stage", "recompute_candidates"]


@dataclass(frozen=True)
class StageChoice:
    """A placed stage's recomputation and its exact memory (``choose_for_stage``)."""

    recompute: StageRecompute | None  # None: no choice fits (``auto``)
    memory_bytes: int  # of the choice (of no recomputation when none fits)
    weight_versions: int
    in_flight: float


def choose_for_stage(
    profile: Profile,
    layers: Sequence[int],
    schedule: str,
    replicas: Sequence[int],
    stage: int,
    optimizer: str,
    microbatches: int,
    precision: Precision,
    largest_param_bytes: float,
    mode: str,
    memory_limit: float | None,
    gains: Sequence[float] | None = None,
) -> StageChoice:
    """``mode``'s choice for stage ``stage`` of a placed pipeline (``replicas`` per stage),
    with its memory exact for the schedule's in-flight count (``planner.memory``);
    ``memory_limit`` None: memory unchecked; ``gains``: the profile's ``gain_bytes`` when
    already computed. O(layers) with ``gains``."""
    params = float(sum(profile.layers[i].param_bytes for i in layers))

    def memory(option: StageRecompute) -> tuple[int, int, float]:
        return plan_stage_memory(
            schedule,
            replicas,
            stage,
            params,
            option.activation_bytes,
            optimizer,
            microbatches,
            precision=precision,
            largest_param_bytes=largest_param_bytes,
            transient_bytes=option.transient_bytes,
        )

    options = recompute_candidates(profile, layers, microbatches, mode, gains)
    fits = None if memory_limit is None else (lambda option: memory(option)[0] <= memory_limit)
    chosen = choose(options, mode, fits)
    bytes_, versions, in_flight = memory(chosen if chosen is not None else options[0])
    return StageChoice(chosen, bytes_, versions, in_flight)


def recompute_candidates(
    profile: Profile,
    layers: Sequence[int],
    microbatches: int,
    mode: str,
    gains: Sequence[float] | None = None,
) -> list[StageRecompute]:
    """The choices ``mode`` picks among for a stage of ``layers``, no recomputation first
    (``recompute.choose``): ``none`` only that; ``full`` ``stage_options`` (k = 0..|R|);
    ``selective`` that and the selective choice; ``auto`` all of them."""
    if mode == "none":
        return [StageRecompute((), 0.0, float(sum(profile.layers[i].saved_bytes for i in layers)), 0.0)]
    options = stage_options(profile, layers, microbatches, gains)
    if mode == "full":
        return options
    chosen = selective_option(profile, layers, microbatches)
    return [options[0], chosen] if mode == "selective" else [*options, chosen]
