"""Uniform (Megatron-shaped) candidates, one-lane simulation of flush plans, what-if GPT profiles."""

import itertools
import json

import numpy as np
import pytest
from click.testing import CliRunner

import pipeplan.planner.simulate as simulate_module
from pipeplan.cli import cli
from pipeplan.planner.partition import PartitionOptions, flush_in_flight, partition
from pipeplan.planner.simulate import simulate_plan
from pipeplan.planner.uniform import balanced_cuts, uniform_shapes
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.profiler.estimate import DEVICE_RATES, MATMUL_EFFICIENCY, PARAM_BYTES, GPTShape, estimate_gpt
from pipeplan.topology import DeviceSpec, Level, Topology


def test_balanced_cuts_match_brute_force():
    rng = np.random.default_rng(0)
    for n, p in [(5, 2), (6, 3), (7, 4), (8, 3), (6, 6)]:
        widths = rng.uniform(0.1, 5.0, n)
        prefix = np.concatenate([[0.0], np.cumsum(widths)])
        best = min(
            max(prefix[b] - prefix[a] for a, b in zip((0,) + cut, cut + (n,)))
            for cut in itertools.combinations(range(1, n), p - 1)
        )
        cuts = balanced_cuts(prefix, p)
        assert (
            len(cuts) == p + 1
            and cuts[0] == 0
            and cuts[-1] == n
            and all(a < b for a, b in zip(cuts, cuts[1:]))
        )
        got = max(prefix[b] - prefix[a] for a, b in zip(cuts, cuts[1:]))
        assert got == pytest.approx(best, rel=1e-9)
    assert balanced_cuts(np.arange(4.0), 4) == []


def test_uniform_shapes_lay_out_within_two_levels():
    top = Topology("x", DeviceSpec("d", 1), (Level("node", 4, 1.0), Level("c", 2, 1.0)))
    assert uniform_shapes(top, 100) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert uniform_shapes(top, 3) == [(1, 8), (2, 4)]
    assert uniform_shapes(Topology("y", DeviceSpec("d", 1), (Level("node", 4, 1.0),)), 8) == []


def chain(n=6):
    layers = tuple(
        LayerProfile(
            i, f"l{i}", "L", (i - 1,) if i else (), 1.0 + 0.3 * i, 2.0 + 0.1 * i, 1000 * (i + 1), 5000, 3000
        )
        for i in range(n)
    )
    return Profile("m", "f", DeviceInfo("cuda", "x"), 24, "float32", layers, optimizer_ms={"sgd": 0.5})


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe", "zb-h1"])
def test_one_lane_simulation_equals_every_replica(schedule, monkeypatch):
    top = Topology("t", DeviceSpec("d", 10**9), (Level("node", 4, 1e8, 0.01), Level("c", 2, 1e7, 0.02)))
    for micro in (4, 12):
        plan = partition(chain(), top, PartitionOptions(schedule=schedule, microbatches=micro, uniform=True))
        assert len({s.replicas for s in plan.stages}) == 1 and plan.stages[0].replicas > 1
        lanes = simulate_plan(plan, chain())
        monkeypatch.setattr(simulate_module, "_lanes", lambda *args: 1)
        every = simulate_plan(plan, chain())
        monkeypatch.undo()
        assert lanes.time_per_minibatch_ms == pytest.approx(every.time_per_minibatch_ms, rel=1e-12)
        for a, b in zip(lanes.stages, every.stages):
            assert (a.replicas, a.memory_bytes) == (b.replicas, b.memory_bytes)
            assert a.busy_ms == pytest.approx(b.busy_ms, rel=1e-12)
            assert a.in_flight == pytest.approx(b.in_flight, rel=1e-12)
            assert a.idle_ms == pytest.approx(b.idle_ms, rel=1e-9, abs=1e-9)


def test_uniform_candidates_never_lose_to_the_dp_plan():
    top = Topology("t", DeviceSpec("d", 10**9), (Level("node", 4, 1e8, 0.01), Level("c", 2, 1e7, 0.02)))
    for micro in (2, 8, 24):
        options = PartitionOptions(schedule="1f1b-flush", microbatches=micro)
        dp = partition(chain(8), top, options)
        both = partition(
            chain(8), top, PartitionOptions(schedule="1f1b-flush", microbatches=micro, uniform=True)
        )
        assert both.predicted.simulated
        assert both.predicted.time_per_minibatch_ms <= dp.predicted.time_per_minibatch_ms * (1 + 1e-12)


