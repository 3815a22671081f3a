"""``partition(profile, topology, options) -> Plan``: the planner's single entry point.

Runs the hierarchical DP (``planner.dp``, pipeplan cost model) or PipeDream's optimizer
(``planner.pipedream_dp``), places the stages on ranks (``planner.placement``), recomputes
every stage's memory exactly (``planner.memory``) and fills a ``pipeplan.plan.Plan`` with
per-stage and predicted figures (ms per minibatch, bytes per device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.plan import SCHEDULES, Plan, Predicted, StagePlan
from pipeplan.profile import Profile
from pipeplan.schedule import noam
from pipeplan.topology import Topology
from pipeplan.units import format_bytes
from pipeplan.planner.costs import COST_MODELS, LayerArrays, layer_arrays, ring_allreduce_ms, transfer_ms
from pipeplan.planner.cuts import cut_family
from pipeplan.planner.dp import DPSettings, StageNode, reconstruct, solve
from pipeplan.planner.memory import OPTIMIZER_STATES, plan_stage_memory, stage_memory_bytes
from pipeplan.planner.pipedream_dp import PipeDreamSettings, pipedream_data_parallel_ms, solve_pipedream
from pipeplan.planner.placement import FlatStage, flatten

__all__ = ["PartitionOptions", "partition", "data_parallel_ms", "stage_figures"]


@dataclass(frozen=True)
class PartitionOptions:
    schedule: str = "1f1b-rr"  # one of pipeplan.plan.SCHEDULES
    cost_model: str = "pipeplan"  # "pipeplan" | "pipedream"
    optimizer: str = "sgd"  # "sgd" | "momentum" | "adam"
    straight: bool = False  # one device per stage
    max_stages: int | None = None
    use_fewer_devices: bool = False
    microbatches: int = 1  # for 1f1b-flush / gpipe
    memory_check: bool = True
    activation_compression_ratio: float | None = None  # PipeDream mode only

    def validate(self) -> None:
        if self.schedule not in SCHEDULES:
            raise InputError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.cost_model not in COST_MODELS:
            raise InputError(f"cost model {self.cost_model!r} is not one of {', '.join(COST_MODELS)}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise InputError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZER_STATES)}")
        if self.max_stages is not None and self.max_stages < 1:
            raise InputError(f"--max-stages must be >= 1 (got {self.max_stages})")
        if self.microbatches < 1:
            raise InputError(f"--microbatches must be >= 1 (got {self.microbatches})")
        if self.cost_model == "pipedream" and self.max_stages is not None:
            raise InputError("--max-stages is not part of PipeDream's optimizer (use --cost-model pipeplan)")
        ratio = self.activation_compression_ratio
        if ratio is not None and not ratio > 0:
            raise InputError(f"activation compression ratio must be positive (got {ratio})")


def data_parallel_ms(arrays: LayerArrays, topology: Topology, cost_model: str = "pipeplan") -> float:
    """Pure data parallelism on every device: the whole model as one stage at each level."""
    if cost_model == "pipedream":
        return pipedream_data_parallel_ms(arrays, topology)
    time = arrays.compute(0, arrays.layers)
    params = float(arrays.param_bytes[-1])
    for level in topology.levels:
        allreduce = float(ring_allreduce_ms(params, level.count, level.bandwidth_bytes_per_s, level.latency_ms))
        time = max(time / level.count, allreduce)
    return time


def _outgoing_level(flat: tuple[FlatStage, ...], index: int) -> int:
    """Level (1-based) of the cut after stage ``index``: where its path and the next diverge."""
    here, nxt = flat[index].path, flat[index + 1].path
    for a, b in zip(here, nxt):
        if a is not b:
            return a.level
    return here[-1].level


def stage_figures(
    flat: tuple[FlatStage, ...], arrays: LayerArrays, topology: Topology, options: PartitionOptions,
    single_nodes: frozenset = frozenset(),
) -> list[tuple[float, float, float, float]]:
    """(compute, all-reduce, communication, time per minibatch) in ms for each stage.

    pipeplan: every term of the stage's path, each divided by the replication above it;
    the stage's time is the largest. pipedream: PipeDream's additive formulas.
    """
    out = []
    for q, stage in enumerate(flat):
        compute = arrays.compute(stage.start, stage.end)
        comm_level = _outgoing_level(flat, q) if q + 1 < len(flat) else None
        if options.cost_model == "pipeplan":
            terms, allreduce, comm = [], 0.0, 0.0
            above = 1
            for node in stage.path:  # top first
                lv = topology.levels[node.level - 1]
                ar = float(ring_allreduce_ms(arrays.params(node.start, node.end), node.units,
                                             lv.bandwidth_bytes_per_s, lv.latency_ms)) / above
                allreduce = max(allreduce, ar)
                if comm_level == node.level:
                    comm = float(transfer_ms(arrays.cut_bytes[stage.end], lv.bandwidth_bytes_per_s, lv.latency_ms)) / above
                above *= node.units
            terms = [compute / above, allreduce, comm]
            out.append((compute, allreduce, comm, max(terms)))
        else:
            time = compute / 1000.0
            allreduce = 0.0
            comm = 0.0
            ratio = options.activation_compression_ratio
            within_of = {k + 1: (topology.levels[k - 1].count if k >= 1 else 1) for k in range(len(topology.levels))}
            for node in reversed(stage.path):  # innermost first
                lv = topology.levels[node.level - 1]
                params = arrays.params(node.start, node.end)
                ar = 4 * (node.units - 1) * params / (lv.bandwidth_bytes_per_s * node.units)
                if (node.level, node.start, node.end) in single_nodes:
                    ar /= within_of[node.level]
                allreduce += ar * 1000.0
                if ratio is not None and comm_level == node.level:
                    comm = 2.0 * arrays.frontier_bytes[stage.end] / (lv.bandwidth_bytes_per_s * node.units) / ratio * 1000.0
                time = max((time + ar) / node.units, comm / 1000.0)
            out.append((compute, allreduce, comm, time * 1000.0))
    return out


def _infeasible_message(arrays: LayerArrays, profile: Profile, topology: Topology, options: PartitionOptions) -> str:
    """Name the layer that needs the most memory even in the most favourable position."""
    need = []
    for i, layer in enumerate(profile.layers):
        params, saved = float(layer.param_bytes), float(layer.saved_bytes)
        # the planner charges 1F1B-RR and GPipe a whole minibatch of activations at least,
        # 1F1B-flush one micro-batch's share at best
        least_in_flight = 1.0 / options.microbatches if options.schedule == "1f1b-flush" else 1.0
        need.append(stage_memory_bytes(params, saved, 1, least_in_flight, options.optimizer))
    worst = max(range(len(need)), key=lambda i: need[i])
    memory = topology.device.memory_bytes
    if need[worst] > memory:
        layer = profile.layers[worst]
        return (
            f"no plan fits in {format_bytes(memory)} per device: layer {worst} ({layer.name}) alone "
            f"needs {format_bytes(need[worst])} ({options.optimizer}, schedule {options.schedule})"
        )
    return (
        f"no plan fits in {format_bytes(memory)} per device with schedule {options.schedule} on "
        f"{topology.world_size} devices: the smallest stage that cannot fit is layer {worst} "
        f"({profile.layers[worst].name}) with its minibatches in flight; it needs at least "
        f"{format_bytes(need[worst])} with one ({_infeasible_hint(options)})"
    )


def _infeasible_hint(options: PartitionOptions) -> str:
    if options.schedule == "1f1b-rr":
        return "try --schedule 1f1b-flush or more devices"
    if options.schedule == "1f1b-flush":
        return "try more --microbatches or more devices"
    return "try --schedule 1f1b-flush or more devices"


def _solve(arrays: LayerArrays, topology: Topology, options: PartitionOptions) -> tuple[float, tuple[StageNode, ...], frozenset]:
    if options.cost_model == "pipedream":
        result = solve_pipedream(
            arrays, topology,
            PipeDreamSettings(options.straight, options.use_fewer_devices, options.memory_check,
                              options.activation_compression_ratio),
        )
        return result.time_ms, result.stages, result.single_stage_nodes
    settings = DPSettings(options.schedule, options.optimizer, options.straight, options.max_stages,
                          options.use_fewer_devices, options.memory_check)
    solution = solve(arrays, topology, settings)
    if not math.isfinite(solution.time_ms):
        return math.inf, (), frozenset()
    return solution.time_ms, reconstruct(solution), frozenset()


def charged_optimizer(options: PartitionOptions) -> str | None:
    """The optimizer whose measured step counts as compute (none in PipeDream's own model)."""
    return options.optimizer if options.cost_model == "pipeplan" else None


def partition(profile: Profile, topology: Topology, options: PartitionOptions = PartitionOptions()) -> Plan:
    """The best plan of ``profile`` on ``topology`` under ``options``.

    Raises ``InputError`` for bad options and ``InfeasibleError`` (one line) when no plan
    fits device memory.
    """
    options.validate()
    family = cut_family(profile)
    arrays = layer_arrays(profile, charged_optimizer(options), family)
    time_ms, tree, single_nodes = _solve(arrays, topology, options)
    if not math.isfinite(time_ms):
        raise InfeasibleError(_infeasible_message(arrays, profile, topology, options))
    flat = flatten(tree, topology)
    replicas = [stage.replicas for stage in flat]
    figures = stage_figures(flat, arrays, topology, options, single_nodes)
    stages = []
    for q, (stage, (compute, allreduce, comm, stage_time)) in enumerate(zip(flat, figures)):
        memory, versions, in_flight = plan_stage_memory(
            options.schedule, replicas, q, arrays.params(stage.start, stage.end),
            arrays.saved(stage.start, stage.end), options.optimizer, options.microbatches,
        )
        if options.memory_check and options.cost_model == "pipeplan" and memory > topology.device.memory_bytes:
            raise InfeasibleError(
                f"internal: stage {q} needs {format_bytes(memory)} > {format_bytes(topology.device.memory_bytes)}"
            )
        layers = family.stage_layers(stage.start, stage.end)
        stages.append(StagePlan(
            index=q, layer_start=min(layers), layer_end=max(layers) + 1, layers=layers, replicas=stage.replicas,
            ranks=stage.ranks, compute_ms=compute, allreduce_ms=allreduce, communication_ms=comm,
            time_per_minibatch_ms=stage_time, memory_bytes=memory, weight_versions=versions,
            in_flight=int(math.ceil(in_flight)),
        ))
    single = arrays.compute(0, arrays.layers)
    dp_ms = data_parallel_ms(arrays, topology, options.cost_model)
    predicted = Predicted(
        time_per_minibatch_ms=time_ms,
        samples_per_s=profile.batch_size / time_ms * 1000.0 if time_ms > 0 else math.inf,
        speedup_vs_data_parallel=dp_ms / time_ms if time_ms > 0 else math.inf,
        speedup_vs_single_device=single / time_ms if time_ms > 0 else math.inf,
        data_parallel_ms=dp_ms,
        single_device_ms=single,
    )
    bottleneck = max(range(len(stages)), key=lambda q: stages[q].time_per_minibatch_ms)
    return Plan(
        profile_fingerprint=profile.fingerprint, model=profile.model, batch_size=profile.batch_size,
        dtype=profile.dtype, topology=topology, schedule=options.schedule, cost_model=options.cost_model,
        optimizer=options.optimizer, world_size=topology.world_size, in_flight=noam(replicas) if options.schedule == "1f1b-rr" else 1,
        stages=tuple(stages), predicted=predicted, bottleneck_stage=bottleneck,
        microbatches=options.microbatches, leaf_modules=profile.leaf_modules,
        cut_family=family.name, cut_candidates=family.states,
    )
