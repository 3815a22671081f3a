"""``pipeplan report``: predicted vs measured time per minibatch, per stage."""

from __future__ import annotations

import click

__all__ = ["report"]


@click.command(
    "report",
    epilog="""\b
Examples:
  pipeplan report metrics.json
  pipeplan report metrics.json --strict    # exit 1 when a stage is off by > 20 %
""",
)
@click.argument("metrics_path", metavar="METRICS.json", type=click.Path(dir_okay=False))
@click.option("--strict", is_flag=True, help="Exit with status 1 when a stage is flagged.")
def report(metrics_path: str, strict: bool) -> None:
    """Compare the plan's predictions with what `pipeplan run` measured (METRICS.json).

    A stage whose measured time per minibatch is more than 20 % away from the
    prediction is flagged.
    """
    from rich.console import Console
    from rich.table import Table

    from pipeplan.planner.report import OFF_THRESHOLD, Comparison, load_report

    result = load_report(metrics_path)
    console = Console()

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def ratio(pair: Comparison) -> str:
        if pair.ratio is None:
            return "-"
        text = f"{pair.ratio:.2f}"
        return f"[bold red]{text}[/]" if pair.off else text

    summary = Table(title=f"{metrics_path}: {result.schedule}")
    for header in ("", "predicted (ms/minibatch)", "measured (ms/minibatch)", "measured / predicted"):
        summary.add_column(header, justify="right")
    summary.add_row("pipeline", ms(result.time_per_minibatch.predicted_ms),
                    ms(result.time_per_minibatch.measured_ms), ratio(result.time_per_minibatch))
    console.print(summary)
    if result.predicted_for:
        console.print(f"predictions are for the schedule that ran: {result.predicted_for}")
    if result.samples_per_s is not None:
        console.print(f"measured throughput: {result.samples_per_s:.1f} samples/s")
    if result.losses:
        console.print(f"loss: {result.losses[0]:.4f} (first) -> {result.losses[-1]:.4f} (last), "
                      f"{len(result.losses)} steps")

    table = Table(title="per stage replica (ms per minibatch)")
    for header in ("stage", "replica", "rank", "predicted ms", "measured ms", "ratio",
                   "predicted compute ms", "measured compute ms", "compute ratio", "wait ms", ""):
        table.add_column(header, justify="right")
    for s in result.stages:
        flag = f"[bold red]off by > {OFF_THRESHOLD:.0%}[/]" if s.time_per_minibatch.off else ""
        table.add_row(str(s.stage), str(s.replica), str(s.rank),
                      ms(s.time_per_minibatch.predicted_ms), ms(s.time_per_minibatch.measured_ms),
                      ratio(s.time_per_minibatch), ms(s.compute.predicted_ms),
                      ms(s.compute.measured_ms), ratio(s.compute), ms(s.wait_ms), flag)
    console.print(table)
    flagged = result.flagged
    if flagged:
        names = ", ".join(f"stage {s.stage} replica {s.replica} ({s.time_per_minibatch.ratio:.2f}x)"
                          for s in flagged)
        console.print(f"[bold red]{len(flagged)} stage replica(s) off by more than "
                      f"{OFF_THRESHOLD:.0%}:[/] {names}")
        if strict:
            raise SystemExit(1)
    else:
        console.print(f"every stage within {OFF_THRESHOLD:.0%} of its prediction")
