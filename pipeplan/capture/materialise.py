"""Models built on the meta device, and their weights materialised a few modules at a time.

``build_on_meta`` runs the user's ``build_model()`` under ``torch.device("meta")``: every
parameter and buffer has its shape and dtype and no storage, so a 7B-parameter model
costs no memory. ``materialise(model, tensors, device, seed)`` gives real storage to the
modules holding ``tensors`` and initialises them; ``release`` hands it back.

New tensor objects replace the meta ones in every module of the model that holds them
(a tied embedding and head keep sharing one); ``rebind`` points graph modules captured
before (a stage's ``fx.GraphModule``) at them. Initial values do not depend on which modules are materialised
together (the plan): a module is initialised alone, by its own initialiser, under a seed
derived from the run's seed and its qualified name:

- a Hugging Face ``PreTrainedModel`` (the root or an ancestor): its ``_init_weights(module)``,
  which also recomputes non-persistent buffers (rotary ``inv_freq``);
- else a torch.nn module's ``reset_parameters()`` (BatchNorm: statistics too);
- a module holding tensors with neither cannot be materialised: ``InputError``.

A tensor held by several modules (a tied embedding and head) is initialised by each of
them in the model's module order, whatever the plan, so every copy agrees.

Capture's two steps around a model's build (``pipeplan.capture.build``): ``capture_site``
says where a model is exported (a model on meta: on fake stand-ins on the device its stages
will run on), and ``place_graph`` points the captured graph back at the model's own tensors
and makes the devices it recorded that device.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn

from pipeplan.errors import InputError, one_line
from pipeplan.model_inputs import ModelInputs

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = [
    "BUILDS",
    "CaptureSite",
    "EAGER_BUILD_BYTES",
    "build_model",
    "build_on_meta",
    "capture_site",
    "on_meta",
    "model_bytes",
    "materialise",
    "meta_stand_ins",
    "release",
    "rebind",
    "sample_run",
    "fake_mode_for",
    "fake_stand_ins",
    "module_seed",
    "place_graph",
]


BUILDS = ("auto", "eager", "meta")  # --build
# auto: a model whose parameters and buffers take at most this many bytes is built eagerly
# (today's exact initial weights); a larger one stays on meta until each part is needed
EAGER_BUILD_BYTES = 1 << 30


def build_model(build: Callable[[], nn.Module], mode: str, seed: int) -> tuple[nn.Module, bool, str]:
    """``(model, on_meta, note)``: the user's ``build()`` eagerly under ``torch.manual_seed(seed)``
    or on meta, as ``mode`` (one of ``BUILDS``) says.

    ``note`` is one line when ``auto`` wanted meta but the model file cannot be built there
    (the model is then built eagerly, as before); ``meta`` refuses such a file.
    """
    if mode not in BUILDS:
        raise InputError(f"--build must be one of {', '.join(BUILDS)} (got {mode!r})")
    note = ""
    if mode != "eager":
        model, reason = build_on_meta(build)
        if model is not None and (mode == "meta" or model_bytes(model) > EAGER_BUILD_BYTES):
            return model, True, ""
        if model is None:
            if mode == "meta":
                raise InputError(f"build_model() cannot run on the meta device: {reason}")
            note = f"build_model() cannot run on the meta device ({reason}): built whole"
        del model
    torch.manual_seed(seed)
    return build(), False, note


def build_on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module | None, str]:
    """``(model, "")`` built by ``build()`` under the meta device, or ``(None, reason)``."""
    try:
        with torch.device("meta"):
            model = build()
    except InputError as exc:
        return None, str(exc)
    except Exception as exc:  # the user's code may not run on meta: say so, build eagerly
        return None, one_line(exc)
    if not isinstance(model, nn.Module):
        return None, f"build_model() returned {type(model).__name__}"
    real = [name for name, tensor in _named_tensors(model) if tensor.device.type != "meta"]
    if real:
        return None, f"{real[0]} was created on {dict(_named_tensors(model))[real[0]].device}, not on meta"
    return model, ""


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` has no storage yet."""
    return any(tensor.device.type == "meta" for _, tensor in _named_tensors(model))


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's distinct parameters and buffers (meta or not)."""
    seen = {id(t): t.numel() * t.element_size() for _, t in _named_tensors(model)}
    return sum(seen.values())


