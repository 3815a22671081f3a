"""torch.distributed.pipelining: split points at module boundaries, the schedule class and the CSV action table."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass
from typing import Any

from pipeplan.capture.torch_split import outermost_split_point, split_faults
from pipeplan.errors import InputError
from pipeplan.export.structure import (
    MULTI_STAGE_CLASSES,
    SCHEDULE_CLASSES,
    CutError,
    ModelStructure,
    check_exportable,
    engine_stages,
    positions,
    tensor_parallel_degree,
)
from pipeplan.plan import Plan
from pipeplan.schedules import build_schedule, schedule_kind, unit_clock

__all__ = ["PipeliningExport", "action_table_csv", "check_torch_split", "export_pipelining", "split_points"]

_CSV_KINDS = ("F", "B", "I", "W")  # pipeplan action kinds with a torch counterpart of the same letter


@dataclass(frozen=True)
class PipeliningExport:
    """A plan as torch.distributed.pipelining runs it: split points, schedule class, CSV."""

    model: str
    schedule: str  # pipeplan's name
    schedule_class: str  # torch.distributed.pipelining class name
    stages: int  # model stages (virtual stages included)
    ranks: int  # pipeline ranks; stage q runs on rank q % ranks (in a V: ``stage_style``)
    batch_size: int  # samples per minibatch (one schedule.step)
    microbatches: int
    split_points: tuple[str, ...]  # module where stage 1, 2, ... begins (SplitPoint.BEGINNING)
    stage_layers: tuple[tuple[str, ...], ...]  # layer names of each (torch) stage, in order
    plan_ranks: tuple[int, ...]  # global rank the plan gave each pipeline position
    csv: str  # the plan's action table, compute-only CSV
    # torch's stages of rank r: "loop" r, r + ranks, ...; "v" r and 2 * ranks - 1 - r (ZBV)
    stage_style: str = "loop"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["microbatch_size"] = self.batch_size // self.microbatches
        out["python"] = self.python()
        return {"schema": "pipeplan.export.pipelining/1", **out}

    def python(self) -> str:
        """A snippet to paste: ``build_pipeline_schedule(model, example_microbatch, loss_fn, rank, device)``."""
        spec = ", ".join(f"{json.dumps(name)}: SplitPoint.BEGINNING" for name in self.split_points)
        multi = self.schedule_class in MULTI_STAGE_CLASSES
        mine = (
            "(rank, num_stages - 1 - rank)  # a V: the first and the mirrored stage"
            if self.stage_style == "v"
            else f"tuple(range(rank, num_stages, {self.ranks}))"
        )
        build = (
            "    stages = [pipe.build_stage(s, device, group) for s in stage_ids(rank, pipe.num_stages)]\n"
            f"    schedule = {self.schedule_class}(stages, n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)\n"
            if multi
            else "    stages = [pipe.build_stage(rank, device, group)]\n"
            f"    schedule = {self.schedule_class}(stages[0], n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)\n"
        )
        size = self.batch_size // self.microbatches
        caveat = (
            "# torch 2.13: a rank's two adjacent stages (the V's turn) exchange warm-up messages with\n"
            '# the rank itself, which gloo refuses ("Pair is not connected"): run it on NCCL.\n'
            if self.stage_style == "v"
            else ""
        )
        return (
            f"# pipeplan export --to pipelining: {self.model}, {self.stages} stages on {self.ranks} ranks,\n"
            f"# {self.schedule} = {self.schedule_class}, {self.microbatches} micro-batches of {size} samples\n"
            f"# per step of {self.batch_size} samples. Run on {self.ranks} ranks "
            f"(torchrun --nproc-per-node {self.ranks}).\n"
            f"{caveat}"
            f"from torch.distributed.pipelining import SplitPoint, pipeline, {self.schedule_class}\n"
            "\n"
            f"SPLIT_SPEC = {{{spec}}}\n"
            f"N_MICROBATCHES = {self.microbatches}\n"
            "\n"
            "\n"
            "def stage_ids(rank, num_stages):\n"
            '    """The stages this rank builds, as the schedule class places them."""\n'
            f"    return {mine}\n"
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
            raise CutError(
                f"stage {stage_of[first]} begins at layer {first} ({name}), a functional op, not a module: "
                f"torch.distributed.pipelining splits before module calls; a plan that cuts before a "
                f"module layer carries over"
            )
        calls = structure.calls.get(name, 0)
        if calls != 1:
            layers = [i for i in under[name] if names[i] == name]
            raise CutError(
                f"stage {stage_of[first]} begins at layer {first} ({name}), a module called {calls} times "
                f"per forward pass (layers {', '.join(map(str, layers))}): SplitPoint.BEGINNING would split "
                f"before every call; a plan whose stages begin at modules called once carries over"
            )
        points.append(outermost_split_point(names, structure.calls, first))
    return tuple(points)


def check_torch_split(plan: Plan, structure: ModelStructure, points: tuple[str, ...]) -> None:
    """Trace torch's own ``pipeline()`` at ``points`` once (in-process, nothing run) and
    compare it with the plan: the same stages, each holding exactly its plan stage's
    parameters, a model input read by stage 0 alone, every value sent to the next stage
    alone. ``InputError`` (one line) for what torch would refuse at run time; nothing
    when ``structure`` has no model to trace. O(graph nodes + parameters)."""
    if structure.trace is None:
        return
    try:
        split = structure.trace(points)
    except Exception as exc:  # whatever pipeline() raises, the user's run would raise too
        message = (str(exc).strip().splitlines() or [""])[0][:160]
        raise InputError(
            f"torch.distributed.pipelining's pipeline() cannot trace {plan.model} split at "
            f"{', '.join(points)} ({type(exc).__name__}: {message})"
        ) from exc
    if len(split.pieces) != len(plan.stages):
        raise InputError(
            f"torch.distributed.pipelining's pipeline() made {len(split.pieces)} stages of "
            f"{plan.model} split at {', '.join(points)}, the plan has {len(plan.stages)}"
        )
    engine = engine_stages(plan)
    owner = {
        name: engine[stage.index]
        for stage in plan.stages
        for i in stage.layers
        for name in structure.layer_parameters[i]
    }
    for k, piece in enumerate(split.pieces):
        for name in sorted(piece.parameters ^ {n for n, s in owner.items() if s == k}):
            where = f"stage {k}" if name in piece.parameters else "another stage"
            raise CutError(
                f"torch.distributed.pipelining's split puts parameter {name} in {where}, the plan in "
                f"stage {owner.get(name, 'none')}: torch would not train the plan's stages"
            )
    faults = split_faults(split)
    if faults:
        raise CutError(
            f"torch.distributed.pipelining's own split of {plan.model} at {', '.join(points)}: "
            f"{faults[0]}; torch runs parameter-free ops where the Python code does, which need not "
            f"be the layer the plan counts them in"
        )


# --------------------------------------------------------------------------- the action table


def action_table_csv(plan: Plan) -> str:
    """The plan's actions for one step (one minibatch) as torch's compute-only CSV.

    Row r lists pipeline rank r's actions in order, ``f"{stage}{kind}{microbatch}"`` with
    stage torch's index of model stage chunk * ranks + r (``engine_stages``: the same, but in
    a V chunk 1 of rank r is torch's stage 2 * ranks - 1 - r); empty cells are idle unit steps of pipeplan's clock, so the
    rows line up by time as torch's own tables do. The optimizer step ("S") is the
    caller's ``optimizer.step()`` and has no cell. O(actions).
    """
    ranks = positions(plan)
    schedule = build_schedule(plan.schedule, (1,) * ranks, 1, plan.microbatches, plan.virtual_stages)
    clock = unit_clock(schedule)
    engine = engine_stages(plan)
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
            stage = engine[action.chunk * ranks + rank]
            row.append(f"{stage}{action.kind}{action.microbatch}")
        writer.writerow(row)
    return buffer.getvalue()


# --------------------------------------------------------------------------- exports


def export_pipelining(plan: Plan, structure: ModelStructure) -> PipeliningExport:
    """The plan for torch.distributed.pipelining; ``InputError`` (one line) when it does not carry over."""
    degree = tensor_parallel_degree(plan)
    if degree > 1:
        raise InputError(
            f"plan splits every stage {degree} ways (tensor_parallel {degree}): torch.distributed.pipelining "
            f"runs one device per stage, without tensor parallelism; export --to torchtitan "
            f"(tensor_parallel_degree) or re-plan with --tensor-parallel 1"
        )
    stage_of = check_exportable(plan, structure)
    points = split_points(structure, stage_of)
    check_torch_split(plan, structure, points)
    ranks = positions(plan)
    return PipeliningExport(
        model=plan.model,
        schedule=plan.schedule,
        schedule_class=SCHEDULE_CLASSES[plan.schedule],
        stages=len(plan.stages),
        ranks=ranks,
        batch_size=plan.batch_size,
        microbatches=plan.microbatches,
        split_points=points,
        stage_layers=tuple(
            tuple(structure.layer_names[i] for i in sorted(plan.stages[q].layers))
            for q in plan.pipeline_order()
        ),
        stage_style="v" if schedule_kind(plan.schedule).v_shape else "loop",
        plan_ranks=tuple(plan.stages[i].ranks[0] for i in range(ranks)),
        csv=action_table_csv(plan),
    )
