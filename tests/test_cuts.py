"""Cut families over a DAG (``planner.cuts``), the DP over downsets against brute force,
and pipeplan's ``--cost-model pipedream`` against PipeDream's own antichain optimizer."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from brute_force import plan_at_brute_force_optimum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.capture import build_layer_graph
from pipeplan.errors import InputError
from pipeplan.modelfile import load_model_file
from pipeplan.planner.costs import layer_arrays
from pipeplan.planner.cuts import cut_family
from pipeplan.planner.exhaustive import exhaustive_best
from pipeplan.planner.memory import plan_stage_memory
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.profiler.pipedream_graph import load_pipedream_graph
from pipeplan.topology import DeviceSpec, Level, Topology, preset

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES / "pipedream"))

from oracle import Graph, pipedream_optimum_ms  # noqa: E402


def dag(inputs: list[tuple[int, ...]], compute=None, params=None, outputs=None) -> Profile:
    n = len(inputs)
    compute = compute or [1.0] * n
    params = params or [1000] * n
    outputs = outputs or [100] * n
    layers = tuple(
        LayerProfile(
            i, f"l{i}", "x", inputs[i], compute[i] / 2, compute[i] / 2, outputs[i], params[i], outputs[i]
        )
        for i in range(n)
    )
    return Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers)


def brute_downsets(profile: Profile) -> set[frozenset[int]]:
    n = len(profile.layers)
    out = set()
    for bits in range(1 << n):
        members = {i for i in range(n) if bits >> i & 1}
        if all(p in members for i in members for p in profile.layers[i].inputs):
            out.add(frozenset(members))
    return out


def family_sets(profile: Profile) -> list[frozenset[int]]:
    family = cut_family(profile)
    return [frozenset(family.stage_layers(0, s)) for s in range(family.states)]


def test_diamond_family_is_every_downset_sorted_by_size():
    """0 -> {1, 2} -> 3: downsets {}, {0}, {0,1}, {0,2}, {0,1,2}, all (6)."""
    profile = dag([(), (0,), (0,), (1, 2)])
    family = cut_family(profile)
    assert family.name == "all-downsets" and family.exact and family.states == 6
    assert family_sets(profile) == [frozenset(s) for s in ([], [0], [0, 1], [0, 2], [0, 1, 2], [0, 1, 2, 3])]
    arrays = layer_arrays(profile, None, family)
    assert arrays.nested(2, 4) and not arrays.nested(2, 3) and not arrays.nested(3, 2)
    # {0, 2} | {1, 3}: the non-contiguous stage of the diamond
    assert family.stage_layers(3, 5) == (1, 3)
    # {0}: its output once though two layers read it; {0, 1}: outputs of 0 and 1 (100 B each)
    assert list(arrays.cut_bytes) == [0, 100, 200, 200, 200, 0]


def test_chain_family_is_the_prefixes():
    profile = dag([(), (0,), (1,), (2,)])
    family = cut_family(profile)
    assert family.is_prefix and family.exact and family.states == 5 and family.name == "all-downsets"


def test_wide_graph_falls_back_to_windows_with_every_prefix():
    """20 independent layers have 2^20 downsets: the family keeps every prefix and the
    downsets of windows, at most ``limit`` states."""
    profile = dag([()] * 20)
    family = cut_family(profile, limit=200)
    assert family.name.startswith("window-") and not family.exact and family.states <= 200
    sets = family_sets(profile)
    assert all(frozenset(range(s)) in sets for s in range(21))
    assert sets == sorted(sets, key=len)
    assert prefix_only(profile, limit=20).name == "prefix"


def prefix_only(profile: Profile, limit: int):
    return cut_family(profile, limit=limit)


def test_pipeplan_counts_a_crossing_tensor_once_pipedream_augments():
    """resnet18, cut after layer 39 (node41): node35 feeds node36 and node41, both
    inside the cut; PipeDream's augmented antichain {node35, node40, node41} charges
    205,520,896 B where 102,760,448 B (node40's and node41's outputs... 2 x 51,380,224 B) cross."""
    path = FIXTURES / "pipedream" / "resnet18" / "graph.txt"
    profile = load_pipedream_graph(path, batch_size=64)
    arrays = layer_arrays(profile)
    assert arrays.cut_bytes[40] == 102_760_448
    gr = Graph.from_str(path.read_text())
    for node in gr.sources():
        if node.node_desc.startswith("Input"):
            gr.remove_node(node)
    antichain = ["node40", "node41"]  # the frontier of layers 0..39
    assert {n.node_id for n in gr.all_predecessors(antichain)} == {
        layer.name for layer in profile.layers[:40]
    }
    augmented = gr.augment_antichain(antichain)
    assert sorted(augmented) == ["node35", "node40", "node41"]
    assert sum(gr.nodes[node].activation_size for node in augmented) == 205_520_896


# --- the DP over every downset == brute force over every downset --------------------


@st.composite
def dag_cases(draw):
    n = draw(st.integers(2, 5))
    layers = []
    for i in range(n):
        inputs = (
            tuple(sorted(set(draw(st.lists(st.integers(0, i - 1), min_size=1, max_size=2))))) if i else ()
        )
        layers.append(
            LayerProfile(
                i,
                f"l{i}",
                "x",
                inputs,
                draw(st.floats(0.1, 5)),
                draw(st.floats(0.1, 5)),
                draw(st.integers(0, 4000)),
                draw(st.integers(0, 8000)),
                draw(st.integers(0, 3000)),
            )
        )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", tuple(layers))
    counts = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    levels = tuple(Level(f"l{k}", c, draw(st.sampled_from([1e6, 3e6, 1e7]))) for k, c in enumerate(counts))
    memory = draw(st.sampled_from([10**9, 40_000, 25_000]))
    options = PartitionOptions(
        schedule=draw(st.sampled_from(["1f1b-rr", "gpipe"])),
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        straight=draw(st.booleans()),
        max_stages=draw(st.sampled_from([None, None, 2, 3])),
        recompute=draw(st.sampled_from(["auto", "none"])),
    )
    return profile, Topology("t", DeviceSpec("d", memory), levels), options


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag_cases())
def test_dp_equals_brute_force_over_every_downset(case):
    profile, topology, options = case
    assert set(family_sets(profile)) == brute_downsets(profile)
    best, _ = exhaustive_best(profile, topology, options)
    plan = plan_at_brute_force_optimum(best, profile, topology, options)
    if plan is None:
        return
    assert plan.cut_family == "all-downsets" and plan.cut_candidates == len(brute_downsets(profile))
    owner = {layer: s.index for s in plan.stages for layer in s.layers}
    assert sorted(owner) == list(range(len(profile.layers)))
    for layer in profile.layers:  # every edge goes to the same or a later stage
        assert all(owner[p] <= owner[layer.index] for p in layer.inputs)
    replicas = [s.replicas for s in plan.stages]
    for q, stage in enumerate(plan.stages):
        params = sum(profile.layers[i].param_bytes for i in stage.layers)
        saved = sum(profile.layers[i].saved_bytes for i in stage.layers)
        memory, _, _ = plan_stage_memory(options.schedule, replicas, q, params, saved, options.optimizer)
        assert stage.memory_bytes <= topology.device.memory_bytes
        if not stage.recompute_layers and stage.shard == "none":
            # else its memory is less (tests/test_recompute.py, tests/test_sharding.py)
            assert memory == stage.memory_bytes
        else:
            assert stage.memory_bytes < memory


def test_unnested_neighbouring_downsets_do_not_prove_a_layer_never_fits():
    """Found by hypothesis: downsets 3 = {0, 3} and 4 = {0, 1, 2} are neighbours in the
    family's order but not nested, so their difference is no stage. The DP's infeasibility
    proof read it as a single layer of 12,567 B of Adam parameters (50 kB > 40 kB) and gave
    up; the plan {0, 1, 3} | {2} | {4} fits (its largest stage 30.9 kB) at 11 ms."""
    layers = (
        LayerProfile(0, "l0", "x", (), 1.0, 1.0, 0, 0, 0),
        LayerProfile(1, "l1", "x", (0,), 1.0, 1.0, 0, 4938, 3000),
        LayerProfile(2, "l2", "x", (1,), 5.0, 1.0, 0, 7629, 386),
        LayerProfile(3, "l3", "x", (0,), 5.0, 2.0, 0, 0, 0),
        LayerProfile(4, "l4", "x", (2,), 5.0, 1.0, 0, 1530, 3000),
    )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers)
    topology = Topology("t", DeviceSpec("d", 40000), (Level("l0", 3, 1e7),))
    options = PartitionOptions(schedule="gpipe", optimizer="adam", recompute="none", shard="none")
    assert exhaustive_best(profile, topology, options)[0] == 11.0
    plan = partition(profile, topology, options)
    assert plan.predicted.stage_bound_ms == 11.0
    assert [s.layers for s in plan.stages] == [(0, 1, 3), (2,), (4,)]


def test_a_non_prefix_cut_beats_every_prefix():
    """Diamond 0 -> {1, 2} -> 3, 4 ms per layer, two devices at 100 MB/s, one per stage.
    Prefixes of 0, 1, 2, 3: {0} or {0, 1, 2} give a 12 ms stage; {0, 1} sends layer 0's
    10 kB and layer 1's 1 MB: 2 * 1.01 MB / 100 MB/s = 20.2 ms. The downset {0, 2} sends
    10 kB + 1 kB: 0.22 ms, so 8 ms per minibatch with stages {0, 2} | {1, 3}."""
    profile = dag(
        [(), (0,), (0,), (1, 2)],
        compute=[4.0, 4.0, 4.0, 4.0],
        params=[0, 0, 0, 0],
        outputs=[10_000, 1_000_000, 1_000, 10],
    )
    topology = Topology("2", DeviceSpec("d", 10**12), (Level("host", 2, 1e8),))
    plan = partition(profile, topology, PartitionOptions(straight=True))
    assert [s.layers for s in plan.stages] == [(0, 2), (1, 3)]
    assert (plan.stages[0].layer_start, plan.stages[0].layer_end) == (0, 3)
    assert plan.predicted.stage_bound_ms == pytest.approx(8.0)
    assert plan.stages[0].communication_ms == pytest.approx(2 * 11_000 / 1e8 * 1e3)


def test_split_refuses_an_edge_to_an_earlier_stage():
    model = load_model_file(str(FIXTURES / "runtime" / "branches.py"))
    graph = build_layer_graph(model.build(), model.batch(4, 0)[0])
    assert len(graph.split([0, 0, 1, 0, 1, 1])) == 2  # {0, 1, 3} | {2, 4, 5}
    with pytest.raises(InputError, match="layer 3 \\(stage 0\\) reads layer 1 of the later stage 1"):
        graph.split([0, 1, 0, 0, 1, 1])


# --- never worse than PipeDream's optimizer ------------------------------------------

GiB = 2**30
TOPOLOGIES = {
    "4x4": preset("cluster-a"),
    "8-flat": Topology("8-flat", DeviceSpec("V100", 16 * GiB), (Level("server", 8, 10e9),)),
}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["squeezenet1_0", "resnet18"])
@pytest.mark.parametrize("shape", sorted(TOPOLOGIES))
def test_pipedream_mode_is_never_worse_than_pipedream(model: str, shape: str):
    """PipeDream's optimizer (tests/fixtures/pipedream/oracle.py, a transcription of its
    antichain DAG and compute_partitioning) on its own profile, with and without
    activation compression: pipeplan's optimum is <= PipeDream's, over a superset of its
    states (every downset) and counting each crossing tensor once."""
    path = FIXTURES / "pipedream" / model / "graph.txt"
    profile = load_pipedream_graph(path, batch_size=64)
    topology = TOPOLOGIES[shape]
    for ratio in (None, 1.0):
        want, states = pipedream_optimum_ms(
            path.read_text(),
            [lv.count for lv in topology.levels],
            [lv.bandwidth_bytes_per_s for lv in topology.levels],
            topology.device.memory_bytes,
            activation_compression_ratio=ratio,
        )
        plan = partition(
            profile, topology, PartitionOptions(cost_model="pipedream", activation_compression_ratio=ratio)
        )
        assert plan.cut_family == "all-downsets" and plan.cut_candidates == states + 1  # + the empty set
        assert math.isfinite(want)
        assert plan.predicted.stage_bound_ms <= want * (1 + 1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag_cases(), st.integers(4, 9))
def test_pruning_over_downsets_changes_nothing(case, extra):
    """Pruned and unpruned DP over every downset: same optimum and plan (sums over
    states need not grow with the state index, so the pruning bounds scan every length)."""
    from pipeplan.planner.dp import DPSettings, reconstruct, solve

    profile, topology, options = case
    layers = list(profile.layers)
    for i in range(len(layers), len(layers) + extra):  # widen: extra layers off random earlier ones
        layers.append(
            LayerProfile(i, f"l{i}", "x", (i * 7 % i, i - 2), 1.0 + i % 3, 0.5, 500 * (i % 4), 100 * i, 300)
        )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", tuple(layers))
    arrays = layer_arrays(profile, None, cut_family(profile))
    dp_settings = DPSettings(options.schedule, options.optimizer, options.straight, options.max_stages)
    pruned, full = solve(arrays, topology, dp_settings), solve(arrays, topology, dp_settings, prune=False)
    assert pruned.time_ms == full.time_ms
    if math.isfinite(full.time_ms):
        assert reconstruct(pruned) == reconstruct(full)