def sample_run(
    model: nn.Module, tensors: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor, ...], contextlib.AbstractContextManager[Any]]:
    """``(inputs, context)`` for one run of ``model`` (or a graph over it) on ``tensors``:
    a model on meta runs on meta inputs, one under ``fake_stand_ins`` on fake tensors
    (``fake_mode_for``, entered already: enter the context at once), any other as it is."""
    if on_meta(model):
        return tuple(value.to("meta") for value in tensors), contextlib.nullcontext()
    return tensors, fake_mode_for(model)


def fake_mode_for(
    model: nn.Module, device: torch.device | str = "cpu"
) -> contextlib.AbstractContextManager[Any]:
    """Where ``model`` is on meta, a run with shapes only, as ``torch.export`` will trace it on
    ``device``; else a no-op.

    Inside, the model's meta tensors are fake tensors on ``device`` (``fake_stand_ins``; the
    ones already there when called inside it), their ``FakeTensorMode`` is active (real
    integer inputs such as token ids allowed) and torch reports that it is compiling, as it
    does under ``torch.export``: library code that picks a kernel by device, dtype or
    compilation (a Hugging Face MoE's ``grouped_mm`` and ``histc``) takes the branch the
    captured graph will run, on the device it will run on. The meta tensors come back after.

    An op that meets a meta tensor the model keeps outside its parameters and buffers and a
    real CPU input gives a meta result: torch 2.13 runs the meta kernel on such arguments as
    they are, torch 2.11 fakes both and raises a device mismatch unless meta is the preferred
    device."""
    mode = _fake_mode_of(model)
    if mode is None and not on_meta(model):
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    stack = contextlib.ExitStack()
    if mode is None:
        mode = stack.enter_context(fake_stand_ins(model, device))
    if hasattr(functorch_config, "fake_tensor_prefer_device_type"):
        stack.enter_context(functorch_config.patch(fake_tensor_prefer_device_type="meta"))
    stack.enter_context(mode)
    stack.enter_context(_compiling())
    return stack


@contextlib.contextmanager
def fake_stand_ins(model: nn.Module, device: torch.device | str) -> Iterator[FakeTensorMode]:
    """Inside, every meta parameter and buffer of ``model`` is a fake tensor on ``device``
    (same shape, stride and dtype, no storage) of one ``FakeTensorMode``, which it yields;
    the meta tensors come back after. A graph exported inside records ``device`` where the
    model's code reads a device, as an eager model's does; ``rebind`` graph modules made
    inside to the meta originals."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    stand_ins: dict[int, torch.Tensor] = {}
    originals: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensor in _own_tensors(module):
            if tensor.device.type == "meta" and id(tensor) not in stand_ins:
                with mode:
                    fake = torch.empty_strided(
                        tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device
                    )
                stand_ins[id(tensor)] = _like(tensor, fake)
                originals[id(stand_ins[id(tensor)])] = tensor
    _replace(model, stand_ins)
    try:
        yield mode
    finally:
        _replace(model, originals)


def _fake_mode_of(model: nn.Module) -> FakeTensorMode | None:
    """The ``FakeTensorMode`` of the model's fake stand-ins, if it holds any."""
    from torch._subclasses.fake_tensor import FakeTensor

    return next((t.fake_mode for _, t in _named_tensors(model) if isinstance(t, FakeTensor)), None)


def _compiling() -> contextlib.AbstractContextManager[Any]:
    """torch reports compiling and exporting inside (``torch.compiler.is_compiling()``), as
    under ``torch.export``, which sets the same flags."""
    from torch._export import utils as export_utils

    state = getattr(export_utils, "_compiling_state_context", None)
    return state() if state is not None else contextlib.nullcontext()


def module_seed(seed: int, name: str) -> int:
    """The seed module ``name`` is initialised under: a function of the run's seed and the name."""
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFF_FFFF


