"""What a plan needs to carry over to torch.distributed.pipelining or torchtitan: the model's structure and the checks.

Both engines take a split by hand and run one device per stage with a flush schedule,
so a plan carries over when it is *straight* (no replicated stage), uses a flush
schedule, keeps every stage a contiguous range of layers in execution order, shares no
parameter between stages, and cuts where the engine can cut:

- **torch.distributed.pipelining** (``pipeline(model, split_spec={name:
  SplitPoint.BEGINNING})``) cuts before the call of any module, at any depth. A cut
  before layer i is at a *module boundary* when layer i is a module called once; its
  split point is the outermost module whose first layer is i and all of whose leaves
  are called once (``blocks.1`` rather than ``blocks.1.ln1``). A cut before a
  functional op, or before a module called several times, is refused.
- **torchtitan** (``parallelism.module_fqns_per_model_part``) keeps or deletes whole
  *units*: the model's children, and the entries of a child that is an
  ``nn.ModuleList`` / ``nn.ModuleDict`` (``layers.3``), one level deep, as its
  ``pipeline_module_split`` does. A cut is at a unit boundary when no unit has layers in
  two stages; a layer outside every unit (a functional op of the root) is refused.

Every refusal is an ``InputError`` with one line: what does not carry over, and what
would. The plan's own action order is exported as torch.distributed.pipelining's
compute-only CSV schedule (one row per pipeline rank, cells like ``"1F0"``: stage 1,
forward, micro-batch 0), which ``_PipelineScheduleRuntime._load_csv`` and torchtitan's
``pipeline_parallel_schedule_csv`` read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeplan.capture.torch_split import TorchSplit
from pipeplan.errors import InputError
from pipeplan.plan import Plan
from pipeplan.schedules import DEFAULT_TARGET_SCHEDULE, SCHEDULE_KINDS, schedule_kind, v_segment

if TYPE_CHECKING:
    from torch import nn

    from pipeplan.capture import LayerGraph
    from pipeplan.model_inputs import ModelInputs

__all__ = [
    "SCHEDULE_CLASSES",
    "TARGETS",
    "TORCHTITAN_SCHEDULES",
    "CutError",
    "ModelAtHand",
    "ModelStructure",
    "check_exportable",
    "check_no_offload",
    "check_plan",
    "check_shared_parameters",
    "engine_stages",
    "model_structure",
    "positions",
    "replica_degree",
    "tensor_parallel_degree",
]

TARGETS = ("pipelining", "torchtitan")

# Derived from the schedule registry (pipeplan.schedules.kinds: each kind's ``engine``):
# pipeplan schedule -> torch.distributed.pipelining class (torch 2.13 schedules.py)
SCHEDULE_CLASSES = {name: kind.engine.torch_class for name, kind in SCHEDULE_KINDS.items() if kind.engine}
# pipeplan schedule -> torchtitan's pipeline_parallel_schedule (torch's get_schedule_class names)
TORCHTITAN_SCHEDULES = {
    name: kind.engine.torchtitan_name for name, kind in SCHEDULE_KINDS.items() if kind.engine
}
# the multi-stage classes (several stages per rank)
MULTI_STAGE_CLASSES = tuple(
    kind.engine.torch_class for kind in SCHEDULE_KINDS.values() if kind.engine and kind.engine.multi_stage
)
ENGINES = "torch.distributed.pipelining and torchtitan"


class CutError(InputError):
    """A plan cuts where the engine cannot (``pipeplan partition --for`` plans only cuts it can)."""


@dataclass(frozen=True)
class ModelAtHand:
    """The plan's model as export builds it, to run the stages it writes: the model, its
    layer graph (captured on one micro-batch, as ``pipeplan run`` captures it), that
    micro-batch's inputs and targets, and the model file's loss."""

    model: nn.Module
    graph: LayerGraph
    inputs: ModelInputs
    target: Any
    loss_fn: Callable[[Any, Any], Any]
    leaf_modules: tuple[str, ...]
    opaque_modules: tuple[str, ...]


@dataclass(frozen=True)
class ModelStructure:
    """What an engine's split sees of a model, indexed like the plan's layers.

    ``layer_names[i]``: plan layer i's module qualified name (or functional op name);
    ``layer_parameters[i]``: qualified names of the parameters layer i uses;
    ``modules``: every module's qualified name ("" is the root) -> its class name;
    ``containers``: the modules that are ``nn.ModuleList`` / ``nn.ModuleDict``;
    ``calls``: module name -> how many times one forward pass calls it (a container: 0);
    ``trace``: split points -> torch.distributed.pipelining's own split of the model there
    (``pipeline()`` traced in-process), None when the model is not at hand;
    ``at_hand``: the model itself, to run the stages (None: the checks from the structure alone).
    """

    layer_names: tuple[str, ...]
    layer_parameters: tuple[frozenset[str], ...]
    modules: dict[str, str]
    containers: frozenset[str]
    calls: dict[str, int]
    trace: Callable[[tuple[str, ...]], TorchSplit] | None = field(default=None, compare=False, repr=False)
    at_hand: ModelAtHand | None = field(default=None, compare=False, repr=False)

    def is_module(self, name: str) -> bool:
        return bool(name) and name in self.modules


# --------------------------------------------------------------------------- the model


def model_structure(model_path: str, plan: Plan) -> ModelStructure:
    """Build the model file's model and layer graph; ``InputError`` unless it is the plan's model.

    The graph is traced on one micro-batch (``batch_size // microbatches`` samples) of
    ``sample_batch`` with the plan's leaf and opaque module classes (else the model file's
    ``LEAF_MODULES`` / ``OPAQUE_MODULES``), as ``pipeplan run`` does; one more forward pass on it counts each
    module's calls (``pipeplan.capture.module_records``, as the profiler records them).
    """
    import torch

    from pipeplan.capture import build_layer_graph, module_records
    from pipeplan.capture.torch_split import trace_torch_split
    from pipeplan.modelfile import load_model_file, resolve_model_path

    model_file = load_model_file(resolve_model_path(model_path))
    torch.manual_seed(0)
    model = model_file.build()
    sample_inputs, sample_target = model_file.batch(max(1, plan.batch_size // plan.microbatches), seed=0)
    leaf_modules = plan.leaf_modules if plan.leaf_modules is not None else model_file.leaf_modules
    opaque_modules = plan.opaque_modules if plan.opaque_modules is not None else model_file.opaque_modules
    graph = build_layer_graph(model, sample_inputs, leaf_modules, opaque_modules)
    if graph.fingerprint != plan.profile_fingerprint:
        raise InputError(
            f"{model_file.path} does not match the plan: model fingerprint {graph.fingerprint}, "
            f"plan was made for {plan.profile_fingerprint} (re-profile and re-plan this model)"
        )
    per_layer = graph.layer_modules()
    records = module_records(model, sample_inputs)
    return ModelStructure(
        layer_names=tuple(layer.name for layer in graph.layers),
        layer_parameters=tuple(frozenset(m.parameter_names.values()) for m in per_layer),
        modules={record.name: record.type for record in records},
        containers=frozenset(record.name for record in records if record.container),
        calls={record.name: record.calls for record in records},
        trace=lambda points: trace_torch_split(model, sample_inputs, points),
        at_hand=ModelAtHand(
            model=model,
            graph=graph,
            inputs=sample_inputs,
            target=sample_target,
            loss_fn=model_file.loss_fn,
            leaf_modules=tuple(leaf_modules),
            opaque_modules=tuple(opaque_modules),
        ),
    )


# --------------------------------------------------------------------------- checks


def check_plan(plan: Plan) -> None:
    """Raise ``InputError`` (one line) for what neither engine runs, from the plan alone.

    Checks, in order: schedule, replication, contiguous stages, and the micro-batch
    counts the torch schedule class accepts. O(layers + stages).
    """
    kind = schedule_kind(plan.schedule)
    if kind.engine is None:
        raise InputError(
            f"plan schedule {kind.exported_as} does not carry over: {ENGINES} run flush "
            f"schedules only ({', '.join(SCHEDULE_CLASSES)}); re-plan with "
            f"`pipeplan partition PROFILE --schedule {DEFAULT_TARGET_SCHEDULE} --straight`"
        )
    replica_degree(plan)
    check_no_offload(plan)
    for stage in plan.stages:
        expected = range(stage.layer_start, stage.layer_end)
        if tuple(sorted(stage.layers)) != tuple(expected):
            missing = sorted(set(expected) - set(stage.layers))[:3]
            raise InputError(
                f"plan stage {stage.index} holds layers {stage.layer_start}..{stage.layer_end - 1} "
                f"but not {', '.join(map(str, missing))}: {ENGINES} cut the execution order, so every "
                f"stage must be a contiguous range of layers; a plan cut along the layer order carries over"
            )
    _check_microbatches(plan)


def check_no_offload(plan: Plan) -> None:
    """``InputError`` (one line) for a plan whose stages offload to host memory: no export
    carries the offload, and the plan's memory figures count on it."""
    offloaded = [stage.index for stage in plan.stages if stage.offload != "none"]
    if offloaded:
        raise InputError(
            f"plan stage(s) {offloaded} offload to host memory, which the export does not carry and the "
            f"plan's memory counts on; re-plan with `--offload none`"
        )


