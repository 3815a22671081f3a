"""V-Half, V-Min (controllable memory) and DualPipeV: their orders, memory per rank, planning.

Memory is counted in chunk-micro-batches held from "F" to "W" (or "B"); a chunk is half a
1F1B stage, so 2 chunk-micro-batches hold as much as one 1F1B stage-micro-batch.
"""

from __future__ import annotations

import dataclasses
import doctest

import pytest
from test_simulate import make_profile, make_topology

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.planner.auto import search
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.simulate import simulate_plan
from pipeplan.schedules import SCHEDULE_KINDS, build_schedule, v_orders, validate

V_KINDS = ("v-half", "v-min", "dualpipev")


def test_doctests() -> None:
    result = doctest.testmod(v_orders)
    assert result.attempted >= 4 and result.failed == 0


def _flat(action: object) -> list[str]:
    """torch's action as its compute steps: an overlapped F/B pair as its F, then its B."""
    subs = getattr(action, "sub_actions", None)
    return [str(a) for a in subs] if subs else [str(action)]


@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 11)])
def test_dualpipev_is_torchs_own_order(ranks: int, microbatches: int) -> None:
    """Each rank's compute order equals the one torch's ScheduleDualPipeV computes itself:
    chunk 1 on rank r is torch's stage 2 * ranks - 1 - r; "B" is its FULL_BACKWARD."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    theirs_schedule = object.__new__(ScheduleDualPipeV)  # its order alone, without stages or a group
    theirs_schedule.pp_group_size = ranks
    theirs_schedule.num_stages = 2 * ranks
    theirs_schedule._n_microbatches = microbatches
    for rank in range(ranks):
        theirs = [s for a in theirs_schedule._calculate_single_rank_operations(rank) if a for s in _flat(a)]
        stage = {0: rank, 1: 2 * ranks - 1 - rank}
        ours = [f"{stage[c]}{k}{m}" for k, m, c in v_orders.dualpipev_order(ranks, rank, microbatches)]
        assert ours == theirs


@pytest.mark.parametrize("name", V_KINDS)
@pytest.mark.parametrize("positions", [1, 2, 3, 4, 5, 6, 7, 8])
def test_orders_validate_with_any_micro_batch_count(name: str, positions: int) -> None:
    """Every position count the blocks are built for, few and many micro-batches, replicated
    positions too: each unit once forward, once backward, no deadlock (``validate``)."""
    least = SCHEDULE_KINDS[name].least_microbatches_per_device * positions
    for micro in sorted({max(1, least), least + 1, 3 * positions + 1}):
        validate(build_schedule(name, (1,) * positions, 2, micro, 2))
    validate(build_schedule(name, (2,) + (1,) * (positions - 1), 2, max(4, least), 2))


def test_v_min_on_two_devices_hand_computed() -> None:
    """V-Min's block on 2 devices: device 0 runs F c0, F c1, I c1, I c0 of micro-batch m at slots
    6m, 6m + 3, 6m + 4, 6m + 7, device 1 at 6m + 1, 6m + 2, 6m + 5, 6m + 6; each "W" takes the
    first free slot after its "I". Device 0's W's follow at once (slots 6m + 5, 6m + 8): it holds
    one micro-batch of each chunk at most. Device 1's free slots (6m + 3, 6m + 4) come after
    the next micro-batch's forwards: two of each chunk, 4 chunk-micro-batches (1F1B's first
    stage's 2 stage-micro-batches: at P = 2 V-Min saves nothing on device 1)."""
    schedule = build_schedule("v-min", (1, 1), 1, 3, 2)
    assert [" ".join(map(str, schedule.actions[w])) for w in schedule.workers] == [
        "F0 F0c1 I0c1 W0c1 F0.1 I0 W0 F0.1c1 I0.1c1 W0.1c1 F0.2 I0.1 W0.1 F0.2c1 I0.2c1 W0.2c1 I0.2 W0.2 S0",
        "F0 F0c1 I0c1 I0 F0.1 F0.1c1 W0c1 W0 I0.1c1 I0.1 F0.2 F0.2c1 W0.1c1 W0.1 I0.2c1 I0.2 W0.2c1 W0.2 S0",
    ]
    kind = SCHEDULE_KINDS["v-min"]
    assert kind.in_flight_by_chunk((1, 1), 0, 6, 2) == (1 / 6, 1 / 6)
    assert kind.in_flight_by_chunk((1, 1), 1, 6, 2) == (2 / 6, 2 / 6)


