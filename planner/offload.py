"""Offload to host memory: what a stage's devices keep without it, and what the copies cost.

A stage whose replicas shard (``planner.sharding``: level-1 replicas, d > 1) may also move
state to its host's memory (``StagePlan.offload``):

- ``optimizer``: the optimizer's states (and the float32 masters under mixed precision) of
  the replica's share live on the host, which steps them (ZeRO-Offload's split). Per step the
  gradients of that share cross the host link down and the stepped compute weights come back
  up; the host steps the share (``HOST_ADAM_BYTES_PER_S``).
- ``optimizer+params``: FSDP2's ``CPUOffloadPolicy`` (zero2 / fsdp only): the sharded
  parameters, gradients and optimizer states all live on the host; per micro-batch each
  all-gather copies the replica's parameter shard up first and each reduce-scatter's
  gradient shard comes down; the host steps the share. The device keeps only the gathered
  compute weights (zero2: the whole stage's, from forward to backward; fsdp: its gathered
  layers, ``planner.sharding``) and the activations.

Copies are charged on the host link (``Topology.host_bandwidth_bytes_per_s``, else
``DEFAULT_HOST_BANDWIDTH``, PCIe Gen4 x16's effective rate) and not overlapped with compute
(an upper bound); the device's own optimizer step stays charged in the stage's compute
(an upper bound as well). On a CPU topology the device's memory is the host's: offload frees
nothing, so ``auto`` never offloads there and an explicit request is refused in one line.

``auto`` offloads only what ``pipeplan run`` runs: ``optimizer+params`` on zero2 / fsdp
stages (FSDP2 has no policy that offloads the optimizer state alone, so ``optimizer`` is
planned when asked by name, and ``pipeplan run`` refuses it).

Planner modes: the shard modes of ``planner.sharding`` carry their offload as ``mode/offload``
(``variant``), so the DP and ``stage_shard`` take the fastest that fits over both at once.
"""

from __future__ import annotations

from pipeplan.errors import InputError
from pipeplan.planner.costs import Elementwise
from pipeplan.planner.memory import optimizer_states
from pipeplan.precision import Precision
from pipeplan.topology import Topology

__all__ = [
    "DEFAULT_HOST_BANDWIDTH",
    "HOST_ADAM_BYTES_PER_S",
    "OFFLOAD_CHOICES",
    "OFFLOADS",
    "base_mode",
    "host_bandwidth",
    "host_link_note",
    "offload_variants",
    "offload_freed_copies",
    "offload_ms",
    "offload_of",
    "variant",
]

OFFLOADS = ("none", "optimizer", "optimizer+params")  # StagePlan.offload
OFFLOAD_CHOICES = ("auto", "none", "optimizer", "all")  # --offload; "all" plans optimizer+params
FSDP_MODES = ("zero2", "fsdp")  # the modes FSDP2 runs, and so the only ones offloading parameters
# PCIe Gen4 x16 moves 32 GB/s raw, about 25 GB/s in practice: the planner's host link when
# the topology gives none (``host_link: {bandwidth: ...}``)
DEFAULT_HOST_BANDWIDTH = 25e9
# float32 parameter bytes per second torch's fused CPU Adam steps on one thread: 64 MiB of
# parameters in 8.4 ms (7.96 GB/s), median of 7 on this repository's AMD EPYC CI VM, loaded
# by other work; charged for every optimizer (an upper bound for sgd and momentum)
HOST_ADAM_BYTES_PER_S = 8.0e9


def variant(mode: str, offload: str) -> str:
    """The planner's name of shard ``mode`` with ``offload``: ``mode`` itself without offload."""
    return mode if offload == "none" else f"{mode}/{offload}"


def base_mode(name: str) -> str:
    """The shard mode of a planner mode name (``variant``)."""
    return name.split("/", 1)[0]


def offload_of(name: str) -> str:
    """The offload of a planner mode name (``variant``): one of ``OFFLOADS``."""
    return name.split("/", 1)[1] if "/" in name else "none"


def host_bandwidth(topology: Topology) -> float:
    """Bytes/s of the host link the planner prices: the topology's, else the default."""
    given = topology.host_bandwidth_bytes_per_s
    return DEFAULT_HOST_BANDWIDTH if given is None else given


