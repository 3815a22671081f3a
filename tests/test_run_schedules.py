"""The newer schedules, and 1F1B-flush on uneven replicas, under torchrun (gloo on CPU).

Flush schedules (interleaved-1f1b, zb-h1, zb-v, v-half, v-min, dualpipev, 1f1b-flush) must equal single-process training; 2BW must
equal its delayed-update rule W(t+1) = W(t) - lr * grad f(W(t-1)), emulated in one
process. Each launch has a hard timeout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_run_torchrun import FIXTURES, LR, assert_params_match, records, torchrun

sys.path.insert(0, str(FIXTURES))

from plans import make_plan  # noqa: E402
from reference import emulate_2bw, train_reference  # noqa: E402

pytestmark = pytest.mark.multiprocess

CASES = {
    # DAG: layer 0 feeds layers 1 and 5, i.e. model stages 1 and 3, both on rank 1 (P = 2
    # ranks, v = 2 chunks): the value crosses once per unit and the two chunks' gradients
    # go back summed; a residual inside stage 1. Messages are matched in posting order, as
    # NCCL matches them (no tags).
    "interleaved-dag": (
        "dag.py",
        [[0], [1, 2], [3], [4, 5]],
        2,
        "interleaved-1f1b",
        4,
        2,
        {"PIPEPLAN_TEST_UNTAGGED": "1"},
    ),
    # tied embedding (stage 0, rank 0) and head (stage 3, rank 1)
    "interleaved-tied": ("tied.py", [[0], [1], [2], [3, 4]], 2, "interleaved-1f1b", 2, 2, {}),
    # one rank, both chunks on it: every message goes to the rank itself
    "interleaved-one-rank": ("dag.py", [[0, 1, 2], [3, 4, 5]], 1, "interleaved-1f1b", 2, 2, {}),
    # PTD-P: 2 positions x 2 replicas, 2 chunks per rank; each replica runs Megatron's order on
    # its own 4 micro-batches (m = r mod 2) and the replicas of a position all-reduce both chunks
    "interleaved-replicas": ("mlp.py", [[0], [1, 2], [3], [4, 5]], 4, "interleaved-1f1b", 8, 2, {}),
    "zb-h1-dag": ("dag.py", [[0], [1, 2], [3], [4, 5]], 4, "zb-h1", 4, 1, {}),
    "zb-h1-tied": ("tied.py", [[0, 1], [2, 3, 4]], 2, "zb-h1", 4, 1, {"PIPEPLAN_TEST_UNTAGGED": "1"}),
    # the V on 2 ranks puts the first and the last pieces on rank 0: the tied embedding and
    # head are one Parameter in two chunks of one rank (its gradient holds both uses)
    "zb-v-tied": ("tied.py", [[0], [1], [3, 4], [2]], 2, "zb-v", 4, 2, {}),
    # the V on 4 ranks: model stage q = c * 4 + i holds piece i (c = 0) or 7 - i (c = 1), so
    # rank 0 runs the first and the last layers, rank 3 the two middle pieces back to back
    # (a message to itself); 4 micro-batches, fewer than the 2P - 1 = 7 of a full V
    "zb-v": ("deep.py", [[0], [1], [2], [3], [7, 8], [6], [5], [4]], 4, "zb-v", 4, 2, {}),
    # the controllable-memory V's on the same V placement: "W" in the block's free slots
    "v-half": ("deep.py", [[0], [1], [2], [3], [7, 8], [6], [5], [4]], 4, "v-half", 4, 2, {}),
    "v-min": ("deep.py", [[0], [1], [2], [3], [7, 8], [6], [5], [4]], 4, "v-min", 4, 2, {}),
    # DualPipeV: 2P = 8 micro-batches of one sample, whole ("B") and split ("I", "W") backwards mixed
    "dualpipev": ("deep.py", [[0], [1], [2], [3], [7, 8], [6], [5], [4]], 4, "dualpipev", 8, 2, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flush_schedules_match_single_process(tmp_path: Path, case: str) -> None:
    model_name, layers, ranks, schedule, micro, virtual, extra_env = CASES[case]
    model = str(FIXTURES / model_name)
    plan = make_plan(
        model,
        layers,
        [ranks // (len(layers) // virtual)] * len(layers),
        schedule,
        batch_size=8,
        microbatches=micro,
        optimizer="momentum",
        virtual_stages=virtual,
    )
    plan.save(tmp_path / "plan.json")
    result = torchrun(
        ranks,
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
        extra_env=extra_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reference, _ = train_reference(model, 3, 8, LR, optimizer="momentum")
    recs = records(tmp_path / "rec")
    assert len(recs) == ranks  # every replica's parameters compared, not one per position
    assert_params_match(recs, reference)


def test_2bw_delayed_updates_with_two_versions(tmp_path: Path) -> None:
    model = str(FIXTURES / "mlp.py")
    layers, replicas = [[0, 1, 2], [3, 4, 5]], [1, 2]  # stage 1 replicated, as 1F1B-RR has it
    plan = make_plan(model, layers, replicas, "2bw", batch_size=8, microbatches=4)
    plan.save(tmp_path / "plan.json")
    steps = 5
    result = torchrun(
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
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    recs = records(tmp_path / "rec")
    for rec in recs.values():
        units = list(rec["units"].values())
        assert len(units) == steps * 4 // (1 if rec["stage"] == 0 else 2)
        for minibatch, _, forward_version, backward_version in units:
            # every backward on its forward's version, which is W(t - 1)
            assert forward_version == backward_version == max(minibatch - 1, 0)
        assert rec["peak_versions"] <= 2 and rec["peak_kept_versions"] <= 2
    # stage 0 (3 micro-batches of warm-up) really runs two minibatches on two versions at once
    assert recs[0]["peak_versions"] == 2
    final, versions = emulate_2bw(model, steps, 8, LR)
    assert_params_match(recs, final)
    # and the delay is real: one-step-stale training differs from plain SGD
    plain, _ = train_reference(model, steps, 8, LR)
    assert any(not bool((final[n] - plain[n]).abs().max() < 1e-6) for n in final)


def test_1f1b_flush_on_uneven_replicas_matches_single_process(tmp_path: Path) -> None:
    """Replicas 1, 3, 1 with 4 micro-batches: the smallest plan whose old 1F1B-flush orders
    deadlocked (s1r0 forwarded micro-batch 3 before the backward of 0, which s0r0 needed
    first). The executor runs the fixed orders to the end and trains as one process does."""
    model = str(FIXTURES / "mlp.py")
    plan = make_plan(
        model,
        [[0, 1], [2, 3], [4, 5]],
        [1, 3, 1],
        "1f1b-flush",
        batch_size=8,
        microbatches=4,
        optimizer="momentum",
    )
    plan.save(tmp_path / "plan.json")
    result = torchrun(
        5,
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
    reference, ref_losses = train_reference(model, 3, 8, LR, optimizer="momentum")
    recs = records(tmp_path / "rec")
    assert sorted(rec["stage"] for rec in recs.values()) == [0, 1, 1, 1, 2]
    assert_params_match(recs, reference)  # the three stage-1 replicas included
    assert json.loads((tmp_path / "m.json").read_text())["losses"] == pytest.approx(ref_losses, rel=1e-5)
