"""The topology contract: a hierarchy of device groups joined by bandwidths.

``levels`` is innermost first: level 0 groups ``levels[0].count`` devices joined by
``levels[0].bandwidth_bytes_per_s``; level k groups ``levels[k].count`` units of level
k-1. ``world_size`` is the product of the counts. Global rank r sits in unit
``r // prod(counts[:k+1])`` of level k (ranks are numbered innermost-first).
Read from YAML (``load``); embedded in plan.json as a dict (``to_dict``/``from_dict``).

A topology file lists the levels innermost first, any number of them::

    name: cluster-a            # 4 servers x 4 GPUs
    device: {name: V100-16GB, memory: 16 GiB}          # kind: cuda (default) | cpu
    levels:
      - {name: server,  count: 4, bandwidth: 10 GB/s}   # latency: 5 us (optional)
        # message_overhead: 200 us (optional): what each end of a message costs its own
        # rank's cores, beside the latency (gloo on cores the compute shares); see Level
      - {name: cluster, count: 4, bandwidth: 10 Gbit/s}
    storage: {bandwidth: 2 GB/s}   # optional: each rank's checkpoint write rate
    host_link: {bandwidth: 25 GB/s}  # optional: device <-> host memory (offload); planner assumes PCIe Gen4 x16


Units are parsed strictly by ``pipeplan.units``; a bad value raises ``InputError``
naming the file, the line and the key. Presets live in ``pipeplan.configs.topologies``
(``preset(name)``); ``resolve(arg)`` takes a path or a preset name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pipeplan.errors import InputError
from pipeplan.units import parse_bandwidth, parse_bytes, parse_duration_ms

__all__ = ["Level", "DeviceSpec", "Topology", "load_topology", "preset", "preset_names", "resolve"]


@dataclass(frozen=True)
class Level:
    name: str  # "server", "rack", ...
    count: int  # units of the level below grouped here (devices, for level 0)
    bandwidth_bytes_per_s: float  # between two units of this level
    latency_ms: float = 0.0  # per message between two units of this level
    # per message, time each end spends on its own rank (posting, waking, copying) that the
    # rank's compute cannot overlap: gloo's threads on the cores the compute uses. The
    # latency overlaps the ranks' work, this does not. 0: a separate engine moves the bytes
    # (NCCL, a NIC), or not measured
    message_overhead_ms: float = 0.0

    @property
    def message_ms(self) -> float:
        """What one message holds a rank that waits on it (a collective's step): latency + overhead."""
        return self.latency_ms + self.message_overhead_ms


@dataclass(frozen=True)
class DeviceSpec:
    name: str  # "V100-16GB"
    memory_bytes: int
    kind: str = "cuda"  # "cuda" | "cpu": decides the runtime backend (nccl | gloo)


@dataclass(frozen=True)
class Topology:
    name: str
    device: DeviceSpec
    levels: tuple[Level, ...]  # innermost first
    # bytes/s at which each rank writes a checkpoint (``storage: {bandwidth: ...}``); 0: not given
    storage_bandwidth_bytes_per_s: float = 0.0
    # bytes/s between a device and its host's memory (``host_link: {bandwidth: ...}``), what
    # offload's copies cross (pipeplan.planner.offload); None: not given, the planner assumes
    # ``pipeplan.planner.offload.DEFAULT_HOST_BANDWIDTH`` and says so
    host_bandwidth_bytes_per_s: float | None = None

    @property
    def world_size(self) -> int:
        return math.prod(level.count for level in self.levels)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": {
                "name": self.device.name,
                "memory_bytes": self.device.memory_bytes,
                "kind": self.device.kind,
            },
            "levels": [
                {
                    "name": level.name,
                    "count": level.count,
                    "bandwidth_bytes_per_s": level.bandwidth_bytes_per_s,
                    "latency_ms": level.latency_ms,
                    **(
                        {"message_overhead_ms": level.message_overhead_ms}
                        if level.message_overhead_ms
                        else {}
                    ),
                }
                for level in self.levels
            ],
            "storage_bandwidth_bytes_per_s": self.storage_bandwidth_bytes_per_s,
            **(
                {"host_bandwidth_bytes_per_s": self.host_bandwidth_bytes_per_s}
                if self.host_bandwidth_bytes_per_s is not None
                else {}
            ),
        }

    def to_yaml(self) -> str:
        """The topology file ``parse_topology`` reads back as this topology, every figure with
        its unit (bytes, B/s, ms) at full precision."""
        levels = "".join(
            f"  - {{name: {_yaml_text(level.name)}, count: {level.count}, "
            f"bandwidth: {level.bandwidth_bytes_per_s!r} B/s, latency: {level.latency_ms!r} ms"
            + (f", message_overhead: {level.message_overhead_ms!r} ms" if level.message_overhead_ms else "")
            + "}\n"
            for level in self.levels
        )
        device = self.device
        text = (
            f"name: {_yaml_text(self.name)}\n"
            f"device: {{name: {_yaml_text(device.name)}, memory: {device.memory_bytes} B, kind: {device.kind}}}\n"
            f"levels:\n{levels}"
        )
        if self.storage_bandwidth_bytes_per_s:
            text += f"storage: {{bandwidth: {float(self.storage_bandwidth_bytes_per_s)!r} B/s}}\n"
        if self.host_bandwidth_bytes_per_s is not None:
            text += f"host_link: {{bandwidth: {float(self.host_bandwidth_bytes_per_s)!r} B/s}}\n"
        return text

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Topology:
        """Read a topology YAML file (see the module docstring)."""
        return load_topology(path)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Topology:
        """From ``to_dict``'s form (types checked by the reader); ``InputError`` on a bad range."""
        topology = cls(
            name=obj["name"],
            device=DeviceSpec(**obj["device"]),
            levels=tuple(Level(**level) for level in obj["levels"]),
            storage_bandwidth_bytes_per_s=obj.get("storage_bandwidth_bytes_per_s", 0.0),
            host_bandwidth_bytes_per_s=obj.get("host_bandwidth_bytes_per_s"),
        )
        if not topology.levels:
            raise InputError("topology has no levels")
        if topology.device.memory_bytes <= 0 or topology.device.kind not in ("cuda", "cpu"):
            raise InputError(
                f"topology device: memory_bytes {topology.device.memory_bytes} must be positive "
                f"and kind {topology.device.kind!r} 'cuda' or 'cpu'"
            )
        storage = topology.storage_bandwidth_bytes_per_s
        if isinstance(storage, bool) or not isinstance(storage, (int, float)) or not storage >= 0:
            raise InputError(f"topology storage_bandwidth_bytes_per_s {storage!r} must be a number >= 0")
        host = topology.host_bandwidth_bytes_per_s
        if host is not None and (
            isinstance(host, bool) or not isinstance(host, (int, float)) or not host > 0
        ):
            raise InputError(f"topology host_bandwidth_bytes_per_s {host!r} must be a positive number")
        for k, level in enumerate(topology.levels):
            if (
                level.count < 1
                or not level.bandwidth_bytes_per_s > 0
                or not level.latency_ms >= 0
                or not level.message_overhead_ms >= 0
            ):
                raise InputError(
                    f"topology levels[{k}]: count {level.count} must be >= 1, bandwidth "
                    f"{level.bandwidth_bytes_per_s} bytes/s positive, latency {level.latency_ms} ms and "
                    f"message overhead {level.message_overhead_ms} ms >= 0"
                )
        return topology

    def level_joining(self, rank_a: int, rank_b: int) -> int:
        """Index of the innermost level that holds both ranks (-1 when they are equal)."""
        if rank_a == rank_b:
            return -1
        span = 1
        for k, level in enumerate(self.levels):
            span *= level.count
            if rank_a // span == rank_b // span:
                return k
        raise ValueError(f"ranks {rank_a} and {rank_b} outside world of {self.world_size}")


