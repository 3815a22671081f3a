"""``partition(profile, topology, options) -> Plan``: the planner's single entry point.

Runs the hierarchical DP (``planner.dp``, pipeplan cost model) or PipeDream's optimizer
(``planner.pipedream_dp``), places the stages on ranks (``planner.placement``), recomputes
every stage's memory exactly (``planner.memory``) and fills a ``pipeplan.plan.Plan`` with
per-stage and predicted figures (ms per minibatch, bytes per device).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.plan import Plan, StagePlan
from pipeplan.planner import tp_pricing as tp
from pipeplan.planner.assemble import assemble_plan, data_parallel_ms, stage_figures
from pipeplan.planner.cost_models import cost_model
from pipeplan.planner.costs import LayerArrays, layer_arrays
from pipeplan.planner.cuts import CutFamily, cut_family
from pipeplan.planner.dp import DPSettings, StageNode, reconstruct, solve
from pipeplan.planner.flush_bound import flush_period_bound_ms
from pipeplan.planner.interleave import partition_interleaved, plan_interleaved_shape
from pipeplan.planner.memory import backward_temporary_bytes
from pipeplan.planner.offload import base_mode, host_bandwidth, offload_of
from pipeplan.planner.options import (
    PartitionOptions,
    charged_optimizer,
    planned_fsdp,
    planned_shard_modes,
    plans_sequence_parallel,
)
from pipeplan.planner.pipedream_dp import PipeDreamSettings, solve_pipedream
from pipeplan.planner.placement import flatten
from pipeplan.planner.predict import predict
from pipeplan.planner.recompute import effective_mode, gain_bytes, planned_on_estimates, schedule_recomputes
from pipeplan.planner.recompute_choice import recompute_candidates
from pipeplan.planner.shard_choice import stage_shard
from pipeplan.planner.sharding import shard_memory_bytes
from pipeplan.planner.simulate import SimulationTooLarge
from pipeplan.planner.targets import ENGINES, blocked_summary, most_stages, target_cuts, target_family
from pipeplan.planner.uniform import uniform_trees
from pipeplan.precision import Precision
from pipeplan.profile import Profile
from pipeplan.schedules import names_where, or_list, schedule_kind
from pipeplan.topology import Topology
from pipeplan.units import format_bytes

__all__ = [
    "Dominated",
    "PartitionOptions",
    "partition",
    "resimulated",
    "plan_uniform",
    "data_parallel_ms",
    "stage_figures",
    "charged_optimizer",
    "flush_in_flight",
    "planned_recompute",
]


def _least_in_flight(options: PartitionOptions, world_size: int) -> float:
    """Fewest minibatches of activations the schedule charges any stage: its last stage's."""
    return _least_in_flight_of(options.schedule, options.microbatches, world_size)


@functools.lru_cache(maxsize=256)
def _least_in_flight_of(schedule: str, micro: int, world_size: int) -> float:
    """``_least_in_flight`` (memoised: the action list of a pipeline as deep as the world is
    O(M) to build, and ``partition`` asks once per tensor-parallel degree)."""
    kind = schedule_kind(schedule)
    depth = max(world_size, 2 if kind.virtual_stages else 1)
    if kind.in_flight is not None and not kind.virtual_stages:  # its closed form: no action list
        return kind.activations_in_flight((1,) * depth, depth - 1, micro)
    if kind.virtual_stages:
        micro = depth * math.ceil(micro / depth)
    elif kind.gradients == "delayed":
        micro = max(micro, depth)
    virtual = 2 if kind.virtual_stages else 1
    return min(kind.in_flight_by_chunk((1,) * depth, depth - 1, micro, virtual))


