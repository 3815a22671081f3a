"""Plans that other engines run: torch.distributed.pipelining and torchtitan.

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

import csv
import io
import json
from dataclasses import asdict, dataclass
from typing import Any

from pipeplan.errors import InputError
from pipeplan.plan import Plan
from pipeplan.schedule import build_schedule

__all__ = [
    "TARGETS",
    "SCHEDULE_CLASSES",
    "TORCHTITAN_SCHEDULES",
    "ModelStructure",
    "PipeliningExport",
    "TorchtitanExport",
    "model_structure",
    "check_plan",
    "check_exportable",
    "split_points",
    "torchtitan_parts",
    "action_table_csv",
    "export_pipelining",
    "export_torchtitan",
]

TARGETS = ("pipelining", "torchtitan")

# pipeplan schedule -> torch.distributed.pipelining class (torch 2.13 schedules.py)
SCHEDULE_CLASSES = {
    "1f1b-flush": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
}
# pipeplan schedule -> torchtitan's pipeline_parallel_schedule (torch's get_schedule_class names)
TORCHTITAN_SCHEDULES = {
    "1f1b-flush": "1F1B",
    "gpipe": "GPipe",
    "interleaved-1f1b": "Interleaved1F1B",
    "zb-h1": "InterleavedZeroBubble",
}
_MULTI_STAGE_CLASSES = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
_NOT_CARRIED = {
    "1f1b-rr": "1F1B-RR (PipeDream weight stashing, no flush)",
    "2bw": "2BW (PipeDream-2BW double-buffered weights, no flush)",
}
_CSV_KINDS = ("F", "B", "I", "W")  # pipeplan action kinds with a torch counterpart of the same letter
_ENGINES = "torch.distributed.pipelining and torchtitan"


@dataclass(frozen=True)
class ModelStructure:
    """What an engine's split sees of a model, indexed like the plan's layers.

    ``layer_names[i]``: plan layer i's module qualified name (or functional op name);
    ``layer_parameters[i]``: qualified names of the parameters layer i uses;
    ``modules``: every module's qualified name ("" is the root) -> its class name;
    ``containers``: the modules that are ``nn.ModuleList`` / ``nn.ModuleDict``;
    ``calls``: module name -> how many times one forward pass calls it (a container: 0).
    """

    layer_names: tuple[str, ...]
    layer_parameters: tuple[frozenset[str], ...]
    modules: dict[str, str]
    containers: frozenset[str]
    calls: dict[str, int]

    def is_module(self, name: str) -> bool:
        return bool(name) and name in self.modules


@dataclass(frozen=True)
class PipeliningExport:
    """A plan as torch.distributed.pipelining runs it: split points, schedule class, CSV."""

    model: str
    schedule: str  # pipeplan's name
    schedule_class: str  # torch.distributed.pipelining class name
    stages: int  # model stages (virtual stages included)
    ranks: int  # pipeline ranks; stage q runs on rank q % ranks
    batch_size: int  # samples per minibatch (one schedule.step)
    microbatches: int
    split_points: tuple[str, ...]  # module where stage 1, 2, ... begins (SplitPoint.BEGINNING)
    stage_layers: tuple[tuple[str, ...], ...]  # layer names of each stage, in order
    plan_ranks: tuple[int, ...]  # global rank the plan gave each pipeline position
    csv: str  # the plan's action table, compute-only CSV

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["microbatch_size"] = self.batch_size // self.microbatches
        out["python"] = self.python()
        return {"schema": "pipeplan.export.pipelining/1", **out}

    def python(self) -> str:
        """A snippet to paste: ``build_pipeline_schedule(model, example_microbatch, loss_fn, rank, device)``."""
        spec = ", ".join(f"{json.dumps(name)}: SplitPoint.BEGINNING" for name in self.split_points)
        multi = self.schedule_class in _MULTI_STAGE_CLASSES
        build = (
            f"    stages = [pipe.build_stage(s, device, group) for s in range(rank, pipe.num_stages, {self.ranks})]\n"
            f"    schedule = {self.schedule_class}(stages, n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)\n"
            if multi
            else "    stages = [pipe.build_stage(rank, device, group)]\n"
            f"    schedule = {self.schedule_class}(stages[0], n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)\n"
        )
        size = self.batch_size // self.microbatches
        return (
            f"# pipeplan export --to pipelining: {self.model}, {self.stages} stages on {self.ranks} ranks,\n"
            f"# {self.schedule} = {self.schedule_class}, {self.microbatches} micro-batches of {size} samples\n"
            f"# per step of {self.batch_size} samples. Run on {self.ranks} ranks "
            f"(torchrun --nproc-per-node {self.ranks}).\n"
            f"from torch.distributed.pipelining import SplitPoint, pipeline, {self.schedule_class}\n"
            "\n"
            f"SPLIT_SPEC = {{{spec}}}\n"
            f"N_MICROBATCHES = {self.microbatches}\n"
            "\n"
            "\n"
            "def build_pipeline_schedule(model, example_microbatch, loss_fn, rank, device, group=None):\n"
            f'    """(schedule, this rank\'s stage modules: give their parameters to the optimizer);\n'
            f'    example_microbatch: a tuple of the model\'s inputs for one micro-batch ({size} samples)."""\n'
            "    pipe = pipeline(model, mb_args=example_microbatch, split_spec=SPLIT_SPEC)\n"
            f"{build}"
            "    return schedule, [stage.submod for stage in stages]\n"
            "\n"
            "# The plan's own action order instead (pipeplan export ... --format csv -o schedule.csv):\n"
            "#   from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime\n"
            "#   schedule = _PipelineScheduleRuntime(stages, n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)\n"
            '#   schedule._load_csv("schedule.csv")\n'
        )


