"""bench/bench_exchange.py's fit: the per-message latency at which the simulator predicts a
measured time (no processes launched)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_simulate import make_plan, make_profile, make_topology

from pipeplan.planner.simulate import simulate_plan

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_exchange import fitted_latency_ms, with_latency  # noqa: E402


@pytest.mark.parametrize("latency_ms", [0.01, 0.3, 2.5])
def test_the_fitted_latency_reproduces_the_time_it_was_fitted_to(latency_ms: float) -> None:
    profile = make_profile([0.1] * 4, output_bytes=64)
    plan = make_plan(profile, make_topology(latency_ms=0.0), [0, 2, 4], [1, 1], "1f1b-flush", 4)
    measured = simulate_plan(with_latency(plan, latency_ms), profile).time_per_minibatch_ms
    assert measured > simulate_plan(plan, profile).time_per_minibatch_ms  # latency is on the path
    assert fitted_latency_ms(plan, profile, measured) == pytest.approx(latency_ms, abs=1e-3)


def test_no_latency_fits_a_time_the_plan_beats_without_any() -> None:
    profile = make_profile([0.1] * 4)
    plan = make_plan(profile, make_topology(), [0, 2, 4], [1, 1], "1f1b-flush", 4)
    assert fitted_latency_ms(plan, profile, 0.5 * simulate_plan(plan, profile).time_per_minibatch_ms) == 0.0
