"""planner.partition on plans with uneven replica counts, which the flush schedules now run."""

from __future__ import annotations

import pytest

from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.partition import partition
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.schedules import build_schedule, validate
from pipeplan.topology import DeviceSpec, Level, Topology


def heavy_middle() -> tuple[Profile, Topology]:
    """Three chained layers, forward 1, 3, 1 ms (backward twice that), the outer two with
    10 MB of weights, on 5 devices at 1 GB/s: the fastest plan gives the middle layer 3 replicas."""
    layers = tuple(
        LayerProfile(
            i,
            str(i),
            "Linear",
            (i - 1,) if i else (),
            forward,
            2 * forward,
            1000,
            10_000_000 if forward < 2 else 1000,
            0,
        )
        for i, forward in enumerate((1.0, 3.0, 1.0))
    )
    profile = Profile("heavy-middle", "heavy_middle.py", DeviceInfo("cpu", "test"), 8, "float32", layers)
    return profile, Topology("flat5", DeviceSpec("d", 1 << 40), (Level("node", 5, 1e9),))


@pytest.mark.parametrize("schedule", ["1f1b-flush", "zb-h1"])
@pytest.mark.parametrize("uniform", [False, True])
def test_uneven_replicas_plan_instead_of_failing(schedule: str, uniform: bool) -> None:
    # Replicas 1, 3, 1 with 4 micro-batches: the old 1F1B-flush / ZB-H1 orders deadlocked
    # there, so partition failed with "schedule 1f1b-flush deadlocks" (and the uniform
    # candidates skipped that plan). Now it is simulated and chosen.
    profile, topology = heavy_middle()
    plan = partition(profile, topology, PartitionOptions(schedule=schedule, microbatches=4, uniform=uniform))
    assert [stage.replicas for stage in plan.stages] == [1, 3, 1]
    assert [(stage.layer_start, stage.layer_end) for stage in plan.stages] == [(0, 1), (1, 2), (2, 3)]
    assert plan.predicted.simulated
    validate(build_schedule(schedule, (1, 3, 1), 2, 4))
