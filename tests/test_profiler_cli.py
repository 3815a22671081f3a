"""``pipeplan profile``: the table, the ratio line, profile.json, and one-line errors (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeplan.cli import cli
from pipeplan.profile import PROFILE_SCHEMA, Profile

FIXTURES = Path(__file__).parent / "fixtures" / "models"
REPO = Path(__file__).resolve().parents[1]


def invoke(*args: str):
    return CliRunner().invoke(cli, ["profile", *args], catch_exceptions=False)


def test_profile_bundled_mlp_writes_json_and_prints_table_and_ratio(tmp_path: Path) -> None:
    out = tmp_path / "nested" / "profile.json"
    result = invoke(
        "mlp",
        "-o",
        str(out),
        "--device",
        "cpu",
        "--batch-size",
        "8",
        "--warmup",
        "1",
        "--repeats",
        "3",
        "--threads",
        "1",
    )
    assert result.exit_code == 0, result.output
    profile = Profile.load(out)
    assert profile.schema == PROFILE_SCHEMA and profile.batch_size == 8 and profile.repeats == 3
    assert [layer.type for layer in profile.layers] == ["Linear", "ReLU"] * 4 + ["Linear"]
    assert profile.layers[0].output_bytes == 8 * 1024 * 4
    assert "fwd ms" in result.stdout and "32.00 KiB" in result.stdout  # (8, 1024) float32 output
    assert "4.00 MiB" in result.stdout  # a 1024x1024 float32 weight + bias rounds to 4.00 MiB
    assert f"ratio: {profile.layers_vs_step_ratio:.3f}" in result.stdout
    assert f"measured step: {profile.step_ms:.3f}" in result.stdout
    assert f"wrote {out}" in result.stdout


def test_help_has_examples() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    assert "pipeplan profile model.py -o profile.json" in result.stdout
    for flag in ("--batch-size", "--device", "--dtype", "--warmup", "--repeats", "-o"):
        assert flag in result.stdout


@pytest.mark.parametrize(
    "model, message",
    [
        ("missing_build.py", "defines no build_model()"),
        ("syntax_error.py", "syntax_error.py:5: cannot import: SyntaxError"),
        ("import_error.py", "import_error.py:4: cannot import: ValueError"),
        ("raising_model.py", "the model raised on sample_batch(4): RuntimeError: mat1 and mat2 shapes"),
        ("not_a_module.py", "build_model() returned str, expected a torch.nn.Module"),
        ("raising_batch.py", "sample_batch(4) raised ValueError: no data for batch size 4"),
        ("bad_loss.py", "loss_fn returned (4, 2), expected a scalar Tensor"),
        ("does_not_exist.py", "does not exist"),
    ],
)
def test_bad_model_files_exit_2_with_one_line(model: str, message: str, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    result = invoke(str(FIXTURES / model), "-o", str(out), "--device", "cpu", "--batch-size", "4")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert not out.exists()


def test_bad_flag_values_exit_2(tmp_path: Path) -> None:
    result = invoke("mlp", "--device", "cpu", "--batch-size", "0", "-o", str(tmp_path / "p.json"))
    assert result.exit_code == 2 and result.stderr == "error: --batch-size must be positive (got 0)\n"
    result = invoke("mlp", "--dtype", "float64")
    assert result.exit_code == 2 and "float64" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_device_cuda_without_cuda_is_one_line() -> None:
    result = invoke("mlp", "--device", "cuda")
    assert result.exit_code == 2
    assert result.stderr == "error: --device cuda requested, but CUDA is not available on this machine\n"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "model, message",
    [
        ("missing_build.py", "defines no build_model()"),
        ("syntax_error.py", "cannot import: SyntaxError"),
        ("raising_model.py", "the model raised on sample_batch(2)"),
        ("nonexistent.py", "does not exist"),
    ],
)
def test_subprocess_exit_2_and_one_stderr_line(model: str, message: str, tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeplan",
            "profile",
            str(FIXTURES / model),
            "--device",
            "cpu",
            "--batch-size",
            "2",
            "-o",
            str(tmp_path / "profile.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert completed.returncode == 2, completed.stderr
    lines = completed.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], completed.stderr
    assert "Traceback" not in completed.stderr and completed.stdout == ""


@pytest.mark.multiprocess
def test_capture_failure_is_one_line_and_leaf_modules_gets_around_it(tmp_path: Path) -> None:
    model = str(FIXTURES / "gated_top.py")  # a branch on a tensor's value in the model's own forward
    out = tmp_path / "profile.json"
    result = subprocess.run(
        [sys.executable, "-m", "pipeplan", "profile", model, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no traceback, no partial graph dump
    assert lines[0].startswith("error: torch.export cannot capture GatedTop at ")
    assert f"{model}:16 (GuardOnDataDependentSymNode" in lines[0] and "change the code there" in lines[0]
    assert not out.exists()
    model = str(FIXTURES / "gated.py")  # the branch inside Gate: fx keeps Gate whole as a leaf
    result = invoke(model, "-o", str(out), "--leaf-modules", "Gate", "--warmup", "0", "--repeats", "1")
    assert result.exit_code == 0, result.output
    assert "capture: fx, 2 layers, leaf modules: Gate" in result.stdout
    assert Profile.load(out).leaf_modules == ("Gate",)


@pytest.mark.multiprocess
@pytest.mark.parametrize("hash_seed", [None, "random"])
def test_commands_run_under_one_hash_seed_so_set_ordered_models_capture_one_graph(
    tmp_path: Path, hash_seed: str | None
) -> None:
    """A forward that iterates a set of strings (ModernBERT's and Gemma 3's rotary tables) is captured
    in the set's order, which follows the process's string hashes: pipeplan re-runs itself under
    PYTHONHASHSEED=0, so a profile, the plan's fingerprint and every rank see one layer order."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    env["SET_ORDER_SEEN"] = str(tmp_path / "seen")
    out = tmp_path / "profile.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeplan",
            "profile",
            str(FIXTURES / "set_order.py"),
            "--device",
            "cpu",
            "-b",
            "2",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "seen").read_text() == "0"
    assert [layer.name for layer in Profile.load(out).layers] == [
        "alpha",
        "beta",
        "head",
    ]  # {"alpha", "beta"} at seed 0
    pinned = {**env, "PYTHONHASHSEED": "1"}  # a user's own seed is kept: at 1 the set iterates the other way
    assert (
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeplan",
                "profile",
                str(FIXTURES / "set_order.py"),
                "--device",
                "cpu",
                "-b",
                "2",
                "--warmup",
                "0",
                "--repeats",
                "1",
                "-o",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=pinned,
        ).returncode
        == 0
    )
    assert (tmp_path / "seen").read_text() == "1"
    assert [layer.name for layer in Profile.load(out).layers] == ["beta", "alpha", "head"]
