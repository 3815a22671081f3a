"""Two-phase (asynchronous) checkpoints, ``--checkpoint-every auto`` and stateful data (issue 34).

Multi-process cases run 2 gloo ranks of the tiny MLP without torchrun's agent, each launch
under a hard timeout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeplan.runtime.checkpoint.frequency import AutoInterval, choose_interval, overhead_pct

FIXTURES = Path(__file__).parent / "fixtures" / "runtime"
sys.path.insert(0, str(FIXTURES))

from plans import make_plan  # noqa: E402
from reference import train_reference  # noqa: E402
from test_run_torchrun import launch_plain  # noqa: E402

MLP = str(FIXTURES / "mlp.py")
STATEFUL = str(FIXTURES / "stateful_mlp.py")
LR = 0.01
WAIT_S = 120  # bound on each launch


def _launch(args: list[str], extra_env: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """Two ranks as torchrun starts them (its environment), without the agent: (exit code, stderr)."""
    procs = launch_plain(2, args, extra_env or {})
    outs = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        outs.append((proc.returncode, err))
    return outs


def _plan(tmp_path: Path, model: str) -> str:
    path = tmp_path / "plan.json"
    make_plan(
        model, [[0, 1, 2], [3, 4, 5]], [1, 1], "1f1b-flush", batch_size=8, microbatches=2, optimizer="adam"
    ).save(path)
    return str(path)


def test_the_interval_is_the_most_frequent_under_the_target_and_follows_the_cost() -> None:
    # a 20 ms snapshot and a 500 ms persist behind 100 ms steps: 6 steps hide the persist
    # and keep the snapshot at 3.33% (5 steps: 4%)
    choice = choose_interval(100.0, 20.0, 500.0, 3.5)
    assert choice.every == 6 and choice.predicted_overhead_pct == pytest.approx(100 * 20 / 600)
    assert overhead_pct(5, 100.0, 20.0, 500.0) > 3.5
    # a persist longer than the snapshot's interval: the wait decides (3 s behind 100 ms
    # steps: 29 steps leave 100 ms of it, (1 + 100) / 2900 = 3.48%; 28 steps 7.5%)
    assert choose_interval(100.0, 1.0, 3000.0, 3.5).every == 29
    assert overhead_pct(28, 100.0, 1.0, 3000.0) > 3.5
    # a persist that slows the steps beside it by 180 ms in all: (20 + 180) / (58 * 100) = 3.45%
    assert choose_interval(100.0, 20.0, 500.0, 3.5, interference_ms=180.0).every == 58
    auto = AutoInterval(3.5)
    assert auto.update(1, 100.0, 20.0, 0.0) and (auto.every, auto.next_step) == (6, 7)
    assert not auto.update(7, 100.0, 20.0, 0.0)  # the same cost: the same interval
    assert auto.update(13, 100.0, 70.0, 0.0) and (auto.every, auto.next_step) == (20, 33)  # a slower disk


@pytest.mark.multiprocess
def test_a_rank_killed_mid_persist_resumes_the_previous_step_allclose(tmp_path: Path) -> None:
    """Asynchronous saves every step; rank 1 dies while its step-3 persist is held (written,
    not sealed): the resume names step 3 in one line, continues from step 2, and ends where
    4 uninterrupted steps in one process end."""
    plan, ckpt = _plan(tmp_path, MLP), tmp_path / "ckpt"
    common = [plan, "--model", MLP, "--lr", str(LR), "--no-progress", "--timeout", "4"]
    common += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--checkpoint-async"]
    crashed = _launch(
        [*common, "--steps", "4"],
        {"PIPEPLAN_TEST_PERSIST_DELAY": "1:3:60", "PIPEPLAN_TEST_FAULT": "1:3:kill"},
    )
    assert [code != 0 for code, _ in crashed] == [True, True], crashed
    assert not (ckpt / "step-000003" / "stage-01-replica-0.json").exists()
    assert (ckpt / "step-000003" / "stage-01-replica-0").is_dir()  # its files, unsealed

    metrics = tmp_path / "m.json"
    resumed = _launch(
        [*common, "--steps", "4", "--resume", "--record", str(tmp_path / "rec"), "--metrics", str(metrics)]
    )
    assert [code for code, _ in resumed] == [0, 0], resumed
    # rank 0's own step-3 persist may not have sealed either before the crash tore it down
    # (a loaded machine): then no manifest of step 3 is readable at all
    assert re.fullmatch(
        r"resume: skipped step 3 \((stage 1 replica 0 has no manifest \(its save did not finish\)"
        r"|it has no readable manifest)\); resuming from step 2",
        resumed[0][1].splitlines()[0],
    ), resumed[0][1]
    reference, losses = train_reference(MLP, 4, 8, LR, optimizer="adam")
    for path in sorted((tmp_path / "rec").glob("rank*.pt")):
        for name, value in torch.load(path)["params"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)
    report = json.loads(metrics.read_text())
    assert report["first_step"] == 2 and report["losses"] == pytest.approx(losses[2:], rel=1e-5)
    assert report["checkpoint_mode"] == "async" and report["start_to_first_step_ms"] > 0
    for stage in report["stages"]:  # steps 3 and 4, each written and sealed
        assert stage["checkpoints"] == 2 and stage["checkpoint_bytes"] > 0
        assert 0 < stage["checkpoint_stall_ms"] and 0 < stage["checkpoint_persist_ms"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000003", "step-000004"]


@pytest.mark.multiprocess
def test_a_stateful_loader_resumes_where_it_stopped_without_rereading(tmp_path: Path) -> None:
    """StatefulDataLoader (shuffled): a run stopped after step 2 and resumed reads exactly the
    items an uninterrupted run reads in steps 3-4, none of the first two steps again, and
    its losses are the uninterrupted run's."""
    plan = _plan(tmp_path, STATEFUL)
    common = [plan, "--model", STATEFUL, "--lr", str(LR), "--no-progress", "--timeout", "30"]
    whole, first, second = (tmp_path / name for name in ("whole", "first", "second"))
    for folder in (whole, first, second):
        folder.mkdir()
    outs = _launch(
        [*common, "--steps", "4", "--metrics", str(tmp_path / "whole.json")],
        {"PIPEPLAN_TEST_ITEMS": str(whole)},
    )
    assert [code for code, _ in outs] == [0, 0], outs
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    outs = _launch([*common, *ckpt, "--steps", "2"], {"PIPEPLAN_TEST_ITEMS": str(first)})
    assert [code for code, _ in outs] == [0, 0], outs
    outs = _launch(
        [*common, *ckpt, "--steps", "4", "--resume", "--metrics", str(tmp_path / "resumed.json")],
        {"PIPEPLAN_TEST_ITEMS": str(second)},
    )
    assert [code for code, _ in outs] == [0, 0], outs
    for rank in (0, 1):  # the input stage reads inputs, the loss stage targets: both read items
        read = {f: (f / f"items-{rank}.txt").read_text().split() for f in (whole, first, second)}
        assert len(read[whole]) == 32 and len(set(read[whole])) == 32  # 4 minibatches of 8, shuffled
        assert read[first] == read[whole][:16]
        assert read[second] == read[whole][16:]  # not one item of steps 1-2 read again
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    uninterrupted = json.loads((tmp_path / "whole.json").read_text())
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][2:], rel=1e-5)