def _yaml_text(text: str) -> str:
    """``text`` as a YAML flow scalar that reads back as the same string."""
    return yaml.safe_dump(text, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def _where(source: str, node: yaml.Node) -> str:
    return f"{source}:{node.start_mark.line + 1}"


def _mapping(
    source: str, node: yaml.Node, what: str, allowed: tuple[str, ...]
) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    """Keys of a YAML mapping node -> (key node, value node).

    ``InputError`` (naming the line) if the node is not a mapping, or a key is repeated
    or not one of ``allowed`` (a misspelt ``latncy:`` must not silently mean 0 s).
    """
    if not isinstance(node, yaml.MappingNode):
        raise InputError(f"{_where(source, node)}: {what} must be a mapping")
    out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key_node, value_node in node.value:
        key = str(key_node.value)
        if key in out:
            raise InputError(
                f"{_where(source, key_node)}: duplicate key '{key}' in {what} "
                f"(first on line {out[key][0].start_mark.line + 1})"
            )
        if key not in allowed:
            raise InputError(
                f"{_where(source, key_node)}: unknown key '{key}' in {what} (allowed: {', '.join(allowed)})"
            )
        out[key] = (key_node, value_node)
    return out


_Parsed = TypeVar("_Parsed")


def _field(
    source: str,
    parent: yaml.Node,
    items: dict[str, tuple[yaml.Node, yaml.Node]],
    key: str,
    path: str,
    parse: Callable[[str], _Parsed],
    default: _Parsed | None = None,
) -> _Parsed:
    """Parse ``items[key]`` with ``parse``; InputError naming the line and ``path.key``."""
    if key not in items:
        if default is not None:
            return default
        raise InputError(f"{_where(source, parent)}: missing key '{path}{key}'")
    _, value_node = items[key]
    if not isinstance(value_node, yaml.ScalarNode):
        raise InputError(f"{_where(source, value_node)}: '{path}{key}' must be a single value")
    try:
        return parse(value_node.value)
    except ValueError as exc:
        raise InputError(f"{_where(source, value_node)}: '{path}{key}': {exc}") from exc


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"must be a positive integer (got {text!r})") from None
    if value <= 0:
        raise ValueError(f"must be a positive integer (got {value})")
    return value


