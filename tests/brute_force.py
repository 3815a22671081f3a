"""The DP against the brute force: the check the planner's property tests share."""

import math

import pytest

from pipeplan.errors import InfeasibleError
from pipeplan.plan import Plan
from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.partition import partition
from pipeplan.profile import Profile
from pipeplan.topology import Topology


def plan_at_brute_force_optimum(
    best: float, profile: Profile, topology: Topology, options: PartitionOptions
) -> Plan | None:
    """``partition``'s plan, asserted to reach ``best`` (``exhaustive_best``'s stage bound,
    to 1e-9); None where the DP finds no plan, asserted only where brute force finds none."""
    try:
        plan = partition(profile, topology, options)
    except InfeasibleError:
        assert best == math.inf
        return None
    assert plan.predicted.stage_bound_ms == pytest.approx(best, rel=1e-9)
    return plan
