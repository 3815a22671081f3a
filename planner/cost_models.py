"""The cost model, chosen once: pipeplan's or PipeDream's, as one object.

Everything that differs between the two lives here, so callers ask the object instead of
comparing its name:

- ``charged_optimizer``: pipeplan counts the measured optimizer step as compute (its
  share per layer, by parameter bytes); PipeDream's own model does not.
- ``stage_figures``: (compute, all-reduce, communication, time) per stage. pipeplan:
  every term of the stage's path, each divided by the replication above it, the time
  being the largest; PipeDream: its additive formulas.
- ``data_parallel_ms``: the baseline of pure data parallelism on every device.
- ``checks_memory``: whether the final plan's exact memory is held to the device's
  (PipeDream's optimizer keeps its own memory rule).
- ``predicts_by_simulation(kind)``: whether a plan's predicted time is the simulated
  steady state of its schedule (pipeplan always; PipeDream keeps its own formula for the
  1F1B-RR it was made for and is simulated for the other schedules).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeplan.errors import InputError
from pipeplan.planner.costs import COST_MODELS, LayerArrays, level_sum_ms, on_gloo, transfer_ms
from pipeplan.planner.placement import FlatStage
from pipeplan.topology import Topology

if TYPE_CHECKING:  # typing only
    from pipeplan.schedules import ScheduleKind

__all__ = ["CostModel", "COST_MODEL_OBJECTS", "cost_model"]

StageFigures = list[tuple[float, float, float, float]]


@dataclass(frozen=True)
class CostModel:
    """One cost model's facts and formulas (see the module docstring)."""

    name: str
    charges_optimizer: bool
    checks_memory: bool
    simulates_stashed: bool  # predict 1F1B-RR ("stashed" gradients) by simulation too
    _stage_figures: Callable[..., StageFigures]
    _data_parallel_ms: Callable[[LayerArrays, Topology], float]

    def charged_optimizer(self, optimizer: str) -> str | None:
        """The optimizer whose measured step counts as compute (None: none does)."""
        return optimizer if self.charges_optimizer else None

    def stage_figures(
        self,
        flat: tuple[FlatStage, ...],
        arrays: LayerArrays,
        topology: Topology,
        activation_compression_ratio: float | None = None,
        single_nodes: frozenset = frozenset(),
    ) -> StageFigures:
        """(compute, all-reduce, communication, time per minibatch) in ms for each stage."""
        return self._stage_figures(flat, arrays, topology, activation_compression_ratio, single_nodes)

    def data_parallel_ms(self, arrays: LayerArrays, topology: Topology) -> float:
        """Pure data parallelism on every device: ms per minibatch."""
        return self._data_parallel_ms(arrays, topology)

    def predicts_by_simulation(self, kind: ScheduleKind) -> bool:
        """Whether plans of schedule ``kind`` (a ``ScheduleKind``) are predicted by simulation."""
        return self.simulates_stashed or kind.gradients != "stashed"


def _outgoing_level(flat: tuple[FlatStage, ...], index: int) -> int:
    """Level (1-based) of the cut after stage ``index``: where its path and the next diverge."""
    here, nxt = flat[index].path, flat[index + 1].path
    for a, b in zip(here, nxt):
        if a is not b:
            return a.level
    return here[-1].level


def _pipeplan_stage_figures(
    flat: tuple[FlatStage, ...],
    arrays: LayerArrays,
    topology: Topology,
    ratio: float | None,
    single_nodes: frozenset,
) -> StageFigures:
    out = []
    gloo = on_gloo(topology)  # two replicas swap once (costs.level_sum_ms)
    for q, stage in enumerate(flat):
        compute = arrays.compute(stage.start, stage.end)
        comm_level = _outgoing_level(flat, q) if q + 1 < len(flat) else None
        allreduce, comm = 0.0, 0.0
        above = 1
        for node in stage.path:  # top first
            lv = topology.levels[node.level - 1]
            ar = float(level_sum_ms(arrays.sync_bytes(node.start, node.end), node.units, lv, gloo)) / above
            allreduce = max(allreduce, ar)
            if comm_level == node.level:
                comm = (
                    float(transfer_ms(arrays.cut_bytes[stage.end], lv.bandwidth_bytes_per_s, lv.latency_ms))
                    / above
                )
            above *= node.units
        out.append((compute, allreduce, comm, max(compute / above, allreduce, comm)))
    return out


def _pipedream_stage_figures(
    flat: tuple[FlatStage, ...],
    arrays: LayerArrays,
    topology: Topology,
    ratio: float | None,
    single_nodes: frozenset,
) -> StageFigures:
    out = []
    for q, stage in enumerate(flat):
        compute = arrays.compute(stage.start, stage.end)
        comm_level = _outgoing_level(flat, q) if q + 1 < len(flat) else None
        time = compute / 1000.0
        allreduce = 0.0
        comm = 0.0
        within_of = {
            k + 1: (topology.levels[k - 1].count if k >= 1 else 1) for k in range(len(topology.levels))
        }
        for node in reversed(stage.path):  # innermost first
            lv = topology.levels[node.level - 1]
            grads = arrays.sync_bytes(node.start, node.end)
            ar = 4 * (node.units - 1) * grads / (lv.bandwidth_bytes_per_s * node.units)
            if (node.level, node.start, node.end) in single_nodes:
                ar /= within_of[node.level]
            allreduce += ar * 1000.0
            if ratio is not None and comm_level == node.level:
                comm = (
                    2.0
                    * arrays.frontier_bytes[stage.end]
                    / (lv.bandwidth_bytes_per_s * node.units)
                    / ratio
                    * 1000.0
                )
            time = max((time + ar) / node.units, comm / 1000.0)
        out.append((compute, allreduce, comm, time * 1000.0))
    return out


def _pipeplan_data_parallel_ms(arrays: LayerArrays, topology: Topology) -> float:
    time = arrays.compute(0, arrays.layers)
    grads = arrays.sync_bytes(0, arrays.layers)
    for level in topology.levels:
        allreduce = float(level_sum_ms(grads, level.count, level, on_gloo(topology)))
        time = max(time / level.count, allreduce)
    return time


def _pipedream_data_parallel_ms(arrays: LayerArrays, topology: Topology) -> float:
    from pipeplan.planner.pipedream_dp import pipedream_data_parallel_ms

    return pipedream_data_parallel_ms(arrays, topology)


COST_MODEL_OBJECTS: dict[str, CostModel] = {
    "pipeplan": CostModel("pipeplan", True, True, True, _pipeplan_stage_figures, _pipeplan_data_parallel_ms),
    "pipedream": CostModel(
        "pipedream", False, False, False, _pipedream_stage_figures, _pipedream_data_parallel_ms
    ),
}


def cost_model(name: str) -> CostModel:
    """The cost model called ``name``; ``InputError`` naming the known ones."""
    if name not in COST_MODEL_OBJECTS:
        raise InputError(f"cost model {name!r} is not one of {', '.join(COST_MODELS)}")
    return COST_MODEL_OBJECTS[name]
