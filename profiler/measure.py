"""Per-layer and whole-step measurements: times (median, spread) and byte counts.

``measure_stages`` runs a training step layer by layer, the way a pipeline runs its
stages: forward through the layers in order, each layer fed *detached* copies of the
values it reads (those from earlier layers require grad when they are differentiable,
model inputs do not); then the loss; then backward through the layers in reverse, each
with ``torch.autograd.backward(outputs, grads)`` where ``grads`` are the gradients its
consumers (or the loss) accumulated on those detached values. Every layer's forward and
backward is timed on its own. Running the layers in one pass, rather than each in
isolation, keeps caches and allocator state as in a real step, so the sum of the layers
stays close to the whole step. The first pass is untimed and counts bytes; the next
``warmup`` passes are discarded; the last ``repeats`` passes give the median and spread.

Each pass also times the whole model's forward + loss + backward (``time_step``), so a
profile can report how close the sum of the layers comes to the real step. For a
``torch.export`` capture the whole model is the captured graph run as one stage (what
the runtime executes), not the eager module, whose Python overhead (a Hugging Face
model's mask helpers and cache) no stage ever runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pipeplan.errors import InputError, one_line
from pipeplan.profile import LayerProfile
from pipeplan.profiler.detach import detached
from pipeplan.profiler.memory import (
    SavedTensorCounter,
    backward_working_bytes,
    count_saved,
    deferred_weight_bytes,
    largest_param_bytes,
    output_bytes,
    param_bytes,
    storage_key,
    tensors_in,
)
from pipeplan.profiler.timing import Stats, Timer, read, robust_stats, time_backward

if TYPE_CHECKING:  # typing only: torch and the capture are imported where they are used
    import torch
    from torch import nn

    from pipeplan.capture import LayerGraph, StageModule

__all__ = [
    "LossError",
    "loss_backward",
    "Progress",
    "StepModel",
    "LayerMeasurement",
    "PassSample",
    "Measurements",
    "run_pass",
    "backward_to_inputs",
    "input_grad_part",
    "time_step",
    "step_saved_bytes",
    "measure_stages",
    "measure_layers",
    "disable_inplace",
    "time_optimizer_steps",
]

# progress(done, total, label): called after each measured pass (or unit of work).


class LossError(InputError):
    """The model file's ``loss_fn`` raised on the output rebuilt from the layers."""


Progress = Callable[[int, int, str], None]


class StepModel(Protocol):
    """What a whole step runs: the model (an ``nn.Module``) or its captured graph (``WholeGraph``)."""

    def __call__(self, *inputs: torch.Tensor) -> Any: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...


@dataclass(frozen=True)
class LayerMeasurement:
    forward: Stats  # ms
    backward: Stats  # ms (zero when no output of the layer needs a gradient)
    output_bytes: int
    param_bytes: int
    saved_bytes: int
    largest_param_bytes: int = 0
    # bytes of its input tensors: what it keeps for backward under torch.utils.checkpoint
    kept_bytes: int = -1
    # ms of the backward to the layer's inputs alone (``input_only`` passes); None: not measured
    backward_input: Stats | None = None
    # what its backward holds beyond its saved bytes (LayerProfile.backward_working_bytes)
    working_bytes: int = -1
    # what a zero-bubble input pass keeps for its weight pass (LayerProfile.deferred_weight_bytes)
    deferred_bytes: int = -1
    saved_by: tuple[int, ...] | None = None  # LayerProfile.output_saved_by
    output_tensors: int = -1

    @property
    def backward_input_ms(self) -> float | None:
        """The input gradient's ms, at most the whole backward's median; None where not measured.

        A layer without parameters has no weight gradient: its whole backward is the input's
        (not the input-only pass's median, which differs from the whole one by noise alone)."""
        if self.backward_input is None:
            return None
        return input_grad_part(self.backward.median, self.backward_input.median, self.param_bytes)


@dataclass
class PassSample:
    """One layer-by-layer training step: per-layer times (ms) and, when counted, bytes.

    In an ``input_only`` pass ``backward_ms`` holds each layer's backward to its inputs alone."""

    forward_ms: list[float]
    backward_ms: list[float]
    loss_ms: float = 0.0
    output_bytes: list[int] = field(default_factory=list)
    saved_bytes: list[int] = field(default_factory=list)
    kept_bytes: list[int] = field(
        default_factory=list
    )  # its input tensors (LayerProfile.recompute_kept_bytes)
    # what its backward holds beyond its saved bytes (0: no gradient reached it)
    working_bytes: list[int] = field(default_factory=list)
    deferred_bytes: list[int] = field(default_factory=list)  # from "I" to "W" (0: no gradient reached it)
    # the layers whose forward saved each layer's output (LayerProfile.output_saved_by)
    saved_by: list[tuple[int, ...]] = field(default_factory=list)
    output_tensors: list[int] = field(default_factory=list)  # tensors in each layer's output
    loss_saved_bytes: int = -1  # the loss's (``loss_bytes``), when counted
    loss_working_bytes: int = -1


