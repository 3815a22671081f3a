"""``pipeplan run plan.json --model model.py``: train under torchrun as the plan says."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from pipeplan.cli.dataclass_options import config_from_options, dataclass_options
from pipeplan.runtime.config import RunConfig

__all__ = ["run"]


@click.command(
    "run",
    epilog="""\b
Examples:
  torchrun --nproc-per-node 4 -m pipeplan run plan.json --model model.py --steps 100
  torchrun --nproc-per-node 4 --no-python pipeplan run plan.json --model model.py
  torchrun --nproc-per-node 2 -m pipeplan run plan.json --model model.py \\
      --schedule 1f1b-flush --microbatches 4 --metrics out.json --trace trace.json
  torchrun --nproc-per-node 2 -m pipeplan run plan.json --model model.py \\
      --checkpoint-dir ckpt --checkpoint-every 10 --resume
  torchrun --nproc-per-node 2 -m pipeplan run plan.json --model model.py --weights hf-model/
  torchrun --nproc-per-node 2 -m pipeplan run plan.json --model model.py --steps 200 \
      --optimizer adamw --lr 3e-4 --weight-decay 0.1 --lr-schedule cosine --warmup-steps 20 \
      --min-lr 3e-5 --clip-grad-norm 1.0 --log-dir runs/first
""",
)
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@dataclass_options(RunConfig)
def run(plan_path: str, **options: object) -> None:
    """Train with the plan's pipeline on the ranks torchrun started.

    Every rank builds only its stage; activations and gradients (skip connections
    included) flow between stages point to point; replicas and tied parameters
    all-reduce their gradients; every wait is bounded and a failed rank stops the run.
    """
    from pipeplan.errors import InputError, PipeplanError
    from pipeplan.plan import Plan
    from pipeplan.runtime.train import PrepareError, run_training

    rank = int(os.environ.get("RANK", "0"))
    try:
        config = config_from_options(RunConfig, options, plan=Plan.load(plan_path))
    except InputError:
        if rank != 0:
            sys.exit(2)
        raise
    try:
        summary = run_training(config)
    except PrepareError:
        if rank != 0:
            sys.exit(2)  # the same error on every rank: rank 0 says it once, every rank exits
        raise  # printed as one "error:" line by the CLI group
    except PipeplanError as exc:
        _die(str(exc))  # after the group started: exit at once, whatever threads hold
    if summary is not None:
        _print_summary(summary)
    # Outputs are written and the group is destroyed: leave without interpreter teardown, whose
    # C++ destructors can abort ("terminate called ...") while a watchdog thread is still
    # inside a store call on a loaded machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _die(message: str) -> None:
    """One ``error:`` line, then exit 2 at once (background threads may hold the group)."""
    sys.stderr.write(f"error: {(message.splitlines() or ['failed'])[0]}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(2)


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.2f}"

    table = Table(title=f"pipeplan run: {summary['schedule']}, {summary['steps']} steps")
    for column in (
        "stage",
        "replica",
        "rank",
        "compute ms/mb",
        "wait ms/mb",
        "stage ms/mb",
        "predicted ms/mb",
    ):
        table.add_column(column, justify="right")
    for s in summary["stages"]:
        table.add_row(
            str(s["stage"]),
            str(s["replica"]),
            str(s["rank"]),
            ms(s["compute_ms"]),
            ms(s["wait_ms"]),
            ms(s["time_per_minibatch_ms"]),
            ms(s["predicted_time_per_minibatch_ms"]),
        )
    console = Console()
    console.print(table)
    from pipeplan.cli.report import memory_table, print_checkpoints

    console.print(memory_table(summary["stages"], (summary.get("plan") or {}).get("stages")))
    print_checkpoints(summary, console)
    losses = summary["losses"]
    last = f"{losses[-1]:.4f}" if losses else "-"
    rate = summary["samples_per_s"]
    console.print(
        f"final loss {last}; {'-' if rate is None else f'{rate:,.1f}'} samples/s steady "
        f"(predicted {summary['predicted_samples_per_s']:,.1f} samples/s); "
        f"period {ms(summary['time_per_minibatch_ms'])} ms/minibatch "
        f"(predicted {ms(summary['predicted_time_per_minibatch_ms'])} ms)"
    )
    from pipeplan.errors import InputError
    from pipeplan.reporting.run_vs_plan import compare, explain, explain_pipeline

    try:
        result = compare(summary, "run")
    except InputError:  # a figure the comparison refuses (no steady period): nothing to explain
        return
    lines = [explain_pipeline(result), *(explain(stage) for stage in result.flagged)]
    for line in lines:
        if line is not None:
            console.print(line, style="red", markup=False, highlight=False)
