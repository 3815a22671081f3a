"""The profile contract: what ``pipeplan profile`` measured, layer by layer.

A ``Profile`` holds one ``LayerProfile`` per layer, indexed by ``LayerProfile.index``
(0..N-1, a topological order: every producer index is smaller than its consumer's).
Times are milliseconds for one minibatch of ``batch_size`` samples; sizes are bytes.
Stored as JSON with ``"schema": "pipeplan.profile/1"``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeplan.errors import InputError
from pipeplan.fields import check_fields
from pipeplan.jsonio import read_json, write_json_atomic

__all__ = ["PROFILE_SCHEMA", "DeviceInfo", "LayerProfile", "Profile", "MAX_MS", "MAX_BYTES"]

PROFILE_SCHEMA = "pipeplan.profile/1"
# Bounds that no real measurement reaches; beyond them sums lose meaning (1e308 ms)
MAX_MS = 1e9  # 11.6 days for one layer's forward on one minibatch
MAX_BYTES = 2**60  # 1 EiB


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cpu" | "cuda"
    name: str  # e.g. "NVIDIA H100 80GB HBM3" or the CPU model


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
    # one optimizer step over all parameters, by optimizer ("sgd", "momentum", "adam"), ms;
    # not in step_ms; empty when not measured (an imported PipeDream graph)
    optimizer_ms: dict[str, float] = field(default_factory=dict)
    data_ms: float = 0.0  # drawing one minibatch (sample_batch) and placing it on the device
    # how the layer graph was captured: "sequential" | "fx" | "export" ("" when not recorded)
    capture: str = ""
    leaf_modules: tuple[str, ...] = ()  # module classes kept whole (--leaf-modules / LEAF_MODULES)
    # output fields the export capture set to None (values that are not tensors, e.g. a cache)
    dropped_outputs: tuple[str, ...] = ()
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
    def is_chain(self) -> bool:
        return all(layer.inputs in ((), (layer.index - 1,)) for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out = {"schema": out.pop("schema"), **out}
        return out

    @classmethod
    def from_dict(cls, obj: dict[str, Any], where: str = "profile") -> "Profile":
        check_fields(cls, obj, where, nested=("device", "layers"))
        check_fields(DeviceInfo, obj["device"], f"{where}: device")
        if not isinstance(obj["layers"], (list, tuple)):
            raise InputError(f"{where}: field 'layers' must be a list of layer objects")
        for position, layer in enumerate(obj["layers"]):
            check_fields(LayerProfile, layer, f"{where}: layers[{position}]")
        try:
            layers = tuple(
                LayerProfile(
                    **{
                        **layer,
                        "inputs": tuple(layer["inputs"]),
                        "model_inputs": tuple(layer.get("model_inputs", ())),
                    }
                )
                for layer in obj["layers"]
            )
            fields = {k: v for k, v in obj.items() if k not in ("layers", "device", "schema")}
            for name in ("leaf_modules", "dropped_outputs"):
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
    def load(cls, path: str | os.PathLike[str]) -> "Profile":
        return cls.from_dict(read_json(path, PROFILE_SCHEMA), where=str(path))


def validate(profile: Profile) -> None:
    """Raise ``InputError`` naming the first inconsistent value."""
    if profile.schema != PROFILE_SCHEMA:
        raise InputError(f"profile schema is {profile.schema!r}, expected {PROFILE_SCHEMA!r}")
    if profile.batch_size <= 0:
        raise InputError(f"profile batch_size must be positive (got {profile.batch_size})")
    if not profile.layers:
        raise InputError("profile has no layers")
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
            _check_amount(getattr(layer, name), MAX_BYTES,
                          f"profile layer {layer.index} ({layer.name}): {name}", integer=True)
        for position in layer.model_inputs:
            if not (isinstance(position, int) and position >= 0):
                raise InputError(
                    f"profile layer {layer.index} ({layer.name}): model_inputs holds {position!r}"
                )
    for name in ("step_ms", "step_ms_spread", "loss_ms", "data_ms"):
        _check_amount(getattr(profile, name), MAX_MS, f"profile {name}")
    for name in ("input_bytes", "step_saved_bytes", "warmup", "repeats"):
        _check_amount(getattr(profile, name), MAX_BYTES, f"profile {name}", integer=True)
    for optimizer, value in profile.optimizer_ms.items():
        _check_amount(value, MAX_MS, f"profile optimizer_ms[{optimizer!r}]")


def _check_amount(value: object, bound: float, what: str, integer: bool = False) -> None:
    """``InputError`` unless ``value`` is a finite number in [0, bound] (an int if ``integer``)."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise InputError(f"{what} must be {'an integer' if integer else 'a number'}, got {value!r}")
    inside = 0 <= value <= bound if isinstance(value, int) else math.isfinite(value) and 0 <= value <= bound
    if not inside:
        raise InputError(f"{what} = {value!r} is outside [0, {bound:g}]")