def disable_inplace(model: nn.Module) -> int:
    """Turn off ``inplace=True`` on the model's modules (ReLU, Dropout, ...); return how many.

    A layer's input is a detached tensor that requires grad, as it is on a pipeline
    stage's boundary; autograd forbids modifying such a tensor in place.
    """
    changed = 0
    for module in model.modules():
        if getattr(module, "inplace", False) is True:
            # a plain flag: nn.Module's typed __setattr__ takes only tensors and modules
            setattr(module, "inplace", False)  # noqa: B010
            changed += 1
    return changed


def _leaves(value: object) -> list[Any]:
    from torch.utils import _pytree as pytree

    return pytree.tree_leaves(value)


def _run(stage: StageModule, args: tuple[object, ...]) -> tuple[object, ...]:
    try:
        outputs = stage.module(*args)
    except Exception as exc:
        raise InputError(f"layer {stage.index} raised when run on its own: {one_line(exc)}") from exc
    if len(outputs) != len(stage.output_names):
        raise RuntimeError(
            f"layer {stage.index} returned {len(outputs)} values for output names {stage.output_names}"
        )
    return tuple(outputs)


def loss_backward(loss_fn: Callable[[Any, Any], Any], output: object, targets: object) -> None:
    """The loss on the captured layers' output and its backward; ``LossError`` if ``loss_fn`` raises."""
    loss = _loss(loss_fn, output, targets)
    if loss.requires_grad:
        loss.backward()


def loss_bytes(
    loss_fn: Callable[[Any, Any], Any],
    output: object,
    targets: object,
    counter: SavedTensorCounter | None = None,
) -> tuple[int, int]:
    """``loss_backward``, measured: (saved, working) bytes of the loss, one minibatch. Saved:
    the storages autograd saves in the loss's forward that ``counter`` (the pass's: what a
    layer saved) has not counted (a cross-entropy's log-probabilities, the logits' size).
    Working: the most bytes its backward's new storages hold at once (the output's gradient,
    handed to the last layer, among them)."""
    from pipeplan.profiler.live_bytes import LiveBytes

    counter = SavedTensorCounter() if counter is None else counter
    before = counter.saved_bytes
    with count_saved(counter=counter):
        loss = _loss(loss_fn, output, targets)
    saved = counter.saved_bytes - before
    if not loss.requires_grad:
        return saved, 0
    with LiveBytes() as live:
        loss.backward()
    return saved, live.peak


def _loss(loss_fn: Callable[[Any, Any], Any], output: object, targets: object) -> Any:
    try:
        return loss_fn(output, targets)
    except Exception as exc:
        raise LossError(f"loss_fn raised on the output of the captured layers: {one_line(exc)}") from exc


