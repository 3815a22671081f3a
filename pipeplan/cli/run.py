"""``pipeplan run plan.json --model model.py``: train under torchrun as the plan says."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from pipeplan.optimizers import LR_SCHEDULES, OPTIMIZERS
from pipeplan.schedules import SCHEDULE_NAMES

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
@click.option("--model", "model_path", required=True, type=click.Path(dir_okay=False),
              help="model.py (build_model, sample_batch[, loss_fn, data_loader]) or a bundled model: mlp, vgg, resnet, gpt.")
@click.option("--schedule", type=click.Choice(SCHEDULE_NAMES), default=None,
              help="Override the plan's schedule.")
@click.option("--steps", type=int, default=10, show_default=True,
              help="Total optimizer steps (1F1B-RR: lcm(replicas) minibatches per step).")
@click.option("--microbatches", type=int, default=None,
              help="Micro-batches per minibatch (all but 1f1b-rr) [default: the plan's].")
@click.option("--lr", type=float, default=0.01, show_default=True, help="Learning rate.")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=None,
              help="Optimizer [default: the plan's]; a model file's make_optimizer(params) replaces it.")
@click.option("--weight-decay", type=float, default=0.0, show_default=True,
              help="Weight decay (adamw: decoupled); never on biases and norm weights (ndim < 2).")
@click.option("--lr-schedule", type=click.Choice(LR_SCHEDULES), default="constant", show_default=True,
              help="Learning rate after the warm-up, over --steps; a model file's make_lr_scheduler replaces it.")
@click.option("--warmup-steps", type=int, default=0, show_default=True,
              help="Steps of linear warm-up from lr/N to --lr.")
@click.option("--min-lr", type=float, default=0.0, show_default=True,
              help="Learning rate the linear or cosine decay ends at.")
@click.option("--clip-grad-norm", type=float, default=None,
              help="Clip gradients to this global norm over every stage and replica (1f1b-rr: per stage).")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Write per-step loss, lr, gradient norm, samples/s and stage times as TensorBoard "
                   "events and metrics.jsonl here (rank 0).")
@click.option("--recompute", is_flag=True, help="GPipe re-materialisation: recompute in backward.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Model init seed; minibatch k is drawn with seed + k.")
@click.option("--metrics", "metrics_path", type=click.Path(dir_okay=False), default=None,
              help="Write the run's metrics JSON (rank 0).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=None,
              help="Write a Chrome trace of every rank's work (rank 0 merges).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None,
              help="Save per-stage checkpoints here.")
@click.option("--checkpoint-every", type=int, default=0, show_default=True,
              help="Checkpoint every N steps (0: once at the end).")
@click.option("--resume", is_flag=True,
              help="Continue from the last complete checkpoint (of this or another plan of the model).")
@click.option("--weights", "weights", type=click.Path(), default=None,
              help="Start from pretrained weights: a Hugging Face save_pretrained folder "
                   "(safetensors, sharded or not), a .safetensors file or a pipeplan checkpoint "
                   "(not used when --resume finds a checkpoint to continue).")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True,
              help="Bound in seconds on every collective and point-to-point wait.")
@click.option("--no-progress", is_flag=True, help="No live progress line.")
@click.option("--allow-nonfinite", is_flag=True, help="Train on when a loss is NaN or infinite.")
@click.option("--build", "build", type=click.Choice(["auto", "eager", "meta"]), default="auto", show_default=True,
              help="eager: build the whole model under --seed, then keep the stage; meta: build on the meta "
                   "device and materialise only this rank's layers (weights seeded by module name); "
                   "auto: meta above 1 GiB of parameters and buffers.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=None,
              help="Compute dtype; bfloat16 trains in mixed precision (bf16 compute and activations, "
                   "float32 master weights, gradients and optimizer state) [default: the plan's].")
@click.option("--record", "record_dir", type=click.Path(file_okay=False), default=None, hidden=True,
              help="Tests: write per-rank parameters, weight versions and digests here.")
def run(plan_path: str, model_path: str, schedule: str | None, steps: int, microbatches: int | None,
        lr: float, optimizer: str | None, recompute: bool, seed: int, metrics_path: str | None,
        trace_path: str | None, checkpoint_dir: str | None, checkpoint_every: int, resume: bool,
        weights: str | None, timeout_s: float, no_progress: bool, record_dir: str | None, allow_nonfinite: bool,
        weight_decay: float, lr_schedule: str, warmup_steps: int, min_lr: float,
        clip_grad_norm: float | None, log_dir: str | None,
        build: str, dtype: str | None) -> None:
    """Train with the plan's pipeline on the ranks torchrun started.

    Every rank builds only its stage; activations and gradients (skip connections
    included) flow between stages point to point; replicas and tied parameters
    all-reduce their gradients; every wait is bounded and a failed rank stops the run.
    """
    from pipeplan.errors import InputError, PipeplanError
    from pipeplan.plan import Plan
    from pipeplan.runtime.train import PrepareError, RunConfig, run_training
    from pipeplan.schedules import schedule_kind

    rank = int(os.environ.get("RANK", "0"))
    try:
        plan = Plan.load(plan_path)
        chosen = schedule or plan.schedule
        config = RunConfig(
            plan=plan, model_path=model_path, schedule=chosen, steps=steps, lr=lr,
            optimizer=optimizer or plan.optimizer,
            microbatches=1 if schedule_kind(chosen).whole_minibatches else (microbatches or plan.microbatches),
            recompute=recompute, seed=seed, timeout_s=timeout_s, metrics_path=metrics_path,
            trace_path=trace_path, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            resume=resume, weights=weights, record_dir=record_dir, progress=not no_progress,
            allow_nonfinite=allow_nonfinite, weight_decay=weight_decay, lr_schedule=lr_schedule,
            warmup_steps=warmup_steps, min_lr=min_lr, clip_grad_norm=clip_grad_norm, log_dir=log_dir,
            build=build, dtype=dtype,
        )
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

    def ms(value: Any) -> str:
        return "-" if value is None else f"{value:,.2f}"

    table = Table(title=f"pipeplan run: {summary['schedule']}, {summary['steps']} steps")
    for column in ("stage", "replica", "rank", "compute ms/mb", "wait ms/mb", "stage ms/mb",
                   "predicted ms/mb"):
        table.add_column(column, justify="right")
    for s in summary["stages"]:
        table.add_row(str(s["stage"]), str(s["replica"]), str(s["rank"]), ms(s["compute_ms"]),
                      ms(s["wait_ms"]), ms(s["time_per_minibatch_ms"]),
                      ms(s["predicted_time_per_minibatch_ms"]))
    console = Console()
    console.print(table)
    from pipeplan.cli.report import memory_table

    console.print(memory_table(summary["stages"]))
    losses = summary["losses"]
    last = f"{losses[-1]:.4f}" if losses else "-"
    rate = summary["samples_per_s"]
    console.print(
        f"final loss {last}; {'-' if rate is None else f'{rate:,.1f}'} samples/s steady "
        f"(predicted {summary['predicted_samples_per_s']:,.1f} samples/s); "
        f"period {ms(summary['time_per_minibatch_ms'])} ms/minibatch "
        f"(predicted {ms(summary['predicted_time_per_minibatch_ms'])} ms)"
    )