def test_flush_in_flight_bound():
    assert flush_in_flight(PartitionOptions(schedule="1f1b-flush", microbatches=512), 130, 384) == 130 / 512
    assert flush_in_flight(PartitionOptions(schedule="1f1b-flush", microbatches=4), 130, 384) == 1.0
    assert flush_in_flight(PartitionOptions(schedule="gpipe", microbatches=512), 130, 384) == 1.0
    assert (
        flush_in_flight(PartitionOptions(schedule="1f1b-flush", microbatches=64, max_stages=8), 130, 384)
        == 8 / 64
    )


def test_estimated_gpt_profile_by_the_paper_formulas():
    shape = GPTShape(layers=24, hidden=2304, heads=24)
    assert shape.parameters == pytest.approx(1.65e9, rel=0.01)  # the paper's 1.7B row
    profile = estimate_gpt(shape, DEVICE_RATES["a100-80gb"], batch_size=512)
    assert profile.estimated.startswith("what-if, not measured: NVIDIA A100 datasheet")
    assert len(profile.layers) == 26 and profile.schema == "pipeplan.profile/2"
    block = profile.layers[1]
    assert block.tp_units == 24 and block.tp_forward_allreduces == 2 and block.tp_backward_allreduces == 4
    assert block.param_bytes == (12 * 2304**2 + 13 * 2304) * PARAM_BYTES
    assert block.saved_bytes == 512 * 2048 * 2304 * 2  # recomputation keeps the block's input only
    assert block.backward_ms == pytest.approx(3 * block.forward_ms)  # twice the forward, plus it again
    # by hand: dense GEMMs (24 h^2 FLOPs per token) at the GEMM rate; attention's two batched
    # GEMMs (2 s h FLOPs over 2 h + a s elements per token each) at their roofline, here
    # memory-bound (88 FLOP/byte below the ridge 312e12 x 0.687 / (2.039e12 x 0.8) = 131);
    # elementwise: (8 h + 4.5 a s) split + 11 h repeated elements per token at 0.8 of HBM
    tokens, h, a, s = 512 * 2048, 2304, 24, 2048
    flops, hbm = 312e12 * MATMUL_EFFICIENCY, 2.039e12 * 0.8
    attention_ms = 2 * max(tokens * 2 * s * h / flops, tokens * (2 * h + a * s) * 2 / hbm) * 1e3
    assert attention_ms == pytest.approx(2 * tokens * (2 * h + a * s) * 2 / hbm * 1e3)  # memory-bound
    split_ms = (
        tokens * 24 * h * h / flops * 1e3 + tokens * (8 * h + 4.5 * a * s) * 2 / hbm * 1e3 + attention_ms
    )
    assert block.tp_split_forward_ms == pytest.approx(split_ms, rel=1e-12)
    assert block.forward_ms == pytest.approx(split_ms + tokens * 11 * h * 2 / hbm * 1e3, rel=1e-12)
    big = estimate_gpt(GPTShape(128, 25600, 160), DEVICE_RATES["a100-80gb"], batch_size=512).layers[1]
    intensity = 2048 * 160 / (2 * 160 + 2048)  # FLOP per byte of the 1T row's attention GEMMs: at the ridge
    assert (
        312e12 * MATMUL_EFFICIENCY / hbm < intensity < 139
        and big.tp_split_forward_ms
        < 1.02
        * (tokens * (24 * 25600**2 + 4 * s * 25600) / flops + tokens * (8 * 25600 + 4.5 * 160 * s) * 2 / hbm)
        * 1e3
    )
    assert profile.layers[0].tp_units == profile.layers[-1].tp_units == 51200
    # Megatron's mixed precision: bf16 weights on float32 masters, 18 bytes per parameter with Adam
    from pipeplan.planner.memory import stage_memory_bytes
    from pipeplan.precision import Precision

    assert profile.master_dtype == "float32" and PARAM_BYTES == 2
    assert (
        stage_memory_bytes(block.param_bytes, 0, 1, 0, "adam", Precision(profile.dtype, profile.master_dtype))
        == (12 * 2304**2 + 13 * 2304) * 18
    )
    pure = estimate_gpt(shape, DEVICE_RATES["a100-80gb"], batch_size=512, mixed_precision=False)
    assert (
        pure.master_dtype is None and pure.layers[1].param_bytes == (12 * 2304**2 + 13 * 2304) * 4
    )  # 16 B/param
    assert pure.layers[1].forward_ms == block.forward_ms
    params = (
        sum(layer.param_bytes for layer in profile.layers) / 2 - 51200 * 2304
    )  # the head ties the embedding
    assert profile.optimizer_ms["adam"] == pytest.approx((7 * 4 + 2) * params / hbm * 1e3, rel=1e-12)
    no_recompute = estimate_gpt(shape, DEVICE_RATES["a100-80gb"], batch_size=512, recompute=False)
    assert no_recompute.layers[1].saved_bytes == int(512 * 2048 * 2304 * (34 + 5 * 24 * 2048 / 2304))
    assert no_recompute.layers[1].backward_ms == pytest.approx(2 * no_recompute.layers[1].forward_ms)


