"""Timelines in the Chrome trace event format, shared by the simulator and the runtime.

A ``TraceEvent`` is one task on one rank (a forward, a backward, a send, an all-reduce,
an optimizer step). ``write_chrome_trace`` stores a list of them as
``{"traceEvents": [...]}`` with complete events (``"ph": "X"``, ``ts``/``dur`` in
microseconds, ``pid`` = rank, ``tid`` 0 compute / 1 communication) and one
``process_name`` metadata event per rank, which Perfetto and chrome://tracing open.
See ``docs/metrics.md``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeplan.errors import InputError
from pipeplan.jsonio import JSONValue, read_json_object, write_atomic

__all__ = [
    "CATEGORIES",
    "COMPUTE_TID",
    "COMM_TID",
    "TraceEvent",
    "to_chrome_trace",
    "write_chrome_trace",
    "read_chrome_trace",
    "validate_chrome_trace",
    "merge_events",
]

CATEGORIES = ("forward", "backward", "send", "recv", "allreduce", "step")
COMPUTE_TID = 0  # forward, backward, step
COMM_TID = 1  # send, recv, allreduce


@dataclass(frozen=True)
class TraceEvent:
    """One task on one rank; times in milliseconds from the start of the run."""

    name: str  # "F3", "B3.1", "send F3 ->r2", "allreduce S3"
    category: str  # one of CATEGORIES
    start_ms: float
    duration_ms: float
    rank: int  # global rank (the trace's pid)
    minibatch: int = -1  # -1 when the task belongs to no minibatch
    microbatch: int = 0
    stage: int = -1
    replica: int = -1
    # a message's (send, recv): its size in bytes and the values it carries; -1: not a message
    message_bytes: int = -1
    message_values: int = -1

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.duration_ms

    @property
    def tid(self) -> int:
        return COMM_TID if self.category in ("send", "recv", "allreduce") else COMPUTE_TID

    def to_chrome(self) -> dict[str, Any]:
        args: dict[str, int] = {
            "minibatch": self.minibatch,
            "microbatch": self.microbatch,
            "stage": self.stage,
            "replica": self.replica,
        }
        if self.message_bytes >= 0:
            args["bytes"] = self.message_bytes
            args["values"] = self.message_values
        return {
            "name": self.name,
            "cat": self.category,
            "ph": "X",
            "ts": round(self.start_ms * 1000.0, 3),
            "dur": round(self.duration_ms * 1000.0, 3),
            "pid": self.rank,
            "tid": self.tid,
            "args": args,
        }

    @classmethod
    def from_chrome(cls, event: Mapping[str, Any]) -> TraceEvent:
        args = event.get("args") or {}
        return cls(
            name=str(event["name"]),
            category=str(event.get("cat", "")),
            start_ms=float(event["ts"]) / 1000.0,
            duration_ms=float(event["dur"]) / 1000.0,
            rank=int(event["pid"]),
            minibatch=int(args.get("minibatch", -1)),
            microbatch=int(args.get("microbatch", 0)),
            stage=int(args.get("stage", -1)),
            replica=int(args.get("replica", -1)),
            message_bytes=int(args.get("bytes", -1)),
            message_values=int(args.get("values", -1)),
        )


def to_chrome_trace(
    events: Iterable[TraceEvent],
    metadata: Mapping[str, Any] | None = None,
    rank_names: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """The Chrome trace object: process names first, then events sorted by (ts, pid)."""
    ordered = sorted(events, key=lambda e: (e.start_ms, e.rank, e.tid))
    names = dict(rank_names or {})
    for event in ordered:
        if event.rank not in names:
            where = f" (stage {event.stage}, replica {event.replica})" if event.stage >= 0 else ""
            names[event.rank] = f"rank {event.rank}{where}"
    meta: list[dict[str, Any]] = []
    for rank in sorted(names):
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": names[rank]}})
        meta.append(
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        )
        for tid, label in ((COMPUTE_TID, "compute"), (COMM_TID, "communication")):
            meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": label}})
    return {
        "traceEvents": meta + [event.to_chrome() for event in ordered],
        "displayTimeUnit": "ms",
        "otherData": dict(metadata or {}),
    }


def write_chrome_trace(
    path: str | os.PathLike[str],
    events: Iterable[TraceEvent],
    metadata: Mapping[str, Any] | None = None,
    rank_names: Mapping[int, str] | None = None,
) -> None:
    """Write ``events`` atomically as a Chrome trace JSON file (see module docstring)."""
    obj = to_chrome_trace(events, metadata, rank_names)
    validate_chrome_trace(obj)
    write_atomic(path, json.dumps(obj, separators=(",", ":")).encode())


def read_chrome_trace(path: str | os.PathLike[str]) -> tuple[list[TraceEvent], dict[str, Any]]:
    """The complete ("X") events of a trace file and its ``otherData`` metadata."""
    obj = read_json_object(path)
    validate_chrome_trace(obj, where=str(path))
    events = [TraceEvent.from_chrome(e) for e in obj["traceEvents"] if e.get("ph") == "X"]
    return events, dict(obj.get("otherData") or {})


def validate_chrome_trace(obj: JSONValue, where: str = "trace") -> None:
    """Raise ``InputError`` naming the first event that is not a valid Chrome trace event.

    Complete events need name, ph "X", numeric ts/dur (µs, dur >= 0), integer pid/tid;
    metadata events (ph "M") need name, pid and args.
    """
    events = obj.get("traceEvents") if isinstance(obj, dict) else None
    if not isinstance(events, list):
        raise InputError(f"{where}: expected an object with a 'traceEvents' list")
    for position, event in enumerate(events):
        if not isinstance(event, dict):
            raise InputError(f"{where}: traceEvents[{position}] is {type(event).__name__}")
        phase = event.get("ph")
        required = ("name", "ph", "ts", "dur", "pid", "tid") if phase == "X" else ("name", "pid")
        missing = [key for key in required if key not in event]
        if phase not in ("X", "M") or missing:
            raise InputError(f"{where}: traceEvents[{position}] has ph={phase!r}, missing {missing}")
        if phase == "X":
            for key in ("ts", "dur"):
                value = event[key]
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise InputError(f"{where}: traceEvents[{position}].{key} = {value!r}")
            duration = event["dur"]
            if isinstance(duration, (int, float)) and duration < 0:  # a number: checked above
                raise InputError(f"{where}: traceEvents[{position}].dur = {event['dur']} < 0")
            for key in ("pid", "tid"):
                if not isinstance(event[key], int):
                    raise InputError(f"{where}: traceEvents[{position}].{key} = {event[key]!r}")


def merge_events(*per_rank: Iterable[TraceEvent]) -> list[TraceEvent]:
    """Merge event lists (one per rank) into one list sorted by start time, then rank."""
    merged = [event for events in per_rank for event in events]
    merged.sort(key=lambda e: (e.start_ms, e.rank, e.tid))
    return merged
