"""Per-stage atomic checkpoints: round trip, torn/missing files, fingerprints, retention."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
import torch

from pipeplan.errors import InputError
from pipeplan.runtime.checkpoint import (
    StageCheckpoint,
    checkpoint_path,
    complete_steps,
    latest_complete_step,
    load_stage_checkpoint,
    prune_checkpoints,
    save_stage_checkpoint,
)

PLAN = "plan-aaaa"
REPLICAS = (2, 1, 1)  # stage 0 has two replicas


def _state(stage: int, step: int) -> dict:
    generator = torch.Generator().manual_seed(stage * 1000 + step)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # creates momentum buffers in the optimizer state
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "stash": [model.weight.detach().clone() * version for version in range(2)],
        "rng": torch.get_rng_state(),
        "step": step,
    }


def _save_step(directory: Path, step: int, replicas=REPLICAS, plan: str = PLAN) -> None:
    for stage, count in enumerate(replicas):
        for replica in range(count):
            save_stage_checkpoint(directory, stage, replica, step, _state(stage, step), plan)


def _steps_on_disk(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


def test_round_trip_restores_every_tensor_and_value(tmp_path: Path) -> None:
    state = _state(stage=1, step=40)
    path = save_stage_checkpoint(tmp_path, 1, 0, 40, state, PLAN)
    assert path == tmp_path / "step-000040" / "stage-01-replica-0.pt"
    loaded = load_stage_checkpoint(tmp_path, 1, 0, 40, PLAN)
    assert isinstance(loaded, StageCheckpoint)
    assert (loaded.stage, loaded.step) == (1, 40)
    assert loaded.state["step"] == 40
    for key, tensor in state["model"].items():
        assert torch.equal(loaded.state["model"][key], tensor)
    momentum = state["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(loaded.state["optimizer"]["state"][0]["momentum_buffer"], momentum)
    assert loaded.state["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert all(torch.equal(a, b) for a, b in zip(loaded.state["stash"], state["stash"]))
    assert torch.equal(loaded.state["rng"], state["rng"])


def test_restored_optimizer_continues_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = [torch.randn(5, 3) for _ in range(4)]
    for x in data[:2]:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    save_stage_checkpoint(
        tmp_path, 0, 0, 2, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, PLAN
    )
    for x in data[2:]:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    resumed = torch.nn.Linear(3, 1)
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
    state = load_stage_checkpoint(tmp_path, 0, 0, 2, PLAN).state
    resumed.load_state_dict(state["model"])
    resumed_opt.load_state_dict(state["optimizer"])
    for x in data[2:]:
        resumed_opt.zero_grad()
        resumed(x).pow(2).mean().backward()
        resumed_opt.step()
    assert torch.equal(resumed.weight, model.weight)
    assert torch.equal(resumed.bias, model.bias)


def test_latest_complete_step_is_newest_when_all_files_verify(tmp_path: Path) -> None:
    assert latest_complete_step(tmp_path / "absent", 3, REPLICAS, PLAN) is None
    _save_step(tmp_path, 10)
    _save_step(tmp_path, 20)
    assert latest_complete_step(tmp_path, 3, REPLICAS, PLAN) == 20
    assert complete_steps(tmp_path, 3, REPLICAS, PLAN) == [20, 10]


@pytest.mark.parametrize("keep_bytes", [0, 10, -1])
def test_truncated_stage_file_falls_back_to_previous_step(tmp_path: Path, keep_bytes: int) -> None:
    _save_step(tmp_path, 10)
    _save_step(tmp_path, 20)
    torn = checkpoint_path(tmp_path, 2, 0, 20)
    data = torn.read_bytes()
    torn.write_bytes(data[: keep_bytes if keep_bytes >= 0 else len(data) - 1])
    assert latest_complete_step(tmp_path, 3, REPLICAS, PLAN) == 10
    with pytest.raises(InputError, match="stage-02-replica-0.pt"):
        load_stage_checkpoint(tmp_path, 2, 0, 20, PLAN)
    assert load_stage_checkpoint(tmp_path, 2, 0, 10, PLAN).step == 10


def test_garbled_payload_byte_makes_step_incomplete(tmp_path: Path) -> None:
    _save_step(tmp_path, 10)
    _save_step(tmp_path, 20)
    torn = checkpoint_path(tmp_path, 0, 1, 20)
    data = bytearray(torn.read_bytes())
    data[-5] ^= 0xFF  # same size, one flipped byte in the payload
    torn.write_bytes(bytes(data))
    assert latest_complete_step(tmp_path, 3, REPLICAS, PLAN) == 10
    with pytest.raises(InputError, match=r"stage-00-replica-1\.pt is corrupt: sha256"):
        load_stage_checkpoint(tmp_path, 0, 1, 20, PLAN)


def test_missing_replica_file_makes_step_incomplete(tmp_path: Path) -> None:
    _save_step(tmp_path, 10)
    _save_step(tmp_path, 20)
    checkpoint_path(tmp_path, 0, 1, 20).unlink()
    assert latest_complete_step(tmp_path, 3, REPLICAS, PLAN) == 10
    with pytest.raises(InputError, match=r"cannot read checkpoint .*stage-00-replica-1\.pt"):
        load_stage_checkpoint(tmp_path, 0, 1, 20, PLAN)
    # a replica count the saved steps never had: no step is complete
    assert latest_complete_step(tmp_path, 3, (3, 1, 1), PLAN) is None


def test_file_renamed_to_another_stage_is_not_accepted(tmp_path: Path) -> None:
    _save_step(tmp_path, 10)
    _save_step(tmp_path, 20)
    os.replace(checkpoint_path(tmp_path, 1, 0, 20), checkpoint_path(tmp_path, 2, 0, 20))
    assert latest_complete_step(tmp_path, 3, REPLICAS, PLAN) == 10
    with pytest.raises(InputError, match="header says step 20 stage 1 replica 0"):
        load_stage_checkpoint(tmp_path, 2, 0, 20, PLAN)


def test_fingerprint_mismatch_names_both_plans(tmp_path: Path) -> None:
    _save_step(tmp_path, 10, plan="plan-old")
    with pytest.raises(InputError) as info:
        load_stage_checkpoint(tmp_path, 1, 0, 10, "plan-new")
    message = str(info.value)
    assert "\n" not in message
    assert "stage-01-replica-0.pt was written for plan plan-old, this plan is plan-new" in message
    with pytest.raises(InputError, match="written for plan plan-old, this plan is plan-new"):
        latest_complete_step(tmp_path, 3, REPLICAS, "plan-new")


def test_crash_before_rename_leaves_no_file_under_final_name(tmp_path: Path, monkeypatch) -> None:
    _save_step(tmp_path, 10)
    final = checkpoint_path(tmp_path, 1, 0, 20)

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(InputError, match=r"cannot write checkpoint .*stage-01-replica-0\.pt: No space"):
        save_stage_checkpoint(tmp_path, 1, 0, 20, _state(1, 20), PLAN)
    monkeypatch.undo()
    assert not final.exists()
    assert list(final.parent.iterdir()) == []  # the temp file was removed too
    # overwriting an existing checkpoint: a failed rename keeps the old, whole file
    old = checkpoint_path(tmp_path, 1, 0, 10).read_bytes()
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(InputError):
        save_stage_checkpoint(tmp_path, 1, 0, 10, _state(1, 99), PLAN)
    monkeypatch.undo()
    assert checkpoint_path(tmp_path, 1, 0, 10).read_bytes() == old
    assert latest_complete_step(tmp_path, 3, REPLICAS, PLAN) == 10


def test_leftover_temp_file_is_ignored(tmp_path: Path) -> None:
    _save_step(tmp_path, 10)
    _save_step(tmp_path, 20)
    final = checkpoint_path(tmp_path, 2, 0, 20)
    (final.parent / f".{final.name}.abc.tmp").write_bytes(final.read_bytes()[:50])
    final.unlink()  # killed between the temp write and the rename
    assert latest_complete_step(tmp_path, 3, REPLICAS, PLAN) == 10


def test_retention_keeps_last_two_complete_steps(tmp_path: Path) -> None:
    _save_step(tmp_path, 10)
    assert prune_checkpoints(tmp_path, 3, REPLICAS, PLAN) == []  # one complete step: keep it
    _save_step(tmp_path, 20)
    assert prune_checkpoints(tmp_path, 3, REPLICAS, PLAN) == []
    _save_step(tmp_path, 30)
    assert prune_checkpoints(tmp_path, 3, REPLICAS, PLAN) == [10]
    assert _steps_on_disk(tmp_path) == ["step-000020", "step-000030"]
    # step 40 is in progress (stage 2 not written yet): nothing is deleted
    for stage, count in enumerate(REPLICAS[:2]):
        for replica in range(count):
            save_stage_checkpoint(tmp_path, stage, replica, 40, _state(stage, 40), PLAN)
    assert prune_checkpoints(tmp_path, 3, REPLICAS, PLAN) == []
    assert _steps_on_disk(tmp_path) == ["step-000020", "step-000030", "step-000040"]
    save_stage_checkpoint(tmp_path, 2, 0, 40, _state(2, 40), PLAN)
    assert prune_checkpoints(tmp_path, 3, REPLICAS, PLAN) == [20]
    assert latest_complete_step(tmp_path, 3, REPLICAS, PLAN) == 40


def test_retention_never_deletes_last_complete_step_when_newer_is_torn(tmp_path: Path) -> None:
    _save_step(tmp_path, 10)
    _save_step(tmp_path, 20)
    _save_step(tmp_path, 30)
    torn = checkpoint_path(tmp_path, 1, 0, 30)
    torn.write_bytes(torn.read_bytes()[:100])
    assert prune_checkpoints(tmp_path, 3, REPLICAS, PLAN) == []  # 20 and 10 are the two kept
    # keep=1: 20 is the last complete step and stays; the torn 30 is newer (maybe in progress)
    assert prune_checkpoints(tmp_path, 3, REPLICAS, PLAN, keep=1) == [10]
    assert _steps_on_disk(tmp_path) == ["step-000020", "step-000030"]
    assert latest_complete_step(tmp_path, 3, REPLICAS, PLAN) == 20
    _save_step(tmp_path, 40)
    # 40 is complete, so 20 and the torn 30 go
    assert prune_checkpoints(tmp_path, 3, REPLICAS, PLAN, keep=1) == [20, 30]
    assert _steps_on_disk(tmp_path) == ["step-000040"]
    with pytest.raises(InputError, match="keep at least 1 step, got keep=0"):
        prune_checkpoints(tmp_path, 3, REPLICAS, PLAN, keep=0)


def test_unloadable_state_is_refused_at_save_with_its_key(tmp_path: Path) -> None:
    point = collections.namedtuple("point", "x y")
    with pytest.raises(InputError, match=r"state\['extra'\]\[1\] is a point"):
        save_stage_checkpoint(tmp_path, 0, 0, 1, {"extra": [1, point(1, 2)]}, PLAN)
    with pytest.raises(InputError, match="must be a non-negative int, got -1"):
        save_stage_checkpoint(tmp_path, 0, 0, -1, {}, PLAN)
    with pytest.raises(InputError, match=r"stages=2 needs one replica count >= 1 per stage, got replicas=\[1\]"):
        latest_complete_step(tmp_path, 2, [1], PLAN)
    assert not (tmp_path / "step-000001").exists()