def _least_need_bytes(profile: Profile, topology: Topology, options: PartitionOptions) -> list[float]:
    """Each layer's bytes on one device even in the most favourable position (one weight
    version, the last stage's activations in flight, the most sharing replicas of level 1
    in its least hungry shard mode): no stage holding it needs less."""
    least_in_flight = _least_in_flight(options, topology.world_size)
    precision = Precision(profile.dtype, profile.master_dtype)
    most = topology.levels[0].count
    planned = planned_shard_modes(options, topology)  # refuses an offload request first, as the DP does
    modes = ("none",) + (planned if most > 1 else ())
    out = []
    gains = gain_bytes(profile)
    for layer in profile.layers:
        choices = recompute_candidates(
            profile, (layer.index,), options.microbatches, options.recompute, gains
        )
        if options.recompute in ("full", "selective"):
            choices = choices[-1:]
        out.append(
            min(
                shard_memory_bytes(
                    mode,
                    float(layer.param_bytes),
                    choice.activation_bytes,
                    1,
                    least_in_flight,
                    options.optimizer,
                    precision,
                    most,
                    backward_temporary_bytes(
                        float(layer.largest_tensor_bytes),
                        float(profile.charged_working_bytes[layer.index]),
                        options.microbatches,
                        precision,
                    )
                    + choice.transient_bytes,
                    float(layer.param_bytes),
                )
                for mode in modes
                for choice in choices
            )
        )
    return out


def _infeasible_message(
    arrays: LayerArrays, profile: Profile, topology: Topology, options: PartitionOptions
) -> str:
    """Name the layer that needs the most memory even in the most favourable position, or,
    where no layout exists whatever the memory, say so (``_layout_message``)."""
    layout = _layout_message(arrays.layers, topology.world_size, options)
    if layout is not None:
        return layout
    need = _least_need_bytes(profile, topology, options)
    worst = max(range(len(need)), key=lambda i: need[i])
    memory = topology.device.memory_bytes
    if need[worst] > memory:
        layer = profile.layers[worst]
        return (
            f"no plan fits in {format_bytes(memory)} per device: layer {worst} ({layer.name}) alone "
            f"needs {format_bytes(need[worst])} ({options.optimizer}, schedule {options.schedule})"
        )
    return (
        f"no plan fits in {format_bytes(memory)} per device with schedule {options.schedule} on "
        f"{topology.world_size} devices: the smallest stage that cannot fit is layer {worst} "
        f"({profile.layers[worst].name}) with its minibatches in flight; it needs at least "
        f"{format_bytes(need[worst])} with one ({_infeasible_hint(options)})"
    )


def _layout_message(layers: int, devices: int, options: PartitionOptions) -> str | None:
    """Why no plan exists at any memory, or None: ``straight`` puts one device on each stage
    and, without ``use_fewer_devices``, every device holds one, so a pipeline needs as many
    stages as devices; ``max_stages`` or the ``layers`` may allow fewer."""
    most = min(layers, options.max_stages or layers)
    if not options.straight or options.use_fewer_devices or most >= devices:
        return None
    limit = f"--max-stages {options.max_stages}" if most == options.max_stages else f"{layers} layer(s)"
    return (
        f"no plan lays out {devices} devices at one device a stage (straight) with {limit}: "
        f"at most {most} stage(s), whatever the memory (pass --use-fewer-devices, or drop --straight "
        f"to let a stage hold replicas)"
    )


def _infeasible_hint(options: PartitionOptions) -> str:
    kind = schedule_kind(options.schedule)
    if options.recompute == "none" and kind.recomputes_layers:
        return "try --recompute auto, more --microbatches or more devices"
    if kind.whole_minibatches:
        return "try --schedule auto, a schedule with micro-batches, or more devices"
    return "try more --microbatches, --schedule auto or more devices"


def _solve_pipedream(
    arrays: LayerArrays, topology: Topology, options: PartitionOptions, cap_ms: float = math.inf
) -> tuple[float, tuple[StageNode, ...], frozenset]:
    del cap_ms  # PipeDream's DP fills every table: no limit to prune with
    result = solve_pipedream(
        arrays,
        topology,
        PipeDreamSettings(
            options.straight,
            options.use_fewer_devices,
            options.memory_check,
            options.activation_compression_ratio,
        ),
    )
    return result.time_ms, result.stages, result.single_stage_nodes


