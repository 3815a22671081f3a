"""``pipeplan simulate``: predicted timeline, bubbles and memory of a plan per schedule."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeplan.schedules import SCHEDULE_NAMES

if TYPE_CHECKING:
    from rich.table import Table

    from pipeplan.plan import Plan
    from pipeplan.planner.simulate import SimResult

__all__ = ["simulate"]

GIB = 2**30


@click.command(
    "simulate",
    epilog="""\b
Examples:
  pipeplan simulate plan.json --profile profile.json
  pipeplan simulate plan.json --profile profile.json --timeline timeline.svg
  pipeplan simulate plan.json --profile profile.json --timeline trace.json   # Perfetto
  pipeplan simulate plan.json --profile profile.json -s 1f1b-rr -s gpipe -m 8
""",
)
@click.argument("plan_path", metavar="PLAN.json", type=click.Path(dir_okay=False))
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Profile the plan was made from (per-layer times and bytes). Without it "
    "the plan's per-stage figures are used (forward:backward = 1:2).",
)
@click.option(
    "--schedule",
    "-s",
    "schedules",
    multiple=True,
    type=click.Choice([*SCHEDULE_NAMES, "all"]),
    help="Schedule(s) to simulate side by side (repeatable; default: the plan's). "
    "interleaved-1f1b on a one-chunk plan re-cuts it into 2 chunks per device "
    "(needs --profile).",
)
@click.option(
    "--microbatches",
    "-m",
    type=int,
    default=None,
    help="Micro-batches per minibatch for schedules that split minibatches (default: "
    "the plan's when it uses one, else twice the stage count).",
)
@click.option(
    "--steady",
    type=click.IntRange(1, 1000),
    default=8,
    show_default=True,
    help="Minibatches per replica in the steady-state window.",
)
@click.option(
    "--timeline",
    "timeline_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the timeline: .svg/.png image or .json Chrome trace. With several "
    "schedules, one file each: NAME-<schedule>.EXT.",
)
def simulate(
    plan_path: str,
    profile_path: str | None,
    schedules: tuple[str, ...],
    microbatches: int | None,
    steady: int,
    timeline_path: str | None,
) -> None:
    """Simulate PLAN.json: per stage busy, idle, bubble % and memory, per schedule."""
    from rich.console import Console

    from pipeplan.errors import InputError
    from pipeplan.plan import Plan
    from pipeplan.planner.simulate import backward_split_note, simulate_plan
    from pipeplan.profile import Profile
    from pipeplan.reporting.checkpoint_cost import checkpoint_summary
    from pipeplan.reporting.timeline import TIMELINE_SUFFIXES, write_timeline
    from pipeplan.schedules import schedule_kind

    console = Console()
    plan = Plan.load(plan_path)
    profile = Profile.load(profile_path) if profile_path else None
    if profile is not None and profile.estimated:
        console.print(
            f"ESTIMATED profile (every figure below rests on it): {profile.estimated}", markup=False
        )
    if profile is None:
        console.print(
            "[yellow]no --profile: costs from the plan's per-stage figures "
            "(forward:backward = 1:2, a micro-batch's time proportional to its samples), memory from the plan[/]"
        )
    else:
        from pipeplan.planner.reliability import prediction_warnings

        for line in prediction_warnings(profile, plan):
            console.print(f"warning: {line}", style="yellow", markup=False, soft_wrap=True)
    names = list(SCHEDULE_NAMES) if "all" in schedules else list(dict.fromkeys(schedules or [plan.schedule]))
    if any(schedule_kind(name).split_backward for name in names):
        console.print(backward_split_note(profile), markup=False, soft_wrap=True)
    if microbatches is not None and microbatches < 1:
        raise InputError(f"--microbatches must be >= 1 (got {microbatches})")
    if timeline_path and Path(timeline_path).suffix.lower() not in TIMELINE_SUFFIXES:
        raise InputError(f"--timeline {timeline_path}: expected a {', '.join(TIMELINE_SUFFIXES)} file")
    results = []
    for name in names:
        kind = schedule_kind(name)
        micro = microbatches
        if micro is None and not kind.whole_minibatches:
            micro = (
                plan.microbatches if plan.schedule == name and plan.microbatches > 1 else 2 * len(plan.stages)
            )
        shown = plan
        if kind.virtual_stages and plan.virtual_stages == 1:
            if profile is None:
                console.print(f"[yellow]{name}: skipped, re-cutting the plan into chunks needs --profile[/]")
                continue
            from pipeplan.planner.interleave import rechunk

            try:
                shown = rechunk(plan, profile, name, 2, micro)
            except InputError as exc:
                console.print(f"[yellow]{name}: skipped, {exc}[/]")
                continue
        elif plan.virtual_stages > 1 and not kind.virtual_stages:
            console.print(
                f"[yellow]{name}: skipped, the plan runs {plan.virtual_stages} chunks per device[/]"
            )
            continue
        result = simulate_plan(shown, profile, name, micro, steady, record=bool(timeline_path))
        results.append(result)
        console.print(_stage_table(shown, result))
        if timeline_path:
            target = Path(timeline_path)
            if len(names) > 1:
                target = target.with_name(f"{target.stem}-{name}{target.suffix}")
            write_timeline(
                target,
                result.events(),
                metadata={
                    "source": "simulator",
                    "schedule": name,
                    "plan": str(plan_path),
                    "microbatches": result.microbatches,
                    "time_per_minibatch_ms": result.time_per_minibatch_ms,
                },
                title=f"{name}: {result.time_per_minibatch_ms:.2f} ms/minibatch (simulated)",
            )
            console.print(f"timeline written to {target}")
    console.print(_summary_table(plan, results))
    own = [r for r in results if r.schedule == plan.schedule]
    period = own[0].time_per_minibatch_ms if own else None
    console.print(checkpoint_summary(plan, period), markup=False, soft_wrap=True)


def _stage_table(plan: Plan, result: SimResult) -> Table:  # noqa: F821
    from rich.table import Table

    from pipeplan.cli.partition import offload_text, recompute_text, shard_text

    recomputes = any(stage.recompute_layers or stage.selective_layers for stage in plan.stages)
    sequence_parallel = any(stage.sequence_parallel for stage in plan.stages)
    micro = f", {result.microbatches} micro-batches" if result.microbatches > 1 else ""
    if result.virtual_stages > 1:
        micro += f", {result.virtual_stages} chunks per device"
    table = Table(
        title=f"{result.schedule}{micro}: {result.time_per_minibatch_ms:.3f} ms/minibatch, "
        f"{result.samples_per_s:.1f} samples/s (simulated)",
        caption="busy/idle/link: ms per minibatch, per replica; in flight: minibatches; device memory "
        f"{result.memory_limit_bytes / GIB:.3f} GiB"
        + (
            "; recomputed: layers (full) or attention cores (selective) run again in backward, ms per "
            "minibatch in busy"
            if recomputes
            else ""
        )
        + ("; seq-par: sequence-parallel tensor-parallel group" if sequence_parallel else "")
        + (
            "; offload: host-link copies and host optimizer step, ms per minibatch in busy"
            if any(stage.offload != "none" for stage in plan.stages)
            else ""
        ),
    )
    # times are ms per minibatch of the pipeline, per replica; in flight in minibatches
    sharded = any(stage.shard != "none" for stage in plan.stages)
    offloads = any(stage.offload != "none" for stage in plan.stages)
    for header in (
        "stage",
        "repl",
        "layers",
        "busy ms",
        "idle ms",
        "bubble %",
        "link ms",
        "memory GiB",
        "in flight",
        *(("recomputed",) if recomputes else ()),
        *(["shard"] if sharded else []),
        *(["seq-par"] if sequence_parallel else []),
        *(["offload"] if offloads else []),
    ):
        table.add_column(header, justify="right")
    limit = result.memory_limit_bytes
    for stage, sim in zip(plan.stages, result.stages):
        memory = f"{sim.memory_bytes / GIB:.3f}"
        if sim.memory_bytes > limit:
            memory = f"[red]{memory} > {limit / GIB:.1f}[/]"
        table.add_row(
            str(sim.stage),
            str(sim.replicas),
            f"{stage.layer_start}-{stage.layer_end - 1}",
            f"{sim.busy_ms:.3f}",
            f"{sim.idle_ms:.3f}",
            f"{100 * sim.bubble_fraction:.1f}",
            f"{sim.comm_ms:.3f}",
            memory,
            f"{sim.in_flight:g}",
            *((recompute_text(stage),) if recomputes else ()),
            *([shard_text(stage)] if sharded else []),
            *(
                [f"{stage.tensor_parallel}-way" if stage.sequence_parallel else "-"]
                if sequence_parallel
                else []
            ),
            *([offload_text(stage)] if offloads else []),
        )
    return table


def _summary_table(plan: Plan, results: list) -> Table:  # noqa: F821
    from rich.table import Table

    table = Table(
        title=f"schedules for {len(plan.stages)} stages on {plan.world_size} devices "
        f"(plan predicts {plan.predicted.time_per_minibatch_ms:.3f} ms/minibatch "
        f"with {plan.schedule})"
    )
    for header in (
        "schedule",
        "micro",
        "ms/minibatch",
        "samples/s",
        "x plan",
        "max bubble %",
        "peak GiB",
        "fits",
    ):
        table.add_column(header, justify="right")
    best = min(r.time_per_minibatch_ms for r in results)
    for r in results:
        ratio = r.time_per_minibatch_ms / plan.predicted.time_per_minibatch_ms
        mark = "[bold green]" if r.time_per_minibatch_ms == best else ""
        table.add_row(
            f"{mark}{r.schedule}",
            str(r.microbatches),
            f"{r.time_per_minibatch_ms:.3f}",
            f"{r.samples_per_s:.1f}",
            f"{ratio:.3f}",
            f"{100 * max(s.bubble_fraction for s in r.stages):.1f}",
            f"{r.peak_memory_bytes / GIB:.3f}",
            "yes" if r.fits_memory else "[red]no[/]",
        )
    return table
