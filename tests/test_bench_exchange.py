"""bench/bench_exchange.py's fit: the message overhead at which the simulator predicts a
measured time (no processes launched)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_simulate import make_plan, make_profile, make_topology

from pipeplan.planner.simulate import simulate_plan

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_exchange import fitted_overhead_ms, with_overhead  # noqa: E402


@pytest.mark.parametrize("overhead_ms", [0.01, 0.3, 2.5])
def test_the_fitted_overhead_reproduces_the_time_it_was_fitted_to(overhead_ms: float) -> None:
    profile = make_profile([0.1] * 4, output_bytes=64)
    plan = make_plan(profile, make_topology(), [0, 2, 4], [1, 1], "1f1b-flush", 4)
    measured = simulate_plan(with_overhead(plan, overhead_ms), profile).time_per_minibatch_ms
    # each of the minibatch's 2 M = 8 messages adds the overhead to the period
    assert measured - simulate_plan(plan, profile).time_per_minibatch_ms == pytest.approx(
        8 * overhead_ms, abs=1e-5
    )
    assert fitted_overhead_ms(plan, profile, measured) == pytest.approx(overhead_ms, abs=1e-3)


def test_no_overhead_fits_a_time_the_plan_beats_without_any() -> None:
    profile = make_profile([0.1] * 4)
    plan = make_plan(profile, make_topology(), [0, 2, 4], [1, 1], "1f1b-flush", 4)
    assert fitted_overhead_ms(plan, profile, 0.5 * simulate_plan(plan, profile).time_per_minibatch_ms) == 0.0
