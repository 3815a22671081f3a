import pytest

from pipeplan.errors import InputError
from pipeplan.schedules import weight_versions
from pipeplan.planner.memory import in_flight_after, plan_stage_memory, stage_memory_bytes


def test_in_flight_matches_schedule():
    for replicas in ([1, 1, 1, 1], [2, 1, 1], [3, 2, 4], [1, 5]):
        for stage in range(len(replicas)):
            after = sum(replicas[stage:])
            assert in_flight_after(after, replicas[stage]) == weight_versions("1f1b-rr", replicas, stage)


def test_memory_formula():
    # adam: weights x versions + gradient + 2 states; activations x in flight
    assert stage_memory_bytes(100, 10, 3, 3, "adam") == 100 * 6 + 30
    memory, versions, in_flight = plan_stage_memory("1f1b-rr", [1, 1, 1], 0, 100, 10, "momentum")
    assert (memory, versions, in_flight) == (100 * 5 + 30, 3, 3.0)
    memory, versions, in_flight = plan_stage_memory("gpipe", [1, 1, 1], 0, 100, 10, "sgd", microbatches=4)
    assert (memory, versions, in_flight) == (200 + 10, 1, 1.0)
    with pytest.raises(InputError):
        stage_memory_bytes(1, 1, 1, 1, "lion")
