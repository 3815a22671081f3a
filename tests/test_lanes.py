"""The test lanes of tests/lanes.py and the guard that keeps process launches in their lane."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import lanes
import pytest
from _pytest.mark.expression import Expression
from spawn_guard import is_process_launch

TESTS = Path(__file__).parent


@pytest.mark.parametrize(
    "markers",
    [
        set(chosen)
        for n in range(5)
        for chosen in itertools.combinations(("slow", "multiprocess", "timing", "gpu"), n)
    ],
)
def test_every_test_runs_in_exactly_one_lane(markers: set[str]) -> None:
    holding = [
        lane.name
        for lane in lanes.LANES
        if Expression.compile(lane.marker_expression).evaluate(lambda name, **_: name in markers)
    ]
    assert len(holding) == 1, (markers, holding)


@pytest.mark.parametrize(
    "statuses, expected", [((0, 0, 0), 0), ((0, 5, 0), 0), ((1, 0, 0), 1), ((0, 0, 2), 1)]
)
def test_every_lane_runs_and_any_failure_fails_the_run(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    statuses: tuple[int, ...],
    expected: int,
) -> None:
    ran: list[tuple[str, list[str]]] = []

    def fake_run(lane: lanes.Lane, extra: list[str], root: Path) -> tuple[int, float, Counter[str]]:
        ran.append((lane.name, extra))
        status = statuses[len(ran) - 1]
        return status, 0.0, Counter({"passed": 2, "failed": int(status not in (0, 5))})

    monkeypatch.setattr(lanes, "_run", fake_run)
    assert lanes.main(["-x"]) == expected
    assert ran == [(lane.name, ["-x"]) for lane in lanes.LANES]
    failed = sum(status not in (0, 5) for status in statuses)
    closing = capsys.readouterr().out.splitlines()[-1]
    assert closing == f"lanes: 6 passed, {failed} failed, 0 skipped"  # one line CI reads


def test_a_lanes_closing_line_is_counted() -> None:
    counts = lanes.outcome_counts("=== 1 failed, 598 passed, 1 skipped, 2 errors in 84.93s (0:01:24) ===")
    assert counts == Counter({"passed": 598, "failed": 1, "skipped": 1, "error": 2})


def test_lane_names_come_first_and_the_rest_goes_to_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(
        lanes, "_run", lambda lane, extra, root: (ran.append((lane.name, extra)), (0, 0.0, Counter()))[1]
    )
    assert lanes.main(["slow", "fast", "-k", "fast"]) == 0
    assert ran == [("fast", ["-k", "fast"]), ("slow", ["-k", "fast"])]


def test_python_torchrun_and_pipeplan_are_launches_and_library_helpers_are_not() -> None:
    assert is_process_launch([sys.executable, "-c", "pass"])
    assert is_process_launch(["torchrun", "--nproc-per-node", "2", "train.py"])
    assert is_process_launch("pipeplan demo")
    assert is_process_launch(["/usr/bin/python3.11", "-m", "pipeplan"])
    assert is_process_launch(["anything"], executable=sys.executable)
    assert not is_process_launch(["fc-list", "--format=%{file}"])
    assert not is_process_launch("ldconfig -p")


GUARDED = """
import multiprocessing
import subprocess
import sys

import pytest


def test_unmarked_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_multiprocessing():
    process = multiprocessing.get_context("spawn").Process(target=print)
    process.start()
    process.join()


def test_unmarked_launch_whose_error_is_swallowed():
    try:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    except Exception:
        pass


def test_unmarked_library_helper():
    subprocess.run(["true"], check=True)


@pytest.mark.multiprocess
def test_marked_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


@pytest.mark.multiprocess
def test_an_unmarked_test_that_launches_a_process_fails(tmp_path: Path) -> None:
    (tmp_path / "test_guarded.py").write_text(textwrap.dedent(GUARDED))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "spawn_guard",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rfE",
            "-W",
            "ignore::pytest.PytestUnknownMarkWarning",
            "test_guarded.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    summary = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert result.returncode == 1, result.stdout + result.stderr
    assert sorted(line.split()[0] + " " + line.split()[1].split("::")[1] for line in summary) == [
        "ERROR test_unmarked_launch_whose_error_is_swallowed",
        "FAILED test_unmarked_multiprocessing",
        "FAILED test_unmarked_python",
    ], result.stdout
    assert "2 failed, 3 passed, 1 error" in result.stdout and "not marked multiprocess" in result.stdout, (
        result.stdout
    )


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    root = TESTS.parent
    readme = (root / "README.md").read_text().splitlines()
    commands = [line for line in readme if line.startswith("pip install") and "'.[test]'" in line]
    assert len(commands) == 1, commands
    assert commands[0] in (root / ".ci" / "run").read_text().splitlines()
