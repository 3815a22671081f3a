"""Parameters tied across stages: the gradient all-reduce a plan adds between their stages.

A parameter that layers of several stages use (a tied embedding and head; each layer lists
the parameters it uses in ``LayerProfile.parameters``) is a tensor of its own on each of
those stages at run time, and every step sums its gradient over them
(``pipeplan.runtime.sync``: rank k of each such stage with rank k of the others). The
simulator charges that sum (``costs.group_sum_ms``), of the parameter's bytes in the gradient
dtype among as many ranks as hold it, over the slowest level joining them, to the step of each of those
stages, beside its replicas' own all-reduce. A tie within one device (two chunks of a rank)
is summed locally and costs nothing here.
"""

from __future__ import annotations

from pipeplan.plan import Plan
from pipeplan.planner.costs import group_sum_ms
from pipeplan.profile import Profile, shared_parameters

__all__ = ["tied_parameters", "tie_allreduce_ms"]


def tied_parameters(profile: Profile) -> dict[str, tuple[int, ...]]:
    """Each parameter more than one layer uses, with those layers (ascending)."""
    return shared_parameters((layer.index, layer.parameters) for layer in profile.layers)


def _tie_bytes(profile: Profile, name: str, users: tuple[int, ...]) -> int:
    """The tied parameter's bytes: recorded, or (older profiles) its users' smallest param_bytes."""
    recorded = profile.shared_parameter_bytes.get(name)
    if recorded is not None:
        return recorded
    return min(profile.layers[i].param_bytes for i in users)


def tie_allreduce_ms(plan: Plan, profile: Profile) -> list[float]:
    """Per model stage of ``plan``, the ms its tied parameters' all-reduces add to its step.
    O(layers x parameters per layer + ties x stages)."""
    stage_of = {layer: stage.index for stage in plan.stages for layer in stage.layers}
    out = [0.0] * len(plan.stages)
    ratio = plan.precision.gradient_ratio
    topology = plan.topology
    for name, users in tied_parameters(profile).items():
        stages = sorted({stage_of[i] for i in users})
        ranks = sorted({plan.stages[q].ranks[0] for q in stages})
        ms = group_sum_ms(topology, ranks, _tie_bytes(profile, name, users) * ratio)  # 0 on one rank
        for q in stages:
            out[q] += ms
    return out
