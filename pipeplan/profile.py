"""The profile contract: what ``pipeplan profile`` measured, layer by layer.

A ``Profile`` holds one ``LayerProfile`` per layer, indexed by ``LayerProfile.index``
(0..N-1, a topological order: every producer index is smaller than its consumer's).
Times are milliseconds for one minibatch of ``batch_size`` samples; sizes are bytes.
Stored as JSON with ``"schema": "pipeplan.profile/2"``; version 1 files (without the
tensor-parallel fields and ``estimated``) still load, and so do /2 files without the
optional fields of a meta-device profile (``build``, ``step_not_measured``,
``optimizer_sample_bytes``, ``LayerProfile.reused_from``) or ``master_dtype``, or
``LayerProfile.backward_input_ms`` (the input gradient's part of the backward; where
absent, ``input_grad_ms`` assumes half) or ``LayerProfile.backward_working_bytes`` (where
absent, -1: the planner charges no backward working memory and says so) or
``LayerProfile.deferred_weight_bytes`` (where absent, -1: a zero-bubble stage is charged
nothing between its input and weight passes) or ``LayerProfile.output_saved_by`` (where
absent, None: a stage is charged no received or sent values beyond its saved bytes) or
``LayerProfile.output_tensors`` (where absent, -1) or
``shared_parameter_bytes`` (where absent, a tied parameter is priced at its users' smallest
``param_bytes``) or ``loss_saved_bytes`` / ``loss_working_bytes`` (where absent, -1: the
planner charges the loss stage none of the loss's memory and says so).

The module tree (``Profile.modules``, every module in ``named_modules()`` order with its
calls per forward pass, and ``LayerProfile.parameters``) says where an export target can
cut (``pipeplan partition --for``) without the model file; empty when not recorded (a
profile made before it, an imported PipeDream graph, an estimated profile).
``pipelining_reach`` / ``pipelining_blocked`` record torch.distributed.pipelining's own
split of the model (``pipeplan.capture.torch_split``) for ``--for pipelining``.

Tensor parallelism (Megatron's column- then row-parallel linear pairs, vocab-parallel
embeddings and heads): a layer with ``tp_units > 0`` splits t ways for every t dividing
``tp_units`` (its attention heads, or its vocabulary). Of its times and sizes, the
``tp_split_*`` parts divide by t (each of the t ranks holds 1/t of those weights and
activations and runs 1/t of those FLOPs); the rest is repeated on every rank. Each
forward adds ``tp_forward_allreduces`` all-reduces of ``tp_allreduce_bytes`` among the t
ranks, each backward ``tp_backward_allreduces`` (a Megatron block: 2 and 2).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeplan.errors import InputError
from pipeplan.fields import check_fields
from pipeplan.jsonio import read_json, write_json_atomic

__all__ = [
    "PROFILE_SCHEMA",
    "OLDER_PROFILE_SCHEMAS",
    "DeviceInfo",
    "LayerProfile",
    "ModuleRecord",
    "Profile",
    "MAX_MS",
    "MAX_BYTES",
    "ASSUMED_INPUT_GRAD_SHARE",
    "shared_parameters",
]

PROFILE_SCHEMA = "pipeplan.profile/2"
OLDER_PROFILE_SCHEMAS = ("pipeplan.profile/1",)  # still load (new fields take defaults)
# Bounds that no real measurement reaches; beyond them sums lose meaning (1e308 ms)
MAX_MS = 1e9  # 11.6 days for one layer's forward on one minibatch
MAX_BYTES = 2**60  # 1 EiB
# of a backward, the input gradient's part where a profile did not measure it (the rest: weights)
ASSUMED_INPUT_GRAD_SHARE = 0.5


def shared_parameters(holders: Iterable[tuple[int, Iterable[str]]]) -> dict[str, tuple[int, ...]]:
    """Each parameter name more than one holder uses, with those holders' ids (ascending), by
    name: ``holders`` are (id, qualified parameter names) pairs, a layer's
    ``LayerProfile.parameters`` or a stage's parameters. A tied embedding and head.

    >>> shared_parameters([(0, ["emb.weight"]), (1, ["fc.weight"]), (3, ["emb.weight", "emb.weight"])])
    {'emb.weight': (0, 3)}
    """
    users: dict[str, set[int]] = {}
    for holder, names in holders:
        for name in names:
            users.setdefault(name, set()).add(holder)
    return {name: tuple(sorted(ids)) for name, ids in sorted(users.items()) if len(ids) > 1}


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cpu" | "cuda"
    name: str  # e.g. "NVIDIA H100 80GB HBM3" or the CPU model


@dataclass(frozen=True)
class ModuleRecord:
    """One module of the model, as ``model.named_modules()`` lists it (definition order)."""

    name: str  # qualified name; "" is the root
    type: str  # class name
    calls: int  # times one forward pass calls it (0: never, e.g. an nn.ModuleList)
    container: bool = False  # an nn.ModuleList / nn.ModuleDict (torchtitan splits its entries)


@dataclass(frozen=True)
class LayerProfile:
    index: int
    name: str  # qualified module name ("features.3") or fx node name for a functional layer
    type: str  # module class name ("Conv2d") or the op ("add")
    inputs: tuple[int, ...]  # producer layer indices, each < index
    forward_ms: float  # median over repeats
    backward_ms: float  # median over repeats
    output_bytes: int  # bytes of every tensor this layer hands to other layers / the loss
    param_bytes: int  # bytes of the parameters the layer uses (a tied weight counts in each user)
    saved_bytes: int  # bytes autograd saves for backward during this layer's forward
    forward_ms_spread: float = 0.0  # interquartile range (p75 - p25) over repeats
    backward_ms_spread: float = 0.0
    model_inputs: tuple[int, ...] = ()  # positions of the model inputs this layer reads
    # tensor parallelism (module docstring); all 0: the layer is repeated whole on every rank
    tp_units: int = 0  # t must divide it: attention heads, or the vocabulary of an embedding / head
    tp_split_forward_ms: float = 0.0  # of forward_ms, the part that divides by t (its GEMMs)
    tp_split_backward_ms: float = 0.0  # of backward_ms, the part that divides by t
    tp_split_param_bytes: int = 0  # of param_bytes, the weights split t ways
    tp_split_saved_bytes: int = 0  # of saved_bytes, the activations split t ways
    tp_allreduce_bytes: int = 0  # bytes of one all-reduce among the t ranks (the layer's activation)
    tp_forward_allreduces: int = 0  # all-reduces per forward (Megatron block: 2; vocab embedding: 1)
    tp_backward_allreduces: int = 0  # per backward (block: 2; vocab head: 1; + the forward's under recompute)
    parameters: tuple[str, ...] = ()  # qualified names of the parameters the layer uses (sorted)
    # -1: timed itself; else the index of the identical layer (same class, parameter and
    # input shapes and dtypes) whose times it reuses (its bytes are always its own)
    reused_from: int = -1
    # bytes of the layer's largest parameter (0: not recorded, as in profiles before it was;
    # read ``largest_tensor_bytes``): the planner's gradient-temporary charge
    largest_param_bytes: int = 0
    # activation recomputation (``pipeplan.planner.recompute``): bytes the layer keeps for
    # backward when it runs under ``torch.utils.checkpoint`` (its input tensors, the
    # checkpoint's boundary); -1: not recorded (older and imported profiles), then derived
    # from its producers' ``output_bytes`` (``planner.recompute.kept_bytes``). Recomputing
    # costs the layer's forward again in backward (``forward_ms``).
    recompute_kept_bytes: int = -1
    # selective recomputation (Korthikanti et al. 2022; ``pipeplan.planner.recompute``): bytes
    # the layer saves for backward when only its attention core (scores, softmax, dropout on
    # the scores, scores x V) is recomputed, and that core's forward ms (what recomputing it
    # adds to the backward); -1: the layer has no attention core, or it was not recorded.
    # The freed bytes (saved - selective_saved) belong to ``tp_split_saved_bytes`` and the
    # core's ms to ``tp_split_forward_ms``: both split by heads.
    selective_saved_bytes: int = -1
    selective_recompute_ms: float = -1.0
    # the most bytes the layer's backward holds beyond what its forward saved: the gradients of
    # its outputs handed in, plus what its backward allocates and still holds at its peak
    # (activation gradients, temporaries such as softmax's), less the parameter gradients it
    # leaves (the planner charges those as gradients); measured as live tensor bytes, one
    # minibatch. A stage holds one layer's at a time, beside its saved activations
    # (``planner.memory``). -1: not measured (older, imported and estimated profiles): the
    # planner charges none and says so.
    backward_working_bytes: int = -1
    # what a zero-bubble schedule's input pass ("I") leaves for its weight pass ("W"), beside
    # the saved activations the retained graph keeps: the gradients recorded at the layer's
    # boundary nodes (``pipeplan.split_backward``), one minibatch; 0 where no input of the
    # layer needs a gradient. -1: not measured (older, imported and estimated profiles): the
    # planner charges none.
    deferred_weight_bytes: int = -1
    # the layers whose forward saved this layer's output for backward (its own index where it
    # saves its output itself), ascending: its bytes count in the first one's ``saved_bytes``.
    # A pipeline stage also holds, until their backward, the values it received and the
    # outputs it sent (``planner.costs.stage_boundary_bytes``) where no layer of its own
    # counted them. None: not measured (older, imported, estimated and layer-by-layer
    # profiles): the planner charges no such bytes.
    output_saved_by: tuple[int, ...] | None = None
    # tensors in the layer's output (several travel to another stage packed in one copy on
    # gloo, ``runtime/comm.py``); -1: not measured
    output_tensors: int = -1
    # of backward_ms, the input gradient's part ("B" of a zero-bubble schedule; the rest,
    # the weight gradient, is "W"): measured as a backward to the layer's inputs alone
    # (``torch.autograd.grad``), or derived from FLOPs in a what-if profile; None: not
    # measured (profiles before it was), read ``input_grad_ms``: assumed half
    backward_input_ms: float | None = None

    @property
    def input_grad_ms(self) -> float:
        """The input gradient's ms: ``backward_input_ms``, or half the backward where not measured."""
        if self.backward_input_ms is None:
            return self.backward_ms * ASSUMED_INPUT_GRAD_SHARE
        return self.backward_input_ms

    # forward / backward ms at each of ``Profile.timed_batch_sizes`` (medians, aligned with it;
    # () when not measured: the planner then takes time proportional to the batch)
    forward_ms_at: tuple[float, ...] = ()
    backward_ms_at: tuple[float, ...] = ()

    @property
    def largest_tensor_bytes(self) -> int:
        """The largest parameter's bytes; the layer's whole parameter bytes where not recorded."""
        return self.largest_param_bytes or self.param_bytes

    @property
    def charged_working_bytes(self) -> int:
        """The backward working bytes the planner charges: ``backward_working_bytes``, 0 where
        not measured (-1)."""
        return max(0, self.backward_working_bytes)

    @property
    def charged_deferred_bytes(self) -> int:
        """The bytes from "I" to "W" the planner charges: ``deferred_weight_bytes``, 0 where not
        measured (-1)."""
        return max(0, self.deferred_weight_bytes)

    @property
    def splits(self) -> bool:
        """Whether the layer can be split across tensor-parallel ranks."""
        return self.tp_units > 0

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms


