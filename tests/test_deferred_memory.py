"""What a zero-bubble input pass keeps for its weight pass: measured by the profiler with the
runtime's own split, charged by the planner and the simulator to the units between "I" and "W"."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from test_simulate import make_profile, make_topology

from pipeplan.planner.costs import layer_arrays, stage_deferred_bytes
from pipeplan.planner.exhaustive import exhaustive_best
from pipeplan.planner.memory import plan_stage_memory
from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.partition import partition
from pipeplan.planner.simulate import simulate_plan
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.profiler.memory import deferred_weight_bytes
from pipeplan.schedules import names_where, schedule_kind
from pipeplan.split_backward import backward_input
from pipeplan.topology import DeviceSpec, Level, Topology


def _two_linears(needs_grad: bool) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(5, 4, requires_grad=needs_grad)
    return model, x, model(x)


def test_the_profiler_counts_the_gradients_the_runtime_records() -> None:
    model, x, y = _two_linears(needs_grad=True)
    grad = torch.ones_like(y)
    measured = deferred_weight_bytes([y], [grad], model.parameters(), [x])
    # the two addmm nodes' output gradients: 5 x 3 and 5 x 8 float32
    assert measured == (5 * 3 + 5 * 8) * 4
    _, work = backward_input([y], [grad], [x], list(model.parameters()))
    assert measured == sum(g.untyped_storage().nbytes() for g in work.recorded())
    assert all(p.grad is None for p in model.parameters()) and x.grad is None  # nothing accumulated
    torch.autograd.backward([y], [grad])  # the graph was kept for the caller's backward
    assert model[0].weight.grad is not None


def test_a_layer_whose_inputs_need_no_gradient_records_nothing() -> None:
    model, x, y = _two_linears(needs_grad=False)
    assert deferred_weight_bytes([y], [torch.ones_like(y)], model.parameters(), [x]) == 0


def test_only_split_backward_schedules_defer_weight_passes() -> None:
    split = set(names_where(lambda kind: kind.split_backward))
    assert {"zb-h1", "zb-v", "dualpipev"} <= split
    for name in ("1f1b-flush", "gpipe", "1f1b-rr", "2bw"):
        assert schedule_kind(name).deferred_by_chunk((1, 1), 0, 4) == (0.0,)
    zb = schedule_kind("zb-h1")
    # 2 positions, 4 micro-batches: the last stage runs F0 I0 F0.1 I0.1 W0 ..., so at its peak
    # both units it holds are past their "I"; the first runs F0 F0.1 I0 W0 ...: one of two
    assert zb.in_flight_by_chunk((1, 1), 1, 4) == zb.deferred_by_chunk((1, 1), 1, 4) == (0.5,)
    assert zb.in_flight_by_chunk((1, 1), 0, 4) == (0.5,) and zb.deferred_by_chunk((1, 1), 0, 4) == (0.25,)


def test_plan_memory_charges_the_deferred_units() -> None:
    common = ("zb-h1", [1, 1], 1, 1000.0, 400.0, "sgd")
    memory, _, _ = plan_stage_memory(*common, microbatches=4, deferred_bytes=800.0)
    without, _, _ = plan_stage_memory(*common, microbatches=4)
    assert memory - without == 800.0 * 0.5  # the last stage: two micro-batches of four past "I"
    flush, _, _ = plan_stage_memory("1f1b-flush", [1, 1], 1, 1000.0, 400.0, "sgd", 4, deferred_bytes=800.0)
    assert flush == plan_stage_memory("1f1b-flush", [1, 1], 1, 1000.0, 400.0, "sgd", 4)[0]


def _with_deferred(profile: Profile, deferred: list[int]) -> Profile:
    layers = tuple(replace(layer, deferred_weight_bytes=d) for layer, d in zip(profile.layers, deferred))
    return replace(profile, layers=layers)


def test_the_first_stage_records_nothing_and_the_others_their_layers() -> None:
    assert stage_deferred_bytes(True, 48.0) == 0.0 and stage_deferred_bytes(False, 48.0) == 48.0
    profile = _with_deferred(make_profile([1.0] * 4, saved_bytes=100), [10, 20, 40, -1])
    arrays = layer_arrays(profile)
    assert arrays.deferred(0, 2) == 0.0  # starts the model
    assert arrays.deferred(1, 3) == 60.0
    assert arrays.deferred(2, 4) == 40.0  # -1: not measured, charged none
    # the DP's ranges, elementwise, by the same rule
    starts, ends = np.array([0, 1, 2, 0]), np.array([2, 3, 4, 4])
    assert arrays.deferred_range(starts, ends).tolist() == [0.0, 60.0, 40.0, 0.0]


def test_planner_and_simulator_charge_zb_h1_alike() -> None:
    profile = _with_deferred(
        make_profile([1.0] * 4, output_bytes=1000, param_bytes=5000, saved_bytes=3000), [2000] * 4
    )
    topology = make_topology(per_server=2, servers=1)
    options = PartitionOptions(schedule="zb-h1", microbatches=4, straight=True)
    plan = partition(profile, topology, options)
    old = partition(_with_deferred(profile, [-1] * 4), topology, options)
    assert [len(s.layers) for s in plan.stages] == [2, 2]
    extra = [s.memory_bytes - o.memory_bytes for s, o in zip(plan.stages, old.stages)]
    assert extra == [0, 2 * 2000 * 2 / 4]  # the last stage: 2 micro-batches of 4 past "I", 2 layers
    simulated = simulate_plan(plan, profile)
    assert [s.memory_bytes for s in simulated.stages] == [s.memory_bytes for s in plan.stages]


def test_the_dp_fits_a_stage_with_what_its_input_pass_keeps() -> None:
    """Four layers whose "I" each keeps 1,000 bytes for its "W", on two devices of 1,500
    bytes under ZB-H1 (M = 2: the second stage holds its units' deferred bytes once, the
    first none). The even split's second stage needs 2,000 bytes: the DP, which did not
    charge them, chose it, and the plan's assembly refused it ("no plan fits"). Now the DP
    finds the split that fits, the brute force's optimum."""
    layers = tuple(
        replace(
            LayerProfile(i, f"l{i}", "x", (i - 1,) if i else (), 0.5, 0.5, 0, 0, 0),
            deferred_weight_bytes=1000,
        )
        for i in range(4)
    )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers)
    topology = Topology("t", DeviceSpec("d", 1500, "gpu"), (Level("l0", 2, 1e9),))
    options = PartitionOptions(schedule="zb-h1", microbatches=2, straight=True)
    plan = partition(profile, topology, options)
    assert [stage.layers for stage in plan.stages] == [(0, 1, 2), (3,)]
    assert [stage.memory_bytes for stage in plan.stages] == [0, 1000]
    assert plan.predicted.stage_bound_ms == exhaustive_best(profile, topology, options)[0] == 3.0


