"""``partition --schedule auto``: search schedule x micro-batches x virtual stages.

Every candidate is planned by ``planner.partition.partition`` (the split and the
replication under that schedule's own memory: weight versions and activations in flight
from the registry) and predicted by simulating its own schedule, so candidates compare on
the same footing. The fastest that fits device memory wins; when none fits, the error
names the smallest memory in which one of them would. Equally fast candidates (within
``TIE_REL``) go to the one with fewer micro-batches, then the least memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.plan import Plan
from pipeplan.planner.interleave import VIRTUAL_CANDIDATES
from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.partition import Dominated, partition, resimulated
from pipeplan.profile import Profile
from pipeplan.schedules import SCHEDULE_KINDS, schedule_kind
from pipeplan.topology import Topology
from pipeplan.units import format_bytes

__all__ = ["Candidate", "SearchResult", "candidate_shapes", "choose_schedule", "device_peak_bytes", "search"]

MAX_MICROBATCHES = 64  # powers of two tried up to this count (and 4 per device)
# samples per micro-batch also tried, whatever the batch: M = batch / b reaches the regime of
# Megatron's large runs (global batches of 512-3,072 sequences, micro-batches of 1-8)
MICROBATCH_SIZES = (1, 2, 4, 8)
TIE_REL = 1e-6  # simulated times this close are a tie: fewer micro-batches, then less memory


@dataclass(frozen=True)
class Candidate:
    """One (schedule, micro-batches, v) the search planned; times in ms, memory in bytes."""

    schedule: str
    microbatches: int
    virtual_stages: int
    time_per_minibatch_ms: float  # simulated, bubble included (inf: no plan)
    peak_memory_bytes: int  # per device (0: no plan)
    fits: bool
    note: str = ""  # why it has no plan, when it has none
    pruned: bool = False  # proven slower than a plan found before it, so not planned further


@dataclass(frozen=True)
class SearchResult:
    candidates: tuple[Candidate, ...]
    chosen: int  # index into candidates
    plan: Plan

    @property
    def best(self) -> Candidate:
        return self.candidates[self.chosen]


def device_peak_bytes(plan: Plan) -> int:
    """Peak bytes on the fullest device: the sum over the model stages a device runs."""
    positions = len(plan.stages) // plan.virtual_stages
    return max(sum(stage.memory_bytes for stage in plan.stages[i::positions]) for i in range(positions))


def _counts(options: PartitionOptions, batch_size: int, world_size: int) -> list[int]:
    """Micro-batch counts to try: the user's, or powers of two dividing the batch up to
    4 per device (at most ``MAX_MICROBATCHES``) and the batch split into micro-batches
    of each size in ``MICROBATCH_SIZES``.

    >>> from types import SimpleNamespace
    >>> _counts(SimpleNamespace(microbatches=1), 24, 2)
    [2, 3, 4, 6, 8, 12, 24]
    >>> _counts(SimpleNamespace(microbatches=1), 3072, 3072)[-4:]
    [384, 768, 1536, 3072]
    """
    if options.microbatches > 1:
        return [options.microbatches]
    limit = min(batch_size, 4 * world_size, MAX_MICROBATCHES)
    small = {2**k for k in range(1, 7) if 2**k <= limit and batch_size % 2**k == 0}
    large = {batch_size // b for b in MICROBATCH_SIZES if batch_size % b == 0 and batch_size // b > 1}
    return sorted(small | large) or [1]


def candidate_shapes(
    options: PartitionOptions, batch_size: int, world_size: int, schedules: Sequence[str] | None = None
) -> list[tuple[str, int, int | None]]:
    """(schedule, micro-batches, virtual stages) to plan, in registry order (only
    ``schedules`` when given).

    Schedules of whole minibatches try M = 1 only; virtual-stage schedules each v of
    ``planner.interleave.VIRTUAL_CANDIDATES`` (or the user's) with every count (the
    planner refuses the positions x replicas whose pipelines break Megatron's rule, M / d
    a multiple of p); V-shaped ones (zb-v) v = 2 with every count.
    """
    counts = _counts(options, batch_size, world_size)
    out: list[tuple[str, int, int | None]] = []
    for name, kind in SCHEDULE_KINDS.items():
        if schedules is not None and name not in schedules:
            continue
        if kind.whole_minibatches:
            out.append((name, 1, 1))
        elif kind.v_shape:  # two chunks in a V; any micro-batch count
            out += [(name, m, 2) for m in counts if options.virtual_stages in (None, 2)]
        elif kind.virtual_stages:
            virtuals = [options.virtual_stages] if options.virtual_stages else list(VIRTUAL_CANDIDATES)
            out += [(name, m, v) for v in virtuals for m in counts]
        else:
            out += [(name, m, 1) for m in counts]
    return out


def search(
    profile: Profile,
    topology: Topology,
    options: PartitionOptions,
    schedules: Sequence[str] | None = None,
    misfit_memory: bool = True,
    every_candidate: bool = False,
) -> SearchResult:
    """Plan every candidate shape (of ``schedules`` only, when given); the fastest that
    fits (ties within ``TIE_REL``: fewer micro-batches, whose per-message costs the time
    model leaves out, then the smaller peak memory, then the earlier candidate).

    Candidates are planned most micro-batches first (``_search_order``), each against the
    fastest fitting plan so far: one that provably cannot beat it (``partition``'s
    ``Dominated``: its DP's slowest stage or flush bound is higher, or its simulation is)
    is ``pruned``, listed without a figure. The choice is the same as planning every
    candidate in full, which ``every_candidate`` does (for a table of every figure).

    A candidate with no plan that fits is planned again without the memory check to
    report the memory it would need (pruned too when even that plan cannot beat the fastest
    fitting one); with ``misfit_memory=False`` only when no candidate fits (the others are
    listed without a figure: one partition each saved).
    Raises ``InfeasibleError`` naming the smallest per-device memory that one of the
    candidates' plans needs when none fits. Time: one partition and one simulation per
    candidate (two for one that does not fit).
    """
    if not misfit_memory:
        try:
            return _search(profile, topology, options, schedules, False, every_candidate)
        except InfeasibleError:
            pass  # none fits: the full search names the smallest memory that would
    return _search(profile, topology, options, schedules, True, every_candidate)


def _search(
    profile: Profile,
    topology: Topology,
    options: PartitionOptions,
    schedules: Sequence[str] | None,
    misfit_memory: bool,
    every_candidate: bool,
) -> SearchResult:
    shapes = candidate_shapes(options, profile.batch_size, topology.world_size, schedules)
    candidates: list[Candidate | None] = [None] * len(shapes)
    plans: list[Plan | None] = [None] * len(shapes)
    fastest_ms = math.inf  # of the fitting plans so far: a candidate that cannot beat it is pruned
    for i in _search_order(shapes):
        name, micro, virtual = shapes[i]
        shape = replace(
            options,
            schedule=name,
            microbatches=micro,
            virtual_stages=virtual if schedule_kind(name).virtual_stages else None,
        )
        plan: Plan | None = None
        note = ""
        fits = True
        # a tie within TIE_REL may still win on its count; the chosen one is resimulated, below
        beat_ms = math.inf if every_candidate else fastest_ms * (1 + TIE_REL)
        try:
            plan = partition(profile, topology, shape, resimulate=False, beat_ms=beat_ms)
        except Dominated:
            candidates[i] = _pruned(shape, f"slower than {fastest_ms:.3f} ms")
            continue
        except InputError as exc:
            note = str(exc)
        except InfeasibleError as exc:
            fits = False
            note = f"no plan fits: {exc}"
            if misfit_memory:  # the memory it would need, unless it could not beat a fitting plan anyway
                note = ""
                try:
                    unchecked = replace(shape, memory_check=False)
                    plan = partition(profile, topology, unchecked, resimulate=False, beat_ms=beat_ms)
                except Dominated:
                    candidates[i] = _pruned(shape, f"does not fit, and slower than {fastest_ms:.3f} ms")
                    continue
                except (InputError, InfeasibleError) as exc:
                    note = str(exc)
        if plan is None:
            candidates[i] = Candidate(name, micro, virtual or 1, math.inf, 0, False, note)
        else:
            peak = device_peak_bytes(plan)
            fits = fits and peak <= topology.device.memory_bytes
            candidates[i] = Candidate(
                name, micro, plan.virtual_stages, plan.predicted.time_per_minibatch_ms, peak, fits
            )
            if fits:
                fastest_ms = min(fastest_ms, plan.predicted.time_per_minibatch_ms)
        plans[i] = plan
    planned = tuple(c for c in candidates if c is not None)
    assert len(planned) == len(shapes)  # every index planned once
    return _choose(profile, topology, options, planned, plans)


def _pruned(shape: PartitionOptions, why: str) -> Candidate:
    """A candidate proven not to beat a fitting plan found before it: no figures."""
    return Candidate(
        shape.schedule, shape.microbatches, shape.virtual_stages or 1, math.inf, 0, False, why, True
    )


def _search_order(shapes: Sequence[tuple[str, int, int | None]]) -> list[int]:
    """Indices of ``shapes`` in the order to plan them: more micro-batches first, else as
    listed. Large models win with many (the bubble shrinks), so the slower counts after
    them are pruned before their DP fills its tables; small ones lose nothing but order."""
    return sorted(range(len(shapes)), key=lambda i: -shapes[i][1])


def _choose(
    profile: Profile,
    topology: Topology,
    options: PartitionOptions,
    candidates: tuple[Candidate, ...],
    plans: Sequence[Plan | None],
) -> SearchResult:
    """The search's answer over planned ``candidates`` (see ``search``)."""
    fitting = [i for i, c in enumerate(candidates) if c.fits]
    if not fitting:
        planned = [c for c in candidates if c.peak_memory_bytes > 0]
        if not planned:
            raise InfeasibleError(
                "no schedule can be planned: "
                + "; ".join(f"{c.schedule} M={c.microbatches}: {c.note}" for c in candidates[:3])
            )
        least = min(planned, key=lambda c: c.peak_memory_bytes)
        raise InfeasibleError(
            f"no schedule fits in {format_bytes(topology.device.memory_bytes)} per device; the smallest "
            f"that would fit is {format_bytes(least.peak_memory_bytes)} per device ({least.schedule}, "
            f"{least.microbatches} micro-batches, v={least.virtual_stages})"
        )
    fastest = min(candidates[i].time_per_minibatch_ms for i in fitting)
    tied = [i for i in fitting if candidates[i].time_per_minibatch_ms <= fastest * (1 + TIE_REL)]
    chosen = min(tied, key=lambda i: (candidates[i].microbatches, candidates[i].peak_memory_bytes, i))
    plan = plans[chosen]
    assert plan is not None  # a fitting candidate has a plan
    best = candidates[chosen]
    shape = replace(options, schedule=best.schedule, microbatches=best.microbatches)
    return SearchResult(tuple(candidates), chosen, resimulated(plan, profile, shape))


def choose_schedule(
    profile: Profile, topology: Topology, options: PartitionOptions, every_candidate: bool = False
) -> tuple[str, int, str]:
    """(schedule, micro-batches, one-line reason): the best simulated throughput that fits.

    ``planner.auto.search`` over schedule x micro-batches x virtual stages; raises
    ``InfeasibleError`` when none fits.
    """
    found = search(profile, topology, options, every_candidate=every_candidate)
    best = found.best
    others = ", ".join(
        f"{c.schedule} M={c.microbatches} {c.time_per_minibatch_ms:.3f} ms"
        for i, c in enumerate(found.candidates)
        if i != found.chosen and c.fits
    )
    reason = (
        f"{best.schedule} (M={best.microbatches}, v={best.virtual_stages}) simulates "
        f"{best.time_per_minibatch_ms:.3f} ms/minibatch in {format_bytes(best.peak_memory_bytes)} "
        f"of {format_bytes(topology.device.memory_bytes)} per device"
    )
    if others:
        reason += f"; vs {others}"
    pruned = sum(c.pruned for c in found.candidates)
    if pruned:
        reason += f"; {pruned} more pruned (provably slower)"
    return best.schedule, best.microbatches, reason