def _solve_pipeplan(
    arrays: LayerArrays, topology: Topology, options: PartitionOptions, cap_ms: float = math.inf
) -> tuple[float, tuple[StageNode, ...], frozenset]:
    settings = DPSettings(
        options.schedule,
        options.optimizer,
        options.straight,
        options.max_stages,
        options.use_fewer_devices,
        options.memory_check,
        flush_in_flight(options, arrays.layers, topology.world_size),
        deferred_in_flight(options, arrays.layers, topology.world_size),
        arrays.precision,
        microbatches=options.microbatches,
        recompute=options.recompute,
        shard=planned_shard_modes(options, topology),
        fsdp_recomputes=options.shard != "auto",
        host_bandwidth_bytes_per_s=host_bandwidth(topology),
    )
    solution = solve(arrays, topology, settings, cap_ms=cap_ms)
    if not math.isfinite(solution.time_ms):
        return math.inf, (), frozenset()
    return solution.time_ms, reconstruct(solution), frozenset()


def _target_family(profile: Profile, topology: Topology, options: PartitionOptions) -> CutFamily:
    """The cut states ``options.export_target`` can express (``planner.targets``); a one-line
    ``InputError`` when the target runs no plan with the stages and micro-batches asked."""
    target = options.export_target
    assert target is not None
    engine = ENGINES[target]
    cuts = target_cuts(profile, target)
    if cuts.refusal:
        raise InputError(f"--for {target}: {engine} runs no split of {profile.model}: {cuts.refusal}")
    least = (
        1
        if options.use_fewer_devices
        else min(topology.world_size, options.max_stages or topology.world_size)
    )
    if len(cuts.allowed) + 1 < least:
        where = (
            f"only {len(cuts.allowed)} layer boundar{'y' if len(cuts.allowed) == 1 else 'ies'} (before "
            f"layer {', '.join(map(str, cuts.allowed[:6]))})"
            if cuts.allowed
            else "no layer boundary"
        )
        raise InputError(
            f"--for {target}: {engine} can cut {profile.model} at {where}, too few for {least} stages; "
            f"blocked by {blocked_summary(cuts)} (pass --use-fewer-devices or --max-stages "
            f"{len(cuts.allowed) + 1})"
        )
    if profile.batch_size % options.microbatches:
        raise InputError(
            f"--for {target}: the batch of {profile.batch_size} samples does not split into "
            f"{options.microbatches} equal micro-batches, as {engine} splits it"
        )
    stages = min(topology.world_size, options.max_stages or topology.world_size)
    runs_as = schedule_kind(options.schedule).engine
    if runs_as is not None and runs_as.microbatch_per_stage and options.microbatches < stages:
        raise InputError(
            f"--for {target}: {options.schedule} runs as {runs_as.torch_class}, which needs a micro-batch "
            f"per stage: "
            f"--microbatches {options.microbatches} on up to {stages} stages (pass --microbatches {stages} or "
            f"more, or --max-stages {options.microbatches})"
        )
    family = target_family(cuts, profile)
    most = most_stages(family)
    if most < least:
        raise InputError(
            f"--for {target}: {engine} can run {profile.model} on at most {most} stage(s), not {least}: with more, "
            f"some stage would pass a value past the next stage (a value computed before a cut is read after the "
            f"next one); pass --use-fewer-devices or --max-stages {most}"
        )
    return family


