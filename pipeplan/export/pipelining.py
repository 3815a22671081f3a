"""torch.distributed.pipelining: split points at module boundaries, the schedule class and the CSV action table."""

from __future__ import annotations

import csv
import io
from dataclasses import replace

import torch

from pipeplan.capture.torch_split import outermost_split_point, split_faults, torch_pipe
from pipeplan.errors import InputError
from pipeplan.export.run_check import StagedModel, StageRunError, check_staged, traced_staged
from pipeplan.export.snippets import PipeliningExport
from pipeplan.export.stage_modules import split_graph, staged_loss, tied_parameters
from pipeplan.export.structure import (
    SCHEDULE_CLASSES,
    CutError,
    ModelAtHand,
    ModelStructure,
    check_exportable,
    engine_stages,
    positions,
    replica_degree,
    tensor_parallel_degree,
)
from pipeplan.plan import Plan
from pipeplan.schedules import build_schedule, schedule_kind, unit_clock

__all__ = ["PipeliningExport", "action_table_csv", "check_torch_split", "export_pipelining", "split_points"]

_CSV_KINDS = ("F", "B", "I", "W")  # pipeplan action kinds with a torch counterpart of the same letter


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


def action_table_csv(plan: Plan, microbatches: int | None = None) -> str:
    """The plan's actions for one step (one minibatch) as torch's compute-only CSV, of
    ``microbatches`` (default: the plan's; one data-parallel copy's M / d when replicated).

    Row r lists pipeline rank r's actions in order, ``f"{stage}{kind}{microbatch}"`` with
    stage torch's index of model stage chunk * ranks + r (``engine_stages``: the same, but in
    a V chunk 1 of rank r is torch's stage 2 * ranks - 1 - r); empty cells are idle unit steps of pipeplan's clock, so the
    rows line up by time as torch's own tables do. The optimizer step ("S") is the
    caller's ``optimizer.step()`` and has no cell. O(actions).
    """
    ranks = positions(plan)
    micro = microbatches or plan.microbatches
    schedule = build_schedule(plan.schedule, (1,) * ranks, 1, micro, plan.virtual_stages)
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
    """The plan for torch.distributed.pipelining; ``InputError`` (one line) when it does not carry over.

    With the model at hand (``structure.at_hand``), torch's own ``SPLIT_SPEC`` split is
    written where ``pipeline()`` expresses the plan's stages and its stages, run once
    in-process (``run_check``), equal the whole model; else pipeplan's stage modules,
    run the same way first. Without it, the split points after the checks from the
    structure alone.
    """
    degree = tensor_parallel_degree(plan)
    if degree > 1:
        raise InputError(
            f"plan splits every stage {degree} ways (tensor_parallel {degree}): torch.distributed.pipelining "
            f"runs one device per stage, without tensor parallelism; export --to torchtitan "
            f"(tensor_parallel_degree) or re-plan with --tensor-parallel 1"
        )
    at_hand = structure.at_hand
    stage_of = check_exportable(plan, structure, shared=at_hand is not None)
    ranks = positions(plan)
    d = replica_degree(plan)
    base = PipeliningExport(
        model=plan.model,
        schedule=plan.schedule,
        schedule_class=SCHEDULE_CLASSES[plan.schedule],
        stages=len(plan.stages),
        ranks=ranks,
        batch_size=plan.batch_size // d,
        microbatches=plan.microbatches // d,
        replicas=d,
        split_points=(),
        stage_layers=tuple(
            tuple(structure.layer_names[i] for i in sorted(plan.stages[q].layers))
            for q in plan.pipeline_order()
        ),
        stage_style="v" if schedule_kind(plan.schedule).v_shape else "loop",
        plan_ranks=tuple(plan.stages[i].ranks[0] for i in range(ranks)),
        csv=action_table_csv(plan, plan.microbatches // d),
        reason="torch's pipeline() split at the split points",
    )
    if at_hand is None:
        points = split_points(structure, stage_of)
        check_torch_split(plan, structure, points)
        return replace(base, split_points=points)
    try:
        points = split_points(structure, stage_of)
        fault, loss = _split_spec_fault(plan, structure, at_hand, stage_of, points)
    except InputError as exc:
        points, fault = (), str(exc)
    if fault is None and base.stage_style == "v":
        fault = V_TRACED_FAULT
    if fault is None:
        return replace(
            base,
            split_points=points,
            reason="torch's own pipeline() split (SPLIT_SPEC): it traces the model and its stages ran",
            checked=_checked(loss),
        )
    return _stage_modules_export(base, at_hand, stage_of, fault)


# torch 2.13 warms a rank's stages up before the first step: PipelineStage (pipeplan's stage
# modules) by its vote protocol, any other stage (pipeline()'s traced ones) by isend/irecv to
# every neighbour stage's rank, in a V also to the rank itself (stages P - 1 and P), which gloo
# refuses ("Pair is not connected")
V_TRACED_FAULT = (
    "in a V, torch's traced pipeline() stages warm up by sending to the rank itself (stages P - 1 "
    "and P), which gloo refuses; PipelineStage's own warm-up does not"
)


def _checked(loss: float) -> str:
    return (
        f"every stage ran forward and backward on one micro-batch in-process, chained as torch "
        f"chains them: loss {loss:.6g} and every gradient equal to the whole model's"
    )


def _split_spec_fault(
    plan: Plan, structure: ModelStructure, at_hand: ModelAtHand, stage_of: list[int], points: tuple[str, ...]
) -> tuple[str | None, float]:
    """(why torch's own split would not run the plan, None when it does; the loss its stages
    gave). Raises ``InputError`` for a fault found before running."""
    if not at_hand.inputs.positional:
        return "the model takes keyword or non-tensor inputs, which pipeline()'s stage 0 is not fed", 0.0
    stages_of: dict[str, set[int]] = {}
    for layer, names in enumerate(structure.layer_parameters):
        for name in names:
            stages_of.setdefault(name, set()).add(stage_of[layer])
    tied = sorted(name for name, held in stages_of.items() if len(held) > 1)
    if tied:
        held = ", ".join(map(str, sorted(stages_of[tied[0]])))
        return (
            f"parameter {tied[0]} is used by stages {held} (tied), whose copies torch's pipeline() "
            f"trains apart; the export sums their gradients",
            0.0,
        )
    check_torch_split(plan, structure, points)
    try:
        return None, _run_split_spec(at_hand, points)
    except StageRunError as exc:
        return f"torch's pipeline() split at {', '.join(points)} fails when run: {exc}", 0.0


def _run_split_spec(at_hand: ModelAtHand, points: tuple[str, ...]) -> float:
    pipe = torch_pipe(at_hand.model, at_hand.inputs, points)
    staged = traced_staged(pipe, at_hand.model, len(at_hand.inputs.args))
    return check_staged(
        staged, at_hand.model, at_hand.inputs, tuple(at_hand.inputs.args), at_hand.target, at_hand.loss_fn
    )


def _stage_modules_export(
    base: PipeliningExport, at_hand: ModelAtHand, stage_of: list[int], fault: str
) -> PipeliningExport:
    """pipeplan's stage modules, run once in-process first; ``InputError`` (one line) when they fail."""
    modules = split_graph(at_hand.graph, stage_of)
    staged = StagedModel(
        stages=tuple(modules),
        sources=((), *(tuple((m.index - 1, i) for i in range(len(m.input_names))) for m in modules[1:])),
        parameters=tuple(m.qualified_parameters() for m in modules),
    )
    inputs = at_hand.inputs
    try:
        loss = check_staged(
            staged,
            at_hand.model,
            inputs,
            inputs.tensors(),
            at_hand.target,
            at_hand.loss_fn,
            staged_loss(modules, at_hand.loss_fn),
        )
    except StageRunError as exc:
        raise InputError(
            f"{base.model}: pipeplan's stage modules fail when run as torch.distributed.pipelining runs them: {exc}"
        ) from exc
    layout = tuple(
        (name, None if isinstance(value, torch.Tensor) else value)
        for name, value in (*((str(i), v) for i, v in enumerate(inputs.args)), *inputs.kwargs.items())
    )
    names = [layer.name for layer in at_hand.graph.layers]
    return replace(
        base,
        split="stage_modules",
        split_points=tuple(names[i] for i in range(1, len(names)) if stage_of[i] != stage_of[i - 1]),
        reason=f"pipeplan's stage modules in PipelineStage, since {_lower(fault)}",
        checked=_checked(loss),
        stage_of_layer=tuple(stage_of),
        input_layout=layout,
        fingerprint=at_hand.graph.fingerprint,
        leaf_modules=at_hand.leaf_modules,
        opaque_modules=at_hand.opaque_modules,
        tied=tied_parameters(modules),
    )


def _lower(text: str) -> str:
    return text[:1].lower() + text[1:]
