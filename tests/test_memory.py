import math

import pytest

from pipeplan.errors import InputError
from pipeplan.planner.memory import in_flight_after, plan_stage_memory, stage_memory_bytes
from pipeplan.schedules import weight_versions


def test_in_flight_matches_schedule():
    for replicas in ([1, 1, 1, 1], [2, 1, 1], [3, 2, 4], [1, 5]):
        for stage in range(len(replicas)):
            after = sum(replicas[stage:])
            assert in_flight_after(after, replicas[stage]) == weight_versions("1f1b-rr", replicas, stage)


def test_memory_formula():
    # adam: weights x versions (stashed snapshots, plus the live weights where there are
    # several: runtime/stash.py) + gradient + 2 states; activations x in flight
    assert stage_memory_bytes(100, 10, 3, 3, "adam") == 100 * (3 + 1 + 1 + 2) + 30
    assert stage_memory_bytes(100, 10, 1, 3, "adam") == 100 * (1 + 1 + 2) + 30  # the live weights alone
    memory, versions, in_flight = plan_stage_memory("1f1b-rr", [1, 1, 1], 0, 100, 10, "momentum")
    assert (memory, versions, in_flight) == (100 * (3 + 1 + 1 + 1) + 30, 3, 3.0)
    memory, versions, in_flight = plan_stage_memory("gpipe", [1, 1, 1], 0, 100, 10, "sgd", microbatches=4)
    assert (memory, versions, in_flight) == (200 + 10, 1, 1.0)
    with pytest.raises(InputError):
        stage_memory_bytes(1, 1, 1, 1, "lion")


def test_a_stage_that_accumulates_holds_its_largest_gradient_temporary():
    from pipeplan.planner.memory import gradient_temporary_bytes
    from pipeplan.precision import Precision

    mixed = Precision("bfloat16", "float32")
    # one micro-batch: autograd keeps the new gradient as .grad, no temporary
    assert gradient_temporary_bytes(64, microbatches=1) == 0.0
    # two or more: each later gradient is added into .grad
    assert gradient_temporary_bytes(64, microbatches=3) == 64
    # mixed precision: every backward's bf16 gradient is added into the float32 master's
    assert gradient_temporary_bytes(64, microbatches=1, precision=mixed) == 64
    flush = plan_stage_memory("1f1b-flush", [1, 1], 0, 100, 10, "sgd", microbatches=4, largest_param_bytes=60)
    assert flush == (200 + 10 * 2 / 4 + 60, 1, 0.5)  # 2 of 4 micro-batches in flight: half a minibatch
    single = plan_stage_memory(
        "1f1b-flush", [1, 1], 0, 100, 10, "sgd", microbatches=1, largest_param_bytes=60
    )
    assert single == (200 + 10, 1, 1.0)
    # an interleaved device's temporary is charged once, to its first chunk
    first = plan_stage_memory(
        "interleaved-1f1b", [1, 1], 0, 100, 10, "sgd", 4, 2, chunk=0, largest_param_bytes=60
    )
    second = plan_stage_memory(
        "interleaved-1f1b", [1, 1], 0, 100, 10, "sgd", 4, 2, chunk=1, largest_param_bytes=60
    )
    assert (first[0], second[0]) == (math.ceil(200 + 10 * first[2] + 60), math.ceil(200 + 10 * second[2]))
