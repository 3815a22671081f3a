"""torchtitan: the ``[parallelism]`` fragment, with the model parts as whole units."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipeplan.errors import InputError
from pipeplan.export.structure import (
    TORCHTITAN_SCHEDULES,
    CutError,
    ModelStructure,
    check_exportable,
    positions,
    replica_degree,
    tensor_parallel_degree,
)
from pipeplan.plan import Plan

__all__ = ["TorchtitanExport", "activation_checkpoint_mode", "export_torchtitan", "torchtitan_parts"]


@dataclass(frozen=True)
class TorchtitanExport:
    """A plan as torchtitan's ``[parallelism]`` section: degree, schedule, micro-batch size, FQNs."""

    model: str
    schedule: str  # pipeplan's name
    pipeline_parallel_schedule: str
    pipeline_parallel_degree: int
    tensor_parallel_degree: int  # the plan's t: torchtitan's TP mesh dimension (1: none)
    batch_size: int  # torchtitan's [training] local_batch_size this fragment assumes
    microbatches: int
    module_fqns_per_model_part: tuple[tuple[str, ...], ...]
    # torchtitan's [activation_checkpoint] mode ("none" | "selective" with selective_ac_option
    # "op" | "full"), from the plan's recomputed
    # layers (``activation_checkpoint_mode``); ``recompute_note`` says what it changes, if anything
    activation_checkpoint_mode: str = "none"
    recompute_note: str = ""
    # copies of the whole pipeline (PTD-P's d): torchtitan's data-parallel replicate mesh
    # dimension; ``batch_size`` and ``microbatches`` are each copy's
    data_parallel_replicate_degree: int = 1

    @property
    def pipeline_parallel_microbatch_size(self) -> int:
        return self.batch_size // self.microbatches

    def toml(self) -> str:
        parts = "".join(
            "  [" + ", ".join(json.dumps(name) for name in part) + "],\n"
            for part in self.module_fqns_per_model_part
        )
        return (
            f"# pipeplan export --to torchtitan: {self.model}, {len(self.module_fqns_per_model_part)} stages "
            f"on {self.pipeline_parallel_degree} ranks, {self.schedule}.\n"
            "# Keys of torchtitan's [parallelism] section (torchtitan/config/job_config.py, class\n"
            "# Parallelism, pytorch/torchtitan@6404b932). With [training] local_batch_size =\n"
            f"# {self.batch_size}, local_batch_size / pipeline_parallel_microbatch_size = "
            f"{self.microbatches} micro-batches.\n"
            "[parallelism]\n"
            f"pipeline_parallel_degree = {self.pipeline_parallel_degree}\n"
            f"tensor_parallel_degree = {self.tensor_parallel_degree}\n"
            + (
                f"data_parallel_replicate_degree = {self.data_parallel_replicate_degree}\n"
                if self.data_parallel_replicate_degree > 1
                else ""
            )
            + f"pipeline_parallel_schedule = {json.dumps(self.pipeline_parallel_schedule)}\n"
            f"pipeline_parallel_microbatch_size = {self.pipeline_parallel_microbatch_size}\n"
            f"module_fqns_per_model_part = [\n{parts}]\n"
            "\n" + (f"# {self.recompute_note}\n" if self.recompute_note else "") + "[activation_checkpoint]\n"
            f"mode = {json.dumps(self.activation_checkpoint_mode)}\n"
            + ('selective_ac_option = "op"\n' if self.activation_checkpoint_mode == "selective" else "")
        )


# --------------------------------------------------------------------------- torchtitan units


def _unit_of(structure: ModelStructure, name: str) -> str:
    """The torchtitan unit holding module ``name``: its root child, or ``child.key`` in a container."""
    parts = name.split(".")
    if parts[0] in structure.containers and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def _units(structure: ModelStructure) -> list[str]:
    """Every unit in the model's definition order."""
    units: list[str] = []
    for name in structure.modules:
        if not name:
            continue
        parts = name.split(".")
        if len(parts) == 1 and name not in structure.containers:
            units.append(name)
        elif len(parts) == 2 and parts[0] in structure.containers:
            units.append(name)
    return units