def test_v_half_on_two_devices_hand_computed() -> None:
    """V-Half's block on 2 devices, device 0 at 6m, 6m + 4, 6m + 8, 6m + 13 (F c0, F c1, I c1,
    I c0): micro-batch m's chunk 0 lives from slot 6m to its W at 6m + 15, so after F c0 of
    micro-batch 2 (slot 12) device 0 holds chunk 0 of 0, 1, 2 and chunk 1 of 1 (that of 0 went
    at slot 9): 4 chunk-micro-batches, 3 of chunk 0. Device 1 (2, 3, 10, 12): 2 of each."""
    kind = SCHEDULE_KINDS["v-half"]
    assert kind.in_flight_by_chunk((1, 1), 0, 6, 2) == (3 / 6, 1 / 6)
    assert kind.in_flight_by_chunk((1, 1), 1, 6, 2) == (2 / 6, 2 / 6)


def test_dualpipev_memory_hand_computed() -> None:
    """DualPipeV, 2 devices, 4 micro-batches. Device 0: F c0 of 0, 1, 2, then F c1 of 0 and
    its I, W; then F c1 of 1 and F c0 of 3: chunk 0 of 0..3 and chunk 1 of 1 held, 5
    chunk-micro-batches (DeepSeek's "PP + 1" chunks of activations at PP = 2 ranks: 2P + 1)."""
    schedule = build_schedule("dualpipev", (1, 1), 1, 4, 2)
    assert " ".join(map(str, schedule.actions[(0, 0)])) == (
        "F0 F0.1 F0.2 F0c1 I0c1 W0c1 F0.1c1 F0.3 B0.1c1 F0.2c1 B0 B0.2c1 F0.3c1 B0.1 B0.3c1 I0.2 W0.2 "
        "I0.3 W0.3 S0"
    )
    kind = SCHEDULE_KINDS["dualpipev"]
    assert kind.in_flight_by_chunk((1, 1), 0, 4, 2) == (4 / 4, 1 / 4)
    assert kind.in_flight_by_chunk((1, 1), 1, 4, 2) == (3 / 4, 2 / 4)


@pytest.mark.parametrize(
    "positions, micro, held",
    [
        # stage-micro-batches held at the peak, per device (1F1B: P - i)
        (4, 16, {"v-half": [3.0] * 4, "v-min": [2.0] * 4, "dualpipev": [4.5] * 4}),
        (
            8,
            32,
            {"v-half": [5.0] * 8, "v-min": [3.0, 4.0, 4.0, 3.0, 4.0, 4.0, 3.0, 4.0], "dualpipev": [8.5] * 8},
        ),
    ],
)
def test_memory_against_1f1b(positions: int, micro: int, held: dict[str, list[float]]) -> None:
    """Against 1F1B's first stage (P stage-micro-batches): V-Half 3/4 at P = 4, 5/8 at P = 8
    (the paper's 1/2 plus a constant of the block); V-Min 1/2 at both (the paper's 1/3 plus
    its constant); DualPipeV P + 1/2 (2P + 1 chunks) on every device."""
    for name, expected in held.items():
        kind = SCHEDULE_KINDS[name]
        got = [
            kind.activations_in_flight((1,) * positions, i, micro, 2) * micro / 2 for i in range(positions)
        ]
        assert got == expected, name


def test_dualpipev_refuses_fewer_than_two_micro_batches_per_device_when_planned() -> None:
    profile = make_profile([1.0] * 16, param_bytes=1000, saved_bytes=2**20)
    options = PartitionOptions(schedule="dualpipev", microbatches=6, straight=True)
    with pytest.raises(
        InputError, match=r"dualpipev needs micro-batches >= 2 x 4 devices = 8 \(got 6\)"
    ) as e:
        partition(profile, make_topology(per_server=4, servers=1), options)
    assert "\n" not in str(e.value)


