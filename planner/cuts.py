"""Cut families: the downsets of a layer DAG at which the planner may cut.

A pipeline over a DAG cuts at *downsets* (sets of layers closed under predecessors): the
stages are the differences of nested downsets ``D_0 = {} < D_1 < ... < D_k = all``. The
DPs work over a family of such states, ordered by size (a subset always comes first),
state 0 the empty set and the last state every layer. Which family:

The budget is ``state_budget(N) = max(MAX_CUT_STATES, 3 (N + 1) / 2)`` states for N
layers: the DPs cost about F^3 per level and unit count, so a family may be at most
about 1.5 times the N + 1 prefixes (or 256 states on a small graph).

1. ``all-downsets`` when the DAG has at most ``state_budget(N)`` downsets (the empty one
   included). This contains every prefix of the topological order and every state
   PipeDream's antichain DAG reaches (those are the downsets that hold the first source,
   so it is exact, PipeDream's search included). A chain has N + 1 downsets.
2. Otherwise ``window-w``: the downsets between prefixes of the topological order,
   ``P_a | X`` with X a downset of the layers [a, a + w) (windows start every
   ``max(1, w // 2)`` layers), for the largest w (doubling from 2) whose family fits the
   budget. It holds every prefix. PipeDream itself enumerates every downset that holds
   the first source (its antichain DAG), more than the budget here.
3. ``prefix`` (today's family, N + 1 states) when not even w = 2 fits, and on graphs of
   more than ``LARGE_GRAPH_LAYERS`` layers (NASNet: the DP over the prefixes alone is
   already its slowest case).

The budget bounds the DP's tables (states x states per unit count), so memory and time
stay bounded on wide graphs (NASNet, Inception). Enumeration is a breadth-first walk
that keeps each downset's ready layers: O(F (N / 64 + degree)) for F states.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.profile import Profile

__all__ = [
    "MAX_CUT_STATES",
    "LARGE_GRAPH_LAYERS",
    "CutFamily",
    "cut_family",
    "state_budget",
    "prefix_family",
    "downsets",
    "is_chain",
]

MAX_CUT_STATES = 256
LARGE_GRAPH_LAYERS = 512


def state_budget(layers: int) -> int:
    """Most cut states a family may hold for a graph of ``layers`` layers."""
    return max(MAX_CUT_STATES, 3 * (layers + 1) // 2)


@dataclass(frozen=True)
class CutFamily:
    """States of a cut family. ``masks[s]`` (bool, one column per layer) is state s;
    ``None`` for the prefix family, whose state s is layers ``[0, s)``. States are sorted
    by size, so ``D_i < D_j`` implies ``i < j``; ``name`` says which family it is and
    ``exact`` whether it holds every downset of the DAG. ``stage_ok[i, j]`` (bool, F x F),
    when given, further rules out the stage from state i to state j (an export target's
    rule that a whole stage cannot satisfy, ``planner.targets``)."""

    name: str
    layers: int
    masks: np.ndarray | None = None
    exact: bool = False
    stage_ok: np.ndarray | None = None

    @property
    def states(self) -> int:
        return self.layers + 1 if self.masks is None else len(self.masks)

    @property
    def is_prefix(self) -> bool:
        return self.masks is None

    def stage_layers(self, i: int, j: int) -> tuple[int, ...]:
        """Layers of the stage between states i and j (state j minus state i)."""
        if self.masks is None:
            return tuple(range(i, j))
        return tuple(int(x) for x in np.nonzero(self.masks[j] & ~self.masks[i])[0])

    def sums(self, values: np.ndarray) -> np.ndarray:
        """Per state, the sum of ``values`` (one per layer) over its layers (float64)."""
        values = np.asarray(values, dtype=np.float64)
        if self.masks is None:
            out = np.zeros(self.layers + 1)
            np.cumsum(values, out=out[1:])
            return out
        return self.masks.astype(np.float64) @ values

    def nested(self, span: int, rows: int) -> np.ndarray:
        """ok[l, i]: state i is a proper subset of state i + l (l <= ``span``, i < ``rows``;
        False past the last state). O(span F N / 64)."""
        f = self.states
        lengths = np.arange(span + 1)[:, None]
        starts = np.arange(rows)[None, :]
        ok = (lengths >= 1) & (starts + lengths < f)
        if self.stage_ok is not None:
            for length in range(1, min(span, f - 1) + 1):
                count = min(f - length, rows)
                ok[length, :count] &= np.diagonal(self.stage_ok, offset=length)[:count]
        if self.masks is None:
            return ok
        words = _packed(self.masks)
        for length in range(1, min(span, f - 1) + 1):
            outside = np.bitwise_and(words[: f - length], ~words[length:])
            ok[length, : f - length] &= ~outside.any(axis=1)
        return ok


def _packed(masks: np.ndarray) -> np.ndarray:
    """Bit-packed rows of ``masks`` as uint64 words (N / 64 per state)."""
    packed = np.packbits(masks, axis=1)
    pad = (-packed.shape[1]) % 8
    if pad:
        packed = np.concatenate([packed, np.zeros((len(packed), pad), dtype=np.uint8)], axis=1)
    return packed.view(np.uint64)


def is_chain(profile: Profile) -> bool:
    """True when the only downsets are the prefixes (every layer reads its predecessor)."""
    return all(i - 1 in layer.inputs for i, layer in enumerate(profile.layers) if i)


def prefix_family(layers: int, name: str = "prefix", exact: bool = False) -> CutFamily:
    return CutFamily(name, layers, None, exact)


def downsets(preds: list[tuple[int, ...]], first: int, stop: int, limit: int) -> list[int] | None:
    """Every downset X of the layers [first, stop) (predecessors outside that range are
    taken as present), as bit masks over the layers (bit k = layer first + k); None when
    there are more than ``limit``. Breadth-first by size; O(|result| * width)."""
    succs: dict[int, list[int]] = {v: [] for v in range(first, stop)}
    missing = {}
    for v in range(first, stop):
        inside = [p for p in preds[v] if first <= p < stop]
        missing[v] = len(inside)
        for p in inside:
            succs[p].append(v)
    out = [0]
    level: dict[int, tuple[int, ...]] = {0: tuple(v for v in range(first, stop) if missing[v] == 0)}
    while level:
        following: dict[int, tuple[int, ...]] = {}
        for mask, ready in level.items():
            for v in ready:
                grown = mask | (1 << (v - first))
                if grown in following:
                    continue
                now = [w for w in ready if w != v]
                for w in succs[v]:
                    if all(not (first <= p < stop) or grown >> (p - first) & 1 for p in preds[w]):
                        now.append(w)
                following[grown] = tuple(now)
                if len(out) + len(following) > limit:
                    return None
        out.extend(following)
        level = following
    return out


def _masks_from_bits(bits: list[int], first: int, layers: int) -> np.ndarray:
    out = np.zeros((len(bits), layers), dtype=bool)
    out[:, :first] = True
    for row, value in enumerate(bits):
        k = 0
        while value:
            if value & 1:
                out[row, first + k] = True
            value >>= 1
            k += 1
    return out


def _sorted_unique(masks: np.ndarray) -> np.ndarray:
    """Unique rows, ordered by size, then with the lowest layers first (a prefix leads
    the states of its size). O(F N log F)."""
    masks = np.unique(masks, axis=0)
    packed = np.packbits(masks, axis=1).astype(np.int16)  # layer 0 is the top bit of byte 0
    keys = tuple(-packed[:, c] for c in reversed(range(packed.shape[1]))) + (masks.sum(axis=1),)
    return masks[np.lexsort(keys)]


def _window_family(preds: list[tuple[int, ...]], n: int, window: int, limit: int) -> np.ndarray | None:
    blocks = [np.tri(n + 1, n, -1, dtype=bool)]  # prefixes: row s = layers < s
    total = n + 1
    step = max(1, window // 2)
    for first in range(0, n, step):
        stop = min(n, first + window)
        bits = downsets(preds, first, stop, limit)
        if bits is None:
            return None
        total += len(bits)
        if total > 4 * limit:
            return None
        blocks.append(_masks_from_bits(bits, first, n))
    masks = _sorted_unique(np.concatenate(blocks))
    return masks if len(masks) <= limit else None


def cut_family(profile: Profile, limit: int | None = None) -> CutFamily:
    """The family of cut states the planner searches for ``profile``, at most ``limit``
    states (default ``state_budget``) unless it is the prefix family (module docstring)."""
    n = len(profile.layers)
    limit = state_budget(n) if limit is None else limit
    if is_chain(profile):
        return prefix_family(n, "all-downsets", exact=True)
    preds = [tuple(layer.inputs) for layer in profile.layers]
    if n > LARGE_GRAPH_LAYERS:
        return prefix_family(n)
    every = downsets(preds, 0, n, limit)
    if every is not None:
        return CutFamily("all-downsets", n, _sorted_unique(_masks_from_bits(every, 0, n)), exact=True)
    best: tuple[int, np.ndarray] | None = None
    window = 2
    while window <= n:
        masks = _window_family(preds, n, window, limit)
        if masks is None:
            break
        best = (window, masks)
        window *= 2
    if best is None:
        return prefix_family(n)
    return CutFamily(f"window-{best[0]}", n, best[1], exact=False)
