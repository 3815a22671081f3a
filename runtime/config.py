"""What ``pipeplan run`` was asked to do: small frozen configs, one per concern, each option written once.

Every field that is a command-line option carries its flag, help and default here, once
(``Option`` in the field's metadata, under ``OPTION``); ``pipeplan.cli.dataclass_options``
turns the fields into the click options of ``pipeplan run``, and the parsed command line
back into a ``RunConfig``. The groups, as ``RunConfig`` composes them:

- ``pipeline``: ``ScheduleConfig`` (schedule override, micro-batches, recompute);
- ``optim``: ``OptimizerConfig`` (optimizer, lr, weight decay, lr schedule, warm-up, clipping);
- ``build``: ``BuildConfig`` (build mode, compute dtype, seed);
- ``checkpoints``: ``CheckpointConfig`` (directory, interval or auto, overhead target,
  asynchronous saves, resume, pretrained weights);
- ``outputs``: ``OutputConfig`` (metrics, trace, live log, progress line, test record).

A field left ``None`` where its help says "[default: the plan's]" is resolved against the
plan by ``RunConfig``'s properties (``schedule``, ``microbatches``, ``optimizer``,
``precision``); the runtime reads those, never the raw field.

At the bottom of the runtime: imports no other runtime module (and no torch, so that
``pipeplan run --help`` stays instant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pipeplan.errors import InputError
from pipeplan.optimizers import LR_SCHEDULES, OPTIMIZERS, LRSchedule
from pipeplan.plan import Plan
from pipeplan.precision import Precision
from pipeplan.schedules import SCHEDULE_NAMES, names_where, or_list, schedule_kind

__all__ = [
    "BUILD_MODES",
    "COMPUTE_DTYPES",
    "OPTION",
    "BuildConfig",
    "CheckpointConfig",
    "OptimizerConfig",
    "Option",
    "OutputConfig",
    "RunConfig",
    "ScheduleConfig",
    "check_options",
    "check_recompute",
    "check_layer_recompute",
]

OPTION = "pipeplan.option"  # the metadata key of a field's ``Option``
BUILD_MODES = ("auto", "eager", "meta")  # --build (pipeplan.capture.materialise.BUILDS)
COMPUTE_DTYPES = ("float32", "bfloat16")  # --dtype


@dataclass(frozen=True)
class Option:
    """How a config field appears on the command line.

    The option's type and default are the field's own: a ``bool`` field is a flag, an
    ``int`` / ``float`` / ``str`` field (or one of them ``| None``) takes a value, and the
    default is shown in the help unless it is ``None`` or the field is a flag. A field with
    no default is a required option.
    """

    flag: str  # "--lr"
    help: str
    choices: tuple[str, ...] | None = None  # a click.Choice
    path: Literal["file", "dir", "any"] | None = None  # a click.Path: a file, a directory or either
    hidden: bool = False


def _option(
    flag: str,
    help: str,
    choices: tuple[str, ...] | None = None,
    path: Literal["file", "dir", "any"] | None = None,
    hidden: bool = False,
) -> dict[str, Option]:
    """A field's metadata: ``field(default=..., metadata=_option("--flag", "Help."))``."""
    return {OPTION: Option(flag, help, choices, path, hidden)}