@dataclass(frozen=True)
class Profile:
    model: str  # the model file (or the PipeDream graph) it was measured from
    fingerprint: str  # hash of the layer structure; a plan refuses another model
    device: DeviceInfo
    batch_size: int
    dtype: str  # "float32" | "bfloat16"
    layers: tuple[LayerProfile, ...]
    step_ms: float = 0.0  # measured whole-model forward+backward (0 when not measured)
    step_ms_spread: float = 0.0
    input_bytes: int = 0  # bytes of one minibatch's model inputs
    warmup: int = 0
    repeats: int = 0
    source: str = "pipeplan"  # "pipeplan" | "pipedream" (imported graph.txt)
    # distinct storages autograd saves in one whole-model forward (the loss excluded, as
    # from every layer), parameters excluded (0 when not measured); a layer's saved_bytes
    # counts only storages no earlier layer saved, so the layers sum to this figure
    step_saved_bytes: int = 0
    loss_ms: float = 0.0  # loss forward+backward on the model output: in step_ms, in no layer
    # the loss's own memory, one minibatch, charged to the last layer as its time is: what
    # autograd saves in the loss's forward (a cross-entropy's log-probabilities: the logits'
    # size) and the most its backward holds at once (the logits' gradient); -1: not measured
    loss_saved_bytes: int = -1
    loss_working_bytes: int = -1
    # one optimizer step over all parameters, by optimizer ("sgd", "momentum", "adam"), ms;
    # not in step_ms; empty when not measured (an imported PipeDream graph)
    optimizer_ms: dict[str, float] = field(default_factory=dict)
    data_ms: float = 0.0  # drawing one minibatch (sample_batch) and placing it on the device
    # how the layer graph was captured: "sequential" | "fx" | "export" ("" when not recorded)
    capture: str = ""
    leaf_modules: tuple[str, ...] = ()  # module classes kept whole (--leaf-modules / LEAF_MODULES)
    # module classes run as themselves, never traced into (--opaque-modules / OPAQUE_MODULES,
    # or chosen where torch.export failed inside them)
    opaque_modules: tuple[str, ...] = ()
    # output fields the export capture set to None (values that are not tensors, e.g. a cache)
    dropped_outputs: tuple[str, ...] = ()
    # split compute at tensor-parallel degree t takes tp_split_*_ms / (t * this): how the
    # GEMMs' rate holds when they shrink t ways (1.0: they keep it; how it was obtained is
    # said in ``estimated`` for a what-if profile)
    tp_efficiency: float = 1.0
    # "" for a measured profile; else how its figures were estimated (a what-if profile for
    # hardware not at hand: the device's datasheet rates and the model's architecture)
    estimated: str = ""
    # the model's module tree in named_modules() order (module docstring); () when not recorded
    modules: tuple[ModuleRecord, ...] = ()
    # "eager": the whole model was built and measured at once; "meta": it was built on the
    # meta device and each layer materialised alone ("" in files from before)
    build: str = ""
    # why step_ms is 0 when the model was not measured whole ("" when it was, or in old files)
    step_not_measured: str = ""
    # bytes of parameters the optimizer steps were timed on; optimizer_ms scales that time
    # linearly to all parameters (0: timed on all of them)
    optimizer_sample_bytes: int = 0
    # mixed precision (``pipeplan.precision``): the dtype of the master weights that training
    # in ``dtype`` keeps ("float32" for a measured bf16 profile): the optimizer steps were timed
    # on them (plus the copy back into ``dtype``) and the planner charges them; None: every
    # tensor in ``dtype`` (float32 profiles; estimated and older bf16 profiles)
    master_dtype: str | None = None
    # torch.distributed.pipelining's own split (``pipeline()`` traced once, cut before every
    # layer that is a module called once; pipeplan.capture.torch_split): entry a is the last
    # layer of the furthest piece that reads a value computed before layer a (entry 0: a
    # model input), -1 when none or when a is no such cut; () when not recorded. A stage
    # [a, b) runs under torch only when entry a < b.
    pipelining_reach: tuple[int, ...] = ()
    # entry a: why torch's own split cannot cut before layer a as the layer order does ("" where
    # it can, or where a is no such cut); () when not recorded
    pipelining_blocked: tuple[str, ...] = ()
    # micro-batch sizes (samples, ascending, the last = batch_size) at which every layer's
    # forward_ms_at / backward_ms_at were measured; () when not measured (older files,
    # meta-built and imported profiles): time is then taken as proportional to the batch
    timed_batch_sizes: tuple[int, ...] = ()
    # bytes of each parameter that more than one layer uses (``LayerProfile.parameters``: a
    # tied embedding and head); a plan that puts its users in different stages all-reduces
    # its gradient between them every step (planner.ties). {}: none, or not recorded (older
    # files: the planner then takes the smallest of its users' param_bytes)
    shared_parameter_bytes: dict[str, int] = field(default_factory=dict)
    schema: str = field(default=PROFILE_SCHEMA)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def sum_layers_ms(self) -> float:
        return sum(layer.compute_ms for layer in self.layers)

    @property
    def layers_vs_step_ratio(self) -> float:
        """Sum of per-layer forward+backward over the measured whole step (nan if unmeasured)."""
        return self.sum_layers_ms / self.step_ms if self.step_ms > 0 else math.nan

    @property
    def input_grad_measured(self) -> bool:
        """Whether every layer with a backward has its input-gradient part (``backward_input_ms``);
        where not, the simulator assumes half of that layer's backward (``ASSUMED_INPUT_GRAD_SHARE``)."""
        return all(layer.backward_input_ms is not None for layer in self.layers if layer.backward_ms > 0)

    @functools.cached_property
    def charged_saved_bytes(self) -> tuple[int, ...]:
        """Per layer, the saved bytes the planner charges: ``saved_bytes``, and the loss's on
        the last layer (where measured), as ``loss_ms`` is charged there."""
        saved = [layer.saved_bytes for layer in self.layers]
        if saved:
            saved[-1] += max(0, self.loss_saved_bytes)
        return tuple(saved)

    @functools.cached_property
    def charged_working_bytes(self) -> tuple[int, ...]:
        """Per layer, the backward working bytes the planner charges
        (``LayerProfile.charged_working_bytes``); the last layer's at least the loss's."""
        working = [layer.charged_working_bytes for layer in self.layers]
        if working:
            working[-1] = max(working[-1], self.loss_working_bytes)
        return tuple(working)

    @property
    def is_chain(self) -> bool:
        return all(layer.inputs in ((), (layer.index - 1,)) for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out = {"schema": out.pop("schema"), **out}
        return out

    @classmethod
    def from_dict(cls, obj: dict[str, Any], where: str = "profile") -> Profile:
        check_fields(cls, obj, where, nested=("device", "layers", "modules"))
        check_fields(DeviceInfo, obj["device"], f"{where}: device")
        for name, kind in (("layers", LayerProfile), ("modules", ModuleRecord)):
            if not isinstance(obj.get(name, ()), (list, tuple)):
                raise InputError(f"{where}: field {name!r} must be a list of objects")
            for position, item in enumerate(obj.get(name, ())):
                check_fields(kind, item, f"{where}: {name}[{position}]")
        try:
            layers = tuple(
                LayerProfile(
                    **{
                        **layer,
                        "inputs": tuple(layer["inputs"]),
                        "model_inputs": tuple(layer.get("model_inputs", ())),
                        "parameters": tuple(layer.get("parameters", ())),
                        "forward_ms_at": tuple(layer.get("forward_ms_at", ())),
                        "backward_ms_at": tuple(layer.get("backward_ms_at", ())),
                        "output_saved_by": _tuple_or_none(layer.get("output_saved_by")),
                    }
                )
                for layer in obj["layers"]
            )
            fields = {k: v for k, v in obj.items() if k not in ("layers", "device", "schema", "modules")}
            fields["modules"] = tuple(ModuleRecord(**module) for module in obj.get("modules", ()))
            for name in (
                "leaf_modules",
                "dropped_outputs",
                "opaque_modules",
                "pipelining_reach",
                "pipelining_blocked",
                "timed_batch_sizes",
            ):
                if name in fields:
                    fields[name] = tuple(fields[name])
            return cls(device=DeviceInfo(**obj["device"]), layers=layers, **fields)
        except KeyError as exc:
            raise InputError(f"{where}: missing key {exc.args[0]!r}") from exc
        except TypeError as exc:
            raise InputError(f"{where}: {exc}") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        return cls.from_dict(read_json(path, PROFILE_SCHEMA, OLDER_PROFILE_SCHEMAS), where=str(path))


def validate(profile: Profile) -> None:
    """Raise ``InputError`` naming the first inconsistent value."""
    if profile.schema != PROFILE_SCHEMA:
        raise InputError(f"profile schema is {profile.schema!r}, expected {PROFILE_SCHEMA!r}")
    if profile.batch_size <= 0:
        raise InputError(f"profile batch_size must be positive (got {profile.batch_size})")
    if not profile.layers:
        raise InputError("profile has no layers")
    if profile.master_dtype not in (None, "float32"):
        raise InputError(f"profile master_dtype must be null or 'float32' (got {profile.master_dtype!r})")
    for position, layer in enumerate(profile.layers):
        if layer.index != position:
            raise InputError(f"profile layer at position {position} has index {layer.index}")
        for producer in layer.inputs:
            if not 0 <= producer < layer.index:
                raise InputError(
                    f"profile layer {layer.index} ({layer.name}) has input {producer}, "
                    f"which is not an earlier layer"
                )
        for name in ("forward_ms", "backward_ms", "forward_ms_spread", "backward_ms_spread"):
            _check_amount(getattr(layer, name), MAX_MS, f"profile layer {layer.index} ({layer.name}): {name}")
        for name in ("output_bytes", "param_bytes", "saved_bytes"):
            _check_amount(
                getattr(layer, name),
                MAX_BYTES,
                f"profile layer {layer.index} ({layer.name}): {name}",
                integer=True,
            )
        for name in ("tp_split_forward_ms", "tp_split_backward_ms"):
            _check_amount(
                getattr(layer, name),
                getattr(layer, name[len("tp_split_") :]),
                f"profile layer {layer.index} ({layer.name}): {name}",
            )
        if layer.backward_input_ms is not None:
            _check_amount(
                layer.backward_input_ms,
                layer.backward_ms,
                f"profile layer {layer.index} ({layer.name}): backward_input_ms",
            )
        _check_amount(
            layer.largest_param_bytes,
            layer.param_bytes,
            f"profile layer {layer.index} ({layer.name}): largest_param_bytes",
            integer=True,
        )
        for name in ("tp_split_param_bytes", "tp_split_saved_bytes"):
            _check_amount(
                getattr(layer, name),
                getattr(layer, name[len("tp_split_") :]),
                f"profile layer {layer.index} ({layer.name}): {name}",
                integer=True,
            )
        for name in ("tp_units", "tp_allreduce_bytes", "tp_forward_allreduces", "tp_backward_allreduces"):
            _check_amount(
                getattr(layer, name),
                MAX_BYTES,
                f"profile layer {layer.index} ({layer.name}): {name}",
                integer=True,
            )
        if not all(isinstance(name, str) and name for name in layer.parameters):
            raise InputError(
                f"profile layer {layer.index} ({layer.name}): parameters must be non-empty names"
            )
        where = f"profile layer {layer.index} ({layer.name})"
        _check_optional_bytes(layer.recompute_kept_bytes, f"{where}: recompute_kept_bytes")
        _check_selective(layer)
        _check_optional_bytes(layer.backward_working_bytes, f"{where}: backward_working_bytes")
        _check_optional_bytes(layer.deferred_weight_bytes, f"{where}: deferred_weight_bytes")
        if not (isinstance(layer.output_tensors, int) and layer.output_tensors >= -1):
            raise InputError(f"{where}: output_tensors = {layer.output_tensors!r} must be -1 or a count")
        savers = layer.output_saved_by
        if savers is not None and not (
            isinstance(savers, tuple)
            and all(isinstance(q, int) and layer.index <= q < len(profile.layers) for q in savers)
        ):
            raise InputError(
                f"{where}: output_saved_by = {savers!r} must be a list of layers from "
                f"{layer.index} to {len(profile.layers) - 1}"
            )
        if not (isinstance(layer.reused_from, int) and -1 <= layer.reused_from < layer.index):
            raise InputError(
                f"profile layer {layer.index} ({layer.name}): reused_from = {layer.reused_from!r} "
                f"is not -1 or an earlier layer"
            )
        for position in layer.model_inputs:
            if not (isinstance(position, int) and position >= 0):
                raise InputError(
                    f"profile layer {layer.index} ({layer.name}): model_inputs holds {position!r}"
                )
    for name in ("step_ms", "step_ms_spread", "loss_ms", "data_ms"):
        _check_amount(getattr(profile, name), MAX_MS, f"profile {name}")
    for name in ("input_bytes", "step_saved_bytes", "warmup", "repeats", "optimizer_sample_bytes"):
        _check_amount(getattr(profile, name), MAX_BYTES, f"profile {name}", integer=True)
    for name in ("loss_saved_bytes", "loss_working_bytes"):
        _check_optional_bytes(getattr(profile, name), f"profile {name}")
    if profile.build not in ("", "eager", "meta"):
        raise InputError(f"profile build = {profile.build!r} is not one of eager, meta")
    if not (isinstance(profile.tp_efficiency, (int, float)) and 0 < profile.tp_efficiency <= 1):
        raise InputError(f"profile tp_efficiency = {profile.tp_efficiency!r} is outside (0, 1]")
    for optimizer, value in profile.optimizer_ms.items():
        _check_amount(value, MAX_MS, f"profile optimizer_ms[{optimizer!r}]")
    if not isinstance(profile.shared_parameter_bytes, dict):
        raise InputError("profile shared_parameter_bytes must be an object of parameter names to bytes")
    for name, value in profile.shared_parameter_bytes.items():
        if not isinstance(name, str) or not name:
            raise InputError(
                f"profile shared_parameter_bytes has a key {name!r} that is not a parameter name"
            )
        _check_amount(value, MAX_BYTES, f"profile shared_parameter_bytes[{name!r}]", integer=True)
    _validate_modules(profile.modules)
    reach, n = profile.pipelining_reach, len(profile.layers)
    if reach and (len(reach) != n or not all(isinstance(r, int) and -1 <= r < n for r in reach)):
        raise InputError(
            f"profile pipelining_reach must hold {n} layer indices (-1 .. {n - 1}), one per layer"
        )
    _validate_batch_sizes(profile)
    blocked = profile.pipelining_blocked
    if blocked and (len(blocked) != n or not all(isinstance(why, str) for why in blocked) or blocked[0]):
        raise InputError(f"profile pipelining_blocked must hold {n} strings, one per layer (the first empty)")


def _check_selective(layer: LayerProfile) -> None:
    """One line unless the selective fields are -1 or a byte count within ``saved_bytes`` and ms."""
    where = f"profile layer {layer.index} ({layer.name})"
    saved = layer.selective_saved_bytes
    if not (isinstance(saved, int) and not isinstance(saved, bool) and -1 <= saved <= layer.saved_bytes):
        raise InputError(
            f"{where}: selective_saved_bytes = {saved!r} is not -1 or a byte count <= saved_bytes "
            f"{layer.saved_bytes}"
        )
    ms = layer.selective_recompute_ms
    if not (isinstance(ms, (int, float)) and not isinstance(ms, bool) and (ms == -1 or 0 <= ms <= MAX_MS)):
        raise InputError(f"{where}: selective_recompute_ms = {ms!r} is not -1 or a time in ms")
    if (saved == -1) != (ms == -1):
        raise InputError(
            f"{where}: selective_saved_bytes = {saved} and selective_recompute_ms = {ms} must both be -1 "
            f"(no attention core) or both be known"
        )


def _validate_batch_sizes(profile: Profile) -> None:
    """``timed_batch_sizes`` ascending, positive, ending at ``batch_size``; every layer's times aligned."""
    sizes = profile.timed_batch_sizes
    if not sizes:
        for layer in profile.layers:
            if layer.forward_ms_at or layer.backward_ms_at:
                raise InputError(
                    f"profile layer {layer.index} ({layer.name}): forward_ms_at / backward_ms_at "
                    f"given but timed_batch_sizes is empty"
                )
        return
    ascending = all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes) and all(
        a < b for a, b in zip(sizes, sizes[1:])
    )
    if not ascending or sizes[-1] != profile.batch_size:
        raise InputError(
            f"profile timed_batch_sizes = {list(sizes)} must be positive, ascending and end at "
            f"batch_size {profile.batch_size}"
        )
    for layer in profile.layers:
        for name in ("forward_ms_at", "backward_ms_at"):
            values = getattr(layer, name)
            where = f"profile layer {layer.index} ({layer.name}): {name}"
            if len(values) != len(sizes):
                raise InputError(f"{where} holds {len(values)} times for {len(sizes)} timed_batch_sizes")
            for value in values:
                _check_amount(value, MAX_MS, where)


