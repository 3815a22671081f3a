"""What makes a plan's predicted time unreliable, known before it runs (``partition``, ``simulate``).

The prediction adds the profile's layer times up per stage; it holds when the layers
measured one by one add up to the whole step, when their readings are steady, and when a
micro-batch's time is known at its size, and, on CPUs, when the topology says what each
message costs the ranks' cores (``Level.message_overhead_ms``). Each warning is one line
that says which of these fails, by how much, and what to do. The predicted memory leaves out what a backward holds
beyond the saved activations where the profile did not measure it
(``LayerProfile.backward_working_bytes``), or the loss's memory (``Profile.loss_saved_bytes``):
that is said too.
"""

from __future__ import annotations

from pipeplan.plan import Plan
from pipeplan.planner.microbatch_time import PROPORTIONAL_NOTE, microbatch_share, stage_curve
from pipeplan.profile import Profile
from pipeplan.topology import Level

__all__ = ["RATIO_BAND", "SPREAD_LIMIT", "PER_CALL_LIMIT", "prediction_warnings", "preset_overhead_note"]

RATIO_BAND = (0.8, 1.25)  # sum of layers over the whole step outside this: stages mispredicted
SPREAD_LIMIT = 0.2  # summed interquartile range over summed medians above this: a noisy profile
PER_CALL_LIMIT = 1.5  # a micro-batch over this many times its proportional share: per-call costs


def prediction_warnings(profile: Profile, plan: Plan) -> list[str]:
    """One line per reason the predicted time of ``plan`` may not hold. O(layers x sizes)."""
    out: list[str] = []
    ratio = profile.layers_vs_step_ratio
    if ratio == ratio and not RATIO_BAND[0] <= ratio <= RATIO_BAND[1]:  # not nan
        out.append(
            f"the layers timed one by one sum to {ratio:.2f}x the measured whole step "
            f"({profile.sum_layers_ms:.3f} ms vs {profile.step_ms:.3f} ms): stage times may be off by as "
            f"much; profile again on an idle machine, or with --leaf-modules to time larger layers"
        )
    medians = profile.sum_layers_ms
    spread = sum(layer.forward_ms_spread + layer.backward_ms_spread for layer in profile.layers)
    if medians > 0 and spread / medians > SPREAD_LIMIT:
        out.append(
            f"the profile's readings vary by {spread / medians:.0%} of their medians (interquartile "
            f"ranges summed): profile again on an idle machine or with more --repeats"
        )
    if profile.layers and all(layer.backward_working_bytes < 0 for layer in profile.layers):
        out.append(
            "the profile does not record its layers' backward working memory (activation "
            "gradients and temporaries; profiles made before it was, imported or estimated): "
            "each stage's memory figure leaves it out; profile again to have it charged"
        )
    elif profile.layers and profile.loss_saved_bytes < 0:
        out.append(
            "the profile does not record the loss's memory (what its forward saves, a "
            "cross-entropy's log-probabilities, and its backward's logit gradients; profiles made "
            "before it was): the last stage's memory figure leaves it out; profile again to have it charged"
        )
    unmeasured = _levels_without_message_overhead(plan)
    if unmeasured:
        out.append(
            f"topology {plan.topology.name!r} gives no message_overhead for its gloo level(s) "
            f"{', '.join(unmeasured)}: what each message costs the ranks' cores is left out "
            f"(0.21-0.44 ms per message on a 2-core machine: 2-33% of the bundled and tiny Hugging "
            f"Face models' time per minibatch); measure it with `pipeplan calibrate --topology "
            f"{plan.topology.name} -o measured.yaml` and plan on that file"
        )
    micro = plan.microbatches
    if micro > 1 and not profile.timed_batch_sizes:
        out.append(PROPORTIONAL_NOTE)
    elif micro > 1:
        curve = stage_curve(profile, range(len(profile.layers)))
        forward = sum(layer.forward_ms for layer in profile.layers)
        backward = sum(layer.backward_ms for layer in profile.layers)
        one = forward * microbatch_share(curve, micro) + backward * microbatch_share(curve, micro, "backward")
        whole = one * micro / medians if medians > 0 else 1.0  # over the proportional share
        if whole > PER_CALL_LIMIT:
            out.append(
                f"a micro-batch of {profile.batch_size / micro:g} samples takes {whole:.1f}x its "
                f"proportional share of the minibatch (measured: per-call costs); the prediction "
                f"includes it, fewer micro-batches (or --schedule auto) spend less of it"
            )
    return out


def _levels_without_message_overhead(plan: Plan) -> list[str]:
    """Names of the levels a CPU plan's messages cross that give no message overhead."""
    return [level.name for level in _cpu_levels_crossed(plan) if level.message_overhead_ms == 0]


def _cpu_levels_crossed(plan: Plan) -> list[Level]:
    """The levels a CPU plan's messages cross (none on GPUs: NCCL moves the bytes)."""
    topology = plan.topology
    if topology.device.kind != "cpu":
        return []
    ranks = sorted({rank for stage in plan.stages for rank in stage.ranks})
    crossed = {topology.level_joining(ranks[0], rank) for rank in ranks[1:]}
    return [topology.levels[k] for k in sorted(crossed)]


def preset_overhead_note(preset: str, plan: Plan) -> str | None:
    """A line for a plan made on the topology preset ``preset`` whose messages cross a CPU level
    with a message overhead: that figure is the machine's and its load's, measured where the
    preset was written, not here (None otherwise)."""
    given = [level for level in _cpu_levels_crossed(plan) if level.message_overhead_ms > 0]
    if not given:
        return None
    figures = ", ".join(f"{level.name} {level.message_overhead_ms * 1e3:.0f} us" for level in given)
    return (
        f"preset {preset!r} gives a message overhead measured on another machine or day ({figures}); "
        f"`pipeplan calibrate --topology {preset} -o measured.yaml` measures this one's, and "
        f"`partition --topology measured.yaml` plans on it"
    )
