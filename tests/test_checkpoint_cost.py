"""The checkpoint cost a plan predicts (``planner.checkpoint_cost``, issue 34): bytes per stage
against what the runtime's checkpoint state holds, the write time at the topology's storage
bandwidth, and how ``partition`` / ``simulate`` say it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from pipeplan.cli import cli
from pipeplan.errors import InputError
from pipeplan.plan import Plan
from pipeplan.planner.checkpoint_cost import checkpoint_bytes
from pipeplan.precision import Precision
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.reporting.checkpoint_cost import checkpoint_summary, sync_interval
from pipeplan.runtime.checkpoint.state import rank_state
from pipeplan.topology import parse_topology

VGG = str(Path(__file__).parent / "fixtures" / "pipedream" / "vgg16" / "graph.txt")
TOPOLOGY = """\
name: four
device: {name: V100, memory: 16 GiB}
storage: {bandwidth: 1 GB/s}
levels:
  - {name: server, count: 4, bandwidth: 10 GB/s}
"""


def _profile_of(model: nn.Sequential) -> Profile:
    layers = tuple(
        LayerProfile(
            i,
            str(i),
            type(m).__name__,
            (i - 1,) if i else (),
            1.0,
            2.0,
            64,
            sum(p.numel() * p.element_size() for p in m.parameters()),
            64,
        )
        for i, m in enumerate(model)
    )
    return Profile("m", "f", DeviceInfo("cpu", "x"), 4, "float32", layers)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_stage_bytes_match_the_tensors_a_rank_checkpoints(optimizer: str) -> None:
    """The predicted bytes are those of the tensors ``rank_state`` saves for the stage (its
    weights and its optimizer state after a step), to within the optimizer's step counters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32), nn.Linear(32, 8))
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p),
    }[optimizer]
    stage = nn.Sequential(*list(model)[2:])  # layers 2 and 3 as one stage
    opt = make(stage.parameters())
    stage(torch.randn(4, 128)).sum().backward()
    opt.step()
    names = {key: key for key in stage.state_dict()}
    saved = rank_state(stage, names, opt)
    tensor_bytes = sum(v.numel() * v.element_size() for v in saved.values() if torch.is_tensor(v))
    tensor_bytes -= saved["rng"].numel()  # the RNG state is not the stage's
    predicted = checkpoint_bytes(_profile_of(model), [2, 3], optimizer, Precision("float32"))
    assert predicted == pytest.approx(tensor_bytes, abs=16)  # Adam's two 4-byte step counters


def test_the_plan_carries_bytes_per_stage_and_the_write_at_the_storage_bandwidth(tmp_path: Path) -> None:
    topology = tmp_path / "four.yaml"
    topology.write_text(TOPOLOGY)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        cli, ["partition", VGG, "--topology", str(topology), "--optimizer", "adam", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert plan.topology.storage_bandwidth_bytes_per_s == 1e9
    writers: Counter[int] = Counter()
    for stage in plan.stages:
        params = sum(layer_param_bytes for layer_param_bytes in _vgg_param_bytes(stage.layers))
        assert stage.checkpoint_bytes == round(3 * params)  # weights + Adam's two moments
        writers[stage.ranks[0]] += stage.checkpoint_bytes
    assert plan.predicted.checkpoint_write_ms == pytest.approx(max(writers.values()) / 1e6)
    text = " ".join(result.output.split())
    assert "weights and adam state" in text and "per rank it takes" in text
    again = CliRunner().invoke(cli, ["simulate", str(out)])
    assert again.exit_code == 0 and "synchronous saves cost" in " ".join(again.output.split())


def _vgg_param_bytes(layers: tuple[int, ...]) -> list[int]:
    from pipeplan.profiler.pipedream_graph import load_pipedream_graph

    profile = load_pipedream_graph(VGG)
    return [profile.layers[i].param_bytes for i in layers]


def test_without_a_storage_bandwidth_only_bytes_are_predicted(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["partition", VGG, "--topology", "cluster-a", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert plan.predicted.checkpoint_write_ms == 0.0 and all(s.checkpoint_bytes > 0 for s in plan.stages)
    assert "no write time predicted" in " ".join(result.output.split())


def test_summary_prices_synchronous_and_asynchronous_saves() -> None:
    assert sync_interval(70.0, 100.0) == 20 and sync_interval(0.0, 100.0) == 1
    plan = Plan.load(_plan_with_storage())
    text = checkpoint_summary(plan, period_ms=plan.predicted.checkpoint_write_ms / 2.5)
    # a write of 2.5 steps: 250% of a step synchronously; asynchronously hidden behind 3 steps
    assert "cost 250.0% of a" in text and "behind 3 step(s)" in text


def _plan_with_storage() -> Path:
    import tempfile

    folder = Path(tempfile.mkdtemp())
    (folder / "t.yaml").write_text(TOPOLOGY)
    out = folder / "plan.json"
    result = CliRunner().invoke(cli, ["partition", VGG, "--topology", str(folder / "t.yaml"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_a_bad_storage_entry_is_one_line_naming_it() -> None:
    with pytest.raises(InputError, match=r"<t>:3: 'storage.bandwidth': must be positive"):
        parse_topology(TOPOLOGY.replace("1 GB/s", "0 GB/s"), "<t>")
    with pytest.raises(InputError, match=r"unknown key 'rate' in 'storage'"):
        parse_topology(TOPOLOGY.replace("bandwidth: 1 GB/s}", "rate: 1 GB/s}"), "<t>")