def run_pass(
    stages: Sequence[StageModule],
    inputs: Sequence[torch.Tensor],
    targets: object,
    loss_fn: Callable[[Any, Any], Any],
    timer: Timer,
    count_bytes: bool = False,
    input_only: bool = False,
) -> PassSample:
    """Forward layer by layer, the loss, then backward layer by layer in reverse (all timed).

    With ``count_bytes``, a layer's saved bytes are the storages autograd saves during its
    forward that no earlier layer saved (a layer's output saved again as the next layer's
    input counts once), so the layers sum to the whole forward's figure; and a layer's
    backward working bytes are what its backward holds beyond them
    (``memory.backward_working_bytes``). With
    ``input_only``, each layer's backward runs to its inputs alone (``backward_to_inputs``:
    the input gradient "B" of a zero-bubble schedule, without the weight gradient "W").
    """
    import torch

    from pipeplan.capture import MODEL_OUTPUT

    sample = PassSample(forward_ms=[0.0] * len(stages), backward_ms=[0.0] * len(stages))
    if count_bytes:  # filled in reverse; a layer no gradient reaches holds none
        sample.working_bytes = [0] * len(stages)
        sample.deferred_bytes = [0] * len(stages)
    values: dict[str, Any] = {f"input:{k}": value for k, value in enumerate(inputs)}
    produced: list[tuple[object, ...]] = []
    args_of: list[tuple[object, ...]] = []  # each layer's inputs (for ``input_only`` and ``count_bytes``)
    # one counter for the whole pass: a storage counts in the first layer that saves it
    counter = SavedTensorCounter(exclude=[p for stage in stages for p in stage.module.parameters()])
    owner: dict[int, int] = {}  # storage key of a layer's output -> that layer
    saved_by: list[set[int]] = [set() for _ in stages]
    with torch.enable_grad():
        for position, stage in enumerate(stages):
            args = tuple(values[name] for name in stage.input_names)
            if count_bytes:
                before = counter.saved_bytes
                with count_saved(counter=counter):
                    outputs = _run(stage, args)
                produced_tensors = tensors_in(list(outputs))
                sample.output_tensors.append(len(produced_tensors))
                for key in map(storage_key, produced_tensors):
                    owner.setdefault(key, position)
                for key in counter.take_packed() & owner.keys():
                    saved_by[owner[key]].add(position)
                sample.saved_bytes.append(counter.saved_bytes - before)
                sample.output_bytes.append(output_bytes(outputs))
                sample.kept_bytes.append(output_bytes(args))
            else:
                timer.start()
                outputs = _run(stage, args)
                sample.forward_ms[position] = timer.stop()
            produced.append(outputs)
            args_of.append(args if input_only or count_bytes else ())
            values.update((name, detached(value)) for name, value in zip(stage.output_names, outputs))
        result = values[MODEL_OUTPUT]
        timer.start()
        if count_bytes:
            sample.loss_saved_bytes, sample.loss_working_bytes = loss_bytes(loss_fn, result, targets, counter)
            sample.saved_by = [tuple(sorted(savers)) for savers in saved_by]
        else:
            loss_backward(loss_fn, result, targets)
        sample.loss_ms = timer.stop()
        for position in reversed(range(len(stages))):
            stage = stages[position]
            pairs = [
                (output, detached.grad)
                for name, value in zip(stage.output_names, produced[position])
                for output, detached in zip(_leaves(value), _leaves(values[name]))
                if isinstance(output, torch.Tensor) and output.requires_grad and detached.grad is not None
            ]
            produced[position] = ()
            for name in stage.output_names:  # free the gradients as soon as they are used,
                values[name] = None  # as a whole-model backward would
            if pairs:
                heads, grads = [o for o, _ in pairs], [g for _, g in pairs]
                if count_bytes:
                    sample.deferred_bytes[position] = deferred_weight_bytes(
                        heads, grads, stage.module.parameters(), args_of[position]
                    )
                    sample.working_bytes[position] = backward_working_bytes(
                        heads, grads, stage.module.parameters(), args_of[position]
                    )
                elif input_only:
                    inputs = _leaves(list(args_of[position]))
                    sample.backward_ms[position] = time_backward(
                        timer, heads, functools.partial(backward_to_inputs, heads, grads, inputs)
                    )
                else:
                    sample.backward_ms[position] = time_backward(
                        timer, heads, functools.partial(torch.autograd.backward, heads, grads)
                    )
            args_of[position] = ()
            del pairs
    sample.forward_ms = [read(t) for t in sample.forward_ms]
    sample.backward_ms = [read(t) for t in sample.backward_ms]
    sample.loss_ms = read(sample.loss_ms)
    return sample


def input_grad_part(backward_ms: float, input_only_ms: float, param_bytes: int) -> float:
    """A layer's input-gradient ms from its whole backward and its input-only backward medians.

    >>> input_grad_part(2.0, 1.2, 64), input_grad_part(2.0, 2.5, 64), input_grad_part(2.0, 1.2, 0)
    (1.2, 2.0, 2.0)
    """
    return backward_ms if param_bytes == 0 else min(input_only_ms, backward_ms)


def backward_to_inputs(
    heads: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[object]
) -> None:
    """Backward from ``heads`` to the floating ``inputs`` that need a gradient, accumulated in
    their ``.grad``; no weight gradient is computed (autograd runs only the work that reaches
    the inputs: a Linear's ``grad_y @ W``, not ``grad_y.T @ x``). A layer whose inputs need
    none (an embedding of token ids) does nothing."""
    import torch

    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not wanted:
        return
    found = torch.autograd.grad(list(heads), wanted, list(grads), allow_unused=True)
    for x, g in zip(wanted, found):
        if g is not None:
            x.grad = g if x.grad is None else x.grad + g


def _clear_grads(model: StepModel) -> None:
    for parameter in model.parameters():
        parameter.grad = None


