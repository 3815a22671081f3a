"""Chrome trace format: write, read back, validate."""

from __future__ import annotations

import json

import pytest

from pipeplan.errors import InputError
from pipeplan.trace import (
    COMM_TID,
    COMPUTE_TID,
    TraceEvent,
    merge_events,
    read_chrome_trace,
    to_chrome_trace,
    validate_chrome_trace,
    write_chrome_trace,
)

EVENTS = [
    TraceEvent("F0", "forward", 0.0, 1.5, rank=0, minibatch=0, stage=0, replica=0),
    TraceEvent("send F0 ->r1", "send", 1.5, 0.25, 0, 0, 0, 0, 0, message_bytes=4096, message_values=3),
    TraceEvent("F0", "forward", 1.75, 2.0, rank=1, minibatch=0, stage=1, replica=0),
    TraceEvent("B0.1", "backward", 4.0, 3.0, rank=1, minibatch=0, microbatch=1, stage=1, replica=0),
    TraceEvent("allreduce S0", "allreduce", 7.0, 0.5, rank=1, minibatch=0, stage=1, replica=0),
]


def test_chrome_trace_fields_and_units(tmp_path) -> None:
    path = tmp_path / "trace.json"
    write_chrome_trace(path, EVENTS, {"source": "test"}, rank_names={0: "first"})
    obj = json.loads(path.read_text())
    validate_chrome_trace(obj)
    complete = [e for e in obj["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(EVENTS)
    for event in complete:
        assert set(event) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
    backward = next(e for e in complete if e["cat"] == "backward")
    assert (backward["ts"], backward["dur"], backward["pid"], backward["tid"]) == (
        4000.0,
        3000.0,
        1,
        COMPUTE_TID,
    )
    assert backward["args"] == {"minibatch": 0, "microbatch": 1, "stage": 1, "replica": 0}
    send = next(e for e in complete if e["cat"] == "send")
    assert send["tid"] == COMM_TID
    assert (send["args"]["bytes"], send["args"]["values"]) == (4096, 3)  # a message's size
    names = {e["pid"]: e["args"]["name"] for e in obj["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "first", 1: "rank 1 (stage 1, replica 0)"}
    assert obj["otherData"] == {"source": "test"} and obj["displayTimeUnit"] == "ms"


def test_round_trip(tmp_path) -> None:
    path = tmp_path / "trace.json"
    write_chrome_trace(path, EVENTS, {"schedule": "1f1b-rr"})
    events, metadata = read_chrome_trace(path)
    assert sorted(events, key=lambda e: (e.start_ms, e.rank)) == merge_events(EVENTS)
    assert metadata == {"schedule": "1f1b-rr"}


def test_merge_orders_by_start_then_rank() -> None:
    merged = merge_events(EVENTS[2:], EVENTS[:2])
    assert [(e.start_ms, e.rank) for e in merged] == [(0.0, 0), (1.5, 0), (1.75, 1), (4.0, 1), (7.0, 1)]


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"events": []}, "'traceEvents' list"),
        ({"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "pid": 0, "tid": 0}]}, r"missing \['dur'\]"),
        ({"traceEvents": [{"name": "x", "ph": "B", "ts": 0, "pid": 0}]}, "ph='B'"),
        ({"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "dur": -1, "pid": 0, "tid": 0}]}, "dur = -1 < 0"),
        ({"traceEvents": [{"name": "x", "ph": "X", "ts": "0", "dur": 1, "pid": 0, "tid": 0}]}, "ts = '0'"),
        ({"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "dur": 1, "pid": 0.5, "tid": 0}]}, "pid = 0.5"),
    ],
)
def test_validate_names_the_bad_event(bad, match) -> None:
    with pytest.raises(InputError, match=match):
        validate_chrome_trace(bad)


def test_read_rejects_non_json(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        read_chrome_trace(path)


def test_to_chrome_trace_puts_metadata_first() -> None:
    obj = to_chrome_trace(EVENTS)
    phases = [e["ph"] for e in obj["traceEvents"]]
    assert phases == sorted(phases, key=lambda p: p != "M")