@dataclass(frozen=True)
class ScheduleConfig:
    """Which pipeline schedule runs, over how many micro-batches, and whether GPipe recomputes."""

    schedule: str | None = field(
        default=None, metadata=_option("--schedule", "Override the plan's schedule.", choices=SCHEDULE_NAMES)
    )
    microbatches: int | None = field(
        default=None,
        metadata=_option(
            "--microbatches", "Micro-batches per minibatch (all but 1f1b-rr) [default: the plan's]."
        ),
    )
    recompute: bool = field(
        default=False, metadata=_option("--recompute", "GPipe re-materialisation: recompute in backward.")
    )


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer, its learning-rate curve and gradient clipping (``pipeplan.optimizers``)."""

    optimizer: str | None = field(
        default=None,
        metadata=_option(
            "--optimizer",
            "Optimizer [default: the plan's]; a model file's make_optimizer(params) replaces it.",
            choices=OPTIMIZERS,
        ),
    )
    lr: float = field(default=0.01, metadata=_option("--lr", "Learning rate."))
    weight_decay: float = field(
        default=0.0,
        metadata=_option(
            "--weight-decay", "Weight decay (adamw: decoupled); never on biases and norm weights (ndim < 2)."
        ),
    )
    lr_schedule: str = field(
        default="constant",
        metadata=_option(
            "--lr-schedule",
            "Learning rate after the warm-up, over --steps; a model file's make_lr_scheduler replaces it.",
            choices=LR_SCHEDULES,
        ),
    )
    warmup_steps: int = field(
        default=0, metadata=_option("--warmup-steps", "Steps of linear warm-up from lr/N to --lr.")
    )
    min_lr: float = field(
        default=0.0, metadata=_option("--min-lr", "Learning rate the linear or cosine decay ends at.")
    )
    clip_grad_norm: float | None = field(
        default=None,
        metadata=_option(
            "--clip-grad-norm",
            "Clip gradients to this global norm over every stage and replica (1f1b-rr: per stage).",
        ),
    )


@dataclass(frozen=True)
class BuildConfig:
    """How each rank builds its stage: whole or on meta, in which dtype, from which seed."""

    mode: str = field(
        default="auto",
        metadata=_option(
            "--build",
            "eager: build the whole model under --seed, then keep the stage; meta: build on the meta "
            "device and materialise only this rank's layers (weights seeded by module name); "
            "auto: meta above 1 GiB of parameters and buffers.",
            choices=BUILD_MODES,
        ),
    )
    dtype: str | None = field(
        default=None,
        metadata=_option(
            "--dtype",
            "Compute dtype; bfloat16 trains in mixed precision (bf16 compute and activations, "
            "float32 master weights, gradients and optimizer state) [default: the plan's].",
            choices=COMPUTE_DTYPES,
        ),
    )
    seed: int = field(
        default=0, metadata=_option("--seed", "Model init seed; minibatch k is drawn with seed + k.")
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go, how often, and what the run starts from (``pipeplan.runtime.checkpoint``)."""

    directory: str | None = field(
        default=None, metadata=_option("--checkpoint-dir", "Save per-stage checkpoints here.", path="dir")
    )
    every: str = field(
        default="0",
        metadata=_option(  # steps, or "auto" (pipeplan.runtime.checkpoint.frequency)
            "--checkpoint-every",
            "Checkpoint every N steps (0: once at the end), or auto: the most frequent interval "
            "whose measured cost stays under --checkpoint-overhead.",
        ),
    )
    overhead_pct: float = field(
        default=3.5,
        metadata=_option(
            "--checkpoint-overhead",
            "With --checkpoint-every auto: the most checkpoints may cost, in % of training time.",
        ),
    )
    asynchronous: bool = field(
        default=False,
        metadata=_option(
            "--checkpoint-async",
            "Two-phase checkpoints: training waits only for a copy in host memory, the write "
            "and its seal run behind the next steps (at most one in flight per rank).",
        ),
    )
    resume: bool = field(
        default=False,
        metadata=_option(
            "--resume", "Continue from the last complete checkpoint (of this or another plan of the model)."
        ),
    )
    weights: str | None = field(
        default=None,
        metadata=_option(
            "--weights",
            "Start from pretrained weights: a Hugging Face save_pretrained folder "
            "(safetensors, sharded or not), a .safetensors file or a pipeplan checkpoint "
            "(not used when --resume finds a checkpoint to continue).",
            path="any",
        ),
    )

    @property
    def interval(self) -> int | None:
        """Steps between checkpoints (0: only the final step), or None for ``auto``;
        ``InputError`` naming the value otherwise."""
        text = self.every.strip().lower()
        if text == "auto":
            return None
        try:
            steps = int(text)
        except ValueError:
            steps = -1
        if steps < 0:
            raise InputError(f"--checkpoint-every must be an integer >= 0 or auto (got {self.every!r})")
        return steps


@dataclass(frozen=True)
class OutputConfig:
    """What the run writes besides checkpoints, and what it shows while it trains."""

    metrics_path: str | None = field(
        default=None, metadata=_option("--metrics", "Write the run's metrics JSON (rank 0).", path="file")
    )
    trace_path: str | None = field(
        default=None,
        metadata=_option(
            "--trace", "Write a Chrome trace of every rank's work (rank 0 merges).", path="file"
        ),
    )
    log_dir: str | None = field(
        default=None,
        metadata=_option(  # TensorBoard events and metrics.jsonl
            "--log-dir",
            "Write per-step loss, lr, gradient norm, samples/s and stage times as TensorBoard "
            "events and metrics.jsonl here (rank 0).",
            path="dir",
        ),
    )
    progress: bool = field(
        default=True,
        metadata=_option(  # a flag that turns the default off
            "--no-progress", "No live progress line."
        ),
    )
    record_dir: str | None = field(
        default=None,
        metadata=_option(  # per-rank params, versions, digests
            "--record",
            "Tests: write per-rank parameters, weight versions and digests here.",
            path="dir",
            hidden=True,
        ),
    )


