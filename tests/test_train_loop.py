"""The training loop: AdamW, LR schedules, global-norm clipping, model-file hooks, live metrics.

Multi-process cases run under torchrun (gloo, CPU) and compare with one process training
the whole model (``tests/fixtures/runtime/reference.py: train_reference_loop``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures" / "runtime"
sys.path.insert(0, str(FIXTURES))

from plans import make_plan  # noqa: E402
from reference import train_reference_loop  # noqa: E402
from test_run_torchrun import assert_params_match, launch_plain, records, torchrun  # noqa: E402

from pipeplan.errors import InputError  # noqa: E402
from pipeplan.optimizers import LRSchedule, make_lr_scheduler, make_optimizer, param_groups  # noqa: E402


def log_lines(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- one process


def test_weight_decay_skips_biases_and_norms() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    optimizer = make_optimizer("adamw", param_groups(model.named_parameters()), lr=0.1, weight_decay=0.3)
    groups = {g["name"]: (g["weight_decay"], g["param_names"]) for g in optimizer.param_groups}
    assert groups == {
        "decay": (0.3, ["0.weight", "2.weight"]),
        "no_decay": (0.0, ["0.bias", "1.weight", "1.bias", "2.bias"]),
    }
    assert isinstance(optimizer, torch.optim.AdamW)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("constant", [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.25, 0.5, 0.75, 1.0, 1.0, 0.82, 0.64, 0.46, 0.28, 0.1]),
        ("cosine", [0.25, 0.5, 0.75, 1.0, 1.0, 0.9140576475, 0.6890576475, 0.4109423525, 0.1859423525, 0.1]),
    ],
)
def test_schedules_warm_up_then_decay_to_min_lr(kind: str, expected: list[float]) -> None:
    schedule = LRSchedule(kind, warmup_steps=4, min_lr=0.1, total_steps=9)  # a 10th step would be at min_lr
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_lr_scheduler(optimizer, schedule, 1.0)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx(expected, rel=1e-9)
    assert seen == pytest.approx([schedule.lr(t, 1.0) for t in range(10)], rel=1e-12)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (
            LRSchedule("cosine", warmup_steps=11, total_steps=10),
            "--warmup-steps must be between 0 and --steps 10 (got 11)",
        ),
        (
            LRSchedule("cosine", min_lr=2.0, total_steps=10),
            "--min-lr must be between 0 and --lr 1.0 (got 2.0)",
        ),
        (LRSchedule("step", total_steps=10), "unknown --lr-schedule 'step'"),
    ],
)
def test_bad_schedule_settings_are_one_line_errors(schedule: LRSchedule, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        schedule.check(1.0)


# ---------------------------------------------------------------- torchrun


@pytest.mark.multiprocess
def test_global_norm_clip_three_stages_tied_and_replicated(tmp_path: Path) -> None:
    """tied.py: stage 0 (embedding) and stage 2 (head) share a weight; stage 1 has two replicas."""
    model = str(FIXTURES / "tied.py")
    plan = make_plan(model, [[0, 1], [2, 3], [4]], [1, 2, 1], "1f1b-flush", batch_size=8, microbatches=2)
    plan.save(tmp_path / "plan.json")
    steps, clip = 4, 0.5
    result = torchrun(
        4,
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            str(steps),
            "--lr",
            "0.2",
            "--clip-grad-norm",
            str(clip),
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
            "--log-dir",
            str(tmp_path / "log"),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ref = train_reference_loop(model, steps, 8, lambda p: torch.optim.SGD(p, lr=0.2), clip_grad_norm=clip)
    assert min(ref["norms"]) > clip  # every step really clips
    lines = log_lines(tmp_path / "log")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert [line["grad_norm"] for line in lines] == pytest.approx(ref["norms"], rel=1e-5)
    assert [line["loss"] for line in lines] == pytest.approx(ref["losses"], rel=1e-5)
    assert_params_match(records(tmp_path / "rec"), ref["params"])


@pytest.mark.multiprocess
def test_adamw_warmup_cosine_clip_under_1f1b_flush_matches_one_process(tmp_path: Path) -> None:
    model = str(FIXTURES / "tied.py")
    plan = make_plan(model, [[0, 1], [2, 3, 4]], [1, 1], "1f1b-flush", batch_size=8, microbatches=2)
    plan.save(tmp_path / "plan.json")
    steps, lr, clip = 6, 0.02, 1.5
    schedule = LRSchedule("cosine", warmup_steps=2, min_lr=0.002, total_steps=steps)
    result = torchrun(
        2,
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            str(steps),
            "--optimizer",
            "adamw",
            "--lr",
            str(lr),
            "--weight-decay",
            "0.1",
            "--lr-schedule",
            "cosine",
            "--warmup-steps",
            "2",
            "--min-lr",
            "0.002",
            "--clip-grad-norm",
            str(clip),
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
            "--log-dir",
            str(tmp_path / "log"),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ref = train_reference_loop(
        model,
        steps,
        8,
        lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.1),
        lambda o: make_lr_scheduler(o, schedule, lr),
        clip_grad_norm=clip,
    )
    assert_params_match(records(tmp_path / "rec"), ref["params"])
    lines = log_lines(tmp_path / "log")
    assert [line["lr"] for line in lines] == ref["lrs"]  # the same curve, to the bit
    assert [line["grad_norm"] for line in lines] == pytest.approx(ref["norms"], rel=1e-5)
    assert all(line["samples_per_s"] > 0 and len(line["stage_step_ms"]) == 2 for line in lines)
    assert list((tmp_path / "log").glob("events.out.tfevents.*"))


@pytest.mark.multiprocess
def test_model_file_optimizer_and_scheduler_are_used(tmp_path: Path) -> None:
    model = str(FIXTURES / "user_optim.py")
    plan = make_plan(model, [[0, 1, 2], [3, 4, 5]], [1, 1], "gpipe", batch_size=8, microbatches=2)
    plan.save(tmp_path / "plan.json")
    result = torchrun(
        2,
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            "5",
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
            "--log-dir",
            str(tmp_path / "log"),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sys.path.insert(0, str(FIXTURES))
    import user_optim

    ref = train_reference_loop(model, 5, 8, user_optim.make_optimizer, user_optim.make_lr_scheduler)
    lines = log_lines(tmp_path / "log")
    assert [line["lr"] for line in lines] == ref["lrs"] == [0.05, 0.05, 0.025, 0.025, 0.0125]
    # logged without clipping: every rank's squared sum, added by the writer, no all-reduce
    assert [line["grad_norm"] for line in lines] == pytest.approx(ref["norms"], rel=1e-5)
    assert_params_match(records(tmp_path / "rec"), ref["params"])


@pytest.mark.multiprocess
def test_resume_mid_warmup_continues_the_lr_curve_exactly(tmp_path: Path) -> None:
    model = str(FIXTURES / "mlp.py")
    plan = make_plan(model, [[0, 1, 2], [3, 4, 5]], [1, 1], "1f1b-flush", batch_size=8, microbatches=2)
    plan.save(tmp_path / "plan.json")
    steps, lr = 7, 0.01
    common = [
        str(tmp_path / "plan.json"),
        "--model",
        model,
        "--steps",
        str(steps),
        "--optimizer",
        "adamw",
        "--lr",
        str(lr),
        "--lr-schedule",
        "linear",
        "--warmup-steps",
        "5",
        "--min-lr",
        "0.001",
        "--clip-grad-norm",
        "1.0",
        "--no-progress",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "1",
        "--log-dir",
        str(tmp_path / "log"),
    ]
    first = launch_plain(2, common, {"PIPEPLAN_TEST_FAULT": "0:2:kill"})  # dies after step 2, mid-warm-up
    [p.communicate(timeout=120) for p in first]
    assert [p.returncode for p in first] != [0, 0]
    second = launch_plain(
        2, [*common, "--resume", "--record", str(tmp_path / "rec"), "--metrics", str(tmp_path / "m.json")], {}
    )
    outs = [p.communicate(timeout=120) for p in second]
    assert [p.returncode for p in second] == [0, 0], [o[1][-2000:] for o in outs]
    resumed_from = json.loads((tmp_path / "m.json").read_text())["first_step"]
    assert resumed_from in (1, 2)  # the newest step both ranks saved before rank 0 died
    schedule = LRSchedule("linear", warmup_steps=5, min_lr=0.001, total_steps=steps)
    ref = train_reference_loop(
        model,
        steps,
        8,
        lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0),
        lambda o: make_lr_scheduler(o, schedule, lr),
        clip_grad_norm=1.0,
    )
    resumed = list(log_lines(tmp_path / "log"))[-(steps - resumed_from) :]
    assert [line["step"] for line in resumed] == list(range(resumed_from + 1, steps + 1))
    assert [line["lr"] for line in resumed] == ref["lrs"][resumed_from:]  # exactly, warm-up included
    assert_params_match(records(tmp_path / "rec"), ref["params"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["2bw", "1f1b-rr"])
def test_clipping_under_schedules_with_weight_versions(tmp_path: Path, schedule: str) -> None:
    """2BW clips the delayed gradient by the global norm; 1F1B-RR each stage's update by its own."""
    from reference import emulate_1f1b_rr, emulate_2bw

    model = str(FIXTURES / "mlp.py")
    layers, replicas = [[0, 1, 2], [3, 4, 5]], ([1, 1] if schedule == "2bw" else [2, 1])
    microbatches = 2 if schedule == "2bw" else 1
    plan = make_plan(model, layers, replicas, schedule, batch_size=8, microbatches=microbatches)
    plan.save(tmp_path / "plan.json")
    steps, lr, clip = 4, 0.2, 0.3
    result = torchrun(
        sum(replicas),
        [
            str(tmp_path / "plan.json"),
            "--model",
            model,
            "--steps",
            str(steps),
            "--lr",
            str(lr),
            "--clip-grad-norm",
            str(clip),
            "--no-progress",
            "--record",
            str(tmp_path / "rec"),
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if schedule == "2bw":
        reference, _ = emulate_2bw(model, steps, 8, lr, clip_grad_norm=clip)
        unclipped, _ = emulate_2bw(model, steps, 8, lr)
    else:
        reference = emulate_1f1b_rr(model, layers, replicas, steps * 2, 8, lr, clip_grad_norm=clip)
        unclipped = emulate_1f1b_rr(model, layers, replicas, steps * 2, 8, lr)
    assert not torch.allclose(reference["0.weight"], unclipped["0.weight"], atol=1e-4)  # clipping acted
    assert_params_match(records(tmp_path / "rec"), reference)


# ---------------------------------------------------------------- report --plot


def test_report_summarises_a_log_dir_and_plots_the_loss(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from pipeplan.cli import cli

    log = tmp_path / "log"
    log.mkdir()
    lines = [
        {
            "step": s,
            "loss": 3.0 - 0.5 * s,
            "lr": 0.1 * s,
            "grad_norm": 2.0,
            "samples_per_s": 100.0 * s,
            "stage_step_ms": [1.0],
            "stage_compute_ms": [0.5],
        }
        for s in (1, 2, 3)
    ]
    lines.append({**lines[2], "loss": 1.25})  # a resumed run wrote step 3 again: the newest wins
    (log / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    runner = CliRunner()
    out = runner.invoke(
        cli, ["report", str(log), "--plot", str(tmp_path / "loss.png")], catch_exceptions=False
    )
    assert out.exit_code == 0, out.output
    assert "steps 1-3 (3 logged)" in out.output and "loss: 2.5000 (first) -> 1.2500 (last)" in out.output
    assert "learning rate: 0.1 (first) -> 0.3 (last)" in out.output and "median 200.0 samples/s" in out.output
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = runner.invoke(cli, ["report", str(log), "--plot", str(tmp_path / "loss.svg")])
    assert bad.exit_code == 2 and "expected a .png file" in bad.output
    (log / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    broken = runner.invoke(cli, ["report", str(log)])
    assert broken.exit_code == 2 and "metrics.jsonl:2: not a metrics line" in broken.output
