"""The recomputation choices of a stage (``planner.recompute``): what ``partition``,
interleaving and brute force choose among."""

from __future__ import annotations

from collections.abc import Sequence

from pipeplan.planner.recompute import StageRecompute, selective_option, stage_options
from pipeplan.profile import Profile

__all__ = ["recompute_candidates"]


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
        return [StageRecompute((), 0.0, float(sum(profile.charged_saved_bytes[i] for i in layers)), 0.0)]
    options = stage_options(profile, layers, microbatches, gains)
    if mode == "full":
        return options
    chosen = selective_option(profile, layers, microbatches)
    return [options[0], chosen] if mode == "selective" else [*options, chosen]
