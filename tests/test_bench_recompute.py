"""The memory limit of bench/bench_recompute.py: the least memory each ``--recompute`` mode
plans at is tight (one resolution less plans nothing), and the limit between ``auto``'s and
``none``'s makes ``none`` refuse while ``auto`` recomputes; on
tests/fixtures/runtime/recompute_blocks.profile.json (no processes launched)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from pipeplan.errors import InfeasibleError
from pipeplan.planner.options import PartitionOptions
from pipeplan.profile import Profile
from pipeplan.topology import preset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_recompute import MiB, auto_against_none, least_memory, memory_limit, plan_or_none  # noqa: E402

PROFILE = Profile.load(ROOT / "tests" / "fixtures" / "runtime" / "recompute_blocks.profile.json")
BASE = PartitionOptions(schedule="1f1b-flush", microbatches=2, straight=True)
OPTIONS = {mode: dataclasses.replace(BASE, recompute=mode) for mode in ("none", "auto")}


def test_the_limit_lies_between_the_least_memories_so_only_recomputation_fits() -> None:
    topology = preset("local-cpu")
    least = {mode: least_memory(PROFILE, topology, options) for mode, options in OPTIONS.items()}
    for mode, options in OPTIONS.items():  # tight to the resolution
        assert plan_or_none(PROFILE, topology, options, least[mode]) is not None
        assert plan_or_none(PROFILE, topology, options, least[mode] - MiB) is None
    assert least["auto"] < least["none"]
    limit = memory_limit(least)
    assert limit == (least["auto"] + least["none"]) // 2
    assert plan_or_none(PROFILE, topology, OPTIONS["none"], limit) is None
    plan = plan_or_none(PROFILE, topology, OPTIONS["auto"], limit)
    assert plan is not None and any(stage.recompute_layers for stage in plan.stages)
    checks = auto_against_none(PROFILE, topology, OPTIONS, (limit, least["none"]))
    assert checks[0]["none_ms"] is None and checks[0]["auto_ms"] == plan.predicted.time_per_minibatch_ms
    assert checks[1]["auto_ms"] <= checks[1]["none_ms"]


def test_no_limit_when_recomputation_frees_nothing() -> None:
    with pytest.raises(InfeasibleError, match=r"auto needs 64.0 MiB, none 64.0 MiB"):
        memory_limit({"auto": 64 * MiB, "none": 64 * MiB})
