"""From chosen stages to a ``Plan``: each stage's cost-model figures and the plan's baselines."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from pipeplan.plan import Plan, Predicted, StagePlan
from pipeplan.planner.checkpoint_cost import checkpoint_bytes, checkpoint_write_ms
from pipeplan.planner.cost_models import cost_model
from pipeplan.planner.costs import LayerArrays
from pipeplan.planner.cuts import CutFamily
from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.placement import FlatStage
from pipeplan.precision import Precision
from pipeplan.profile import Profile
from pipeplan.schedules import schedule_kind
from pipeplan.topology import Topology

__all__ = ["assemble_plan", "data_parallel_ms", "stage_figures"]


def data_parallel_ms(arrays: LayerArrays, topology: Topology, cost_model_name: str = "pipeplan") -> float:
    """Pure data parallelism on every device: the whole model as one stage at each level."""
    return cost_model(cost_model_name).data_parallel_ms(arrays, topology)


def stage_figures(
    flat: tuple[FlatStage, ...],
    arrays: LayerArrays,
    topology: Topology,
    options: PartitionOptions,
    single_nodes: frozenset = frozenset(),
) -> list[tuple[float, float, float, float]]:
    """(compute, all-reduce, communication, time per minibatch) in ms for each stage (the cost model's)."""
    return cost_model(options.cost_model).stage_figures(
        flat, arrays, topology, options.activation_compression_ratio, single_nodes
    )


def assemble_plan(
    profile: Profile,
    topology: Topology,
    options: PartitionOptions,
    arrays: LayerArrays,
    stages: tuple[StagePlan, ...],
    time_ms: float,
    virtual_stages: int = 1,
    family: CutFamily | None = None,
) -> Plan:
    """A ``Plan`` of ``stages`` predicting ``time_ms`` per minibatch (baselines from ``arrays``,
    cut at the states of ``family``; default: the prefixes of the layer order)."""
    if family is None:
        family = CutFamily("prefix", len(profile.layers))
    stages = _with_checkpoint_bytes(profile, stages, options.optimizer)
    single = arrays.compute(0, arrays.layers)
    dp_ms = data_parallel_ms(arrays, topology, options.cost_model)
    predicted = Predicted(
        time_per_minibatch_ms=time_ms,
        samples_per_s=profile.batch_size / time_ms * 1000.0 if time_ms > 0 else math.inf,
        speedup_vs_data_parallel=dp_ms / time_ms if time_ms > 0 else math.inf,
        speedup_vs_single_device=single / time_ms if time_ms > 0 else math.inf,
        data_parallel_ms=dp_ms,
        single_device_ms=single,
        stage_bound_ms=time_ms,
        checkpoint_write_ms=checkpoint_write_ms(
            _bytes_per_writer(stages).values(), topology.storage_bandwidth_bytes_per_s
        ),
    )
    positions = len(stages) // virtual_stages
    replicas = [stage.replicas for stage in stages[:positions]]
    bottleneck = max(range(len(stages)), key=lambda q: stages[q].time_per_minibatch_ms)
    return Plan(
        profile_fingerprint=profile.fingerprint,
        model=profile.model,
        batch_size=profile.batch_size,
        dtype=profile.dtype,
        topology=topology,
        schedule=options.schedule,
        cost_model=options.cost_model,
        optimizer=options.optimizer,
        world_size=topology.world_size,
        in_flight=schedule_kind(options.schedule).minibatches_in_flight(replicas),
        stages=stages,
        predicted=predicted,
        bottleneck_stage=bottleneck,
        microbatches=options.microbatches,
        virtual_stages=virtual_stages,
        leaf_modules=profile.leaf_modules,
        opaque_modules=profile.opaque_modules,
        cut_family=family.name,
        cut_candidates=family.states,
        export_target=options.export_target,
        master_dtype=profile.master_dtype,
        recompute=options.recompute,
    )


def _with_checkpoint_bytes(
    profile: Profile, stages: tuple[StagePlan, ...], optimizer: str
) -> tuple[StagePlan, ...]:
    """``stages`` with the bytes each one's checkpoint writes (``planner.checkpoint_cost``)."""
    precision = Precision(profile.dtype, profile.master_dtype)
    return tuple(
        replace(stage, checkpoint_bytes=checkpoint_bytes(profile, stage.layers, optimizer, precision))
        for stage in stages
    )


def _bytes_per_writer(stages: tuple[StagePlan, ...]) -> Counter[int]:
    """Checkpoint bytes by writing rank (a stage's first rank; interleaved chunks add up)."""
    written: Counter[int] = Counter()
    for stage in stages:
        written[stage.ranks[0]] += stage.checkpoint_bytes
    return written
