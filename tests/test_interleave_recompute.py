"""Interleaved 1F1B planned with recomputation (``planner.interleave``): one mode for the
whole plan (Megatron's global flags), memory at the schedule's in-flight counts per chunk,
the recomputed forwards in the chunks' backward; refused where pipeplan's own rules refuse it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.plan import Plan
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.schedules import schedule_kind
from pipeplan.topology import DeviceSpec, Level, Topology


def _blocks(estimated: str = "hand-made") -> Profile:
    """4 equal blocks: forward 1 ms, backward 2 ms, output 200 B, 100 B of parameters, 1000 B
    saved, of which recomputing the attention core (0.2 ms) frees 600 B."""
    layers = tuple(
        LayerProfile(
            i,
            f"b{i}",
            "Block",
            (i - 1,) if i else (),
            1.0,
            2.0,
            200,
            100,
            1000,
            selective_saved_bytes=400,
            selective_recompute_ms=0.2,
        )  # fmt: skip
        for i in range(4)
    )
    return Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers, estimated=estimated)


def _plan(memory: int, recompute: str, profile: Profile | None = None) -> Plan:
    topology = Topology("two", DeviceSpec("d", memory), (Level("n", 2, 1e15),))
    options = PartitionOptions(
        schedule="interleaved-1f1b", microbatches=2, virtual_stages=2, optimizer="sgd", recompute=recompute
    )
    return partition(profile or _blocks(), topology, options)


def _device_bytes(plan: Plan) -> list[int]:
    positions = len(plan.stages) // plan.virtual_stages
    return [sum(s.memory_bytes for s in plan.stages[i::positions]) for i in range(positions)]


def test_interleaved_plan_that_fits_only_with_selective_recomputation() -> None:
    """p = 2 devices x v = 2 chunks of one block, M = 2 micro-batches. Device 0 holds both of
    its chunks' whole minibatch at its peak (in flight 1.0, 1.0), device 1 (1.0, 0.5). Per
    chunk: 100 B weights + 100 B gradient (SGD), the device's gradient temporary (its largest
    parameter, 100 B) and recompute transient (one micro-batch of the freed bytes, 600 / 2 =
    300 B) on its first chunk. Device 0 without recomputation: 200 + 1000 + 100 + 200 + 1000
    = 2500 B; selective: 200 + 400 + 100 + 300 + 200 + 400 = 1600 B. Time: every backward
    1.1 ms per micro-batch instead of 1.0; the interleaved order's critical path runs 5
    backwards (last chunk m0, m1, then chunks 2, 1, 0 of m1): 7.5 ms + 5 x 0.1 ms = 8.0 ms."""
    kind = schedule_kind("interleaved-1f1b")
    assert kind.in_flight_by_chunk((1, 1), 0, 2, 2) == (1.0, 1.0)
    assert kind.in_flight_by_chunk((1, 1), 1, 2, 2) == (1.0, 0.5)
    loose = _plan(10**9, "none")
    assert _device_bytes(loose) == [2500, 2000]
    assert loose.predicted.time_per_minibatch_ms == pytest.approx(7.5)
    with pytest.raises(InfeasibleError, match="the smallest needs 2.44 KiB"):
        _plan(2000, "none")
    plan = _plan(2000, "auto")
    assert [s.selective_layers for s in plan.stages] == [(0,), (1,), (2,), (3,)]
    assert all(s.recompute_layers == () for s in plan.stages)
    assert [s.memory_bytes for s in plan.stages] == [1000, 1000, 600, 400]
    assert _device_bytes(plan) == [1600, 1400]
    assert [s.recompute_ms for s in plan.stages] == [pytest.approx(0.2)] * 4
    assert [s.compute_ms for s in plan.stages] == [pytest.approx(3.2)] * 4
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(8.0)
    assert _plan(2000, "selective") == replace(plan, recompute="selective")


def test_full_recomputation_recomputes_every_chunk_layer() -> None:
    """Full: each block keeps its input (the previous block's 200 B output; block 0 nothing),
    transient one micro-batch of a block's saved bytes (1000 / 2 = 500 B); 1 ms more per
    chunk. Device 0: 200 + 0 + 100 + 500 + 200 + 200 = 1200 B."""
    plan = _plan(2000, "full")
    assert [s.recompute_layers for s in plan.stages] == [(0,), (1,), (2,), (3,)]
    assert [s.memory_bytes for s in plan.stages] == [800, 1000, 400, 300]
    assert [s.compute_ms for s in plan.stages] == [pytest.approx(4.0)] * 4
    assert _plan(2000, "auto").predicted.time_per_minibatch_ms < plan.predicted.time_per_minibatch_ms


@pytest.mark.parametrize("memory", [1700, 2000, 2200, 2500, 10**9])
def test_auto_is_never_slower_than_none(memory: int) -> None:
    auto = _plan(memory, "auto")
    try:
        none = _plan(memory, "none")
    except InfeasibleError:
        return
    assert auto.predicted.time_per_minibatch_ms <= none.predicted.time_per_minibatch_ms * (1 + 1e-9)
    assert not any(s.selective_layers or s.recompute_layers for s in auto.stages)  # none fits: none


def test_measured_profiles_refuse_recomputation_under_interleaving() -> None:
    measured = _blocks(estimated="")
    with pytest.raises(InputError) as caught:
        _plan(2000, "selective", measured)
    assert "\n" not in str(caught.value) and "interleaved-1f1b" in str(caught.value)
    plan = _plan(10**9, "auto", measured)  # auto plans none where pipeplan does not run it
    assert not any(s.selective_layers or s.recompute_layers for s in plan.stages)
    with pytest.raises(InfeasibleError):
        _plan(2000, "auto", measured)
