"""What one checkpoint of each stage writes, and how long the write takes (CheckFreq's cost).

A checkpoint (``pipeplan.runtime.checkpoint.state``) holds each stage's parameters once (its
first replica writes them; a tensor-parallel group gathers them to its first rank) with the
optimizer state of each, in the master dtype under mixed precision, so the stage's writing
rank writes::

    checkpoint_bytes = param_bytes * master/compute ratio * (1 + optimizer states)

(the other replicas write their RNG state only). Buffers, the scheduler and RNG states are
a few KB and not counted; a weight tied between two layers of one stage is counted in both
(the profile gives bytes per layer, not per tensor), so the figure is an upper bound there.

The write takes ``checkpoint_bytes / storage bandwidth`` when the topology gives one
(``storage: {bandwidth: ...}``); every stage writes at once, so a checkpoint lasts as long
as its largest stage's write. Without a storage bandwidth only the bytes are predicted.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeplan.planner.memory import optimizer_states
from pipeplan.precision import Precision
from pipeplan.profile import Profile

__all__ = ["checkpoint_bytes", "checkpoint_write_ms"]


def checkpoint_bytes(profile: Profile, layers: Iterable[int], optimizer: str, precision: Precision) -> int:
    """Bytes one checkpoint of the stage running ``layers`` writes (module docstring).

    >>> from pipeplan.profile import DeviceInfo, LayerProfile
    >>> layer = LayerProfile(0, "fc", "Linear", (), 1.0, 2.0, 8, 400, 8)
    >>> one = Profile("m", "f", DeviceInfo("cpu", "x"), 4, "float32", (layer,))
    >>> checkpoint_bytes(one, [0], "adam", Precision("float32"))  # weights + 2 moments
    1200
    >>> checkpoint_bytes(one, [0], "adam", Precision("bfloat16", "float32"))  # in float32
    2400
    """
    param_bytes = sum(profile.layers[i].param_bytes for i in layers)
    ratio = precision.gradient_ratio  # master bytes per compute byte (1 without mixed precision)
    return round(param_bytes * ratio * (1 + optimizer_states(optimizer)))


def checkpoint_write_ms(stage_bytes: Iterable[int], storage_bytes_per_s: float) -> float:
    """ms one checkpoint takes to write: its largest stage's bytes at ``storage_bytes_per_s``
    (each writing rank at that rate); 0.0 when no bandwidth is given.

    >>> checkpoint_write_ms([10**9, 2 * 10**9], 1e9)
    2000.0
    """
    if storage_bytes_per_s <= 0:
        return 0.0
    return 1000.0 * max(stage_bytes, default=0) / storage_bytes_per_s