_Number = TypeVar("_Number", int, float)


def _positive(parse: Callable[[str], _Number]) -> Callable[[str], _Number]:
    def check(text: str) -> _Number:
        value = parse(text)
        if value <= 0:
            raise ValueError(f"must be positive (got {text!r})")
        return value

    return check


def _non_negative_ms(text: str) -> float:
    value = parse_duration_ms(text)
    if value < 0:
        raise ValueError(f"must not be negative (got {text!r})")
    return value


def _kind(text: str) -> str:
    if text not in ("cuda", "cpu"):
        raise ValueError(f"must be 'cuda' or 'cpu' (got {text!r})")
    return text


def parse_topology(text: str, source: str = "<topology>") -> Topology:
    """Build a ``Topology`` from YAML ``text``; ``source`` names it in errors."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{source}{line}: not valid YAML ({problem})") from exc
    if root is None:
        raise InputError(f"{source}: empty topology file")
    top = _mapping(source, root, "the topology", ("name", "device", "levels", "storage", "host_link"))
    name = _field(source, root, top, "name", "", str)
    if "device" not in top:
        raise InputError(f"{_where(source, root)}: missing key 'device'")
    device_node = top["device"][1]
    dev = _mapping(source, device_node, "'device'", ("name", "memory", "kind"))
    device = DeviceSpec(
        name=_field(source, device_node, dev, "name", "device.", str),
        memory_bytes=_field(source, device_node, dev, "memory", "device.", _positive(parse_bytes)),
        kind=_field(source, device_node, dev, "kind", "device.", _kind, default="cuda"),
    )
    storage = 0.0
    if "storage" in top:
        storage_node = top["storage"][1]
        items = _mapping(source, storage_node, "'storage'", ("bandwidth",))
        storage = _field(source, storage_node, items, "bandwidth", "storage.", _positive(parse_bandwidth))
    host: float | None = None
    if "host_link" in top:
        host_node = top["host_link"][1]
        items = _mapping(source, host_node, "'host_link'", ("bandwidth",))
        host = _field(source, host_node, items, "bandwidth", "host_link.", _positive(parse_bandwidth))
    if "levels" not in top:
        raise InputError(f"{_where(source, root)}: missing key 'levels'")
    levels_node = top["levels"][1]
    if not isinstance(levels_node, yaml.SequenceNode) or not levels_node.value:
        raise InputError(f"{_where(source, levels_node)}: 'levels' must be a non-empty list")
    levels = []
    for k, level_node in enumerate(levels_node.value):
        path = f"levels[{k}]."
        items = _mapping(
            source,
            level_node,
            f"'levels[{k}]'",
            ("name", "count", "bandwidth", "latency", "message_overhead"),
        )
        levels.append(
            Level(
                name=_field(source, level_node, items, "name", path, str),
                count=_field(source, level_node, items, "count", path, _positive_int),
                bandwidth_bytes_per_s=_field(
                    source, level_node, items, "bandwidth", path, _positive(parse_bandwidth)
                ),
                latency_ms=_field(source, level_node, items, "latency", path, _non_negative_ms, 0.0),
                message_overhead_ms=_field(
                    source, level_node, items, "message_overhead", path, _non_negative_ms, 0.0
                ),
            )
        )
    return Topology(
        name=name,
        device=device,
        levels=tuple(levels),
        storage_bandwidth_bytes_per_s=storage,
        host_bandwidth_bytes_per_s=host,
    )


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Read a topology YAML file; ``InputError`` (one line, with the line number) if bad."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise InputError(f"cannot read topology {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"topology {path} is not UTF-8 text (byte {exc.start})") from exc
    return parse_topology(text, source=str(path))


def preset_names() -> list[str]:
    """Names of the bundled topology presets (``configs/topologies/*.yaml``)."""
    folder = resources.files("pipeplan.configs.topologies")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def preset(name: str) -> Topology:
    """The bundled topology preset ``name`` (e.g. ``"cluster-a"``, ``"local-cpu"``)."""
    resource = resources.files("pipeplan.configs.topologies") / f"{name}.yaml"
    if not resource.is_file():
        raise InputError(f"no topology preset {name!r} (presets: {', '.join(preset_names())})")
    return parse_topology(resource.read_text(), source=f"preset {name}")


def resolve(arg: str) -> Topology:
    """A topology from a file path or, if no such file exists, a preset name."""
    if os.path.exists(arg):
        return load_topology(arg)
    if arg.endswith((".yaml", ".yml")) or os.sep in arg:
        raise InputError(f"topology file {arg} does not exist (presets: {', '.join(preset_names())})")
    return preset(arg)
