"""``pipeplan report``: predicted vs measured time per minibatch and memory, per stage; the loss curve as PNG."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:  # typing only: rich stays out of --help
    from rich.console import Console

__all__ = ["report", "memory_table", "print_checkpoints"]


@click.command(
    "report",
    epilog="""\b
Examples:
  pipeplan report metrics.json
  pipeplan report metrics.json --strict    # exit 1 when the pipeline or a stage is off by > 20 %
  pipeplan report runs/first --plot loss.png   # a --log-dir: loss and lr per step
""",
)
@click.argument("metrics_path", metavar="METRICS", type=click.Path())
@click.option("--strict", is_flag=True, help="Exit with status 1 when the pipeline or a stage is flagged.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the loss curve (and the learning rate, from a --log-dir) as a PNG.",
)
def report(metrics_path: str, strict: bool, plot_path: str | None) -> None:
    """Compare the plan's predictions with what `pipeplan run` measured (METRICS.json),
    or summarise a run's --log-dir (METRICS: the folder or its metrics.jsonl).

    A stage whose measured time per minibatch is more than 20 % away from the
    prediction is flagged, and so is the pipeline's period (its stages may each be
    within while the time between them is not).
    """
    from pathlib import Path

    from rich.console import Console

    from pipeplan.errors import InputError

    if plot_path is not None and Path(plot_path).suffix.lower() != ".png":
        raise InputError(f"--plot {plot_path}: expected a .png file")
    console = Console()
    is_log = Path(metrics_path).is_dir() or metrics_path.endswith(".jsonl")
    flagged = False
    if is_log:
        _log_summary(metrics_path, console)
    else:
        flagged = _compare(metrics_path, console)
    if plot_path is not None:
        from pipeplan.jsonio import write_atomic
        from pipeplan.runtime.curves import draw_curve, read_curve

        write_atomic(plot_path, draw_curve(read_curve(metrics_path)))
        console.print(f"loss curve written to {plot_path}")
    if strict and flagged:
        raise SystemExit(1)


def _log_summary(path: str, console: Console) -> None:
    """One line per fact of a --log-dir: steps, loss, lr, gradient norm, samples/s."""
    from pipeplan.runtime.curves import read_curve

    curve = read_curve(path)

    def ends(values: tuple[float | None, ...], digits: str) -> str:
        known = [v for v in values if v is not None]
        return f"{known[0]:{digits}} (first) -> {known[-1]:{digits}} (last)" if known else "-"

    rates = [v for v in curve.samples_per_s if v is not None]
    lines = [
        f"{curve.source}: steps {curve.steps[0]}-{curve.steps[-1]} ({len(curve.steps)} logged)",
        f"loss: {ends(curve.losses, '.4f')}",
        f"learning rate: {ends(curve.lrs, '.3g')}",
        f"gradient norm (before clipping): {ends(curve.grad_norms, '.4g')}",
        f"throughput: median {sorted(rates)[len(rates) // 2]:,.1f} samples/s" if rates else "throughput: -",
    ]
    for line in lines:
        console.print(line)


def _compare(metrics_path: str, console: Console) -> bool:
    """The predicted-vs-measured tables; True when the pipeline or a stage is flagged."""
    from rich.table import Table

    from pipeplan.reporting.run_vs_plan import (
        OFF_THRESHOLD,
        Comparison,
        compare,
        explain,
        explain_pipeline,
        read_metrics,
    )

    metrics = read_metrics(metrics_path)
    result = compare(metrics, where=metrics_path)

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
    summary.add_row(
        "pipeline",
        ms(result.time_per_minibatch.predicted_ms),
        ms(result.time_per_minibatch.measured_ms),
        ratio(result.time_per_minibatch),
    )
    console.print(summary)
    if result.predicted_for:
        console.print(f"predictions are for the schedule that ran: {result.predicted_for}")
    if result.samples_per_s is not None:
        console.print(f"measured throughput: {result.samples_per_s:.1f} samples/s")
    if result.losses:
        console.print(
            f"loss: {result.losses[0]:.4f} (first) -> {result.losses[-1]:.4f} (last), "
            f"{len(result.losses)} steps"
        )

    table = Table(title="per stage replica (ms per minibatch)")
    for header in (
        "stage",
        "replica",
        "rank",
        "predicted ms",
        "measured ms",
        "ratio",
        "predicted compute ms",
        "measured compute ms",
        "compute ratio",
        "wait ms",
        "",
    ):
        table.add_column(header, justify="right")
    for s in result.stages:
        flag = f"[bold red]off by > {OFF_THRESHOLD:.0%}[/]" if s.time_per_minibatch.off else ""
        table.add_row(
            str(s.stage),
            str(s.replica),
            str(s.rank),
            ms(s.time_per_minibatch.predicted_ms),
            ms(s.time_per_minibatch.measured_ms),
            ratio(s.time_per_minibatch),
            ms(s.compute.predicted_ms),
            ms(s.compute.measured_ms),
            ratio(s.compute),
            ms(s.wait_ms),
            flag,
        )
    console.print(table)
    if any(s.peak_memory_bytes is not None for s in metrics.stages):  # metrics/2
        console.print(memory_table(metrics.to_dict()["stages"], (metrics.plan or {}).get("stages")))
    for line in recompute_lines(metrics.plan or {}) + offload_lines(metrics.plan or {}):
        console.print(line, markup=False, soft_wrap=True)
    print_checkpoints(metrics.to_dict(), console)
    pipeline = explain_pipeline(result)
    if pipeline is not None:
        console.print(pipeline, markup=False, highlight=False)
    flagged = result.flagged
    if flagged:
        names = ", ".join(
            f"stage {s.stage} replica {s.replica} ({s.time_per_minibatch.ratio:.2f}x)" for s in flagged
        )
        console.print(
            f"[bold red]{len(flagged)} stage replica(s) off by more than {OFF_THRESHOLD:.0%}:[/] {names}"
        )
        for stage in flagged:
            console.print(explain(stage), markup=False, highlight=False)
        return True
    console.print(f"every stage within {OFF_THRESHOLD:.0%} of its prediction")
    return pipeline is not None


def recompute_lines(plan: Mapping[str, Any]) -> list[str]:
    """One line per stage of the run's plan that recomputes layers (``StagePlan.recompute_layers``,
    ``selective_layers``) or runs sequence parallelism: how many, the time they cost (in its
    predicted compute) and its memory against the device's."""
    from pipeplan.units import format_bytes, format_ms

    device = plan.get("topology", {}).get("device", {}).get("memory_bytes")
    out = []
    for stage in plan.get("stages", []):
        full, selective = stage.get("recompute_layers") or [], stage.get("selective_layers") or []
        what = (
            f"recomputes {len(full)} of {len(stage.get('layers', []))} layers"
            if full
            else f"recomputes the attention core of {len(selective)} of {len(stage.get('layers', []))} layers (selective)"
        )
        sequence = (
            f", sequence-parallel over {stage.get('tensor_parallel', 1)}"
            if stage.get("sequence_parallel")
            else ""
        )
        if full or selective:
            out.append(
                f"stage {stage['index']} {what}{sequence}: "
                f"+{format_ms(float(stage.get('recompute_ms', 0.0)))} per minibatch (in its predicted compute), "
                f"planned memory {format_bytes(int(stage['memory_bytes']))}"
                + (f" of {format_bytes(int(device))} per device" if device else "")
            )
        elif sequence:
            out.append(
                f"stage {stage['index']}{sequence.replace(',', '', 1)}: planned memory "
                f"{format_bytes(int(stage['memory_bytes']))}"
                + (f" of {format_bytes(int(device))} per device" if device else "")
            )
    return out


