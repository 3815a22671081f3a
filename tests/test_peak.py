"""pipeplan/schedules/peak.py: the moment a worker's held activations peak, the one rule the
planner's memory and the simulator read, against a plain loop over the actions."""

from __future__ import annotations

import random

import pytest

from pipeplan.errors import InputError
from pipeplan.schedules import SCHEDULE_NAMES, Action, schedule_kind
from pipeplan.schedules.peak import ChunkWeights, units_at_peak


def _loop_peak(
    actions: list[Action], chunks: int, weights: ChunkWeights | None
) -> tuple[list[int], list[int]]:
    """The rule, one action at a time: a unit is held from its F to its B (or W), deferred from
    its I to its W; the first strict maximum of (units, deferred) or of the weighted bytes."""
    held: dict[tuple[int, int, int], int] = {}
    deferred: set[tuple[int, int, int]] = set()
    best: tuple[list[int], list[int]] = ([0] * chunks, [0] * chunks)
    peak: tuple[float, ...] = (0, 0) if weights is None else (0.0,)
    for action in actions:
        key = (action.minibatch, action.microbatch, action.chunk)
        if action.kind == "F":
            held[key] = action.chunk
        elif action.kind == "I":
            deferred.add(key)
        elif action.kind in ("B", "W"):
            held.pop(key, None)
            deferred.discard(key)
        if weights is None:
            now: tuple[float, ...] = (len(held), len(deferred))
        else:
            now = (sum(weights[0][c] for c in held.values()) + sum(weights[1][held[k]] for k in deferred),)
        if now > peak:
            peak = now
            best = (
                [sum(1 for c in held.values() if c == chunk) for chunk in range(chunks)],
                [sum(1 for k in deferred if held[k] == chunk) for chunk in range(chunks)],
            )
    return best


def _cases() -> list[tuple[str, tuple[int, ...], int, int]]:
    cases = []
    for name in SCHEDULE_NAMES:
        kind = schedule_kind(name)
        virtual = 2 if kind.virtual_stages else 1
        for depth, micro in ((2, 4), (3, 6), (4, 8)):
            for count in (micro, 1):  # a schedule of whole minibatches runs one micro-batch
                try:
                    kind.check((1,) * depth, count, virtual, 2)
                except InputError:
                    continue
                cases.append((name, (1,) * depth, count, virtual))
                break
    assert len(cases) == 3 * len(SCHEDULE_NAMES)
    return cases


@pytest.mark.parametrize(("name", "replicas", "micro", "virtual"), _cases())
def test_units_at_peak_is_the_loop_on_every_schedule(
    name: str, replicas: tuple[int, ...], micro: int, virtual: int
) -> None:
    kind = schedule_kind(name)
    rng = random.Random(f"{name}{len(replicas)}")
    checked = 0
    for (position, _), actions in kind.actions(replicas, 2, micro, virtual).items():
        for weights in (None, *(_random_weights(rng, virtual) for _ in range(3))):
            assert units_at_peak(list(actions), virtual, weights) == _loop_peak(
                list(actions), virtual, weights
            ), (
                position,
                weights,
            )
            checked += 1
    assert checked == 4 * len(replicas)


def _random_weights(rng: random.Random, chunks: int) -> ChunkWeights:
    return (
        tuple(float(rng.choice([1, 3, 8, 40])) for _ in range(chunks)),
        tuple(float(rng.choice([0, 2, 8, 100])) for _ in range(chunks)),
    )


def test_nothing_held_is_no_peak() -> None:
    assert units_at_peak([], 2) == ([0, 0], [0, 0])
    assert units_at_peak([Action.parse("S0")], 1, ((5.0,), (0.0,))) == ([0], [0])


def test_a_kind_of_more_than_one_letter_is_refused() -> None:
    class Odd:
        kind, chunk = "FB", 0

    with pytest.raises(InputError, match="one letter each"):
        units_at_peak([Odd()], 1)  # type: ignore[list-item]
