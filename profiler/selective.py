"""The selective-recomputation option of each layer that holds an attention core, measured.

For a layer whose captured graph holds an attention core whole
(``pipeplan.capture.attention_core``), the layer runs on its real inputs twice, each
with a fresh ``SavedTensorCounter`` (the saved-tensor hooks of
``pipeplan.profiler.memory``): as it is, and with its core under non-reentrant
``torch.utils.checkpoint`` (``checkpoint_attention``: what the runtime runs for
``StagePlan.selective_layers``; the checkpoint's kept inputs count, as autograd packs
them). The difference is what selective recomputation frees; the layer's
``selective_saved_bytes`` is its ``saved_bytes`` (the whole-pass rule: a storage counts in
the first layer that saves it) less that. ``selective_recompute_ms`` is the median
forward of the core alone (grad enabled, as backward's recomputation runs it) on the
inputs it received: the time selective recomputation adds to the layer's backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeplan.profiler.detach import detached
from pipeplan.profiler.memory import SavedTensorCounter, count_saved
from pipeplan.profiler.timing import Timer, read, robust_stats

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pipeplan.capture import LayerGraph, StageModule

__all__ = ["Selective", "measure_selective", "core_layers", "measure_layer", "selective_saved"]


@dataclass(frozen=True)
class Selective:
    freed_bytes: int  # saved bytes the layer no longer holds with its core checkpointed
    recompute_ms: float  # the core's forward, median


def measure_selective(
    graph: LayerGraph,
    per_layer: Sequence[StageModule],
    inputs: Sequence[torch.Tensor],
    timer: Timer,
    warmup: int,
    repeats: int,
) -> dict[int, Selective]:
    """Layer index -> its selective option, for the layers holding an attention core whole."""
    import torch

    cores = core_layers(graph)
    out: dict[int, Selective] = {}
    if not cores:
        return out
    values: dict[str, object] = {f"input:{k}": value for k, value in enumerate(inputs)}
    with torch.enable_grad():
        for stage in per_layer:
            args = tuple(values[name] for name in stage.input_names)
            if stage.index in cores:
                out[stage.index] = measure_layer(graph, stage, args, timer, warmup, repeats)
            outputs = tuple(stage.module(*args))
            values.update((name, detached(value)) for name, value in zip(stage.output_names, outputs))
    return out


def core_layers(graph: LayerGraph) -> set[int]:
    """The layers of ``graph`` holding an attention core whole (none in an ``nn.Sequential`` capture)."""
    from pipeplan.capture.attention_core import attention_cores

    if graph.kind == "sequential":
        return set()
    return set(attention_cores(graph.graph_module.graph, graph.layer_of_node))


def measure_layer(
    graph: LayerGraph, stage: StageModule, args: tuple[object, ...], timer: Timer, warmup: int, repeats: int
) -> Selective:
    """The selective option of the one-layer ``stage`` (a layer of ``core_layers``) on ``args``."""
    import torch

    from pipeplan.capture.checkpointed import checkpoint_attention

    with torch.enable_grad():
        plain_bytes, _ = _saved(stage.module, args)
        checkpointed = checkpoint_attention(graph, _copy(stage), [stage.index])
        checkpointed_bytes, _ = _saved(checkpointed.module, args)
        plain = checkpoint_attention(graph, _copy(stage), [stage.index], checkpointed=False)
        ms = _core_ms(plain.module, args, timer, warmup, repeats)
    return Selective(max(0, plain_bytes - checkpointed_bytes), ms)


def _copy(stage: StageModule) -> StageModule:
    """``stage`` on a copy of its graph, sharing its modules and parameters (fusing a core
    rewrites a stage's graph in place)."""
    import copy
    import dataclasses

    from torch import fx

    from pipeplan.capture.layer_graph import _RebuildOutput

    module = stage.module
    inner = module.graph if isinstance(module, _RebuildOutput) else module
    assert isinstance(inner, fx.GraphModule)
    fresh = fx.GraphModule(inner, copy.deepcopy(inner.graph))
    if isinstance(module, _RebuildOutput):
        return dataclasses.replace(stage, module=_RebuildOutput(fresh, module.spec, module.count))
    return dataclasses.replace(stage, module=fresh)


def _saved(module: nn.Module, args: tuple[object, ...]) -> tuple[int, tuple[object, ...]]:
    """Bytes ``module(*args)`` saves for backward (parameters excluded), and its outputs."""
    counter = SavedTensorCounter(exclude=module.parameters())
    with count_saved(counter=counter):
        outputs = tuple(module(*args))
    return counter.saved_bytes, outputs


def _core_ms(module: nn.Module, args: tuple[object, ...], timer: Timer, warmup: int, repeats: int) -> float:
    """Median ms of the forward of ``module``'s fused attention cores (``selective_<k>``)."""
    from pipeplan.capture.checkpointed import SELECTIVE_PREFIX

    calls: list[tuple[nn.Module, tuple[object, ...]]] = []
    subs = [
        sub for name, sub in module.named_modules() if name.rpartition(".")[2].startswith(SELECTIVE_PREFIX)
    ]
    handles = [sub.register_forward_pre_hook(lambda sub, a: calls.append((sub, a))) for sub in subs]
    try:
        module(*args)
    finally:
        for handle in handles:
            handle.remove()
    samples = []
    for iteration in range(max(warmup, 1) + repeats):
        timer.start()
        for sub, core_args in calls:
            sub(*core_args)
        elapsed = read(timer.stop())
        if iteration >= max(warmup, 1):
            samples.append(elapsed)
    return robust_stats(samples).median


def selective_saved(saved_bytes: int, selective: Selective | None) -> int:
    """The layer's saved bytes with its attention core recomputed; -1 without a core."""
    # a core whose checkpoint keeps more than it frees saves the layer nothing (the profile's
    # bound: selective_saved_bytes <= saved_bytes)
    return -1 if selective is None else min(saved_bytes, max(0, saved_bytes - selective.freed_bytes))
