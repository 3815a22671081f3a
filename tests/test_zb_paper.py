"""pipeplan's simulator on the Zero Bubble paper's GPT settings (``bench/zb_paper.py``):
its closed forms without communication, the paper's own 1F1B and ZB-H1 rates with it."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from bench_schedules import LINK_BYTES_PER_S, plan_schedule  # noqa: E402
from zb_paper import ROWS, PaperRow, bubble_rate, paper_profile  # noqa: E402

from pipeplan.planner.simulate import simulate_plan  # noqa: E402


def _period_ms(row: PaperRow, name: str, comm: bool) -> float:
    profile = paper_profile(row, LINK_BYTES_PER_S if comm else None)
    plan = plan_schedule(profile, row.p, name, microbatches=row.m)
    assert not isinstance(plan, str), plan
    return simulate_plan(plan, profile).time_per_minibatch_ms


def test_closed_forms_without_communication() -> None:
    """1.5B, p = 8, m = 24: 1F1B idles (p-1)(T_F+T_B+T_W), ZB-H1 (p-1)(T_F+T_B-T_W), the
    forms the authors' script asserts."""
    row = ROWS[0]
    f, b, w = row.forward_ms, row.input_grad_ms, row.weight_grad_ms
    idle_1f1b = (row.p - 1) * (f + b + w)
    idle_h1 = (row.p - 1) * (f + b - w)
    assert _period_ms(row, "1f1b-flush", False) == pytest.approx(row.ideal_ms + idle_1f1b, rel=1e-9)
    assert _period_ms(row, "zb-h1", False) == pytest.approx(row.ideal_ms + idle_h1, rel=1e-9)
    assert bubble_rate(row, row.ideal_ms + idle_1f1b) == pytest.approx(7 / 31)  # (p-1)/(m+p-1)


def test_zb_h1_idles_a_third_of_1f1b_at_equal_times() -> None:
    row = replace(ROWS[0], forward_ms=1.0, input_grad_ms=1.0, weight_grad_ms=1.0)
    idle_1f1b = _period_ms(row, "1f1b-flush", False) - row.ideal_ms
    idle_h1 = _period_ms(row, "zb-h1", False) - row.ideal_ms
    assert idle_1f1b == pytest.approx((row.p - 1) * 3.0)
    assert idle_h1 == pytest.approx(idle_1f1b / 3)


@pytest.mark.parametrize("index", [0, 6])  # 1.5B p=8 m=24; 14.6B p=16 m=48
def test_paper_rates_with_communication(index: int) -> None:
    """With T_comm as a send, pipeplan's 1F1B and ZB-H1 give the paper's rates (4 decimals)."""
    row = ROWS[index]
    assert bubble_rate(row, _period_ms(row, "1f1b-flush", True)) == pytest.approx(row.rate_1f1b, abs=5e-5)
    assert bubble_rate(row, _period_ms(row, "zb-h1", True)) == pytest.approx(row.rate_zb_h1, abs=5e-5)