@pytest.mark.multiprocess
def test_auto_picks_an_interval_under_the_target_where_every_step_would_exceed_it(tmp_path: Path) -> None:
    """The tiny MLP trains in a few ms a step and a checkpoint takes longer: saving every step
    would cost far more than the 20% target; auto checkpoints rarely enough to stay near it.
    The measured bound is 25%: the run's mean stall includes the cold first checkpoint, which
    the choice does not see, and the 2 cores are shared (21% was measured once)."""
    plan = _plan(tmp_path, MLP)
    metrics = tmp_path / "m.json"
    steps = 100
    outs = _launch(
        [
            plan,
            *("--model", MLP, "--lr", str(LR), "--no-progress", "--steps", str(steps)),
            *("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "auto"),
            *("--checkpoint-overhead", "20", "--metrics", str(metrics)),
        ]
    )
    assert [code for code, _ in outs] == [0, 0], outs
    assert "checkpoint: every " in outs[0][1] and "(auto), predicted overhead " in outs[0][1]
    report = json.loads(metrics.read_text())
    every = report["checkpoint_every"]
    assert 1 < every < steps and report["predicted_checkpoint_overhead_pct"] <= 20.0
    for stage in report["stages"]:
        per_checkpoint_ms = stage["checkpoint_stall_ms"] / stage["checkpoints"]
        step_ms = (report["wall_ms"] - stage["checkpoint_stall_ms"]) / steps
        every_step_pct = 100.0 * per_checkpoint_ms / step_ms
        at_interval_pct = every_step_pct / every
        assert every_step_pct > 20.0, (every_step_pct, stage)  # every step would exceed the target
        assert at_interval_pct < 25.0, (at_interval_pct, every, stage)
        assert stage["checkpoints"] < steps / 2
