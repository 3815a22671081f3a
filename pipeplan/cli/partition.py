"""``pipeplan partition``: profile + topology -> plan.json, with a table of the stages."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click

from pipeplan.optimizers import OPTIMIZERS
from pipeplan.plan import EXPORT_TARGETS
from pipeplan.planner.costs import COST_MODELS
from pipeplan.planner.recompute import RECOMPUTE_MODES
from pipeplan.schedules import (
    DEFAULT_SCHEDULE,
    DEFAULT_TARGET_SCHEDULE,
    SCHEDULE_NAMES,
    TARGET_SCHEDULES,
    or_list,
    schedule_kind,
)

if TYPE_CHECKING:  # typing only: keeps torch-free imports out of --help
    from pipeplan.plan import Plan, StagePlan
    from pipeplan.planner.auto import SearchResult
    from pipeplan.planner.options import PartitionOptions
    from pipeplan.profile import Profile

__all__ = ["partition", "recompute_text"]


def _load_profile(path: str, batch_size: int) -> Profile:
    from pathlib import Path

    from pipeplan.errors import InputError
    from pipeplan.profile import Profile
    from pipeplan.profiler.pipedream_graph import is_pipedream_graph, parse_pipedream_graph

    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 text (byte {exc.start})") from exc
    if is_pipedream_graph(text):
        return parse_pipedream_graph(text, source=path, batch_size=batch_size)
    return Profile.load(path)


def _layer_text(stage: StagePlan) -> str:
    """``first-last``, with the count when the set is not contiguous (a DAG cut at downsets)."""
    text = f"{stage.layer_start}-{stage.layer_end - 1}"
    gaps = stage.layer_end - stage.layer_start != len(stage.layers)
    return f"{text} ({len(stage.layers)} layers)" if gaps else text


def _print_candidates(found: SearchResult, memory_bytes: int) -> None:
    """The auto search's candidates, the chosen one marked."""
    from rich.console import Console
    from rich.table import Table

    from pipeplan.units import format_bytes

    table = Table(
        title=f"schedule auto: candidates ({format_bytes(memory_bytes)} per device)",
        caption="ms per minibatch simulated with each schedule's bubble; memory per device",
    )
    for column in ("", "schedule", "micro-batches", "v", "ms/minibatch", "peak memory", "fits"):
        table.add_column(column, justify="left" if column in ("", "schedule") else "right")
    for i, c in enumerate(found.candidates):
        chosen = i == found.chosen
        time = f"{c.time_per_minibatch_ms:.3f}" if c.peak_memory_bytes else "-"
        memory = format_bytes(c.peak_memory_bytes) if c.peak_memory_bytes else "-"
        fits = (
            "yes"
            if c.fits
            else ("no" if c.peak_memory_bytes else "pruned" if c.pruned else "no plan (below)")
        )
        style = "bold green" if chosen else None
        table.add_row(
            "*" if chosen else "",
            c.schedule,
            str(c.microbatches),
            str(c.virtual_stages),
            time,
            memory,
            fits,
            style=style,
        )
    console = Console()
    console.print(table)
    for c in found.candidates:
        if not c.peak_memory_bytes and not c.pruned:
            console.print(
                f"no plan for {c.schedule}, {c.microbatches} micro-batches, v={c.virtual_stages}: {c.note}"
            )
    pruned = sum(c.pruned for c in found.candidates)
    if pruned:
        console.print(
            f"pruned: {pruned} candidate(s) proven slower than a fitting plan found before them (their "
            f"bound, or their simulation); not planned further (--every-candidate plans them all)"
        )
    best = found.best
    console.print(
        f"* chosen: {best.schedule}, {best.microbatches} micro-batches, v={best.virtual_stages}: "
        f"the fastest that fits (equal times: fewer micro-batches, then less memory)"
    )


def recompute_text(stage: StagePlan) -> str:
    """A stage's recomputation for a table cell: "2 of 4 layers, +1.20 ms" ("-": none)."""
    from pipeplan.units import format_ms

    if stage.selective_layers:
        return f"selective {len(stage.selective_layers)} of {len(stage.layers)} layers, +{format_ms(stage.recompute_ms)}"
    if not stage.recompute_layers:
        return "-"
    return (
        f"full {len(stage.recompute_layers)} of {len(stage.layers)} layers, +{format_ms(stage.recompute_ms)}"
    )


