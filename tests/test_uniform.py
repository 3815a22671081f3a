"""Uniform (Megatron-shaped) candidates, one-lane simulation of flush plans, what-if GPT profiles."""

import itertools
import json

import numpy as np
import pytest
from click.testing import CliRunner

import pipeplan.planner.simulate as simulate_module
from pipeplan.cli import cli
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.profiler.estimate import DEVICE_RATES, PARAM_BYTES, GPTShape, estimate_gpt
from pipeplan.topology import DeviceSpec, Level, Topology
from pipeplan.planner.partition import PartitionOptions, flush_in_flight, partition
from pipeplan.planner.simulate import simulate_plan
from pipeplan.planner.uniform import balanced_cuts, uniform_shapes


def test_balanced_cuts_match_brute_force():
    rng = np.random.default_rng(0)
    for n, p in [(5, 2), (6, 3), (7, 4), (8, 3), (6, 6)]:
        widths = rng.uniform(0.1, 5.0, n)
        prefix = np.concatenate([[0.0], np.cumsum(widths)])
        best = min(max(prefix[b] - prefix[a] for a, b in zip((0,) + cut, cut + (n,)))
                   for cut in itertools.combinations(range(1, n), p - 1))
        cuts = balanced_cuts(prefix, p)
        assert len(cuts) == p + 1 and cuts[0] == 0 and cuts[-1] == n and all(a < b for a, b in zip(cuts, cuts[1:]))
        got = max(prefix[b] - prefix[a] for a, b in zip(cuts, cuts[1:]))
        assert got == pytest.approx(best, rel=1e-9)
    assert balanced_cuts(np.arange(4.0), 4) == []


def test_uniform_shapes_lay_out_within_two_levels():
    top = Topology("x", DeviceSpec("d", 1), (Level("node", 4, 1.0), Level("c", 2, 1.0)))
    assert uniform_shapes(top, 100) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert uniform_shapes(top, 3) == [(1, 8), (2, 4)]
    assert uniform_shapes(Topology("y", DeviceSpec("d", 1), (Level("node", 4, 1.0),)), 8) == []


def chain(n=6):
    layers = tuple(LayerProfile(i, f"l{i}", "L", (i - 1,) if i else (), 1.0 + 0.3 * i, 2.0 + 0.1 * i,
                                1000 * (i + 1), 5000, 3000) for i in range(n))
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
        both = partition(chain(8), top, PartitionOptions(schedule="1f1b-flush", microbatches=micro, uniform=True))
        assert both.predicted.simulated
        assert both.predicted.time_per_minibatch_ms <= dp.predicted.time_per_minibatch_ms * (1 + 1e-12)


def test_flush_in_flight_bound():
    assert flush_in_flight(PartitionOptions(schedule="1f1b-flush", microbatches=512), 130, 384) == 130 / 512
    assert flush_in_flight(PartitionOptions(schedule="1f1b-flush", microbatches=4), 130, 384) == 1.0
    assert flush_in_flight(PartitionOptions(schedule="gpipe", microbatches=512), 130, 384) == 1.0
    assert flush_in_flight(PartitionOptions(schedule="1f1b-flush", microbatches=64, max_stages=8), 130, 384) == 8 / 64


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
    # the GEMM time alone: 24 h^2 + 4 s h FLOPs per token at 0.64 of 312 TFLOP/s
    gemm_ms = 512 * 2048 * (24 * 2304**2 + 4 * 2048 * 2304) / (312e12 * 0.64) * 1e3
    assert gemm_ms < block.forward_ms < 1.5 * gemm_ms
    assert profile.layers[0].tp_units == profile.layers[-1].tp_units == 51200
    no_recompute = estimate_gpt(shape, DEVICE_RATES["a100-80gb"], batch_size=512, recompute=False)
    assert no_recompute.layers[1].saved_bytes == int(512 * 2048 * 2304 * (34 + 5 * 24 * 2048 / 2304))
    assert no_recompute.layers[1].backward_ms == pytest.approx(2 * no_recompute.layers[1].forward_ms)


def test_estimate_cli_writes_a_marked_profile_and_partition_shows_it(tmp_path):
    out = tmp_path / "gpt.json"
    runner = CliRunner()
    result = runner.invoke(cli, ["estimate", "--device", "h100-sxm", "--layers", "4", "--hidden", "512",
                                 "--heads", "8", "--seq-len", "128", "--vocab", "1024", "--batch-size", "16",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "ESTIMATED" in result.output
    raw = json.loads(out.read_text())
    assert raw["estimated"].startswith("what-if") and raw["device"]["name"] == "H100-SXM5-80GB"
    plan_path = tmp_path / "plan.json"
    result = runner.invoke(cli, ["partition", str(out), "--topology", "dgx-h100-pod", "--schedule", "1f1b-flush",
                                 "--microbatches", "16", "--optimizer", "adam", "-o", str(plan_path)])
    assert result.exit_code == 0, result.output
    assert "ESTIMATED profile" in result.output
    bad = runner.invoke(cli, ["estimate", "--device", "a100-80gb", "--layers", "2", "--hidden", "100",
                              "--heads", "8", "--batch-size", "4", "-o", str(tmp_path / "x.json")])
    assert bad.exit_code == 2 and bad.output.strip() == "error: GPT hidden size 100 is not a multiple of its 8 heads"
    assert not (tmp_path / "x.json").exists()
