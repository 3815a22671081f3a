"""Timeline files from a simulation: Chrome trace, SVG, PNG; and the simulate CLI."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_simulate import make_plan, make_profile, make_topology

from pipeplan.cli import cli
from pipeplan.errors import InputError
from pipeplan.planner.simulate import simulate_plan
from pipeplan.reporting.timeline import draw_timeline, write_timeline
from pipeplan.trace import TraceEvent, validate_chrome_trace


@pytest.fixture(scope="module")
def simulated():
    profile = make_profile([1.0] * 6, output_bytes=10_000_000, param_bytes=1_000_000)
    plan = make_plan(profile, make_topology(), [0, 2, 4, 6], [2, 1, 1])
    return plan, profile, simulate_plan(plan, profile, record=True)


def test_chrome_trace_from_simulation(simulated, tmp_path) -> None:
    _, _, result = simulated
    path = tmp_path / "timeline.json"
    write_timeline(path, result.events(), {"source": "simulator"})
    obj = json.loads(path.read_text())
    validate_chrome_trace(obj)
    complete = [e for e in obj["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in complete} == {"forward", "backward", "send", "allreduce"}
    assert {e["pid"] for e in complete} == {0, 1, 2, 3}
    assert max(e["ts"] + e["dur"] for e in complete) == pytest.approx(result.makespan_ms * 1000, rel=1e-6)


@pytest.mark.parametrize("suffix, magic", [(".svg", b"<svg"), (".png", b"\x89PNG")])
def test_image_is_written(simulated, tmp_path, suffix, magic) -> None:
    _, _, result = simulated
    path = tmp_path / f"timeline{suffix}"
    write_timeline(path, result.events(), title="test")
    data = path.read_bytes()
    assert len(data) > 5000 and magic in data[:400]


def test_svg_shows_ranks_and_minibatch_ids(simulated) -> None:
    _, _, result = simulated
    svg = draw_timeline(result.events(), "svg").decode()
    for label in ("rank 0 s0r0", "rank 3 s2r0", "forward", "backward", "time (ms)"):
        assert label in svg
    ids = {e.minibatch for e in result.events() if e.category == "forward" and e.end_ms < 30}
    assert ids and all(f">{k}</text>" in svg for k in ids)


def test_many_ranks_are_capped() -> None:
    events = [
        TraceEvent(f"F{r}", "forward", r, 1.0, rank=r, minibatch=r, stage=r % 3, replica=r // 3)
        for r in range(30)
    ]
    svg = draw_timeline(events, "svg", max_rows=6).decode()
    assert "showing 6 ranks, 24 more not drawn" in svg


def test_rejects_unknown_suffix_and_empty(tmp_path) -> None:
    with pytest.raises(InputError, match=r"unknown suffix '\.txt'"):
        write_timeline(tmp_path / "t.txt", [TraceEvent("F0", "forward", 0, 1, 0)])
    with pytest.raises(InputError, match="no events"):
        write_timeline(tmp_path / "t.svg", [])


@pytest.mark.slow
def test_simulate_cli_table_and_timelines(simulated, tmp_path) -> None:
    plan, profile, result = simulated
    plan.save(tmp_path / "plan.json")
    profile.save(tmp_path / "profile.json")
    runner = CliRunner()
    args = ["simulate", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json")]
    out = runner.invoke(cli, args + ["--timeline", str(tmp_path / "t.json")], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert f"{result.time_per_minibatch_ms:.3f} ms/minibatch" in out.output
    assert "bubble" in out.output and "memory" in out.output
    validate_chrome_trace(json.loads((tmp_path / "t.json").read_text()))
    out = runner.invoke(
        cli,
        args + ["-s", "1f1b-rr", "-s", "gpipe", "-m", "4", "--timeline", str(tmp_path / "t.png")],
        catch_exceptions=False,
    )
    assert out.exit_code == 0, out.output
    assert "gpipe, 4 micro-batches" in out.output
    assert (tmp_path / "t-1f1b-rr.png").stat().st_size > 0
    assert (tmp_path / "t-gpipe.png").stat().st_size > 0


def test_simulate_cli_errors_are_one_line(tmp_path) -> None:
    runner = CliRunner()
    out = runner.invoke(cli, ["simulate", str(tmp_path / "missing.json")])
    assert out.exit_code == 2
    assert out.output.strip().startswith("error: cannot read") and "Traceback" not in out.output
