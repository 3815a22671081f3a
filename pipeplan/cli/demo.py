"""``pipeplan demo``: the whole flow on this machine, profile -> partition -> simulate -> run.

Each step is the very command a user would type, run as a child process and echoed
first, so the demo doubles as a transcript of the tutorial. The run goes through
torchrun's own launcher (``python -m torch.distributed.run``), never a home-made one.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import click

from pipeplan.errors import RuntimeFailure
from pipeplan.modelfile import BUNDLED_MODELS

__all__ = ["demo"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_step(title: str, argv: list[str], env: dict[str, str], timeout_s: float, quiet: bool = False) -> None:
    """Echo ``argv`` as a shell line, run it, stream its output (``quiet``: keep it, and give
    its last line only in the error if it fails); fail with one line."""
    from rich.console import Console

    console = Console()
    shown = " ".join(shlex.quote(a) for a in argv)
    shown = shown.replace(shlex.quote(sys.executable) + " -m pipeplan", "pipeplan")
    shown = shown.replace(shlex.quote(sys.executable) + " -m torch.distributed.run", "torchrun")
    console.rule(f"[bold]{title}")
    console.print(f"[dim]$ {shown}[/dim]", highlight=False)
    started = time.perf_counter()
    try:
        completed = subprocess.run(argv, env=env, timeout=timeout_s, capture_output=quiet, text=quiet)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeFailure(f"{title}: did not finish within {timeout_s:.0f} s") from exc
    if completed.returncode != 0:
        said = (completed.stderr or "").strip().splitlines() if quiet else []
        reason = f" ({said[-1]})" if said else ""
        raise RuntimeFailure(f"{title} failed with exit code {completed.returncode}{reason}: {shown}")
    console.print(f"[dim]({title}: {time.perf_counter() - started:.1f} s)[/dim]")


@click.command(
    epilog="""\b
Examples:
  pipeplan demo                       # bundled MLP, 2 CPU workers, 20 steps
  pipeplan demo --model gpt --steps 10
  pipeplan demo --model ./my_model.py --out-dir /tmp/demo
"""
)
@click.option(
    "--model",
    default="mlp",
    show_default=True,
    help=f"A model file, or a bundled model: {', '.join(BUNDLED_MODELS)}.",
)
@click.option(
    "--batch-size", default=128, show_default=True, type=click.IntRange(min=1), help="Samples per minibatch."
)
@click.option(
    "--steps", default=20, show_default=True, type=click.IntRange(min=1), help="Training steps of the run."
)
@click.option("--lr", default=0.1, show_default=True, type=float, help="SGD learning rate of the run.")
@click.option(
    "--topology",
    default="local-cpu",
    show_default=True,
    help="Topology file or preset; its world size is the number of local processes.",
)
@click.option("--out-dir", default="pipeplan-demo", show_default=True, type=click.Path(file_okay=False))
@click.option(
    "--repeats", default=10, show_default=True, type=click.IntRange(min=1), help="Profiler repeats per layer."
)
@click.option(
    "--calibrate/--no-calibrate",
    default=True,
    show_default=True,
    help="First measure what a message costs here (pipeplan calibrate, 100 steps at 1 and 4 "
    "micro-batches) and plan on that topology; only on a CPU topology whose level 0 joins several devices.",
)
@click.option(
    "--data-parallel",
    is_flag=True,
    help="Let the planner replicate stages (on 2 CPUs it picks data parallelism) instead of a pipeline.",
)
def demo(
    model: str,
    batch_size: int,
    steps: int,
    lr: float,
    topology: str,
    out_dir: str,
    repeats: int,
    calibrate: bool,
    data_parallel: bool,
) -> None:
    """Profile a model on the CPU, partition it, show the timeline, train it with torchrun.

    The partition step searches every schedule x micro-batch count x virtual stages
    (``--schedule auto``), prints the candidates it compared and marks its choice. Writes profile.json, plan.json, timeline.svg and metrics.json into OUT_DIR and
    ends with predicted against measured time per minibatch. The profile runs one CPU
    thread, as each torchrun worker does (OMP_NUM_THREADS=1), so the two agree. On a CPU
    topology it first measures the message overhead (``pipeplan calibrate``) into
    OUT_DIR/topology.yaml: what a message costs the ranks' cores is the machine's, and moves
    with its load.
    """
    from pipeplan.modelfile import resolve_model_path
    from pipeplan.topology import resolve

    model_path = resolve_model_path(model)
    given = resolve(topology)
    world_size = given.world_size
    calibrating = calibrate and given.device.kind == "cpu" and given.levels[0].count > 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    profile, plan = out / "profile.json", out / "plan.json"
    timeline, metrics = out / "timeline.svg", out / "metrics.json"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    pipeplan = [sys.executable, "-m", "pipeplan"]
    # Two CPU processes on one host share a fast link: the DP would (rightly) pick plain
    # data parallelism, so the demo asks for a pipeline and the table compares the two.
    partition_flags = [] if data_parallel else ["--straight"]
    steps_total = 5 + calibrating
    titles = iter(
        f"{n}/{steps_total} {name}"
        for n, name in enumerate(
            ["calibrate"] * calibrating + ["profile", "partition", "simulate", "run", "report"], start=1
        )
    )
    if calibrating:
        measured = out / "topology.yaml"
        run_step(
            next(titles),
            [*pipeplan, "calibrate", "--topology", topology, "-o", str(measured), "--steps", "100",
             "--microbatches", "1", "--microbatches", "4"],
            env,
            timeout_s=300,
        )  # fmt: skip
        topology = str(measured)

    run_step(
        next(titles),
        [
            *pipeplan,
            "profile",
            model_path,
            "--device",
            "cpu",
            "--batch-size",
            str(batch_size),
            "--repeats",
            str(repeats),
            "--threads",
            "1",
            "-o",
            str(profile),
        ],
        env,
        timeout_s=300,
    )
    run_step(
        next(titles),
        [
            *pipeplan,
            "partition",
            str(profile),
            "--topology",
            topology,
            *partition_flags,
            "--schedule",
            "auto",
            "-o",
            str(plan),
        ],
        env,
        timeout_s=120,
    )
    run_step(
        next(titles),
        [*pipeplan, "simulate", str(plan), "--profile", str(profile), "--timeline", str(timeline)],
        env,
        timeout_s=120,
    )
    run_step(
        next(titles),
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(world_size),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "pipeplan",
            "run",
            str(plan),
            "--model",
            model_path,
            "--steps",
            str(steps),
            "--lr",
            str(lr),
            "--metrics",
            str(metrics),
        ],
        env,
        timeout_s=600,
    )
    run_step(next(titles), [*pipeplan, "report", str(metrics)], env, timeout_s=60)
