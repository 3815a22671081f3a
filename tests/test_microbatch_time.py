"""Times at micro-batch sizes: the profile's fields, the simulator's charge, the auto search."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipeplan.errors import InputError
from pipeplan.planner.auto import search
from pipeplan.planner.microbatch_time import BatchCurve, microbatch_share, stage_curve, time_at_ms
from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.simulate import simulate_plan
from pipeplan.profile import Profile
from pipeplan.profiler.batch_sizes import monotone, smaller_batch_sizes
from pipeplan.topology import DeviceSpec
from tests.test_simulate import make_plan, make_profile, make_topology, with_message_overhead

SIZES = (1, 2, 4, 8, 16, 32)


def with_fixed_cost(profile: Profile, fixed_ms: float) -> Profile:
    """``profile`` whose layers take ``fixed_ms`` per call plus a part proportional to the
    batch: T(b) = fixed + (T(B) - fixed) b / B, forward and backward alike."""
    batch = profile.batch_size
    layers = tuple(
        replace(
            layer,
            forward_ms_at=tuple(fixed_ms + (layer.forward_ms - fixed_ms) * b / batch for b in SIZES),
            backward_ms_at=tuple(fixed_ms + (layer.backward_ms - fixed_ms) * b / batch for b in SIZES),
        )
        for layer in profile.layers
    )
    return replace(profile, layers=layers, timed_batch_sizes=SIZES)


def test_times_at_batch_sizes_round_trip(tmp_path: Path) -> None:
    profile = with_fixed_cost(make_profile([2.0, 3.0], [4.0, 6.0]), 0.5)
    path = tmp_path / "profile.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded == profile
    assert loaded.timed_batch_sizes == SIZES
    assert loaded.layers[1].forward_ms_at == pytest.approx([0.5 + 2.5 * b / 32 for b in SIZES])


def test_old_profile_loads_without_the_fields(tmp_path: Path) -> None:
    obj = make_profile([1.0, 1.0]).to_dict()
    del obj["timed_batch_sizes"]
    for layer in obj["layers"]:
        del layer["forward_ms_at"], layer["backward_ms_at"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(obj))
    loaded = Profile.load(path)
    assert loaded.timed_batch_sizes == ()
    assert stage_curve(loaded, [0, 1]) is None  # proportional
    assert microbatch_share(None, 4) == 0.25


@pytest.mark.parametrize(
    "sizes, message",
    [((1, 2, 16), "end at batch_size 32"), ((2, 1, 32), "ascending"), ((0, 32), "positive")],
)
def test_bad_batch_sizes_are_one_line_errors(sizes: tuple[int, ...], message: str) -> None:
    profile = make_profile([1.0])
    layer = replace(profile.layers[0], forward_ms_at=(1.0,) * len(sizes), backward_ms_at=(1.0,) * len(sizes))
    with pytest.raises(InputError, match=message):
        replace(profile, layers=(layer,), timed_batch_sizes=sizes)


def test_misaligned_times_are_refused() -> None:
    profile = make_profile([1.0])
    layer = replace(profile.layers[0], forward_ms_at=(1.0, 2.0), backward_ms_at=(1.0,))
    with pytest.raises(InputError, match=r"backward_ms_at holds 1 times for 2 timed_batch_sizes"):
        replace(profile, layers=(layer,), timed_batch_sizes=(16, 32))


def test_interpolation_is_piecewise_linear_and_proportional_below() -> None:
    assert time_at_ms((2, 4, 8), (3.0, 4.0, 8.0), 6) == pytest.approx(6.0)
    assert time_at_ms((2, 4, 8), (3.0, 4.0, 8.0), 3) == pytest.approx(3.5)
    assert time_at_ms((2, 4, 8), (3.0, 4.0, 8.0), 1) == pytest.approx(1.5)
    curve = BatchCurve((2, 4, 8), (3.0, 4.0, 8.0), (6.0, 8.0, 16.0))
    assert microbatch_share(curve, 2) == pytest.approx(0.5)
    assert microbatch_share(curve, 4, "backward") == pytest.approx(6.0 / 16.0)


def test_profiler_sizes_and_noise_mending() -> None:
    assert smaller_batch_sizes(32) == (1, 2, 4, 8, 16)
    assert smaller_batch_sizes(6) == (1, 2, 4)
    # 8 samples read slower than 16 (noise): capped at 16's; 2 under 2/8 of 8's and 1 under
    # 1/2 of 2's: raised to their proportional share
    assert monotone((1, 2, 8, 16), (0.1, 1.0, 9.0, 8.0)) == pytest.approx((1.0, 2.0, 8.0, 8.0))
    assert monotone((1, 2, 4), (1.5, 2.0, 3.0)) == pytest.approx((1.5, 2.0, 3.0))  # kept


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b-flush"])
def test_simulator_charges_the_time_measured_at_the_micro_batch_size(schedule: str) -> None:
    # two stages of one layer, 1 + 2 ms per minibatch of 32; a fixed 0.1 ms per call each way
    base = make_profile([1.0, 1.0], [2.0, 2.0])
    profile = with_fixed_cost(base, 0.1)
    plan = make_plan(profile, make_topology(per_server=2, servers=1), [0, 1, 2], [1, 1], schedule, 4)
    # a micro-batch of 8 samples: forward 0.1 + 0.9 / 4, backward 0.1 + 1.9 / 4
    f, b = 0.1 + 0.9 / 4, 0.1 + 1.9 / 4
    expected = (4 + 2 - 1) * (f + b)  # flush bubble: (M + p - 1) micro-batch slots of f + b
    assert simulate_plan(plan, profile).time_per_minibatch_ms == pytest.approx(expected)
    proportional = simulate_plan(plan, base).time_per_minibatch_ms
    assert proportional == pytest.approx((4 + 2 - 1) * 3.0 / 4)
    assert expected / proportional == pytest.approx(1.2)  # 0.8 ms of fixed cost per slot


def test_auto_chooses_fewer_micro_batches_with_a_fixed_cost_per_call() -> None:
    base = make_profile([2.0] * 4, [4.0] * 4)  # 6 ms per layer per minibatch of 32
    topology = make_topology(per_server=2, servers=1)
    options = PartitionOptions(schedule="1f1b-flush", straight=True)  # two stages, no replicas
    proportional = search(base, topology, options, schedules=("1f1b-flush",))
    fixed = search(with_fixed_cost(base, 0.4), topology, options, schedules=("1f1b-flush",))
    counts = sorted(c.microbatches for c in proportional.candidates)
    assert proportional.best.microbatches == counts[-1]  # the bubble shrinks, nothing grows
    assert fixed.best.microbatches < proportional.best.microbatches
    assert fixed.best.microbatches == 2  # 20.4 ms; 4 micro-batches 21.0 ms, 32 63.5 ms
    # its time is the simulation at measured cost, slower than the proportional model's
    assert fixed.best.time_per_minibatch_ms > proportional.best.time_per_minibatch_ms


@pytest.mark.slow
def test_profile_measures_every_layer_at_the_smaller_sizes() -> None:
    from pipeplan.profiler.profile_model import profile_model

    profile = profile_model("mlp", batch_size=4, device="cpu", warmup=1, repeats=3, threads=1)
    assert profile.timed_batch_sizes == (1, 2, 4)
    for layer in profile.layers:
        assert len(layer.forward_ms_at) == len(layer.backward_ms_at) == 3
        assert layer.forward_ms_at[-1] == layer.forward_ms
        # mended to no faster than proportional, no slower than the larger size
        for k in range(2):
            for at in (layer.forward_ms_at, layer.backward_ms_at):
                assert at[k + 1] * 0.5 - 1e-12 <= at[k] <= at[k + 1] + 1e-12


def test_partition_warns_when_the_prediction_is_known_unreliable() -> None:
    from pipeplan.planner.reliability import prediction_warnings

    base = replace(make_profile([2.0] * 4, [4.0] * 4), step_ms=12.0)  # layers sum to 2x the step
    plan = make_plan(base, make_topology(per_server=2, servers=1), [0, 2, 4], [1, 1], "gpipe", 4)
    warnings = prediction_warnings(base, plan)
    assert any("sum to 2.00x the measured whole step (24.000 ms vs 12.000 ms)" in w for w in warnings)
    assert any("proportional to its size" in w for w in warnings)  # no times at smaller sizes
    assert any("backward working memory" in w for w in warnings)  # not measured: said
    working = replace(
        base,
        layers=tuple(replace(layer, backward_working_bytes=0) for layer in base.layers),
        loss_saved_bytes=0,
        loss_working_bytes=0,
    )
    assert not any("backward working memory" in w for w in prediction_warnings(working, plan))
    no_loss = replace(working, loss_saved_bytes=-1, loss_working_bytes=-1)  # a profile from before
    assert any("does not record the loss's memory" in w for w in prediction_warnings(no_loss, plan))
    assert prediction_warnings(with_fixed_cost(replace(working, step_ms=24.0), 0.4), plan) == []  # 1.4x
    measured = with_fixed_cost(replace(working, step_ms=24.0), 1.0)
    warnings = prediction_warnings(measured, plan)
    # a micro-batch of 8 per layer: forward 1 + 1 / 4, backward 1 + 3 / 4: 3 ms for 6 / 4 = 1.5 proportional
    assert warnings == [
        "a micro-batch of 8 samples takes 2.0x its proportional share of the minibatch (measured: "
        "per-call costs); the prediction includes it, fewer micro-batches (or --schedule auto) spend less of it"
    ]


def test_partition_warns_when_a_cpu_topology_gives_no_message_overhead() -> None:
    from pipeplan.planner.reliability import prediction_warnings

    profile = make_profile([2.0] * 4, [4.0] * 4)
    gloo = replace(make_topology(per_server=2, servers=1), device=DeviceSpec("cpu", 2**30, "cpu"))
    plan = make_plan(profile, gloo, [0, 2, 4], [1, 1], "1f1b-flush", 1)
    warned = [w for w in prediction_warnings(profile, plan) if "message_overhead" in w]
    assert warned == [
        "topology 'test' gives no message_overhead for its gloo level(s) server: what each message "
        "costs the ranks' cores is left out (0.21-0.44 ms per message on a 2-core machine: 2-33% of "
        "the bundled and tiny Hugging Face models' time per minibatch); measure it with "
        "`pipeplan calibrate --topology test -o measured.yaml` and plan on that file"
    ]
    measured = replace(plan, topology=with_message_overhead(gloo, 0.23))
    assert not any("message_overhead" in w for w in prediction_warnings(profile, measured))
    one_device = make_plan(profile, gloo, [0, 4], [1], "1f1b-flush", 1)  # no message crosses a level
    assert not any("message_overhead" in w for w in prediction_warnings(profile, one_device))
    nccl = make_plan(profile, make_topology(per_server=2, servers=1), [0, 2, 4], [1, 1], "1f1b-flush", 1)
    assert not any("message_overhead" in w for w in prediction_warnings(profile, nccl))


def test_auto_chooses_fewer_micro_batches_where_each_message_holds_its_ranks() -> None:
    # each message's overhead is paid 2 M times a minibatch, so it moves auto's choice the
    # way a fixed cost per call does (above), where a latency would overlap
    base = make_profile([2.0] * 4, [4.0] * 4)
    topology = make_topology(per_server=2, servers=1)
    options = PartitionOptions(schedule="1f1b-flush", straight=True)
    free = search(base, topology, options, schedules=("1f1b-flush",))
    held = search(base, with_message_overhead(topology, 1.0), options, schedules=("1f1b-flush",))
    assert held.best.microbatches < free.best.microbatches
    assert free.best.microbatches == 32
    # two stages of 12 ms per minibatch: (M + 1) x 12 / M ms of compute and bubble, and 2 M
    # messages of 1 ms: M = 2 18 + 4 = 22 ms, M = 4 15 + 8 = 23 ms, M = 32 76.4 ms
    assert held.best.microbatches == 2
    assert held.best.time_per_minibatch_ms == pytest.approx(22.0)


def test_run_metrics_compare_a_stage_with_its_compute_at_the_micro_batch_size() -> None:
    # issue 31: a run's stage compute was set against StagePlan.compute_ms, one whole minibatch
    # in one call; with 4 micro-batches of a fixed 0.1 ms per call the stage computes
    # 4 (f + b) = 4 * 0.8 = 3.2 ms, not 3.0 (and 3.0 is what its layers' sum still reads)
    from pipeplan.planner.predict import predict
    from pipeplan.runtime.rank_metrics import predicted_compute_ms

    base = make_profile([1.0, 1.0], [2.0, 2.0])
    profile = with_fixed_cost(base, 0.1)
    plan = make_plan(profile, make_topology(per_server=2, servers=1), [0, 1, 2], [1, 1], "1f1b-flush", 4)
    simulated = predict(plan, profile)
    f, b = 0.1 + 0.9 / 4, 0.1 + 1.9 / 4
    for stage in simulated.stages:
        assert stage.compute_ms == pytest.approx(3.0)
        assert predicted_compute_ms(stage, flushes=True) == pytest.approx(4 * (f + b))
    proportional = predict(plan, base)
    assert predicted_compute_ms(proportional.stages[0], flushes=True) == pytest.approx(3.0)