def materialise(
    model: nn.Module,
    tensors: Iterable[torch.Tensor] | None,
    device: torch.device | str,
    seed: int,
    dtype: torch.dtype | None = None,
    loaded_after: bool = False,
) -> int:
    """Give storage on ``device`` to the meta tensors in ``tensors`` (None: all) and initialise
    every module that holds one (with all its own tensors); return the bytes allocated.

    New tensor objects replace the meta ones in every module of ``model`` that holds them
    (tied copies stay one object); graph modules made from the model before see them after
    ``rebind``. ``dtype`` casts floating-point tensors after initialisation.
    ``loaded_after`` (``run --weights``, which fails unless it fills every parameter of the
    stage): a module whose own tensors are all parameters among ``tensors`` is given storage
    but not initialised, since the weights overwrite it; a module holding a buffer (computed
    ones such as rotary ``inv_freq`` are not in the weights) is initialised as always.
    """
    wanted = None if tensors is None else {id(t) for t in tensors}
    chosen: list[tuple[str, nn.Module]] = []
    replaced: dict[int, torch.Tensor] = {}
    for name, module in model.named_modules():
        own = _own_tensors(module)
        if wanted is not None and not any(id(t) in wanted for t in own):
            continue
        if not any(t.device.type == "meta" for t in own):
            continue
        overwritten = (
            loaded_after
            and not any(b is not None for b in module._buffers.values())
            and (wanted is None or all(id(t) in wanted for t in own))
        )
        if not overwritten:
            chosen.append((name, module))
        for tensor in own:
            if tensor.device.type == "meta" and id(tensor) not in replaced:
                replaced[id(tensor)] = _like(tensor, torch.empty_like(tensor, device=device))
    _replace(model, replaced)
    held_by: dict[int, int] = {}  # tensor id -> modules holding it (a tied weight: several)
    for holder in model.modules():
        for tensor in _own_tensors(holder):
            held_by[id(tensor)] = held_by.get(id(tensor), 0) + 1
    slots_under: dict[str, list[tuple[dict[str, Any], str]]] = {}  # per ancestor: where its real tensors sit
    for name, module in chosen:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(seed, name))
            _initialise(model, name, module)
            untied = [t for t in _own_tensors(module) if held_by.get(id(t), 0) == 1]
            if untied:
                _ancestor_schemes(model, name, untied, seed, slots_under)
    if dtype is not None:
        cast = {
            id(t): _like(t, t.detach().to(dtype))
            for t in replaced.values()
            if t.is_floating_point() and t.dtype != dtype
        }
        _replace(model, cast)
    return sum(t.numel() * t.element_size() for t in replaced.values())


