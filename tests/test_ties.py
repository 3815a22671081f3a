"""planner/ties.py: a parameter tied across stages adds its gradient all-reduce to their steps."""

from __future__ import annotations

import dataclasses

import pytest

from pipeplan.errors import InputError
from pipeplan.planner.costs import ring_allreduce_ms
from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.partition import partition
from pipeplan.planner.simulate import durations, simulate_plan, stage_costs
from pipeplan.planner.ties import tie_allreduce_ms, tied_parameters
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.topology import DeviceSpec, Level, Topology

EMBEDDING = 4000  # bytes of the tied weight (its recorded size)


def _tied(shared: dict[str, int] | None = None) -> Profile:
    """4 layers: an embedding and a head sharing ``emb.weight`` (the head also has a bias)."""
    names = [("emb.weight",), ("h1.weight",), ("h2.weight",), ("emb.weight", "head.bias")]
    params = [EMBEDDING, 400, 400, EMBEDDING + 40]
    layers = tuple(
        LayerProfile(
            i, f"l{i}", "x", (i - 1,) if i else (), 1.0, 2.0, 64, params[i], 100, parameters=names[i]
        )
        for i in range(4)
    )
    return Profile(
        "m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers, shared_parameter_bytes=shared or {}
    )


def _topology(devices: int, kind: str = "cpu", overhead_ms: float = 0.0) -> Topology:
    return Topology("t", DeviceSpec("d", 10**9, kind), (Level("n", devices, 1e9, 0.05, overhead_ms),))


def _plan(profile: Profile, devices: int, microbatches: int = 1, kind: str = "cpu", overhead_ms: float = 0.0):
    options = PartitionOptions(schedule="1f1b-flush", microbatches=microbatches, straight=True)
    return partition(profile, _topology(devices, kind, overhead_ms), options)


def test_tied_parameters_are_those_several_layers_use() -> None:
    assert tied_parameters(_tied()) == {"emb.weight": (0, 3)}


# (device kind, message overhead ms) -> the pair's sum, ms: on gloo ("cpu") the two ranks
# swap the tensor (4000 B / 1 GB/s and one message: 0.05 ms latency + the overhead); on
# NCCL a ring of 2 steps, 2 * 1/2 * 4000 B / 1 GB/s and two messages
PAIR_SUM_MS = {
    ("cpu", 0.0): 0.004 + 0.05,
    ("cpu", 0.2): 0.004 + 0.05 + 0.2,
    ("cuda", 0.0): 0.004 + 2 * 0.05,
    ("cuda", 0.2): 0.004 + 2 * (0.05 + 0.2),
}


@pytest.mark.parametrize(("kind", "overhead_ms"), list(PAIR_SUM_MS))
def test_stages_sharing_a_weight_pay_its_sum_at_each_step(kind: str, overhead_ms: float) -> None:
    profile = _tied({"emb.weight": EMBEDDING})
    plan = _plan(profile, 2, kind=kind, overhead_ms=overhead_ms)
    assert [stage.layers for stage in plan.stages] == [(0, 1), (2, 3)]
    expected = PAIR_SUM_MS[(kind, overhead_ms)]
    if kind == "cuda":
        assert expected == pytest.approx(ring_allreduce_ms(EMBEDDING, 2, 1e9, 0.05 + overhead_ms))
    assert tie_allreduce_ms(plan, profile) == [pytest.approx(expected)] * 2
    costs = stage_costs(plan, profile)
    assert durations(plan, costs, 1).allreduce_ms == (pytest.approx(expected), pytest.approx(expected))
    untied = [dataclasses.replace(c, tie_allreduce_ms=0.0) for c in costs]
    assert durations(plan, untied, 1).allreduce_ms == (0.0, 0.0)
    # 1F1B-flush, one micro-batch: stage 0's step ends the minibatch, so the period grows by it
    from pipeplan.planner.simulate import simulate

    with_tie = simulate(plan, costs).time_per_minibatch_ms
    assert with_tie - simulate(plan, untied).time_per_minibatch_ms == pytest.approx(expected)
    assert simulate_plan(plan, profile).time_per_minibatch_ms == pytest.approx(with_tie)


def test_a_tie_inside_one_stage_costs_nothing_and_unrecorded_bytes_take_the_smallest_user() -> None:
    assert tie_allreduce_ms(_plan(_tied(), 1), _tied()) == [0.0]
    profile = _tied()  # no shared_parameter_bytes (an older profile)
    plan = _plan(profile, 2)
    assert tie_allreduce_ms(plan, profile) == [pytest.approx(PAIR_SUM_MS[("cpu", 0.0)])] * 2


def test_shared_parameter_bytes_round_trip_and_are_checked(tmp_path) -> None:
    profile = _tied({"emb.weight": EMBEDDING})
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").shared_parameter_bytes == {"emb.weight": EMBEDDING}
    with pytest.raises(InputError, match=r"shared_parameter_bytes\['emb.weight'\] = -1 is outside"):
        _tied({"emb.weight": -1})
    with pytest.raises(InputError, match="must be an object"):
        dataclasses.replace(profile, shared_parameter_bytes=[1])  # type: ignore[arg-type]
