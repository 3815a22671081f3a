import json
from pathlib import Path

from click.testing import CliRunner

from pipeplan.cli import cli
from pipeplan.plan import Plan

VGG = str(Path(__file__).parent / "fixtures" / "pipedream" / "vgg16" / "graph.txt")


def test_partition_pipedream_graph(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        cli, ["partition", VGG, "--topology", "cluster-a", "--cost-model", "pipedream", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert json.loads(out.read_text())["schema"] == "pipeplan.plan/2"
    assert plan.world_size == 16 and plan.cost_model == "pipedream"
    assert abs(plan.predicted.time_per_minibatch_ms - 44.12107431111115) < 1e-9
    assert "bottleneck" in result.output and "pipeline speed-up" in result.output and "GiB" in result.output


def test_partition_default_model_fits_memory(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["partition", VGG, "--topology", "cluster-a", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert all(s.memory_bytes <= plan.topology.device.memory_bytes for s in plan.stages)
    assert sorted(r for s in plan.stages for r in s.ranks) == list(range(16))


def test_bad_topology_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\ndevice: {name: a, memory: 16 GiB}\nlevels:\n  - {name: s, count: 2, bandwidth: 5 parsecs}\n"
    )
    result = CliRunner().invoke(cli, ["partition", VGG, "--topology", str(bad)])
    assert result.exit_code == 2
    assert "bad.yaml:4: 'levels[0].bandwidth'" in result.output
    assert "Traceback" not in result.output


def test_infeasible_memory_exits_2(tmp_path):
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(
        "name: t\ndevice: {name: a, memory: 100 MB}\nlevels:\n  - {name: s, count: 2, bandwidth: 5 GB/s}\n"
    )
    result = CliRunner().invoke(
        cli, ["partition", VGG, "--topology", str(tiny), "-o", str(tmp_path / "p.json")]
    )
    assert result.exit_code == 2
    assert "error: no plan fits in 95.4 MiB per device" in result.output
    assert not (tmp_path / "p.json").exists()


def test_a_cpu_preset_says_its_message_overhead_was_measured_elsewhere(tmp_path):
    from pipeplan.topology import preset
    from tests.test_simulate import make_profile

    profile = tmp_path / "profile.json"
    make_profile([0.5] * 4, output_bytes=4096).save(profile)
    note = (
        "note: preset 'local-cpu' gives a message overhead measured on another machine or day (host "
        "230 us); `pipeplan calibrate --topology local-cpu -o measured.yaml` measures this one's"
    )

    def partition(topology: str) -> str:
        result = CliRunner().invoke(
            cli,
            ["partition", str(profile), "--topology", topology, "--straight", "-o", str(tmp_path / "p.json")],
        )
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split())

    assert note in partition("local-cpu")
    # the same figures from a file (what calibrate writes): no note
    measured = tmp_path / "measured.yaml"
    measured.write_text(preset("local-cpu").to_yaml())
    assert "note: preset" not in partition(str(measured))
