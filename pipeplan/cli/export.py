"""``pipeplan export plan.json --to pipelining|torchtitan|megatron --model model.py``: a plan for another engine."""

from __future__ import annotations

from pathlib import Path

import click

__all__ = ["export"]

# target -> formats it writes, the default first
FORMATS = {"pipelining": ("python", "json", "csv"), "torchtitan": ("toml", "csv"), "megatron": ("args",)}
SUFFIXES = {".py": "python", ".json": "json", ".csv": "csv", ".toml": "toml", ".sh": "args", ".txt": "args"}


def choose_format(target: str, fmt: str | None, output: str | None) -> str:
    """``fmt``, else the one ``output``'s suffix names, else the target's default."""
    from pipeplan.errors import InputError

    allowed = FORMATS[target]
    chosen = fmt or (SUFFIXES.get(Path(output).suffix) if output else None) or allowed[0]
    if chosen not in allowed:
        raise InputError(
            f"--to {target} writes {', '.join(allowed)}, not {chosen}"
            + ("" if fmt else f" (from the suffix of {output}; pass --format)")
        )
    return chosen


@click.command(
    "export",
    epilog="""\b
Examples:
  pipeplan export plan.json --to pipelining --model model.py              # Python snippet
  pipeplan export plan.json --to pipelining --model model.py -o split.json
  pipeplan export plan.json --to pipelining --model model.py -o schedule.csv
  pipeplan export plan.json --to torchtitan --model model.py -o pp.toml
  pipeplan export plan.json --to megatron --model model.py -o megatron-args.sh
""",
)
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option(
    "--to",
    "target",
    type=click.Choice(tuple(FORMATS)),
    required=True,
    help="The engine: torch.distributed.pipelining, torchtitan or Megatron-LM.",
)
@click.option(
    "--model",
    "model_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="The plan's model.py (or a bundled model: mlp, vgg, resnet, gpt): its module "
    "tree says where the engine can cut; its fingerprint must be the plan's.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(("python", "json", "csv", "toml", "args")),
    default=None,
    help="pipelining: python (default), json, csv; torchtitan: toml (default), csv; megatron: args. "
    "Default: from the -o suffix.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write here (atomically) instead of standard output.",
)
def export(plan_path: str, target: str, model_path: str, fmt: str | None, output: str | None) -> None:
    """Export PLAN for torch.distributed.pipelining, torchtitan or Megatron-LM.

    pipelining: split points (SplitPoint.BEGINNING module names), schedule class and
    micro-batches, as a Python snippet or JSON; where torch's own pipeline() split does
    not run the plan (it fails to trace or to run, tied weights, keyword inputs), pipeplan's
    stage modules in torch's PipelineStage instead; every stage is run once in-process
    before writing; csv: the plan's own action table in
    torch.distributed.pipelining's CSV schedule format. torchtitan: a [parallelism] TOML
    fragment. megatron: pretrain_gpt.py's parallelism arguments (the pipeline layout). A plan these engines cannot run as planned (1F1B-RR/2BW, replicated
    stages, a cut inside what the engine keeps whole, shared parameters) is refused
    with one line saying what does not carry over and what would.
    """
    import json

    from pipeplan.export import (
        CutError,
        PipeliningExport,
        action_table_csv,
        check_plan,
        export_pipelining,
        export_torchtitan,
        model_structure,
    )
    from pipeplan.plan import Plan

    chosen = choose_format(target, fmt, output)
    plan = Plan.load(plan_path)
    if target == "megatron":
        from pipeplan.export.megatron import export_megatron

        megatron = export_megatron(plan, model_structure(model_path, plan))
        _emit(
            megatron.text(),
            output,
            f"{len(megatron.layout)} stages on t={megatron.tensor_parallel} x p={megatron.pipeline_parallel} "
            f"x d={megatron.data_parallel} ranks; layout {megatron.layout_string}",
        )
        return
    check_plan(plan)
    structure = model_structure(model_path, plan)
    try:
        made = (
            export_pipelining(plan, structure)
            if target == "pipelining"
            else export_torchtitan(plan, structure)
        )
    except CutError as exc:
        if plan.export_target == target:
            raise
        raise CutError(f"{exc}; `pipeplan partition PROFILE --for {target}` plans only such cuts") from exc
    if isinstance(made, PipeliningExport):
        pipelining = made
        text = {
            "python": pipelining.python(),
            "json": json.dumps(pipelining.to_dict(), indent=2) + "\n",
            "csv": pipelining.csv,
        }[chosen]
        summary = (
            f"{pipelining.stages} stages on {pipelining.ranks} ranks, {pipelining.schedule_class}, "
            f"{pipelining.microbatches} micro-batches; split points: {', '.join(pipelining.split_points)}\n"
            f"stages: {pipelining.reason}"
            + (f"\nchecked: {pipelining.checked}" if pipelining.checked else "")
        )
    else:
        titan = made
        text = titan.toml() if chosen == "toml" else action_table_csv(plan)
        summary = (
            f"{len(titan.module_fqns_per_model_part)} stages on {titan.pipeline_parallel_degree} ranks, "
            f"{titan.pipeline_parallel_schedule}, micro-batch size {titan.pipeline_parallel_microbatch_size} "
            f"samples"
        )
    _emit(text, output, summary)


def _emit(text: str, output: str | None, summary: str) -> None:
    """``text`` to standard output, or atomically to ``output`` with a one-line ``summary``."""
    from pipeplan.jsonio import write_atomic

    if output is None:
        click.echo(text, nl=False)
        return
    write_atomic(output, text.encode())
    click.echo(f"{summary}\nwrote {output}")