def planned_recompute(
    options: PartitionOptions, t: int, mixed: bool = False, estimated: bool = False
) -> PartitionOptions:
    """``options`` with the recomputation mode planned at tensor-parallel degree ``t``:
    ``auto`` is ``none`` where the schedule, the degree, the cost model or mixed precision
    (``mixed``: a recomputed forward would read the float32 masters,
    ``pipeplan.capture.checkpointed``) runs none. An ``estimated`` profile (a what-if for
    another engine, ``recompute.planned_on_estimates``) plans recomputation at any degree
    and precision; ``pipeplan run`` refuses what its runtime does not run."""
    asked = options.recompute
    if mixed and asked in ("full", "selective") and not estimated:
        raise InputError(
            f"--recompute {asked} is not run under mixed precision (bf16 compute, float32 masters); "
            f"pipeplan plans it for estimated profiles only"
        )
    if asked in ("full", "selective") and not estimated and not schedule_recomputes(options.schedule):
        raise InputError(
            f"--recompute {asked} with schedule {options.schedule}: pipeplan runs recomputation with "
            f"{or_list(names_where(lambda kind: kind.recomputes_layers))} only (estimated profiles: also "
            f"interleaved 1F1B, for Megatron-LM)"
        )
    if (
        t > 1 and asked in ("full", "selective") and not estimated
    ):  # --tensor-parallel auto: other degrees may
        raise InputError(
            f"--recompute {asked} with tensor-parallel degree {t}: pipeplan recomputes layers of stages "
            f"without tensor parallelism only (estimated profiles: any degree)"
        )
    mode = effective_mode(asked, options.schedule, t, estimated)
    if (options.cost_model != "pipeplan" or not planned_on_estimates(estimated, 1, mixed)) and mode == "auto":
        mode = "none"
    return options if mode == options.recompute else replace(options, recompute=mode)


def flush_in_flight(options: PartitionOptions, states: int, world_size: int) -> float:
    """Minibatches of activations the DP charges a stage of a schedule with exact gradients
    and a closed-form count (``ScheduleKind.in_flight``): that count at the first stage of a
    straight pipeline of depth K = min(cut states, devices, max stages), which bounds every
    stage of the pipelines the DP builds (S <= K stages). For 1f1b-flush the exact count,
    min(M, S - s) / M, is at most min(M, K) / M; gpipe holds 1.0. The other schedules
    without stashing are charged 1.0 (every micro-batch of one minibatch). Equal to 1.0,
    the DP's bound before, whenever M <= K.

    >>> flush_in_flight(PartitionOptions(schedule="1f1b-flush", microbatches=512), 130, 384)
    0.25390625
    """
    kind = schedule_kind(options.schedule)
    if kind.gradients != "exact" or kind.in_flight is None:
        return 1.0
    depth = min(states, world_size, options.max_stages or world_size)
    return kind.in_flight((1,) * depth, 0, options.microbatches)


def deferred_in_flight(options: PartitionOptions, states: int, world_size: int) -> float:
    """Minibatches of units between their "I" and "W" the DP charges a stage of a
    split-backward schedule: ``flush_in_flight``, since a unit past its "I" is still held
    (so at most as many as the held units, which that bounds); 0 without a split backward."""
    if not schedule_kind(options.schedule).split_backward:
        return 0.0
    return flush_in_flight(options, states, world_size)


_SOLVERS = {"pipeplan": _solve_pipeplan, "pipedream": _solve_pipedream}  # by cost model