def offload_lines(plan: Mapping[str, Any]) -> list[str]:
    """One line per stage of the run's plan that offloads to host memory (``StagePlan.offload``):
    what, the ms it adds per minibatch (in its predicted time) and its memory against the device's."""
    from pipeplan.units import format_bytes, format_ms

    device = plan.get("topology", {}).get("device", {}).get("memory_bytes")
    return [
        f"stage {stage['index']} offloads {stage['offload']} to host memory: "
        f"+{format_ms(float(stage.get('offload_ms', 0.0)))} per minibatch (host-link copies and host "
        f"optimizer step, in its predicted time), planned memory {format_bytes(int(stage['memory_bytes']))}"
        + (f" of {format_bytes(int(device))} per device" if device else "")
        for stage in plan.get("stages", [])
        if stage.get("offload", "none") != "none"
    ]


def memory_table(stages: list[dict[str, Any]], plan_stages: list[dict[str, Any]] | None = None) -> Any:
    """Per rank: the plan's per-device figure against what the rank held for its stage
    (peak - baseline - set-up), the set-up and the fixed part shown apart; where the ranks
    counted their live tensors (CPU), those they held beside it, which the plan predicts
    without the allocator's caching; with ``plan_stages`` (the plan's, as JSON) a ``shard``
    column where a stage shards its replicas."""
    from rich.table import Table

    from pipeplan.metrics import StageMetrics
    from pipeplan.units import format_bytes

    def size(value: int | None) -> str:
        return "-" if value is None else format_bytes(value)

    def ratio(value: int | None, planned: int | None) -> str:
        return f"{value / planned:.2f}" if value is not None and planned else "-"

    kinds = {s.get("memory_kind") for s in stages} - {None}
    what = "GPU: torch.cuda max_memory_allocated" if kinds == {"cuda_allocated"} else "CPU: the process's RSS"
    shards = {p["index"]: p for p in plan_stages or [] if p.get("shard", "none") != "none"}
    counted = any(s.get("tensor_held_bytes") is not None for s in stages)
    tensors_note = (
        "; tensors: the most bytes of live tensors at once over the first steps, the stage's "
        "parameters and what the steps made (what the plan predicts; RSS also holds what the "
        "allocator keeps of freed memory)"
        if counted
        else ""
    )
    table = Table(
        title=f"memory per rank ({what}; held = peak - baseline - set-up; set-up: held before the first "
        "step beyond the stage's parameters (the build, minibatches drawn ahead, communication); fixed: "
        f"of the baseline, a first step's own cost, measured on a tiny model{tensors_note})"
    )
    columns = ["stage", "replica", "rank", "planned"]
    columns += ["tensors", "tensors/planned"] if counted else []
    columns += ["held", "held/planned", "set-up", "fixed", "peak", "baseline"]
    for column in columns:
        table.add_column(column, justify="right")
    if shards:
        table.add_column("shard", justify="right")
    for s in stages:
        planned = s.get("predicted_memory_bytes")
        held = StageMetrics.from_dict(s, "stage").held_memory_bytes
        tensors = s.get("tensor_held_bytes")
        table.add_row(
            str(s["stage"]),
            str(s["replica"]),
            str(s["rank"]),
            size(planned),
            *([size(tensors), ratio(tensors, planned)] if counted else []),
            size(held),
            ratio(held, planned),
            size(s.get("setup_memory_bytes")),
            size(s.get("overhead_memory_bytes")),
            size(s.get("peak_memory_bytes")),
            size(s.get("baseline_memory_bytes")),
            *([_shard_cell(shards.get(s["stage"]))] if shards else []),
        )
    return table


