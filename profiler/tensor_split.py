"""The profile's tensor-parallel fields of measured layers: what splits, what one rank of a t-group computes.

The split rules are the runtime's (``pipeplan.tensor_parallel.plans``: the model file's
``TP_PLAN``, transformers' own plan, or the built-in plans per module class), so a layer the profile calls
splittable is one ``pipeplan run`` splits. Per layer holding split modules:

- ``tp_units``: the gcd of the model's attention head counts and every split dimension
  of the layer (a degree must divide all of them, as the runtime checks);
- ``tp_split_param_bytes``: the bytes of its split parameters (exact);
- ``tp_split_forward_ms`` / ``tp_split_backward_ms`` / ``tp_split_saved_bytes``:
  MEASURED. The layer is run as one rank of a t-group runs it (``parallelize_stage``
  over a one-process *fake* process group of size t, whose collectives move no data: its
  parameter shards, DTensor's dispatch, and no communication) and as a whole, in the same
  pass; the part that divides by t is solved from the two, x_1 = rest + split and
  x_t = rest + split / t, so split = (x_1 - x_t) t / (t - 1), as a share of x_1
  applied to the profile's own figure, clamped to [0, the figure]. t is the smallest
  degree above 1 dividing every layer's units. At that t the planner's figure
  (rest + split / t) is the measured one, so ``Profile.tp_efficiency`` stays 1.0: the
  measurement already holds what is lost to splitting (a tiny layer on a CPU may gain
  nothing: split 0). Other degrees are extrapolated as 1/t.
- all-reduces (what the planner charges; Megatron's count), of the layer's output bytes:
  one forward per row-parallel module (its partial sums; a vocabulary-parallel embedding
  is one), one backward per group of column-parallel modules reading one input (q, k, v;
  gate, up; a head: their input's gradient). A Megatron block: 2 and 2. DTensor, as
  ``pipeplan run`` uses it, issues more, and a split stage's outputs are gathered where
  they leave it (not charged; README: the collectives DTensor places).

A model without a plan (no ``TP_PLAN``, no transformers plan, no built-in family) gets no split fields.
"""

from __future__ import annotations

import copy
import math
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pipeplan.errors import one_line
from pipeplan.profile import LayerProfile
from pipeplan.profiler.timing import Timer

if TYPE_CHECKING:  # typing only: torch and the capture are imported where they are used
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from pipeplan.capture import LayerGraph, StageModule
    from pipeplan.tensor_parallel.plans import Split

SHARE_TURNS = 5  # whole / split timings of a layer, whatever --repeats says (DTensor on a CPU is slow)

__all__ = [
    "SplitLayout",
    "SplitShare",
    "layer_layouts",
    "fill_split_fields",
    "measure_split_degree",
    "measure_shares",
    "split_fields",
]


@dataclass(frozen=True)
class SplitLayout:
    """What a layer splits, from the plan alone (no measurement)."""

    units: int  # gcd of the head counts and the split dimensions
    param_bytes: int  # bytes of the split parameters
    forward_allreduces: int
    backward_allreduces: int
    dims: dict[str, dict[str, int]]  # qualified module path -> {parameter: dim}


def layer_layouts(
    model: nn.Module,
    tp_plan: dict[str, Any] | None,
    layers: Sequence[LayerProfile],
    where: str,
    element_size: int | None = None,
) -> dict[int, SplitLayout]:
    """Layer index -> its ``SplitLayout``, for the layers holding split modules (empty: no plan).

    ``element_size``: bytes per parameter element as profiled (default: as the model holds them).
    """
    from torch import nn

    from pipeplan.tensor_parallel.plans import COLWISE, ROWWISE, head_counts

    splits = _plan_splits(model, tp_plan, where)
    if not splits:
        return {}
    heads = list(head_counts(model).values())
    modules = dict(model.named_modules())
    layouts: dict[int, SplitLayout] = {}
    for layer in layers:
        names = set(layer.parameters)
        held = [
            split
            for split in splits.values()
            if any(f"{split.module}.{name}" in names for name, _ in split.dims)
        ]
        if not held:
            continue
        units, split_bytes, seen = 0, 0, set()
        for split in held:
            for name, dim in split.dims:
                param = getattr(modules[split.module], name)
                units = math.gcd(units, int(param.shape[dim]))
                if id(param) not in seen:
                    seen.add(id(param))
                    split_bytes += param.numel() * (element_size or param.element_size())
        for count in heads:
            units = math.gcd(units, count)
        embeddings = [isinstance(modules[split.module], nn.Embedding) for split in held]
        rows = sum(1 for split, embedding in zip(held, embeddings) if split.style == ROWWISE)
        # a column group (q, k, v; gate, up) reads one input: one all-reduce of its gradient
        column_groups = {
            split.module.rpartition(".")[0]
            for split, embedding in zip(held, embeddings)
            if split.style == COLWISE and not embedding
        }
        dims: dict[str, dict[str, int]] = {}
        for split in held:
            dims.setdefault(split.module, {}).update(split.dims)
        layouts[layer.index] = SplitLayout(
            units=units,
            param_bytes=split_bytes,
            forward_allreduces=rows,
            backward_allreduces=len(column_groups),
            dims=dims,
        )
    return layouts