def partition(
    profile: Profile,
    topology: Topology,
    options: PartitionOptions = PartitionOptions(),
    *,
    resimulate: bool = True,
    beat_ms: float = math.inf,
) -> Plan:
    """The best plan of ``profile`` on ``topology`` under ``options``, over the
    tensor-parallel degrees ``planner.tp_pricing.degrees`` allows: one exact plan per
    degree (``_partition_at_tensor_degree``: ``_partition_pipeline`` on its group topology
    and split profile), the fastest (simulated) wins, ties to the smaller degree. A profile
    without splitting layers plans t = 1 only: the plan ``_partition_pipeline`` makes.
    Raises ``InputError`` for bad options or a degree the profile or topology refuse,
    ``InfeasibleError`` when no degree fits.
    ``resimulate=False`` keeps the one-minibatch window the uniform candidates were
    compared on (``resimulated`` does the rest: ``planner.auto`` calls it for its choice).
    With ``beat_ms`` (the time of a plan the caller already has) raises ``Dominated``
    when it can prove that no plan is faster, often without simulating any.
    """
    options.validate()
    if options.uniform is None:  # transformers (splitting layers) also try Megatron's uniform shapes
        options = replace(
            options, uniform=not options.export_target and any(layer.splits for layer in profile.layers)
        )
    found: list[tuple[float, int, Plan]] = []
    failure: InfeasibleError | InputError | None = None
    dominated = False
    choices = [1] if options.export_target else tp.degrees(profile, topology, options.tensor_parallel)
    if not schedule_kind(options.schedule).runs_tensor_parallel:  # plan only what `pipeplan run` runs
        if options.tensor_parallel not in (None, 1):
            raise InputError(
                f"tensor-parallel degree {options.tensor_parallel} with schedule {options.schedule}: pipeplan "
                f"runs split stages with {or_list(names_where(lambda kind: kind.runs_tensor_parallel))} only"
            )
        choices = [1]
    for t in sorted(choices, reverse=True):  # large degrees first: big models' best, pruning the rest sooner
        # only simulated periods prune: a plan too large to simulate has its bubble-free figure
        beat = min([beat_ms] + [item[0] for item in found if item[2].predicted.simulated])
        try:
            plan = _partition_at_tensor_degree(profile, topology, options, t, beat)
        except Dominated:
            dominated = True
            continue
        except InfeasibleError as exc:
            failure = exc
            continue
        except InputError as exc:  # its schedule's rules refuse this degree's stages (2bw's micro-batches
            # for its replica counts, interleaved-1f1b's for its positions): other degrees may run
            if len(choices) == 1:
                raise
            failure = InputError(f"with tensor-parallel degree {t}: {exc}")
            continue
        found.append((plan.predicted.time_per_minibatch_ms, t, plan))
    if not found:
        if dominated:  # by the caller's plan: whatever the other degrees' failures, one is faster
            raise Dominated(f"no plan beats {beat_ms:.6g} ms per minibatch")
        assert failure is not None  # every degree either planned, was dominated or failed
        raise failure
    # simulated periods first: a plan too large to simulate has only its bubble-free figure
    best = min(found, key=lambda item: (not item[2].predicted.simulated, item[0], item[1]))[2]
    if best.predicted.time_per_minibatch_ms > beat_ms:  # its bound passed, its simulation did not
        raise Dominated(f"no plan beats {beat_ms:.6g} ms per minibatch")
    return resimulated(best, profile, options) if resimulate else best


def resimulated(plan: Plan, profile: Profile, options: PartitionOptions) -> Plan:
    """``plan`` predicted over the default window when ``partition`` priced it on one
    minibatch (the uniform candidates of a flush schedule), else ``plan``."""
    if options.uniform is None:
        options = replace(
            options, uniform=not options.export_target and any(layer.splits for layer in profile.layers)
        )
    kind = schedule_kind(options.schedule)
    # priced on a one-minibatch window; interleaved plans were too, and a flush repeats it exactly
    if options.uniform and kind.flushes and not kind.virtual_stages:
        try:
            return predict(plan, profile)  # the default window, as every plan's figures
        except SimulationTooLarge:  # the one-minibatch window stands: flush minibatches repeat
            pass
    return plan


