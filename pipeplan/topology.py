"""The topology contract: a hierarchy of device groups joined by bandwidths.

``levels`` is innermost first: level 0 groups ``levels[0].count`` devices joined by
``levels[0].bandwidth_bytes_per_s``; level k groups ``levels[k].count`` units of level
k-1. ``world_size`` is the product of the counts. Global rank r sits in unit
``r // prod(counts[:k+1])`` of level k (ranks are numbered innermost-first).
Read from YAML (``load``); embedded in plan.json as a dict (``to_dict``/``from_dict``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Level", "DeviceSpec", "Topology"]


@dataclass(frozen=True)
class Level:
    name: str  # "server", "rack", ...
    count: int  # units of the level below grouped here (devices, for level 0)
    bandwidth_bytes_per_s: float  # between two units of this level
    latency_ms: float = 0.0  # per message between two units of this level


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
                }
                for level in self.levels
            ],
        }

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "Topology":
        return cls(
            name=obj["name"],
            device=DeviceSpec(**obj["device"]),
            levels=tuple(Level(**level) for level in obj["levels"]),
        )

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