def test_estimate_cli_writes_a_marked_profile_and_partition_shows_it(tmp_path):
    out = tmp_path / "gpt.json"
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "estimate",
            "--device",
            "h100-sxm",
            "--layers",
            "4",
            "--hidden",
            "512",
            "--heads",
            "8",
            "--seq-len",
            "128",
            "--vocab",
            "1024",
            "--batch-size",
            "16",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "ESTIMATED" in result.output
    raw = json.loads(out.read_text())
    assert raw["estimated"].startswith("what-if") and raw["device"]["name"] == "H100-SXM5-80GB"
    plan_path = tmp_path / "plan.json"
    result = runner.invoke(
        cli,
        [
            "partition",
            str(out),
            "--topology",
            "dgx-h100-pod",
            "--schedule",
            "1f1b-flush",
            "--microbatches",
            "16",
            "--optimizer",
            "adam",
            "-o",
            str(plan_path),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "ESTIMATED profile" in result.output
    bad = runner.invoke(
        cli,
        [
            "estimate",
            "--device",
            "a100-80gb",
            "--layers",
            "2",
            "--hidden",
            "100",
            "--heads",
            "8",
            "--batch-size",
            "4",
            "-o",
            str(tmp_path / "x.json"),
        ],
    )
    assert (
        bad.exit_code == 2
        and bad.output.strip() == "error: GPT hidden size 100 is not a multiple of its 8 heads"
    )
    assert not (tmp_path / "x.json").exists()


def test_plan_uniform_prices_a_given_configuration():
    """``plan_uniform``: Megatron's own (t, p, d) priced as partition prices its candidates;
    the plan partition chooses, when uniform, is the same plan; shapes the topology cannot
    lay out are refused in one line."""
    from pipeplan.errors import InputError as Refused
    from pipeplan.planner.partition import plan_uniform

    profile = estimate_gpt(GPTShape(16, 2048, 16), DEVICE_RATES["a100-80gb"], 256)
    top = Topology(
        "t", DeviceSpec("A100", 80 * 2**30), (Level("node", 8, 300e9, 0.002), Level("c", 4, 200e9, 0.005))
    )
    options = PartitionOptions(schedule="1f1b-flush", microbatches=256, optimizer="adam")
    plan = plan_uniform(profile, top, options, 2, 4)
    assert [(s.tensor_parallel, s.replicas, len(s.ranks)) for s in plan.stages] == [(2, 4, 8)] * 4
    assert plan.predicted.simulated and sorted(r for s in plan.stages for r in s.ranks) == list(range(32))
    chosen = partition(profile, top, options)
    assert len({s.replicas for s in chosen.stages}) == 1  # a uniform shape wins here
    again = plan_uniform(profile, top, options, chosen.stages[0].tensor_parallel, len(chosen.stages))
    assert again.predicted.time_per_minibatch_ms == pytest.approx(
        chosen.predicted.time_per_minibatch_ms, rel=1e-12
    )
    assert [s.layers for s in again.stages] == [s.layers for s in chosen.stages]
    with pytest.raises(Refused, match="no uniform plan of 3 stages"):
        plan_uniform(profile, top, options, 2, 3)