def plan_uniform(profile: Profile, topology: Topology, options: PartitionOptions, t: int, p: int) -> Plan:
    """The uniform plan of degree ``t`` and ``p`` balanced stages on every device
    (``planner.uniform``: d = devices / (t p) replicas each), priced, memory-checked and
    simulated as ``partition`` prices its candidates: what pipeplan predicts for a
    configuration chosen elsewhere (Megatron's own t, p, d; with interleaved 1F1B, v =
    ``options.virtual_stages`` chunks per device, ``planner.interleave``). ``InputError`` when the
    topology cannot lay that shape out; ``InfeasibleError`` when it does not fit."""
    options.validate()
    options = planned_recompute(
        options, t, Precision(profile.dtype, profile.master_dtype).mixed, bool(profile.estimated)
    )
    options = planned_fsdp(options, profile, topology)
    tp.check_degree(profile, topology, t)
    sp = plans_sequence_parallel(options, t, bool(profile.estimated))
    split, grouped = tp.split_profile(profile, topology, t, sp), tp.group_topology(topology, t)
    model = cost_model(options.cost_model)
    arrays = layer_arrays(split, model.charged_optimizer(options.optimizer), cut_family(split))
    if schedule_kind(options.schedule).virtual_stages:  # p positions x d replicas x v chunks
        return _expanded(
            plan_interleaved_shape(split, grouped, options, p), profile, topology, options, t, sp
        )
    for stages, _, tree in uniform_trees(arrays, grouped):
        if stages == p:
            flat = flatten(tree, grouped)
            stage_ms = max(figure[3] for figure in stage_figures(flat, arrays, grouped, options))
            plan = _tree_plan(split, grouped, options, arrays, tree, stage_ms, frozenset())
            return _expanded(plan, profile, topology, options, t, sp)
    raise InputError(
        f"no uniform plan of {p} stages with tensor-parallel degree {t} on {topology.name}: "
        f"{topology.world_size // t} groups do not split into {p} stages laid out within the levels"
    )


def _expanded(
    plan: Plan,
    profile: Profile,
    topology: Topology,
    options: PartitionOptions,
    t: int,
    sequence_parallel: bool,
) -> Plan:
    """``plan`` of the group topology on the real ranks (``tp.expand_plan``), its baselines
    those of the whole profile; ``plan`` itself when t = 1."""
    if t == 1:
        return plan
    whole = layer_arrays(profile, cost_model(options.cost_model).charged_optimizer(options.optimizer))
    baselines = (whole.compute(0, whole.layers), data_parallel_ms(whole, topology, options.cost_model))
    return tp.expand_plan(plan, topology, t, baselines_ms=baselines, sequence_parallel=sequence_parallel)


class Dominated(Exception):
    """No plan can beat a plan the search already has (``beat_ms``): every candidate's
    lower bound (its slowest stage, its flush bubble) is higher."""


def _partition_at_tensor_degree(
    profile: Profile, topology: Topology, options: PartitionOptions, t: int, beat_ms: float = math.inf
) -> Plan:
    """The best plan with tensor-parallel degree ``t`` for every stage: ``_partition_pipeline``
    on the group topology and split profile, expanded to the real ranks."""
    options = planned_recompute(
        options, t, Precision(profile.dtype, profile.master_dtype).mixed, bool(profile.estimated)
    )
    options = planned_fsdp(options, profile, topology)
    if options.tensor_parallel is None and not any(layer.splits for layer in profile.layers):
        # no tensor parallelism: the plan and messages as before
        return _partition_pipeline(profile, topology, options)
    if t > 1 and options.shard not in ("auto", "none"):
        raise InputError(
            f"--shard {options.shard} with tensor-parallel degree {t}: tensor-parallel stages are not sharded"
        )
    if t > 1 and options.offload not in ("auto", "none"):
        raise InputError(
            f"--offload {options.offload} with tensor-parallel degree {t}: tensor-parallel stages are not offloaded"
        )
    try:
        grouped = _partition_pipeline(
            tp.split_profile(
                profile, topology, t, plans_sequence_parallel(options, t, bool(profile.estimated))
            ),
            tp.group_topology(topology, t),
            replace(options, shard="none", offload="none") if t > 1 else options,
            beat_ms,
        )
    except InfeasibleError as exc:
        raise InfeasibleError(f"with tensor-parallel degree {t} (groups of {t} devices): {exc}") from exc
    if t == 1:
        return grouped
    model = cost_model(options.cost_model)
    arrays = layer_arrays(profile, model.charged_optimizer(options.optimizer))
    baselines = (arrays.compute(0, arrays.layers), data_parallel_ms(arrays, topology, options.cost_model))
    return tp.expand_plan(
        grouped,
        topology,
        t,
        baselines_ms=baselines,
        sequence_parallel=plans_sequence_parallel(options, t, bool(profile.estimated)),
    )


