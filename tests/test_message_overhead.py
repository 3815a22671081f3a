"""planner/message_overhead.py: the message overhead at which the simulator predicts a
measured time (what ``pipeplan calibrate`` writes; no processes launched here)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_simulate import make_plan, make_profile, make_topology

from pipeplan.errors import InputError
from pipeplan.plan import Plan
from pipeplan.planner.message_overhead import fitted_message_overhead_ms, with_message_overhead
from pipeplan.planner.simulate import simulate_plan
from pipeplan.profile import Profile
from pipeplan.topology import Level


def _plan(microbatches: int = 4) -> tuple[Plan, Profile]:
    profile = make_profile([0.1] * 4, output_bytes=64)
    return make_plan(profile, make_topology(), [0, 2, 4], [1, 1], "1f1b-flush", microbatches), profile


def _with(plan: Plan, overhead_ms: float) -> Plan:
    return replace(plan, topology=with_message_overhead(plan.topology, overhead_ms))


@pytest.mark.parametrize("microbatches", [1, 4])
@pytest.mark.parametrize("overhead_ms", [0.01, 0.3, 2.5])
def test_the_fitted_overhead_reproduces_the_time_it_was_fitted_to(
    overhead_ms: float, microbatches: int
) -> None:
    plan, profile = _plan(microbatches)
    measured = simulate_plan(_with(plan, overhead_ms), profile).time_per_minibatch_ms
    # each of the minibatch's 2 M messages adds the overhead to the period
    assert measured - simulate_plan(plan, profile).time_per_minibatch_ms == pytest.approx(
        2 * microbatches * overhead_ms, abs=1e-5
    )
    assert fitted_message_overhead_ms(plan, profile, measured) == pytest.approx(overhead_ms, abs=1e-3)


def test_the_fit_ignores_the_overhead_the_plan_was_made_with() -> None:
    plan, profile = _plan()
    measured = simulate_plan(_with(plan, 0.3), profile).time_per_minibatch_ms
    assert fitted_message_overhead_ms(_with(plan, 5.0), profile, measured) == pytest.approx(0.3, abs=1e-3)


def test_no_overhead_fits_a_time_the_plan_beats_without_any() -> None:
    plan, profile = _plan()
    assert (
        fitted_message_overhead_ms(plan, profile, 0.5 * simulate_plan(plan, profile).time_per_minibatch_ms)
        == 0.0
    )


@pytest.mark.parametrize("measured_ms", [0.0, -1.0, float("nan")])
def test_a_time_that_is_not_positive_is_refused(measured_ms: float) -> None:
    plan, profile = _plan()
    with pytest.raises(InputError, match="must be positive"):
        fitted_message_overhead_ms(plan, profile, measured_ms)


def test_a_time_no_overhead_explains_is_refused_not_looped_on() -> None:
    plan, profile = _plan()
    with pytest.raises(InputError, match="no message overhead up to 10000 ms explains"):
        fitted_message_overhead_ms(plan, profile, 1e9)


def test_with_message_overhead_sets_one_level_only() -> None:
    topology = replace(make_topology(), levels=(Level("host", 2, 1e9, 0.01, 0.2), Level("rack", 2, 1e8, 0.5)))
    changed = with_message_overhead(topology, 0.7, level=1)
    assert [level.message_overhead_ms for level in changed.levels] == [0.2, 0.7]
    assert changed.levels[0] == topology.levels[0] and changed.levels[1].latency_ms == 0.5
    with pytest.raises(InputError, match="has no level 2"):
        with_message_overhead(topology, 0.7, level=2)
