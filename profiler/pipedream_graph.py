"""Read a PipeDream ``graph.txt`` profile into a ``pipeplan.profile.Profile``.

Node lines: ``node<ID> -- <description> -- forward_compute_time=<ms>,
backward_compute_time=<ms>, activation_size=<bytes>, parameter_size=<bytes>``; edge
lines start with a tab: ``\\tnode<A> -- node<B>``. As PipeDream's optimizer does, source
nodes described ``Input...`` and sink nodes described ``__getitem__...`` are dropped.
Layers come out in a topological order (Kahn's algorithm, ties by the order of first
appearance in the file); ``output_bytes`` and ``saved_bytes`` are PipeDream's
activation size, ``param_bytes`` its parameter size. The fingerprint hashes the structure
(descriptions and edges), not the timings.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import os
import re
from pathlib import Path

from pipeplan.errors import InputError
from pipeplan.profile import DeviceInfo, LayerProfile, Profile

__all__ = ["is_pipedream_graph", "parse_pipedream_graph", "load_pipedream_graph"]

_NODE = re.compile(
    r"^(?P<id>\S+) -- (?P<desc>.*) -- forward_compute_time=(?P<f>[^,]+), "
    r"backward_compute_time=(?P<b>[^,]+), activation_size=(?P<a>.+), parameter_size=(?P<p>[^,\s]+)"
    r"(?: -- stage_id=\d+)?\s*$"
)


def is_pipedream_graph(text: str) -> bool:
    """True when ``text`` looks like a PipeDream graph.txt (its first line is a node)."""
    first = text.lstrip("\n").split("\n", 1)[0]
    return bool(_NODE.match(first.strip()))


def _number(text: str, where: str, what: str) -> float:
    """A finite, non-negative number; ``InputError`` naming ``what`` otherwise (inf, nan, -1)."""
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{where}: cannot read {what} {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise InputError(f"{where}: {what} {text.strip()!r} must be a finite number >= 0")
    return value


def _size(text: str, where: str) -> float:
    """An activation/parameter size: a number or PipeDream's list ``[a; b]`` (summed)."""
    if text.startswith("["):
        return sum(_number(x, where, "size") for x in text.strip("[]").split(";") if x.strip())
    return _number(text, where, "size")


def parse_pipedream_graph(text: str, source: str = "graph.txt", batch_size: int = 1) -> Profile:
    """The ``Profile`` of a graph.txt ``text``; ``source`` names the file in errors."""
    nodes: dict[str, tuple[str, float, float, float, float]] = {}
    order: list[str] = []
    edges: list[tuple[str, str]] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        if line.startswith("\t"):
            parts = line.strip().split(" -- ")
            if len(parts) != 2:
                raise InputError(f"{where}: edge line is not 'nodeA -- nodeB': {line.strip()!r}")
            edges.append((parts[0], parts[1]))
            continue
        match = _NODE.match(line.strip())
        if match is None:
            raise InputError(f"{where}: not a PipeDream node line: {line.strip()[:80]!r}")
        forward = _number(match["f"], where, "forward_compute_time")
        backward = _number(match["b"], where, "backward_compute_time")
        nodes[match["id"]] = (
            match["desc"],
            forward,
            backward,
            _size(match["a"], where),
            _size(match["p"], where),
        )
        order.append(match["id"])
    if not nodes:
        raise InputError(f"{source}: no nodes")
    for a, b in edges:
        for node in (a, b):
            if node not in nodes:
                raise InputError(f"{source}: edge {a} -- {b} names unknown node {node}")
    preds: dict[str, list[str]] = {n: [] for n in nodes}
    succs: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        preds[b].append(a)
        succs[a].append(b)
    dropped = {n for n in nodes if not preds[n] and nodes[n][0].startswith("Input")}
    dropped |= {n for n in nodes if not succs[n] and nodes[n][0].startswith("__getitem__")}
    keep = [n for n in order if n not in dropped]
    position = {n: i for i, n in enumerate(order)}
    indegree = {n: sum(1 for p in preds[n] if p not in dropped) for n in keep}
    ready = [(position[n], n) for n in keep if indegree[n] == 0]
    heapq.heapify(ready)
    topo: list[str] = []
    while ready:
        _, n = heapq.heappop(ready)
        topo.append(n)
        for s in succs[n]:
            if s in indegree:
                indegree[s] -= 1
                if indegree[s] == 0:
                    heapq.heappush(ready, (position[s], s))
    if len(topo) != len(keep):
        raise InputError(f"{source}: the graph has a cycle")
    index = {n: i for i, n in enumerate(topo)}
    layers = []
    digest = hashlib.sha256()
    for i, n in enumerate(topo):
        desc, forward, backward, activation, params = nodes[n]
        inputs = tuple(sorted(index[p] for p in preds[n] if p in index))
        digest.update(f"{desc}|{inputs}|{int(params)}\n".encode())
        layers.append(
            LayerProfile(
                index=i,
                name=n,
                type=desc.split("(")[0],
                inputs=inputs,
                forward_ms=forward,
                backward_ms=backward,
                output_bytes=int(round(activation)),
                param_bytes=int(round(params)),
                saved_bytes=int(round(activation)),
            )
        )
    return Profile(
        model=source,
        fingerprint=digest.hexdigest(),
        device=DeviceInfo(type="cuda", name="V100 (PipeDream profile)"),
        batch_size=batch_size,
        dtype="float32",
        layers=tuple(layers),
        source="pipedream",
    )


def load_pipedream_graph(path: str | os.PathLike[str], batch_size: int = 1) -> Profile:
    """Read ``path`` (a PipeDream graph.txt) as a ``Profile``."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 text (byte {exc.start})") from exc
    return parse_pipedream_graph(text, source=str(path), batch_size=batch_size)
