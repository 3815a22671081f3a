import pytest

from pipeplan.errors import InputError
from pipeplan.topology import Topology, load_topology, parse_topology, preset, preset_names, resolve

GOOD = """name: cluster-a            # 4 servers x 4 GPUs
device: {name: V100-16GB, memory: 16 GiB}
levels:
  - {name: server,  count: 4, bandwidth: 10 GB/s}
  - {name: cluster, count: 4, bandwidth: 10 Gbit/s, latency: 5 us}
"""


def test_parse_good(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(GOOD)
    topo = Topology.load(path)
    assert topo.world_size == 16
    assert topo.device.memory_bytes == 16 * 2**30
    assert topo.levels[0].bandwidth_bytes_per_s == 10e9
    assert topo.levels[1].bandwidth_bytes_per_s == 1.25e9
    assert topo.levels[1].latency_ms == pytest.approx(0.005)
    assert Topology.from_dict(topo.to_dict()) == topo


@pytest.mark.parametrize(
    "old,new,needle",
    [
        ("count: 4, bandwidth: 10 GB/s", "count: 0, bandwidth: 10 GB/s", "<string>:4: 'levels[0].count'"),
        ("count: 4, bandwidth: 10 Gbit", "count: -2, bandwidth: 10 Gbit", "<string>:5: 'levels[1].count'"),
        ("10 GB/s", "0 GB/s", "<string>:4: 'levels[0].bandwidth'"),
        ("10 Gbit/s", "10 Gbps", "unknown bandwidth unit 'Gbps'"),
        ("memory: 16 GiB", "memory: 16 gigs", "<string>:2: 'device.memory'"),
        ("{name: server,  count: 4, ", "{name: server, ", "<string>:4: missing key 'levels[0].count'"),
        (
            "latency: 5 us}",
            "latency: 5 us, message_overhead: -1 us}",
            "<string>:5: 'levels[1].message_overhead'",
        ),
        (
            "latency: 5 us}",
            "latency: 5 us, message_overhead: 2 parsecs}",
            "<string>:5: 'levels[1].message_overhead'",
        ),
        ("latency: 5 us}", "latency: 5 us, overhead: 2 us}", "unknown key 'overhead'"),
    ],
)
def test_bad_values_name_key_and_line(old, new, needle):
    text = GOOD.replace(old, new)
    with pytest.raises(InputError) as info:
        parse_topology(text, source="<string>")
    message = str(info.value)
    assert "\n" not in message
    assert needle in message


def test_message_overhead_is_read_kept_in_a_plan_and_absent_from_older_files():
    topo = parse_topology(GOOD.replace("latency: 5 us}", "latency: 5 us, message_overhead: 230 us}"))
    assert topo.levels[0].message_overhead_ms == 0.0  # not given: none
    assert topo.levels[1].message_overhead_ms == pytest.approx(0.23)
    assert topo.levels[1].message_ms == pytest.approx(0.235)  # a collective's step: latency + overhead
    assert Topology.from_dict(topo.to_dict()) == topo
    older = parse_topology(GOOD)  # a plan written before the field: the key is absent, and reads 0
    assert "message_overhead_ms" not in older.to_dict()["levels"][1]
    assert Topology.from_dict(older.to_dict()).levels[1].message_overhead_ms == 0.0
    bad = topo.to_dict()
    bad["levels"][1]["message_overhead_ms"] = -0.1
    with pytest.raises(InputError, match=r"levels\[1\]: .* message overhead -0.1 ms >= 0"):
        Topology.from_dict(bad)


def test_missing_top_key():
    with pytest.raises(InputError, match="missing key 'levels'"):
        parse_topology("name: x\ndevice: {name: a, memory: 1 GiB}\n", source="t")


def test_presets():
    assert {"cluster-a", "cluster-b", "dgx-h100-pod", "local-cpu"} <= set(preset_names())
    assert preset("cluster-a").world_size == 16
    assert preset("cluster-b").levels[0].count == 8
    assert preset("local-cpu").device.kind == "cpu"
    # measured on the dev VM (bench/bench_exchange.py); the GPU presets' NCCL needs none
    assert preset("local-cpu").levels[0].message_overhead_ms == pytest.approx(0.23)
    assert all(level.message_overhead_ms == 0.0 for level in preset("cluster-a").levels)
    assert resolve("cluster-a") == preset("cluster-a")
    with pytest.raises(InputError, match="no topology preset"):
        resolve("nope")


def test_load_missing_file(tmp_path):
    with pytest.raises(InputError, match="cannot read topology"):
        load_topology(tmp_path / "none.yaml")


@pytest.mark.parametrize("name", preset_names())
def test_to_yaml_reads_back_as_the_same_topology(name):
    topology = preset(name)
    assert parse_topology(topology.to_yaml()) == topology


def test_to_yaml_keeps_odd_names_every_figure_and_the_optional_links():
    from dataclasses import replace

    from pipeplan.topology import Level

    topology = replace(
        preset("local-cpu"),
        name="a: b # c",
        levels=(Level("host: 1", 2, 4.75e9, 0.0451234567, 0.436279296875), Level("'rack'", 3, 1.25e8, 1e-05)),
        storage_bandwidth_bytes_per_s=1.5e9,
        host_bandwidth_bytes_per_s=2.5e10,
    )
    text = topology.to_yaml()
    assert parse_topology(text) == topology
    # every figure says its unit
    assert "message_overhead: 0.436279296875 ms" in text and "memory: 4294967296 B" in text
    assert "bandwidth: 4750000000.0 B/s" in text and "latency: 1e-05 ms" in text
