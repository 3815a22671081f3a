"""Run the whole suite in lanes: the fast tests first, then the slow ones, then those that run alone.

    python tests/lanes.py            # every lane (the README's test command, which CI runs)
    python tests/lanes.py fast       # one lane: fast, slow or serial
    python tests/lanes.py fast -x    # the arguments after the lane names go to each lane's pytest

The markers split the suite into three disjoint lanes that together hold every test
(``tests/test_lanes.py`` checks it):

- ``fast``: no ``slow``, ``multiprocess`` or ``timing`` marker; 2 pytest-xdist workers.
- ``slow``: ``slow`` (whole models, Hugging Face families), neither of the others; 2 workers.
- ``serial``: ``multiprocess`` (the test launches processes: torchrun and gloo ranks, a
  subprocess) or ``timing`` (it compares measured times): one test at a time in one pytest, so
  that ranks have the machine's cores to themselves and do not run into their timeouts, and
  timings are not taken beside another test (``tests/spawn_guard.py`` makes every launching
  test carry ``multiprocess``).

Every lane runs, even after a lane failed, so one run reports every failure; the exit status is
0 when every lane passed and 1 otherwise. pytest's exit status 5 (the lane selected no test) is
said in the summary and is not a failure: a marker expression may well select nothing in a
filtered run (``-k``). Each lane's wall time is printed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LANES", "Lane", "main"]

NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED, without importing pytest here


@dataclass(frozen=True)
class Lane:
    """One pytest run over the tests that ``marker_expression`` selects (``-m``)."""

    name: str
    marker_expression: str
    xdist_workers: int  # 0: no worker, the tests run one at a time in the pytest process

    def pytest_args(self) -> list[str]:
        workers = ["-n", str(self.xdist_workers)] if self.xdist_workers else []
        return ["-q", "-m", self.marker_expression, *workers]


LANES = (
    Lane("fast", "not slow and not multiprocess and not timing", xdist_workers=2),
    Lane("slow", "slow and not multiprocess and not timing", xdist_workers=2),
    Lane("serial", "multiprocess or timing", xdist_workers=0),
)


OUTCOME = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b")


def outcome_counts(summary: str) -> Counter[str]:
    """The counts of pytest's closing line ("3 failed, 10 passed, 1 skipped in 2.0s").

    >>> dict(outcome_counts("== 3 failed, 10 passed, 1 skipped, 2 errors in 2.01s =="))
    {'failed': 3, 'passed': 10, 'skipped': 1, 'error': 2}
    """
    counts: Counter[str] = Counter()
    for number, outcome in OUTCOME.findall(summary):
        counts["error" if outcome.startswith("error") else outcome] += int(number)
    return counts


def _run(lane: Lane, extra: list[str], root: Path) -> tuple[int, float, Counter[str]]:
    """The lane's pytest exit status, wall time (in seconds) and outcome counts."""
    command = [sys.executable, "-m", "pytest", *lane.pytest_args(), *extra]
    print(f"== lane {lane.name}: {' '.join(command[1:])}", flush=True)
    start = time.monotonic()
    closing = ""
    with subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, text=True, bufsize=1) as pytest:
        assert pytest.stdout is not None
        for line in pytest.stdout:
            sys.stdout.write(line)
            if OUTCOME.search(line) and " in " in line:
                closing = line  # pytest's closing line; the last one wins
    return pytest.returncode, time.monotonic() - start, outcome_counts(closing)


def _verdict(status: int) -> str:
    if status == 0:
        return "passed"
    if status == NO_TESTS_COLLECTED:
        return "selected no test"
    return f"FAILED (pytest exit status {status})"


def main(argv: list[str]) -> int:
    names = {lane.name for lane in LANES}
    first_extra = next((i for i, arg in enumerate(argv) if arg not in names), len(argv))
    chosen, extra = argv[:first_extra], argv[first_extra:]
    lanes = [lane for lane in LANES if not chosen or lane.name in chosen]
    root = Path(__file__).resolve().parent.parent
    results = [(lane, *_run(lane, extra, root)) for lane in lanes]
    print("== lanes:", flush=True)
    total: Counter[str] = Counter()
    for lane, status, wall_s, counts in results:
        print(f"   {lane.name:<13} {wall_s:7.1f} s  {_verdict(status)}")
        total += counts
    print(f"   {'total':<13} {sum(result[2] for result in results):7.1f} s")
    failed = total["failed"] + total["error"]
    # One plain closing line over every lane, as CI reads it.
    print(f"lanes: {total['passed']} passed, {failed} failed, {total['skipped']} skipped", flush=True)
    return 0 if all(status in (0, NO_TESTS_COLLECTED) for _, status, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
