"""What every stage of a DP band holds of the values it received and sent, at once.

``costs.stage_boundary_bytes`` prices one stage; the DP's fit test needs it for every range
of its band, tens of thousands of them, as the plan's assembly charges it (``shard_choice``).
On the prefix family (state s = layers ``[0, s)``, the stage from i to j = layers
``[i, j)``) each value's share is a union of rectangles in (i, j), so one sweep over i
with a running step function in j prices every range in O(N^2 + edges) numpy work and O(N)
memory. Other cut families (nested downsets of a DAG) are priced range by range.

For a value p read by layers r_1 < ... < r_k (all after p), first saved by f (or by none):

- sent, and counted by no layer of the stage: i <= p < j <= min(r_k, f), since f in the
  stage (f < j) would count it;
- received: p < i and a reader in [i, j): for r_{m-1} < i <= r_m, j > r_m; less the ranges
  where f is in the stage (p < i <= f < j), which count it already;
- with ``packed_copy``, the sent values once more where the stage sends more than one tensor.
"""

from __future__ import annotations

import numpy as np

from pipeplan.planner.costs import LayerArrays, ValueGraph, stage_boundary_bytes

__all__ = ["boundary_range"]


def boundary_range(
    arrays: LayerArrays, starts: np.ndarray, ends: np.ndarray, packed_copy: bool
) -> np.ndarray:
    """``LayerArrays.boundary`` of every stage [starts, ends) (numpy arrays of states, one
    shape; 0 where the range is empty or the profile did not record who saved what)."""
    starts, ends = np.broadcast_arrays(np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64))
    graph = arrays.values
    out = np.zeros(starts.shape)
    if graph is None or not graph.measured or not graph.output_bytes:
        return out
    nonempty = starts < ends
    if not nonempty.any():
        return out
    family = arrays.cut_family
    if family.is_prefix and _ordered(graph):
        lengths = ends[nonempty] - starts[nonempty]
        table = _prefix_table(graph, arrays.layers, packed_copy, int(lengths.max()))
        out[nonempty] = table[starts[nonempty], lengths]
        return out
    cache: dict[tuple[int, int], float] = {}
    for index in zip(*np.nonzero(nonempty)):
        key = (int(starts[index]), int(ends[index]))
        if key not in cache:
            cache[key] = stage_boundary_bytes(graph, family.stage_layers(*key), packed_copy)
        out[index] = cache[key]
    return out


def _prefix_table(graph: ValueGraph, layers: int, packed_copy: bool, width: int) -> np.ndarray:
    """table[i, l]: the boundary of the stage [i, i + l), l <= ``width`` (0 past the last
    layer). Kept for the next call on the same graph (the DP's passes widen their band)."""
    key = (id(graph), layers, packed_copy)
    cached = _TABLES.get(key)
    if cached is None or cached[0] is not graph or cached[1].shape[1] <= width:
        _TABLES.clear()
        cached = (graph, _PrefixSweep(graph, layers, packed_copy).table(width))
        _TABLES[key] = cached
    return cached[1]


_TABLES: dict[tuple[int, int, bool], tuple[ValueGraph, np.ndarray]] = {}


def _ordered(graph: ValueGraph) -> bool:
    """The sweep's premise: every reader comes after the value it reads, and a value's first
    saver is one of its readers."""
    return all(
        all(r > p for r in readers) and (not savers or savers[0] in readers)
        for p, (readers, savers) in enumerate(zip(graph.readers, graph.saved_by))
    )


class _PrefixSweep:
    """Per start i, the step functions in j of the held bytes, the sent bytes and the sent
    tensors, built from rectangles [i_lo, i_hi] x [j_lo, inf) with a weight each."""

    def __init__(self, graph: ValueGraph, layers: int, packed_copy: bool) -> None:
        self.layers, self.packed_copy = layers, packed_copy
        rects: list[tuple[int, int, int, int, float]] = []  # (i_lo, i_hi, j_lo, row, weight)
        for p, readers in enumerate(graph.readers):
            if not readers:
                continue
            size = graph.output_bytes[p]
            tensors = float(max(1, graph.tensors[p])) if graph.tensors else 1.0
            order = sorted(readers)
            savers = graph.saved_by[p]
            first = savers[0] if savers else None
            top = order[-1] if first is None else min(order[-1], first)
            rects += [(0, p, p + 1, 0, size), (0, p, top + 1, 0, -size)]  # sent, not counted
            for row, weight in ((1, size), (2, tensors)):  # sent at all (the packed copy's test)
                rects += [(0, p, p + 1, row, weight), (0, p, order[-1] + 1, row, -weight)]
            previous = p
            for r in order:  # received: the first reader at or after i lies before j
                if r > previous:
                    rects.append((previous + 1, r, r + 1, 0, size))
                previous = r
            if first is not None:  # ... where the first saver is outside the stage
                rects.append((p + 1, first, first + 1, 0, -size))
        self.rects = np.array(rects, dtype=np.float64).reshape(-1, 5)

    def table(self, width: int) -> np.ndarray:
        """Rows i = 0..N, columns l = 0..width: the boundary of [i, i + l)."""
        n = self.layers
        rect = self.rects
        i_lo, i_hi, j_lo = (rect[:, k].astype(np.int64) for k in range(3))
        rows, weights = rect[:, 3].astype(np.int64), rect[:, 4]
        opening = np.argsort(i_lo, kind="stable")
        closing = np.argsort(i_hi, kind="stable")
        active = np.zeros((3, n + 2))
        out = np.zeros((n + 1, width + 1))
        o = c = 0
        for i in range(n + 1):
            while o < len(opening) and i_lo[opening[o]] <= i:
                k = opening[o]
                active[rows[k], j_lo[k]] += weights[k]
                o += 1
            while c < len(closing) and i_hi[closing[c]] < i:
                k = closing[c]
                active[rows[k], j_lo[k]] -= weights[k]
                c += 1
            stop = min(n, i + width)
            if stop <= i:
                continue
            held, sent, tensors = np.cumsum(active[:, : stop + 1], axis=1)[:, i + 1 : stop + 1]
            copies = np.where(tensors > 1.5, sent, 0.0) if self.packed_copy else 0.0
            out[i, 1 : stop - i + 1] = held + copies
        return out