def _partition_pipeline(
    profile: Profile, topology: Topology, options: PartitionOptions, beat_ms: float = math.inf
) -> Plan:
    """The best plan of ``profile`` on ``topology`` under ``options``, without tensor parallelism.

    Its predicted time, throughput and per-stage figures are those of its own schedule,
    bubble included (``planner.predict``). ``interleaved-1f1b`` plans come from
    ``planner.interleave`` (the planner picks v unless ``options.virtual_stages``).
    With ``options.uniform`` and a flush schedule, the uniform shapes of
    ``planner.uniform`` compete with the DP's plan (simulated over one minibatch, which
    flush schedules repeat exactly); ``Dominated`` when none can beat ``beat_ms``.
    Raises ``InputError`` for bad options and ``InfeasibleError`` (one line) when no plan
    fits device memory.
    """
    options.validate()
    kind = schedule_kind(options.schedule)
    if kind.virtual_stages:
        chunked = partition_interleaved(profile, topology, options, beat_ms)
        if chunked is None:
            raise Dominated()
        return chunked
    model = cost_model(options.cost_model)
    family = _target_family(profile, topology, options) if options.export_target else cut_family(profile)
    arrays = layer_arrays(profile, model.charged_optimizer(options.optimizer), family)
    if (
        options.memory_check
        and model.checks_memory
        and max(_least_need_bytes(profile, topology, options)) > topology.device.memory_bytes
    ):
        raise InfeasibleError(
            _infeasible_message(arrays, profile, topology, options)
        )  # what the DP would find
    uniform = options.uniform and kind.flushes
    charged = model.charged_optimizer(options.optimizer)
    bubble = model.predicts_by_simulation(kind)  # the flush bound holds for simulated periods
    # a flush plan's period is never below its slowest stage, the DP's time: the DP need not
    # look past the plan to beat (ties kept: the caller prefers the smaller degree)
    cap_ms = beat_ms * (1 + 1e-9) if uniform and bubble else math.inf
    time_ms, tree, single_nodes = _SOLVERS[model.name](arrays, topology, options, cap_ms)
    if not math.isfinite(time_ms) and not uniform:
        raise InfeasibleError(_infeasible_message(arrays, profile, topology, options))
    if not uniform:
        return _tree_plan(profile, topology, options, arrays, tree, time_ms, single_nodes)

    def bound_ms(stage_ms: float, shape: tuple[StageNode, ...]) -> float:
        if not bubble:
            return stage_ms
        flat = flatten(shape, topology)
        bound = flush_period_bound_ms(profile, family, flat, options.schedule, options.microbatches, charged)
        return max(
            stage_ms, bound * (1 - 1e-12)
        )  # 1e-12: its sums add in another order than the simulation's

    # the DP's first: it wins ties. It charges a 1f1b-flush stage min(M, K) / M minibatches of
    # activations (K >= stages, ``flush_in_flight``) where a uniform pipeline of p stages holds
    # min(M, p - s) / M: with few micro-batches the DP may find nothing that the uniform shapes do
    candidates = [(bound_ms(time_ms, tree), time_ms, tree, single_nodes)] if math.isfinite(time_ms) else []
    failure: Exception = (
        Dominated()
        if candidates or math.isfinite(cap_ms)  # a DP capped at the plan to beat found none faster
        else InfeasibleError(_infeasible_message(arrays, profile, topology, options))
    )
    for _, _, shape in uniform_trees(arrays, topology):
        flat = flatten(shape, topology)
        stage_ms = max(figure[3] for figure in stage_figures(flat, arrays, topology, options))
        candidates.append((bound_ms(stage_ms, shape), stage_ms, shape, frozenset()))
    best: Plan | None = None
    unsimulated: Plan | None = None  # the first plan too large to simulate, kept when none simulates
    for bound, stage_ms, shape, nodes in sorted(
        candidates, key=lambda item: item[0]
    ):  # stable: DP, then fewer stages
        if bound > beat_ms or (best is not None and bound >= best.predicted.time_per_minibatch_ms):
            break  # a period is never below its bound (slowest stage, flush bubble): no later candidate can win
        try:
            plan = _tree_plan(profile, topology, options, arrays, shape, stage_ms, nodes, steady=1)
        except InfeasibleError as exc:  # does not fit (a flush schedule runs any replica counts)
            if shape is tree:
                failure = exc
            continue
        if not plan.predicted.simulated:  # too large to simulate: its bubble-free figure ranks with no other
            unsimulated = unsimulated or plan
        elif best is None or plan.predicted.time_per_minibatch_ms < best.predicted.time_per_minibatch_ms * (
            1 - 1e-9
        ):
            best = plan
    chosen = best or unsimulated
    if chosen is None:
        raise failure
    return chosen