def host_link_note(topology: Topology) -> str:
    """One line on the host link a plan's offload is priced on ('' when the topology gives it)."""
    if topology.host_bandwidth_bytes_per_s is not None:
        return ""
    return (
        f"offload priced on an assumed host link of {DEFAULT_HOST_BANDWIDTH / 1e9:g} GB/s "
        "(PCIe Gen4 x16 effective; give the topology host_link: {bandwidth: ...})"
    )


def offload_variants(request: str, modes: tuple[str, ...], fsdp_run: bool, cpu: bool) -> tuple[str, ...]:
    """The planner's modes (``variant``) for ``--offload request`` over shard ``modes``:
    ``none`` leaves them; ``optimizer`` / ``all`` offload every one they can (``all``: zero2
    and fsdp); ``auto`` adds ``optimizer+params`` to zero2 / fsdp where ``fsdp_run`` (what
    ``pipeplan run`` runs) and the devices are not CPUs. ``InputError`` in one line for an
    unknown request, offload on a CPU topology, or ``all`` without zero2 or fsdp.

    >>> offload_variants("auto", ("none", "zero1", "zero2", "fsdp"), True, False)
    ('none', 'zero1', 'zero2', 'fsdp', 'zero2/optimizer+params', 'fsdp/optimizer+params')
    """
    if request not in OFFLOAD_CHOICES:
        raise InputError(f"--offload {request!r} is not one of {', '.join(OFFLOAD_CHOICES)}")
    if request == "none" or (request == "auto" and (cpu or not fsdp_run)):
        return modes
    if cpu:
        raise InputError(
            f"--offload {request} on a CPU topology: a CPU device's memory is its host's, offload frees nothing"
        )
    fsdp = tuple(mode for mode in modes if mode in FSDP_MODES)
    if request == "optimizer":
        return tuple(variant(mode, "optimizer") for mode in modes)
    if not fsdp and request == "auto":
        return modes
    if not fsdp:
        raise InputError(
            f"--offload all offloads parameters with FSDP2: it needs --shard zero2 or fsdp "
            f"(planned here: {', '.join(modes)})"
        )
    params = tuple(variant(mode, "optimizer+params") for mode in fsdp)
    return params if request == "all" else modes + params


def offload_freed_copies(name: str, optimizer: str, precision: Precision, d: int) -> float:
    """Bytes per compute-dtype parameter byte that ``name``'s offload takes off one of d
    replicas (``planner.sharding.shard_copies`` minus this is what stays).

    >>> p = Precision("bfloat16", "float32")
    >>> [offload_freed_copies(n, "adam", p, 4) for n in ("zero1/optimizer", "zero2/optimizer", "fsdp/optimizer+params")]
    [3.0, 1.5, 2.0]
    """
    mode, offload = base_mode(name), offload_of(name)
    if offload == "none":
        return 0.0
    g = precision.gradient_ratio
    states = optimizer_states(optimizer)
    if offload == "optimizer+params":
        if mode not in FSDP_MODES:
            raise InputError(f"offload optimizer+params runs with shard zero2 or fsdp, not {mode}")
        own = 0.0 if precision.mixed else 1.0
        return (precision.state_copies(states) + own) / d
    state_share = 1.0 if mode == "none" else 1.0 / d
    master_share = 1.0 / d if mode in FSDP_MODES else 1.0
    masters = g * master_share if precision.mixed else 0.0
    return g * states * state_share + masters


def offload_ms(
    name: str,
    param_bytes: Elementwise,
    d: int,
    precision: Precision,
    microbatches: int,
    bandwidth_bytes_per_s: float,
) -> Elementwise:
    """Host-link copies and the host's optimizer step (ms per minibatch) of one of d replicas
    under ``name``'s offload (module docstring); ``param_bytes`` in the compute dtype,
    ``microbatches`` each replica runs; 0 without offload.

    >>> offload_ms("fsdp/optimizer+params", 8e9, 2, Precision(), 1, 25e9)
    980.0
    """
    mode, offload = base_mode(name), offload_of(name)
    if offload == "none":
        return param_bytes * 0.0
    g = precision.gradient_ratio
    share = 1.0 if mode == "none" else 1.0 / d
    step = param_bytes * g * share / HOST_ADAM_BYTES_PER_S * 1e3
    if offload == "optimizer":
        copies = param_bytes * share * (g + 1.0)
    else:
        gathers = 1.0 if mode == "zero2" else 2.0
        copies = microbatches * param_bytes * share * (g + gathers)
    return copies / bandwidth_bytes_per_s * 1e3 + step
