"""Layer-by-layer measurement of a model built on meta: one layer holds memory at a time.

For each layer, in order: its modules are materialised on the profiling device
(``pipeplan.capture.materialise``: initialised as the runtime initialises them), its
forward runs once without grad to produce the real values later layers read, then its
forward and backward are timed on those inputs (``warmup`` + ``repeats`` passes; the
backward seeded with random output gradients), its bytes counted, and its storage
released. Values no later layer reads are dropped at once, so peak memory is the largest
layer with its activations plus the values crossing it, whatever the depth.

Layers that are the same computation (class, parameter shapes and dtypes, input shapes
and dtypes: a transformer's repeated blocks) are timed once; the others reuse the
figures (``LayerProfile.reused_from``) unless ``every_layer``.

Saved bytes follow the whole-pass rule of ``pipeplan.profiler.measure``: a storage counts
in the first layer that saves it, so an input that its producer (or an earlier reader)
already saved does not count again. Backward working bytes are counted as there too
(``memory.backward_working_bytes``), on that same first forward, every layer (reused or
not). The output gradients handed in are those the eager pass hands in, or their like:
the loss's own for the model output's tensors it differentiates, ones for the outputs a
later layer reads, none for the others.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pipeplan.errors import InputError, one_line
from pipeplan.host_memory import return_freed_blocks
from pipeplan.memory_errors import memory_step
from pipeplan.profile import LayerProfile
from pipeplan.profiler.detach import detached
from pipeplan.profiler.measure import (
    Progress,
    backward_to_inputs,
    input_grad_part,
    loss_backward,
    loss_bytes,
)
from pipeplan.profiler.memory import (
    SavedTensorCounter,
    backward_working_bytes,
    count_saved,
    deferred_weight_bytes,
    largest_param_bytes,
    output_bytes,
    param_bytes,
    storage_key,
)
from pipeplan.profiler.selective import Selective, selective_saved
from pipeplan.profiler.timing import Stats, Timer, read, robust_stats, time_backward
from pipeplan.units import format_bytes

if TYPE_CHECKING:  # typing only: torch and the capture are imported where they are used
    import torch
    from torch import nn

    from pipeplan.capture import LayerGraph, LayerNode, StageModule

__all__: list[str] = ["LayerwiseResult", "measure_layerwise", "time_layer", "layer_signature", "as_input"]


@dataclass(frozen=True)
class LayerwiseResult:
    layers: list[LayerProfile]
    loss: Stats  # ms: loss forward + backward on the model output
    measured: int  # layers timed (the others reuse a timed layer's figures)
    loss_saved_bytes: int = -1  # the loss's memory, one minibatch (``measure.loss_bytes``)
    loss_working_bytes: int = -1


@dataclass(frozen=True)
class _Timed:
    index: int
    forward: Stats
    backward: Stats
    backward_input: Stats  # the backward to the layer's inputs alone (measure.backward_to_inputs)


def measure_layerwise(
    graph: LayerGraph,
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: object,
    loss_fn: Callable[[Any, Any], Any],
    timer: Timer,
    warmup: int,
    repeats: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    every_layer: bool = False,
    progress: Progress | None = None,
) -> LayerwiseResult:
    """Measure every layer of ``graph`` (captured from ``model``, which is on meta). O(layers)."""
    import torch

    from pipeplan.capture import MODEL_OUTPUT
    from pipeplan.capture.materialise import materialise, rebind, release
    from pipeplan.profiler.selective import core_layers, measure_layer

    cores = core_layers(graph)
    stages: list[StageModule | None] = list(graph.layer_modules())  # None once measured
    remaining = _reads([stage for stage in stages if stage is not None])
    values: dict[str, Any] = {f"input:{k}": value for k, value in enumerate(inputs)}
    timed: dict[tuple[Any, ...], _Timed] = {}
    counted: set[str] = set()  # values (by name) some earlier layer saved
    # LayerProfile.output_saved_by and output_tensors, as the eager pass records them
    # (``measure.run_pass``): the storage of each live value -> the layer that made it first
    owner: dict[int, int] = {}
    saved_by: list[set[int]] = [set() for _ in stages]
    output_tensors: list[int] = []
    layers: list[LayerProfile] = []
    loss = robust_stats([0.0])
    loss_memory = (-1, -1)  # (saved, working) bytes of the loss
    with _frozen_heap():  # each layer's collection traverses only what the layers made
        for position in range(len(stages)):  # (enumerate would keep the last stage alive)
            stage = stages[position]
            assert stage is not None  # set to None only after its own turn
            node = graph.layers[position]
            # the model's tensors now: a tied weight an earlier layer materialised and released is
            # a new meta tensor in the model, no longer the one the stage was split with
            rebind([stage.module], model)
            held = [*stage.module.parameters(), *stage.module.buffers()]
            with memory_step(
                f"layer {position} ({node.name}, {format_bytes(param_bytes(held))} of parameters "
                f"and buffers) was measured alone",
                "lower --batch-size, or profile on a device with more memory",
            ):
                materialise(model, held, device, seed, dtype)
                rebind([stage.module], model)
                # the materialised tensors; not the constants the graph holds (a Falcon's index tensors),
                # which layers split from one graph share, and which have no meta original to go back to
                held = _model_tensors(stage.module, model)
                args = tuple(as_input(values[name]) for name in stage.input_names)
                excluded = [a for name, a in zip(stage.input_names, args) if name in counted]
                counter = SavedTensorCounter(exclude=[*stage.module.parameters(), *_tensors(excluded)])
                with torch.enable_grad(), count_saved(counter=counter):
                    outputs = _run(stage, args)
                for name, value in (*zip(stage.input_names, args), *zip(stage.output_names, outputs)):
                    if any(storage_key(t) in counter.storages for t in _tensors([value])):
                        counted.add(name)
                made = _tensors(list(outputs))
                output_tensors.append(len(made))
                for tensor in made:
                    owner.setdefault(storage_key(tensor), position)
                parameters = {storage_key(p) for p in stage.module.parameters()}
                for key in (counter.seen - parameters) & owner.keys():
                    saved_by[owner[key]].add(position)
                saved = counter.saved_bytes
                produced = output_bytes(outputs)
                wanted = {name for name in stage.output_names if remaining.get(name, 0) > 0}
                loss_grads: list[Any] = []
                if MODEL_OUTPUT in stage.output_names:
                    output = outputs[stage.output_names.index(MODEL_OUTPUT)]
                    loss_grads, loss_memory = _loss_grads(output, targets, loss_fn, counter)
                working, deferred = _backward_bytes(stage, args, outputs, wanted, loss_grads)
                key = layer_signature(stage, args)
                reuse = None if every_layer else timed.get(key)
                if reuse is None:
                    reuse = time_layer(stage, args, outputs, timer, warmup, repeats, position)
                    timed[key] = reuse
                if MODEL_OUTPUT in stage.output_names:
                    loss = _time_loss(outputs[-1], targets, loss_fn, timer, warmup, repeats)
                selective = (
                    measure_layer(graph, stage, args, timer, warmup, repeats) if position in cores else None
                )
                layers.append(
                    _layer_profile(
                        graph.layers[position],
                        reuse,
                        position,
                        produced,
                        param_bytes(stage.module.parameters()),
                        saved,
                        tuple(sorted(set(stage.parameter_names.values()))),
                        largest_param_bytes(stage.module.parameters()),
                        output_bytes(args),
                        selective,
                        working,
                        deferred,
                    )
                )
                for name, value in zip(stage.output_names, outputs):
                    values[name] = detached(value)
                del outputs, args, counter
                for name in stage.input_names:
                    remaining[name] -= 1
                    if remaining[name] == 0 and not name.startswith("input:"):
                        _forget(owner, values.pop(name, None), values)
            release(model, held)
            stages[position] = None  # its module keeps only released tensors, no storage
            del held, stage
            gc.collect()  # what the layer made in reference cycles (an fx.GraphModule's) goes now
            return_freed_blocks()  # and glibc keeps freed blocks unless told: the next layer starts clean
            if progress is not None:
                progress(position + 1, len(graph.layers), f"layer {position + 1}/{len(graph.layers)}")
    layers = [
        replace(layer, output_saved_by=tuple(sorted(savers)), output_tensors=tensors)
        for layer, savers, tensors in zip(layers, saved_by, output_tensors)
    ]
    return LayerwiseResult(layers, loss, len({t.index for t in timed.values()}), *loss_memory)


def _forget(owner: dict[int, int], freed: object, live: dict[str, Any]) -> None:
    """Drop the storages of a value no layer reads any more from ``owner``, unless a live
    value shares them: a freed storage's address can come back as a later layer's output."""
    keys = {storage_key(t) for t in _tensors([freed])}
    keys -= {storage_key(t) for t in _tensors(list(live.values()))}
    for key in keys:
        owner.pop(key, None)


def _loss_grads(
    output: object, targets: object, loss_fn: Callable[[Any, Any], Any], counter: SavedTensorCounter
) -> tuple[list[Any], tuple[int, int]]:
    """The loss's gradient of each leaf of the model output (None where it has none), as the
    eager pass hands them to the last layer's backward, and the loss's (saved, working) bytes
    (``measure.loss_bytes``; ``counter``: what the last layer saved, not counted again)."""
    import torch
    from torch.utils import _pytree as pytree

    value = as_input(output)
    with torch.enable_grad():
        memory = loss_bytes(loss_fn, value, targets, counter)
    grads = [leaf.grad if isinstance(leaf, torch.Tensor) else None for leaf in pytree.tree_leaves(value)]
    return grads, memory


def _backward_bytes(
    stage: StageModule,
    args: tuple[object, ...],
    outputs: tuple[object, ...],
    wanted: set[str],
    loss_grads: list[Any],
) -> tuple[int, int]:
    """The layer's backward working bytes and the bytes its zero-bubble input pass keeps for
    the weight pass (``memory.deferred_weight_bytes``), from the forward just run (``outputs``
    of ``args``): ones are handed to the ``wanted`` outputs (those later layers read),
    ``loss_grads`` to the model output's leaves. The gradients it leaves on its parameters and
    inputs are cleared."""
    import torch
    from torch.utils import _pytree as pytree

    from pipeplan.capture import MODEL_OUTPUT
    from pipeplan.profiler.memory import tensors_in

    heads, grads = [], []
    for name, value in zip(stage.output_names, outputs):
        leaves = pytree.tree_leaves(value)
        if name == MODEL_OUTPUT:
            given = loss_grads
        else:  # ones, not random: the values do not change the bytes
            given = [
                torch.ones_like(t)
                if name in wanted and isinstance(t, torch.Tensor) and t.requires_grad
                else None
                for t in leaves
            ]
        for leaf, grad in zip(leaves, given):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and grad is not None:
                heads.append(leaf)
                grads.append(grad)
    if not heads:
        return 0, 0
    with torch.enable_grad():
        deferred = deferred_weight_bytes(heads, grads, stage.module.parameters(), args)
        working = backward_working_bytes(heads, grads, stage.module.parameters(), args)
    for tensor in (*stage.module.parameters(), *tensors_in(list(args))):
        if isinstance(tensor, torch.Tensor):
            tensor.grad = None
    return working, deferred


def _model_tensors(stage_module: nn.Module, model: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of ``stage_module`` that are ``model``'s."""
    owned = {id(t) for t in (*model.parameters(), *model.buffers())}
    return [t for t in (*stage_module.parameters(), *stage_module.buffers()) if id(t) in owned]


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Inside, the objects that exist on entry (the libraries, the model, every layer's stage
    module) are left out of garbage collections (``gc.freeze``): the collection after each
    layer traverses only what was made since, not the whole heap (measured with
    transformers loaded: 0.15 s a collection otherwise, most of a small layer's time). What
    a stage module keeps after ``release`` holds no storage, so it may wait until the end."""
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:  # someone else's frozen objects stay frozen
            gc.unfreeze()


def _tensors(values: Sequence[object]) -> list[torch.Tensor]:
    import torch

    from pipeplan.profiler.memory import tensors_in

    return [t for t in tensors_in(list(values)) if isinstance(t, torch.Tensor)]


def _reads(stages: Sequence[StageModule]) -> dict[str, int]:
    """How many layers read each value."""
    counts: dict[str, int] = {}
    for stage in stages:
        for name in stage.input_names:
            counts[name] = counts.get(name, 0) + 1
    return counts


def as_input(value: object) -> Any:
    """A value as a stage boundary hands it over: detached; floating tensors require grad."""
    import torch
    from torch.utils import _pytree as pytree

    def leaf(tensor: object) -> object:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return tensor.detach().requires_grad_(tensor.is_floating_point() and tensor.requires_grad)

    return pytree.tree_map(leaf, value)


def _run(stage: StageModule, args: tuple[object, ...]) -> tuple[object, ...]:
    try:
        return tuple(stage.module(*args))
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"layer {stage.index} raised when run on its own: {one_line(exc)}") from exc


def layer_signature(stage: StageModule, args: tuple[object, ...]) -> tuple[object, ...]:
    """What makes two layers the same computation: the code of their graph (ops and the
    classes of the modules they call), parameter and input shapes and dtypes."""
    import torch

    from pipeplan.profiler.memory import tensors_in

    code = getattr(stage.module, "code", None) or type(stage.module).__name__
    normalised = _normalise_names(str(code))
    modules = _normalise_names(" ".join(type(m).__name__ for _, m in stage.module.named_modules()))
    params = tuple((tuple(p.shape), str(p.dtype)) for p in stage.module.parameters())
    shapes = tuple(
        (tuple(t.shape), str(t.dtype)) for a in args for t in tensors_in(a) if isinstance(t, torch.Tensor)
    )
    return normalised, modules, params, shapes, len(stage.output_names)


def _normalise_names(code: str) -> str:
    """The stage's generated code with layer-specific names (``h_3_attn``, ``add_17``) numbered away."""
    import re

    return re.sub(r"\d+", "#", code)


def time_layer(
    stage: StageModule,
    args: tuple[object, ...],
    first: tuple[object, ...],
    timer: Timer,
    warmup: int,
    repeats: int,
    position: int,
) -> _Timed:
    """Forward and backward of one layer, ``repeats`` timed passes after ``warmup``."""
    import torch

    from pipeplan.profiler.memory import tensors_in

    differentiable = [t for t in tensors_in(list(first)) if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = [torch.randn_like(t) for t in differentiable]
    forward, backward, backward_input = [], [], []
    for iteration in range(warmup + repeats):
        # each measured round times the whole backward, then (on a fresh forward) the
        # backward to the layer's inputs alone
        for input_only in (False, True) if iteration >= warmup else (False,):
            with torch.enable_grad():
                timer.start()
                outputs = _run(stage, args)
                forward_ms = read(timer.stop())
                heads = [
                    t for t in tensors_in(list(outputs)) if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                backward_ms = 0.0
                if heads:
                    inputs, head_grads = tensors_in(list(args)), grads[: len(heads)]
                    reading = time_backward(
                        timer,
                        heads,
                        functools.partial(backward_to_inputs, heads, head_grads, inputs)
                        if input_only
                        else functools.partial(torch.autograd.backward, heads, head_grads),
                    )
                    backward_ms = read(reading)
            del outputs, heads
            for parameter in stage.module.parameters():
                parameter.grad = None
            for arg in tensors_in(list(args)):
                if isinstance(arg, torch.Tensor):
                    arg.grad = None
            if iteration < warmup:
                continue
            if input_only:
                backward_input.append(backward_ms)
            else:
                forward.append(forward_ms)
                backward.append(backward_ms)
    return _Timed(position, robust_stats(forward), robust_stats(backward), robust_stats(backward_input))


def _time_loss(
    output: object,
    targets: object,
    loss_fn: Callable[[Any, Any], Any],
    timer: Timer,
    warmup: int,
    repeats: int,
) -> Stats:
    """The loss's forward + backward on the model output, ms."""
    import torch

    samples = []
    for iteration in range(warmup + repeats):
        value = as_input(output)
        with torch.enable_grad():
            timer.start()
            loss_backward(loss_fn, value, targets)
            elapsed = read(timer.stop())
        if iteration >= warmup:
            samples.append(elapsed)
    return robust_stats(samples)


def _layer_profile(
    node: LayerNode,
    timed: _Timed,
    position: int,
    produced: int,
    params: int,
    saved: int,
    names: tuple[str, ...],
    largest: int,
    kept: int = -1,
    selective: Selective | None = None,
    working: int = -1,
    deferred: int = -1,
) -> LayerProfile:
    return LayerProfile(
        index=node.index,
        name=node.name,
        type=node.type,
        inputs=tuple(node.inputs),
        forward_ms=timed.forward.median,
        backward_ms=timed.backward.median,
        output_bytes=produced,
        param_bytes=params,
        saved_bytes=saved,
        forward_ms_spread=timed.forward.spread,
        backward_ms_spread=timed.backward.spread,
        backward_input_ms=input_grad_part(timed.backward.median, timed.backward_input.median, params),
        model_inputs=tuple(node.model_inputs),
        reused_from=-1 if timed.index == position else timed.index,
        parameters=names,
        largest_param_bytes=largest,
        recompute_kept_bytes=kept,
        selective_saved_bytes=selective_saved(saved, selective),
        selective_recompute_ms=selective.recompute_ms if selective is not None else -1.0,
        backward_working_bytes=working,
        deferred_weight_bytes=deferred,
    )
