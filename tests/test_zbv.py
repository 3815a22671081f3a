"""ZB-V: two chunks per device in a V (Qi et al., ICLR 2024, section 6): its order, memory,
placement, simulation and the V's pipeline order."""

from __future__ import annotations

import pytest
from test_simulate import make_profile, make_topology

from pipeplan.errors import InputError
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.simulate import simulate_plan, stage_costs
from pipeplan.schedules import SCHEDULE_KINDS, build_schedule, grid, peak_in_flight, validate

# 2 devices, 3 micro-batches (fewer than the 2P - 1 = 3 of a full V: none dropped here):
# device 0 runs chunk 0 (the first layers) and chunk 1 (the last), device 1 the two middle
# chunks back to back; "W" fills what 1F1B leaves idle
ZBV_2x3 = """\
step  s0r0    s1r0
   0  F0.0c0  .
   1  F0.1c0  F0.0c0
   2  F0.2c0  F0.0c1
   3  F0.0c1  F0.1c0
   4  I0.0c1  F0.1c1
   5  W0.0c1  I0.0c1
   6  F0.1c1  W0.0c1
   7  I0.1c1  F0.2c0
   8  W0.1c1  I0.0c0
   9  I0.0c0  W0.0c0
  10  W0.0c0  F0.2c1
  11  F0.2c1  I0.1c1
  12  I0.2c1  W0.1c1
  13  W0.2c1  I0.1c0
  14  I0.1c0  I0.2c1
  15  W0.1c0  I0.2c0
  16  I0.2c0  W0.1c0
  17  W0.2c0  W0.2c1
  18  .       W0.2c0"""


def test_grid_of_two_devices() -> None:
    schedule = build_schedule("zb-v", (1, 1), 1, 3, 2)
    validate(schedule)
    assert grid(schedule) == ZBV_2x3
    assert schedule.pipeline_order() == (0, 1, 3, 2)


@pytest.mark.parametrize("positions", [2, 4, 8])
def test_every_device_holds_one_f1b_first_stages_activations(positions: int) -> None:
    """At its peak every device holds 2P chunk-micro-batches, each half a 1F1B stage: P whole
    ones, 1F1B's first stage's, on every device alike (the paper's memory claim)."""
    micro = 4 * positions
    schedule = build_schedule("zb-v", (1,) * positions, 1, micro, 2)
    assert [peak_in_flight(schedule.actions[(i, 0)]) for i in range(positions)] == [2 * positions] * positions
    kind = SCHEDULE_KINDS["zb-v"]
    assert kind.in_flight_by_chunk((1,) * positions, 0, micro, 2) == (
        (2 * positions - 1) / micro,  # chunk 0 forwards ahead, chunk 1 (the loss) one at a time
        1 / micro,
    )


def test_rules_two_chunks_and_any_micro_batch_count() -> None:
    kind = SCHEDULE_KINDS["zb-v"]
    kind.check((1, 1, 1), 5, 2)  # no Megatron multiple: 5 on 3 devices
    with pytest.raises(InputError, match=r"zb-v runs exactly 2 chunks per device in a V \(got 3\)"):
        kind.check((1, 1, 1), 6, 3)


def test_v_placement_mirrors_the_layers_and_runs_without_a_bubble() -> None:
    """16 equal layers (F = I = W) on 4 devices: chunk 1 of device i holds piece 7 - i; the
    period is the ideal (no bubble at all, the paper's (p - 1)(T_F + T_I - 2 T_W) = 0), below
    ZB-H1's and 1F1B's, and every device holds 1F1B's first stage's memory."""
    profile = make_profile([1.0] * 16, param_bytes=1000, saved_bytes=2**20)
    topology = make_topology(per_server=4, servers=1)
    plans = {
        name: partition(profile, topology, PartitionOptions(schedule=name, microbatches=8, straight=True))
        for name in ("zb-v", "zb-h1", "1f1b-flush")
    }
    zbv = plans["zb-v"]
    assert [stage.layers for stage in zbv.stages] == [
        (0, 1), (2, 3), (4, 5), (6, 7), (14, 15), (12, 13), (10, 11), (8, 9)
    ]  # fmt: skip
    assert [stage.ranks for stage in zbv.stages] == [(i % 4,) for i in range(8)]
    # the simulator's pipeline-order edges follow the V: 3 -> 7 -> 6 -> 5 -> 4
    sends = [cost.sends for cost in stage_costs(zbv, profile)]
    assert [sends[q][0][0] for q in (0, 1, 2, 3, 7, 6, 5)] == [1, 2, 3, 7, 6, 5, 4] and sends[4] == ()
    result = {name: simulate_plan(plan, profile) for name, plan in plans.items()}
    assert result["zb-v"].time_per_minibatch_ms == pytest.approx(16 * 3.0 / 4, rel=1e-12)
    assert result["zb-h1"].time_per_minibatch_ms == pytest.approx(13.5, rel=1e-12)
    assert result["1f1b-flush"].time_per_minibatch_ms == pytest.approx(16.5, rel=1e-12)
    first = result["1f1b-flush"].device_memory_bytes[0]
    assert result["zb-v"].device_memory_bytes == (first,) * 4


def test_auto_chooses_zb_v_among_the_flush_schedules_when_it_pays() -> None:
    """`--schedule auto` over the exact-gradient schedules on 16 equal layers (F = I = W) and
    4 devices: zb-v reaches the ideal 12 ms at 8 micro-batches, which no other flush
    schedule does at any count tried, so it is chosen; every zb-v candidate has v = 2."""
    from pipeplan.planner.auto import search

    profile = make_profile([1.0] * 16, param_bytes=1000, saved_bytes=2**20)
    found = search(
        profile,
        make_topology(per_server=4, servers=1),
        PartitionOptions(straight=True),
        ("1f1b-flush", "gpipe", "interleaved-1f1b", "zb-h1", "zb-v"),
    )
    assert found.plan.schedule == "zb-v" and found.plan.virtual_stages == 2
    assert found.plan.predicted.time_per_minibatch_ms == pytest.approx(12.0, rel=1e-9)
    assert {c.virtual_stages for c in found.candidates if c.schedule == "zb-v"} == {2}