@dataclass(frozen=True)
class RunConfig:
    """One ``pipeplan run``: the plan, the model file and the groups above."""

    plan: Plan  # PLAN, loaded (the command's argument, not an option)
    model_path: str = field(
        metadata=_option(
            "--model",
            "model.py (build_model, sample_batch[, loss_fn, data_loader]) or a bundled model: "
            "mlp, vgg, resnet, gpt.",
            path="file",
        )
    )
    steps: int = field(
        default=10,
        metadata=_option(  # total steps (a resumed run continues up to it)
            "--steps", "Total optimizer steps (1F1B-RR: lcm(replicas) minibatches per step)."
        ),
    )
    pipeline: ScheduleConfig = field(default_factory=ScheduleConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    build: BuildConfig = field(default_factory=BuildConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    outputs: OutputConfig = field(default_factory=OutputConfig)
    timeout_s: float = field(
        default=300.0,
        metadata=_option("--timeout", "Bound in seconds on every collective and point-to-point wait."),
    )
    allow_nonfinite: bool = field(
        default=False, metadata=_option("--allow-nonfinite", "Train on when a loss is NaN or infinite.")
    )

    @property
    def schedule(self) -> str:
        """The schedule that runs: ``--schedule``, else the plan's (one of ``SCHEDULE_NAMES``)."""
        return self.pipeline.schedule or self.plan.schedule

    @property
    def microbatches(self) -> int:
        """Micro-batches per minibatch: 1 for a schedule of whole minibatches (1F1B-RR), else
        ``--microbatches`` or the plan's."""
        if schedule_kind(self.schedule).whole_minibatches:
            return 1
        return self.pipeline.microbatches or self.plan.microbatches

    @property
    def optimizer(self) -> str:
        """The built-in optimizer: ``--optimizer``, else the plan's (one of ``OPTIMIZERS``)."""
        return self.optim.optimizer or self.plan.optimizer

    @property
    def precision(self) -> Precision:
        """``--dtype``'s precision, else the plan's (its profile's dtype)."""
        return self.plan.precision if self.build.dtype is None else Precision.for_dtype(self.build.dtype)

    @property
    def schedule_settings(self) -> LRSchedule:
        """The built-in learning-rate curve over the run's ``steps``."""
        return LRSchedule(self.optim.lr_schedule, self.optim.warmup_steps, self.optim.min_lr, self.steps)


def check_options(config: RunConfig) -> None:
    """``InputError`` for a value no run takes, in one line naming its flag (before any communication)."""
    optim = config.optim
    if config.optimizer not in OPTIMIZERS:
        raise InputError(f"optimizer {config.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if config.steps < 1:
        raise InputError(f"--steps must be >= 1 (got {config.steps})")
    _ = config.checkpoints.interval  # InputError on a value that is neither N >= 0 nor auto
    overhead = config.checkpoints.overhead_pct
    if not (math.isfinite(overhead) and 0 < overhead < 100):
        raise InputError(f"--checkpoint-overhead must be a percentage in (0, 100) (got {overhead})")
    if not (math.isfinite(optim.lr) and optim.lr > 0):
        raise InputError(f"--lr must be a finite number > 0 (got {optim.lr})")
    if not (math.isfinite(optim.weight_decay) and optim.weight_decay >= 0):
        raise InputError(f"--weight-decay must be a finite number >= 0 (got {optim.weight_decay})")
    clip = optim.clip_grad_norm
    if clip is not None and not (math.isfinite(clip) and clip > 0):
        raise InputError(f"--clip-grad-norm must be a finite number > 0 (got {optim.clip_grad_norm})")
    config.schedule_settings.check(optim.lr)
    if not (math.isfinite(config.timeout_s) and config.timeout_s > 0):
        raise InputError(f"--timeout must be a finite number of seconds > 0 (got {config.timeout_s})")
    check_recompute(config)
    check_layer_recompute(config)


def check_layer_recompute(config: RunConfig) -> None:
    """A plan's per-layer recomputation (``StagePlan.recompute_layers``, and the attention
    cores of ``selective_layers``) runs only under the schedules whose ``ScheduleKind`` says
    ``recomputes_layers``, without tensor parallelism and without mixed precision (a
    recomputed forward reads the weights the modules hold when backward runs:
    ``pipeplan.capture.checkpointed``); ``InputError`` otherwise."""
    stages = [stage.index for stage in config.plan.stages if stage.recompute_layers or stage.selective_layers]
    if not stages:
        return
    if not schedule_kind(config.schedule).recomputes_layers:
        allowed = or_list(names_where(lambda kind: kind.recomputes_layers))
        raise InputError(
            f"the plan recomputes layers of stage(s) {stages}, which runs under {allowed}, not {config.schedule} "
            f"(plan it with --recompute none for {config.schedule})"
        )
    if config.precision.mixed:
        raise InputError(
            f"the plan recomputes layers of stage(s) {stages}, which pipeplan runs without mixed precision "
            f"(got {config.precision.dtype} with {config.precision.master_dtype} masters; such plans of estimated "
            f"profiles are for other engines: pipeplan export --to megatron)"
        )
    split = [
        stage.index
        for stage in config.plan.stages
        if (stage.recompute_layers or stage.selective_layers) and stage.tensor_parallel > 1
    ]
    if split:
        raise InputError(
            f"the plan recomputes layers of tensor-parallel stage(s) {split}, which pipeplan does not run "
            f"(such plans of estimated profiles are for other engines: pipeplan export --to megatron)"
        )


def check_recompute(config: RunConfig) -> None:
    """``--recompute`` re-materialises only under the schedules whose ``ScheduleKind`` says
    ``supports_recompute``; ``InputError`` under another."""
    if config.pipeline.recompute and not schedule_kind(config.schedule).supports_recompute:
        allowed = or_list(names_where(lambda kind: kind.supports_recompute))
        raise InputError(f"--recompute applies to {allowed}, not {config.schedule}")