def engine_stages(plan: Plan) -> dict[int, int]:
    """Model stage -> the engines' stage index: the place along the layers, as both number
    their stages (the same index, except in a V: zb-v's model stage P + i is torch's stage
    2P - 1 - i, on rank i as ``ScheduleZBVZeroBubble`` places it)."""
    stages = len(plan.stages)
    ranks = stages // plan.virtual_stages
    v_shape = schedule_kind(plan.schedule).v_shape
    return {q: v_segment(q, ranks) if v_shape else q for q in range(stages)}


def check_exportable(plan: Plan, structure: ModelStructure, shared: bool = False) -> list[int]:
    """``check_plan``, then the checks that need the model; return each layer's engine stage
    (``engine_stages``).

    Raises ``InputError`` (one line) when a parameter is used by two stages, unless
    ``shared`` (the export keeps tied copies equal itself). O(layers).
    """
    check_plan(plan)
    engine = engine_stages(plan)
    stage_of = [engine[q] for q in plan.stage_of_layers(len(structure.layer_names))]
    if not shared:
        check_shared_parameters(structure, stage_of)
    return stage_of


def _flush_of(schedule: str) -> str:
    return schedule if schedule in SCHEDULE_CLASSES else DEFAULT_TARGET_SCHEDULE


def tensor_parallel_degree(plan: Plan) -> int:
    """The plan's one tensor-parallel degree t; ``InputError`` (one line) when stages differ
    (torchtitan's tensor-parallel mesh dimension spans every stage)."""
    degrees = sorted({stage.tensor_parallel for stage in plan.stages})
    if len(degrees) > 1:
        raise InputError(
            f"plan stages use tensor-parallel degrees {degrees}: {ENGINES} use one for every stage"
        )
    return degrees[0]


