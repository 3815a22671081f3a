"""Placement: flatten the DP's stage tree into pipeline stages and give each its ranks.

Ranks are numbered innermost-first (``pipeplan.topology``): unit u of level k holds ranks
``[u D_k, (u + 1) D_k)``. Stages of a level take consecutive units in pipeline order, so
consecutive stages are neighbours, and the replicas of a stage sit inside the smallest
unit that holds them. Replica j of a flattened stage is its j-th rank in ascending order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeplan.planner.dp import StageNode
from pipeplan.topology import Topology

__all__ = ["FlatStage", "flatten"]


@dataclass(frozen=True)
class FlatStage:
    """One pipeline stage: layers [start, end) on ``ranks``; ``path`` = its tree nodes, top first."""

    start: int
    end: int
    ranks: tuple[int, ...]
    path: tuple[StageNode, ...]

    @property
    def replicas(self) -> int:
        return len(self.ranks)


def _devices_per_unit(topology: Topology, level: int) -> int:
    return math.prod(lv.count for lv in topology.levels[:level])


def _walk(
    node_list: Sequence[StageNode],
    topology: Topology,
    base_units: list[int],
    path: tuple[StageNode, ...],
    out: dict[Any, Any],
) -> None:
    """Assign units to ``node_list`` (a pipeline at one level) inside every unit of ``base_units``.

    ``base_units`` are global indices of the enclosing units (of the level of the nodes);
    stage nodes take consecutive sub-units inside each of them.
    """
    if not node_list:
        return
    level = node_list[0].level
    sub_count = topology.levels[level - 1].count  # sub-units (level-1) per unit of ``level``
    offset = 0
    for node in node_list:
        sub_units = [b * sub_count + offset + r for b in base_units for r in range(node.units)]
        offset += node.units
        here = path + (node,)
        if node.children:
            _walk(node.children, topology, sub_units, here, out)
        else:
            per = _devices_per_unit(topology, level - 1)
            ranks = tuple(sorted(unit * per + d for unit in sub_units for d in range(per)))
            out.setdefault(node.start, []).append((node.end, ranks, here))


def flatten(stages: tuple[StageNode, ...], topology: Topology) -> tuple[FlatStage, ...]:
    """Pipeline stages in order, each with its sorted global ranks."""
    collected: dict[int, list] = {}
    _walk(stages, topology, [0], (), collected)
    flat = []
    for start in sorted(collected):
        entries = collected[start]
        end, _, path = entries[0]
        ranks = tuple(sorted(r for _, rs, _ in entries for r in rs))
        flat.append(FlatStage(start, end, ranks, path))
    return tuple(flat)