def test_an_interleaved_device_is_charged_at_its_peak_of_bytes_as_the_simulator_does() -> None:
    """Interleaved 1F1B, 2 devices, 2 chunks each, 4 micro-batches: the second device holds
    at most three units, once as two of its first chunk and one of its second, later as three
    of its first. Its first chunk saves 8x what its second does, so the later moment holds
    more bytes; the plan took the first moment with the most units and charged the device
    less than the simulator did (42,500 against 60,000 bytes here)."""
    saved = [10_000, 80_000, 10_000, 10_000]  # per layer, one minibatch: chunk 1 is layer 1
    profile = make_profile([1.0] * 4)
    profile = replace(profile, layers=tuple(replace(l, saved_bytes=s) for l, s in zip(profile.layers, saved)))
    options = PartitionOptions(schedule="interleaved-1f1b", microbatches=4, virtual_stages=2, straight=True)
    plan = partition(profile, make_topology(per_server=2, servers=1), options)
    assert [stage.layers for stage in plan.stages] == [(0,), (1,), (2,), (3,)]
    planned = [stage.memory_bytes for stage in plan.stages]
    assert planned == [stage.memory_bytes for stage in simulate_plan(plan, profile).stages]
    assert planned[1] + planned[3] == 3 * 80_000 // 4  # three units of the first chunk, none of the second
