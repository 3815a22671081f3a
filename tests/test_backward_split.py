"""The backward split in two: each layer's input-gradient ("I") and weight-gradient ("W") parts.

Measured by the profilers (a backward to the layer's inputs alone), derived from FLOPs in a
what-if profile, kept through the profile contract, and read by the simulator's durations.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeplan.capture import build_layer_graph
from pipeplan.errors import InputError
from pipeplan.planner.simulate import INPUT_GRAD_SHARE, durations, simulate_plan, stage_costs
from pipeplan.planner.tp_pricing import split_profile
from pipeplan.profile import Profile
from pipeplan.profiler.estimate import DEVICE_RATES, MATMUL_EFFICIENCY, GPTShape, estimate_gpt
from pipeplan.profiler.measure import measure_layers
from pipeplan.profiler.timing import CpuTimer

sys.path.insert(0, str(Path(__file__).parent))
from test_profiler import cross_entropy  # noqa: E402
from test_simulate import make_plan, make_profile, make_topology  # noqa: E402


def _share(layer_backward_input: float | None, backward: float) -> float:
    assert layer_backward_input is not None
    return layer_backward_input / backward


@pytest.mark.timing
def test_measured_split_puts_an_embeddings_backward_in_its_weights() -> None:
    """An embedding of token ids and a Linear on the model input need no input gradient: their
    whole backward is "W"; a Linear on a hidden value has both, a ReLU is all "I"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 256), nn.Flatten(), nn.Linear(2048, 1024), nn.ReLU())
    tokens = torch.randint(0, 4096, (32, 8))
    graph = build_layer_graph(model, (tokens,))
    layers, _ = measure_layers(
        graph, (tokens,), torch.randint(0, 1024, (32,)), cross_entropy, CpuTimer(), warmup=1, repeats=3
    )
    embedding, _, linear, relu = layers
    assert embedding.backward_input_ms is not None and embedding.backward_ms > 0
    assert _share(embedding.backward_input_ms, embedding.backward_ms) < 0.2
    for layer in layers:
        assert layer.backward_input_ms is not None and 0.0 <= layer.backward_input_ms <= layer.backward_ms
    # one GEMM of two, the other (grad_y.T @ x: 8 MiB written from 32 rows) memory-bound
    assert 0.03 < _share(linear.backward_input_ms, linear.backward_ms) < 0.9
    assert relu.backward_input_ms == relu.backward_ms  # no weights: all "I"


@pytest.mark.slow
def test_layer_by_layer_profile_measures_the_split_too() -> None:
    """The meta build's profiler (one layer at a time): a conv on the image takes no input gradient."""
    from pipeplan.profiler.profile_model import profile_model

    profile = profile_model("resnet", batch_size=2, device="cpu", warmup=0, repeats=1, build="meta")
    assert profile.input_grad_measured
    stem = profile.layers[0]
    assert stem.type == "Conv2d" and _share(stem.backward_input_ms, stem.backward_ms) < 0.2
    later = [layer for layer in profile.layers[1:] if layer.type == "Conv2d"]
    assert later and all(layer.backward_input_ms > 0 for layer in later)  # type: ignore[operator]


def test_the_split_round_trips_and_old_profiles_assume_half(tmp_path: Path) -> None:
    profile = make_profile([1.0, 1.0], [4.0, 2.0])
    measured = replace(profile, layers=(replace(profile.layers[0], backward_input_ms=3.0), profile.layers[1]))
    path = tmp_path / "profile.json"
    measured.save(path)
    loaded = Profile.load(path)
    assert loaded == measured and loaded.layers[0].backward_input_ms == 3.0
    assert (loaded.layers[0].input_grad_ms, loaded.layers[1].input_grad_ms) == (3.0, 1.0)
    assert not loaded.input_grad_measured  # layer 1 is not measured: half is assumed
    old = measured.to_dict()
    for layer in old["layers"]:
        del layer["backward_input_ms"]
    assert Profile.from_dict(old).layers[0].input_grad_ms == 4.0 * INPUT_GRAD_SHARE
    with pytest.raises(InputError, match=r"layer 0 \(layer0\): backward_input_ms = 5.0 is outside"):
        replace(measured, layers=(replace(measured.layers[0], backward_input_ms=5.0), measured.layers[1]))


def test_simulator_prices_zb_h1_on_the_measured_halves() -> None:
    """I and W of each stage are its layers' measured parts; with the whole backward in "I"
    (nothing to defer) ZB-H1 runs exactly as 1F1B-flush, with half of it in "W" faster."""
    topology = make_topology()
    profile = make_profile([1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0])
    all_input = replace(
        profile, layers=tuple(replace(layer, backward_input_ms=2.0) for layer in profile.layers)
    )
    quarter = replace(
        profile, layers=tuple(replace(layer, backward_input_ms=0.5) for layer in profile.layers)
    )
    plan = make_plan(profile, topology, [0, 1, 2, 3, 4], [1, 1, 1, 1], schedule="zb-h1", microbatches=8)
    timed = durations(plan, stage_costs(plan, quarter), 8)
    assert timed.backward_input_ms == (0.5 / 8,) * 4 and timed.backward_weight_ms == (1.5 / 8,) * 4
    flush = simulate_plan(plan, all_input, schedule="1f1b-flush").time_per_minibatch_ms
    assert simulate_plan(plan, all_input).time_per_minibatch_ms == pytest.approx(flush, rel=1e-9)
    assumed = simulate_plan(plan, profile).time_per_minibatch_ms
    assert simulate_plan(plan, quarter).time_per_minibatch_ms < assumed < flush


def test_estimated_gpt_splits_by_flops() -> None:
    """What-if GPT: the embedding's backward is all "W"; a block's "W" is its four weight GEMMs,
    a third of a recomputing block's backward; tensor parallelism divides "W" by t."""
    shape = GPTShape(layers=2, hidden=2048, heads=16, seq_len=2048, vocab=51200)
    profile = estimate_gpt(shape, DEVICE_RATES["a100-80gb"], 8)
    embedding, block = profile.layers[0], profile.layers[1]
    assert embedding.backward_input_ms == 0.0 and profile.input_grad_measured
    weight_ms = block.backward_ms - block.input_grad_ms
    tokens = 8 * shape.seq_len  # the four weight GEMMs: 24 h^2 FLOPs per token at the GEMM rate
    rate = DEVICE_RATES["a100-80gb"].matmul_flops_per_s * MATMUL_EFFICIENCY
    assert weight_ms == pytest.approx(tokens * 24 * shape.hidden**2 / rate * 1e3, rel=1e-12)
    assert 0.15 < weight_ms / block.backward_ms < 1 / 3  # recomputation: the forward again is "I"
    plain = estimate_gpt(shape, DEVICE_RATES["a100-80gb"], 8, recompute=False)
    assert plain.layers[1].backward_ms - plain.layers[1].input_grad_ms == pytest.approx(weight_ms)
    split = split_profile(profile, make_topology(per_server=8), 4).layers[1]
    assert split.backward_ms - split.input_grad_ms == pytest.approx(weight_ms / (4 * profile.tp_efficiency))
