"""The cost model's inputs: prefix sums, cut bytes and the optimizer step's share."""

from __future__ import annotations

import pytest

from pipeplan.planner.costs import layer_arrays, layer_compute_ms, update_ms
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.simulate import simulate_plan
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.topology import DeviceSpec, Level, Topology


def profile(optimizer_ms: dict[str, float], loss_ms: float = 0.0, data_ms: float = 0.0) -> Profile:
    """A 4-layer chain: 3 ms of forward+backward each; parameters 1, 1, 2, 0 MB."""
    params = [1_000_000, 1_000_000, 2_000_000, 0]
    layers = tuple(
        LayerProfile(i, f"l{i}", "Linear", () if i == 0 else (i - 1,), 1.0, 2.0, 1000, p, 1000)
        for i, p in enumerate(params)
    )
    return Profile(
        "chain",
        "fp",
        DeviceInfo("cpu", "test"),
        8,
        "float32",
        layers,
        optimizer_ms=optimizer_ms,
        loss_ms=loss_ms,
        data_ms=data_ms,
    )


def one_device() -> Topology:
    return Topology("one", DeviceSpec("cpu", 1 << 30, "cpu"), (Level("host", 1, 1e9),))


def test_update_share_follows_parameter_bytes() -> None:
    assert update_ms(profile({"adam": 8.0}), "adam") == [2.0, 2.0, 4.0, 0.0]
    assert update_ms(profile({"adam": 8.0}), "sgd") == [0.0] * 4  # not measured for sgd
    assert update_ms(profile({"adam": 8.0}), None) == [0.0] * 4


def test_compute_prefix_includes_the_charged_optimizer() -> None:
    arrays = layer_arrays(profile({"sgd": 4.0}), "sgd")
    assert arrays.compute(0, 4) == pytest.approx(12.0 + 4.0)
    assert arrays.compute(2, 3) == pytest.approx(3.0 + 2.0)
    assert layer_arrays(profile({"sgd": 4.0})).compute(0, 4) == pytest.approx(12.0)


@pytest.mark.parametrize("cost_model, expected_ms", [("pipeplan", 12.0 + 6.0), ("pipedream", 12.0)])
def test_single_device_prediction_and_simulation_include_the_step(
    cost_model: str, expected_ms: float
) -> None:
    measured = profile({"sgd": 1.0, "adam": 6.0})
    options = PartitionOptions(optimizer="adam", cost_model=cost_model)
    plan = partition(measured, one_device(), options)
    assert plan.predicted.single_device_ms == pytest.approx(expected_ms)
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(expected_ms)
    if cost_model == "pipeplan":  # PipeDream's own model knows no optimizer step
        assert simulate_plan(plan, measured).time_per_minibatch_ms == pytest.approx(expected_ms)


def test_loss_and_minibatch_draws_are_charged_to_the_end_layers() -> None:
    measured = profile({"sgd": 0.0}, loss_ms=0.5, data_ms=0.25)
    assert layer_compute_ms(measured, "sgd") == [3.25, 3.0, 3.0, 3.75]  # draw, ..., draw + loss
    arrays = layer_arrays(measured, "sgd")
    assert arrays.compute(0, 4) == pytest.approx(12.0 + 0.25 + 0.5)  # one stage draws once
    assert arrays.compute(2, 4) == pytest.approx(6.0 + 0.25 + 0.5)  # the loss stage draws too
    assert layer_compute_ms(measured, None) == [3.0] * 4  # PipeDream's model: layers only


# --- the replicas' gradient all-reduce under mixed precision: float32 gradients of bf16 weights


def bf16_profile(master_dtype: str | None, dtype: str = "bfloat16") -> Profile:
    """4 layers of 1 + 2 ms, 2 MB of parameters each (1 M bf16 weights), Adam timed at 1 ms."""
    layers = tuple(
        LayerProfile(i, f"l{i}", "Linear", () if i == 0 else (i - 1,), 1.0, 2.0, 1000, 2_000_000, 1000)
        for i in range(4)
    )
    return Profile(
        "chain",
        "fp",
        DeviceInfo("cpu", "test"),
        8,
        dtype,
        layers,
        optimizer_ms={"adam": 1.0},
        master_dtype=master_dtype,
    )


