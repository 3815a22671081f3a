"""`pipeplan run` end to end: torchrun (and plain env launches) with gloo on CPU.

Each launch has a hard subprocess timeout. References are single-process trainings on
the same batches (tests/fixtures/runtime/reference.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ports import free_port

FIXTURES = Path(__file__).parent / "fixtures" / "runtime"
sys.path.insert(0, str(FIXTURES))

from plans import make_plan  # noqa: E402
from reference import emulate_1f1b_rr, train_reference  # noqa: E402

pytestmark = pytest.mark.multiprocess
LR = 0.05


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(
    nproc: int, args: list[str], timeout: float = 120.0, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        "-m",
        "pipeplan",
        "run",
        *args,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**env(), **(extra_env or {})}
    )


def launch_plain(nproc: int, args: list[str], extra_env: dict[str, str]) -> list[subprocess.Popen[str]]:
    """Start ranks as torchrun would (its environment variables), without the agent."""
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        rank_env = {
            **env(),
            **extra_env,
            "RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "pipeplan", "run", *args],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def records(folder: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): torch.load(p) for p in sorted(folder.glob("rank*.pt"))}


def assert_params_match(recs: dict[int, dict], reference: dict[str, torch.Tensor]) -> None:
    seen = set()
    for rec in recs.values():
        for name, value in rec["params"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(reference)


def test_1f1b_flush_under_torchrun_matches_single_process(tmp_path: Path) -> None:
    model = str(FIXTURES / "mlp.py")
    plan = make_plan(model, [[0, 1, 2], [3, 4, 5]], [1, 1], "1f1b-flush", batch_size=8, microbatches=2)
    plan.save(tmp_path / "plan.json")
    steps = 3
    result = torchrun(
        2,
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            str(steps),
            "--lr",
            str(LR),
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
            "--metrics",
            str(tmp_path / "m.json"),
            "--trace",
            str(tmp_path / "t.json"),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reference, ref_losses = train_reference(model, steps, 8, LR)
    assert_params_match(records(tmp_path / "rec"), reference)
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["schema"] == "pipeplan.metrics/2" and metrics["schedule"] == "1f1b-flush"
    assert metrics["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert metrics["samples_per_s"] > 0 and metrics["wall_samples_per_s"] > 0
    assert [(s["stage"], s["rank"]) for s in metrics["stages"]] == [(0, 0), (1, 1)]
    for stage in metrics["stages"]:
        assert stage["compute_ms"] > 0 and stage["wait_ms"] >= 0
        assert stage["predicted_time_per_minibatch_ms"] == 1.0
        # the rank's own memory: RSS after imports (torch: > 50 MiB), a peak above it, the plan's figure
        assert stage["memory_kind"] == "rss" and stage["baseline_memory_bytes"] > 50 << 20
        assert stage["peak_memory_bytes"] >= stage["baseline_memory_bytes"]
        assert stage["predicted_memory_bytes"] == 1 << 20  # make_plan's StagePlan.memory_bytes
    assert "memory per rank" in result.stdout and "MiB" in result.stdout
    trace = json.loads((tmp_path / "t.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    categories = {(e["pid"], e["cat"]) for e in events}
    for rank in (0, 1):
        for cat in ("forward", "backward", "send", "recv", "allreduce", "step"):
            assert (rank, cat) in categories, (rank, cat)
    forwards = [e["name"] for e in events if e["cat"] == "forward" and e["pid"] == 0]
    assert forwards == ["F0", "F0.1", "F1", "F1.1", "F2", "F2.1"]


def test_gpipe_recompute_dag_with_skip_over_two_stages(tmp_path: Path) -> None:
    model = str(FIXTURES / "dag.py")
    # layer 0 (stage 0) feeds layer 4 (stage 3): the skip jumps stages 1 and 2
    plan = make_plan(model, [[0], [1, 2], [3], [4, 5]], [1, 1, 1, 1], "gpipe", batch_size=8, microbatches=2)
    plan.save(tmp_path / "plan.json")
    result = torchrun(
        4,
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            "3",
            "--lr",
            str(LR),
            "--recompute",
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reference, _ = train_reference(model, 3, 8, LR)
    assert_params_match(records(tmp_path / "rec"), reference)


@pytest.mark.parametrize("schedule", ["1f1b-flush", "1f1b-rr"])
def test_untagged_messages_keep_their_order_across_a_cut(tmp_path: Path, schedule: str) -> None:
    """As on NCCL (no tags): two same-shaped values cross one cut, read in the other order."""
    model = str(FIXTURES / "crossed.py")
    plan = make_plan(
        model,
        [[0, 1], [2, 3]],
        [1, 1],
        schedule,
        batch_size=8,
        microbatches=2 if schedule == "1f1b-flush" else 1,
    )
    plan.save(tmp_path / "plan.json")
    result = torchrun(
        2,
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            "3",
            "--lr",
            str(LR),
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
        ],
        extra_env={"PIPEPLAN_TEST_UNTAGGED": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if schedule == "1f1b-flush":
        reference, _ = train_reference(model, 3, 8, LR)
    else:
        reference = emulate_1f1b_rr(model, [[0, 1], [2, 3]], [1, 1], 3, 8, LR)
    assert_params_match(records(tmp_path / "rec"), reference)


def test_flush_with_a_replicated_loss_stage_reports_whole_minibatch_losses(tmp_path: Path) -> None:
    model = str(FIXTURES / "mlp.py")
    plan = make_plan(model, [[0, 1, 2], [3, 4, 5]], [1, 2], "1f1b-flush", batch_size=8, microbatches=2)
    plan.save(tmp_path / "plan.json")
    result = torchrun(
        3,
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            "3",
            "--lr",
            str(LR),
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
            "--metrics",
            str(tmp_path / "m.json"),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reference, ref_losses = train_reference(model, 3, 8, LR)
    assert_params_match(records(tmp_path / "rec"), reference)
    # each replica of the loss stage saw one micro-batch of every minibatch: summed, they
    # are the minibatch's loss
    assert json.loads((tmp_path / "m.json").read_text())["losses"] == pytest.approx(ref_losses, rel=1e-5)


def test_tied_weights_across_stages_stay_identical(tmp_path: Path) -> None:
    model = str(FIXTURES / "tied.py")
    plan = make_plan(
        model, [[0, 1], [2, 3, 4]], [1, 1], "1f1b-flush", batch_size=8, microbatches=2, optimizer="momentum"
    )
    plan.save(tmp_path / "plan.json")
    result = torchrun(
        2,
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            "3",
            "--lr",
            str(LR),
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    recs = records(tmp_path / "rec")
    reference, _ = train_reference(model, 3, 8, LR, optimizer="momentum")
    assert_params_match(recs, reference)
    both = [rec["digests"] for rec in recs.values()]
    assert len(both[0]) == 3
    assert [d["wte.weight"] for d in both[0]] == [d["wte.weight"] for d in both[1]]
    torch.testing.assert_close(
        recs[0]["params"]["wte.weight"], recs[1]["params"]["wte.weight"], rtol=0, atol=0
    )


def test_1f1b_rr_stashing_and_replicated_stage(tmp_path: Path) -> None:
    model = str(FIXTURES / "mlp.py")
    layers, replicas = [[0, 1, 2], [3, 4, 5]], [2, 1]
    plan = make_plan(model, layers, replicas, "1f1b-rr", batch_size=8)
    plan.save(tmp_path / "plan.json")
    steps = 4  # 2 minibatches per step (lcm of replicas)
    procs = launch_plain(
        3,
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            str(steps),
            "--lr",
            str(LR),
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
            "--metrics",
            str(tmp_path / "m.json"),
        ],
        {},
    )
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-2000:] for o in outs]
    recs = records(tmp_path / "rec")
    # every backward used the version of its own forward; stage 0 really ran stale versions
    for rec in recs.values():
        for _minibatch, _, forward_version, backward_version in rec["units"].values():
            assert forward_version == backward_version >= 0
    stage0_versions = sorted(v[2] for r in (0, 1) for v in recs[r]["units"].values())
    assert stage0_versions == [0, 0, 0, 0, 1, 1, 2, 2]
    assert recs[2]["peak_versions"] == 1 and recs[0]["peak_versions"] == 2
    # the two replicas of stage 0 end every step with identical weights
    assert len(recs[0]["digests"]) == steps
    assert recs[0]["digests"] == recs[1]["digests"]
    for name in recs[0]["params"]:
        torch.testing.assert_close(recs[0]["params"][name], recs[1]["params"][name], rtol=0, atol=0)
    # and the run equals PipeDream's semantics emulated in one process
    assert_params_match(recs, emulate_1f1b_rr(model, layers, replicas, steps * 2, 8, LR))
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert len(metrics["losses"]) == steps and len(metrics["minibatch_losses"]) == 2 * steps


def test_resume_under_another_plan_equals_uninterrupted_run(tmp_path: Path) -> None:
    """2 stages train 2 steps; a flipped file makes step 2 unusable (named in one line); the
    run resumes from step 1 under 3 stages, and from step 2 under a replicated plan, and both
    end where 4 uninterrupted steps in one process end (Adam state moved with its parameters)."""
    import shutil

    model = str(FIXTURES / "mlp.py")
    plans = {
        "two": ([[0, 1, 2], [3, 4, 5]], [1, 1]),
        "three": ([[0, 1], [2, 3], [4, 5]], [1, 1, 1]),
        "replicated": ([[0, 1, 2], [3, 4, 5]], [1, 2]),
    }
    for name, (layers, replicas) in plans.items():
        make_plan(model, layers, replicas, "1f1b-flush", batch_size=8, microbatches=2, optimizer="adam").save(
            tmp_path / f"{name}.json"
        )
    common = ["--model", model, "--lr", "0.01", "--no-progress", "--checkpoint-every", "1"]
    first = launch_plain(
        2,
        [str(tmp_path / "two.json"), *common, "--steps", "2", "--checkpoint-dir", str(tmp_path / "ckpt")],
        {},
    )
    assert [p.communicate(timeout=120) and p.returncode for p in first] == [0, 0]
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt-replicated")
    flipped = tmp_path / "ckpt" / "step-000002" / "stage-01-replica-0" / "__0_0.distcp"
    data = bytearray(flipped.read_bytes())
    data[100:164] = bytes(b ^ 0xFF for b in data[100:164])
    flipped.write_bytes(bytes(data))
    reference, ref_losses = train_reference(model, 4, 8, 0.01, optimizer="adam")
    for plan, folder, first_step in (("three", "ckpt", 1), ("replicated", "ckpt-replicated", 2)):
        ranks = sum(plans[plan][1])
        second = launch_plain(
            ranks,
            [
                str(tmp_path / f"{plan}.json"),
                *common,
                "--steps",
                "4",
                "--resume",
                "--checkpoint-dir",
                str(tmp_path / folder),
                "--record",
                str(tmp_path / f"rec-{plan}"),
                "--metrics",
                str(tmp_path / "m.json"),
            ],
            {},
        )
        outs = [p.communicate(timeout=120) for p in second]
        assert [p.returncode for p in second] == [0] * ranks, [o[1][-2000:] for o in outs]
        lines = outs[0][1].splitlines()
        if plan == "three":
            assert lines[0] == (
                "resume: skipped step 2 (stage-01-replica-0/__0_0.distcp fails its sha256 "
                "(the file changed after it was written)); resuming from step 1"
            )
        assert (
            f"resume: step {first_step} was saved under another plan: 2 stages (layers 0-2 | 3-5), "
            "replicas 1,1, 1f1b-flush, 2 micro-batches, 2 ranks; continuing under "
        ) in outs[0][1]
        assert_params_match(records(tmp_path / f"rec-{plan}"), reference)
        metrics = json.loads((tmp_path / "m.json").read_text())
        assert metrics["first_step"] == first_step
        assert metrics["losses"] == pytest.approx(ref_losses[first_step:], rel=1e-5)
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == ["step-000003", "step-000004"]


@pytest.mark.parametrize(("how", "ranks", "failing"), [("kill", 3, 1), ("raise", 2, 0)])
def test_failed_rank_stops_every_rank(tmp_path: Path, how: str, ranks: int, failing: int) -> None:
    """A rank that dies (os._exit) or raises mid-run: every other rank exits non-zero
    within 60 s and names it. Launched without torchrun's agent, so the runtime itself
    (bounded waits, watchdog) must notice; rank 0 also hosts the rendezvous store."""
    model = str(FIXTURES / "mlp.py")
    layers = [[0, 1], [2, 3], [4, 5]] if ranks == 3 else [[0, 1, 2], [3, 4, 5]]
    make_plan(model, layers, [1] * ranks, "1f1b-rr", batch_size=8).save(tmp_path / "plan.json")
    start = time.monotonic()
    procs = launch_plain(
        ranks,
        [str(tmp_path / "plan.json"), "--model", model, "--steps", "100000", "--no-progress"],
        {"PIPEPLAN_TEST_FAULT": f"{failing}:3:{how}"},
    )
    outs = [p.communicate(timeout=90) for p in procs]
    elapsed = time.monotonic() - start
    codes = [p.returncode for p in procs]
    assert all(code != 0 for code in codes), codes
    assert elapsed < 60, elapsed
    for rank in range(ranks):
        if rank != failing:
            err = outs[rank][1]
            assert "error:" in err and f"rank {failing}" in err, err[-2000:]
    if how == "raise":
        assert f"error: rank {failing} failed: RuntimeError: injected failure at step 3" in outs[failing][1]


def test_world_size_mismatch_refused_on_every_rank(tmp_path: Path) -> None:
    model = str(FIXTURES / "mlp.py")
    make_plan(model, [[0, 1, 2], [3, 4, 5]], [1, 1]).save(tmp_path / "plan.json")
    procs = launch_plain(3, [str(tmp_path / "plan.json"), "--model", model], {})
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [2, 2, 2]
    assert outs[0][1].strip() == (
        "error: the plan is for 2 ranks but torchrun started 3; use --nproc-per-node 2 "
        "(times nodes) or re-plan for 3 devices"
    )
    assert outs[1][1] == "" and outs[2][1] == ""


def test_non_contiguous_downset_plan_trains(tmp_path: Path) -> None:
    """Stage 0 runs layers {0, 1, 3} (a downset of the DAG, not a
    range), stage 1 runs {2, 4, 5}; 1F1B-flush matches single-process training."""
    model = str(FIXTURES / "branches.py")
    plan = make_plan(model, [[0, 1, 3], [2, 4, 5]], [1, 1], "1f1b-flush", batch_size=8, microbatches=2)
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == [(0, 4), (2, 6)]
    plan.save(tmp_path / "plan.json")
    result = torchrun(
        2,
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            "3",
            "--lr",
            str(LR),
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reference, _ = train_reference(model, 3, 8, LR)
    assert_params_match(records(tmp_path / "rec"), reference)