@contextlib.contextmanager
def meta_stand_ins(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Inside, every floating-point tensor of ``model`` is a storage-less meta stand-in in
    ``dtype``; the originals come back after (no copy, no rounding). A graph captured inside
    bakes ``dtype`` where the model's code reads it (mixed precision captures the layers in
    their compute dtype while the model keeps its float32 weights); ``rebind`` graph modules
    made inside to the originals."""
    stand_ins: dict[int, torch.Tensor] = {}
    originals: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensor in _own_tensors(module):
            if tensor.is_floating_point() and tensor.dtype != dtype and id(tensor) not in stand_ins:
                stand_in = _like(tensor, torch.empty_like(tensor, device="meta", dtype=dtype))
                stand_ins[id(tensor)] = stand_in
                originals[id(stand_in)] = tensor
    _replace(model, stand_ins)
    try:
        yield
    finally:
        _replace(model, originals)


def release(model: nn.Module, tensors: Iterable[torch.Tensor]) -> None:
    """Hand the storage of ``tensors`` back: in ``model`` each becomes a meta tensor again."""
    real = [t for t in tensors if t.device.type != "meta"]
    _replace(model, {id(t): _like(t, torch.empty_like(t, device="meta")) for t in real})
    for tensor in real:  # free the memory now, whoever still holds the old tensor object
        tensor.grad = None
        tensor.detach().untyped_storage().resize_(0)


def rebind(graph_modules: Iterable[nn.Module], model: nn.Module) -> None:
    """Point the ``get_attr`` targets of ``graph_modules`` (fx graphs over ``model``, and the
    graphs nested in them) at the model's current tensors of those qualified names. A tensor
    constant captured on meta with no elements (an empty tensor the model made: GPT-2's) gets
    an empty one on the CPU: it has no values to lose."""
    current: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    current.update(model.named_buffers(remove_duplicate=False))
    for root in graph_modules:
        for graph_module in root.modules():
            if not isinstance(graph_module, fx.GraphModule):
                continue
            for node in graph_module.graph.nodes:
                target = str(node.target)
                if node.op != "get_attr":
                    continue
                if target not in current:
                    _fill_empty_constant(graph_module, target)
                    continue
                path, _, field = target.rpartition(".")
                holder = graph_module.get_submodule(path)
                value = current[target]
                if isinstance(value, nn.Parameter):
                    holder._parameters[field] = value
                else:
                    holder._buffers[field] = value


def _fill_empty_constant(graph_module: nn.Module, target: str) -> None:
    path, _, field = target.rpartition(".")
    holder = graph_module.get_submodule(path)
    value = getattr(holder, field, None)
    if isinstance(value, torch.Tensor) and value.device.type == "meta" and value.numel() == 0:
        empty = torch.empty_like(value, device="cpu")
        if field in holder._buffers:
            holder._buffers[field] = empty
        else:
            setattr(holder, field, empty)


@dataclass(frozen=True)
class CaptureSite:
    """Where an export capture runs, on what, and where its stages will run."""

    on_meta: bool  # the model is on meta: it is exported on fake stand-ins (fake_stand_ins) on target
    target: torch.device  # where the stages will run
    captured_on: torch.device  # where the capture runs: target for a model on meta, else the inputs' device
    sample_inputs: ModelInputs  # as the capture runs them: on target for a model on meta


@contextlib.contextmanager
def capture_site(
    model: nn.Module, sample_inputs: ModelInputs, device: torch.device | str | None
) -> Iterator[CaptureSite]:
    """Inside, ``model`` as it is exported, and where: ``device`` is where the stages will run
    (None: where the sample inputs are; the CPU for a model on meta). A model on meta holds
    fake tensors there (``fake_stand_ins``) and its sample inputs are moved there, so its
    code takes the branches it takes on that device (a kernel or a dtype chosen by device,
    as Hugging Face MoE experts choose); its meta tensors come back after. A model with
    storage is exported where its sample inputs are (``place_graph`` moves the devices)."""
    tensors = sample_inputs.tensors()
    lazy = on_meta(model)
    if device is not None:
        target = torch.device(device)
    else:
        target = torch.device("cpu") if lazy else _inputs_device(tensors)
    if lazy:
        sample_inputs = sample_inputs.map(lambda tensor: tensor.to(target))
    site = CaptureSite(lazy, target, target if lazy else _inputs_device(tensors), sample_inputs)
    with fake_stand_ins(model, target) if lazy else contextlib.nullcontext():
        yield site


def place_graph(graph_module: fx.GraphModule, model: nn.Module, site: CaptureSite) -> None:
    """A graph exported on fake stand-ins reads the model's own meta tensors again (``rebind``),
    and the devices the export recorded where it ran become ``site.target``."""
    if site.on_meta:
        rebind([graph_module], model)  # the model's meta tensors, not the stand-ins
    if site.target != site.captured_on:
        _devices_to(graph_module, site.captured_on, site.target)


def _devices_to(graph_module: fx.GraphModule, source: torch.device, target: torch.device) -> None:
    """An export records the device it ran on (the sample inputs') in factory ops
    (``arange``, ``full``) and ``_assert_tensor_metadata``; make them ``target``, the
    device the stages will run on."""
    for module in graph_module.modules():  # higher-order ops' bodies too
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                node.args = tuple(target if _is(arg, source) else arg for arg in node.args)
                node.kwargs = {k: target if _is(v, source) else v for k, v in node.kwargs.items()}
            module.recompile()


def _is(value: fx.node.Argument, device: torch.device) -> bool:
    return isinstance(value, torch.device) and value == device


def _inputs_device(tensors: tuple[torch.Tensor, ...]) -> torch.device:
    """The device of the sample inputs (the CPU when there are none)."""
    return next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    own = list(module._parameters.values()) + list(module._buffers.values())
    return [t for t in own if t is not None]


def _like(old: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as a Parameter when ``old`` is one (same ``requires_grad``)."""
    if isinstance(old, nn.Parameter):
        return nn.Parameter(value, requires_grad=old.requires_grad)
    return value


def _replace(model: nn.Module, replaced: dict[int, torch.Tensor]) -> None:
    """In every module of ``model``, swap each tensor whose id is a key for its new value."""
    if not replaced:
        return
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for key, tensor in slots.items():
                if tensor is not None and id(tensor) in replaced:
                    slots[key] = replaced[id(tensor)]  # type: ignore[assignment]


def _initialise(model: nn.Module, name: str, module: nn.Module) -> None:
    """Initialise ``module``'s own tensors the way its library does (module docstring)."""
    owner = _pretrained_owner(model, name)
    if owner is not None:
        owner._init_weights(module)
        return
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
        return
    if (
        isinstance(module, nn.Module)
        and not module._parameters
        and all(b is None for b in module._buffers.values())
    ):
        return
    raise InputError(
        f"module {name or '(root)'} ({type(module).__name__}) holds tensors but defines no "
        f"reset_parameters(), so it cannot be initialised after a meta build; define "
        f"reset_parameters() on it, or build the model eagerly (--build eager)"
    )


def _ancestor_schemes(
    model: nn.Module,
    name: str,
    tensors: list[torch.Tensor],
    seed: int,
    slots_under: dict[str, list[tuple[dict[str, Any], str]]],
) -> None:
    """Replay on ``tensors`` (module ``name``'s own, untied) what its Hugging Face ancestors'
    ``_init_weights`` do.

    A library initialises children first, then each parent, whose ``_init_weights(parent)``
    may set its children's tensors by their place: GPT-2's and ModernBERT's output projections
    scaled by depth, T5's attention and feed-forward weights by its dimensions, Whisper's
    sinusoidal positions. Each ancestor (parent first, as the library goes) runs its scheme
    with every other tensor under it swapped for a meta stand-in, under a seed of this module
    and that ancestor: what this module gets does not depend on what else is materialised. A
    tied weight is left out: the library ties after initialising, so the tensor keeps the
    initialisation of the module it belongs to, whatever a parent does to its other name.
    ``slots_under`` caches, per ancestor, the slots holding real tensors (they do not change
    while one ``materialise`` initialises).
    """
    own = {id(t) for t in tensors}
    parts = name.split(".") if name else []
    for depth in range(len(parts) - 1, -1, -1):
        ancestor_name = ".".join(parts[:depth])
        ancestor = model.get_submodule(ancestor_name)
        owner = _pretrained_owner(model, ancestor_name)
        if owner is None or type(ancestor) in (nn.ModuleList, nn.ModuleDict):  # containers: no scheme
            continue
        if ancestor_name not in slots_under:
            slots_under[ancestor_name] = [
                (slots, key)
                for sub in ancestor.modules()
                for slots in (sub._parameters, sub._buffers)
                for key, t in slots.items()
                if t is not None and t.device.type != "meta"
            ]
        others = [
            (slots, key, slots[key]) for slots, key in slots_under[ancestor_name] if id(slots[key]) not in own
        ]
        for slots, key, tensor in others:
            slots[key] = _like(tensor, torch.empty_like(tensor, device="meta"))
        try:
            torch.manual_seed(module_seed(seed, f"{name}<{ancestor_name}"))
            owner._init_weights(ancestor)
        finally:
            for slots, key, tensor in others:
                slots[key] = tensor


def _pretrained_owner(model: nn.Module, name: str) -> Any:
    """The nearest Hugging Face ``PreTrainedModel`` at or above module ``name``, if any."""
    candidates = [model]
    parts = name.split(".") if name else []
    current: nn.Module = model
    for part in parts:
        current = getattr(current, part)
        candidates.append(current)
    for candidate in reversed(candidates):
        if callable(getattr(candidate, "_init_weights", None)) and hasattr(candidate, "config"):
            return candidate
    return None


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()
