"""Timeline files of a run or a simulation: Chrome-trace JSON, SVG or PNG.

``write_timeline(path, events, ...)`` picks the format from the suffix: ``.json`` writes a
Chrome trace (``pipeplan.trace``), ``.svg``/``.png`` draw one row per rank with matplotlib
(Agg backend, no display): forwards, backwards and all-reduces on the rank's row,
sends in a thin strip under it, minibatch ids written inside the bars wide enough to
hold them. Split backwards draw their "I" and "W" halves in their own colours; with
virtual stages a bar's label ends in its chunk ("3.1c1") and odd chunks are hatched.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeplan.errors import InputError
from pipeplan.jsonio import write_atomic
from pipeplan.trace import TraceEvent, write_chrome_trace

__all__ = ["TIMELINE_SUFFIXES", "COLOURS", "bar_kind", "write_timeline", "draw_timeline"]

TIMELINE_SUFFIXES = (".json", ".svg", ".png")
COLOURS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "input grad": "#8CC97E",  # "I": backward to the stage inputs (zero-bubble schedules)
    "weight grad": "#2F6B3B",  # "W": weight gradients of an earlier "I"
    "step": "#8172B2",
    "allreduce": "#DD8452",
    "send": "#8C8C8C",
    "recv": "#BBBBBB",
}
MAX_LABELS = 3000  # write minibatch ids only below this many drawn bars


def write_timeline(
    path: str | os.PathLike[str],
    events: Sequence[TraceEvent],
    metadata: Mapping[str, Any] | None = None,
    rank_names: Mapping[int, str] | None = None,
    title: str = "",
    max_rows: int = 64,
) -> None:
    """Write ``events`` to ``path`` as a Chrome trace (.json) or an image (.svg, .png)."""
    suffix = Path(path).suffix.lower()
    if suffix not in TIMELINE_SUFFIXES:
        raise InputError(
            f"timeline {path}: unknown suffix {suffix!r} (expected one of {', '.join(TIMELINE_SUFFIXES)})"
        )
    if not events:
        raise InputError(f"timeline {path}: no events to write")
    if suffix == ".json":
        write_chrome_trace(path, events, metadata, rank_names)
        return
    write_atomic(path, draw_timeline(events, suffix[1:], rank_names, title, max_rows))


def draw_timeline(
    events: Sequence[TraceEvent],
    image_format: str = "svg",
    rank_names: Mapping[int, str] | None = None,
    title: str = "",
    max_rows: int = 64,
) -> bytes:
    """The timeline image as bytes of ``image_format`` ("svg" or "png").

    One row per rank (at most ``max_rows``: beyond that, the first replica of each stage
    first, then the others in rank order). Time in ms on the x axis.
    """
    import matplotlib

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = _rows(events, max_rows)
    row_of = {rank: i for i, rank in enumerate(rows)}
    names = dict(rank_names or {})
    for event in events:
        if event.rank not in names and event.stage >= 0:
            names[event.rank] = f"rank {event.rank} s{event.stage}r{max(event.replica, 0)}"
    bars: dict[tuple[int, str, int], list[tuple[float, float]]] = defaultdict(list)
    labels: list[tuple[float, float, float, str]] = []
    for event in events:
        row = row_of.get(event.rank)
        if row is None:
            continue
        bars[(row, bar_kind(event), _chunk(event) % 2)].append((event.start_ms, event.duration_ms))
        if event.category in ("forward", "backward") and event.minibatch >= 0:
            labels.append((event.start_ms + event.duration_ms / 2, row, event.duration_ms, _bar_label(event)))
    end_ms = max(event.end_ms for event in events)
    width = min(40.0, max(10.0, 0.5 * len(labels) / max(len(rows), 1)))
    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.45 * len(rows)))
    for (bar_row, category, odd_chunk), spans in bars.items():
        comm = category in ("send", "recv")
        y = bar_row + (0.28 if comm else -0.38)
        height = 0.12 if comm else 0.62
        ax.broken_barh(
            spans,
            (y, height),
            facecolors=COLOURS.get(category, "#333333"),
            edgecolors="white",
            linewidth=0.3,
            hatch="///" if odd_chunk else None,
        )
    if len(labels) <= MAX_LABELS:
        inches_per_ms = (width * 0.8) / max(end_ms, 1e-9)
        for x, label_row, duration, text in labels:
            if duration * inches_per_ms * 72 >= 5.5 * len(text):
                ax.text(x, label_row - 0.07, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([names.get(rank, f"rank {rank}") for rank in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.6)
    ax.set_xlim(0, end_ms * 1.01)
    ax.set_xlabel("time (ms)")
    shown = [c for c in COLOURS if c in {bar_kind(event) for event in events if event.rank in row_of}]
    # Legend outside the axes, right of the rows, so it never covers bars or the x label.
    ax.legend(
        handles=[Patch(color=COLOURS.get(c, "#333333"), label=c) for c in shown],
        loc="center left",
        bbox_to_anchor=(1.005, 0.5),
        fontsize=8,
        frameon=False,
    )
    hidden = len({event.rank for event in events}) - len(rows)
    suffix = f" (showing {len(rows)} ranks, {hidden} more not drawn)" if hidden > 0 else ""
    ax.set_title((title or "timeline") + suffix, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    with plt.rc_context({"svg.fonttype": "none"}):  # SVG keeps text as text (searchable)
        fig.savefig(buffer, format=image_format, dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def bar_kind(event: TraceEvent) -> str:
    """Legend entry of ``event``: its category, or "input grad" / "weight grad" for a
    backward named "I..." / "W..." (an action of a split backward)."""
    if event.category == "backward" and event.name[:1] == "I":
        return "input grad"
    if event.category == "backward" and event.name[:1] == "W":
        return "weight grad"
    return event.category


def _chunk(event: TraceEvent) -> int:
    """Chunk of a compute event named like "F3.1c1" (0 without a "c" suffix)."""
    head, _, chunk = event.name.rpartition("c")
    return int(chunk) if head and chunk.isdigit() and event.category in ("forward", "backward") else 0


def _bar_label(event: TraceEvent) -> str:
    """ "minibatch[.micro][cchunk]": the action's name without its kind letter."""
    if event.name[:1] in ("F", "B", "I", "W") and event.name[1:2].isdigit():
        return event.name[1:]
    return f"{event.minibatch}.{event.microbatch}" if event.microbatch else str(event.minibatch)


def _rows(events: Sequence[TraceEvent], max_rows: int) -> list[int]:
    """Ranks to draw: all when they fit, else replica 0 of each stage first."""
    stage_of: dict[int, tuple[int, int]] = {}
    for event in events:
        stage_of.setdefault(event.rank, (event.stage, event.replica))
    ranks = sorted(stage_of)
    if len(ranks) <= max_rows:
        return ranks
    firsts = [rank for rank in ranks if stage_of[rank][1] <= 0]
    others = [rank for rank in ranks if stage_of[rank][1] > 0]
    return sorted((firsts + others)[:max_rows])
