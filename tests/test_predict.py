"""Honest predictions: every plan predicts its own schedule's simulated period, bubble
included; the bubble laws of flush and interleaved 1F1B; re-prediction for another
schedule; ``partition --schedule auto``; the engine's unit clock is the grid's."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner
from test_simulate import make_profile, make_topology

from pipeplan.cli import cli
from pipeplan.errors import InfeasibleError
from pipeplan.planner.auto import search
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.predict import predict
from pipeplan.planner.simulate import simulate_plan, stage_costs_from_plan
from pipeplan.schedules import SCHEDULE_KINDS, SCHEDULE_NAMES
from pipeplan.topology import Topology

# 16 equal layers (1 ms forward, 2 ms backward), nothing sent, no parameters: free
# communication and equal stages, so the period is the ideal time plus the bubble
EQUAL = make_profile([1.0] * 16)
IDEAL_MS = 16 * 3.0 / 4  # on 4 devices


def straight4(memory_bytes: int = 16 * 2**30) -> Topology:
    return make_topology(per_server=4, servers=1, memory_bytes=memory_bytes)


@pytest.mark.parametrize("virtual, micro", [(2, 4), (2, 8), (4, 4)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(virtual: int, micro: int) -> None:
    options = PartitionOptions(
        schedule="interleaved-1f1b", microbatches=micro, virtual_stages=virtual, straight=True
    )
    plan = partition(EQUAL, straight4(), options)
    assert plan.virtual_stages == virtual and len(plan.stages) == 4 * virtual
    assert [s.ranks for s in plan.stages] == [(q % 4,) for q in range(4 * virtual)]
    period = simulate_plan(plan, EQUAL).time_per_minibatch_ms
    assert period == pytest.approx(IDEAL_MS * (1 + 3 / (virtual * micro)), rel=1e-9)
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(period, rel=1e-9)


@pytest.mark.parametrize("micro", [2, 4, 8])
def test_flush_bubble_is_p_minus_1_over_m(micro: int) -> None:
    plan = partition(
        EQUAL, straight4(), PartitionOptions(schedule="1f1b-flush", straight=True, microbatches=micro)
    )
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(IDEAL_MS * (1 + 3 / micro), rel=1e-9)
    assert plan.predicted.stage_bound_ms == pytest.approx(IDEAL_MS)  # the DP's bound has no bubble


def _shape(name: str) -> dict:
    kind = SCHEDULE_KINDS[name]
    if kind.whole_minibatches:
        return {}
    micro = max(4, kind.least_microbatches_per_device * 4)  # 4 devices; DualPipeV needs 2 per device
    return {"microbatches": micro, **({"virtual_stages": 2} if kind.virtual_stages else {})}


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_plan_predicts_its_own_simulation(name: str) -> None:
    """Uneven layers, activations sent over a slow link between two servers, parameters
    all-reduced by replicas: the plan's figures are the simulator's (within 1 %)."""
    profile = make_profile(
        [1.0, 3.0, 2.0, 0.5, 2.5, 1.5, 1.0, 2.0],
        output_bytes=2_000_000,
        param_bytes=500_000,
        saved_bytes=100_000,
    )
    topology = make_topology(per_server=2, servers=2, inside_bytes_per_s=10e9, between_bytes_per_s=1e9)
    plan = partition(profile, topology, PartitionOptions(schedule=name, **_shape(name)))
    assert plan.schedule == name and plan.predicted.simulated
    result = simulate_plan(plan, profile)
    assert plan.predicted.time_per_minibatch_ms == pytest.approx(result.time_per_minibatch_ms, rel=0.01)
    assert plan.predicted.samples_per_s == pytest.approx(result.samples_per_s, rel=0.01)
    for stage, sim in zip(plan.stages, result.stages):
        assert stage.time_per_minibatch_ms == pytest.approx(sim.busy_ms, rel=0.01, abs=1e-9)
        # the registry's count bounds the simulated action order's (gpipe charges a replica
        # the whole minibatch although it holds only its own micro-batches)
        assert stage.memory_bytes >= sim.memory_bytes
        if stage.replicas == 1:
            assert stage.memory_bytes == sim.memory_bytes


def test_flush_plan_no_longer_predicts_the_1f1b_rr_figure() -> None:
    """Issue 12's resnet18 case in small: 2 stages, 2 micro-batches. 1F1B-RR's period is
    the slowest stage (6 ms); 1F1B-flush adds the bubble: (12 + 3) / 2 ... simulated."""
    profile = make_profile([1.0] * 4)
    topology = make_topology(per_server=2, servers=1)
    rr = partition(profile, topology, PartitionOptions(straight=True))
    flush = partition(
        profile, topology, PartitionOptions(schedule="1f1b-flush", straight=True, microbatches=2)
    )
    assert rr.predicted.time_per_minibatch_ms == pytest.approx(6.0)
    # per micro-batch F 1 ms, B 2 ms per stage: F F | B F B | B ... = 9 ms per minibatch
    assert flush.predicted.time_per_minibatch_ms == pytest.approx(9.0)
    assert flush.predicted.time_per_minibatch_ms == pytest.approx(
        simulate_plan(flush, profile).time_per_minibatch_ms, rel=1e-9
    )


def test_repredict_for_another_schedule_from_the_plan_alone() -> None:
    profile = make_profile([1.0] * 4)
    rr = partition(profile, make_topology(per_server=2, servers=1), PartitionOptions(straight=True))
    again = predict(rr, schedule="1f1b-flush", microbatches=2)
    assert (again.schedule, again.microbatches) == ("1f1b-flush", 2)
    expected = simulate_plan(rr, None, "1f1b-flush", 2).time_per_minibatch_ms
    assert again.predicted.time_per_minibatch_ms == pytest.approx(expected, rel=1e-12)
    assert again.predicted.time_per_minibatch_ms == pytest.approx(9.0, rel=1e-9)
    assert len(stage_costs_from_plan(rr)) == 2


def test_auto_chooses_the_fastest_that_fits() -> None:
    heavy = make_profile([1.0] * 8, saved_bytes=1 << 30)
    found = search(
        heavy, make_topology(per_server=2, servers=1, memory_bytes=5 << 30), PartitionOptions(straight=True)
    )
    names = {c.schedule for c in found.candidates}
    assert names == set(SCHEDULE_NAMES)
    assert {c.virtual_stages for c in found.candidates if c.schedule == "interleaved-1f1b"} == {2, 3, 4}
    fitting = [c for c in found.candidates if c.fits]
    assert found.best.fits and found.best.time_per_minibatch_ms == min(
        c.time_per_minibatch_ms for c in fitting
    )
    rr = next(c for c in found.candidates if c.schedule == "1f1b-rr")
    assert not rr.fits and rr.peak_memory_bytes == 8 << 30  # 2 minibatches x 4 GiB on stage 0
    assert found.plan.schedule == found.best.schedule
    assert found.plan.microbatches == found.best.microbatches


def test_auto_infeasible_names_the_smallest_memory_that_fits() -> None:
    heavy = make_profile([1.0] * 8, saved_bytes=1 << 30)
    with pytest.raises(InfeasibleError) as caught:
        # 8 micro-batches (with the batch of 32 split further, 1f1b-flush would fit: 2/32 of 4 GiB)
        search(
            heavy,
            make_topology(per_server=2, servers=1, memory_bytes=1 << 29),
            PartitionOptions(straight=True, microbatches=8, recompute="none"),
        )
    message = str(caught.value)
    assert "\n" not in message and "the smallest that would fit is" in message
    # 1f1b-flush / zb-h1 with 8 micro-batches keep min(8, 2)/8 of 4 GiB = 1 GiB on stage 0
    assert "1.00 GiB per device" in message


def test_partition_auto_cli_prints_candidates(tmp_path) -> None:
    profile_path = tmp_path / "profile.json"
    make_profile([1.0] * 8, param_bytes=1000, saved_bytes=1000).save(profile_path)
    topology = tmp_path / "t.yaml"
    topology.write_text(
        "name: t\ndevice: {name: a, memory: 16 GiB}\nlevels:\n  - {name: s, count: 4, bandwidth: 100 GB/s}\n"
    )
    out = tmp_path / "plan.json"
    command = ["partition", str(profile_path), "--topology", str(topology), "--straight"]
    command += ["--microbatches", "4", "--schedule", "auto", "-o", str(out)]
    result = CliRunner().invoke(cli, [*command, "--every-candidate"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "│" in line and ("ms" not in line)]
    marked = [line for line in rows if line.split("│")[1].strip() == "*"]
    # 1F1B-RR and 2BW both take 6 ms (no bubble): the tie goes to fewer micro-batches
    # although 2BW holds less on stage 0 (2 layers of 1000 B of parameters and 1000 B
    # saved): 2000 (2 versions + the live weights + 1 gradient) + 2000 x 4 micro-batches of
    # 1/4 + one layer's 1000 B gradient temporary (it accumulates 4 micro-batches; the
    # profile records no largest parameter) = 10.7 KiB against 1F1B-RR's 2000 (4 + 1 + 1)
    # + 2000 x 4 minibatches = 19.5 KiB
    assert len(marked) == 1 and " 1f1b-rr " in marked[0] and " 6.000 " in marked[0]
    two = next(line for line in rows if " 2bw " in line)
    assert " 6.000 " in two and " 10.7 KiB " in two and " 19.5 KiB " in marked[0]
    for text in (" 1f1b-flush ", " 10.500 ", " interleaved-1f1b ", " 8.250 ", " zb-h1 ", " 7.500 "):
        assert text in result.output
    assert "* chosen: 1f1b-rr, 1 micro-batches, v=1" in result.output and "pruned" not in result.output
    # by default the candidates planned after a faster one (most micro-batches first) that
    # provably cannot beat it are pruned: the same choice, "pruned" rows without figures
    default = CliRunner().invoke(cli, command, env={"COLUMNS": "200"})
    assert default.exit_code == 0, default.output
    assert "* chosen: 1f1b-rr, 1 micro-batches, v=1" in default.output
    pruned = [line for line in default.output.splitlines() if "│" in line and " pruned " in line]
    assert pruned and all(" - " in line for line in pruned)
    assert "candidate(s) proven slower than a fitting plan" in default.output


def test_auto_without_misfit_memory_chooses_the_same_and_lifts_the_count_cap() -> None:
    """``misfit_memory=False`` plans no candidate twice: the same choice, candidates that
    do not fit listed without a figure; micro-batch counts reach the batch (32 here,
    above the old cap of 4 per device) and win when they cut the bubble."""
    heavy = make_profile([1.0] * 8, saved_bytes=1 << 30)
    topology = make_topology(
        per_server=2, servers=1, memory_bytes=3 << 30
    )  # gpipe's 4 GiB per stage does not fit (without recomputation)
    options = PartitionOptions(straight=True, recompute="none")
    full = search(heavy, topology, options, schedules=("1f1b-flush", "gpipe"))
    quick = search(heavy, topology, options, schedules=("1f1b-flush", "gpipe"), misfit_memory=False)
    assert quick.best == full.best and quick.plan == full.plan
    assert {c.schedule for c in quick.candidates} == {"1f1b-flush", "gpipe"}
    assert max(c.microbatches for c in quick.candidates) == 32 and full.best.microbatches == 32
    assert any(not c.fits and c.peak_memory_bytes for c in full.candidates)
    for a, b in zip(quick.candidates, full.candidates):
        assert a.fits == b.fits
        assert (a.peak_memory_bytes, a.time_per_minibatch_ms) == (
            (b.peak_memory_bytes, b.time_per_minibatch_ms) if b.fits else (0, math.inf)
        )
    with pytest.raises(InfeasibleError, match="the smallest that would fit is"):
        search(
            heavy, make_topology(per_server=2, servers=1, memory_bytes=1 << 26), options, misfit_memory=False
        )


@pytest.mark.parametrize("misfit_memory", [False, True])
def test_search_prunes_only_candidates_slower_than_its_choice(misfit_memory: bool) -> None:
    """Candidates whose bound is above a plan already found are pruned (not planned further):
    the search chooses the same plan as when every candidate is planned, and each pruned one
    planned in full is slower than that choice or does not fit; with ``misfit_memory`` one
    that does not fit is pruned only when its plan without the memory check is slower too."""
    from pipeplan.planner import auto
    from pipeplan.profiler.estimate import DEVICE_RATES, GPTShape, estimate_gpt
    from pipeplan.topology import DeviceSpec, Level

    profile = estimate_gpt(GPTShape(16, 2048, 16), DEVICE_RATES["a100-80gb"], 256)
    # 8 GiB per GPU: 1F1B-RR and some slower candidates do not fit
    topology = Topology(
        "t", DeviceSpec("A100", 8 * 2**30), (Level("node", 8, 300e9, 0.002), Level("c", 4, 200e9, 0.005))
    )
    options = PartitionOptions(optimizer="adam")
    schedules = ("1f1b-flush", "gpipe", "interleaved-1f1b", "1f1b-rr")
    pruned = search(profile, topology, options, schedules, misfit_memory=misfit_memory)
    every = search(profile, topology, options, schedules, misfit_memory=misfit_memory, every_candidate=True)
    assert (pruned.chosen, pruned.plan) == (every.chosen, every.plan)
    skipped = [i for i, c in enumerate(pruned.candidates) if c.pruned]
    assert skipped and not any(c.pruned for c in every.candidates)
    unfit = [c for c in pruned.candidates if c.note.startswith("does not fit")]
    assert bool(unfit) == misfit_memory  # without it, one that does not fit is never planned twice
    best = every.best.time_per_minibatch_ms
    for i, (a, b) in enumerate(zip(pruned.candidates, every.candidates)):
        if i not in skipped:
            assert a == b
        elif a.note.startswith("does not fit"):
            assert misfit_memory and not b.fits and b.time_per_minibatch_ms > best * (1 + auto.TIE_REL)
        else:
            assert a.note.startswith("slower than ") and not a.fits
            assert not b.fits or b.time_per_minibatch_ms > best * (1 + auto.TIE_REL)
