"""Reference throughput: PyTorch's own ``torch.distributed.pipelining`` on CPU ranks.

pipeplan's runtime benchmark compares against two numbers measured here on the same
model file, batch and learning rate:

- ``run_pipelining_baseline``: an ``nn.Sequential`` model split at ``stage_boundaries``
  into ``PipelineStage``s (gloo, CPU), trained with SGD by one of ``SCHEDULES``:
  ``Schedule1F1B`` (one stage per rank), ``ScheduleInterleaved1F1B`` (``virtual_stages``
  stages per rank: rank i holds stages i, i + ranks, ...) or ``ScheduleInterleavedZeroBubble``;
- ``run_single_process_baseline``: the same model trained by a plain loop in this process.

Both build the model under ``torch.manual_seed(seed)`` and train on the batches
``model_file.batch(batch_size, seed=i)`` for i = 0, 1, ...: first ``warmup_steps``
untimed minibatches, then ``steps`` timed ones. With a mean-reduced loss and equal
micro-batches, 1F1B's gradient (mean of the micro-batch gradients) equals the
full-batch gradient, so both runs report the same losses up to float rounding.

Standalone (prints a table, ``--out`` writes JSON)::

    python bench/pipelining_baseline.py --model mlp --batch-size 64 --microbatches 4 --steps 20
    python bench/pipelining_baseline.py --model my_model.py --boundaries 3 --out baseline.json
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeplan.host_memory import keep_freed_blocks

__all__ = ["SCHEDULES", "run_pipelining_baseline", "run_single_process_baseline"]

_WORKER_FLAG = "_pipelining_worker"
SCHEDULES = ("Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")


def run_pipelining_baseline(
    model_path: str,
    stage_boundaries: list[int],
    batch_size: int,
    microbatches: int,
    steps: int,
    lr: float,
    *,
    warmup_steps: int = 2,
    seed: int = 0,
    threads_per_rank: int | None = None,
    timeout_s: float = 300.0,
    schedule: str = "Schedule1F1B",
    virtual_stages: int = 1,
) -> dict[str, Any]:
    """Train with ``PipelineStage`` + ``schedule`` on ``(len(stage_boundaries) + 1) / virtual_stages`` CPU ranks.

    ``stage_boundaries`` are the indices of the ``nn.Sequential`` children where stages
    1, 2, ... begin (``[4]``: children 0-3 on rank 0, 4.. on rank 1); with
    ``virtual_stages`` v, stage q runs on rank q % (stages / v). The ranks are
    launched with torchrun (``--standalone``, gloo); the whole launch is killed after
    ``timeout_s`` seconds. ``threads_per_rank`` defaults to ``cpu_count // ranks``.

    Returns ``samples_per_s``, ``time_per_minibatch_ms`` (timed steps only, slowest
    rank), ``losses`` (mean micro-batch loss of each timed step) and the settings.
    Raises ``InputError`` for bad arguments, ``RuntimeFailure`` when a rank fails or
    the run exceeds ``timeout_s``.
    """
    from pipeplan.errors import InputError

    _check_counts(batch_size, steps, warmup_steps, lr)
    if schedule not in SCHEDULES:
        raise InputError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    stages = len(stage_boundaries) + 1
    if (
        virtual_stages < 1
        or stages % virtual_stages
        or (virtual_stages > 1) != (schedule == "ScheduleInterleaved1F1B")
    ):
        raise InputError(
            f"{schedule} with {virtual_stages} stages per rank does not fit {stages} stages "
            f"(ScheduleInterleaved1F1B takes 2 or more per rank, the others 1)"
        )
    ranks = stages // virtual_stages
    if ranks < 2:
        raise InputError("stage_boundaries is empty: the pipelining baseline needs at least 2 ranks")
    if microbatches < ranks:
        raise InputError(
            f"{schedule} needs microbatches >= ranks (microbatches: {microbatches}, ranks: {ranks})"
        )
    if batch_size % microbatches:
        raise InputError(f"batch size {batch_size} does not split into {microbatches} equal micro-batches")
    children = _sequential_length(model_path)
    bounds = [0, *stage_boundaries, children]
    if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
        raise InputError(
            f"stage boundaries {stage_boundaries} must increase strictly within 1..{children - 1} "
            f"(the model has {children} Sequential children)"
        )
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // ranks)
    config = {
        "model_path": str(Path(model_path).resolve()),
        "bounds": bounds,
        "batch_size": batch_size,
        "microbatches": microbatches,
        "steps": steps,
        "warmup_steps": warmup_steps,
        "lr": lr,
        "seed": seed,
        "threads": threads,
        "timeout_s": timeout_s,
        "schedule": schedule,
        "virtual_stages": virtual_stages,
    }
    with tempfile.TemporaryDirectory(prefix="pipeplan-baseline-") as folder:
        config_path = Path(folder) / "config.json"
        result_path = Path(folder) / "result.json"
        config_path.write_text(json.dumps(config))
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={ranks}",
            os.path.abspath(__file__),
            _WORKER_FLAG,
            str(config_path),
            str(result_path),
        ]
        log = _launch(command, Path(folder) / "log.txt", timeout_s)
        if not result_path.is_file():
            from pipeplan.errors import RuntimeFailure

            raise RuntimeFailure(f"pipelining baseline wrote no result; last output: {log}")
        measured = json.loads(result_path.read_text())
    result = {
        "ranks": ranks,
        "schedule": schedule,
        "virtual_stages": virtual_stages,
        "stage_boundaries": list(stage_boundaries),
        "batch_size": batch_size,
        "microbatches": microbatches,
        "steps": steps,
        "threads_per_rank": threads,
    }
    result.update(measured)
    return result


def run_single_process_baseline(
    model_path: str,
    batch_size: int,
    steps: int,
    lr: float,
    *,
    warmup_steps: int = 2,
    seed: int = 0,
    threads: int | None = None,
) -> dict[str, Any]:
    """Train the whole model in this process with SGD; same batches and timing as the pipeline.

    ``threads`` (default: torch's current setting) is restored afterwards. Returns
    ``samples_per_s``, ``time_per_minibatch_ms``, ``losses`` (one per timed step).
    """
    import torch

    from pipeplan.modelfile import load_model_file

    _check_counts(batch_size, steps, warmup_steps, lr)
    model_file = load_model_file(model_path)
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    keep_freed_blocks()
    try:
        torch.manual_seed(seed)
        model = model_file.build()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        batches = [model_file.batch(batch_size, seed=i) for i in range(warmup_steps + steps)]
        losses: list[float] = []
        start = time.perf_counter()
        for index, (inputs, targets) in enumerate(batches):
            if index == warmup_steps:
                start = time.perf_counter()
            optimizer.zero_grad()
            loss = model_file.loss_fn(model(*inputs), targets)
            loss.backward()
            optimizer.step()
            if index >= warmup_steps:
                losses.append(float(loss.detach()))
        elapsed_s = time.perf_counter() - start
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous_threads)
    return {
        "ranks": 1,
        "batch_size": batch_size,
        "steps": steps,
        "threads_per_rank": used_threads,
        **_rates(elapsed_s, steps, batch_size),
        "losses": losses,
    }


def _rates(elapsed_s: float, steps: int, batch_size: int) -> dict[str, float]:
    return {
        "samples_per_s": steps * batch_size / elapsed_s,
        "time_per_minibatch_ms": elapsed_s / steps * 1e3,
    }


def _check_counts(batch_size: int, steps: int, warmup_steps: int, lr: float) -> None:
    from pipeplan.errors import InputError

    if batch_size < 1 or steps < 1 or warmup_steps < 0 or not lr > 0:
        raise InputError(
            f"baseline needs batch_size >= 1, steps >= 1, warmup_steps >= 0, lr > 0 "
            f"(batch_size: {batch_size}, steps: {steps}, warmup_steps: {warmup_steps}, lr: {lr})"
        )


def _sequential_length(model_path: str) -> int:
    """Number of children of the model file's ``nn.Sequential`` (``InputError`` otherwise)."""
    import torch

    from pipeplan.errors import InputError
    from pipeplan.modelfile import load_model_file

    model = load_model_file(model_path).build()
    if not isinstance(model, torch.nn.Sequential):
        raise InputError(
            f"{model_path}: the pipelining baseline splits an nn.Sequential, "
            f"build_model() returned {type(model).__name__}"
        )
    return len(model)


def _launch(command: list[str], log_path: Path, timeout_s: float) -> str:
    """Run ``command`` in its own process group; kill the group after ``timeout_s`` seconds.

    Returns the last line of its output; raises ``RuntimeFailure`` on a non-zero exit or
    a timeout.
    """
    from pipeplan.errors import RuntimeFailure

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RuntimeFailure(
                f"pipelining baseline exceeded its timeout of {timeout_s:g} s; "
                f"last output: {_last_line(log_path)}"
            ) from None
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    if code != 0:
        raise RuntimeFailure(f"pipelining baseline exited with code {code}: {_last_line(log_path)}")
    return _last_line(log_path)


def _last_line(log_path: Path) -> str:
    """The most informative line of a log: the last exception line, else the last line."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return (errors or lines or ["(no output)"])[-1][:400]


def _worker(config_path: str, result_path: str) -> None:
    """One torchrun rank: its stage(s) of the model, the schedule over gloo, timed SGD steps."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    from pipeplan.jsonio import write_json_atomic
    from pipeplan.modelfile import load_model_file

    config = json.loads(Path(config_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(config["threads"])
    keep_freed_blocks()  # the allocator setting pipeplan's runtime uses: compare schedules, not mallocs
    dist.init_process_group("gloo", timeout=timedelta(seconds=config["timeout_s"]))
    try:
        model_file = load_model_file(config["model_path"])
        torch.manual_seed(config["seed"])
        model = model_file.build()
        bounds = config["bounds"]
        stages = len(bounds) - 1
        held = range(rank, stages, world)  # stage q on rank q % world
        submodules = [model[bounds[q] : bounds[q + 1]] for q in held]
        pipeline_stages = [PipelineStage(m, q, stages, torch.device("cpu")) for m, q in zip(submodules, held)]
        schedule_class = getattr(pipelining, config["schedule"])
        if config["schedule"] == "Schedule1F1B":
            schedule = schedule_class(
                pipeline_stages[0], n_microbatches=config["microbatches"], loss_fn=model_file.loss_fn
            )
        else:
            schedule = schedule_class(
                pipeline_stages, n_microbatches=config["microbatches"], loss_fn=model_file.loss_fn
            )
        optimizer = torch.optim.SGD([p for m in submodules for p in m.parameters()], lr=config["lr"])
        warmup, steps = config["warmup_steps"], config["steps"]
        batches = [model_file.batch(config["batch_size"], seed=i) for i in range(warmup + steps)]
        losses: list[float] = []
        dist.barrier()
        start = time.perf_counter()
        for index, (inputs, targets) in enumerate(batches):
            if index == warmup:
                dist.barrier()
                start = time.perf_counter()
            optimizer.zero_grad()
            micro_losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(*inputs)
            elif rank == world - 1:
                schedule.step(target=targets, losses=micro_losses, return_outputs=False)
            else:
                schedule.step()
            optimizer.step()
            if index >= warmup and micro_losses:
                losses.append(float(torch.stack([loss.detach() for loss in micro_losses]).mean()))
        dist.barrier()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if rank == world - 1:
            write_json_atomic(
                result_path,
                {**_rates(float(elapsed), steps, config["batch_size"]), "losses": losses},
            )
    finally:
        dist.destroy_process_group()


def _main() -> None:
    import click

    @click.command(
        context_settings={"help_option_names": ["-h", "--help"]},
        epilog="Examples:\n\n  python bench/pipelining_baseline.py --model mlp --steps 20\n\n"
        "  python bench/pipelining_baseline.py --model my_model.py --boundaries 3 --out b.json",
    )
    @click.option(
        "--model",
        "model",
        default="mlp",
        show_default=True,
        help="Model file path, or a bundled model name (mlp).",
    )
    @click.option(
        "--boundaries",
        default=None,
        help="Comma-separated Sequential indices where stages 1.. start (default: the middle child).",
    )
    @click.option("--batch-size", default=64, show_default=True, type=int, help="Samples per minibatch.")
    @click.option(
        "--microbatches", default=4, show_default=True, type=int, help="Micro-batches per minibatch."
    )
    @click.option(
        "--steps", default=20, show_default=True, type=int, help="Timed minibatches (after 2 warm-up)."
    )
    @click.option("--lr", default=0.01, show_default=True, type=float, help="SGD learning rate.")
    @click.option(
        "--timeout",
        "timeout_s",
        default=300.0,
        show_default=True,
        type=float,
        help="Kill the pipelined run after this many seconds.",
    )
    @click.option(
        "--out", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON here."
    )
    def main(
        model: str,
        boundaries: str | None,
        batch_size: int,
        microbatches: int,
        steps: int,
        lr: float,
        timeout_s: float,
        out: str | None,
    ) -> None:
        """Measure torch.distributed.pipelining (1F1B, CPU ranks) against one process."""
        from rich.console import Console
        from rich.table import Table

        from pipeplan.errors import PipeplanError
        from pipeplan.jsonio import write_json_atomic
        from pipeplan.modelfile import bundled_model_path

        try:
            path = model if Path(model).is_file() else bundled_model_path(model)
            cuts = (
                [int(item) for item in boundaries.split(",")]
                if boundaries
                else [_sequential_length(path) // 2]
            )
            piped = run_pipelining_baseline(
                path, cuts, batch_size, microbatches, steps, lr, timeout_s=timeout_s
            )
            single = run_single_process_baseline(path, batch_size, steps, lr)
        except (PipeplanError, ValueError) as exc:
            raise click.ClickException(str(exc).splitlines()[0]) from exc
        gap = max(abs(a - b) for a, b in zip(piped["losses"], single["losses"]))
        table = Table(
            title=f"{Path(path).name}: {batch_size} samples/minibatch, {steps} timed steps, lr {lr:g}"
        )
        for column in ("run", "ranks", "threads/rank", "samples/s", "ms/minibatch", "loss first→last"):
            table.add_column(column, justify="left" if column == "run" else "right")
        for name, run in ((f"1F1B, {microbatches} micro-batches", piped), ("single process", single)):
            table.add_row(
                name,
                str(run["ranks"]),
                str(run["threads_per_rank"]),
                f"{run['samples_per_s']:.1f}",
                f"{run['time_per_minibatch_ms']:.2f}",
                f"{run['losses'][0]:.4f}→{run['losses'][-1]:.4f}",
            )
        console = Console(width=max(100, Console().width))
        console.print(table)
        console.print(f"stage boundaries {cuts}; max |loss difference| {gap:.2e} (unitless)")
        if out:
            write_json_atomic(
                out,
                {
                    "schema": "pipeplan.bench.pipelining-baseline/1",
                    "model": path,
                    "pipelining": piped,
                    "single_process": single,
                    "max_loss_difference": gap,
                },
            )
            console.print(f"wrote {out}")

    main()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == _WORKER_FLAG:
        _worker(sys.argv[2], sys.argv[3])
    else:
        _main()
