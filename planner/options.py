"""``PartitionOptions``: what the user asks of the planner, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.errors import InputError
from pipeplan.planner.cost_models import cost_model
from pipeplan.planner.costs import COST_MODELS
from pipeplan.planner.memory import OPTIMIZER_STATES
from pipeplan.planner.offload import OFFLOAD_CHOICES, offload_variants
from pipeplan.planner.recompute import check_recompute_mode
from pipeplan.planner.sharding import fsdp_runs, shard_modes
from pipeplan.planner.targets import ENGINES, EXPORT_TARGETS
from pipeplan.precision import Precision
from pipeplan.profile import Profile
from pipeplan.schedules import DEFAULT_SCHEDULE, SCHEDULE_NAMES, TARGET_SCHEDULES, schedule_kind
from pipeplan.topology import Topology

__all__ = [
    "PartitionOptions",
    "TARGET_SCHEDULES",
    "SEQUENCE_PARALLEL_MODES",
    "charged_optimizer",
    "planned_fsdp",
    "planned_shard_modes",
    "check_sequence_parallel",
    "plans_sequence_parallel",
    "RUNTIME_RUNS_SEQUENCE_PARALLEL",
]

SEQUENCE_PARALLEL_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class PartitionOptions:
    schedule: str = DEFAULT_SCHEDULE  # one of pipeplan.schedules.SCHEDULE_NAMES
    cost_model: str = "pipeplan"  # "pipeplan" | "pipedream"
    optimizer: str = "sgd"  # "sgd" | "momentum" | "adam"
    straight: bool = False  # one device per stage
    max_stages: int | None = None
    use_fewer_devices: bool = False
    microbatches: int = 1  # micro-batches per minibatch (schedules that split minibatches)
    memory_check: bool = True
    activation_compression_ratio: float | None = None  # PipeDream mode only
    virtual_stages: int | None = None  # interleaved-1f1b: chunks per device (None: the planner picks)
    # tensor-parallel degree of every stage (None: the planner picks among those the profile
    # and the topology's innermost level allow; planner.tp_pricing)
    tensor_parallel: int | None = None
    # flush schedules: also try uniform plans (p balanced stages x d replicas, planner.uniform)
    # and keep the fastest simulated; None: when the profile has splitting layers (transformers)
    uniform: bool | None = None
    # plan only cuts this engine can express (planner.targets): "pipelining" | "torchtitan" | None
    export_target: str | None = None
    # activation recomputation per stage (``planner.recompute``): "auto" (the least that fits,
    # chosen with the split, where the schedule runs it), "none", "full"
    recompute: str = "auto"
    # sharded data parallelism of replicated stages (planner.sharding): auto | none | zero1 | zero2 | fsdp
    shard: str = "auto"
    # Megatron's sequence parallelism of tensor-parallel stages (planner.tp_pricing):
    # "auto" (on wherever t > 1 and it runs: plans_sequence_parallel), "on" (needs t > 1), "off"
    sequence_parallel: str = "auto"
    # offload to host memory of sharded replicas (planner.offload): auto | none | optimizer | all
    offload: str = "auto"
    # set by ``planned_fsdp`` from the profile and topology: ``pipeplan run`` runs zero2 and
    # fsdp for them (planner.sharding.fsdp_runs), so ``auto`` chooses among them (and their
    # offload), without recomputation on those stages
    fsdp_run: bool = False

    def validate(self) -> None:
        if self.schedule not in SCHEDULE_NAMES:
            raise InputError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULE_NAMES)}")
        if self.cost_model not in COST_MODELS:
            raise InputError(f"cost model {self.cost_model!r} is not one of {', '.join(COST_MODELS)}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise InputError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZER_STATES)}")
        if self.max_stages is not None and self.max_stages < 1:
            raise InputError(f"--max-stages must be >= 1 (got {self.max_stages})")
        if self.microbatches < 1:
            raise InputError(f"--microbatches must be >= 1 (got {self.microbatches})")
        if self.cost_model == "pipedream" and self.max_stages is not None:
            raise InputError("--max-stages is not part of PipeDream's optimizer (use --cost-model pipeplan)")
        ratio = self.activation_compression_ratio
        if ratio is not None and not ratio > 0:
            raise InputError(f"activation compression ratio must be positive (got {ratio})")
        kind = schedule_kind(self.schedule)
        if self.offload not in OFFLOAD_CHOICES:
            raise InputError(f"--offload {self.offload!r} is not one of {', '.join(OFFLOAD_CHOICES)}")
        if self.offload not in ("auto", "none") and (self.cost_model != "pipeplan" or self.export_target):
            raise InputError(
                f"--offload {self.offload} is planned with --cost-model pipeplan and without --for "
                f"(got --cost-model {self.cost_model}, --for {self.export_target})"
            )
        shard_modes(
            self.shard, self.schedule, self.tensor_parallel or 1
        )  # one line for a bad or refused mode
        if self.virtual_stages is not None and (
            self.virtual_stages < 2 if kind.virtual_stages else self.virtual_stages != 1
        ):
            raise InputError(
                f"schedule {self.schedule} runs "
                + ("v >= 2" if kind.virtual_stages else "one")
                + f" chunk(s) per device (got --virtual-stages {self.virtual_stages})"
            )
        if kind.whole_minibatches and self.microbatches != 1:
            raise InputError(
                f"{self.schedule} runs whole minibatches (got --microbatches {self.microbatches})"
            )
        if self.export_target is not None:
            self._validate_target()
        check_recompute_mode(self.recompute, self.schedule, self.tensor_parallel, estimated=True)
        if self.recompute in ("full", "selective") and self.cost_model != "pipeplan":
            raise InputError(
                f"--recompute {self.recompute} is planned with --cost-model pipeplan (got {self.cost_model})"
            )
        check_sequence_parallel(self.sequence_parallel, self.tensor_parallel)

    def _validate_target(self) -> None:
        """What ``--for`` needs besides the cuts: a flush schedule of one chunk, one device per stage."""
        target = self.export_target
        if target not in EXPORT_TARGETS:
            raise InputError(f"--for {target!r} is not one of {', '.join(EXPORT_TARGETS)}")
        if self.schedule not in TARGET_SCHEDULES:
            raise InputError(
                f"--for {target} plans {', '.join(TARGET_SCHEDULES)} (got --schedule {self.schedule}): "
                f"{ENGINES[target]} runs flush schedules, and pipeplan restricts the cuts of one chunk per device"
            )
        if not self.straight:
            raise InputError(
                f"--for {target} plans one device per stage (--straight): {ENGINES[target]} "
                f"replicates whole pipelines, not stages"
            )
        if self.uniform:
            raise InputError(
                f"--for {target} plans the DP's cuts, not --uniform shapes (which replicate stages)"
            )
        if self.tensor_parallel not in (None, 1):
            raise InputError(
                f"--for {target} plans without tensor parallelism (got --tensor-parallel "
                f"{self.tensor_parallel}): pipeplan exports pipeline stages only"
            )


def charged_optimizer(options: PartitionOptions) -> str | None:
    """The optimizer whose measured step counts as compute (none in PipeDream's own model)."""
    return cost_model(options.cost_model).charged_optimizer(options.optimizer)


def planned_fsdp(options: PartitionOptions, profile: Profile, topology: Topology) -> PartitionOptions:
    """``options`` with ``fsdp_run`` set: whether ``pipeplan run`` runs zero2 / fsdp for plans of
    ``profile`` on ``topology`` (after ``partition.planned_recompute``: full recomputation rules them out)."""
    users: dict[str, int] = {}
    for layer in profile.layers:
        for name in layer.parameters:
            users[name] = users.get(name, 0) + 1
    runs = fsdp_runs(
        options.schedule,
        Precision(profile.dtype, profile.master_dtype).mixed,
        len(topology.levels),
        any(count > 1 for count in users.values()),
        options.recompute,
    )
    return options if runs == options.fsdp_run else replace(options, fsdp_run=runs)


def planned_shard_modes(
    options: PartitionOptions, topology: Topology, tensor_parallel: int = 1
) -> tuple[str, ...]:
    """The modes the DP may give a replicated stage, each with its offload
    (``planner.offload.variant``): ``none`` only under PipeDream's own cost model, for an
    export target, or with tensor parallelism under ``auto``. ``InputError`` in one line for
    an offload the topology or modes refuse (``planner.offload.offload_variants``)."""
    if options.cost_model != "pipeplan" or options.export_target is not None:
        return ("none",)
    if tensor_parallel > 1 and options.shard == "auto":
        return ("none",)
    fsdp = options.fsdp_run and tensor_parallel == 1
    modes = shard_modes(options.shard, options.schedule, tensor_parallel, fsdp)
    return offload_variants(options.offload, modes, fsdp, topology.device.kind == "cpu")


def check_sequence_parallel(mode: str, tensor_parallel: int | None) -> None:
    """One-line ``InputError`` for an unknown ``--sequence-parallel`` mode, or ``on`` with
    tensor-parallel degree 1 (it shards the sequence over a tensor-parallel group)."""
    if mode not in SEQUENCE_PARALLEL_MODES:
        raise InputError(f"--sequence-parallel {mode!r} is not one of {', '.join(SEQUENCE_PARALLEL_MODES)}")
    if mode == "on" and tensor_parallel == 1:
        raise InputError(
            "--sequence-parallel on with tensor-parallel degree 1: sequence parallelism shards the "
            "sequence over a tensor-parallel group (pass --tensor-parallel 2 or more, or auto)"
        )


# Whether ``auto`` plans sequence parallelism for measured profiles. ``pipeplan run`` runs it
# (DTensor ``SequenceParallel``, ``pipeplan.tensor_parallel.sequence``), but DTensor's linear
# saves the all-gathered input whole where Megatron-LM keeps it sharded, so a measured stage
# saves less than ``split_profile`` divides: ``auto`` plans it for estimated profiles only
# (plans for Megatron-LM), and ``on`` plans it for measured ones.
RUNTIME_RUNS_SEQUENCE_PARALLEL = False


def plans_sequence_parallel(options: PartitionOptions, t: int, estimated: bool = True) -> bool:
    """Whether plans of tensor-parallel degree ``t`` run sequence parallelism: at t > 1 when
    ``on``, or ``auto`` where it runs (``estimated``: a what-if profile, planned for another
    engine; ``RUNTIME_RUNS_SEQUENCE_PARALLEL``). It divides the layer norms' and dropouts'
    activations and time by t, and its reduce-scatter + all-gather move an all-reduce's
    bytes: never slower, never larger, so ``auto`` needs no search."""
    if t < 2 or options.sequence_parallel == "off":
        return False
    return options.sequence_parallel == "on" or estimated or RUNTIME_RUNS_SEQUENCE_PARALLEL
