"""Process-group start-up: read torchrun's environment, check it against the plan.

``pipeplan run`` is started by torchrun (or anything that sets torchrun's variables:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Every rank
checks the world size against the plan *before* any collective, so a mismatch makes
every rank exit at once (rank 0 prints the error; see ``pipeplan.cli.run``).

Backend: NCCL when the plan's devices are GPUs (``topology.device.kind == "cuda"``) and
CUDA is present, gloo otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from pipeplan.errors import InputError, RuntimeFailure, first_line
from pipeplan.plan import Plan

__all__ = ["DistEnv", "read_env", "choose_backend", "check_world_size", "init_distributed"]

_LAUNCH_HINT = "torchrun --nproc-per-node N -m pipeplan run plan.json --model model.py"


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the run (from torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda:<local_rank>"


def _int_env(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    if value is None:
        raise InputError(f"pipeplan run must be started by torchrun ({name} is not set): {_LAUNCH_HINT}")
    try:
        return int(value)
    except ValueError as exc:
        raise InputError(f"environment variable {name}={value!r} is not an integer") from exc


def choose_backend(device_kind: str, cuda_available: bool) -> str:
    """``"nccl"`` for a GPU plan on a machine with CUDA, ``"gloo"`` otherwise.

    >>> choose_backend("cuda", True), choose_backend("cuda", False), choose_backend("cpu", True)
    ('nccl', 'gloo', 'gloo')
    """
    return "nccl" if device_kind == "cuda" and cuda_available else "gloo"


def read_env(plan: Plan, environ: Mapping[str, str] | None = None) -> DistEnv:
    """This rank's ``DistEnv``; ``InputError`` when torchrun's variables are missing."""
    import torch

    env = os.environ if environ is None else environ
    rank = _int_env(env, "RANK")
    world_size = _int_env(env, "WORLD_SIZE")
    local_rank = int(env.get("LOCAL_RANK", rank))
    backend = choose_backend(plan.topology.device.kind, torch.cuda.is_available())
    device = f"cuda:{local_rank}" if backend == "nccl" else "cpu"
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        backend=backend,
        device=device,
    )


def check_world_size(plan: Plan, env: DistEnv) -> None:
    """``InputError`` when torchrun started a different number of ranks than the plan has."""
    if env.world_size != plan.world_size:
        raise InputError(
            f"the plan is for {plan.world_size} ranks but torchrun started {env.world_size}; "
            f"use --nproc-per-node {plan.world_size} (times nodes) or re-plan for "
            f"{env.world_size} devices"
        )


def init_distributed(env: DistEnv, timeout_s: float) -> None:
    """``init_process_group`` with ``timeout_s`` seconds on every collective.

    Start-up itself is bounded too: ``init_process_group`` can wait past its timeout
    (MASTER_PORT held by a listener that is not a store, a stopped store host), so a
    deadline of ``timeout_s`` ends the process with one line naming the address.
    """
    import torch
    import torch.distributed as dist

    from pipeplan.runtime.failure import deadline

    if env.backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    where = f"{env.master_addr}:{env.master_port}"
    try:
        with deadline(
            timeout_s,
            f"rank {env.rank}: cannot join the process group at {where} within "
            f"{timeout_s:.0f} s (no rendezvous store answers there, or a rank "
            f"did not start; check MASTER_ADDR/MASTER_PORT)",
        ):
            dist.init_process_group(
                env.backend,
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(seconds=timeout_s),
            )
    except Exception as exc:
        reason = first_line(exc)
        raise RuntimeFailure(
            f"rank {env.rank}: cannot join the process group at "
            f"{env.master_addr}:{env.master_port} within {timeout_s:.0f} s: {reason}"
        ) from exc