def _shard_cell(stage: dict[str, Any] | None) -> str:
    """``zero1/2`` (mode / replicas sharing) of a plan stage as JSON, ``none`` without."""
    return "none" if stage is None else f"{stage['shard']}/{stage['shard_degree']}"


def print_checkpoints(summary: dict[str, Any], console: Console) -> None:
    """Per rank: what its checkpoints cost (stall, wait, persist, bytes, overhead), then the
    interval and the start-to-first-step time; nothing for a run without checkpoints."""
    from rich.table import Table

    from pipeplan.units import format_bytes

    def per(total: float | None, count: int) -> str:  # ms per checkpoint
        return "-" if total is None or not count else f"{total / count:,.1f}"

    stages = [s for s in summary["stages"] if s.get("checkpoints")]
    if stages:
        mode = summary.get("checkpoint_mode") or "?"
        table = Table(
            title=f"checkpoints per rank ({mode}; ms per checkpoint, overhead = stall / training time)"
        )
        for column in ("stage", "replica", "rank", "checkpoints", "stall ms", "of it wait ms", "persist ms"):
            table.add_column(column, justify="right")
        table.add_column("written", justify="right")
        table.add_column("overhead %", justify="right")
        for s in stages:
            count, overhead = s["checkpoints"], s.get("checkpoint_overhead_pct")
            table.add_row(
                str(s["stage"]),
                str(s["replica"]),
                str(s["rank"]),
                str(count),
                per(s.get("checkpoint_stall_ms"), count),
                per(s.get("checkpoint_wait_ms"), count),
                per(s.get("checkpoint_persist_ms"), count),
                "-" if s.get("checkpoint_bytes") is None else format_bytes(s["checkpoint_bytes"]),
                "-" if overhead is None else f"{overhead:.2f}",
            )
        console.print(table)
        every, predicted = summary.get("checkpoint_every"), summary.get("predicted_checkpoint_overhead_pct")
        if every:
            guess = "" if predicted is None else f" (auto; predicted overhead {predicted:.2f}%)"
            console.print(f"checkpoint interval: every {every} steps{guess}")
    first = summary.get("start_to_first_step_ms")
    if first is not None:
        what = "restart to the first resumed step" if summary.get("first_step") else "start to the first step"
        console.print(f"{what}: {first / 1000.0:,.2f} s")
