"""The plan contract: stages, replicas, ranks, schedule and predicted figures.

``stages`` is indexed by stage (0 = input stage); stage s runs the profile layers
``layers`` (authoritative; a difference of two downsets of the DAG, not necessarily
contiguous in the topological order; ``layer_start = min(layers)``, ``layer_end =
max(layers) + 1``; a plan without ``layers`` means the range) on ``replicas`` devices whose global ranks are ``ranks``
(replica j of stage s is ``ranks[j]``). A stage with ``tensor_parallel`` t > 1 splits
its layers t ways (Megatron tensor parallelism) inside each replica: ``ranks`` then holds
``replicas * t`` ranks, replica-major (replica j's tensor-parallel group is
``ranks[j*t:(j+1)*t]``). Times are milliseconds per minibatch, memory in bytes per
device. ``dtype`` is the compute precision (the profile's), ``master_dtype`` that of the
master weights and optimizer state under mixed precision (``pipeplan.precision``; memory
figures count them). ``export_target`` names the engine whose cuts the planner kept to (``partition
--for``). Stored as JSON with ``"schema": "pipeplan.plan/2"``; version 1 files (no
``tensor_parallel``: t = 1, no ``export_target``) still load, and so do /2 files without
the optional recomputation fields (``Plan.recompute``, ``StagePlan.recompute_layers`` and
``recompute_ms``: none recomputed).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeplan.errors import InputError
from pipeplan.fields import check_fields
from pipeplan.jsonio import read_json, write_json_atomic
from pipeplan.precision import Precision
from pipeplan.schedules.actions import v_segment
from pipeplan.schedules.kinds import (
    SCHEDULE_NAMES,
    schedule_kind,
)  # the names a plan may carry (the registry's)
from pipeplan.topology import DeviceSpec, Level, Topology

__all__ = [
    "PLAN_SCHEMA",
    "OLDER_PLAN_SCHEMAS",
    "SCHEDULE_NAMES",
    "EXPORT_TARGETS",
    "StagePlan",
    "Predicted",
    "Plan",
]

PLAN_SCHEMA = "pipeplan.plan/2"
OLDER_PLAN_SCHEMAS = ("pipeplan.plan/1",)  # still load (new fields take defaults)
EXPORT_TARGETS = ("pipelining", "torchtitan")  # the engines `pipeplan export` writes for (Plan.export_target)


@dataclass(frozen=True)
class StagePlan:
    index: int
    layer_start: int  # first layer (inclusive)
    layer_end: int  # one past the last layer
    replicas: int
    ranks: tuple[int, ...]  # global ranks; replica j runs on ranks[j*t:(j+1)*t], t = tensor_parallel
    compute_ms: float  # forward+backward of the stage's layers, one minibatch, one device
    allreduce_ms: float  # gradient all-reduce among the replicas, per minibatch
    communication_ms: float  # activations out + gradients back over the outgoing cut
    time_per_minibatch_ms: float  # the stage's share of the pipeline period
    memory_bytes: int  # predicted peak per device
    weight_versions: int  # stashed weight versions kept (1 = no stashing)
    in_flight: int  # minibatches whose activations a replica holds at once
    layers: tuple[int, ...] = ()  # the layer set (for a DAG); defaults to the range
    tensor_parallel: int = 1  # t: ranks per replica, each holding 1/t of the split layers
    # bytes one checkpoint of the stage writes (its first rank: weights and optimizer state,
    # pipeplan.planner.checkpoint_cost); 0 in plans written before it was predicted
    checkpoint_bytes: int = 0
    # activation recomputation (``pipeplan.planner.recompute``): the layers the stage runs
    # under torch.utils.checkpoint (a subset of ``layers``; () none), and the forward time
    # they cost again in backward (ms per minibatch, in ``compute_ms``)
    recompute_layers: tuple[int, ...] = ()
    recompute_ms: float = 0.0
    # selective recomputation: the layers whose attention core only runs again in backward
    # (disjoint from ``recompute_layers``; their extra ms is in ``recompute_ms`` too)
    selective_layers: tuple[int, ...] = ()
    # Megatron's sequence parallelism: the stage's tensor-parallel group also shards the
    # sequence of its layer-norm / dropout regions (only with tensor_parallel > 1)
    sequence_parallel: bool = False
    # sharded data parallelism of the replicas (pipeplan.planner.sharding): "none" | "zero1" |
    # "zero2" | "fsdp", among groups of ``shard_degree`` consecutive replicas (1: none)
    shard: str = "none"
    shard_degree: int = 1
    # offload to host memory (pipeplan.planner.offload): "none" | "optimizer" (optimizer state,
    # and master weights, on host memory) | "optimizer+params" (parameters too, FSDP2
    # CPUOffloadPolicy), and its host-link copies and host optimizer step (ms per minibatch,
    # per replica, in ``time_per_minibatch_ms``)
    offload: str = "none"
    offload_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.layers:
            object.__setattr__(self, "layers", tuple(range(self.layer_start, self.layer_end)))

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """The tensor-parallel group of ``replica``: its ``tensor_parallel`` ranks."""
        t = self.tensor_parallel
        return self.ranks[replica * t : (replica + 1) * t]


@dataclass(frozen=True)
class Predicted:
    time_per_minibatch_ms: float  # pipeline period: one minibatch leaves every this many ms
    samples_per_s: float
    speedup_vs_data_parallel: float
    speedup_vs_single_device: float
    data_parallel_ms: float  # time per minibatch of pure data parallelism on all devices
    single_device_ms: float  # forward+backward of the whole model on one device
    # the planner's objective: the slowest stage with transfers and all-reduce overlapped,
    # no bubble (a lower bound of the period); 0.0 in plans written before it existed
    stage_bound_ms: float = 0.0
    simulated: bool = False  # time_per_minibatch_ms is the simulated period of the plan's schedule
    # one checkpoint's write at the topology's storage bandwidth (the slowest writing rank);
    # 0.0 when the topology gives no storage bandwidth, or in older plans
    checkpoint_write_ms: float = 0.0


@dataclass(frozen=True)
class Plan:
    profile_fingerprint: str
    model: str  # the profile's model (informational; `run --model` names the file)
    batch_size: int  # samples per minibatch (as profiled)
    dtype: str
    topology: Topology
    schedule: str  # one of SCHEDULE_NAMES
    cost_model: str  # "pipeplan" | "pipedream"
    optimizer: str  # one of pipeplan.optimizers.OPTIMIZERS
    world_size: int
    in_flight: int  # 1F1B-RR: NOAM = ceil(used devices / replicas of the input stage); flush: 1
    stages: tuple[StagePlan, ...]
    predicted: Predicted
    bottleneck_stage: int
    microbatches: int = 1  # micro-batches per minibatch for 1f1b-flush / gpipe
    # module classes the profile kept whole (the runtime rebuilds the same layers);
    # None: not recorded, the model file's LEAF_MODULES apply
    leaf_modules: tuple[str, ...] | None = None
    # module classes run as opaque layers (the profile's; None: not recorded, OPAQUE_MODULES apply)
    opaque_modules: tuple[str, ...] | None = None
    cut_family: str = "prefix"  # cut states searched: "prefix", "all-downsets", "window-<w>" (planner.cuts)
    cut_candidates: int = (
        0  # how many cut states (downsets, the empty and the full one included) that family held
    )
    virtual_stages: int = 1  # model chunks per device (interleaved-1f1b); stage q on position q % P
    # the engine whose cuts the planner kept to (`partition --for`): "pipelining" | "torchtitan";
    # None: any cut pipeplan's runtime runs
    export_target: str | None = None
    # mixed precision (pipeplan.precision): the dtype of the master weights, their gradients and
    # the optimizer state when compute runs in ``dtype``; None: all in ``dtype`` (older plans)
    master_dtype: str | None = None
    # the recomputation mode planned (``partition --recompute``): "auto" | "none" | "full";
    # "auto" is planned as "none" where the schedule, tensor-parallel degree or precision runs
    # none (each stage's choice is its ``recompute_layers``); "none" in plans written before it
    recompute: str = "none"
    schema: str = field(default=PLAN_SCHEMA)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def precision(self) -> Precision:
        return Precision(self.dtype, self.master_dtype)

    def pipeline_order(self) -> tuple[int, ...]:
        """The model stages in the order the layers run through them: 0, 1, ..., or, for a
        V-shaped schedule (zb-v), 0 .. P-1 then 2P-1 down to P (``v_segment``)."""
        stages = range(len(self.stages))
        if not schedule_kind(self.schedule).v_shape:
            return tuple(stages)
        positions = len(self.stages) // self.virtual_stages
        return tuple(sorted(stages, key=lambda q: v_segment(q, positions)))

    def stage_of_rank(self, rank: int) -> tuple[int, int]:
        """(stage index, replica index) that global ``rank`` runs."""
        for stage in self.stages:
            if rank in stage.ranks:
                return stage.index, stage.ranks.index(rank) // stage.tensor_parallel
        raise InputError(f"rank {rank} runs no stage of this plan (world size {self.world_size})")

    def stage_of_layers(self, layers: int) -> list[int]:
        """The stage of each of a model's ``layers`` layers; ``InputError`` when the plan names
        a layer the model lacks or leaves one without a stage."""
        owner = [-1] * layers
        for stage in self.stages:
            for layer in stage.layers:
                if not 0 <= layer < layers:
                    raise InputError(
                        f"plan stage {stage.index} names layer {layer}, the model has {layers} layers"
                    )
                owner[layer] = stage.index
        missing = [i for i, s in enumerate(owner) if s < 0]
        if missing:
            raise InputError(f"plan assigns no stage to layers {missing[:5]} (model has {layers} layers)")
        return owner

    @property
    def used_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for stage in self.stages for r in stage.ranks))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["topology"] = self.topology.to_dict()
        return {"schema": out.pop("schema"), **out}

    @classmethod
    def from_dict(cls, obj: dict[str, Any], where: str = "plan") -> Plan:
        _check_plan_fields(obj, where)
        try:
            stages = tuple(
                StagePlan(
                    **{
                        **s,
                        "ranks": tuple(s["ranks"]),
                        "layers": tuple(s.get("layers", ())),
                        "recompute_layers": tuple(s.get("recompute_layers", ())),
                        "selective_layers": tuple(s.get("selective_layers", ())),
                    }
                )
                for s in obj["stages"]
            )
            rest = {k: v for k, v in obj.items() if k not in ("schema", "stages", "topology", "predicted")}
            for name in ("leaf_modules", "opaque_modules"):
                if rest.get(name) is not None:
                    rest[name] = tuple(rest[name])
            return cls(
                topology=Topology.from_dict(obj["topology"]),
                stages=stages,
                predicted=Predicted(**obj["predicted"]),
                **rest,
            )
        except KeyError as exc:
            raise InputError(f"{where}: missing key {exc.args[0]!r}") from exc
        except TypeError as exc:
            raise InputError(f"{where}: {exc}") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        return cls.from_dict(read_json(path, PLAN_SCHEMA, OLDER_PLAN_SCHEMAS), where=str(path))


def _check_plan_fields(obj: dict[str, Any], where: str) -> None:
    """Unknown, missing and mistyped fields of a plan JSON object (``InputError``)."""
    check_fields(Plan, obj, where, nested=("topology", "stages", "predicted"))
    check_fields(Predicted, obj["predicted"], f"{where}: predicted")
    topology = obj["topology"]
    check_fields(Topology, topology, f"{where}: topology", nested=("device", "levels"))
    check_fields(DeviceSpec, topology["device"], f"{where}: topology.device")
    if not isinstance(topology["levels"], (list, tuple)):
        raise InputError(f"{where}: topology.levels must be a list")
    for k, level in enumerate(topology["levels"]):
        check_fields(Level, level, f"{where}: topology.levels[{k}]")
    if not isinstance(obj["stages"], (list, tuple)):
        raise InputError(f"{where}: field 'stages' must be a list of stage objects")
    for position, stage in enumerate(obj["stages"]):
        check_fields(StagePlan, stage, f"{where}: stages[{position}]")


def validate(plan: Plan) -> None:
    """Raise ``InputError`` naming the first inconsistent value.

    Checks the schedule name, sizes (batch, micro-batches, world), that the stages' layer
    sets are disjoint and cover layers 0..N-1 exactly once (N = max layer + 1; the sets
    need not be contiguous), ``layer_start``/``layer_end`` = min/max+1 of each set, and
    that every rank runs at most one pipeline position. O(layers + ranks).
    """
    if plan.schedule not in SCHEDULE_NAMES:
        raise InputError(f"plan schedule {plan.schedule!r} is not one of {', '.join(SCHEDULE_NAMES)}")
    if plan.export_target is not None and plan.export_target not in EXPORT_TARGETS:
        raise InputError(
            f"plan export_target {plan.export_target!r} is not one of {', '.join(EXPORT_TARGETS)}"
        )
    Precision(plan.dtype, plan.master_dtype)  # known dtypes, or one line naming the value
    if plan.world_size != plan.topology.world_size:
        raise InputError(
            f"plan world_size {plan.world_size} != topology world size {plan.topology.world_size}"
        )
    if plan.batch_size < 1:
        raise InputError(f"plan batch_size must be >= 1 (got {plan.batch_size})")
    if plan.microbatches < 1:
        raise InputError(f"plan microbatches must be >= 1 (got {plan.microbatches})")
    if plan.batch_size % plan.microbatches:
        raise InputError(
            f"plan batch_size {plan.batch_size} is not divisible into {plan.microbatches} micro-batches"
        )
    if plan.recompute not in ("auto", "none", "selective", "full"):
        raise InputError(f"plan recompute {plan.recompute!r} is not one of auto, none, selective, full")
    if not plan.stages:
        raise InputError("plan has no stages")
    _check_stage_layers(plan.stages)
    _check_stage_ranks(plan)


def _check_selective_stage(stage: StagePlan) -> None:
    """One line unless ``selective_layers`` are distinct layers of the stage, none of them
    fully recomputed, and ``sequence_parallel`` has a tensor-parallel group to shard over."""
    chosen = stage.selective_layers
    if not all(isinstance(layer, int) and not isinstance(layer, bool) for layer in chosen):
        raise InputError(f"plan stage {stage.index}: selective_layers {list(chosen)!r} are not layer indices")
    if (
        set(chosen) - set(stage.layers)
        or len(set(chosen)) != len(chosen)
        or set(chosen) & set(stage.recompute_layers)
    ):
        raise InputError(
            f"plan stage {stage.index}: selective_layers {list(chosen)} are not distinct layers of the stage "
            f"(layers {list(stage.layers)}) outside its recompute_layers {list(stage.recompute_layers)}"
        )
    if not isinstance(stage.sequence_parallel, bool):
        raise InputError(
            f"plan stage {stage.index}: sequence_parallel {stage.sequence_parallel!r} is not true or false"
        )
    t = stage.tensor_parallel
    if stage.sequence_parallel and (isinstance(t, bool) or not isinstance(t, int) or t < 2):
        raise InputError(
            f"plan stage {stage.index}: sequence_parallel with tensor_parallel {stage.tensor_parallel} "
            f"(it shards the sequence over a tensor-parallel group of 2 or more)"
        )


def _check_stage_layers(stages: tuple[StagePlan, ...]) -> None:
    owner: dict[int, int] = {}
    for position, stage in enumerate(stages):
        if stage.index != position:
            raise InputError(f"plan stage at position {position} has index {stage.index}")
        if not stage.layers:
            raise InputError(f"plan stage {stage.index} has no layers")
        for layer in stage.layers:
            if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
                raise InputError(f"plan stage {stage.index}: layer {layer!r} is not a layer index")
            if layer in owner:
                raise InputError(f"plan stages {owner[layer]} and {stage.index} both hold layer {layer}")
            owner[layer] = stage.index
        outside = sorted(set(stage.recompute_layers) - set(stage.layers))
        if outside or len(set(stage.recompute_layers)) != len(stage.recompute_layers):
            raise InputError(
                f"plan stage {stage.index}: recompute_layers {list(stage.recompute_layers)} are not distinct "
                f"layers of the stage (layers {list(stage.layers)})"
            )
        _check_selective_stage(stage)
        if not stage.recompute_ms >= 0:
            raise InputError(f"plan stage {stage.index}: recompute_ms {stage.recompute_ms!r} is negative")
        first, end = min(stage.layers), max(stage.layers) + 1
        if (stage.layer_start, stage.layer_end) != (first, end):
            raise InputError(
                f"plan stage {stage.index}: layer_start/layer_end [{stage.layer_start}, "
                f"{stage.layer_end}) do not match its layers (min {first}, max {end - 1})"
            )
    missing = [layer for layer in range(max(owner) + 1) if layer not in owner]
    if missing:
        raise InputError(f"plan assigns no stage to layers {missing[:5]} of 0..{max(owner)}")


SHARD_NAMES = ("none", "zero1", "zero2", "fsdp")  # pipeplan.planner.sharding.SHARD_MODES
OFFLOAD_NAMES = ("none", "optimizer", "optimizer+params")  # pipeplan.planner.offload.OFFLOADS


def _check_stage_shard(stage: StagePlan) -> None:
    """A shard mode by name, among groups of ``shard_degree`` replicas dividing its replicas."""
    d = stage.shard_degree
    if stage.shard not in SHARD_NAMES:
        raise InputError(
            f"plan stage {stage.index}: shard {stage.shard!r} is not one of {', '.join(SHARD_NAMES)}"
        )
    if isinstance(d, bool) or not isinstance(d, int) or d < 1 or stage.replicas % d:
        raise InputError(
            f"plan stage {stage.index}: shard_degree {d!r} must be an integer >= 1 dividing its {stage.replicas} replicas"
        )
    if (stage.shard == "none") != (d == 1):
        raise InputError(f"plan stage {stage.index}: shard {stage.shard} with shard_degree {d}")
    if stage.offload not in OFFLOAD_NAMES:
        raise InputError(
            f"plan stage {stage.index}: offload {stage.offload!r} is not one of {', '.join(OFFLOAD_NAMES)}"
        )
    if stage.offload == "optimizer+params" and stage.shard not in ("zero2", "fsdp"):
        raise InputError(
            f"plan stage {stage.index}: offload optimizer+params with shard {stage.shard} (FSDP2: zero2 or fsdp)"
        )
    ms = stage.offload_ms
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not ms >= 0:
        raise InputError(f"plan stage {stage.index}: offload_ms {ms!r} must be a number >= 0")


def _check_stage_ranks(plan: Plan) -> None:
    """Replica counts, rank ranges, one pipeline position per rank (interleaved: q % p)."""
    virtual = plan.virtual_stages
    if not isinstance(virtual, int) or virtual < 1 or len(plan.stages) % virtual:
        raise InputError(
            f"plan has {len(plan.stages)} stages, not a multiple of its {virtual!r} virtual stages per device"
        )
    positions = len(plan.stages) // virtual
    seen: set[int] = set()
    for stage in plan.stages:
        t = stage.tensor_parallel
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise InputError(f"plan stage {stage.index}: tensor_parallel {t!r} must be an integer >= 1")
        _check_stage_shard(stage)
        if stage.replicas * t != len(stage.ranks) or stage.replicas < 1:
            raise InputError(
                f"plan stage {stage.index}: replicas {stage.replicas} x tensor_parallel {t} but ranks "
                f"{list(stage.ranks)}"
            )
        if stage.index >= positions:
            if stage.ranks != plan.stages[stage.index % positions].ranks:
                raise InputError(
                    f"plan stage {stage.index}: ranks {list(stage.ranks)} differ from those of "
                    f"stage {stage.index % positions} (same pipeline position)"
                )
            continue
        for rank in stage.ranks:
            if not 0 <= rank < plan.world_size or rank in seen:
                raise InputError(f"plan stage {stage.index}: rank {rank} is out of range or reused")
            seen.add(rank)