def _plan_splits(model: nn.Module, tp_plan: dict[str, Any] | None, where: str) -> dict[str, Split]:
    """The plan's splits; none, with one line on stderr saying why, where the model's plan is
    refused or a transformers model has none (the profile is still written, without splits)."""
    import sys

    from pipeplan.errors import InputError
    from pipeplan.tensor_parallel.plans import has_plan, no_plan_message, resolve_splits

    if not has_plan(model, tp_plan):
        if getattr(getattr(model, "config", None), "model_type", None):
            sys.stderr.write(
                f"pipeplan: the profile carries no tensor-parallel splits: {no_plan_message(model, where)}\n"
            )
        return {}
    try:
        return resolve_splits(model, tp_plan, set(), where)
    except InputError as exc:
        sys.stderr.write(f"pipeplan: the profile carries no tensor-parallel splits: {exc}\n")
        return {}


@dataclass(frozen=True)
class SplitShare:
    """Measured shares of a layer that divide by t (0..1 of its whole figure)."""

    forward: float
    backward: float
    saved: float


def fill_split_fields(
    layers: Sequence[LayerProfile], layouts: dict[int, SplitLayout], shares: dict[int, SplitShare]
) -> list[LayerProfile]:
    """``layers`` with their tp_* fields set from ``layouts`` and the measured ``shares``."""
    out = []
    for layer in layers:
        layout = layouts.get(layer.index)
        if layout is None:
            out.append(layer)
            continue
        share = shares.get(layer.index, SplitShare(0.0, 0.0, 0.0))
        out.append(
            replace(
                layer,
                tp_units=layout.units,
                tp_split_forward_ms=layer.forward_ms * share.forward,
                tp_split_backward_ms=layer.backward_ms * share.backward,
                tp_split_param_bytes=min(layout.param_bytes, layer.param_bytes),
                tp_split_saved_bytes=int(layer.saved_bytes * share.saved),
                tp_allreduce_bytes=layer.output_bytes,
                tp_forward_allreduces=layout.forward_allreduces,
                tp_backward_allreduces=layout.backward_allreduces,
            )
        )
    return out


def measure_split_degree(layouts: dict[int, SplitLayout]) -> int:
    """The smallest degree above 1 dividing every split layer's units (1: none)."""
    units = 0
    for layout in layouts.values():
        units = math.gcd(units, layout.units)
    return next((t for t in range(2, units + 1) if units % t == 0), 1)


def measure_shares(
    graph: LayerGraph,
    inputs: Sequence[torch.Tensor],
    layouts: dict[int, SplitLayout],
    degree: int,
    timer: Timer,
    warmup: int,
    device_type: str,
) -> dict[int, SplitShare]:
    """Per split layer, the measured shares that divide by ``degree`` (module docstring).

    Runs the layers in order on ``inputs`` (no grad) to give each its real inputs; layers
    that are the same computation are measured once. Uses a fake process group of size
    ``degree`` in this process, destroyed afterwards; nothing when a process group exists.
    """
    import torch
    import torch.distributed as dist

    from pipeplan.profiler.layerwise import as_input, layer_signature

    if degree < 2 or not layouts or dist.is_initialized():
        return {}
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=degree)
    try:
        mesh = init_device_mesh(device_type, (degree,))
        stages = graph.layer_modules()
        values: dict[str, Any] = {f"input:{k}": value for k, value in enumerate(inputs)}
        shares: dict[int, SplitShare] = {}
        measured: dict[tuple[object, ...], SplitShare] = {}
        for position, stage in enumerate(stages):
            args = tuple(as_input(values[name]) for name in stage.input_names)
            layout = layouts.get(graph.layers[position].index)
            if layout is not None:
                key = layer_signature(stage, args)
                if key not in measured:
                    try:
                        measured[key] = _share(stage, args, layout, degree, mesh, timer, warmup, device_type)
                    except Exception as exc:  # an op DTensor cannot split: the layer is charged whole
                        warnings.warn(
                            f"layer {graph.layers[position].name}: its tensor-parallel split could not "
                            f"be timed ({one_line(exc)}); its split shares are 0",
                            stacklevel=1,
                        )
                        measured[key] = SplitShare(0.0, 0.0, 0.0)
                shares[graph.layers[position].index] = measured[key]
            with torch.no_grad():
                outputs = tuple(stage.module(*args))
            values.update((name, _plain(value)) for name, value in zip(stage.output_names, outputs))
        return shares
    finally:
        dist.destroy_process_group()