@dataclass(frozen=True)
class TorchtitanExport:
    """A plan as torchtitan's ``[parallelism]`` section: degree, schedule, micro-batch size, FQNs."""

    model: str
    schedule: str  # pipeplan's name
    pipeline_parallel_schedule: str
    pipeline_parallel_degree: int
    batch_size: int  # torchtitan's [training] local_batch_size this fragment assumes
    microbatches: int
    module_fqns_per_model_part: tuple[tuple[str, ...], ...]

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
            f"pipeline_parallel_schedule = {json.dumps(self.pipeline_parallel_schedule)}\n"
            f"pipeline_parallel_microbatch_size = {self.pipeline_parallel_microbatch_size}\n"
            f"module_fqns_per_model_part = [\n{parts}]\n"
        )


# --------------------------------------------------------------------------- the model


def model_structure(model_path: str, plan: Plan) -> ModelStructure:
    """Build the model file's model and layer graph; ``InputError`` unless it is the plan's model.

    The graph is traced on one micro-batch (``batch_size // microbatches`` samples) of
    ``sample_batch``, as ``pipeplan run`` does; one more forward pass on it counts each
    module's calls (forward pre-hooks).
    """
    import torch
    from torch import nn

    from pipeplan.graph import build_layer_graph
    from pipeplan.modelfile import load_model_file, resolve_model_path

    model_file = load_model_file(resolve_model_path(model_path))
    torch.manual_seed(0)
    model = model_file.build()
    sample_inputs, _ = model_file.batch(max(1, plan.batch_size // plan.microbatches), seed=0)
    graph = build_layer_graph(model, sample_inputs)
    if graph.fingerprint != plan.profile_fingerprint:
        raise InputError(
            f"{model_file.path} does not match the plan: model fingerprint {graph.fingerprint}, "
            f"plan was made for {plan.profile_fingerprint} (re-profile and re-plan this model)"
        )
    per_layer = graph.layer_modules()
    calls = dict.fromkeys((name for name, _ in model.named_modules()), 0)
    hooks = [
        module.register_forward_pre_hook(lambda _m, _a, name=name: calls.__setitem__(name, calls[name] + 1))
        for name, module in model.named_modules()
    ]
    try:
        with torch.no_grad():
            model(*sample_inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return ModelStructure(
        layer_names=tuple(layer.name for layer in graph.layers),
        layer_parameters=tuple(frozenset(m.parameter_names.values()) for m in per_layer),
        modules={name: type(module).__name__ for name, module in model.named_modules()},
        containers=frozenset(
            name for name, module in model.named_modules() if isinstance(module, (nn.ModuleList, nn.ModuleDict))
        ),
        calls=calls,
    )


# --------------------------------------------------------------------------- checks


def check_plan(plan: Plan) -> None:
    """Raise ``InputError`` (one line) for what neither engine runs, from the plan alone.

    Checks, in order: schedule, replication, contiguous stages, and the micro-batch
    counts the torch schedule class accepts. O(layers + stages).
    """
    straight = f"re-plan with `pipeplan partition PROFILE --straight --schedule {_flush_of(plan.schedule)}`"
    if plan.schedule in _NOT_CARRIED:
        raise InputError(
            f"plan schedule {_NOT_CARRIED[plan.schedule]} does not carry over: {_ENGINES} run flush "
            f"schedules only (1f1b-flush, gpipe, interleaved-1f1b, zb-h1); re-plan with "
            f"`pipeplan partition PROFILE --schedule 1f1b-flush --straight`"
        )
    if plan.schedule not in SCHEDULE_CLASSES:
        raise InputError(f"plan schedule {plan.schedule!r} has no counterpart in {_ENGINES}")
    replicas = [stage.replicas for stage in plan.stages]
    if len(set(replicas)) > 1:
        raise InputError(
            f"plan replicates stages unevenly (replicas per stage {', '.join(map(str, replicas))}): "
            f"{_ENGINES} run one device per stage; {straight}"
        )
    if replicas[0] > 1:
        raise InputError(
            f"plan replicates every stage {replicas[0]} times: {_ENGINES} run one device per stage "
            f"(data parallelism over whole pipelines is their separate mesh dimension); {straight}"
        )
    for stage in plan.stages:
        expected = range(stage.layer_start, stage.layer_end)
        if tuple(sorted(stage.layers)) != tuple(expected):
            missing = sorted(set(expected) - set(stage.layers))[:3]
            raise InputError(
                f"plan stage {stage.index} holds layers {stage.layer_start}..{stage.layer_end - 1} "
                f"but not {', '.join(map(str, missing))}: {_ENGINES} cut the execution order, so every "
                f"stage must be a contiguous range of layers; a plan cut along the layer order carries over"
            )
    _check_microbatches(plan)


def check_exportable(plan: Plan, structure: ModelStructure) -> list[int]:
    """``check_plan``, then the checks that need the model; return each layer's stage.

    Raises ``InputError`` (one line) when a parameter is used by two stages. O(layers).
    """
    check_plan(plan)
    layers = len(structure.layer_names)
    stage_of = [-1] * layers
    for stage in plan.stages:
        for layer in stage.layers:
            if not 0 <= layer < layers:
                raise InputError(f"plan stage {stage.index} names layer {layer}, the model has {layers} layers")
            stage_of[layer] = stage.index
    if -1 in stage_of:
        raise InputError(f"plan assigns no stage to layer {stage_of.index(-1)} (model has {layers} layers)")
    _check_shared_parameters(structure, stage_of)
    return stage_of


def _flush_of(schedule: str) -> str:
    return schedule if schedule in SCHEDULE_CLASSES else "1f1b-flush"


def _positions(plan: Plan) -> int:
    """Pipeline ranks: model stages / virtual stages per rank."""
    return len(plan.stages) // plan.virtual_stages


def _check_microbatches(plan: Plan) -> None:
    """The micro-batch rules of the torch schedule class the plan maps to."""
    m, stages, ranks = plan.microbatches, len(plan.stages), _positions(plan)
    if plan.batch_size % m:
        raise InputError(
            f"plan batch size {plan.batch_size} does not split into {m} equal micro-batches, "
            f"as both engines split a step's batch; a plan with a divisor of {plan.batch_size} carries over"
        )
    cls = SCHEDULE_CLASSES[plan.schedule]
    if cls == "Schedule1F1B" and m < stages:
        raise InputError(
            f"plan runs {m} micro-batch(es) per minibatch on {stages} stages: Schedule1F1B needs at "
            f"least one per stage; re-plan with `--microbatches {stages}` (or more)"
        )
    if cls in _MULTI_STAGE_CLASSES:
        rounds = max(1, m // ranks)
        if m % rounds:
            raise InputError(
                f"plan runs {m} micro-batches on {ranks} ranks: {cls} needs a multiple of "
                f"{rounds} (max(1, micro-batches // ranks)); re-plan with `--microbatches {rounds * ranks}`"
            )


def _check_shared_parameters(structure: ModelStructure, stage_of: list[int]) -> None:
    users: dict[str, dict[int, int]] = {}  # parameter -> stage -> first layer using it there
    for layer, names in enumerate(structure.layer_parameters):
        for name in names:
            users.setdefault(name, {}).setdefault(stage_of[layer], layer)
    for name in sorted(users):
        stages = users[name]
        if len(stages) > 1:
            first = ", ".join(f"layer {layer} ({structure.layer_names[layer]}) in stage {s}"
                              for s, layer in sorted(stages.items()))
            raise InputError(
                f"parameter {name} is shared by {first}: torch.distributed.pipelining copies it into each "
                f"stage and trains the copies apart, torchtitan keeps it on one stage; a plan that puts "
                f"every layer using it in one stage carries over"
            )


# --------------------------------------------------------------------------- split points


def _layers_under(names: tuple[str, ...]) -> dict[str, list[int]]:
    """Module prefix -> indices of the layers at or under it (each dot-prefix of a layer name)."""
    under: dict[str, list[int]] = {}
    for index, name in enumerate(names):
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            under.setdefault(".".join(parts[:depth]), []).append(index)
    return under


def split_points(structure: ModelStructure, stage_of: list[int]) -> tuple[str, ...]:
    """The module where each stage 1, 2, ... begins (torch.distributed.pipelining's SplitPoint.BEGINNING).

    For a stage beginning at layer i: the outermost module that is called exactly once
    per forward pass and whose first layer is i (``blocks.1`` rather than
    ``blocks.1.ln1``; never a ModuleList, which is not called). Raises ``InputError``
    for a stage that begins at a functional op or at a module called several times.
    O(layers * depth).

    >>> s = ModelStructure(("a", "b.0.x", "b.0.y", "b.1.x"), (frozenset(),) * 4,
    ...                    {"": "M", "a": "L", "b": "S", "b.0": "B", "b.0.x": "L", "b.0.y": "L",
    ...                     "b.1": "B", "b.1.x": "L"}, frozenset(),
    ...                    {"": 1, "a": 1, "b": 1, "b.0": 1, "b.0.x": 1, "b.0.y": 1, "b.1": 1, "b.1.x": 1})
    >>> split_points(s, [0, 0, 1, 2])
    ('b.0.y', 'b.1')
    """
    names = structure.layer_names
    under = _layers_under(names)
    points = []
    for first in range(1, len(names)):
        if stage_of[first] == stage_of[first - 1]:
            continue
        name = names[first]
        if not structure.is_module(name):
            raise InputError(
                f"stage {stage_of[first]} begins at layer {first} ({name}), a functional op, not a module: "
                f"torch.distributed.pipelining splits before module calls; a plan that cuts before a "
                f"module layer carries over"
            )
        calls = structure.calls.get(name, 0)
        if calls != 1:
            layers = [i for i in under[name] if names[i] == name]
            raise InputError(
                f"stage {stage_of[first]} begins at layer {first} ({name}), a module called {calls} times "
                f"per forward pass (layers {', '.join(map(str, layers))}): SplitPoint.BEGINNING would split "
                f"before every call; a plan whose stages begin at modules called once carries over"
            )
        point = name
        parts = name.split(".")
        for depth in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:depth])
            if min(under[prefix]) != first:
                break
            if structure.calls.get(prefix, 0) == 1:
                point = prefix
        points.append(point)
    return tuple(points)


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


def torchtitan_parts(structure: ModelStructure, stage_of: list[int], stages: int) -> tuple[tuple[str, ...], ...]:
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
            raise InputError(
                f"layer {layer} ({name}) is a functional op of the root module: torchtitan places "
                f"modules, not ops; `--to pipelining` carries it over"
            )
        unit = _unit_of(structure, name)
        if unit in stage_of_unit and stage_of_unit[unit] != stage_of[layer]:
            before = last_layer[unit]
            kind = structure.modules.get(unit, "module")
            raise InputError(
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


# --------------------------------------------------------------------------- the action table


def action_table_csv(plan: Plan) -> str:
    """The plan's actions for one step (one minibatch) as torch's compute-only CSV.

    Row r lists pipeline rank r's actions in order, ``f"{stage}{kind}{microbatch}"`` with
    stage = chunk * ranks + r; empty cells are idle unit steps of pipeplan's clock, so the
    rows line up by time as torch's own tables do. The optimizer step ("S") is the
    caller's ``optimizer.step()`` and has no cell. O(actions).
    """
    ranks = _positions(plan)
    schedule = build_schedule(plan.schedule, (1,) * ranks, 1, plan.microbatches, plan.virtual_stages)
    clock = schedule.steps()
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for rank in range(ranks):
        row: list[str] = []
        for action, step in zip(schedule.actions[(rank, 0)], clock[(rank, 0)]):
            if action.kind == "S":
                continue
            if action.kind not in _CSV_KINDS:
                raise InputError(f"plan action {action} has no torch.distributed.pipelining counterpart")
            row += [""] * (step - len(row))
            stage = action.chunk * ranks + rank
            row.append(f"{stage}{action.kind}{action.microbatch}")
        writer.writerow(row)
    return buffer.getvalue()


# --------------------------------------------------------------------------- exports


def export_pipelining(plan: Plan, structure: ModelStructure) -> PipeliningExport:
    """The plan for torch.distributed.pipelining; ``InputError`` (one line) when it does not carry over."""
    stage_of = check_exportable(plan, structure)
    points = split_points(structure, stage_of)
    ranks = _positions(plan)
    return PipeliningExport(
        model=plan.model,
        schedule=plan.schedule,
        schedule_class=SCHEDULE_CLASSES[plan.schedule],
        stages=len(plan.stages),
        ranks=ranks,
        batch_size=plan.batch_size,
        microbatches=plan.microbatches,
        split_points=points,
        stage_layers=tuple(tuple(structure.layer_names[i] for i in sorted(s.layers)) for s in plan.stages),
        plan_ranks=tuple(plan.stages[i].ranks[0] for i in range(ranks)),
        csv=action_table_csv(plan),
    )


def export_torchtitan(plan: Plan, structure: ModelStructure) -> TorchtitanExport:
    """The plan for torchtitan's ``[parallelism]``; ``InputError`` (one line) when it does not carry over."""
    stage_of = check_exportable(plan, structure)
    return TorchtitanExport(
        model=plan.model,
        schedule=plan.schedule,
        pipeline_parallel_schedule=TORCHTITAN_SCHEDULES[plan.schedule],
        pipeline_parallel_degree=_positions(plan),
        batch_size=plan.batch_size,
        microbatches=plan.microbatches,
        module_fqns_per_model_part=torchtitan_parts(structure, stage_of, len(plan.stages)),
    )