def two_replicas() -> Topology:  # ring all-reduce among 2: P / B, no latency
    return Topology("two", DeviceSpec("cpu", 1 << 30, "cpu"), (Level("host", 2, 1e9, 0.0),))


# (profile, gradient bytes all-reduced, their ring all-reduce among 2 at 1 GB/s in ms)
SYNC_CASES = [
    pytest.param(bf16_profile("float32"), 16e6, 16.0, id="bf16-float32-masters"),  # 4 M float32 gradients
    pytest.param(bf16_profile(None), 8e6, 8.0, id="bf16-only"),  # every tensor bf16 (older profiles)
    pytest.param(
        bf16_profile(None, "float32"), 8e6, 8.0, id="float32"
    ),  # the same bytes in float32: unchanged
]


@pytest.mark.parametrize("measured, grad_bytes, allreduce_ms", SYNC_CASES)
def test_replicas_all_reduce_gradients_in_the_master_dtype(
    measured: Profile, grad_bytes: float, allreduce_ms: float
) -> None:
    """Every place the planner prices the data-parallel all-reduce (the DP, its bounds, the
    stage figures, the baseline, the flush bound, the simulation, PipeDream's model) prices
    it on the master dtype's bytes under mixed precision: exactly twice the bf16 figure."""
    from pipeplan.planner.cost_models import cost_model
    from pipeplan.planner.cuts import CutFamily
    from pipeplan.planner.dp import DPSettings, solve
    from pipeplan.planner.dp.bounds import data_parallel_bound_ms
    from pipeplan.planner.flush_bound import flush_period_bound_ms
    from pipeplan.planner.placement import FlatStage
    from pipeplan.planner.simulate import durations, stage_costs
    from pipeplan.precision import Precision

    top = two_replicas()
    arrays = layer_arrays(measured, "adam")
    assert arrays.params(0, 4) == 8e6 and arrays.sync_bytes(0, 4) == grad_bytes
    assert arrays.sync_range(0, 4) == grad_bytes
    compute = 4 * 3.0 + 1.0  # forward + backward + the Adam step, on one device
    # pure data parallelism (one stage on both devices): max(compute / 2, all-reduce)
    assert cost_model("pipeplan").data_parallel_ms(arrays, top) == max(compute / 2, allreduce_ms)
    # PipeDream's: (compute + 4 (n-1) P / (B n)) / n, its compute without the step
    pipedream = cost_model("pipedream").data_parallel_ms(layer_arrays(measured), top)
    assert pipedream == pytest.approx((12.0 + 4 * grad_bytes / 2e9 * 1e3) / 2, rel=1e-12)
    settings = DPSettings(
        "1f1b-flush", "adam", max_stages=1, precision=Precision(measured.dtype, measured.master_dtype)
    )
    assert data_parallel_bound_ms(arrays, top, settings) == max(compute / 2, allreduce_ms)
    for prune in (True, False):
        assert solve(arrays, top, settings, prune=prune).time_ms == max(compute / 2, allreduce_ms)

    options = PartitionOptions(schedule="1f1b-flush", microbatches=2, optimizer="adam", max_stages=1)
    plan = partition(measured, top, options)
    assert [(s.replicas, s.allreduce_ms) for s in plan.stages] == [(2, allreduce_ms)]
    assert plan.predicted.data_parallel_ms == max(compute / 2, allreduce_ms)
    assert durations(plan, stage_costs(plan, measured), 2).allreduce_ms == (allreduce_ms,)
    # each replica: one micro-batch's forward + backward (6 ms), then the all-reduce and the step
    assert simulate_plan(plan, measured).time_per_minibatch_ms == pytest.approx(
        6.0 + allreduce_ms + 1.0, rel=1e-12
    )
    # the bound leaves the sync out (a shard mode may group it): the period less the all-reduce
    bound = flush_period_bound_ms(
        measured, CutFamily("prefix", 4), [FlatStage(0, 4, (0, 1), ())], "1f1b-flush", 2, "adam"
    )
    assert bound == pytest.approx(6.0 + 1.0, rel=1e-12)


