"""Cost model of a layer range: prefix sums, cut bytes of a DAG, all-reduce and transfer.

Two cost models share these arrays:

- ``pipeplan`` (default): a stage replicated on m units overlaps compute with its ring
  all-reduce, ``T = max(U / m, 2(m-1)/m * P / B)``; a cut costs ``2 a / B`` (activations
  forward, gradients back), always counted; latency (ms per message) is added when the
  topology gives one.
- ``pipedream``: PipeDream's optimizer (``planner.pipedream_dp``), all-reduce
  ``4(m-1) P / (B m)`` added to compute, transfers only with a compression ratio.

``P`` is the gradient bytes the replicas all-reduce (``LayerArrays.sync_bytes``): the
parameter bytes, times ``master / compute`` bytes under mixed precision, whose runtime
accumulates and all-reduces float32 gradients of bf16 weights (as Megatron's float32
``main_grad``); activations and the bytes sent between stages stay in the compute dtype.

Arrays are indexed by the cut states of a ``planner.cuts.CutFamily``: a stage runs from
state i to state j (state j minus state i, for a proper subset i of j). For the prefix
family state s is layers ``[0, s)``, so a stage is the half-open range ``[i, j)`` of the
profile's topological order. Times are milliseconds per minibatch, sizes bytes,
bandwidths bytes/s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypedDict, overload

import numpy as np

from pipeplan.planner.cuts import CutFamily, prefix_family
from pipeplan.planner.recompute import SelectiveRanges, gain_bytes, selective_freed_bytes
from pipeplan.precision import Precision
from pipeplan.profile import Profile
from pipeplan.topology import Level, Topology

# a number, or a numpy array of numbers: the cost formulas work elementwise on either
Elementwise = float | np.ndarray

__all__ = [
    "COST_MODELS",
    "LayerArrays",
    "layer_arrays",
    "stage_deferred_bytes",
    "stage_boundary_bytes",
    "ValueGraph",
    "layer_compute_ms",
    "range_max",
    "update_ms",
    "ring_allreduce_ms",
    "group_sum_ms",
    "level_sum_ms",
    "on_gloo",
    "transfer_ms",
]

COST_MODELS = ("pipeplan", "pipedream")


@overload
def stage_deferred_bytes(first_stage: bool, layers_deferred: float) -> float: ...
@overload
def stage_deferred_bytes(first_stage: np.ndarray, layers_deferred: np.ndarray) -> np.ndarray: ...
def stage_deferred_bytes(first_stage: bool | np.ndarray, layers_deferred: Elementwise) -> Elementwise:
    """What a stage's zero-bubble input pass keeps for its weight pass, one minibatch: the sum of
    its layers' ``deferred_weight_bytes`` (``layers_deferred``); none for the model's first
    stage, whose inputs need no gradient, so that its "W" is its whole backward and records
    nothing (``pipeplan.split_backward``). Elementwise over numpy arrays (the DP's ranges).

    >>> stage_deferred_bytes(True, 48.0), stage_deferred_bytes(False, 48.0)
    (0.0, 48.0)
    >>> stage_deferred_bytes(np.array([True, False]), np.array([48.0, 48.0]))
    array([ 0., 48.])
    """
    if isinstance(first_stage, np.ndarray):
        return np.where(first_stage, 0.0, layers_deferred)
    return 0.0 if first_stage else float(layers_deferred)


@dataclass(frozen=True)
class ValueGraph:
    """Who reads and who saves each layer's output, for ``stage_boundary_bytes``: per layer its
    producers, its readers, its output bytes, the layers that saved its output
    (``LayerProfile.output_saved_by``; None anywhere: not measured) and its output's tensors
    (-1: not measured, taken as one)."""

    inputs: tuple[tuple[int, ...], ...]
    readers: tuple[tuple[int, ...], ...]
    output_bytes: tuple[float, ...]
    saved_by: tuple[tuple[int, ...] | None, ...]
    tensors: tuple[int, ...] = ()

    @classmethod
    def of(cls, profile: Profile) -> ValueGraph:
        readers: list[list[int]] = [[] for _ in profile.layers]
        for layer in profile.layers:
            for producer in dict.fromkeys(layer.inputs):
                readers[producer].append(layer.index)
        return cls(
            tuple(tuple(layer.inputs) for layer in profile.layers),
            tuple(map(tuple, readers)),
            tuple(float(layer.output_bytes) for layer in profile.layers),
            tuple(layer.output_saved_by for layer in profile.layers),
            tuple(layer.output_tensors for layer in profile.layers),
        )

    @property
    def measured(self) -> bool:
        return all(savers is not None for savers in self.saved_by)


def stage_boundary_bytes(graph: ValueGraph, layers: Iterable[int], packed_copy: bool) -> float:
    """What a pipeline stage of ``layers`` holds per minibatch beside its layers' saved bytes,
    until each unit's backward: the values it received (the runtime keeps a stage's inputs for
    their gradients) and the outputs it sent (kept as its backward's heads), each where no layer
    of the stage counts it already (the first layer to save a value counts its bytes). With
    ``packed_copy`` (gloo: several tensors to one peer travel packed in a copy, which is kept
    until their gradients come back) the sent values once more. 0 where the profile did not
    record who saved what.

    >>> graph = ValueGraph(((), (0,), (1,)), ((1,), (2,), ()), (8.0, 16.0, 4.0), ((1,), (), (2,)))
    >>> stage_boundary_bytes(graph, [0], False), stage_boundary_bytes(graph, [1, 2], False)
    (8.0, 0.0)
    >>> stage_boundary_bytes(graph, [1], False), stage_boundary_bytes(graph, [2], False)
    (16.0, 16.0)
    """
    if not graph.measured:
        return 0.0
    stage = set(layers)
    received = {p for q in stage for p in graph.inputs[q] if p not in stage}
    sent = {p for p in stage if any(r not in stage for r in graph.readers[p])}

    def counted_here(p: int) -> bool:  # its first saver is of the stage
        savers = graph.saved_by[p]
        return bool(savers) and savers is not None and savers[0] in stage

    held = sum(graph.output_bytes[p] for p in received | sent if not counted_here(p))
    tensors = sum(max(1, graph.tensors[p]) if graph.tensors else 1 for p in sent)
    copies = sum(graph.output_bytes[p] for p in sent) if packed_copy and tensors > 1 else 0.0
    return float(held + copies)


@dataclass(frozen=True)
class LayerArrays:
    """Sums over the cut states (index s holds the sum over the layers of state s; for
    the prefix family the layers < s; length F = states).

    ``cut_bytes[s]`` is every activation byte crossing the cut after state ``s`` (outputs
    of its layers read by a layer outside it, each tensor counted once);
    ``frontier_bytes[s]`` adds the output of the state's last layer (highest index) when
    no layer outside reads it (the loss input; PipeDream's antichain size on a chain).
    PipeDream's own antichain size also counts predecessors whose readers all lie inside
    the state (``augment_antichain``): pipeplan does not (README, PipeDream section).
    ``layers`` is the number of the last state (N for prefixes).
    """

    compute_ms: np.ndarray  # float64, prefix of forward+backward ms
    param_bytes: np.ndarray  # float64, prefix of parameter bytes
    saved_bytes: np.ndarray  # float64, prefix of bytes saved for backward
    output_bytes: np.ndarray  # float64, prefix of layer outputs (PipeDream's stash size)
    cut_bytes: np.ndarray  # float64, length N + 1; cut_bytes[0] = cut_bytes[N] = 0
    frontier_bytes: np.ndarray  # float64, length N + 1
    # Charged to both the first and the last layer (the input and the loss stage each
    # draw the minibatch), but paid once by a stage that holds them both (ms).
    shared_ends_ms: float = 0.0
    family: CutFamily | None = None  # None: the prefix family
    # what the parameter bytes are (compute dtype) and what the memory rule charges beside them
    # (the profile's: float32 masters for a measured bf16 profile; pipeplan.precision, planner.memory)
    precision: Precision = Precision()
    # per layer (not summed): its largest parameter's bytes (``LayerProfile.largest_tensor_bytes``)
    largest_param_bytes: np.ndarray | None = None
    # activation recomputation (``planner.recompute``): sums over the states of the bytes
    # recomputing each layer frees and of the recomputable layers' forward ms; per layer
    # (not summed) the saved bytes of the recomputable layers (0 for the others)
    recompute_gain: np.ndarray | None = None
    recompute_forward_ms: np.ndarray | None = None
    recompute_saved: np.ndarray | None = None
    # selective recomputation (``planner.recompute``): sums over the states of the bytes each
    # layer's attention core frees and of its ms; per layer (not summed) the freed bytes
    selective_freed: np.ndarray | None = None
    selective_ms: np.ndarray | None = None
    selective_layer_freed: np.ndarray | None = None
    # per layer (not summed): its parameter bytes (FSDP's gathered layer, planner.sharding)
    layer_param_bytes: np.ndarray | None = None
    # per layer (not summed): what its backward holds beyond the saved bytes, one minibatch
    # (``LayerProfile.backward_working_bytes``; 0 where not measured): planner.memory
    working_bytes: np.ndarray | None = None
    # sums over the states of what each layer's zero-bubble input pass keeps for its weight
    # pass, one minibatch (``LayerProfile.deferred_weight_bytes``; 0 where not measured)
    deferred_bytes: np.ndarray | None = None
    values: ValueGraph | None = None  # who reads and saves each output (stage_boundary_bytes)

    @property
    def cut_family(self) -> CutFamily:
        return self.family if self.family is not None else prefix_family(self.layers)

    def nested(self, i: int, j: int) -> bool:
        """True when a stage can run from state i to state j (state i a proper subset of j)."""
        if (
            self.family is not None
            and self.family.stage_ok is not None
            and not (i < j and self.family.stage_ok[i, j])
        ):
            return False
        if self.family is None or self.family.masks is None:
            return i < j
        masks = self.family.masks
        return i < j and not bool(np.any(masks[i] & ~masks[j]))

    @property
    def layers(self) -> int:
        return len(self.compute_ms) - 1

    def compute(self, i: int, j: int) -> float:
        both_ends = i == 0 and j == self.layers and self.layers > 1
        return float(self.compute_ms[j] - self.compute_ms[i]) - (self.shared_ends_ms if both_ends else 0.0)

    def compute_range(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """``compute`` over arrays of ranges: a whole-model stage pays the shared ends once."""
        whole = (starts == 0) & (ends == self.layers) & (self.layers > 1)
        return self.compute_ms[ends] - self.compute_ms[starts] - np.where(whole, self.shared_ends_ms, 0.0)

    def params(self, i: int, j: int) -> float:
        return float(self.param_bytes[j] - self.param_bytes[i])

    def saved(self, i: int, j: int) -> float:
        return float(self.saved_bytes[j] - self.saved_bytes[i])

    def sync_bytes(self, i: int, j: int) -> float:
        """Gradient bytes a stage from state i to state j all-reduces among its replicas:
        its parameter bytes in the gradients' dtype (``Precision.gradient_ratio``)."""
        return self.params(i, j) * self.precision.gradient_ratio

    def sync_range(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """``sync_bytes`` of every range [starts, ends) (numpy indices, elementwise)."""
        return (self.param_bytes[ends] - self.param_bytes[starts]) * self.precision.gradient_ratio

    def _stage_max(self, values: np.ndarray | None, i: int, j: int) -> float:
        """The largest of the per-layer ``values`` in the stage from state i to j (0: none)."""
        layers = list(self.cut_family.stage_layers(i, j))
        return float(values[layers].max()) if values is not None and layers else 0.0

    def largest(self, i: int, j: int) -> float:
        """Bytes of the largest parameter of the stage from state i to state j (0: none recorded)."""
        return self._stage_max(self.largest_param_bytes, i, j)

    def largest_range(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """``largest`` of every stage [starts, ends) (numpy index arrays of nested states,
        elementwise; ``range_max``)."""
        return range_max(self.largest_param_bytes, self.cut_family, starts, ends)

    def deferred(self, i: int, j: int) -> float:
        """What the stage from state i to j keeps from its input pass to its weight pass, one
        minibatch (``stage_deferred_bytes``: none for the stage from state 0)."""
        if self.deferred_bytes is None:
            return 0.0
        return stage_deferred_bytes(i == 0, float(self.deferred_bytes[j] - self.deferred_bytes[i]))

    def deferred_range(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """``deferred`` of every stage [starts, ends) (numpy indices, elementwise)."""
        if self.deferred_bytes is None:
            return np.zeros(np.broadcast_shapes(np.shape(starts), np.shape(ends)))
        return stage_deferred_bytes(
            np.asarray(starts) == 0, self.deferred_bytes[ends] - self.deferred_bytes[starts]
        )

    def boundary(self, i: int, j: int, packed_copy: bool) -> float:
        """What the stage from state i to j holds beyond its saved bytes, one minibatch: the
        values it received and sent (``stage_boundary_bytes``; 0 where not recorded)."""
        if self.values is None:
            return 0.0
        return stage_boundary_bytes(self.values, self.cut_family.stage_layers(i, j), packed_copy)

    def working(self, i: int, j: int) -> float:
        """The largest backward working bytes (one minibatch) of the stage from state i to j."""
        return self._stage_max(self.working_bytes, i, j)

    def working_range(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """``working`` of every stage [starts, ends) (elementwise; ``range_max``)."""
        return range_max(self.working_bytes, self.cut_family, starts, ends)

    def recompute_transient(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The largest recomputable layer's saved bytes of every stage [starts, ends)
        (one minibatch; ``planner.recompute``)."""
        return range_max(self.recompute_saved, self.cut_family, starts, ends)

    def selective_ranges(
        self, starts: np.ndarray, ends: np.ndarray, microbatches: int
    ) -> SelectiveRanges | None:
        """Selective recomputation of every stage [starts, ends) (None: not recorded)."""
        if self.selective_freed is None or self.selective_ms is None or self.selective_layer_freed is None:
            return None
        if not np.any(self.selective_layer_freed > 0):
            return None
        return SelectiveRanges(
            self.selective_freed[ends] - self.selective_freed[starts],
            self.selective_ms[ends] - self.selective_ms[starts],
            range_max(self.selective_layer_freed, self.cut_family, starts, ends) / microbatches,
        )


def range_max(
    values: np.ndarray | None, family: CutFamily, starts: np.ndarray, ends: np.ndarray
) -> np.ndarray:
    """The largest of the per-layer ``values`` in every stage [starts, ends) of ``family``
    (0 where none). A stage holds a layer of at least size v when the count of such layers
    differs between its two states (counts are sums over states, as the bytes are); the
    largest such v is found by bisection over the distinct sizes: O(states x sizes) for
    the counts, O(log sizes) array passes."""
    starts, ends = np.broadcast_arrays(np.asarray(starts), np.asarray(ends))
    if values is None or not np.any(values > 0):
        return np.zeros(starts.shape)
    sizes = np.unique(values)[::-1]
    sizes = sizes[sizes > 0]
    at_least = (values[:, None] >= sizes[None, :]).astype(np.float64)  # layer x size (descending)
    if family.masks is None:
        counts = np.vstack([np.zeros(len(sizes)), np.cumsum(at_least, axis=0)])
    else:
        counts = family.masks.astype(np.float64) @ at_least

    def holds(k: np.ndarray) -> np.ndarray:
        return counts[ends, k] - counts[starts, k] > 0.5

    low, high = (
        np.zeros(starts.shape, dtype=np.intp),
        np.full(starts.shape, len(sizes) - 1, dtype=np.intp),
    )
    while np.any(open_ := low < high):  # the first (largest) size the stage holds
        middle = (low + high) // 2
        found = holds(middle)
        high, low = np.where(open_ & found, middle, high), np.where(open_ & ~found, middle + 1, low)
    return np.where(holds(low), sizes[low], 0.0)


def _prefix(values: list[float]) -> np.ndarray:
    out = np.zeros(len(values) + 1)
    np.cumsum(np.asarray(values, dtype=np.float64), out=out[1:])
    return out


def update_ms(profile: Profile, optimizer: str | None) -> list[float]:
    """Each layer's share of one ``optimizer`` step (ms), by its parameter bytes.

    The profile times one step over all parameters (``Profile.optimizer_ms``); a stage
    steps once per minibatch it trains, so the share is part of its compute. All zeros
    when ``optimizer`` is None or was not measured (an imported PipeDream graph).

    >>> from pipeplan.profile import DeviceInfo, LayerProfile
    >>> layers = tuple(LayerProfile(i, str(i), "Linear", (), 1.0, 2.0, 4, p, 0) for i, p in enumerate([300, 100]))
    >>> update_ms(Profile("m", "f", DeviceInfo("cpu", "x"), 1, "float32", layers, optimizer_ms={"sgd": 2.0}), "sgd")
    [1.5, 0.5]
    """
    total_ms = profile.optimizer_ms.get(optimizer, 0.0) if optimizer else 0.0
    if optimizer == "adamw" and "adamw" not in profile.optimizer_ms:  # profiles before adamw was timed:
        total_ms = profile.optimizer_ms.get("adam", 0.0)  # Adam's step (AdamW adds one scaling)
    total_bytes = sum(layer.param_bytes for layer in profile.layers)
    if total_ms <= 0 or total_bytes <= 0:
        return [0.0] * len(profile.layers)
    return [total_ms * layer.param_bytes / total_bytes for layer in profile.layers]


def layer_compute_ms(profile: Profile, optimizer: str | None) -> list[float]:
    """Per layer: forward + backward, plus, when ``optimizer`` is charged (pipeplan's own
    cost model), its share of the optimizer step, the loss on the last layer and the
    drawing of the minibatch on the first and the last layer (the runtime's input and
    loss stages each draw it; ``LayerArrays.compute`` counts it once for a stage that
    holds both)."""
    compute = [layer.compute_ms for layer in profile.layers]
    if optimizer is None:
        return compute
    compute = [c + u for c, u in zip(compute, update_ms(profile, optimizer))]
    compute[0] += profile.data_ms
    compute[-1] += profile.loss_ms + (profile.data_ms if len(compute) > 1 else 0.0)
    return compute


def layer_arrays(
    profile: Profile, optimizer: str | None = None, family: CutFamily | None = None
) -> LayerArrays:
    """Sums and cut sizes of ``profile`` over the states of ``family`` (default: the
    prefixes); compute includes ``optimizer``'s step. O(N + edges) for prefixes, O(F N^2)
    (one matrix product) for a family of F downsets."""
    if family is not None and family.masks is not None:
        return _family_arrays(profile, optimizer, family)
    layers = profile.layers
    n = len(layers)
    last_reader = [-1] * n  # the last layer reading each layer's output
    for layer in layers:
        for producer in layer.inputs:
            last_reader[producer] = max(last_reader[producer], layer.index)
    # output of p crosses every cut s with p < s <= last_reader[p]
    delta = np.zeros(n + 2)
    for p, reader in enumerate(last_reader):
        if reader > p:
            delta[p + 1] += layers[p].output_bytes
            delta[reader + 1] -= layers[p].output_bytes
    cut = np.cumsum(delta)[: n + 1]
    cut[0] = 0.0
    frontier = cut.copy()
    for s in range(1, n + 1):
        if last_reader[s - 1] < s:  # layer s-1 feeds nothing after the cut
            frontier[s] += layers[s - 1].output_bytes
    return LayerArrays(
        compute_ms=_prefix(layer_compute_ms(profile, optimizer)),
        param_bytes=_prefix([layer.param_bytes for layer in layers]),
        saved_bytes=_prefix(list(profile.charged_saved_bytes)),
        deferred_bytes=_prefix([layer.charged_deferred_bytes for layer in layers]),
        values=ValueGraph.of(profile),
        output_bytes=_prefix([layer.output_bytes for layer in layers]),
        cut_bytes=cut,
        frontier_bytes=frontier,
        shared_ends_ms=profile.data_ms if optimizer is not None and n > 1 else 0.0,
        family=family,
        precision=Precision(profile.dtype, profile.master_dtype),
        largest_param_bytes=np.array([layer.largest_tensor_bytes for layer in layers], dtype=np.float64),
        **_recompute_fields(profile, _prefix),
    )


class _RecomputeFields(TypedDict):
    recompute_gain: np.ndarray
    recompute_forward_ms: np.ndarray
    recompute_saved: np.ndarray
    selective_freed: np.ndarray
    selective_ms: np.ndarray
    selective_layer_freed: np.ndarray
    layer_param_bytes: np.ndarray
    working_bytes: np.ndarray


def _recompute_fields(profile: Profile, sums: Callable[[list[float]], np.ndarray]) -> _RecomputeFields:
    """``LayerArrays``' recomputation fields, summed over the states by ``sums``."""
    gains, freed = gain_bytes(profile), selective_freed_bytes(profile)
    return _RecomputeFields(
        recompute_gain=sums(gains),
        recompute_forward_ms=sums(
            [layer.forward_ms if g > 0 else 0.0 for layer, g in zip(profile.layers, gains)]
        ),
        recompute_saved=np.array(
            [float(layer.saved_bytes) if g > 0 else 0.0 for layer, g in zip(profile.layers, gains)]
        ),
        selective_freed=sums(freed),
        selective_ms=sums(
            [layer.selective_recompute_ms if f > 0 else 0.0 for layer, f in zip(profile.layers, freed)]
        ),
        selective_layer_freed=np.array(freed, dtype=np.float64),
        layer_param_bytes=np.array([layer.param_bytes for layer in profile.layers], dtype=np.float64),
        working_bytes=np.array(profile.charged_working_bytes, dtype=np.float64),
    )


def _family_arrays(profile: Profile, optimizer: str | None, family: CutFamily) -> LayerArrays:
    """``layer_arrays`` over the downsets ``family.masks``."""
    layers = profile.layers
    n = len(layers)
    masks = family.masks
    assert masks is not None
    output = np.array([layer.output_bytes for layer in layers], dtype=np.float64)
    readers = np.zeros((n, n), dtype=np.float32)  # readers[c, p]: c reads p's output
    for layer in layers:
        for producer in layer.inputs:
            readers[layer.index, producer] = 1.0
    outside = (~masks).astype(np.float32) @ readers > 0  # [s, p]: a reader of p is outside state s
    crossing = masks & outside
    cut = crossing.astype(np.float64) @ output
    frontier = cut.copy()
    for s in range(len(masks)):
        members = np.nonzero(masks[s])[0]
        if len(members):
            last = int(members[-1])
            if not crossing[s, last]:
                frontier[s] += output[last]
    return LayerArrays(
        compute_ms=family.sums(np.array(layer_compute_ms(profile, optimizer))),
        param_bytes=family.sums(np.array([layer.param_bytes for layer in layers])),
        saved_bytes=family.sums(np.array(profile.charged_saved_bytes)),
        deferred_bytes=family.sums(np.array([layer.charged_deferred_bytes for layer in layers])),
        values=ValueGraph.of(profile),
        output_bytes=family.sums(output),
        cut_bytes=cut,
        frontier_bytes=frontier,
        shared_ends_ms=profile.data_ms if optimizer is not None and n > 1 else 0.0,
        family=family,
        precision=Precision(profile.dtype, profile.master_dtype),
        largest_param_bytes=np.array([layer.largest_tensor_bytes for layer in layers], dtype=np.float64),
        **_recompute_fields(profile, lambda values: family.sums(np.array(values, dtype=np.float64))),
    )


@overload
def ring_allreduce_ms(
    param_bytes: float, replicas: float, bandwidth_bytes_per_s: float, latency_ms: float = 0.0
) -> float: ...
@overload
def ring_allreduce_ms(
    param_bytes: np.ndarray, replicas: Elementwise, bandwidth_bytes_per_s: float, latency_ms: float = 0.0
) -> np.ndarray: ...
@overload
def ring_allreduce_ms(
    param_bytes: Elementwise, replicas: np.ndarray, bandwidth_bytes_per_s: float, latency_ms: float = 0.0
) -> np.ndarray: ...
def ring_allreduce_ms(
    param_bytes: Elementwise, replicas: Elementwise, bandwidth_bytes_per_s: float, latency_ms: float = 0.0
) -> Elementwise:
    """Ring all-reduce of ``param_bytes`` among ``replicas``: 2(m-1)/m * P / B (+ 2(m-1) latencies).

    Works elementwise on numpy arrays. 0 for one replica.
    """
    m = np.asarray(replicas, dtype=np.float64)
    return 2.0 * (m - 1.0) / m * param_bytes / bandwidth_bytes_per_s * 1e3 + 2.0 * (m - 1.0) * latency_ms


def on_gloo(topology: Topology) -> bool:
    """Whether ``topology``'s ranks talk over gloo: CPU devices (the runtime's backend for
    them). Two gloo replicas sum by one swap, and gloo keeps a packed message's copy until its
    gradient comes back (``runtime/comm.py``, ``runtime/collectives.py``)."""
    return topology.device.kind == "cpu"


def level_sum_ms(grad_bytes: Elementwise, units: Elementwise, level: Level, on_gloo: bool) -> Elementwise:
    """Summing ``grad_bytes`` over ``units`` joined by ``level`` (elementwise on numpy arrays,
    which broadcast), as ``runtime.collectives`` does (ms): two on gloo swap the tensor and add,
    P / B and one message (its latency and overhead, ``Level.message_ms``), both directions at
    once; otherwise a ring, 2(m-1)/m P / B and 2(m-1) messages. 0 for one unit or nothing to
    sum. The planner's DP, its bounds and the simulator all price a replicas' sum with it.

    >>> from pipeplan.topology import Level
    >>> level = Level("ethernet", 2, 1e9, latency_ms=0.5, message_overhead_ms=0.25)
    >>> level_sum_ms(1e6, 2, level, on_gloo=True), level_sum_ms(1e6, 2, level, on_gloo=False)
    (1.75, 2.5)
    >>> level_sum_ms(np.array([0.0, 1e6]), np.array([[1], [2]]), level, on_gloo=True).tolist()
    [[0.0, 0.0], [0.0, 1.75]]
    """
    return replica_sum_ms(grad_bytes, units, level.bandwidth_bytes_per_s, level.message_ms, on_gloo)


def replica_sum_ms(
    grad_bytes: Elementwise,
    units: Elementwise,
    bandwidth_bytes_per_s: float,
    message_ms: float,
    on_gloo: bool,
) -> Elementwise:
    """``level_sum_ms`` on a link of ``bandwidth_bytes_per_s`` whose message costs
    ``message_ms`` (``Level.message_ms``): the rule every pricing of a replicas' sum shares,
    the sharded stages' ``none`` mode too (``planner.sharding.shard_sync_ms``)."""
    m = np.asarray(units, dtype=np.float64)
    swap = grad_bytes * 1e3 / bandwidth_bytes_per_s + message_ms
    ring = ring_allreduce_ms(grad_bytes, m, bandwidth_bytes_per_s, message_ms)
    cost = np.where((m == 2) & on_gloo, swap, ring)
    cost = np.where((np.asarray(grad_bytes) > 0) & (m >= 2), cost, 0.0)
    return cost if cost.ndim else float(cost)


def group_sum_ms(topology: Topology, ranks: Sequence[int], grad_bytes: float) -> float:
    """Summing ``grad_bytes`` over ``ranks``, as ``runtime.collectives`` does (ms), over the
    outermost level joining any two of them.

    Two ranks on gloo (device kind "cpu") swap the tensor and add: P / B and one message
    (its latency and overhead), both directions at once. Otherwise a ring: 2(m-1)/m P / B
    and 2(m-1) messages. 0 for one rank or nothing to sum.
    """
    m = len(ranks)
    if m < 2 or grad_bytes <= 0:
        return 0.0
    level = topology.levels[max(topology.level_joining(ranks[0], other) for other in ranks[1:])]
    return float(level_sum_ms(grad_bytes, m, level, on_gloo(topology)))


@overload
def transfer_ms(cut_bytes: float, bandwidth_bytes_per_s: float, latency_ms: float = 0.0) -> float: ...
@overload
def transfer_ms(
    cut_bytes: np.ndarray, bandwidth_bytes_per_s: float, latency_ms: float = 0.0
) -> np.ndarray: ...
def transfer_ms(cut_bytes: Elementwise, bandwidth_bytes_per_s: float, latency_ms: float = 0.0) -> Elementwise:
    """Activations forward plus gradients back over one cut: 2 a / B (+ 2 latencies) in ms."""
    return 2.0 * cut_bytes / bandwidth_bytes_per_s * 1e3 + np.where(cut_bytes > 0, 2.0 * latency_ms, 0.0)