def replica_degree(plan: Plan) -> int:
    """d: the copies of the whole pipeline (PTD-P's data parallelism, the engines' separate
    data-parallel mesh dimension, torchtitan's ``data_parallel_replicate_degree``), each
    running its own M / d micro-batches of batch / d samples. ``InputError`` (one line) for
    replicas the engines cannot run: uneven, a schedule whose replicas do not run a pipeline
    each (``ScheduleKind.replica_pipelines``; one chunk per device always does), or micro-batches
    that do not split evenly over the copies."""
    straight = f"re-plan with `pipeplan partition PROFILE --straight --schedule {_flush_of(plan.schedule)}`"
    replicas = [stage.replicas for stage in plan.stages]
    if len(set(replicas)) > 1:
        raise InputError(
            f"plan replicates stages unevenly (replicas per stage {', '.join(map(str, replicas))}): "
            f"{ENGINES} run one device per stage; {straight}"
        )
    d = replicas[0]
    kind = schedule_kind(plan.schedule)
    if d > 1 and kind.virtual_stages and not kind.replica_pipelines:
        raise InputError(
            f"plan replicates every stage {d} times under {plan.schedule}, whose replicas share one "
            f"pipeline's order: {ENGINES} run a whole pipeline per data-parallel copy; {straight}"
        )
    if d > 1 and (plan.microbatches % d or plan.batch_size % d):
        raise InputError(
            f"plan routes {plan.microbatches} micro-batches of a {plan.batch_size}-sample batch over "
            f"{d} replicas: {ENGINES} give each data-parallel copy of the pipeline an equal share; "
            f"re-plan with a multiple of {d} micro-batches"
        )
    return d


def positions(plan: Plan) -> int:
    """Pipeline ranks: model stages / virtual stages per rank."""
    return len(plan.stages) // plan.virtual_stages


def _check_microbatches(plan: Plan) -> None:
    """The micro-batch rules of the torch schedule class the plan maps to, for each
    data-parallel copy's pipeline (``replica_degree``: M / d micro-batches of batch / d)."""
    d = replica_degree(plan)
    m, stages, ranks = plan.microbatches // d, len(plan.stages), positions(plan)
    batch = plan.batch_size // d
    if batch % m:
        raise InputError(
            f"plan batch size {batch} does not split into {m} equal micro-batches, "
            f"as both engines split a step's batch; a plan with a divisor of {batch} carries over"
        )
    engine = schedule_kind(plan.schedule).engine
    assert engine is not None  # check_plan refused the others
    cls = engine.torch_class
    if engine.microbatch_per_stage and m < stages:
        raise InputError(
            f"plan runs {m} micro-batch(es) per minibatch on {stages} stages: {cls} needs at "
            f"least one per stage; re-plan with `--microbatches {stages}` (or more)"
        )
    if engine.multi_stage and not schedule_kind(plan.schedule).v_shape:  # ZBV pads, needs no rounds
        rounds = max(1, m // ranks)
        if m % rounds:
            raise InputError(
                f"plan runs {m} micro-batches on {ranks} ranks: {cls} needs a multiple of "
                f"{rounds} (max(1, micro-batches // ranks)); re-plan with `--microbatches {rounds * ranks}`"
            )


def check_shared_parameters(structure: ModelStructure, stage_of: list[int]) -> None:
    users: dict[str, dict[int, int]] = {}  # parameter -> stage -> first layer using it there
    for layer, names in enumerate(structure.layer_parameters):
        for name in names:
            users.setdefault(name, {}).setdefault(stage_of[layer], layer)
    for name in sorted(users):
        stages = users[name]
        if len(stages) > 1:
            first = ", ".join(
                f"layer {layer} ({structure.layer_names[layer]}) in stage {s}"
                for s, layer in sorted(stages.items())
            )
            raise CutError(
                f"parameter {name} is shared by {first}: torch.distributed.pipelining copies it into each "
                f"stage and trains the copies apart, torchtitan keeps it on one stage; a plan that puts "
                f"every layer using it in one stage carries over"
            )
