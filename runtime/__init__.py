"""pipeplan's runtime: ``pipeplan run plan.json`` under torchrun.

Modules (one concept each): ``launch`` (torchrun environment, backend, world-size check),
``stage`` (this rank's stage module from model.py + plan), ``comm`` (tagged non-blocking
p2p with a shape handshake and bounded waits), ``stash`` (weight stashing), ``sync``
(replica and tied-parameter gradient all-reduce), ``data`` (minibatches), ``executor``
(walks a ``pipeplan.schedules`` action list), ``recorder`` / ``rank_metrics`` (timings,
metrics, traces), ``device_mesh`` (the (pipeline, data, tensor) mesh of tensor-parallel
runs), ``failure`` (watchdog, deadlines), ``checkpoint`` (atomic per-stage checkpoints),
``run_identity`` (which run a checkpoint belongs to), ``config`` (the run's typed
configuration, from which the CLI options are generated), ``progress`` / ``run_record``
(the live progress line, ``--record``), ``train`` (the loop: prepare, build, train,
finish). Public names are imported lazily so importing a submodule stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "RunConfig",
    "run_training",
    "build_pipeline",
    "PipelineSpec",
    "WeightStash",
    "P2P",
    "BatchSource",
    "Watchdog",
    "Executor",
]

_HOME = {
    "RunConfig": "config",
    "run_training": "train",
    "build_pipeline": "stage",
    "PipelineSpec": "stage",
    "WeightStash": "stash",
    "P2P": "comm",
    "BatchSource": "data",
    "Watchdog": "failure",
    "Executor": "executor",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'pipeplan.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pipeplan.runtime.{_HOME[name]}"), name)