def shard_text(stage: StagePlan) -> str:
    """``zero1/2`` (mode / replicas sharing) or ``none``."""
    return "none" if stage.shard == "none" else f"{stage.shard}/{stage.shard_degree}"


def offload_text(stage: StagePlan) -> str:
    """A stage's offload for a table cell: "optimizer+params, +3.10 ms" ("-": none)."""
    from pipeplan.units import format_ms

    if stage.offload == "none":
        return "-"
    return f"{stage.offload}, +{format_ms(stage.offload_ms)}"


def offload_note(plan: Plan) -> str:
    """The host link a plan's offloaded stages are priced on, in one line ('' without offload)."""
    from pipeplan.planner.offload import HOST_ADAM_BYTES_PER_S, host_bandwidth, host_link_note

    if all(stage.offload == "none" for stage in plan.stages):
        return ""
    link = host_link_note(plan.topology) or (
        f"offload priced on the topology's host link of {host_bandwidth(plan.topology) / 1e9:g} GB/s"
    )
    return (
        f"{link}; the host steps the optimizer at {HOST_ADAM_BYTES_PER_S / 1e9:g} GB/s of float32 "
        "parameters (fused CPU Adam, one thread); offload's ms per minibatch are in busy/minibatch"
    )


def _print_plan(plan: Plan, estimated: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    from pipeplan.reporting.checkpoint_cost import checkpoint_summary
    from pipeplan.units import format_bytes, format_ms

    shape = f"{plan.schedule}, {plan.microbatches} micro-batches" if plan.microbatches > 1 else plan.schedule
    if plan.virtual_stages > 1:
        shape += f", {plan.virtual_stages} chunks per device"
    degree = plan.stages[0].tensor_parallel
    if degree > 1:
        shape += f", tensor-parallel {degree}" + (
            " + sequence-parallel" if any(s.sequence_parallel for s in plan.stages) else ""
        )
    sharded = any(stage.shard != "none" for stage in plan.stages)
    offloads = any(stage.offload != "none" for stage in plan.stages)
    table = Table(
        title=f"{plan.model} on {plan.topology.name} ({plan.world_size} devices, "
        f"{shape}, {plan.cost_model} cost model)" + (f"\nESTIMATED profile: {estimated}" if estimated else "")
    )
    recomputes = any(stage.recompute_layers or stage.selective_layers for stage in plan.stages)
    for column in (
        "stage",
        "layers",
        "replicas x t" if degree > 1 else "replicas",
        "ranks",
        "compute",
        "comm",
        "all-reduce",
        "busy/minibatch",
        "memory",
        *(("recomputed",) if recomputes else ()),
        *(["shard"] if sharded else []),
        *(["offload"] if offloads else []),
    ):
        table.add_column(column, justify="right" if column not in ("layers", "ranks") else "left")
    for stage in plan.stages:
        ranks = stage.ranks if len(stage.ranks) <= 6 else f"{stage.ranks[0]}..{stage.ranks[-1]}"
        ranks_text = ",".join(map(str, ranks)) if isinstance(ranks, tuple) else ranks
        mark = " *" if stage.index == plan.bottleneck_stage else ""
        table.add_row(
            f"{stage.index}{mark}",
            _layer_text(stage),
            f"{stage.replicas} x {stage.tensor_parallel}" if degree > 1 else str(stage.replicas),
            ranks_text,
            format_ms(stage.compute_ms),
            format_ms(stage.communication_ms),
            format_ms(stage.allreduce_ms),
            format_ms(stage.time_per_minibatch_ms),
            format_bytes(stage.memory_bytes),
            *((recompute_text(stage),) if recomputes else ()),
            *([shard_text(stage)] if sharded else []),
            *([offload_text(stage)] if offloads else []),
        )
    console = Console()
    console.print(table)
    if offloads:
        console.print(offload_note(plan), markup=False, soft_wrap=True)
    if recomputes or plan.recompute != "none":
        console.print(
            f"recomputation ({plan.recompute}): "
            + (
                "recomputed layers (full) or attention cores (selective) run their forward again in "
                "backward (in compute); "
                if recomputes
                else "none needed; "
            )
            + f"device memory {format_bytes(plan.topology.device.memory_bytes)}",
            markup=False,
            soft_wrap=True,
        )
    console.print(f"cut states searched: {plan.cut_family} ({plan.cut_candidates} states)")
    if plan.cost_model == "pipedream":
        # PipeDream's own check (activations + parameters against one device) decided the
        # plan; the memory column is pipeplan's model of the same stages
        memory = plan.topology.device.memory_bytes
        over = [s for s in plan.stages if s.memory_bytes > memory]
        if over:
            worst = max(over, key=lambda s: s.memory_bytes)
            console.print(
                f"warning: {len(over)} stage(s) exceed {format_bytes(memory)} per device by pipeplan's memory model "
                f"(stage {worst.index}: {format_bytes(worst.memory_bytes)}); PipeDream's check (activations + "
                f"parameters) let them through",
                style="yellow",
                markup=False,
                soft_wrap=True,
            )
    p = plan.predicted
    console.print(f"* bottleneck stage; minibatches in flight: {plan.in_flight}")
    how = "simulated with its schedule's bubble" if p.simulated else "the cost model's formula"
    if estimated:
        how += "; ESTIMATED profile"
    console.print(
        f"pipeline {format_ms(p.time_per_minibatch_ms)}/minibatch ({p.samples_per_s:.1f} samples/s, {how}) | "
        f"data parallel {format_ms(p.data_parallel_ms)} (pipeline speed-up {p.speedup_vs_data_parallel:.2f}x) | "
        f"one device {format_ms(p.single_device_ms)} (pipeline speed-up {p.speedup_vs_single_device:.2f}x)"
    )
    console.print(checkpoint_summary(plan), markup=False, soft_wrap=True)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("profile_path", metavar="PROFILE", type=click.Path(dir_okay=False))
@click.option(
    "--topology",
    "topology_arg",
    required=True,
    help="Topology YAML file or preset name (cluster-a, cluster-b, dgx-h100-pod, local-cpu).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default="plan.json",
    show_default=True,
    help="Where to write plan.json.",
)
@click.option(
    "--schedule",
    type=click.Choice([*SCHEDULE_NAMES, "auto"]),
    default=None,
    help="auto: plan every schedule x micro-batch count x virtual stages, keep the fastest that fits. "
    f"[default: {DEFAULT_SCHEDULE}; {DEFAULT_TARGET_SCHEDULE} with --for]",
)
@click.option(
    "--for",
    "export_target",
    type=click.Choice(EXPORT_TARGETS),
    default=None,
    help="Only cuts this engine can express (`pipeplan export --to` it): one device per stage, "
    "a flush schedule; prints the best unrestricted plan's time beside it.",
)
@click.option("--cost-model", type=click.Choice(COST_MODELS), default=COST_MODELS[0], show_default=True)
@click.option(
    "--optimizer",
    type=click.Choice(OPTIMIZERS),
    default="sgd",
    show_default=True,
    help="The optimizer the run will use: its state counts in memory, its step in time.",
)
@click.option("--straight", is_flag=True, help="No replication: one device per stage.")
@click.option("--max-stages", type=int, default=None, help="At most this many pipeline stages.")
@click.option("--use-fewer-devices", is_flag=True, help="Allow plans that leave devices idle when faster.")
@click.option(
    "--microbatches",
    type=int,
    default=1,
    show_default=True,
    help="Micro-batches per minibatch (every schedule but 1f1b-rr; auto tries several when 1).",
)
@click.option(
    "--virtual-stages",
    type=int,
    default=None,
    help="interleaved-1f1b: model chunks per device (default: the planner picks).",
)
@click.option(
    "--uniform/--no-uniform",
    default=None,
    help="Flush schedules: also try uniform plans (p balanced stages x d replicas, Megatron's shape) and keep the fastest simulated [default: on for profiles with tensor-parallel layers].",
)
@click.option(
    "--tensor-parallel",
    "tensor_parallel",
    default="auto",
    show_default=True,
    help="Tensor-parallel degree t of every stage (devices of the innermost level per replica), or auto: the planner picks among those the profile's splitting layers and the topology allow.",
)
@click.option(
    "--recompute",
    type=click.Choice(RECOMPUTE_MODES),
    default="auto",
    show_default=True,
    help="Activation recomputation per stage (torch.utils.checkpoint on chosen layers; 1f1b-flush and gpipe): auto chooses with the split, per stage, the fastest that fits of none, selective and the fewest layers recomputed whole; none never; selective the attention core of every transformer block (Korthikanti et al.); full every layer that frees memory.",
)
@click.option(
    "--sequence-parallel",
    "sequence_parallel",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="Megatron's sequence parallelism of tensor-parallel stages (layer norms and dropouts sharded over the sequence, activations and their time / t; reduce-scatter + all-gather instead of all-reduce, same bytes): auto on wherever t > 1 for estimated profiles (measured ones: only with on, as DTensor's linear saves its all-gathered input whole), on (needs t > 1), off.",
)
@click.option(
    "--shard",
    type=click.Choice(["auto", "none", "zero1", "zero2", "fsdp"]),
    default="auto",
    show_default=True,
    help="How a stage's replicas on one unit of the innermost level shard: none, zero1 (optimizer "
    "state / d), zero2 (+ gradients and masters / d), fsdp (+ parameters / d, gathered per layer); "
    "auto: per stage the fastest that fits among those pipeplan run runs for the plan (none and zero1 "
    "everywhere; zero2 and fsdp on float32 gpipe / 1f1b-flush plans of one topology level), less sharding on ties.",
)
@click.option(
    "--offload",
    type=click.Choice(["auto", "none", "optimizer", "all"]),
    default="auto",
    show_default=True,
    help="Offload of sharded replicas' state to host memory, priced on the topology's host_link "
    "(else an assumed 25 GB/s): optimizer (optimizer state and masters; planned, not run), all "
    "(parameters too, FSDP2 CPUOffloadPolicy on zero2/fsdp); auto: per stage where it is the fastest "
    "that fits, among what pipeplan run runs (all, on zero2/fsdp); never on a CPU topology.",
)
@click.option(
    "--memory-check/--no-memory-check",
    default=True,
    show_default=True,
    help="Drop stages that do not fit device memory.",
)
@click.option(
    "--activation-compression",
    type=float,
    default=None,
    help="PipeDream mode: count activation transfers, divided by this ratio.",
)
@click.option(
    "--every-candidate",
    is_flag=True,
    default=False,
    help="--schedule auto: plan every candidate in full, for each one's time and memory in the table "
    "(slower; by default a candidate proven slower than a plan already found is pruned).",
)
@click.option(
    "--batch-size",
    type=int,
    default=64,
    show_default=True,
    help="Samples per minibatch of a PipeDream graph.txt (a profile.json has its own).",
)
def partition(
    profile_path: str,
    topology_arg: str,
    output: str,
    schedule: str | None,
    export_target: str | None,
    cost_model: str,
    optimizer: str,
    straight: bool,
    max_stages: int | None,
    use_fewer_devices: bool,
    microbatches: int,
    virtual_stages: int | None,
    uniform: bool | None,
    tensor_parallel: str,
    shard: str,
    offload: str,
    memory_check: bool,
    activation_compression: float | None,
    batch_size: int,
    recompute: str,
    sequence_parallel: str,
    every_candidate: bool,
) -> None:
    """Split a profiled model into pipeline stages for a topology (PipeDream's DP).

    PROFILE is a pipeplan profile.json or a PipeDream graph.txt (detected by content).

    \b
    pipeplan partition profile.json --topology cluster.yaml -o plan.json
    pipeplan partition profile.json --topology local-cpu --schedule 1f1b-flush --microbatches 4
    pipeplan partition vgg16/graph.txt --topology cluster-a --cost-model pipedream
    pipeplan partition gpt-a100.json --topology megatron.yaml --schedule auto --tensor-parallel 8
    pipeplan partition profile.json --topology local-cpu --for pipelining --microbatches 4
    """
    from pipeplan.errors import InputError
    from pipeplan.planner.partition import PartitionOptions
    from pipeplan.planner.partition import partition as run_partition
    from pipeplan.topology import resolve

    if batch_size < 1:
        raise InputError(f"--batch-size must be >= 1 (got {batch_size})")
    if tensor_parallel != "auto" and not tensor_parallel.isdigit():
        raise InputError(f"--tensor-parallel must be a positive integer or auto (got {tensor_parallel!r})")
    if schedule is None:
        schedule = DEFAULT_TARGET_SCHEDULE if export_target else DEFAULT_SCHEDULE
    if export_target and schedule == "auto":
        raise InputError(
            f"--for {export_target} plans {or_list(TARGET_SCHEDULES)}: pass one with --schedule, not auto"
        )
    profile = _load_profile(profile_path, batch_size)
    topology = resolve(topology_arg)
    options = PartitionOptions(
        schedule=DEFAULT_SCHEDULE
        if schedule == "auto"
        else schedule,  # auto: a placeholder, search sets each
        cost_model=cost_model,
        optimizer=optimizer,
        straight=straight or export_target is not None,
        max_stages=max_stages,
        export_target=export_target,
        use_fewer_devices=use_fewer_devices,
        microbatches=microbatches,
        memory_check=memory_check,
        activation_compression_ratio=activation_compression,
        virtual_stages=virtual_stages,
        tensor_parallel=None if tensor_parallel == "auto" else int(tensor_parallel),
        uniform=uniform,
        recompute=recompute,
        shard=shard,
        sequence_parallel=sequence_parallel,
        offload=offload,
    )
    if schedule == "auto":
        from pipeplan.planner.auto import search

        found = search(profile, topology, options, every_candidate=every_candidate)
        _print_candidates(found, topology.device.memory_bytes)
        plan = found.plan
    else:
        plan = run_partition(profile, topology, options)
    unrestricted = _unrestricted(profile, topology, options) if export_target else None
    plan.save(output)
    _print_plan(plan, profile.estimated)
    if schedule == "auto" or schedule_kind(plan.schedule).split_backward:
        from pipeplan.planner.simulate import backward_split_note

        click.echo(backward_split_note(profile))
    from pipeplan.planner.reliability import prediction_warnings, preset_overhead_note

    for line in prediction_warnings(profile, plan):
        click.secho(f"warning: {line}", fg="yellow")
    note = None if os.path.exists(topology_arg) else preset_overhead_note(topology_arg, plan)
    if note is not None:
        click.echo(f"note: {note}")
    if export_target:
        _print_price(plan, unrestricted)
    click.echo(f"wrote {output}")


def _unrestricted(profile: Profile, topology: object, options: PartitionOptions) -> Plan | str:
    """The best plan without ``--for`` (same schedule and options), or why there is none."""
    from dataclasses import replace

    from pipeplan.errors import PipeplanError
    from pipeplan.planner.partition import partition as run_partition

    try:
        return run_partition(profile, topology, replace(options, export_target=None))  # type: ignore[arg-type]
    except PipeplanError as exc:
        return str(exc)


def _print_price(plan: Plan, unrestricted: Plan | str | None) -> None:
    """The restricted plan's predicted time beside the best unrestricted one's (ms per minibatch)."""
    from pipeplan.planner.targets import ENGINES

    ours = plan.predicted.time_per_minibatch_ms
    line = (
        f"--for {plan.export_target}: {ours:.3f} ms/minibatch predicted with the cuts "
        f"{ENGINES[plan.export_target or '']} can express"
    )
    if isinstance(unrestricted, str) or unrestricted is None:
        click.echo(f"{line}; no unrestricted plan to compare ({unrestricted})")
        return
    best = unrestricted.predicted.time_per_minibatch_ms
    cost = f", {(ours / best - 1.0) * 100.0:+.1f}%" if best > 0 else ""
    click.echo(
        f"{line}; the best plan with any cut (same schedule, one device per stage): "
        f"{best:.3f} ms/minibatch{cost}"
    )
