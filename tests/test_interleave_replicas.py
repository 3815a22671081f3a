"""Interleaved 1F1B planned on replicas (PTD-P): p positions x d replicas x v chunks.

A hand-computed case (equal layers, no parameters: the period is a lane's work plus
Megatron's bubble (p - 1) / (v m), m = M / d micro-batches per pipeline), the all-reduce
priced on the replica group's links, the chunk cuts against brute force, and the refusals.
"""

from __future__ import annotations

import itertools
import random

import pytest
from test_simulate import make_profile, make_topology

from pipeplan.errors import InputError
from pipeplan.planner.costs import ring_allreduce_ms
from pipeplan.planner.interleave import balanced_cuts, pipeline_shapes
from pipeplan.planner.partition import PartitionOptions, partition, plan_uniform
from pipeplan.planner.simulate import simulate_plan
from pipeplan.schedules import build_schedule, schedule_kind, validate

# 16 equal layers (1 ms forward, 2 ms backward), no parameters, nothing sent: 48 ms of work
EQUAL = make_profile([1.0] * 16)


def interleaved(micro: int, virtual: int = 2, **extra: object) -> PartitionOptions:
    return PartitionOptions(schedule="interleaved-1f1b", microbatches=micro, virtual_stages=virtual, **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("micro, virtual", [(4, 2), (8, 2), (8, 4)])
def test_replicas_shorten_the_bubble_as_megatron_counts_it(micro: int, virtual: int) -> None:
    """4 devices: p x d = 4 x 1 runs m = M micro-batches per pipeline, 2 x 2 runs M / 2
    on half the positions: 12 ms of work per lane either way, bubble (p - 1) / (v m)."""
    topology = make_topology(per_server=4, servers=1)
    plan = partition(EQUAL, topology, interleaved(micro, virtual))
    expected = {
        (p, d): 12.0 * (1 + (p - 1) / (virtual * micro / d))
        for p, d in ((4, 1), (2, 2))
        if (micro // d) % p == 0
    }
    best = min(expected, key=expected.__getitem__)
    p, d = best
    assert [s.replicas for s in plan.stages] == [d] * (p * virtual)
    assert [s.ranks for s in plan.stages] == [
        tuple(range(q % p * d, q % p * d + d)) for q in range(p * virtual)
    ]
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(expected[best], rel=1e-9)
    # the default window (8 minibatches) predicts what one minibatch did
    assert simulate_plan(plan, EQUAL).time_per_minibatch_ms == pytest.approx(expected[best], rel=1e-9)


def test_hand_computed_two_by_two() -> None:
    """p = 2, d = 2, v = 2, M = 8: each replica runs 4 micro-batches, Megatron's bubble
    (2 - 1) / (2 * 4) = 1/8 of its 12 ms: 13.5 ms, against 4 x 1's 12 (1 + 3/16) = 14.25."""
    plan = partition(EQUAL, make_topology(per_server=4, servers=1), interleaved(8))
    assert len(plan.stages) == 4 and plan.stages[0].replicas == 2
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(13.5, rel=1e-9)
    straight = partition(EQUAL, make_topology(per_server=4, servers=1), interleaved(8, straight=True))
    assert straight.predicted.time_per_minibatch_ms == pytest.approx(14.25, rel=1e-9)
    # every replica's order is Megatron's for its own 4 micro-batches (m = r mod 2)
    schedule = build_schedule("interleaved-1f1b", (2, 2), 1, 8, 2)
    validate(schedule)
    alone = build_schedule("interleaved-1f1b", (1, 1), 1, 4, 2)
    for (position, replica), actions in schedule.actions.items():
        mine = [(a.kind, a.microbatch, a.chunk) for a in actions if a.kind != "S"]
        lane = [
            (a.kind, 2 * a.microbatch + replica, a.chunk)
            for a in alone.actions[(position, 0)]
            if a.kind != "S"
        ]
        assert mine == lane and actions[-1].kind == "S"


def test_allreduce_priced_on_the_replica_groups_links() -> None:
    """Position i on ranks 2i, 2i + 1 of one server (100 GB/s inside, 1 GB/s between): each
    chunk all-reduces its 1 MB per layer over the server's link, not the cluster's."""
    profile = make_profile([1.0] * 8, param_bytes=2**20)
    topology = make_topology(per_server=2, servers=2)
    plan = plan_uniform(profile, topology, interleaved(8), 1, 2)
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3), (0, 1), (2, 3)]
    for stage in plan.stages:
        grad = stage.layer_end - stage.layer_start
        assert stage.allreduce_ms == pytest.approx(ring_allreduce_ms(grad * 2**20, 2, 100e9, 0.0))
    # a lane's 24 / 4 = 6 ms of work, bubble (p - 1) / (v m) = 1/8, then at the flush ("S")
    # the device's two chunks all-reduce one after the other, 2 layers of 1 MiB each
    reduce = ring_allreduce_ms(2 * 2**20, 2, 100e9, 0.0)
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(6.0 * (1 + 1 / 8) + 2 * reduce, rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_chunk_cuts_match_brute_force(seed: int) -> None:
    """``balanced_cuts``: the smallest largest chunk over every way to cut n layers into k."""
    rng = random.Random(seed)
    n, k = rng.randint(4, 9), rng.randint(2, 4)
    costs = [rng.choice([0.5, 1.0, 2.0, 3.0, 7.0]) for _ in range(n)]
    cuts = balanced_cuts(costs, k)
    assert (
        len(cuts) == k + 1 and cuts[0] == 0 and cuts[-1] == n and all(a < b for a, b in zip(cuts, cuts[1:]))
    )
    largest = max(sum(costs[a:b]) for a, b in zip(cuts, cuts[1:]))
    brute = min(
        max(sum(costs[a:b]) for a, b in zip((0, *inner), (*inner, n)))
        for inner in itertools.combinations(range(1, n), k - 1)
    )
    assert largest == pytest.approx(brute, rel=1e-9)


def test_search_covers_every_shape() -> None:
    """The planner's plan is the fastest of every (p, d) and v it lists, each planned alone."""
    profile = make_profile([1.0, 1.0, 3.0, 1.0, 2.0, 1.0, 1.0, 4.0], param_bytes=2**18)
    topology = make_topology(per_server=2, servers=2)
    options = interleaved(8, virtual=None)  # type: ignore[arg-type]
    plan = partition(profile, topology, options)
    times = []
    for p, d in pipeline_shapes(4, 8, options):
        for v in (2, 3, 4):
            if v * p > 8 or (8 // d) % p:
                continue
            one = partition(profile, make_topology(per_server=2, servers=2), interleaved(8, v, max_stages=p))
            if len(one.stages) // v == p:
                times.append(one.predicted.time_per_minibatch_ms)
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(min(times), rel=1e-9)


def test_refusals_name_the_counts() -> None:
    kind = schedule_kind("interleaved-1f1b")
    with pytest.raises(
        InputError, match=r"micro-batches per pipeline \(4 / 2 replicas\) to be a multiple of the 4"
    ):
        kind.check((2, 2, 2, 2), 4, 2)
    kind.check((2, 2), 4, 2)  # 2 per pipeline on 2 positions
    topology = make_topology(per_server=4, servers=1)
    with pytest.raises(InputError, match=r"micro-batches \(2\) to be a multiple of the 4 pipeline positions"):
        partition(EQUAL, topology, interleaved(2))  # 4 x 1 and 2 x 2 (1 per pipeline) both break the rule
    with pytest.raises(InputError, match="needs at least 2 devices and 4 layers"):
        partition(make_profile([1.0] * 3), topology, interleaved(4))


def test_work_bound_is_below_every_simulated_period() -> None:
    """``_fastest`` stops simulating at a bound above the best: the bound must never exceed a
    period (here on unequal layers with parameters, where all-reduces and the bubble add)."""
    from pipeplan.planner.costs import layer_arrays
    from pipeplan.planner.interleave import _work_bound_ms, interleaved_plan
    from pipeplan.planner.predict import predict

    profile = make_profile([1.0, 1.0, 3.0, 1.0, 2.0, 1.0, 1.0, 4.0], param_bytes=2**18)
    topology = make_topology(per_server=2, servers=2)
    arrays = layer_arrays(profile, "sgd")
    checked = 0
    for p, d in pipeline_shapes(4, 8, interleaved(8)):
        for v in (2, 3, 4):
            if v * p > 8:
                continue
            plan, _ = interleaved_plan(profile, topology, interleaved(8, v), arrays, p, v, replicas=d)
            assert plan is not None
            period = predict(plan, profile).predicted.time_per_minibatch_ms
            assert 0 < _work_bound_ms(plan, profile) <= period * (1 + 1e-12)
            checked += 1
    assert checked == 4  # (4, 1) x v = 2; (2, 2) x v = 2, 3, 4
