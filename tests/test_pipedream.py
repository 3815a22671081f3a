"""PipeDream graph.txt import and PipeDream's optimizer (``--cost-model pipedream``)."""

from pathlib import Path

import pytest

from pipeplan.errors import InputError
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.profiler.pipedream_graph import is_pipedream_graph, load_pipedream_graph, parse_pipedream_graph
from pipeplan.topology import DeviceSpec, Level, Topology, preset

FIXTURES = Path(__file__).parent / "fixtures" / "pipedream"


def test_import_alexnet_drops_input_and_orders_topologically():
    profile = load_pipedream_graph(FIXTURES / "alexnet" / "graph.txt", batch_size=128)
    assert profile.source == "pipedream" and profile.batch_size == 128
    assert len(profile.layers) == 22  # 23 nodes minus the Input node
    assert all(layer.type != "Input" for layer in profile.layers)
    first = profile.layers[0]
    assert first.type == "Conv2d" and first.forward_ms == pytest.approx(22.316) and first.param_bytes == 93184
    view = next(layer for layer in profile.layers if layer.type == "View")
    assert len(view.inputs) == 2  # MaxPool and Size feed View: a DAG
    again = load_pipedream_graph(FIXTURES / "alexnet" / "graph.txt")
    assert again.fingerprint == profile.fingerprint


def test_import_errors_name_line():
    assert is_pipedream_graph((FIXTURES / "vgg16" / "graph.txt").read_text())
    with pytest.raises(InputError, match=r"g:2: not a PipeDream node line"):
        parse_pipedream_graph(
            "node1 -- Input -- forward_compute_time=1.0, backward_compute_time=0.0, "
            "activation_size=4.0, parameter_size=0.000\nbogus\n",
            source="g",
        )


def small():
    """layers (f + b): 10, 10, 20 ms; params 1 MB, 0, 2 MB; outputs 100 kB each."""
    layers = tuple(
        LayerProfile(i, f"l{i}", "x", () if i == 0 else (i - 1,), c / 2, c / 2, 100_000, p, 100_000)
        for i, (c, p) in enumerate([(10.0, 10**6), (10.0, 0), (20.0, 2 * 10**6)])
    )
    return Profile("m", "fp", DeviceInfo("cuda", "V100"), 64, "float32", layers)


def test_pipedream_hand_derived():
    """PipeDream on 2 machines, 1 GB/s (one level, so units inside = 1), seconds:

    - one stage on 2 machines: (0.04 + 4*1*3e6/(1e9*2)) / 2 = (0.04 + 0.006) / 2 = 0.023
    - split after layer 0, last stage [1, 2] on 1: max(A[0][0][1 machine] = 0.01, 0.03) = 0.03
    - split after layer 1, last stage [2] on 1: max(A[0][1][1] = 0.02, 0.02) = 0.02  <- best
    - data parallel: (0.04 + 4*1*3e6/(1e9*2)) / 2 = 0.023 s, so 23/20 = 1.15x
    With an activation compression ratio of 1 the cut adds 2*1e5/1e9 = 0.0002 s: still 0.02.
    """
    topo = Topology("one", DeviceSpec("V100", 16 * 2**30), (Level("server", 2, 1e9),))
    for ratio in (None, 1.0):
        plan = partition(
            small(), topo, PartitionOptions(cost_model="pipedream", activation_compression_ratio=ratio)
        )
        assert plan.predicted.time_per_minibatch_ms == pytest.approx(20.0)
        assert [(s.layer_start, s.layer_end, s.replicas) for s in plan.stages] == [(0, 2, 1), (2, 3, 1)]
        assert plan.predicted.data_parallel_ms == pytest.approx(23.0)
        assert plan.predicted.speedup_vs_data_parallel == pytest.approx(1.15)
    straight = partition(small(), topo, PartitionOptions(cost_model="pipedream", straight=True))
    assert straight.predicted.time_per_minibatch_ms == pytest.approx(20.0)


# Values of PipeDream's optimizer_graph_hierarchical.py on these profiles (cross-checked
# against a transcription of it run on the same states): (ms per minibatch, stages).
EXPECTED = {
    ("vgg16", "cluster-a"): (44.12107431111115, [(0, 16, 12), (16, 25, 3), (25, 40, 1)], 135.4247797),
    ("vgg16", "cluster-b"): (46.38155099999999, [(0, 8, 8), (8, 25, 7), (25, 40, 1)], 68.20607290666666),
    ("alexnet", "cluster-a"): (
        6.0111784,
        [(0, 6, 8), (6, 9, 4), (9, 13, 2), (13, 17, 1), (17, 22, 1)],
        46.5756295,
    ),
    ("alexnet", "cluster-b"): (5.506, [(0, 6, 8), (6, 12, 6), (12, 17, 1), (17, 22, 1)], 16.890804733333333),
}


@pytest.mark.parametrize("model,cluster", sorted(EXPECTED))
def test_pipedream_profiles_reproduce_optimizer(model, cluster):
    profile = load_pipedream_graph(FIXTURES / model / "graph.txt", batch_size=64)
    expected_ms, expected_stages, expected_dp = EXPECTED[(model, cluster)]
    for memory_check in (False, True):
        plan = partition(
            profile, preset(cluster), PartitionOptions(cost_model="pipedream", memory_check=memory_check)
        )
        assert plan.predicted.time_per_minibatch_ms == pytest.approx(expected_ms, rel=1e-12)
        assert [(s.layer_start, s.layer_end, s.replicas) for s in plan.stages] == expected_stages
        assert plan.predicted.data_parallel_ms == pytest.approx(expected_dp, rel=1e-12)
        assert sum(s.replicas for s in plan.stages) == 16


def test_pipedream_mode_warns_when_pipeplan_memory_exceeds_the_device(tmp_path):
    """VGG-16 on Cluster-A passes PipeDream's check (activations + parameters), but by
    pipeplan's model its first stage (16 layers on 12 devices, 1F1B-RR with 2 weight
    versions and 2 minibatches in flight) needs more than 16 GiB: the plan is kept (as
    PipeDream keeps it), one warning line names the worst stage; a fitting plan prints none."""
    from click.testing import CliRunner

    from pipeplan.cli import cli
    from pipeplan.plan import Plan

    graph = str(FIXTURES / "vgg16" / "graph.txt")
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        cli, ["partition", graph, "--topology", "cluster-a", "--cost-model", "pipedream", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    over = [s for s in plan.stages if s.memory_bytes > 16 * 2**30]
    assert [s.index for s in over] == [0]
    # besides the one line every imported profile gets: no backward working memory recorded
    unrecorded = "does not record its layers' backward working memory"
    warnings = [
        line for line in result.output.splitlines() if line.startswith("warning:") and unrecorded not in line
    ]
    assert len(warnings) == 1
    assert (
        "1 stage(s) exceed 16.0 GiB per device by pipeplan's memory model (stage 0: 24.1 GiB)" in warnings[0]
    )
    assert "cut states searched: all-downsets (41 states)" in result.output
    fitting = CliRunner().invoke(cli, ["partition", graph, "--topology", "cluster-a", "-o", str(out)])
    assert fitting.exit_code == 0
    assert [line for line in fitting.output.splitlines() if line.startswith("warning:")] == [
        next(line for line in result.output.splitlines() if unrecorded in line)
    ]
