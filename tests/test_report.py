"""Predicted vs measured: the metrics reader, the comparison, the report CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from pipeplan.cli import cli
from pipeplan.errors import InputError
from pipeplan.metrics import Metrics
from pipeplan.reporting.run_vs_plan import Comparison, compare, explain_pipeline, load_report

METRICS = {
    "schema": "pipeplan.metrics/1",
    "plan": {
        "schedule": "1f1b-rr",
        "predicted": {"time_per_minibatch_ms": 10.0},
        "stages": [
            {"index": 0, "compute_ms": 18.0, "time_per_minibatch_ms": 9.0},
            {"index": 1, "compute_ms": 10.0, "time_per_minibatch_ms": 10.0},
        ],
    },
    "losses": [2.5, 2.0, 1.5],
    "samples_per_s": 2900.0,
    "time_per_minibatch_ms": 11.0,
    "predicted_time_per_minibatch_ms": 10.0,
    "stages": [
        {
            "stage": 1,
            "replica": 0,
            "rank": 2,
            "time_per_minibatch_ms": 13.0,
            "compute_ms": 12.5,
            "wait_ms": 0.5,
            "predicted_time_per_minibatch_ms": 10.0,
            "predicted_compute_ms": 10.0,
        },
        {
            "stage": 0,
            "replica": 1,
            "rank": 1,
            "time_per_minibatch_ms": 9.5,
            "compute_ms": 17.0,
            "wait_ms": 1.0,
        },
        {
            "stage": 0,
            "replica": 0,
            "rank": 0,
            "time_per_minibatch_ms": 9.2,
            "compute_ms": 17.5,
            "wait_ms": 1.0,
            "extra_key": "ignored",
        },
    ],
}


WITHIN = {**METRICS, "stages": METRICS["stages"][1:]}  # stage 0's replicas: compute 0.94x, 0.97x


def test_comparison_ratio_and_flag() -> None:
    assert Comparison(10.0, 12.0).ratio == pytest.approx(1.2)
    assert not Comparison(10.0, 12.0).off
    assert Comparison(10.0, 12.01).off and Comparison(10.0, 7.9).off
    assert Comparison(None, 5.0).ratio is None and not Comparison(0.0, 5.0).off


def test_compare_fills_predictions_from_the_plan() -> None:
    report = compare(METRICS)
    assert report.time_per_minibatch.ratio == pytest.approx(1.1)
    assert [(s.stage, s.replica) for s in report.stages] == [(0, 0), (0, 1), (1, 0)]
    first = report.stages[0]
    assert (first.time_per_minibatch.predicted_ms, first.compute.predicted_ms) == (9.0, 18.0)
    assert [s.stage for s in report.flagged] == [1]  # 13 / 10 = 1.3 > 1.2
    assert report.losses == (2.5, 2.0, 1.5) and report.schedule == "1f1b-rr"


def test_compare_rejects_bad_values() -> None:
    bad = {**METRICS, "stages": [{"stage": 0, "time_per_minibatch_ms": "fast"}]}
    with pytest.raises(InputError, match=r"stages\[0\]: time_per_minibatch_ms = 'fast'"):
        compare(bad)
    with pytest.raises(InputError, match=r"stages\[0\] has no 'stage'"):
        compare({**METRICS, "stages": [{}]})


def test_load_rejects_other_schema(tmp_path) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"schema": "pipeplan.plan/1"}))
    with pytest.raises(InputError, match="expected 'pipeplan.metrics/2'"):
        load_report(path)


def test_report_cli(tmp_path) -> None:
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(METRICS))
    runner = CliRunner()
    out = runner.invoke(cli, ["report", str(path)], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "1.10" in out.output and "1.30" in out.output
    assert "1 stage replica(s) off by more than 20%" in out.output
    assert "stage 1 replica 0 (1.30x)" in out.output
    strict = runner.invoke(cli, ["report", str(path), "--strict"])
    assert strict.exit_code == 1
    path.write_text(json.dumps(WITHIN))
    out = runner.invoke(cli, ["report", str(path), "--strict"], catch_exceptions=False)
    assert out.exit_code == 0 and "every stage within 20%" in out.output
    assert "memory per rank" not in out.output  # a metrics/1 file has no memory figures


def test_a_pipeline_off_while_every_stage_is_within_is_explained() -> None:
    line = explain_pipeline(compare({**WITHIN, "time_per_minibatch_ms": 15.0}))
    assert line is not None and line.startswith("the pipeline: 1.50x its predicted 10.00 ms/minibatch")
    assert "every stage computes within 20% of its prediction (worst 0.97x)" in line
    assert "waiting up to 1.00 ms/minibatch" in line and "The time goes between the stages" in line
    assert "Fewer micro-batches" in line
    assert "which the plan counts only as its topology's message_overhead: measure it here" in line


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        ({**WITHIN, "time_per_minibatch_ms": 11.0}, None),  # 1.10x: within
        ({**METRICS, "time_per_minibatch_ms": 15.0}, "a stage computes slower than profiled"),
        ({**WITHIN, "time_per_minibatch_ms": 7.0}, "faster than planned"),
    ],
)
def test_the_pipeline_line_says_which_part_is_off(metrics: dict, expected: str | None) -> None:
    line = explain_pipeline(compare(metrics))
    assert (line is None) if expected is None else (line is not None and expected in line)


def test_report_strict_fails_on_a_pipeline_off_with_every_stage_within(tmp_path) -> None:
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({**WITHIN, "time_per_minibatch_ms": 15.0}))
    out = CliRunner().invoke(cli, ["report", str(path), "--strict"])
    assert out.exit_code == 1, out.output
    assert "every stage within 20%" in out.output and "the pipeline: 1.50x" in out.output


def test_report_cli_prints_each_rank_memory_against_the_plan(tmp_path) -> None:
    memory = {
        "memory_kind": "rss",
        "baseline_memory_bytes": 300 << 20,
        "peak_memory_bytes": 450 << 20,
        "predicted_memory_bytes": 128 << 20,
    }
    metrics = {
        **METRICS,
        "schema": "pipeplan.metrics/2",
        "stages": [{**stage, **memory} for stage in METRICS["stages"]],
    }
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(metrics))
    out = CliRunner(env={"COLUMNS": "160"}).invoke(cli, ["report", str(path)], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "memory per rank (CPU: the process's RSS" in out.output
    assert "128.0 MiB" in out.output and "150.0 MiB" in out.output and "1.17" in out.output  # 150 / 128


def test_report_memory_table_shows_set_up_and_fixed_apart_from_what_the_stage_held(tmp_path) -> None:
    memory = {
        "memory_kind": "rss",
        "baseline_memory_bytes": 300 << 20,
        "overhead_memory_bytes": 40 << 20,
        "setup_memory_bytes": 22 << 20,
        "peak_memory_bytes": 450 << 20,
        "predicted_memory_bytes": 128 << 20,
    }
    metrics = {**METRICS, "schema": "pipeplan.metrics/2", "stages": [{**METRICS["stages"][0], **memory}]}
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(metrics))
    assert Metrics.load(path).stages[0].held_memory_bytes == 128 << 20  # 450 - 300 - 22
    out = CliRunner(env={"COLUMNS": "200"}).invoke(cli, ["report", str(path)], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    row = next(line for line in out.output.splitlines() if "22.0 MiB" in line)
    assert "128.0 MiB" in row and "1.00" in row and "40.0 MiB" in row
    assert "held = peak - baseline - set-up" in out.output


def test_report_memory_table_shows_the_counted_tensors_beside_rss(tmp_path) -> None:
    memory = {
        "memory_kind": "rss",
        "baseline_memory_bytes": 300 << 20,
        "overhead_memory_bytes": 40 << 20,
        "setup_memory_bytes": 22 << 20,
        "peak_memory_bytes": 487 << 20,  # RSS: 165 MiB held, 1.29x
        "tensor_held_bytes": 132 << 20,  # 1.03x
        "predicted_memory_bytes": 128 << 20,
    }
    metrics = {**METRICS, "schema": "pipeplan.metrics/2", "stages": [{**METRICS["stages"][0], **memory}]}
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(metrics))
    stage = Metrics.load(path).stages[0]
    assert stage.tensor_held_bytes == 132 << 20
    out = CliRunner(env={"COLUMNS": "220"}).invoke(cli, ["report", str(path)], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    header = next(line for line in out.output.splitlines() if "tensors/planned" in line)
    assert header.index("tensors/planned") < header.index("held/planned")
    row = next(line for line in out.output.splitlines() if "132.0 MiB" in line)
    assert "1.03" in row and "165.0 MiB" in row and "1.29" in row
    title = " ".join(out.output.split())
    assert "tensors: the most bytes of live tensors at once over the first steps" in title
    metrics["stages"][0]["tensor_held_bytes"] = -1
    path.write_text(json.dumps(metrics))
    bad = CliRunner().invoke(cli, ["report", str(path)])
    assert bad.exit_code != 0 and "tensor_held_bytes = -1 is negative" in bad.output


def test_a_flagged_stage_says_which_part_is_off_and_what_to_do() -> None:
    from pipeplan.reporting.run_vs_plan import StageComparison, explain

    def stage(measured: float, compute: float, wait: float) -> StageComparison:
        return StageComparison(1, 0, 2, Comparison(10.0, measured), Comparison(8.0, compute), wait)

    slow = explain(stage(13.0, 12.0, 1.0))  # compute 1.50x its 8 ms
    assert slow.startswith(
        "stage 1 replica 0 (rank 2): 1.30x its predicted 10.00 ms/minibatch; its compute is off, 1.50x"
    )
    assert "--threads" in slow and "--trace" in slow
    assert "short layers also run slower right after their rank waited (bench/bench_turns.py)" in slow
    waiting = explain(stage(13.0, 8.4, 4.0))  # compute 1.05x, 4 ms waiting
    assert "its compute is within 20% (1.05x), it waits 4.00 ms/minibatch: for a slower neighbour" in waiting
    other = explain(stage(13.0, 8.4, 0.5))  # 4.1 ms neither compute nor waiting
    assert "4.10 ms/minibatch go neither to compute nor to waiting" in other


def test_report_cli_explains_each_flagged_stage(tmp_path) -> None:
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(METRICS))
    out = CliRunner(env={"COLUMNS": "300"}).invoke(cli, ["report", str(path)], catch_exceptions=False)
    assert (
        "stage 1 replica 0 (rank 2): 1.30x its predicted 10.00 ms/minibatch; its compute is off, 1.25x"
        in out.output
    )


def test_report_cli_error_is_one_line(tmp_path) -> None:
    path = tmp_path / "metrics.json"
    path.write_text("[1, 2]")
    out = CliRunner().invoke(cli, ["report", str(path)])
    assert out.exit_code == 2 and out.output.startswith("error: ") and "list" in out.output


def test_a_non_integer_stage_is_a_one_line_input_error() -> None:
    from pipeplan.errors import InputError
    from pipeplan.reporting.run_vs_plan import compare

    metrics = {"schema": "pipeplan.metrics/1", "stages": [{"stage": "zero", "time_per_minibatch_ms": 1.0}]}
    with pytest.raises(InputError, match=r"stages\[0\]: 'stage' must be an integer \(got 'zero'\)"):
        compare(metrics, where="m.json")


def test_metrics_contract_round_trips(tmp_path) -> None:
    from pipeplan.metrics import Metrics, StageMetrics

    metrics = Metrics(
        schedule="1f1b-flush",
        microbatches=2,
        plan={"schedule": "1f1b-rr"},
        steps=3,
        losses=(2.5, 2.0, 1.5),
        samples_per_s=812.5,
        time_per_minibatch_ms=float("nan"),
        predicted_time_per_minibatch_ms=9.0,
        predicted_schedule="1f1b-flush",
        predicted_microbatches=2,
        stages=(
            StageMetrics(
                stage=0,
                rank=0,
                time_per_minibatch_ms=8.5,
                compute_ms=8.0,
                minibatches=4,
                weight_versions_used=1,
                predicted_time_per_minibatch_ms=9.0,
                memory_kind="rss",
                baseline_memory_bytes=300 << 20,
                peak_memory_bytes=450 << 20,
                predicted_memory_bytes=128 << 20,
            ),
        ),
    )
    path = tmp_path / "metrics.json"
    metrics.save(path)
    obj = json.loads(path.read_text())
    assert obj["schema"] == "pipeplan.metrics/2" and obj["time_per_minibatch_ms"] is None  # NaN -> null
    assert obj["stages"][0]["peak_memory_bytes"] == 450 << 20
    back = Metrics.load(path)
    assert back == replace(metrics, time_per_minibatch_ms=None)
    assert back.plan == {"schedule": "1f1b-rr"} and back.schedule_name == "1f1b-flush"
    assert Metrics.from_dict(back.to_dict()) == back
    assert back.stages[0].held_memory_bytes == 150 << 20
    with pytest.raises(InputError, match=r"m.json: 'steps' must be an integer \(got 2.5\)"):
        Metrics.from_dict({**obj, "steps": 2.5}, where="m.json")


def test_a_run_of_another_schedule_is_reported_against_its_own_prediction() -> None:
    from test_simulate import make_profile, make_topology

    from pipeplan.planner.partition import PartitionOptions, partition
    from pipeplan.planner.simulate import simulate_plan
    from pipeplan.runtime.rank_metrics import prediction_for_run

    plan = partition(
        make_profile([1.0] * 4), make_topology(per_server=2, servers=1), PartitionOptions(straight=True)
    )
    assert prediction_for_run(plan, "1f1b-rr", 1) is plan
    flush = prediction_for_run(plan, "1f1b-flush", 2)
    assert (flush.schedule, flush.microbatches) == ("1f1b-flush", 2)
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(6.0)
    expected = simulate_plan(plan, None, "1f1b-flush", 2).time_per_minibatch_ms
    assert flush.predicted.time_per_minibatch_ms == pytest.approx(expected, rel=1e-12)
    assert flush.predicted.time_per_minibatch_ms == pytest.approx(9.0, rel=1e-9)


def test_metrics_version_1_loads_without_memory_and_memory_values_are_checked(tmp_path) -> None:
    from pipeplan.metrics import Metrics

    path = tmp_path / "old.json"
    path.write_text(json.dumps(METRICS))  # pipeplan.metrics/1: written before the memory figures
    stage = Metrics.load(path).stages[0]
    assert stage.peak_memory_bytes is None and stage.memory_kind is None and stage.held_memory_bytes is None
    good = {"stage": 0, "memory_kind": "rss", "peak_memory_bytes": 10, "baseline_memory_bytes": 4}
    with pytest.raises(
        InputError, match=r"stages\[0\]: memory_kind 'vram' is not one of rss, cuda_allocated"
    ):
        Metrics.from_dict({"stages": [{**good, "memory_kind": "vram"}]})
    with pytest.raises(InputError, match=r"stages\[0\]: peak_memory_bytes = -1 is negative"):
        Metrics.from_dict({"stages": [{**good, "peak_memory_bytes": -1}]})
    with pytest.raises(InputError, match=r"'baseline_memory_bytes' must be an integer \(got 4.5\)"):
        Metrics.from_dict({"stages": [{**good, "baseline_memory_bytes": 4.5}]})


def test_report_cli_prints_each_rank_checkpoint_cost_and_the_restart_time(tmp_path) -> None:
    from pipeplan.metrics import Metrics

    cost = {
        "checkpoints": 4,
        "checkpoint_stall_ms": 400.0,
        "checkpoint_wait_ms": 40.0,
        "checkpoint_persist_ms": 2000.0,
        "checkpoint_bytes": 8 << 20,
        "checkpoint_overhead_pct": 2.5,
    }
    metrics = {
        **METRICS,
        "schema": "pipeplan.metrics/2",
        "first_step": 10,
        "checkpoint_mode": "async",
        "checkpoint_every": 5,
        "predicted_checkpoint_overhead_pct": 1.25,
        "start_to_first_step_ms": 6500.0,
        "stages": [{**stage, **cost} for stage in METRICS["stages"]],
    }
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(metrics))
    loaded = Metrics.load(path)
    assert loaded.stages[0].checkpoint_stall_ms == 400.0 and loaded.checkpoint_every == 5
    assert Metrics.from_dict(METRICS).stages[0].checkpoints == 0  # an older file: no checkpoint figures
    out = CliRunner(env={"COLUMNS": "160"}).invoke(cli, ["report", str(path)], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "checkpoints per rank (async; ms per checkpoint" in out.output
    row = next(line for line in out.output.splitlines() if "8.00 MiB" in line)  # per checkpoint:
    assert [cell for cell in row.split() if "." in cell] == ["100.0", "10.0", "500.0", "8.00", "2.50"]
    assert "checkpoint interval: every 5 steps (auto; predicted overhead 1.25%)" in out.output
    assert "restart to the first resumed step: 6.50 s" in out.output
    bad = {**metrics, "stages": [{**METRICS["stages"][0], "checkpoint_bytes": -1}]}
    with pytest.raises(InputError, match="checkpoint_bytes = -1 is negative"):
        Metrics.from_dict(bad)
