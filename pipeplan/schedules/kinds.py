"""The schedule registry: every schedule's facts and action generator in one ``ScheduleKind``.

Every schedule is one ``ScheduleKind`` in ``SCHEDULE_KINDS``: its facts (flushes,
gradient semantics, split backward, virtual stages, micro-batch rules, its counterpart in
torch.distributed.pipelining and torchtitan, what the runtime runs under it, which one is
the default) and its action generator live there and nowhere else. The memory-relevant
counts are shared with the planner's memory model. Everything else reads the record:
``SCHEDULE_NAMES`` (the plan contract's names), the planner's ``--for`` schedules and
flush-period bound, the runtime's checks, the export tables and the CLI choices. Adding a
schedule is a generator in ``orders.py`` plus a record here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeplan.errors import InputError
from pipeplan.schedules.actions import Action, Schedule, Worker, noam, replica_lanes, warmup_forwards
from pipeplan.schedules.orders import (
    clear_caches,
    worker_1f1b_flush,
    worker_1f1b_rr,
    worker_2bw,
    worker_gpipe,
    worker_interleaved,
    worker_zb_h1,
    worker_zbv,
)
from pipeplan.schedules.peak import ChunkWeights, units_at_peak
from pipeplan.schedules.v_orders import worker_dualpipev, worker_v_half, worker_v_min

__all__ = [
    "DEFAULT_SCHEDULE",
    "DEFAULT_TARGET_SCHEDULE",
    "SCHEDULE_KINDS",
    "SCHEDULE_NAMES",
    "TARGET_SCHEDULES",
    "EngineSchedule",
    "ScheduleKind",
    "activations_in_flight",
    "build_schedule",
    "names_where",
    "or_list",
    "schedule_kind",
    "weight_versions",
]

Generator = Callable[[tuple[int, ...], int, int, int, int, int], list[Action]]
# (replicas per position, position, replica, minibatches, microbatches, virtual stages)


@dataclass(frozen=True)
class EngineSchedule:
    """A schedule's counterpart in torch.distributed.pipelining and torchtitan (``pipeplan export``).

    Both engines run one device per stage with a flush schedule; these are the facts the
    export and ``partition --for`` read about the torch class a plan maps to.
    """

    torch_class: str  # torch.distributed.pipelining class (torch 2.13 schedules.py), e.g. "Schedule1F1B"
    torchtitan_name: str  # torchtitan's pipeline_parallel_schedule (torch's get_schedule_class names)
    # the class needs at least one micro-batch per stage (Schedule1F1B refuses fewer)
    microbatch_per_stage: bool = False
    # a multi-stage class (several stages per rank): micro-batches a multiple of max(1, M // ranks)
    multi_stage: bool = False
    # `partition --for pipelining|torchtitan` may plan it: one chunk per device, cut by the DP
    # (interleaved-1f1b and zb-h1 are cut by balance or need micro-batch rules per stage count)
    plannable: bool = False
    # no class of torch's runs its order: torch's _PipelineScheduleRuntime loads the plan's own
    # action table (``_load_csv``); torchtitan_name is then "" (torchtitan names no class for it)
    action_table: bool = False


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule and every fact about it (the only place these facts live).

    ``gradients``: "exact" (every minibatch's gradient at the weights it started from;
    flush schedules), "stashed" (PipeDream 1F1B-RR: each minibatch's backward on the
    weights of its own forward, staleness depending on the stage), "delayed"
    (PipeDream-2BW: W(t+1) = W(t) - lr * grad f(W(t-1)), staleness 1 everywhere).

    Derived facts are properties: ``runs_tensor_parallel`` (the runtime splits stages
    tensor-parallel under it) and ``flush_period_bounded`` (``planner.flush_bound`` prices it).
    """

    name: str
    summary: str  # one line for --help and reports
    flushes: bool  # the pipeline drains every minibatch (no overlap across minibatches)
    gradients: str  # "exact" | "stashed" | "delayed"
    split_backward: bool  # backward runs as "I" (input grads) then "W" (weight grads)
    virtual_stages: bool  # more than one model chunk per device (then v >= 2 is required)
    whole_minibatches: bool  # micro-batches must be 1
    generate: Generator
    # closed form of activations_in_flight (replicas, stage, microbatches); None: the action list's peak
    in_flight: Callable[[Sequence[int], int, int], float] | None = None
    # its counterpart in torch.distributed.pipelining and torchtitan; None: neither runs it
    # and `pipeplan export` refuses its plans
    engine: EngineSchedule | None = None
    # how `pipeplan export` names a schedule without an engine when it refuses it
    # (e.g. "1F1B-RR (PipeDream weight stashing, no flush)"); "": its name
    export_description: str = ""
    # `pipeplan run --recompute` may recompute activations in backward under it
    supports_recompute: bool = False
    # the planner may choose, and `pipeplan run` runs, per-layer recomputation
    # (torch.utils.checkpoint on a stage's chosen layers, ``pipeplan.planner.recompute``):
    # schedules without weight versions (a recomputed forward must see the forward's weights)
    # and with whole backwards
    recomputes_layers: bool = False
    # V placement (ZB-V): exactly two chunks per device, chunk 1 of position i holding the
    # layers mirrored around the middle (``actions.v_segment``); no Megatron micro-batch rule
    v_shape: bool = False
    # whole backwards ("B") mix with split ones ("I" ... "W") in one order (DualPipeV)
    mixes_backward: bool = False
    # micro-batches >= this many per device (DualPipeV: 2, one per model stage, as torch's class)
    least_microbatches_per_device: int = 0
    # with chunks and every position on d replicas (M a multiple of d: ``replica_lanes``),
    # each replica runs the schedule's own order of M / d micro-batches on its micro-batches:
    # d copies of the pipeline meeting at "S" (PTD-P's data parallelism), so the simulator
    # prices one of them (flush schedules of one chunk do so always)
    replica_pipelines: bool = False
    default: bool = False  # plain `pipeplan partition`'s schedule (exactly one kind)
    default_for_targets: bool = False  # `partition --for`'s schedule (exactly one kind, plannable)

    @property
    def runs_tensor_parallel(self) -> bool:
        """Whether pipeplan runs stages split tensor-parallel under this schedule: exact
        gradients and one backward per micro-batch (weight stashing of DTensors, 2BW's
        delayed weights and ZB-H1's split backward are not built for split stages)."""
        return self.gradients == "exact" and not self.split_backward

    @property
    def flush_period_bounded(self) -> bool:
        """Whether ``planner.flush_bound``'s lower bound of the period covers it: a flush of
        one chunk per device with whole backwards (the next minibatch starts after "S")."""
        return self.flushes and not self.split_backward and not self.virtual_stages

    @property
    def exported_as(self) -> str:
        """How ``pipeplan export`` names it in a refusal: ``export_description`` or the name."""
        return self.export_description or self.name

    # ------------------------------------------------------------ rules
    def check(
        self,
        stage_replicas: Sequence[int],
        microbatches: int,
        virtual_stages: int = 1,
        minibatches: int | None = None,
    ) -> None:
        """Raise a one-line ``InputError`` when the counts break this schedule's rules."""
        replicas = _replicas(stage_replicas)
        if microbatches < 1 or (minibatches is not None and minibatches < 1):
            raise InputError(f"minibatches and microbatches must be >= 1 (got {minibatches}, {microbatches})")
        if self.v_shape and virtual_stages != 2:
            raise InputError(f"{self.name} runs exactly 2 chunks per device in a V (got {virtual_stages})")
        if self.virtual_stages and not self.v_shape:
            if virtual_stages < 2:
                raise InputError(
                    f"{self.name} needs virtual stages >= 2 (got {virtual_stages}); "
                    "with one chunk per device use 1f1b-flush"
                )
            lanes = replica_lanes(replicas, microbatches) if self.replica_pipelines else 1
            if (microbatches // lanes) % len(replicas):
                per = f"micro-batches per pipeline ({microbatches} / {lanes} replicas)" if lanes > 1 else ""
                raise InputError(
                    f"{self.name} needs {per or f'micro-batches ({microbatches})'} to be a multiple of "
                    f"the {len(replicas)} pipeline positions (Megatron's rule)"
                )
        elif not self.virtual_stages and virtual_stages != 1:
            raise InputError(
                f"{self.name} runs one model chunk per device (got virtual stages {virtual_stages})"
            )
        least = self.least_microbatches_per_device * len(replicas)
        if microbatches < least:
            raise InputError(
                f"{self.name} needs micro-batches >= {self.least_microbatches_per_device} x "
                f"{len(replicas)} devices = {least} (got {microbatches}), one per model stage"
            )
        if self.whole_minibatches and microbatches != 1:
            raise InputError(f"{self.name} runs whole minibatches (got microbatches={microbatches})")
        if self.gradients == "stashed" and minibatches is not None:
            period = math.lcm(*replicas)
            if minibatches % period:
                raise InputError(
                    f"{self.name} needs minibatches ({minibatches}) to be a multiple of "
                    f"lcm(replicas {list(replicas)}) = {period}, so replicas all-reduce in lock step"
                )
        if self.gradients == "delayed":
            least = max(n * (warmup_forwards(replicas, s) + 1) for s, n in enumerate(replicas))
            if microbatches < least:
                raise InputError(
                    f"{self.name} needs micro-batches ({microbatches}) >= {least} so that two "
                    f"weight versions suffice: every replica takes at least its warm-up of a "
                    f"minibatch's micro-batches (the pipeline depth without replication)"
                )

    # ------------------------------------------------------------ memory facts
    def weight_versions(self, stage_replicas: Sequence[int], stage: int) -> int:
        """Weight versions a replica of position ``stage`` keeps in use at once."""
        if self.gradients == "stashed":
            return warmup_forwards(stage_replicas, stage) + 1
        if self.gradients == "delayed":
            return 2
        return 1

    def in_flight_by_chunk(
        self,
        stage_replicas: Sequence[int],
        stage: int,
        microbatches: int = 1,
        virtual_stages: int = 1,
        weights: ChunkWeights | None = None,
    ) -> tuple[float, ...]:
        """Minibatches' worth of saved activations of each chunk on a device of ``stage``.

        Taken at the device's peak over one minibatch of the first replica: of units held
        (``peak_in_flight``), or, given ``weights`` (what a unit of each chunk holds, and
        what it holds besides from its "I" to its "W"), of the bytes they hold, as the
        simulator takes it; a unit of chunk c holds 1/M of chunk c's minibatch activations.
        The chunks of a V or an interleaved device differ in size, and the moment with the
        most units need not hold the most bytes. O(M * v) from the action list.
        """
        return _peak_by_chunk(self, _replicas(stage_replicas), stage, microbatches, virtual_stages, weights)[
            0
        ]

    def deferred_by_chunk(
        self,
        stage_replicas: Sequence[int],
        stage: int,
        microbatches: int = 1,
        virtual_stages: int = 1,
        weights: ChunkWeights | None = None,
    ) -> tuple[float, ...]:
        """Minibatches' worth of each chunk's units between their input pass ("I") and weight
        pass ("W") at the same peak as ``in_flight_by_chunk``: each holds what its "I" recorded
        for its "W" (``LayerProfile.deferred_weight_bytes``). All 0 without a split backward."""
        if not self.split_backward:
            return (0.0,) * virtual_stages
        return _peak_by_chunk(self, _replicas(stage_replicas), stage, microbatches, virtual_stages, weights)[
            1
        ]

    def activations_in_flight(
        self, stage_replicas: Sequence[int], stage: int, microbatches: int = 1, virtual_stages: int = 1
    ) -> float:
        """Minibatches' worth of saved activations a replica of ``stage`` holds at its peak.

        1f1b-rr: W_s + 1 whole minibatches. 1f1b-flush: min(M, S - s) micro-batches of
        size 1/M each (exact without replication; with it a bound no replica's order
        exceeds, ``orders.flush_window``). gpipe: all M micro-batches, i.e. one whole
        minibatch. The others (interleaved-1f1b summed over the device's chunks, 2bw,
        zb-h1 held until "W"): the peak of their action list (``in_flight_by_chunk``).
        """
        if self.in_flight is not None:
            return self.in_flight(stage_replicas, stage, microbatches)
        return sum(self.in_flight_by_chunk(stage_replicas, stage, microbatches, virtual_stages))

    # ------------------------------------------------------------ pacing facts
    def minibatches_per_step(self, stage_replicas: Sequence[int]) -> int:
        """Minibatches in one training step: lcm(replicas) for stashed 1F1B-RR, else 1.

        >>> SCHEDULE_KINDS["1f1b-rr"].minibatches_per_step((2, 1, 3))
        6
        """
        return math.lcm(*stage_replicas) if self.gradients == "stashed" else 1

    def minibatches_in_flight(self, stage_replicas: Sequence[int]) -> int:
        """Minibatches overlapping in the pipeline: NOAM for 1F1B-RR, 2 for 2BW, else 1."""
        if self.gradients == "stashed":
            return noam(stage_replicas)
        if self.gradients == "delayed":
            return 2
        return 1

    def forward_version(self, minibatch: int, steps_done: int) -> int:
        """Weight version (optimizer steps applied) a forward of ``minibatch`` runs on.

        ``steps_done``: steps this worker has applied when the forward starts. Stashed and
        exact: the newest. Delayed (2BW): version ``minibatch - 1`` (the weights after the
        step of minibatch t - 2), version 0 for the first two minibatches.
        """
        if self.gradients == "delayed":
            return max(0, minibatch - 1)
        return steps_done

    def actions(
        self, stage_replicas: Sequence[int], minibatches: int, microbatches: int = 1, virtual_stages: int = 1
    ) -> dict[Worker, tuple[Action, ...]]:
        """Every worker's ordered actions (after ``check``)."""
        replicas = _replicas(stage_replicas)
        self.check(replicas, microbatches, virtual_stages, minibatches)
        try:
            return {
                (s, r): tuple(self.generate(replicas, s, r, minibatches, microbatches, virtual_stages))
                for s, n in enumerate(replicas)
                for r in range(n)
            }
        finally:
            clear_caches()  # keep no Actions beyond the schedule that holds them


@functools.lru_cache(maxsize=1024)
def _peak_by_chunk(
    kind: ScheduleKind,
    replicas: tuple[int, ...],
    stage: int,
    microbatches: int,
    virtual_stages: int,
    weights: ChunkWeights | None = None,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``ScheduleKind.in_flight_by_chunk`` and ``deferred_by_chunk``, cached: the planner asks
    for every chunk of every position of every candidate (the same position's answer v times).
    The peak is ``units_at_peak``'s, the simulator's rule: of the most bytes held given
    ``weights``, else of the most units (the most past their "I" among those)."""
    actions = kind.generate(replicas, stage, 0, 1 if kind.flushes else 4, microbatches, virtual_stages)
    held, deferred = units_at_peak(actions, virtual_stages, weights)
    return tuple(n / microbatches for n in held), tuple(n / microbatches for n in deferred)


def _replicas(stage_replicas: Sequence[int]) -> tuple[int, ...]:
    replicas = tuple(int(n) for n in stage_replicas)
    if not replicas or any(n < 1 for n in replicas):
        raise InputError(f"stage replicas must be >= 1 for every stage (got {list(replicas)})")
    return replicas


def _rr_in_flight(stage_replicas: Sequence[int], stage: int, microbatches: int) -> float:
    return float(warmup_forwards(stage_replicas, stage) + 1)  # W_s + 1 whole minibatches


def _flush_in_flight(stage_replicas: Sequence[int], stage: int, microbatches: int) -> float:
    return min(microbatches, len(stage_replicas) - stage) / microbatches  # S - s micro-batches


def _gpipe_in_flight(stage_replicas: Sequence[int], stage: int, microbatches: int) -> float:
    return 1.0  # all M micro-batches: one whole minibatch


SCHEDULE_KINDS: dict[str, ScheduleKind] = {
    kind.name: kind
    for kind in (
        ScheduleKind(
            "1f1b-rr",
            "PipeDream 1F1B-RR: weight stashing, no flush",
            flushes=False,
            gradients="stashed",
            split_backward=False,
            virtual_stages=False,
            whole_minibatches=True,
            generate=worker_1f1b_rr,
            in_flight=_rr_in_flight,
            export_description="1F1B-RR (PipeDream weight stashing, no flush)",
            default=True,
        ),
        ScheduleKind(
            "1f1b-flush",
            "1F1B with a flush per minibatch (PipeDream-Flush)",
            flushes=True,
            gradients="exact",
            split_backward=False,
            virtual_stages=False,
            whole_minibatches=False,
            generate=worker_1f1b_flush,
            in_flight=_flush_in_flight,
            engine=EngineSchedule("Schedule1F1B", "1F1B", microbatch_per_stage=True, plannable=True),
            default_for_targets=True,
            recomputes_layers=True,
        ),
        ScheduleKind(
            "gpipe",
            "GPipe: all forwards, then all backwards, per minibatch",
            flushes=True,
            gradients="exact",
            split_backward=False,
            virtual_stages=False,
            whole_minibatches=False,
            generate=worker_gpipe,
            in_flight=_gpipe_in_flight,
            engine=EngineSchedule("ScheduleGPipe", "GPipe", plannable=True),
            supports_recompute=True,
            recomputes_layers=True,
        ),
        ScheduleKind(
            "interleaved-1f1b",
            "Megatron interleaved 1F1B: v model chunks per device",
            flushes=True,
            gradients="exact",
            split_backward=False,
            virtual_stages=True,
            whole_minibatches=False,
            generate=worker_interleaved,
            engine=EngineSchedule("ScheduleInterleaved1F1B", "Interleaved1F1B", multi_stage=True),
            replica_pipelines=True,
        ),
        ScheduleKind(
            "2bw",
            "PipeDream-2BW: two weight versions, one step of delay, no flush",
            flushes=False,
            gradients="delayed",
            split_backward=False,
            virtual_stages=False,
            whole_minibatches=False,
            generate=worker_2bw,
            export_description="2BW (PipeDream-2BW double-buffered weights, no flush)",
        ),
        ScheduleKind(
            "zb-h1",
            "zero bubble H1: 1F1B with weight gradients deferred",
            flushes=True,
            gradients="exact",
            split_backward=True,
            virtual_stages=False,
            whole_minibatches=False,
            generate=worker_zb_h1,
            engine=EngineSchedule("ScheduleInterleavedZeroBubble", "InterleavedZeroBubble", multi_stage=True),
        ),
        ScheduleKind(
            "zb-v",
            "zero bubble V: two chunks per device in a V, weight gradients deferred",
            flushes=True,
            gradients="exact",
            split_backward=True,
            virtual_stages=True,
            whole_minibatches=False,
            generate=worker_zbv,
            engine=EngineSchedule("ScheduleZBVZeroBubble", "ZBVZeroBubble", multi_stage=True),
            v_shape=True,
        ),
        ScheduleKind(
            "v-half",
            "V-Half: two chunks in a V, toward half of 1F1B's activation memory as p grows (controllable memory)",
            flushes=True,
            gradients="exact",
            split_backward=True,
            virtual_stages=True,
            whole_minibatches=False,
            generate=worker_v_half,
            engine=EngineSchedule("_PipelineScheduleRuntime", "", multi_stage=True, action_table=True),
            v_shape=True,
        ),
        ScheduleKind(
            "v-min",
            "V-Min: two chunks in a V, toward a third of 1F1B's activation memory as p grows (controllable memory)",
            flushes=True,
            gradients="exact",
            split_backward=True,
            virtual_stages=True,
            whole_minibatches=False,
            generate=worker_v_min,
            engine=EngineSchedule("_PipelineScheduleRuntime", "", multi_stage=True, action_table=True),
            v_shape=True,
        ),
        ScheduleKind(
            "dualpipev",
            "DualPipeV: DeepSeek's DualPipe folded into a V, whole and split backwards",
            flushes=True,
            gradients="exact",
            split_backward=True,
            virtual_stages=True,
            whole_minibatches=False,
            generate=worker_dualpipev,
            engine=EngineSchedule("ScheduleDualPipeV", "DualPipeV", multi_stage=True),
            v_shape=True,
            mixes_backward=True,
            least_microbatches_per_device=2,
        ),
    )
}
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULE_KINDS)  # the names a plan may carry, in registry order


def names_where(test: Callable[[ScheduleKind], bool]) -> tuple[str, ...]:
    """The registered names whose kind passes ``test``, in registry order (new kinds come last).

    >>> names_where(lambda kind: kind.runs_tensor_parallel)[:3]
    ('1f1b-flush', 'gpipe', 'interleaved-1f1b')
    """
    return tuple(name for name, kind in SCHEDULE_KINDS.items() if test(kind))


def or_list(names: Sequence[str]) -> str:
    """``"a, b or c"``: names as a message lists them.

    >>> or_list(("1f1b-flush", "gpipe", "interleaved-1f1b")), or_list(("gpipe",))
    ('1f1b-flush, gpipe or interleaved-1f1b', 'gpipe')
    """
    if len(names) < 2:
        return "".join(names)
    return f"{', '.join(names[:-1])} or {names[-1]}"


# the schedules `partition --for pipelining|torchtitan` plans
TARGET_SCHEDULES: tuple[str, ...] = names_where(lambda kind: bool(kind.engine and kind.engine.plannable))
DEFAULT_SCHEDULE: str = names_where(lambda kind: kind.default)[0]  # plain `partition`'s
DEFAULT_TARGET_SCHEDULE: str = names_where(lambda kind: kind.default_for_targets)[0]  # `partition --for`'s


def schedule_kind(name: str) -> ScheduleKind:
    """The registered kind called ``name``; ``InputError`` naming the known ones."""
    kind = SCHEDULE_KINDS.get(name)
    if kind is None:
        raise InputError(f"unknown schedule {name!r} (expected one of {', '.join(SCHEDULE_NAMES)})")
    return kind


def weight_versions(schedule: str, stage_replicas: Sequence[int], stage: int) -> int:
    """Weight versions a replica of ``stage`` keeps: W_s + 1 for 1f1b-rr, 2 for 2bw, else 1."""
    return schedule_kind(schedule).weight_versions(stage_replicas, stage)


def activations_in_flight(
    schedule: str,
    stage_replicas: Sequence[int],
    stage: int,
    microbatches: int = 1,
    virtual_stages: int = 1,
) -> float:
    """Minibatches' worth of saved activations a replica of ``stage`` holds at its peak.

    See ``ScheduleKind.activations_in_flight``; ``ValueError`` for an unknown name.
    """
    if schedule not in SCHEDULE_KINDS:
        raise ValueError(f"unknown schedule {schedule!r}")
    return SCHEDULE_KINDS[schedule].activations_in_flight(stage_replicas, stage, microbatches, virtual_stages)


# --------------------------------------------------------------------------- building


def build_schedule(
    name: str,
    stage_replicas: Sequence[int],
    minibatches: int,
    microbatches: int = 1,
    virtual_stages: int = 1,
) -> Schedule:
    """Every worker's action order for schedule ``name`` (one of ``SCHEDULE_NAMES``).

    Runs in O(workers + positions * minibatches * microbatches * virtual_stages).

    >>> s = build_schedule("1f1b-rr", (2, 1), 4)
    >>> [" ".join(map(str, s.actions[w])) for w in s.workers]
    ['F0 F2 B0 S0 B2 S2', 'F1 F3 B1 S1 B3 S3', 'F0 B0 S0 F1 B1 S1 F2 B2 S2 F3 B3 S3']
    >>> s = build_schedule("gpipe", (1, 1), 1, microbatches=2)
    >>> [" ".join(map(str, s.actions[w])) for w in s.workers]
    ['F0 F0.1 B0.1 B0 S0', 'F0 F0.1 B0.1 B0 S0']
    """
    kind = schedule_kind(name)
    replicas = _replicas(stage_replicas)
    actions = kind.actions(replicas, minibatches, microbatches, virtual_stages)
    return Schedule(name, replicas, minibatches, microbatches, actions, virtual_stages, kind.v_shape)
