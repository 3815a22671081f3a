"""Cuts an export target can express, read from the profile's module tree (``partition --for``).

``pipeplan export`` hands a plan to torch.distributed.pipelining or torchtitan, which cut
a model only at certain layer boundaries (``pipeplan.export.structure`` states the rules
and refuses a plan that breaks them). A *boundary* c (1 <= c < N) is the cut before
layer c of the profile's layer order; both engines run contiguous stages, so a plan for
them cuts at boundaries only (prefixes of the layer order). Boundary c is expressible:

- by both when the layers before it read every model input (both feed the model's inputs
  to the first stage only: torch's first stage takes exactly the inputs its own graph
  reads; ``_inputs_blocked``);
- by **torchtitan** only when no parameter is used on both sides of it (torchtitan keeps
  a module on one stage); a tied weight does not block **pipelining**: its export holds a
  copy on each stage using it and sums their gradients before each optimizer step
  (``pipeplan.export.stage_modules.all_reduce_tied``), so the copies stay equal;
- by **pipelining** when layer c is a module called once per forward pass
  (``SplitPoint.BEGINNING`` splits before every call of the module it names) and torch's
  own split can cut there as the layer order does (``Profile.pipelining_blocked``: the
  Python code calls the modules in another order, or the cut would send a view);
- by **torchtitan** when no *unit* (a child of the root, or an entry of a child that is
  an ``nn.ModuleList`` / ``nn.ModuleDict``) has layers on both sides; torchtitan places
  modules, so a layer that is not a module (a functional op of the root) rules the
  target out for the whole model.

Both engines also send a value only to the next stage (torch: "Backward of skip
connections not supported yet"), so no layer output may jump over a whole stage: a middle
stage [a, b) is ruled out when a layer before a feeds a layer at or after b. torch runs
parameter-free ops where the Python code runs them, not in the layer pipeplan folds them
into (an attention mask built once before the blocks), so for pipelining the profile's
``pipelining_reach`` (torch's own split, traced at profile time) rules out a stage [a, b)
whose values from before a torch's pieces read at or after b, the first stage included.

``target_family`` gives the DP the prefixes at expressible boundaries (a ``CutFamily``
whose states are those prefixes, with the skipped stages ruled out), so the DP stays
exact over the plans the target runs.
O(N * depth + parameters) to read the rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.errors import InputError
from pipeplan.plan import EXPORT_TARGETS
from pipeplan.planner.cuts import CutFamily
from pipeplan.profile import Profile

__all__ = [
    "EXPORT_TARGETS",
    "ENGINES",
    "TargetCuts",
    "blocked_summary",
    "most_stages",
    "target_cuts",
    "target_family",
]

ENGINES = {"pipelining": "torch.distributed.pipelining", "torchtitan": "torchtitan"}


@dataclass(frozen=True)
class TargetCuts:
    """Which layer boundaries ``target`` can cut (boundary c: the cut before layer c).

    ``blocked[c]`` says why boundary c is not expressible (a phrase naming the module or
    parameter); ``refusal`` is set when the target runs no split of this model at all.
    """

    target: str
    layers: int
    allowed: tuple[int, ...]
    blocked: dict[int, str]
    refusal: str = ""


def _require_tree(profile: Profile, target: str) -> None:
    if not profile.modules:
        raise InputError(
            f"the profile of {profile.model} has no module tree (made before pipeplan recorded it, "
            f"or not measured by `pipeplan profile`): re-profile the model to plan --for {target}"
        )


def _shared_parameters(profile: Profile) -> dict[int, str]:
    """Boundary -> the first parameter used on both sides of it."""
    users: dict[str, list[int]] = {}
    for layer in profile.layers:
        for name in layer.parameters:
            users.setdefault(name, []).append(layer.index)
    blocked: dict[int, str] = {}
    for name in sorted(users):
        first, last = min(users[name]), max(users[name])
        for c in range(first + 1, last + 1):
            blocked.setdefault(
                c,
                f"parameter {name} (used by layers {first} "
                f"({profile.layers[first].name}) and {last} ({profile.layers[last].name}))",
            )
    return blocked


def _inputs_blocked(profile: Profile) -> dict[int, str]:
    """Boundaries that would leave a model input unread by the first stage.

    Both engines feed the inputs to the first stage alone. One input is read by the first
    layer; with several, pipeplan's layers fold the parameter-free ops that read an input
    (a mask's preparation) into some layer, which need not run where torch executes them,
    so the first stage must hold every layer that reads an input (conservative).
    """
    readers: dict[int, list[int]] = {}
    for layer in profile.layers:
        for position in layer.model_inputs:
            readers.setdefault(position, []).append(layer.index)
    blocked: dict[int, str] = {}
    for position, layers in sorted(readers.items()):
        last = max(layers) if len(readers) > 1 else min(layers)
        for c in range(1, last + 1):
            blocked.setdefault(
                c,
                f"model input {position} (read by layer {last}, {profile.layers[last].name}: "
                f"the first stage must read every input)",
            )
    return blocked


def _pipelining_blocked(profile: Profile, calls: dict[str, int]) -> dict[int, str]:
    blocked: dict[int, str] = {}
    for layer in profile.layers[1:]:
        if layer.name not in calls or not layer.name:
            blocked[layer.index] = f"{layer.name} (a functional op, not a module)"
        elif calls[layer.name] != 1:
            blocked[layer.index] = f"{layer.name} (called {calls[layer.name]} times per forward pass)"
    for index, why in enumerate(profile.pipelining_blocked):
        if why:
            blocked.setdefault(index, f"{profile.layers[index].name} (torch's own cut there: {why})")
    return blocked


def unit_of(name: str, containers: frozenset[str]) -> str:
    """torchtitan's unit holding module ``name``: its root child, or ``child.key`` in a container."""
    parts = name.split(".")
    if parts[0] in containers and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def _torchtitan_blocked(
    profile: Profile, calls: dict[str, int], types: dict[str, str], containers: frozenset[str]
) -> tuple[dict[int, str], str]:
    functional = [
        f"{layer.index} ({layer.name})"
        for layer in profile.layers
        if layer.name not in calls or not layer.name
    ]
    if functional:
        return {}, (
            f"layer(s) {', '.join(functional[:3])}{', ...' if len(functional) > 3 else ''} are not "
            f"modules (functional ops of the root): torchtitan places modules, not ops"
        )
    span: dict[str, tuple[int, int]] = {}
    for layer in profile.layers:
        unit = unit_of(layer.name, containers)
        first, _ = span.get(unit, (layer.index, layer.index))
        span[unit] = (first, layer.index)
    blocked: dict[int, str] = {}
    for unit, (first, last) in span.items():
        for c in range(first + 1, last + 1):
            blocked.setdefault(c, f"{unit} ({types.get(unit, 'module')}, a unit torchtitan keeps whole)")
    return blocked, ""


def target_cuts(profile: Profile, target: str) -> TargetCuts:
    """The boundaries ``target`` can cut in ``profile`` (module docstring); ``InputError``
    when the profile has no module tree."""
    if target not in EXPORT_TARGETS:
        raise InputError(f"export target {target!r} is not one of {', '.join(EXPORT_TARGETS)}")
    _require_tree(profile, target)
    calls = {module.name: module.calls for module in profile.modules}
    refusal = ""
    if target == "pipelining":
        blocked = _pipelining_blocked(profile, calls)
    else:
        types = {module.name: module.type for module in profile.modules}
        containers = frozenset(module.name for module in profile.modules if module.container)
        blocked, refusal = _torchtitan_blocked(profile, calls, types, containers)
    shared = _shared_parameters(profile) if target == "torchtitan" else {}
    for c, reason in (*_inputs_blocked(profile).items(), *shared.items()):
        blocked.setdefault(c, reason)
    n = len(profile.layers)
    allowed = tuple(c for c in range(1, n) if c not in blocked) if not refusal else ()
    return TargetCuts(target, n, allowed, dict(sorted(blocked.items())), refusal)


def target_family(cuts: TargetCuts, profile: Profile) -> CutFamily:
    """The prefixes of the layer order at the expressible boundaries (and the empty and
    the full one), as cut states of the DP, sorted by size; a stage that some layer's
    output would jump over is ruled out (``CutFamily.stage_ok``). O(N + edges + F^2)."""
    n = cuts.layers
    sizes = np.array([0, *cuts.allowed, n])
    masks = np.arange(n)[None, :] < sizes[:, None]
    reach = np.full(n + 1, -1)  # reach[a]: the last layer reading an output of the layers before a
    for layer in profile.layers:
        for producer in layer.inputs:
            reach[producer + 1] = max(reach[producer + 1], layer.index)
    reach = np.maximum.accumulate(reach)
    if cuts.target == "pipelining" and profile.pipelining_reach:
        reach[:n] = np.maximum(
            reach[:n], profile.pipelining_reach
        )  # torch's own pieces (Profile.pipelining_reach)
    stage_ok = reach[sizes][:, None] < sizes[None, :]  # [i, j]: nothing jumps from before i to j or later
    stage_ok[:, -1] = True  # the last stage ends the pipeline: nothing lies beyond it
    return CutFamily(f"{cuts.target}-cuts", n, masks, exact=False, stage_ok=stage_ok)


def most_stages(family: CutFamily) -> int:
    """The most stages of a plan of ``family`` (a chain of cut states from the empty prefix
    to the full one, each step a stage ``stage_ok`` allows). O(F^2)."""
    states = family.states
    ok = family.stage_ok if family.stage_ok is not None else np.ones((states, states), dtype=bool)
    most = np.full(states, -1)  # most[j]: most stages covering prefix j, -1 when none
    most[0] = 0
    for j in range(1, states):
        before = [most[i] + 1 for i in range(j) if most[i] >= 0 and ok[i, j]]
        most[j] = max(before, default=-1)
    return int(most[-1])


def blocked_summary(cuts: TargetCuts, limit: int = 4) -> str:
    """What blocks the boundaries, most frequent first: ``"x (why) at 5 boundaries, ..."``."""
    if cuts.refusal:
        return cuts.refusal
    counts: dict[str, int] = {}
    for reason in cuts.blocked.values():
        counts[reason] = counts.get(reason, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    text = ", ".join(
        f"{reason} at {count} boundar{'y' if count == 1 else 'ies'}" for reason, count in ranked[:limit]
    )
    return text + (f" and {len(ranked) - limit} more" if len(ranked) > limit else "")
