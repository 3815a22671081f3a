"""``profile_on_meta``: the profile of a model built on the meta device, one layer in memory at a time.

The layer graph is captured from shapes alone; each layer is then measured alone
(``pipeplan.profiler.layerwise``). The whole step (and the optimizer over every
parameter) is measured only when the whole model fits on the device with room to spare
(``whole_step_fits``); otherwise the profile says why not (``step_not_measured``) and
times the optimizers on a sample of the parameters (``OPTIMIZER_SAMPLE_BYTES``),
scaling linearly to all of them (an optimizer step reads and writes every parameter's
state once: its time is proportional to the bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pipeplan.memory_errors import OutOfMemory, memory_step
from pipeplan.model_inputs import ModelInputs
from pipeplan.modelfile import ModelFile
from pipeplan.precision import Precision
from pipeplan.profile import Profile
from pipeplan.profiler.device import available_bytes, device_info, resolve_dtype
from pipeplan.profiler.layerwise import measure_layerwise
from pipeplan.profiler.measure import (
    Progress,
    disable_inplace,
    step_saved_bytes,
    time_optimizer_steps,
    time_step,
)
from pipeplan.profiler.memory import output_bytes, shared_parameter_bytes
from pipeplan.profiler.timing import Stats, Timer, make_timer, robust_stats
from pipeplan.units import format_bytes

if TYPE_CHECKING:  # typing only: torch and the capture are imported where they are used
    import torch
    from torch import nn

    from pipeplan.capture import LayerGraph

__all__ = ["OPTIMIZER_SAMPLE_BYTES", "profile_on_meta", "whole_step_fits"]

OPTIMIZER_SAMPLE_BYTES = 16 << 20  # parameters the optimizer steps are timed on, at most
_ROOM = 0.7  # the whole step may use at most this share of the available memory


def whole_step_fits(
    param_bytes: int, activation_bytes: int, available: int, precision: Precision | None = None
) -> tuple[bool, str]:
    """Whether the whole step fits in ``_ROOM`` of ``available`` bytes; the reason when not.

    Counted: the parameters (``param_bytes``, in the compute dtype), their gradients, Adam's
    two moments, and under mixed precision the float32 masters and their gradients beside the
    compute copies (10 bytes per bf16 byte), plus the activations. Measured on an H100: an
    8-layer bf16 Llama of 7B width, batch 4 x 2048, counted 50.4 GB here, peaked at 60.3 GB (the
    optimizers' temporaries and the loss's logits): the rest of ``_ROOM`` is for those.
    """
    ratio = precision.gradient_ratio if precision is not None and precision.mixed else 0.0
    per_byte = 2 + 4 * ratio if ratio else 4  # copies + gradients + (masters, master gradients, 2 moments)
    need = int(per_byte * param_bytes) + activation_bytes
    if need <= _ROOM * available:
        return True, ""
    return False, (
        f"the whole model needs about {format_bytes(need)} (parameters, gradients, Adam state"
        f"{', float32 masters' if ratio else ''}, activations), more than {_ROOM:.0%} of the "
        f"{format_bytes(available)} available"
    )


def profile_on_meta(
    model_name: str,
    model_file: ModelFile,
    network: nn.Module,
    inputs: tuple[ModelInputs, ModelInputs],
    targets: object,
    batch_size: int,
    device: torch.device,
    dtype: str,
    warmup: int,
    repeats: int,
    progress: Progress | None,
    leaf_modules: tuple[str, ...],
    every_layer: bool,
    data_ms: float,
    whole_step: bool = True,
    opaque_modules: tuple[str, ...] = (),
) -> Profile:
    """Measure ``network`` (on meta) layer by layer; ``inputs`` = (as drawn, on the device),
    each a ``ModelInputs``."""
    from pipeplan.capture import build_layer_graph, module_records
    from pipeplan.capture.materialise import release
    from pipeplan.capture.torch_split import recorded_split

    torch_dtype = resolve_dtype(dtype)
    raw_inputs, placed = inputs
    device_inputs = placed.tensors()  # what the graph's placeholders take
    # Captured in the dtype the layers will run in: a torch.export graph bakes dtypes (an
    # HF rotary embedding asserts its inv_freq buffer's). On meta the cast costs nothing.
    network.to(torch_dtype)
    raw_inputs = raw_inputs.map(lambda t: t.to(torch_dtype) if t.is_floating_point() else t)
    network.train()
    disable_inplace(network)
    graph = build_layer_graph(network, raw_inputs, leaf_modules, opaque_modules, device=device)
    modules = module_records(network, raw_inputs)
    reach, blocked = recorded_split(
        network, raw_inputs, [layer.name for layer in graph.layers], modules, graph.opaque_modules
    )
    timer = make_timer(device)
    result = measure_layerwise(
        graph,
        network,
        device_inputs,
        targets,
        model_file.loss_fn,
        timer,
        warmup,
        repeats,
        device,
        torch_dtype,
        seed=0,
        every_layer=every_layer,
        progress=progress,
    )
    from pipeplan.profiler.tensor_split import fill_split_fields, layer_layouts

    # sizes and all-reduce counts only: the shares are measured on a whole model (docs/profile-format.md)
    element_size = torch_dtype.itemsize
    layers = fill_split_fields(
        result.layers,
        layer_layouts(network, model_file.tp_plan, result.layers, str(model_file.path), element_size),
        {},
    )
    parameters = _param_bytes(network, torch_dtype)
    saved = sum(layer.saved_bytes for layer in result.layers)
    fits, why = whole_step_fits(parameters, saved, available_bytes(device), Precision.for_dtype(dtype))
    if not whole_step:
        fits, why = False, "--no-whole-step was given"
    step = robust_stats([0.0])
    whole_saved = 0
    sample_bytes = 0
    if fits:
        try:
            with memory_step("the whole model was measured", "it is left out of the profile"):
                step, whole_saved, optimizer_ms = _measure_whole(
                    graph,
                    network,
                    device_inputs,
                    targets,
                    model_file.loss_fn,
                    timer,
                    warmup,
                    repeats,
                    device,
                    torch_dtype,
                )
        except OutOfMemory as exc:
            fits, why = False, str(exc)
        finally:
            release(network, [*network.parameters(), *network.buffers()])
    if not fits:
        optimizer_ms, sample_bytes = _sampled_optimizer_ms(
            network, device, torch_dtype, timer, warmup, repeats
        )
    return Profile(
        model=model_name,
        fingerprint=graph.fingerprint,
        device=device_info(device),
        batch_size=batch_size,
        dtype=dtype,
        layers=tuple(layers),
        step_ms=step.median,
        step_ms_spread=step.spread,
        input_bytes=output_bytes(device_inputs),
        warmup=warmup,
        repeats=repeats,
        step_saved_bytes=whole_saved,
        loss_ms=result.loss.median,
        loss_saved_bytes=result.loss_saved_bytes,
        loss_working_bytes=result.loss_working_bytes,
        optimizer_ms=optimizer_ms,
        data_ms=data_ms,
        capture=graph.kind,
        leaf_modules=leaf_modules,
        dropped_outputs=graph.dropped_outputs,
        build="meta",
        step_not_measured=why,
        optimizer_sample_bytes=sample_bytes,
        modules=modules,
        opaque_modules=graph.opaque_modules,
        master_dtype=Precision.for_dtype(dtype).master_dtype,
        pipelining_reach=reach,
        pipelining_blocked=blocked,
        shared_parameter_bytes=shared_parameter_bytes(network, (layer.parameters for layer in layers)),
    )


def _measure_whole(
    graph: LayerGraph,
    network: nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: object,
    loss_fn: Callable[[Any, Any], Any],
    timer: Timer,
    warmup: int,
    repeats: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Stats, int, dict[str, float]]:
    """The whole step (ms stats), its saved bytes and the optimizer steps, all parameters materialised."""
    from pipeplan.capture.materialise import materialise, rebind
    from pipeplan.profiler.measure import WholeGraph

    materialise(network, None, device, 0, dtype)
    rebind([graph.graph_module], network)
    runner = WholeGraph(graph.split([0] * len(graph))[0]) if graph.kind == "export" else network
    whole_saved = step_saved_bytes(runner, inputs, targets, loss_fn)
    samples = [time_step(runner, inputs, targets, loss_fn, timer) for _ in range(warmup + repeats)][warmup:]
    return robust_stats(samples), whole_saved, time_optimizer_steps(network, timer, warmup, repeats)


def _param_bytes(network: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the distinct parameters in ``dtype`` (floating ones cast)."""
    seen = {
        id(p): p.numel()
        * (p.new_empty((), dtype=dtype).element_size() if p.is_floating_point() else p.element_size())
        for p in network.parameters()
    }
    return sum(seen.values())


