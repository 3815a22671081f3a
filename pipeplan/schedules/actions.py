"""Schedules as data: the actions a worker runs, the ``Schedule`` that orders them, and the counts they share.

A worker is ``(position, replica)``: pipeline position p (a group of devices) and a
replica in it. A schedule maps every worker to its ordered tuple of ``Action``s; the
simulator, the runtime and the timeline all read the same schedule, so every schedule
can be checked on the CPU without processes.

Virtual stages (interleaved 1F1B): with P positions and v chunks per device there are
v*P model stages; an action with chunk c on position i belongs to model stage c*P + i.
Without virtual stages (v = 1) position and model stage coincide.

Routing rule (PipeDream): work unit ``u = minibatch * microbatches + microbatch`` runs
on replica ``u % replicas[p]`` of every position p. Route by this global id, never by a
counter local to a rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipeplan.errors import InputError

__all__ = [
    "ACTION_KINDS",
    "Action",
    "Schedule",
    "Worker",
    "interleaved_warmup",
    "label",
    "noam",
    "peak_in_flight",
    "replica_lanes",
    "v_segment",
    "warmup_forwards",
]

ACTION_KINDS = ("F", "B", "I", "W", "S")
Worker = tuple[int, int]  # (position, replica)


# --------------------------------------------------------------------------- counts


def noam(stage_replicas: Sequence[int]) -> int:
    """Minibatches in flight in the whole 1F1B-RR pipeline: ceil(workers / replicas of stage 0)."""
    return math.ceil(sum(stage_replicas) / stage_replicas[0])


def warmup_forwards(stage_replicas: Sequence[int], stage: int) -> int:
    """W_s: extra forwards a replica of ``stage`` admits in 1F1B-RR (PipeDream's warm-up).

    The replica runs W_s + 1 forwards before its first backward, so W_s + 1 minibatches
    (and, with weight stashing, W_s + 1 weight versions) are in flight on it.

    PipeDream: ceil(R / n_0) - 1 for the input stage and
    floor((R - 1 - sum_{i<s} n_i) / n_s) for stage s > 0, with R the total workers.

    >>> [warmup_forwards([1, 1, 1, 1], s) for s in range(4)]
    [3, 2, 1, 0]
    >>> [warmup_forwards([2, 1, 1], s) for s in range(3)]
    [1, 1, 0]
    """
    workers = sum(stage_replicas)
    if stage == 0:
        return noam(stage_replicas) - 1
    before = sum(stage_replicas[:stage])
    return max(0, (workers - 1 - before) // stage_replicas[stage])


def interleaved_warmup(positions: int, position: int, virtual_stages: int) -> int:
    """Megatron's warm-up of interleaved 1F1B: forward chunk-micro-batches before the first B.

    (P - i - 1) * 2 + (v - 1) * P on position i of P, with v chunks per device (before
    capping at the v * m chunk-micro-batches of a minibatch).

    >>> [interleaved_warmup(4, i, 2) for i in range(4)]
    [10, 8, 6, 4]
    """
    return (positions - position - 1) * 2 + (virtual_stages - 1) * positions


def replica_lanes(replicas: Sequence[int], microbatches: int) -> int:
    """d when every position runs on d replicas and d divides the micro-batches (PTD-P's
    data parallelism: d copies of the pipeline, replica r of every position running the
    micro-batches m = r mod d), else 1.

    >>> replica_lanes((2, 2), 8), replica_lanes((2, 1), 8), replica_lanes((2, 2), 3)
    (2, 1, 1)
    """
    d = replicas[0]
    return d if d > 1 and all(n == d for n in replicas) and microbatches % d == 0 else 1


def v_segment(stage: int, positions: int) -> int:
    """The place of model stage ``stage`` (chunk * P + position) along the layers in a V.

    V placement (ZB-V): position i holds segments i and 2P - 1 - i of the 2P segments of
    the layer chain, so model stage q < P is segment q and q = P + i is segment 2P - 1 - i.

    >>> [v_segment(q, 4) for q in range(8)]
    [0, 1, 2, 3, 7, 6, 5, 4]
    """
    return stage if stage < positions else 3 * positions - 1 - stage


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most units (chunk-micro-batches) whose activations are held at once.

    A unit holds its activations from its "F" until its "B", or until its "W" when the
    backward is split (the weight gradient still reads the saved inputs). O(actions).

    >>> peak_in_flight([Action.parse(t) for t in "F0 F0.1 B0 F0.2 I0.1 W0.1 B0.2".split()])
    2
    """
    outstanding = peak = 0
    for action in actions:
        outstanding += (action.kind == "F") - (action.kind in ("B", "W"))
        peak = max(peak, outstanding)
    return peak


# --------------------------------------------------------------------------- actions


_ACTION_RE = re.compile(r"^([FBIWS])(\d+)(?:\.(\d+))?(?:c(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One step of one worker.

    ``kind``: "F" forward, "B" whole backward, "I" backward to the stage inputs only,
    "W" weight gradients of an earlier "I", "S" optimizer step (all-reduces the
    gradients among the position's replicas, then steps the optimizer of every chunk).
    ``minibatch`` is the global minibatch id, ``microbatch`` the micro-batch inside it,
    ``chunk`` the model chunk on the device (model stage ``chunk * P + position``).

    >>> str(Action("F", 3)), str(Action("B", 3, 1)), str(Action("S", 3)), str(Action("I", 0, 2, 1))
    ('F3', 'B3.1', 'S3', 'I0.2c1')
    >>> Action.parse("W3.1c2")
    Action(kind='W', minibatch=3, microbatch=1, chunk=2)
    """

    kind: str
    minibatch: int
    microbatch: int = 0
    chunk: int = 0

    def __str__(self) -> str:
        text = f"{self.kind}{self.minibatch}"
        if self.microbatch:
            text += f".{self.microbatch}"
        if self.chunk:
            text += f"c{self.chunk}"
        return text

    @classmethod
    def parse(cls, text: str) -> Action:
        """Invert ``str``: "F3" -> Action("F", 3); "B3.1c1" -> Action("B", 3, 1, 1)."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise InputError(f"cannot parse action {text!r} (expected e.g. 'F3', 'B3.1', 'I0.2c1', 'S3')")
        kind, minibatch, microbatch, chunk = match.groups()
        return cls(kind, int(minibatch), int(microbatch or 0), int(chunk or 0))


@dataclass(frozen=True)
class Schedule:
    """Every worker's ordered actions; indexed by ``(position, replica)``.

    Work unit ``u = minibatch * microbatches + microbatch`` runs on replica
    ``u % stage_replicas[p]`` of position p. ``stage_replicas`` has one entry per
    pipeline position; with ``virtual_stages`` v each position holds v model chunks.
    """

    name: str  # one of SCHEDULE_NAMES (pipeplan.plan)
    stage_replicas: tuple[int, ...]  # per pipeline position
    minibatches: int
    microbatches: int
    actions: dict[Worker, tuple[Action, ...]]  # (position, replica) -> ordered actions
    virtual_stages: int = 1  # model chunks per device
    v_shape: bool = False  # chunk 1 of position i holds the mirrored layers (``v_segment``)

    def pipeline_order(self) -> tuple[int, ...]:
        """Model stages in the order the layers run through them (q + 1 after q, or the V).

        >>> Schedule("zb-v", (1, 1), 1, 2, {}, 2, v_shape=True).pipeline_order()
        (0, 1, 3, 2)
        """
        stages = self.model_stages
        if not self.v_shape:
            return tuple(range(stages))
        return tuple(sorted(range(stages), key=lambda q: v_segment(q, self.stages)))

    @property
    def stages(self) -> int:
        """Pipeline positions (device groups)."""
        return len(self.stage_replicas)

    @property
    def model_stages(self) -> int:
        """Model stages: positions * virtual stages."""
        return len(self.stage_replicas) * self.virtual_stages

    def model_stage(self, position: int, chunk: int) -> int:
        """Model stage that ``chunk`` on ``position`` runs: chunk * positions + position."""
        return chunk * self.stages + position

    @property
    def workers(self) -> list[Worker]:
        """All workers, position-major: (0, 0), (0, 1), ..., (P-1, n-1)."""
        return [(s, r) for s, n in enumerate(self.stage_replicas) for r in range(n)]

    def replica_of(self, stage: int, minibatch: int, microbatch: int = 0) -> int:
        """Replica of position ``stage`` that runs the unit (minibatch, microbatch)."""
        unit = minibatch * self.microbatches + microbatch
        return unit % self.stage_replicas[stage]


def label(worker: Worker) -> str:
    """A worker as written in grids and messages: s<position>r<replica>."""
    return f"s{worker[0]}r{worker[1]}"
