"""Cost model of a layer range: prefix sums, cut bytes of a DAG, all-reduce and transfer.

Two cost models share these arrays:

- ``pipeplan`` (default): a stage replicated on m units overlaps compute with its ring
  all-reduce, ``T = max(U / m, 2(m-1)/m * P / B)``; a cut costs ``2 a / B`` (activations
  forward, gradients back), always counted; latency (ms per message) is added when the
  topology gives one.
- ``pipedream``: PipeDream's optimizer (``planner.pipedream_dp``), all-reduce
  ``4(m-1) P / (B m)`` added to compute, transfers only with a compression ratio.

Layer ranges are half-open ``[i, j)`` in the profile's topological order; times are
milliseconds per minibatch, sizes bytes, bandwidths bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.profile import Profile

__all__ = ["COST_MODELS", "LayerArrays", "layer_arrays", "layer_compute_ms", "update_ms", "ring_allreduce_ms", "transfer_ms"]

COST_MODELS = ("pipeplan", "pipedream")


@dataclass(frozen=True)
class LayerArrays:
    """Prefix sums over the layers (index i holds the sum of layers < i; length N + 1).

    ``cut_bytes[s]`` is every activation byte crossing the cut before layer ``s`` (outputs
    of layers < s read by a layer >= s, each tensor counted once); ``frontier_bytes[s]``
    adds layer s-1's own output when nothing after reads it (PipeDream's antichain size).
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

    @property
    def layers(self) -> int:
        return len(self.compute_ms) - 1

    def compute(self, i: int, j: int) -> float:
        both_ends = i == 0 and j == self.layers and self.layers > 1
        return float(self.compute_ms[j] - self.compute_ms[i]) - (self.shared_ends_ms if both_ends else 0.0)

    def params(self, i: int, j: int) -> float:
        return float(self.param_bytes[j] - self.param_bytes[i])

    def saved(self, i: int, j: int) -> float:
        return float(self.saved_bytes[j] - self.saved_bytes[i])


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


def layer_arrays(profile: Profile, optimizer: str | None = None) -> LayerArrays:
    """Prefix sums and cut sizes of ``profile``; compute includes ``optimizer``'s step. O(N + edges)."""
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
        saved_bytes=_prefix([layer.saved_bytes for layer in layers]),
        output_bytes=_prefix([layer.output_bytes for layer in layers]),
        cut_bytes=cut,
        frontier_bytes=frontier,
        shared_ends_ms=profile.data_ms if optimizer is not None and n > 1 else 0.0,
    )


def ring_allreduce_ms(param_bytes, replicas, bandwidth_bytes_per_s: float, latency_ms: float = 0.0):
    """Ring all-reduce of ``param_bytes`` among ``replicas``: 2(m-1)/m * P / B (+ 2(m-1) latencies).

    Works elementwise on numpy arrays. 0 for one replica.
    """
    m = np.asarray(replicas, dtype=np.float64)
    return 2.0 * (m - 1.0) / m * param_bytes / bandwidth_bytes_per_s * 1e3 + 2.0 * (m - 1.0) * latency_ms


def transfer_ms(cut_bytes, bandwidth_bytes_per_s: float, latency_ms: float = 0.0):
    """Activations forward plus gradients back over one cut: 2 a / B (+ 2 latencies) in ms."""
    return 2.0 * cut_bytes / bandwidth_bytes_per_s * 1e3 + np.where(cut_bytes > 0, 2.0 * latency_ms, 0.0)
