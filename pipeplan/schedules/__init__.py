"""Schedules as data: the registry of schedule kinds, their action orders, checks and the event engine."""

from pipeplan.plan import SCHEDULE_NAMES
from pipeplan.schedules.actions import (
    ACTION_KINDS,
    Action,
    Schedule,
    Worker,
    interleaved_warmup,
    noam,
    peak_in_flight,
    warmup_forwards,
)
from pipeplan.schedules.engine import Durations, Timeline, collector_paused, run_schedule, unit_clock
from pipeplan.schedules.kinds import (
    SCHEDULE_KINDS,
    ScheduleKind,
    activations_in_flight,
    build_schedule,
    schedule_kind,
    weight_versions,
)
from pipeplan.schedules.checks import grid, validate

__all__ = [
    "ACTION_KINDS",
    "SCHEDULE_KINDS",
    "SCHEDULE_NAMES",
    "Action",
    "Durations",
    "Schedule",
    "ScheduleKind",
    "Timeline",
    "Worker",
    "activations_in_flight",
    "build_schedule",
    "collector_paused",
    "grid",
    "interleaved_warmup",
    "noam",
    "peak_in_flight",
    "run_schedule",
    "schedule_kind",
    "unit_clock",
    "validate",
    "warmup_forwards",
    "weight_versions",
]