def test_v_placement_and_simulated_times_on_equal_layers() -> None:
    """16 equal layers (F = I = W = 1 ms), 4 devices, 8 micro-batches: all three in a V (chunk
    1 of device i holds piece 7 - i). Ideal 12 ms; 1F1B-flush 16.5 (4.5 ms idle), ZB-V 12.0.
    V-Half 14.25: half of 1F1B's idle time, sail-sg's B/2, once squeezed; V-Min 14.75 (its
    squeeze found nothing within the block's memory: 2.75 ms idle, 61% of 1F1B's, about sail-sg's
    2B/3). DualPipeV's whole backwards on the last device's chunk 1 leave 0.75 ms; peak memory per
    device follows the held counts."""
    profile = make_profile([1.0] * 16, param_bytes=1000, saved_bytes=2**20)
    topology = make_topology(per_server=4, servers=1)
    times, memory = {}, {}
    for name in ("1f1b-flush",) + V_KINDS:
        plan = partition(profile, topology, PartitionOptions(schedule=name, microbatches=8, straight=True))
        if name != "1f1b-flush":
            assert plan.virtual_stages == 2
            assert [stage.layers[0] for stage in plan.stages] == [0, 2, 4, 6, 14, 12, 10, 8]
        result = simulate_plan(plan, profile)
        times[name] = result.time_per_minibatch_ms
        memory[name] = max(result.device_memory_bytes)
    assert times == pytest.approx(
        {"1f1b-flush": 16.5, "v-half": 14.25, "v-min": 14.75, "dualpipev": 12.75}, rel=1e-12
    )
    assert memory["v-min"] < memory["v-half"] < memory["1f1b-flush"] < memory["dualpipev"]


def test_auto_picks_a_low_memory_v_when_only_it_fits() -> None:
    """`--schedule auto` over the flush schedules with memory for about 2 of 1F1B's 4 stage-
    micro-batches: 1F1B, ZB-H1, ZB-V and DualPipeV do not fit at 8 micro-batches; V-Min
    (half of 1F1B's at P = 4) does, and the search names it."""
    profile = make_profile([1.0] * 16, param_bytes=1000, saved_bytes=2**20)
    topology = make_topology(per_server=4, servers=1)
    names = ("1f1b-flush", "zb-h1", "zb-v") + V_KINDS
    plan = partition(profile, topology, PartitionOptions(schedule="v-min", microbatches=8, straight=True))
    vmin_peak = max(simulate_plan(plan, profile).device_memory_bytes)
    device = dataclasses.replace(topology.device, memory_bytes=vmin_peak + 2**10)
    tight = dataclasses.replace(topology, device=device)
    options = PartitionOptions(straight=True, microbatches=8)
    try:
        found = search(profile, tight, options, names)
    except InfeasibleError as exc:  # pragma: no cover - the failure names the smallest fit
        raise AssertionError(str(exc)) from exc
    assert found.plan.schedule == "v-min"
    assert {c.schedule for c in found.candidates} >= set(V_KINDS)


@pytest.mark.parametrize("name", ["v-half", "v-min"])
@pytest.mark.parametrize("positions, micro", [(2, 4), (3, 7), (4, 8), (4, 16), (8, 16)])
def test_squeeze_keeps_each_devices_block_memory(name: str, positions: int, micro: int) -> None:
    """The squeezed orders (warm-up and drain pulled ahead in a unit-time sweep) hold no more on
    any device than the plain block order; they validate (no deadlock)."""
    squeezed = v_orders.v_block_orders(name, positions, micro)
    for i in range(positions):
        plain = v_orders.block_order(v_orders.V_BLOCKS[name](positions), i, micro)
        assert sorted(squeezed[i]) == sorted(plain)  # the same actions
        assert v_orders._peak(list(squeezed[i])) <= v_orders._peak(plain)
    validate(build_schedule(name, (1,) * positions, 2, micro, 2))


def test_large_pipelines_keep_the_plain_block_orders() -> None:
    """Beyond SQUEEZE_LIMIT (P^2 M) the sweep is skipped: the block orders run as they are."""
    positions, micro = 64, 32  # 64^2 * 32 > 2^16
    assert positions * positions * micro > v_orders.SQUEEZE_LIMIT
    orders = v_orders.v_block_orders("v-min", positions, micro)
    assert list(orders[5]) == v_orders.block_order(v_orders.V_BLOCKS["v-min"](positions), 5, micro)