def test_tensor_parallel_all_reduces_stay_bf16_and_the_replicas_sync_float32() -> None:
    """A PTD-P plan of an estimated bf16 GPT (t = 2, one stage on 4 replicas): the
    tensor-parallel activation all-reduces inside each layer are the same for both
    precisions (bf16 activations), the replicas' gradient all-reduce doubles."""
    from dataclasses import replace

    from pipeplan.planner.partition import plan_uniform
    from pipeplan.planner.tp_pricing import split_profile
    from pipeplan.profiler.estimate import DEVICE_RATES, GPTShape, estimate_gpt

    mixed = estimate_gpt(GPTShape(2, 256, 4, seq_len=128, vocab=1024), DEVICE_RATES["a100-80gb"], 8)
    assert mixed.master_dtype == "float32"
    pure = replace(mixed, master_dtype=None)
    top = Topology(
        "node", DeviceSpec("A100", 80 * 2**30), (Level("node", 8, 300e9, 0.0), Level("c", 1, 200e9, 0.0))
    )
    assert [(layer.forward_ms, layer.backward_ms) for layer in split_profile(mixed, top, 2).layers] == [
        (layer.forward_ms, layer.backward_ms) for layer in split_profile(pure, top, 2).layers
    ]
    options = PartitionOptions(schedule="1f1b-flush", microbatches=8, optimizer="adam")
    got = {
        name: plan_uniform(profile, top, options, 2, 1)
        for name, profile in (("mixed", mixed), ("pure", pure))
    }
    assert [(s.tensor_parallel, s.replicas) for s in got["mixed"].stages] == [(2, 4)]
    assert got["mixed"].stages[0].allreduce_ms == pytest.approx(
        2 * got["pure"].stages[0].allreduce_ms, rel=1e-12
    )
    assert got["pure"].stages[0].allreduce_ms > 0


@pytest.mark.parametrize("dag", [False, True])
def test_largest_range_is_each_stages_largest_parameter(dag: bool) -> None:
    """The DP's vectorised largest parameter per stage (bisection over the distinct sizes)
    equals the stage's own maximum over its layers, on a chain and on a DAG's downsets."""
    import random

    import numpy as np

    from pipeplan.planner.cuts import cut_family

    rng = random.Random(7)
    n = 9
    sizes = [rng.choice([0, 4, 16, 16, 64, 256]) for _ in range(n)]
    # the DAG: two branches from layer 0 (odd and even layers), joined by the last
    inputs = [(i - 2,) if dag and i >= 2 else (max(i - 1, 0),) for i in range(n)]
    inputs[-1] = (n - 3, n - 2) if dag else (n - 2,)
    layers = tuple(
        LayerProfile(
            i, f"l{i}", "x", () if i == 0 else inputs[i], 1.0, 2.0, 4, 3 * s, 0, largest_param_bytes=s
        )
        for i, s in enumerate(sizes)
    )
    profile = Profile("m", "f", DeviceInfo("cpu", "x"), 8, "float32", layers)
    family = cut_family(profile)
    assert family.is_prefix is (not dag)
    arrays = layer_arrays(profile, family=family)
    states = len(arrays.param_bytes)
    pairs = [(i, j) for i in range(states) for j in range(i + 1, states) if arrays.nested(i, j)]
    got = arrays.largest_range(np.array([i for i, _ in pairs]), np.array([j for _, j in pairs]))
    want = [max([sizes[k] for k in family.stage_layers(i, j)], default=0) for i, j in pairs]
    assert len(pairs) > n and list(got) == want
    assert [arrays.largest(i, j) for i, j in pairs] == want
