"""``PipeliningExport`` and the Python it writes for torch.distributed.pipelining: one snippet per way of splitting.

Both define ``N_STAGES``, ``RANKS``, ``N_MICROBATCHES``, ``build_stages(model,
example_microbatch, rank, device, group=None)`` (this rank's ``PipelineStage`` objects),
``build_pipeline_schedule(model, example_microbatch, loss_fn, rank, device, group=None)``
(the schedule and this rank's stage modules), ``stage_loss(stage_modules, loss_fn)`` (the
loss the schedule applies to the last stage's output) and ``sync_tied_gradients(stage_modules,
group=None)`` (call it after ``schedule.step`` and before ``optimizer.step()``). The
example micro-batch is the model's input tensors, positional ones first, then keyword
ones in the batch's order (``ModelInputs.tensors``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeplan.export.structure import MULTI_STAGE_CLASSES

__all__ = ["SPLITS", "PipeliningExport"]

SPLITS = ("split_spec", "stage_modules")  # PipeliningExport.split: how each rank gets its stage


@dataclass(frozen=True)
class PipeliningExport:
    """A plan as torch.distributed.pipelining runs it: split points, schedule class, CSV.

    ``split``: ``split_spec`` (torch's own ``pipeline()`` split at ``split_points``) or
    ``stage_modules`` (pipeplan's stage modules, each in torch's manual ``PipelineStage``);
    ``reason`` says why, ``checked`` what running the stages in-process showed.
    """

    model: str
    schedule: str  # pipeplan's name
    schedule_class: str  # torch.distributed.pipelining class name
    stages: int  # model stages (virtual stages included)
    ranks: int  # pipeline ranks; stage q runs on rank q % ranks
    batch_size: int  # samples per minibatch (one schedule.step) of one data-parallel copy
    microbatches: int  # of one data-parallel copy's pipeline
    split_points: tuple[
        str, ...
    ]  # module where stage 1, 2, ... begins (SplitPoint.BEGINNING); layer names for stage_modules
    stage_layers: tuple[tuple[str, ...], ...]  # layer names of each stage, in order
    plan_ranks: tuple[int, ...]  # global rank the plan gave each pipeline position
    csv: str  # the plan's action table, compute-only CSV
    split: str = "split_spec"  # one of SPLITS
    reason: str = ""  # one line: why this split
    checked: str = ""  # one line: what the in-process run of the stages gave ("" when not run)
    stage_of_layer: tuple[int, ...] = ()  # stage_modules: each layer's stage
    input_layout: tuple[tuple[str, object], ...] = ()  # stage_modules: the model's inputs (InputLayout)
    fingerprint: str = ""  # stage_modules: the plan's model fingerprint
    leaf_modules: tuple[str, ...] = ()
    opaque_modules: tuple[str, ...] = ()
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)  # parameter -> stages holding a copy
    # torch's stages of rank r: "loop" r, r + ranks, ...; "v" r and 2 * ranks - 1 - r (ZBV)
    stage_style: str = "loop"
    # copies of the whole pipeline (PTD-P's d), each on its own ``ranks`` ranks with batch_size
    # samples: data parallelism over whole pipelines, the engines' separate mesh dimension
    replicas: int = 1

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["microbatch_size"] = self.batch_size // self.microbatches
        out["python"] = self.python()
        return {"schema": "pipeplan.export.pipelining/1", **out}

    def python(self) -> str:
        """A snippet to paste: ``build_pipeline_schedule(model, example_microbatch, loss_fn, rank, device)``."""
        return split_spec_python(self) if self.split == "split_spec" else stage_modules_python(self)


def _header(made: PipeliningExport, imports: str) -> str:
    size = made.batch_size // made.microbatches
    return (
        f"# pipeplan export --to pipelining: {made.model}, {made.stages} stages on {made.ranks} ranks,\n"
        f"# {made.schedule} = {made.schedule_class}, {made.microbatches} micro-batches of {size} samples\n"
        f"# per step of {made.batch_size} samples. Run on {made.ranks} ranks "
        f"(torchrun --nproc-per-node {made.ranks}).\n"
        + (
            f"# Data parallel: the plan runs {made.replicas} copies of this pipeline "
            f"({made.replicas * made.ranks} ranks), each on its own\n# {made.batch_size} samples; "
            "all-reduce each stage's gradients over the copies (a DeviceMesh of shape "
            f"({made.replicas}, {made.ranks}), its data-parallel dimension) before the optimizer step.\n"
            if made.replicas > 1
            else ""
        )
        + f"# Stages: {made.reason}\n"
        + (f"# Checked: {made.checked}\n" if made.checked else "")
        + f"{imports}\n"
    )


RUNTIME_CLASS = "_PipelineScheduleRuntime"  # torch's runtime of a loaded action table (no class fits)


def schedule_import(made: PipeliningExport) -> str:
    """The import of the snippet's schedule class (``_PipelineScheduleRuntime`` is not exported
    at the package's top)."""
    if made.schedule_class == RUNTIME_CLASS:
        return f"from torch.distributed.pipelining.schedules import {RUNTIME_CLASS}\n"
    return f"from torch.distributed.pipelining import {made.schedule_class}\n"


def _schedule(made: PipeliningExport) -> str:
    stages = "stages" if made.schedule_class in MULTI_STAGE_CLASSES else "stages[0]"
    table = made.schedule_class == RUNTIME_CLASS
    return (
        (
            "\n\n# the plan's own action order (compute only): no torch class runs this schedule\n"
            f'ACTION_TABLE = """\\\n{made.csv}"""\n'
            "\n\n"
            "def action_table_file():\n"
            '    """ACTION_TABLE in a CSV file, for _load_csv."""\n'
            "    import tempfile\n\n"
            '    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as table:\n'
            "        table.write(ACTION_TABLE)\n"
            "    return table.name\n"
            if table
            else ""
        )
        + "\n\n"
        "def build_pipeline_schedule(model, example_microbatch, loss_fn, rank, device, group=None):\n"
        '    """(schedule, this rank\'s stage modules: give their parameters to the optimizer)."""\n'
        "    stages = build_stages(model, example_microbatch, rank, device, group)\n"
        "    modules = [stage.submod for stage in stages]\n"
        f"    schedule = {made.schedule_class}(\n"
        f"        {stages}, n_microbatches=N_MICROBATCHES, loss_fn=stage_loss(modules, loss_fn)\n"
        "    )\n"
        + ("    schedule._load_csv(action_table_file())\n" if table else "")
        + "    return schedule, modules\n"
        "\n"
        "# The plan's own action order instead (pipeplan export ... --format csv -o schedule.csv):\n"
        "#   from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime\n"
        "#   modules = [stage.submod for stage in stages]\n"
        "#   schedule = _PipelineScheduleRuntime(\n"
        "#       stages, n_microbatches=N_MICROBATCHES, loss_fn=stage_loss(modules, loss_fn)\n"
        "#   )\n"
        '#   schedule._load_csv("schedule.csv")\n'
    )


def _constants(made: PipeliningExport) -> str:
    mine = (
        "(rank, num_stages - 1 - rank)  # a V: the first and the mirrored stage"
        if made.stage_style == "v"
        else "tuple(range(rank, num_stages, RANKS))"
    )
    return (
        f"N_STAGES = {made.stages}\nRANKS = {made.ranks}\nN_MICROBATCHES = {made.microbatches}\n"
        f"V_SHAPE = {made.stage_style == 'v'}\n"
        "\n\n"
        "def stage_ids(rank, num_stages=N_STAGES):\n"
        '    """The stages this rank builds, as the schedule class places them."""\n'
        f"    return {mine}\n"
    )


def split_spec_python(made: PipeliningExport) -> str:
    """torch's own split: ``pipeline()`` with ``SPLIT_SPEC``, stages from ``pipe.build_stage``."""
    spec = ", ".join(f"{json.dumps(name)}: SplitPoint.BEGINNING" for name in made.split_points)
    size = made.batch_size // made.microbatches
    return (
        _header(
            made, "from torch.distributed.pipelining import SplitPoint, pipeline\n" + schedule_import(made)
        )
        + f"SPLIT_SPEC = {{{spec}}}\n"
        + _constants(made)
        + "\n\n"
        "def build_stages(model, example_microbatch, rank, device, group=None):\n"
        f'    """This rank\'s stages; example_microbatch: the model\'s inputs for one micro-batch ({size} samples)."""\n'
        "    pipe = pipeline(model, mb_args=tuple(example_microbatch), split_spec=SPLIT_SPEC)\n"
        "    return [pipe.build_stage(s, device, group) for s in stage_ids(rank)]\n"
        + _schedule(made)
        + "\n\n"
        "def stage_loss(stage_modules, loss_fn):\n"
        '    """The loss the schedule applies to the last stage\'s output: loss_fn itself."""\n'
        "    return loss_fn\n"
        "\n\n"
        "def sync_tied_gradients(stage_modules, group=None):\n"
        '    """No parameter is held by two stages: nothing to sum."""\n'
    )


def stage_modules_python(made: PipeliningExport) -> str:
    """pipeplan's own stage modules (what ``pipeplan run`` trains) in torch's manual ``PipelineStage``."""
    size = made.batch_size // made.microbatches
    tied = "".join(f"    {json.dumps(name)}: {tuple(stages)!r},\n" for name, stages in made.tied.items())
    return (
        _header(
            made,
            "from torch.distributed.pipelining import PipelineStage\n" + schedule_import(made) + "\n"
            "from pipeplan.export.stage_modules import (\n"
            "    all_reduce_tied,\n"
            "    pipelining_stage_modules,\n"
            "    stage_examples,\n"
            "    staged_loss,\n"
            ")\n",
        )
        + _constants(made)
        + f"STAGE_OF_LAYER = {made.stage_of_layer!r}\n"
        + f"INPUT_LAYOUT = {made.input_layout!r}\n"
        + f"FINGERPRINT = {json.dumps(made.fingerprint)}\n"
        + f"LEAF_MODULES = {made.leaf_modules!r}\n"
        + f"OPAQUE_MODULES = {made.opaque_modules!r}\n"
        + "# parameter -> the stages holding a copy; their gradients are summed before each optimizer step\n"
        + (f"TIED = {{\n{tied}}}\n" if tied else "TIED = {}\n")
        + "\n\n"
        "def build_stages(model, example_microbatch, rank, device, group=None):\n"
        f'    """This rank\'s stages; example_microbatch: the model\'s input tensors for one micro-batch ({size} samples)."""\n'
        "    modules = pipelining_stage_modules(\n"
        "        model, example_microbatch, STAGE_OF_LAYER, INPUT_LAYOUT, FINGERPRINT, LEAF_MODULES, OPAQUE_MODULES, device\n"
        "    )\n"
        "    # example inputs and outputs of every stage: torch's shape inference would run a stage on\n"
        "    # uninitialised tensors (token ids from an earlier stage would index out of range)\n"
        "    examples = stage_examples(modules, example_microbatch)\n"
        "    return [\n"
        "        PipelineStage(\n"
        "            modules[s].to(device), s, N_STAGES, device,\n"
        "            input_args=examples[s][0], output_args=examples[s][1], group=group,\n"
        "        )\n"
        "        for s in stage_ids(rank)\n"
        "    ]\n" + _schedule(made) + "\n\n"
        "def stage_loss(stage_modules, loss_fn):\n"
        '    """loss_fn on the model\'s output, rebuilt from the last stage\'s tuple of tensors."""\n'
        "    return staged_loss(stage_modules, loss_fn)\n"
        "\n\n"
        "def sync_tied_gradients(stage_modules, group=None):\n"
        '    """After schedule.step(), before optimizer.step(): sum each tied parameter\'s gradient over\n'
        '    the ranks holding a copy, so that the copies stay equal. Every rank calls it."""\n'
        "    all_reduce_tied(stage_modules, TIED, RANKS, group, v_shape=V_SHAPE)\n"
    )
