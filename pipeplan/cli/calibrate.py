"""``pipeplan calibrate``: measure the message overhead of this machine into a topology file.

The prediction charges each end of a message what it costs its rank
(``Level.message_overhead_ms``). That cost is the machine's, and moves with its load: a
preset's figure is one machine's on one day. This command measures it where the plan will
run, as ``pipeplan demo`` runs its steps: ``pipeplan profile`` of a model of messages (four
``Linear(4, 4)``, ``configs/models/exchange.py``), a 2-stage plan per micro-batch count, each
trained on 2 local ranks under torchrun; the overhead that makes the simulator predict each
measured time (``planner.message_overhead``), their median written on level 0 of the topology.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeplan.cli.demo import free_port, run_step

if TYPE_CHECKING:  # typing only
    from pipeplan.topology import Topology

__all__ = ["calibrate"]

_RANKS = 2  # the pair of level-0 devices a calibration trains on


@dataclass(frozen=True)
class _Fit:
    microbatches: int
    predicted_ms: float  # without any message overhead
    measured_ms: float
    overhead_ms: float


@click.command(
    epilog="""\b
Examples:
  pipeplan calibrate -o my-cpu.yaml                  # local-cpu, measured here
  pipeplan calibrate --topology cluster.yaml -o cluster-measured.yaml
  pipeplan partition profile.json --topology my-cpu.yaml -o plan.json
"""
)
@click.option(
    "--topology",
    default="local-cpu",
    show_default=True,
    help="Topology file or preset to calibrate; its level 0 must join at least 2 devices.",
)
@click.option(
    "-o",
    "--out",
    required=True,
    type=click.Path(dir_okay=False),
    help="Topology file to write: the input's, with level 0's message overhead measured.",
)
@click.option(
    "--microbatches",
    "microbatch_counts",
    multiple=True,
    type=click.IntRange(min=1),
    default=(1, 2, 4, 8),
    show_default=True,
    help="Micro-batch counts to train at (repeat the option); the overhead is their median.",
)
@click.option(
    "--steps", default=300, show_default=True, type=click.IntRange(min=2), help="Training steps per count."
)
@click.option(
    "--timeout", "timeout_s", default=300.0, show_default=True, help="Seconds per step of the flow."
)
def calibrate(
    topology: str, out: str, microbatch_counts: tuple[int, ...], steps: int, timeout_s: float
) -> None:
    """Measure what each end of a message costs a rank here; write it into a topology file.

    Trains a model of messages (next to no compute) as 2 stages on 2 local ranks at each
    micro-batch count, and fits the message overhead at which the simulator predicts the
    measured time per minibatch. Only level 0 is measured (the ranks of one host); the other
    levels are copied. Run it on an idle machine, with the threads per rank a run will use
    (OMP_NUM_THREADS, 1 if unset).
    """
    from pipeplan.errors import InputError
    from pipeplan.jsonio import write_atomic
    from pipeplan.planner.message_overhead import with_message_overhead
    from pipeplan.topology import resolve

    target = resolve(topology)
    if target.levels[0].count < _RANKS:
        raise InputError(
            f"topology {target.name!r}: level 0 ({target.levels[0].name}) joins {target.levels[0].count} "
            f"device, and a calibration trains {_RANKS} ranks on it"
        )
    destination = Path(out)
    if not destination.parent.is_dir():
        raise InputError(f"cannot write {out}: folder {destination.parent} does not exist")
    with tempfile.TemporaryDirectory(prefix="pipeplan-calibrate-") as folder:
        fits = [
            _fit(target, micro, steps, Path(folder), timeout_s) for micro in sorted(set(microbatch_counts))
        ]
    overhead_ms = statistics.median(fit.overhead_ms for fit in fits)
    measured = with_message_overhead(target, overhead_ms)
    header = (
        f"# Measured by `pipeplan calibrate` on {os.uname().nodename}: level 0's message overhead is the\n"
        f"# median of {', '.join(f'{f.overhead_ms * 1e3:.0f} us (M = {f.microbatches})' for f in fits)};\n"
        f"# {steps} steps each, load average {os.getloadavg()[0]:.2f} after.\n"
    )
    write_atomic(destination, (header + measured.to_yaml()).encode())
    _print_table(fits, target.levels[0].message_overhead_ms, overhead_ms, out)


def _fit(target: Topology, microbatches: int, steps: int, folder: Path, timeout_s: float) -> _Fit:
    """Profile (once), plan and train the model of messages at ``microbatches``; its fit."""
    from pipeplan.metrics import Metrics
    from pipeplan.modelfile import bundled_model_path
    from pipeplan.planner.message_overhead import fitted_message_overhead_ms, with_message_overhead
    from pipeplan.planner.partition import PartitionOptions, partition
    from pipeplan.planner.simulate import simulate_plan
    from pipeplan.profile import Profile
    from pipeplan.topology import Topology

    model = bundled_model_path("exchange")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    threads = env["OMP_NUM_THREADS"]
    profile_path = folder / "profile.json"
    device = target.device.kind
    if not profile_path.exists():
        run_step(
            "profile the model of messages",
            [sys.executable, "-m", "pipeplan", "profile", model, "--device", device, "--threads", threads,
             "--batch-size", "8", "-o", str(profile_path)],
            env, timeout_s, quiet=True,
        )  # fmt: skip
    profile = Profile.load(profile_path)
    pair = Topology(
        name=f"{target.name} (2 devices of level 0)",
        device=target.device,
        levels=(replace(target.levels[0], count=_RANKS),),
    )
    options = PartitionOptions(schedule="1f1b-flush", microbatches=microbatches, straight=True)
    plan = partition(profile, with_message_overhead(pair, 0.0), options)
    plan_path, metrics_path = folder / f"plan-m{microbatches}.json", folder / f"metrics-m{microbatches}.json"
    plan.save(plan_path)
    run_step(
        f"train it at M = {microbatches}",
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(_RANKS),
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "pipeplan", "run",
         str(plan_path), "--model", model, "--steps", str(steps), "--lr", "1e-4", "--no-progress",
         "--metrics", str(metrics_path)],
        env, timeout_s, quiet=True,
    )  # fmt: skip
    measured = Metrics.load(metrics_path).time_per_minibatch_ms
    if measured is None:
        from pipeplan.errors import RuntimeFailure

        raise RuntimeFailure(f"the run at M = {microbatches} measured no steady-state time ({steps} steps)")
    return _Fit(
        microbatches,
        simulate_plan(plan, profile).time_per_minibatch_ms,
        measured,
        fitted_message_overhead_ms(plan, profile, measured),
    )


def _print_table(fits: list[_Fit], before_ms: float, overhead_ms: float, out: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="message overhead that explains each run (2 local ranks, 1F1B-flush)")
    for column in ("M", "predicted without overhead, ms", "measured, ms", "overhead that fits, us"):
        table.add_column(column, justify="right")
    for fit in fits:
        table.add_row(
            str(fit.microbatches),
            f"{fit.predicted_ms:.3f}",
            f"{fit.measured_ms:.3f}",
            f"{fit.overhead_ms * 1e3:.0f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"message overhead: {overhead_ms * 1e3:.0f} us (median; the input topology had "
        f"{before_ms * 1e3:.0f} us); wrote {out}",
        highlight=False,
    )