def _sampled_optimizer_ms(
    network: nn.Module, device: torch.device, dtype: torch.dtype, timer: Timer, warmup: int, repeats: int
) -> tuple[dict[str, float], int]:
    """Optimizer step times over all parameters, timed on the first ``OPTIMIZER_SAMPLE_BYTES``
    of them (fresh zero tensors of their shapes) and scaled by bytes; (times, sample bytes)."""
    import torch
    from torch import nn

    total = _param_bytes(network, dtype)
    sample: list[nn.Parameter] = []
    taken = 0
    for parameter in network.parameters():
        if not parameter.requires_grad:
            continue
        size = parameter.numel() * torch.empty((), dtype=dtype).element_size()
        numel = (
            parameter.numel()
            if taken + size <= OPTIMIZER_SAMPLE_BYTES
            else max((OPTIMIZER_SAMPLE_BYTES - taken) // torch.empty((), dtype=dtype).element_size(), 1)
        )
        sample.append(nn.Parameter(torch.zeros(numel, device=device, dtype=dtype)))
        taken += sample[-1].numel() * sample[-1].element_size()
        if taken >= OPTIMIZER_SAMPLE_BYTES:
            break
    holder = nn.ParameterList(sample)
    times = time_optimizer_steps(holder, timer, warmup, repeats)
    scale = total / taken if taken else 0.0
    return {name: value * scale for name, value in times.items()}, taken