def _tree_plan(
    profile: Profile,
    topology: Topology,
    options: PartitionOptions,
    arrays: LayerArrays,
    tree: tuple[StageNode, ...],
    time_ms: float,
    single_nodes: frozenset,
    steady: int = 8,
) -> Plan:
    """The plan of the stage ``tree``: placed, priced, its memory checked exactly
    (``InfeasibleError``), predicted by simulating its schedule when the cost model does."""
    kind = schedule_kind(options.schedule)
    model = cost_model(options.cost_model)
    family = arrays.cut_family
    flat = flatten(tree, topology)
    replicas = [stage.replicas for stage in flat]
    kind.check(replicas, options.microbatches)
    figures = stage_figures(flat, arrays, topology, options, single_nodes)
    stages = []
    checked = options.memory_check and model.checks_memory
    limit = topology.device.memory_bytes if checked else None
    gains = gain_bytes(profile)
    for q, (stage, figure) in enumerate(zip(flat, figures)):
        layers = family.stage_layers(stage.start, stage.end)
        shard = stage_shard(
            stage,
            q,
            replicas,
            arrays,
            topology,
            options.schedule,
            options.optimizer,
            options.microbatches,
            planned_shard_modes(options, topology),
            figure,
            limit,
            recompute_candidates(profile, layers, options.microbatches, options.recompute, gains),
            options.recompute,
            fsdp_recomputes=options.shard != "auto",
        )
        compute, allreduce, comm, stage_time = shard.figures
        memory, versions, in_flight = shard.memory_bytes, shard.versions, shard.in_flight
        if checked and (shard.recompute is None or memory > topology.device.memory_bytes):
            raise InfeasibleError(
                f"no plan fits in {format_bytes(topology.device.memory_bytes)} per device with schedule "
                f"{options.schedule}: stage {q} of the fastest split needs {format_bytes(memory)} "
                f"({_infeasible_hint(options)})"
            )
        # the recomputed forwards run in the stage's backward (in ``shard.figures``' compute)
        recomputed = shard.recompute.layers if shard.recompute is not None else ()
        selective = shard.recompute.selective if shard.recompute is not None else ()
        extra_ms = shard.recompute.extra_ms if shard.recompute is not None else 0.0
        stages.append(
            StagePlan(
                index=q,
                layer_start=min(layers),
                layer_end=max(layers) + 1,
                layers=layers,
                replicas=stage.replicas,
                ranks=stage.ranks,
                compute_ms=compute,
                allreduce_ms=allreduce,
                communication_ms=comm,
                time_per_minibatch_ms=stage_time,
                memory_bytes=memory,
                weight_versions=versions,
                in_flight=int(math.ceil(in_flight)),
                recompute_layers=recomputed,
                selective_layers=selective,
                recompute_ms=extra_ms,
                shard=base_mode(shard.mode),
                shard_degree=shard.degree if base_mode(shard.mode) != "none" else 1,
                offload=offload_of(shard.mode),
                offload_ms=shard.offload_ms,
            )
        )
    plan = assemble_plan(profile, topology, options, arrays, tuple(stages), time_ms, family=family)
    if not model.predicts_by_simulation(kind):
        return plan
    try:
        return predict(plan, profile, steady=steady)
    except SimulationTooLarge:  # keeps the cost model's figures, marked not simulated
        return plan
