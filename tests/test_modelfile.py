"""The model file loader: required names, one-line errors, seeded batches, the default loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeplan.errors import InputError
from pipeplan.modelfile import bundled_model_path, default_loss, load_model_file, parse_leaf_modules

FIXTURES = Path(__file__).parent / "fixtures" / "models"


def write(tmp_path: Path, text: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "fixture, message",
    [
        ("missing_build.py", "defines no build_model() (required by the model file contract)"),
        ("syntax_error.py", "syntax_error.py:5: cannot import: SyntaxError"),
        ("import_error.py", "import_error.py:4: cannot import: ValueError: invalid literal for int()"),
    ],
)
def test_load_errors_are_one_line(fixture: str, message: str) -> None:
    with pytest.raises(InputError) as info:
        load_model_file(FIXTURES / fixture)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_missing_file_and_not_callable(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        load_model_file(tmp_path / "nope.py")
    path = write(tmp_path, "build_model = 3\ndef sample_batch(n):\n    return 0, 0\n")
    with pytest.raises(InputError, match="build_model is int, expected a function"):
        load_model_file(path)


def test_build_and_batch_errors_are_one_line() -> None:
    with pytest.raises(InputError, match="build_model\\(\\) returned str, expected a torch.nn.Module"):
        load_model_file(FIXTURES / "not_a_module.py").build()
    with pytest.raises(InputError, match="sample_batch\\(3\\) raised ValueError: no data for batch size 3"):
        load_model_file(FIXTURES / "raising_batch.py").batch(3, seed=0)


def test_inputs_must_be_tensors(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n"
        "def sample_batch(n):\n    return (torch.zeros(n, 2), [1, 2]), torch.zeros(n)\n",
    )
    with pytest.raises(InputError, match="sample_batch input 1 is list, expected a Tensor"):
        load_model_file(path).batch(2, seed=0)


def test_batch_is_seeded_and_leaves_the_global_rng_alone() -> None:
    model_file = load_model_file(FIXTURES / "two_inputs.py")
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    (x, y), target = model_file.batch(4, seed=7)
    assert torch.equal(torch.rand(1), expected_next)  # the global RNG did not move
    (x2, y2), target2 = model_file.batch(4, seed=7)
    assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(target, target2)
    assert x.shape == (4, 16) and y.shape == (4, 8)


def test_optional_names(tmp_path: Path) -> None:
    model_file = load_model_file(FIXTURES / "bad_loss.py")
    assert model_file.loss_fn is not default_loss and model_file.data_loader is None
    assert load_model_file(FIXTURES / "residual.py").loss_fn is default_loss


def test_default_loss_cross_entropy_for_ids_mse_for_floats() -> None:
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    ids = torch.tensor([0, 1])
    assert torch.allclose(default_loss(logits, ids), torch.nn.functional.cross_entropy(logits, ids))
    sequence = torch.randn(2, 3, 5)
    tokens = torch.randint(0, 5, (2, 3))
    expected = torch.nn.functional.cross_entropy(sequence.reshape(6, 5), tokens.reshape(6))
    assert torch.allclose(default_loss(sequence, tokens), expected)
    assert torch.allclose(default_loss(torch.ones(3), torch.zeros(3)), torch.tensor(1.0))


def test_default_loss_takes_the_logits_of_structured_outputs_and_segmentation_shapes() -> None:
    from dataclasses import dataclass

    F = torch.nn.functional
    # (B, C, H, W) logits with (B, H, W) targets: cross-entropy per pixel, not flattened by C
    logits = torch.randn(2, 4, 3, 5)
    pixels = torch.randint(0, 4, (2, 3, 5))
    expected = F.cross_entropy(logits, pixels)
    assert torch.allclose(default_loss(logits, pixels), expected)
    assert torch.allclose(default_loss({"out": logits, "aux": torch.zeros(1)}, pixels), expected)

    @dataclass
    class Output:
        loss: None
        logits: torch.Tensor
        cache: object

    tokens = torch.randint(0, 7, (2, 3))
    sequence = torch.randn(2, 3, 7)
    lm = F.cross_entropy(sequence.reshape(6, 7), tokens.reshape(6))
    assert torch.allclose(default_loss(Output(None, sequence, object()), tokens), lm)  # .logits
    assert torch.allclose(default_loss((sequence, torch.zeros(1)), tokens), lm)  # first tensor
    with pytest.raises(InputError, match="no tensor in it; define loss_fn"):
        default_loss({"cache": object()}, tokens)


def test_leaf_modules_from_the_model_file(tmp_path: Path) -> None:
    source = (FIXTURES / "residual.py").read_text()
    good = tmp_path / "good.py"
    good.write_text(source + "\nLEAF_MODULES = ['Block', nn.Linear]\n")
    assert load_model_file(good).leaf_modules == ("Block", "Linear")
    assert load_model_file(FIXTURES / "residual.py").leaf_modules == ()
    bad = tmp_path / "bad.py"
    bad.write_text(source + "\nLEAF_MODULES = 'Block'\n")
    with pytest.raises(InputError, match="LEAF_MODULES is str, expected a list of module class names"):
        load_model_file(bad)
    assert parse_leaf_modules(" GPT2Block, LlamaDecoderLayer ,") == ("GPT2Block", "LlamaDecoderLayer")


def test_bundled_model_paths() -> None:
    for name in ("mlp", "vgg", "resnet", "gpt"):
        assert Path(bundled_model_path(name)).is_file()
    with pytest.raises(InputError, match="no bundled model named 'alexnet'"):
        bundled_model_path("alexnet")