def _validate_modules(modules: tuple[ModuleRecord, ...]) -> None:
    """Names unique, the root first, calls a count."""
    if modules and modules[0].name != "":
        raise InputError(f"profile modules[0] is {modules[0].name!r}, expected the root module ''")
    seen: set[str] = set()
    for position, module in enumerate(modules):
        if not isinstance(module.name, str) or module.name in seen:
            raise InputError(f"profile modules[{position}]: name {module.name!r} is repeated or not a string")
        seen.add(module.name)
        _check_amount(module.calls, MAX_BYTES, f"profile module {module.name!r}: calls", integer=True)
        if not isinstance(module.container, bool):
            raise InputError(f"profile module {module.name!r}: container must be true or false")


def _tuple_or_none(value: object) -> object:
    """A JSON list as a tuple; anything else (None, a wrong type for validation to name) as is."""
    return tuple(value) if isinstance(value, list) else value


def _check_optional_bytes(value: object, what: str) -> None:
    """``InputError`` unless ``value`` is a byte count or -1 (not measured)."""
    if not (isinstance(value, int) and not isinstance(value, bool) and -1 <= value <= MAX_BYTES):
        raise InputError(f"{what} = {value!r} is not -1 or a byte count")


def _check_amount(value: object, bound: float, what: str, integer: bool = False) -> None:
    """``InputError`` unless ``value`` is a finite number in [0, bound] (an int if ``integer``)."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise InputError(f"{what} must be {'an integer' if integer else 'a number'}, got {value!r}")
    inside = 0 <= value <= bound if isinstance(value, int) else math.isfinite(value) and 0 <= value <= bound
    if not inside:
        raise InputError(f"{what} = {value!r} is outside [0, {bound:g}]")
