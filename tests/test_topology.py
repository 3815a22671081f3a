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
    ],
)
def test_bad_values_name_key_and_line(old, new, needle):
    text = GOOD.replace(old, new)
    with pytest.raises(InputError) as info:
        parse_topology(text, source="<string>")
    message = str(info.value)
    assert "\n" not in message
    assert needle in message


def test_missing_top_key():
    with pytest.raises(InputError, match="missing key 'levels'"):
        parse_topology("name: x\ndevice: {name: a, memory: 1 GiB}\n", source="t")


def test_presets():
    assert {"cluster-a", "cluster-b", "dgx-h100-pod", "local-cpu"} <= set(preset_names())
    assert preset("cluster-a").world_size == 16
    assert preset("cluster-b").levels[0].count == 8
    assert preset("local-cpu").device.kind == "cpu"
    assert resolve("cluster-a") == preset("cluster-a")
    with pytest.raises(InputError, match="no topology preset"):
        resolve("nope")


def test_load_missing_file(tmp_path):
    with pytest.raises(InputError, match="cannot read topology"):
        load_topology(tmp_path / "none.yaml")