def _plain(value: object) -> object:
    import torch
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value)


def _share(
    stage: StageModule,
    args: tuple[object, ...],
    layout: SplitLayout,
    degree: int,
    mesh: DeviceMesh,
    timer: Timer,
    warmup: int,
    device_type: str,
) -> SplitShare:
    """One layer whole and as one rank of a ``degree``-group: the shares that divide by t."""
    from pipeplan.tensor_parallel.apply import compute_context, parallelize_stage
    from pipeplan.tensor_parallel.plans import Split, stage_splits

    with warnings.catch_warnings():  # copying the graph's pytree specs warns of a deprecation in torch
        warnings.simplefilter("ignore", FutureWarning)
        split_stage = copy.deepcopy(stage)
    dims = stage_splits(
        split_stage.parameter_names,
        {path: Split(path, "", tuple(d.items())) for path, d in layout.dims.items()},
    )
    parallelize_stage(split_stage.module, dims, mesh)
    # whole and split timed in turns, so a change of load on the machine falls on both alike
    wholes, parts = [], []
    for turn in range(SHARE_TURNS):
        wholes.append(_timed(stage, args, timer, warmup if turn == 0 else 0, 1))
        with compute_context(device_type):
            parts.append(_timed(split_stage, args, timer, warmup if turn == 0 else 0, 1))
    scale = degree / (degree - 1)

    def share(k: int) -> float:
        """Of quantity k, the share that divides by t; 0 unless every split timing beat every
        whole one (a share that noise can give is not credited: the planner charges it whole)."""
        one = statistics.median(sample[k] for sample in wholes)
        at_t = statistics.median(sample[k] for sample in parts)
        if one <= 0 or max(sample[k] for sample in parts) >= min(sample[k] for sample in wholes):
            return 0.0
        return min(1.0, (one - at_t) / one * scale)

    return SplitShare(share(0), share(1), share(2))


def _timed(
    stage: StageModule, args: tuple[object, ...], timer: Timer, warmup: int, repeats: int
) -> tuple[float, float, float]:
    """(forward ms, backward ms, saved bytes) of ``stage`` on ``args``; a split stage's by its local shards."""
    import torch

    from pipeplan.profiler.layerwise import time_layer
    from pipeplan.profiler.memory import counting_hooks

    counter = _LocalCounter(exclude=[_local(p) for p in stage.module.parameters()])
    with torch.enable_grad(), counting_hooks(counter):
        first = tuple(stage.module(*args))
    timed = time_layer(stage, args, first, timer, warmup, repeats, 0)
    return timed.forward.median, timed.backward.median, float(counter.saved_bytes)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class _LocalCounter:
    """Distinct storages autograd saves, a DTensor counted by its local shard; parameters excluded."""

    def __init__(self, exclude: Sequence[torch.Tensor]) -> None:
        from pipeplan.profiler.memory import SavedTensorCounter

        self._counter = SavedTensorCounter(exclude=exclude)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._counter.pack(_local(tensor))
        return tensor.detach()  # as SavedTensorCounter.pack: no cycle through the saved variable

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def saved_bytes(self) -> int:
        return self._counter.saved_bytes


def split_fields(
    model: nn.Module,
    tp_plan: dict[str, Any] | None,
    graph: LayerGraph,
    layers: Sequence[LayerProfile],
    inputs: Sequence[torch.Tensor],
    timer: Timer,
    warmup: int,
    device_type: str,
    where: str,
) -> list[LayerProfile]:
    """``layers`` with their tensor-parallel fields (module docstring); unchanged without a plan."""
    layouts = layer_layouts(model, tp_plan, layers, where)
    if not layouts:
        return list(layers)
    degree = measure_split_degree(layouts)
    shares = measure_shares(graph, inputs, layouts, degree, timer, warmup, device_type)
    return fill_split_fields(layers, layouts, shares)