def time_step(
    model: StepModel,
    inputs: Sequence[torch.Tensor],
    targets: object,
    loss_fn: Callable[[Any, Any], Any],
    timer: Timer,
) -> float:
    """One whole-model forward + loss + backward, in ms."""
    import torch

    _clear_grads(model)
    with torch.enable_grad():
        timer.start()
        loss_fn(model(*inputs), targets).backward()
        return read(timer.stop())


def step_saved_bytes(
    model: StepModel, inputs: Sequence[torch.Tensor], targets: object, loss_fn: Callable[[Any, Any], Any]
) -> int:
    """Distinct storages autograd saves in one whole forward (parameters and the loss excluded)."""
    import torch

    with torch.enable_grad(), count_saved(exclude=model.parameters()) as counter:
        output = model(*inputs)
    del output
    return counter.saved_bytes


def time_optimizer_steps(model: nn.Module, timer: Timer, warmup: int, repeats: int) -> dict[str, float]:
    """Median ms of one ``step()`` of each optimizer in ``pipeplan.optimizers`` over all parameters.

    The gradients are zeros, so the weights keep their values; the arithmetic (and, for
    momentum and Adam, the state updates) is the same as in training. The planner splits
    a step's time among stages by their parameter bytes. Parameters in less than float32
    (a bf16 profile) train in mixed precision (``pipeplan.precision``), so the step is
    timed as the runtime takes it: on float32 masters, then the copy back into them.
    """
    import torch

    from pipeplan.optimizers import OPTIMIZERS, make_optimizer

    parameters: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    if not parameters:
        return dict.fromkeys(OPTIMIZERS, 0.0)
    copies: list[torch.Tensor] = []
    if parameters[0].is_floating_point() and parameters[0].element_size() < 4:
        copies = parameters
        parameters = [torch.nn.Parameter(p.detach().float()) for p in copies]
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    optimizers = {
        name: _refreshing(make_optimizer(name, parameters, lr=1e-3), parameters, copies)
        for name in OPTIMIZERS
    }
    samples: dict[str, list[float]] = {name: [] for name in OPTIMIZERS}
    # Round-robin, so start-up costs (a thread pool waking up, state allocation) fall in
    # the untimed first rounds of every optimizer, not on whichever is timed first.
    for iteration in range(max(warmup, 2) + repeats):
        for name, optimizer in optimizers.items():
            timer.start()
            optimizer.step()
            elapsed = read(timer.stop())
            if iteration >= max(warmup, 2):
                samples[name].append(elapsed)
    times = {name: robust_stats(values).median for name, values in samples.items()}
    _clear_grads(model)
    return times


