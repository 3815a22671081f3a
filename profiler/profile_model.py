"""``profile_model``: load a model file, measure it layer by layer, return a ``Profile``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeplan.errors import InputError, one_line
from pipeplan.memory_errors import memory_step
from pipeplan.model_inputs import ModelInputs
from pipeplan.modelfile import BUNDLED_MODELS, ModelFile, load_model_file, resolve_model_path
from pipeplan.precision import Precision
from pipeplan.profile import Profile
from pipeplan.profiler.batch_sizes import measure_smaller_sizes, with_size_times
from pipeplan.profiler.device import device_info, resolve_device, resolve_dtype
from pipeplan.profiler.measure import Progress, disable_inplace, measure_layers, time_optimizer_steps
from pipeplan.profiler.memory import output_bytes, shared_parameter_bytes
from pipeplan.profiler.timing import make_timer, robust_stats

if TYPE_CHECKING:  # typing only: torch is imported where it is used
    import torch
    from torch import nn

__all__ = ["BUNDLED_MODELS", "resolve_model_path", "prepare_batch", "check_model_runs", "profile_model"]


def prepare_batch(
    inputs: ModelInputs, targets: object, device: torch.device, dtype: torch.dtype
) -> tuple[ModelInputs, object]:
    """Move the batch to ``device``; floating-point tensors are cast to ``dtype``.

    Targets that are not a tensor are left as they are, for the model file's ``loss_fn``.
    """
    import torch

    def move(value: object) -> object:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_floating_point():
            return value.to(device=device, dtype=dtype)
        return value.to(device=device)

    return inputs.map(move), move(targets)


def check_model_runs(
    model_file: ModelFile,
    model: nn.Module,
    inputs: ModelInputs,
    targets: object,
    batch_size: int,
    allow_nonfinite: bool = False,
) -> None:
    """One forward + loss + backward; ``InputError`` (one line) when the user's code raises,
    or when the loss is NaN or infinite (unless ``allow_nonfinite``)."""
    import torch

    try:
        output = inputs.call(model)
    except Exception as exc:
        raise InputError(
            f"{model_file.path}: the model raised on sample_batch({batch_size}): {one_line(exc)}"
        ) from exc
    try:
        loss = model_file.loss_fn(output, targets)
    except Exception as exc:
        raise InputError(f"{model_file.path}: loss_fn raised on the model output: {one_line(exc)}") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError(f"{model_file.path}: loss_fn returned {shape}, expected a scalar Tensor")
    if not allow_nonfinite and not bool(torch.isfinite(loss.detach()).all()):
        raise InputError(
            f"{model_file.path}: the loss is {float(loss.detach())} at step 0 (the check pass, "
            f"whole model, sample_batch({batch_size})); pass --allow-nonfinite to profile anyway"
        )
    try:
        loss.backward()
    except Exception as exc:
        raise InputError(f"{model_file.path}: backward through the loss raised {one_line(exc)}") from exc
    model.zero_grad(set_to_none=True)


def time_data(
    model_file: ModelFile,
    batch_size: int,
    device: torch.device,
    dtype: torch.dtype,
    warmup: int,
    repeats: int,
) -> float:
    """Median ms to draw one minibatch with ``sample_batch`` and place it on ``device``.

    The runtime draws every minibatch on the input stage and again on the loss stage
    (for the targets), so the planner charges this time to both.
    """
    import time

    import torch

    samples = []
    for iteration in range(warmup + repeats):
        started = time.perf_counter()
        inputs, targets = prepare_batch(*model_file.batch(batch_size, seed=iteration), device, dtype)
        if getattr(device, "type", "cpu") == "cuda":
            torch.cuda.synchronize(device)
        if iteration >= warmup:
            samples.append((time.perf_counter() - started) * 1e3)
    return robust_stats(samples).median


def profile_model(
    model: str | os.PathLike[str],
    batch_size: int = 32,
    device: str | None = None,
    dtype: str = "float32",
    warmup: int = 3,
    repeats: int = 10,
    progress: Progress | None = None,
    threads: int | None = None,
    allow_nonfinite: bool = False,
    leaf_modules: Sequence[str] | None = None,
    opaque_modules: Sequence[str] | None = None,
    build: str = "auto",
    time_every_layer: bool = False,
    whole_step: bool = True,
) -> Profile:
    """Measure every layer of the model file ``model`` (a path or a bundled model's name).

    Times are the median (and interquartile range) over ``repeats`` passes after ``warmup``
    passes, in ms for one minibatch of ``batch_size`` samples; ``step_ms`` is the whole
    model's forward + loss + backward, timed in the same passes. ``progress(done, total,
    label)`` is called after each pass (total = 1 + warmup + repeats). ``threads``
    sets torch's intra-op CPU threads for the measurement (restored afterwards).
    ``leaf_modules`` (class names kept whole as one layer each) overrides the model
    file's ``LEAF_MODULES``; ``opaque_modules`` (classes run as themselves) its ``OPAQUE_MODULES``.
    ``build`` (``auto``, ``eager``, ``meta``; ``pipeplan.capture.materialise.build_model``):
    a model built on meta is measured one layer at a time (``pipeplan.profiler.meta_profile``),
    identical layers timed once unless ``time_every_layer``; the whole step is measured there
    only when it fits and ``whole_step``.
    """
    import torch

    if threads is not None and threads <= 0:
        raise InputError(f"--threads must be positive (got {threads})")
    from pipeplan.host_memory import keep_freed_blocks

    keep_freed_blocks()  # as the runtime does, so the profile measures what will run
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _profile(
            model,
            batch_size,
            device,
            dtype,
            warmup,
            repeats,
            progress,
            allow_nonfinite,
            leaf_modules,
            opaque_modules,
            build,
            time_every_layer,
            whole_step,
        )
    finally:
        torch.set_num_threads(previous_threads)


def _profile(
    model: str | os.PathLike[str],
    batch_size: int,
    device: str | None,
    dtype: str,
    warmup: int,
    repeats: int,
    progress: Progress | None,
    allow_nonfinite: bool,
    leaf_modules: Sequence[str] | None,
    opaque_modules: Sequence[str] | None = None,
    build: str = "auto",
    time_every_layer: bool = False,
    whole_step: bool = True,
) -> Profile:
    """``profile_model`` without the thread setting."""
    if batch_size <= 0:
        raise InputError(f"--batch-size must be positive (got {batch_size})")
    if warmup < 0 or repeats <= 0:
        raise InputError(f"--warmup must be >= 0 and --repeats > 0 (got {warmup} and {repeats})")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    model_file = load_model_file(resolve_model_path(model))
    from pipeplan.capture.materialise import build_model

    with memory_step(
        f"build_model() ran (--build {build})", "profile with --build meta, which holds one layer at a time"
    ):
        network, lazy, note = build_model(model_file.build, build, seed=0)
    if note and progress is not None:
        progress(0, 1, note)
    raw_inputs, raw_targets = model_file.batch(batch_size, seed=0)
    inputs, targets = prepare_batch(raw_inputs, raw_targets, torch_device, torch_dtype)
    leaves = tuple(leaf_modules) if leaf_modules is not None else model_file.leaf_modules
    opaque = tuple(opaque_modules) if opaque_modules is not None else model_file.opaque_modules
    _check_leaf_modules(network, (*leaves, *opaque))
    if lazy:
        from pipeplan.profiler.meta_profile import profile_on_meta

        data_ms = time_data(model_file, batch_size, torch_device, torch_dtype, warmup, repeats)
        return profile_on_meta(
            str(model),
            model_file,
            network,
            (raw_inputs, inputs),
            targets,
            batch_size,
            torch_device,
            dtype,
            warmup,
            repeats,
            progress,
            leaves,
            time_every_layer,
            data_ms,
            whole_step,
            opaque,
        )
    whole = "profile with --build meta, which holds one layer at a time, or lower --batch-size"
    with memory_step("the whole model ran its check step (--build eager)", whole):
        network = network.to(device=torch_device, dtype=torch_dtype).train()
        check_model_runs(model_file, network, inputs, targets, batch_size, allow_nonfinite)

    from pipeplan.capture import build_layer_graph, module_records
    from pipeplan.capture.torch_split import recorded_split

    disable_inplace(network)
    graph = build_layer_graph(network, inputs, leaves, opaque)
    modules = module_records(network, inputs)
    reach, blocked = recorded_split(
        network, inputs, [layer.name for layer in graph.layers], modules, graph.opaque_modules
    )
    timer = make_timer(torch_device)
    with memory_step("the layers and the whole step were measured (--build eager)", whole):
        layers, measured = measure_layers(
            graph, inputs.tensors(), targets, model_file.loss_fn, timer, warmup, repeats, progress
        )

    def draw(size: int) -> tuple[ModelInputs, object]:
        return prepare_batch(*model_file.batch(size, seed=0), torch_device, torch_dtype)

    with memory_step("the layers were measured at smaller batch sizes (--build eager)", whole):
        smaller = measure_smaller_sizes(
            draw, model_file.loss_fn, network, graph, leaves, batch_size, timer, repeats, progress
        )
    if smaller.note and progress is not None:
        progress(0, 1, smaller.note)
    layers = with_size_times(layers, smaller, batch_size)
    from pipeplan.profiler.tensor_split import split_fields

    layers = split_fields(
        network,
        model_file.tp_plan,
        graph,
        layers,
        inputs.tensors(),
        timer,
        warmup,
        torch_device.type,
        str(model_file.path),
    )
    with memory_step(
        "the optimizer steps were timed over every parameter (Adam adds two copies of them)",
        "profile with --build meta, which times them on a 16 MiB sample",
    ):
        optimizer_ms = time_optimizer_steps(network, timer, warmup, repeats)
    data_ms = time_data(model_file, batch_size, torch_device, torch_dtype, warmup, repeats)
    return Profile(
        model=str(model),
        fingerprint=graph.fingerprint,
        device=device_info(torch_device),
        batch_size=batch_size,
        dtype=dtype,
        layers=tuple(layers),
        step_ms=measured.step.median,
        step_ms_spread=measured.step.spread,
        input_bytes=output_bytes(inputs.tensors()),
        warmup=warmup,
        repeats=repeats,
        step_saved_bytes=measured.step_saved_bytes,
        loss_ms=measured.loss.median,
        loss_saved_bytes=measured.loss_saved_bytes,
        loss_working_bytes=measured.loss_working_bytes,
        optimizer_ms=optimizer_ms,
        data_ms=data_ms,
        capture=graph.kind,
        leaf_modules=leaves,
        opaque_modules=graph.opaque_modules,
        dropped_outputs=graph.dropped_outputs,
        modules=modules,
        pipelining_reach=reach,
        pipelining_blocked=blocked,
        build="eager",
        master_dtype=Precision.for_dtype(dtype).master_dtype,
        timed_batch_sizes=(*smaller.batch_sizes, batch_size),
        shared_parameter_bytes=shared_parameter_bytes(network, (layer.parameters for layer in layers)),
    )


def _check_leaf_modules(model: nn.Module, leaf_modules: Sequence[str]) -> None:
    """``InputError`` naming a leaf module class that the model does not contain."""
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in leaf_modules if name not in present]
    if missing:
        raise InputError(
            f"leaf module class {missing[0]!r} is not in the model (its classes include "
            f"{', '.join(sorted(present)[:8])}{', ...' if len(present) > 8 else ''})"
        )
