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
        "chain", "fp", DeviceInfo("cpu", "test"), 8, "float32", layers,
        optimizer_ms=optimizer_ms, loss_ms=loss_ms, data_ms=data_ms,
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
def test_single_device_prediction_and_simulation_include_the_step(cost_model: str, expected_ms: float) -> None:
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