class _refreshing:
    """An optimizer whose ``step`` also copies the (master) ``parameters`` into ``copies``."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, parameters: list[torch.Tensor], copies: list[torch.Tensor]
    ) -> None:
        self.optimizer, self.parameters, self.copies = optimizer, parameters, copies

    def step(self) -> None:
        import torch

        self.optimizer.step()
        if self.copies:
            with torch.no_grad():
                torch._foreach_copy_(self.copies, self.parameters)


@dataclass(frozen=True)
class Measurements:
    layers: list[LayerMeasurement]  # by layer index
    loss: Stats  # ms
    step: Stats  # whole-model forward + loss + backward, ms
    step_saved_bytes: int
    loss_saved_bytes: int = -1  # the loss's memory, one minibatch (``loss_bytes``)
    loss_working_bytes: int = -1


def measure_stages(
    stages: Sequence[StageModule],
    model: StepModel,
    inputs: Sequence[torch.Tensor],
    targets: object,
    loss_fn: Callable[[Any, Any], Any],
    timer: Timer,
    warmup: int,
    repeats: int,
    progress: Progress | None = None,
) -> Measurements:
    """Per-layer measurements and the whole step, over ``repeats`` passes after ``warmup``.

    Each pass runs the step layer by layer and then the whole model, so a change in the
    machine's load affects both alike and their ratio stays meaningful; each measured pass
    is followed by one whose backwards stop at the layers' inputs (``run_pass(input_only=True)``),
    which gives every layer's input-gradient part of its backward.
    """
    total = 1 + warmup + repeats
    _clear_grads(model)
    counted = run_pass(stages, inputs, targets, loss_fn, timer, count_bytes=True)
    whole_saved = step_saved_bytes(model, inputs, targets, loss_fn)
    if progress is not None:
        progress(1, total, "counting bytes")
    samples: list[PassSample] = []
    input_samples: list[PassSample] = []
    steps: list[float] = []
    for iteration in range(warmup + repeats):
        _clear_grads(model)
        sample = run_pass(stages, inputs, targets, loss_fn, timer)
        step = time_step(model, inputs, targets, loss_fn, timer)
        if iteration >= warmup:
            samples.append(sample)
            steps.append(step)
            _clear_grads(model)
            input_samples.append(run_pass(stages, inputs, targets, loss_fn, timer, input_only=True))
        if progress is not None:
            progress(2 + iteration, total, "warm-up" if iteration < warmup else "measuring")
    _clear_grads(model)
    layers = [
        LayerMeasurement(
            forward=robust_stats([s.forward_ms[position] for s in samples]),
            backward=robust_stats([s.backward_ms[position] for s in samples]),
            output_bytes=counted.output_bytes[position],
            param_bytes=param_bytes(stage.module.parameters()),
            saved_bytes=counted.saved_bytes[position],
            largest_param_bytes=largest_param_bytes(stage.module.parameters()),
            kept_bytes=counted.kept_bytes[position],
            working_bytes=counted.working_bytes[position],
            deferred_bytes=counted.deferred_bytes[position],
            saved_by=counted.saved_by[position],
            output_tensors=counted.output_tensors[position],
            backward_input=(
                robust_stats([s.backward_ms[position] for s in input_samples]) if input_samples else None
            ),
        )
        for position, stage in enumerate(stages)
    ]
    return Measurements(
        layers,
        robust_stats([s.loss_ms for s in samples]),
        robust_stats(steps),
        whole_saved,
        counted.loss_saved_bytes,
        counted.loss_working_bytes,
    )


class WholeGraph:
    """A one-stage split called like the model: ``whole(*inputs)`` returns the model output."""

    def __init__(self, stage: StageModule) -> None:
        self.stage = stage

    def __call__(self, *inputs: torch.Tensor) -> Any:
        args = (inputs[int(name.split(":")[1])] for name in self.stage.input_names)
        return self.stage.module(*args)[-1]

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.stage.module.parameters()


def measure_layers(
    graph: LayerGraph,
    inputs: Sequence[torch.Tensor],
    targets: object,
    loss_fn: Callable[[Any, Any], Any],
    timer: Timer,
    warmup: int,
    repeats: int,
    progress: Progress | None = None,
) -> tuple[list[LayerProfile], Measurements]:
    """One ``LayerProfile`` per node of ``graph`` (a ``pipeplan.capture.LayerGraph``), and all measurements."""
    whole: StepModel = graph.model if graph.kind != "export" else WholeGraph(graph.split([0] * len(graph))[0])
    per_layer = graph.layer_modules()
    try:
        measured = measure_stages(
            per_layer, whole, inputs, targets, loss_fn, timer, warmup, repeats, progress
        )
    except LossError as exc:
        dropped = getattr(graph, "dropped_outputs", ())
        if not dropped:
            raise
        raise LossError(
            f"{exc}; the capture set the output fields {', '.join(dropped)} to None (not tensors: "
            f"they cannot cross stages); build the model without them (use_cache=False)"
        ) from exc
    from pipeplan.profiler.selective import measure_selective, selective_saved

    selective = measure_selective(graph, per_layer, inputs, timer, warmup, repeats)
    layers = [
        LayerProfile(
            index=node.index,
            name=node.name,
            type=node.type,
            inputs=tuple(node.inputs),
            forward_ms=layer.forward.median,
            backward_ms=layer.backward.median,
            output_bytes=layer.output_bytes,
            param_bytes=layer.param_bytes,
            saved_bytes=layer.saved_bytes,
            forward_ms_spread=layer.forward.spread,
            backward_ms_spread=layer.backward.spread,
            model_inputs=tuple(node.model_inputs),
            parameters=tuple(sorted(set(stage.parameter_names.values()))),
            largest_param_bytes=layer.largest_param_bytes,
            recompute_kept_bytes=layer.kept_bytes,
            backward_input_ms=layer.backward_input_ms,
            selective_saved_bytes=selective_saved(layer.saved_bytes, selective.get(node.index)),
            selective_recompute_ms=(selective[node.index].recompute_ms if node.index in selective else -1.0),
            backward_working_bytes=layer.working_bytes,
            deferred_weight_bytes=layer.deferred_bytes,
            output_saved_by=layer.saved_by,
            output_tensors=layer.output_tensors,
        )
        for node, layer, stage in zip(graph.layers, measured.layers, per_layer)
    ]
    return layers, measured
