"""Every layer's times at the micro-batch sizes a search can plan (``Profile.timed_batch_sizes``).

A layer costs a fixed part per call plus a part that grows with its batch
(``pipeplan.planner.microbatch_time``), so the profile measures each layer at every power
of two from 1 below the profiled batch, besides the batch itself: the sizes of the
micro-batches ``partition --schedule auto`` tries. Each size is drawn from the model file
(``sample_batch(b)``) and run layer by layer as ``pipeplan.profiler.measure.run_pass`` runs
the profiled batch, with fewer passes (``SMALL_WARMUP`` + ``small_repeats``): a pass at a
smaller size costs less, and the sizes together add about half the layer-by-layer passes
again. A graph captured with ``torch.export`` is specialised to its batch, so it is
captured again at each size (its layers must come out the same, by name); a traced graph
runs any size. A size the model file or the graph cannot run is left out, and so are the
smaller ones, with a note: the planner then takes time as proportional below the smallest
measured size.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pipeplan.errors import one_line
from pipeplan.model_inputs import ModelInputs
from pipeplan.profile import LayerProfile
from pipeplan.profiler.measure import Progress, run_pass
from pipeplan.profiler.timing import Timer

if TYPE_CHECKING:  # typing only: torch and the capture are imported where they are used
    import torch
    from torch import nn

    from pipeplan.capture import LayerGraph

__all__ = [
    "SMALL_WARMUP",
    "smaller_batch_sizes",
    "small_repeats",
    "SizeTimes",
    "measure_smaller_sizes",
    "with_size_times",
    "monotone",
]

SMALL_WARMUP = 1  # passes discarded at each smaller size


def smaller_batch_sizes(batch_size: int) -> tuple[int, ...]:
    """Powers of two below ``batch_size``, ascending.

    >>> smaller_batch_sizes(12)
    (1, 2, 4, 8)
    >>> smaller_batch_sizes(1)
    ()
    """
    return tuple(2**k for k in range(batch_size.bit_length()) if 2**k < batch_size)


def small_repeats(repeats: int) -> int:
    """Timed passes at each smaller size: half the profiled batch's, at least 3."""
    return max(3, repeats // 2)


@dataclass(frozen=True)
class SizeTimes:
    """Per-layer medians (ms) at each measured size; sizes ascending, lists by layer index."""

    batch_sizes: tuple[int, ...]
    forward_ms: tuple[tuple[float, ...], ...]  # [size][layer]
    backward_ms: tuple[tuple[float, ...], ...]
    note: str = ""  # why sizes were left out ("" when none was)


def measure_smaller_sizes(
    draw: Callable[[int], tuple[ModelInputs, object]],
    loss_fn: Callable[[Any, Any], Any],
    network: nn.Module,
    graph: LayerGraph,
    leaves: Sequence[str],
    batch_size: int,
    timer: Timer,
    repeats: int,
    progress: Progress | None = None,
) -> SizeTimes:
    """Each layer's forward and backward at every size of ``smaller_batch_sizes(batch_size)``,
    largest first; stops at the first size that does not run. ``draw(size)``: the model
    file's batch of ``size`` samples, on the profiling device. O(sizes x passes x layers)."""
    names = [node.name for node in graph.layers]
    measured: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {}
    note = ""
    for size in reversed(smaller_batch_sizes(batch_size)):
        try:
            inputs, targets = draw(size)
            sized = graph
            if graph.kind == "export":
                from pipeplan.capture import build_layer_graph

                sized = build_layer_graph(network, inputs, leaves, graph.opaque_modules)
                again = [node.name for node in sized.layers]
                if again != names:
                    note = (
                        f"at batch {size} the export captured {len(again)} layers, not the same {len(names)}"
                    )
                    break
            measured[size] = _time_layers(sized, inputs.tensors(), targets, loss_fn, timer, repeats)
        except Exception as exc:  # the user's model may not run at this size (BatchNorm at 1, a fixed shape)
            note = f"not measured at batch {size} or below: {one_line(exc)}"
            break
        if progress is not None:
            progress(len(measured), len(smaller_batch_sizes(batch_size)), f"batch {size}")
    sizes = tuple(sorted(measured))
    return SizeTimes(
        sizes,
        tuple(measured[size][0] for size in sizes),
        tuple(measured[size][1] for size in sizes),
        note,
    )


def _time_layers(
    graph: LayerGraph,
    inputs: Sequence[torch.Tensor],
    targets: object,
    loss_fn: Callable[[Any, Any], Any],
    timer: Timer,
    repeats: int,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Median forward and backward ms of every layer over ``small_repeats(repeats)`` passes."""
    stages = graph.layer_modules()
    forward: list[list[float]] = [[] for _ in stages]
    backward: list[list[float]] = [[] for _ in stages]
    for iteration in range(SMALL_WARMUP + small_repeats(repeats)):
        for stage in stages:
            for parameter in stage.module.parameters():
                parameter.grad = None
        sample = run_pass(stages, inputs, targets, loss_fn, timer)
        if iteration >= SMALL_WARMUP:
            for position in range(len(stages)):
                forward[position].append(sample.forward_ms[position])
                backward[position].append(sample.backward_ms[position])
    for stage in stages:
        for parameter in stage.module.parameters():
            parameter.grad = None
    return (
        tuple(statistics.median(times) for times in forward),
        tuple(statistics.median(times) for times in backward),
    )


def with_size_times(
    layers: Sequence[LayerProfile], smaller: SizeTimes, batch_size: int
) -> list[LayerProfile]:
    """``layers`` (timed at ``batch_size``) with their times at ``smaller``'s sizes and their
    own, aligned with ``(*smaller.batch_sizes, batch_size)``, each made ``monotone``."""
    sizes = (*smaller.batch_sizes, batch_size)
    return [
        replace(
            layer,
            forward_ms_at=monotone(sizes, (*(t[layer.index] for t in smaller.forward_ms), layer.forward_ms)),
            backward_ms_at=monotone(
                sizes, (*(t[layer.index] for t in smaller.backward_ms), layer.backward_ms)
            ),
        )
        for layer in layers
    ]


def monotone(sizes: Sequence[int], times_ms: Sequence[float]) -> tuple[float, ...]:
    """``times_ms`` at ascending ``sizes`` mended from the largest down: no smaller batch takes
    longer than a larger one, nor less than its proportional share of it (a layer's time per
    sample does not grow with its batch); a reading outside that is noise from the machine's
    load. O(sizes).

    >>> monotone((1, 2, 4), (3.0, 0.5, 4.0))  # 2 samples take at least half of 4's time
    (2.0, 2.0, 4.0)
    """
    out = [float(times_ms[-1])]
    for k in range(len(sizes) - 2, -1, -1):
        above = out[0]
        out.insert(0, min(max(float(times_ms[k]), above * sizes[k] / sizes[k + 1]), above))
    return tuple(out)