def torchtitan_parts(
    structure: ModelStructure, stage_of: list[int], stages: int
) -> tuple[tuple[str, ...], ...]:
    """``module_fqns_per_model_part``: the units of each stage, every unit exactly once.

    A unit's stage is its layers' stage; a unit no layer runs joins the stage of the
    first layer using one of its parameters, else the stage of the unit before it in the
    model's definition order (stage 0 for the first).
    Raises ``InputError`` when a cut splits a unit or a layer lies outside every unit.
    O(layers + modules).
    """
    names = structure.layer_names
    stage_of_unit: dict[str, int] = {}
    first_layer: dict[str, int] = {}
    last_layer: dict[str, int] = {}
    for layer, name in enumerate(names):
        if not structure.is_module(name):
            raise CutError(
                f"layer {layer} ({name}) is a functional op of the root module: torchtitan places "
                f"modules, not ops; `--to pipelining` carries it over"
            )
        unit = _unit_of(structure, name)
        if unit in stage_of_unit and stage_of_unit[unit] != stage_of[layer]:
            before = last_layer[unit]
            kind = structure.modules.get(unit, "module")
            raise CutError(
                f"cut between layer {before} ({names[before]}, stage {stage_of_unit[unit]}) and layer "
                f"{layer} ({name}, stage {stage_of[layer]}) falls inside {unit} ({kind}), which torchtitan "
                f"keeps or deletes whole (its units: the model's children and the entries of a "
                f"ModuleList/ModuleDict child); `--to pipelining` can cut there"
            )
        stage_of_unit.setdefault(unit, stage_of[layer])
        first_layer.setdefault(unit, layer)
        last_layer[unit] = layer
    for layer, parameters in enumerate(structure.layer_parameters):  # units no layer runs
        for parameter in sorted(parameters):
            unit = _unit_of(structure, parameter.rsplit(".", 1)[0])
            stage_of_unit.setdefault(unit, stage_of[layer])
            first_layer.setdefault(unit, layer)
    parts: list[list[tuple[int, str]]] = [[] for _ in range(stages)]
    previous_stage, previous_order = 0, -1
    for unit in _units(structure):
        if unit in stage_of_unit:
            previous_stage, previous_order = stage_of_unit[unit], first_layer[unit]
        parts[previous_stage].append((previous_order, unit))
    return tuple(tuple(unit for _, unit in sorted(part, key=lambda item: item[0])) for part in parts)


def activation_checkpoint_mode(plan: Plan) -> tuple[str, str]:
    """(torchtitan's ``[activation_checkpoint] mode``, a note) for the plan's recomputed layers.

    torchtitan applies one mode to every transformer block of every stage: "none" when no
    stage recomputes, "selective" (op level) when stages recompute attention cores only, else
    "full" (every block checkpointed: at least the memory the plan saves, at more time when
    the plan recomputes only some stages' layers, which the note says).
    """
    recomputing = [stage for stage in plan.stages if stage.recompute_layers]
    selective = [stage.index for stage in plan.stages if stage.selective_layers]
    if selective and not recomputing:
        return "selective", _selective_note(plan, selective)
    if not recomputing:
        return "none", ""
    partial = [s.index for s in plan.stages if len(s.recompute_layers) < len(s.layers)]
    if not partial:
        return "full", ""
    shares = ", ".join(f"stage {s.index}: {len(s.recompute_layers)} of {len(s.layers)}" for s in plan.stages)
    return "full", (
        f"pipeplan's plan recomputes only some layers ({shares}); torchtitan checkpoints every block "
        f"in one mode: full (the memory fits, the recomputation costs more than planned)"
    )


def _selective_note(plan: Plan, selective: list[int]) -> str:
    """What torchtitan's op-level selective checkpointing (``selective_ac_option = "op"``)
    changes against the plan's selective recomputation (attention cores, Korthikanti et al.)."""
    left = [s.index for s in plan.stages if s.index not in selective]
    return (
        "torchtitan's op-level selective checkpointing saves matmul and attention outputs and recomputes "
        "the rest of every block; with fused attention the s^2 scores the plan's selective recomputation "
        "frees are never stored, so it keeps at most the plan's memory, at a time of its own"
        + (
            f"; it also applies to stage(s) {', '.join(map(str, left))}, which the plan leaves without"
            if left
            else ""
        )
    )


def export_torchtitan(plan: Plan, structure: ModelStructure) -> TorchtitanExport:
    """The plan for torchtitan's ``[parallelism]``; ``InputError`` (one line) when it does not carry over."""
    stage_of = check_exportable(plan, structure)
    if not TORCHTITAN_SCHEDULES[plan.schedule]:  # runs from its action table, on no named class
        raise InputError(
            f"plan schedule {plan.schedule} has no torchtitan pipeline_parallel_schedule (no torch class "
            f"runs it); `pipeplan export --to pipelining` runs its action table on torch's "
            f"_PipelineScheduleRuntime"
        )
    d = replica_degree(plan)
    return TorchtitanExport(
        model=plan.model,
        schedule=plan.schedule,
        pipeline_parallel_schedule=TORCHTITAN_SCHEDULES[plan.schedule],
        pipeline_parallel_degree=positions(plan),
        tensor_parallel_degree=tensor_parallel_degree(plan),
        batch_size=plan.batch_size // d,
        microbatches=plan.microbatches // d,
        data_parallel_replicate_degree=d,
        module_fqns_per_model_part=torchtitan_parts(structure, stage_of, len(plan.stages)),
        activation_checkpoint_mode=activation_checkpoint_mode(plan)[0],
        recompute_note=activation_checkpoint_mode(plan)[1],
    )
