"""The profile.json contract: round trip, validation, schema, and the optional fields."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from pipeplan.errors import InputError
from pipeplan.profile import PROFILE_SCHEMA, DeviceInfo, LayerProfile, Profile


def make_profile(**overrides) -> Profile:
    layers = (
        LayerProfile(
            0,
            "embed",
            "Embedding",
            (),
            0.5,
            1.0,
            4096,
            1024,
            64,
            forward_ms_spread=0.01,
            backward_ms_spread=0.02,
            model_inputs=(0,),
        ),
        LayerProfile(1, "fc", "Linear", (0,), 1.5, 3.0, 512, 2048, 4096),
        LayerProfile(2, "head", "Linear", (0, 1), 0.25, 0.5, 40, 1024, 512),
    )
    fields = {
        "model": "model.py",
        "fingerprint": "sha256:abc",
        "device": DeviceInfo("cpu", "Test CPU"),
        "batch_size": 32,
        "dtype": "float32",
        "layers": layers,
        "step_ms": 7.5,
        "step_ms_spread": 0.1,
        "input_bytes": 256,
        "warmup": 3,
        "repeats": 10,
        "step_saved_bytes": 4000,
        "loss_ms": 0.2,
    }
    fields.update(overrides)
    return Profile(**fields)


def test_round_trip_through_json_file(tmp_path: Path) -> None:
    profile = make_profile()
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    raw = json.loads(path.read_text())
    assert next(iter(raw)) == "schema" and raw["schema"] == PROFILE_SCHEMA
    assert raw["device"] == {"type": "cpu", "name": "Test CPU"}
    assert raw["layers"][2]["inputs"] == [0, 1] and raw["layers"][0]["model_inputs"] == [0]
    assert list(tmp_path.iterdir()) == [path]  # the atomic write leaves no temp file


def test_derived_figures() -> None:
    profile = make_profile()
    assert profile.sum_layers_ms == pytest.approx(0.5 + 1.0 + 1.5 + 3.0 + 0.25 + 0.5)
    assert profile.layers_vs_step_ratio == pytest.approx(6.75 / 7.5)
    assert not profile.is_chain  # layer 2 reads layer 0
    assert math.isnan(make_profile(step_ms=0.0).layers_vs_step_ratio)


def test_older_files_without_optional_fields_still_load(tmp_path: Path) -> None:
    raw = make_profile().to_dict()
    for key in ("step_saved_bytes", "loss_ms", "step_ms_spread", "input_bytes"):
        raw.pop(key)
    for layer in raw["layers"]:
        layer.pop("model_inputs")
        layer.pop("forward_ms_spread")
    profile = Profile.from_dict(raw)
    assert profile.loss_ms == 0.0 and profile.step_saved_bytes == 0 and profile.layers[0].model_inputs == ()
    # no largest parameter recorded: the planner charges the layer's whole parameter bytes
    assert profile.layers[1].largest_param_bytes == 0 and profile.layers[1].largest_tensor_bytes == 2048
    recorded = replace(make_profile().layers[1], largest_param_bytes=1536)
    assert recorded.largest_tensor_bytes == 1536


def test_backward_working_bytes_round_trip_and_default_to_not_measured(tmp_path: Path) -> None:
    base = make_profile()
    layers = tuple(
        replace(layer, backward_working_bytes=1000 * (k + 1)) for k, layer in enumerate(base.layers)
    )
    profile = replace(base, layers=layers)
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    assert [layer["backward_working_bytes"] for layer in json.loads(path.read_text())["layers"]] == [
        1000,
        2000,
        3000,
    ]
    old = profile.to_dict()  # written before the field existed
    for layer in old["layers"]:
        del layer["backward_working_bytes"]
    assert [layer.backward_working_bytes for layer in Profile.from_dict(old).layers] == [-1, -1, -1]


def test_what_a_stage_holds_at_its_boundaries_round_trips_and_defaults_to_not_measured(
    tmp_path: Path,
) -> None:
    base = make_profile()
    recorded = ((1, 2), (), (2,))  # who saved each layer's output
    layers = tuple(
        replace(layer, output_saved_by=savers, output_tensors=1 + k, deferred_weight_bytes=64 * k)
        for k, (layer, savers) in enumerate(zip(base.layers, recorded))
    )
    profile = replace(base, layers=layers)
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    assert [layer["output_saved_by"] for layer in json.loads(path.read_text())["layers"]] == [[1, 2], [], [2]]
    old = profile.to_dict()  # written before the fields existed
    for layer in old["layers"]:
        del layer["output_saved_by"], layer["output_tensors"], layer["deferred_weight_bytes"]
    loaded = Profile.from_dict(old).layers
    assert [(x.output_saved_by, x.output_tensors, x.deferred_weight_bytes) for x in loaded] == [
        (None, -1, -1)
    ] * 3


def test_the_loss_memory_round_trips_and_defaults_to_not_measured(tmp_path: Path) -> None:
    profile = replace(make_profile(), loss_saved_bytes=5000, loss_working_bytes=9000)
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    assert profile.charged_saved_bytes[-1] == profile.layers[-1].saved_bytes + 5000
    assert profile.charged_working_bytes[-1] == 9000  # above the last layer's -1 (not measured)
    old = profile.to_dict()  # written before the fields existed: nothing of the loss charged
    del old["loss_saved_bytes"], old["loss_working_bytes"]
    loaded = Profile.from_dict(old)
    assert (loaded.loss_saved_bytes, loaded.loss_working_bytes) == (-1, -1)
    assert loaded.charged_saved_bytes == tuple(layer.saved_bytes for layer in loaded.layers)
    assert loaded.charged_working_bytes[-1] == 0


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda raw: raw["layers"][0].update(backward_working_bytes=-2),
            "backward_working_bytes = -2 is not -1 or a byte count",
        ),
        (
            lambda raw: raw.update(loss_saved_bytes=-2),
            "profile loss_saved_bytes = -2 is not -1 or a byte count",
        ),
        (
            lambda raw: raw.update(loss_working_bytes=1.5),
            "field 'loss_working_bytes' must be an integer, got 1.5",
        ),
        (
            lambda raw: raw["layers"][1].update(output_saved_by=[0]),
            "(fc): output_saved_by = (0,) must be a list of layers from 1 to 2",
        ),
        (
            lambda raw: raw["layers"][1].update(output_saved_by=3),
            "field 'output_saved_by' must be a list of an integer or null, got 3",
        ),
        (lambda raw: raw["layers"][0].update(output_tensors=-2), "output_tensors = -2 must be -1 or a count"),
        (
            lambda raw: raw["layers"][0].update(deferred_weight_bytes=-5),
            "deferred_weight_bytes = -5 is not -1 or a byte count",
        ),
        (lambda raw: raw.update(schema="pipeplan.profile/0"), "schema is 'pipeplan.profile/0'"),
        (lambda raw: raw.pop("fingerprint"), "missing field 'fingerprint'"),
        (lambda raw: raw["layers"][1].update(index=5), "layer at position 1 has index 5"),
        (lambda raw: raw["layers"][1].update(inputs=[1]), "has input 1, which is not an earlier layer"),
        (lambda raw: raw["layers"][0].update(saved_bytes=-1), "saved_bytes = -1"),
        (
            lambda raw: raw["layers"][1].update(largest_param_bytes=4096),
            "largest_param_bytes = 4096 is outside [0, 2048]",
        ),
        (lambda raw: raw["layers"][0].update(forward_ms=float("nan")), "NaN is not a JSON number"),
        (lambda raw: raw.update(batch_size=0), "batch_size must be positive (got 0)"),
        (lambda raw: raw.update(layers=[]), "profile has no layers"),
        (lambda raw: raw["layers"][0].update(colour="red"), "layers[0]: unknown field 'colour'"),
    ],
)
def test_invalid_profiles_are_input_errors(tmp_path: Path, change, message: str) -> None:
    raw = make_profile().to_dict()
    change(raw)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match=re.escape(message)):
        Profile.load(path)


def test_not_json_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="is not valid JSON"):
        Profile.load(bad)
    with pytest.raises(InputError, match="cannot read"):
        Profile.load(tmp_path / "missing.json")


def test_replace_keeps_validation() -> None:
    with pytest.raises(InputError, match="param_bytes"):
        replace(make_profile(), layers=(replace(make_profile().layers[0], param_bytes=-5),))
