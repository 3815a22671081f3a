"""What-if profiles: a GPT's per-layer costs on a device not at hand, from its datasheet rates.

``estimate_gpt(shape, rates, batch_size)`` builds a ``Profile`` (marked ``estimated``)
for a Megatron GPT (learned position embeddings, pre-LayerNorm blocks of attention and a
4h GeLU MLP, a head tied to the embedding, vocab-parallel cross-entropy) without running
it: each layer's time is a roofline sum

    GEMM FLOPs / (peak FLOP/s * matmul_efficiency) + elementwise bytes / (HBM B/s * memory_efficiency)

with the FLOPs of Narayanan et al. (SC'21, eq. 3: per block and token 24 h^2 + 4 s h
forward, twice that backward; the head 2 h V forward) and the bytes the fused kernels of
Megatron read and write (counts below, per token, 2-byte elements). Full activation
recomputation (the paper's setting, ``recompute=True``) keeps only each block's input for
backward and runs its forward again inside the backward. Sizes follow Korthikanti et al.
(2022): a block saves s b h (34 + 5 a s / h) bytes without recomputation, of which
s b h (24 + 5 a s / h) split t ways. Every layer carries its tensor-parallel split
(``pipeplan.profile``): blocks split by heads, the embedding and head by the vocabulary.
Parameters count 4 bytes each (``PARAM_BYTES``: Megatron's fp32 master state). Left out:
the cross-entropy's small all-reduces (3 floats per token), kernel launch
gaps, and the transient activations of the one block being recomputed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from pipeplan.errors import InputError
from pipeplan.profile import DeviceInfo, LayerProfile, Profile

__all__ = ["DeviceRates", "DEVICE_RATES", "GPTShape", "estimate_gpt", "MATMUL_EFFICIENCY", "MEMORY_EFFICIENCY", "PARAM_BYTES"]

# Calibrated, not measured (no A100 at hand): the one factor that brings the roofline of the
# PTD-P paper's smallest row (1.7B, pure data parallelism: no pipeline, no tensor
# parallelism, its all-reduce hidden) to its reported 137 TFLOP/s; every other row is then
# a prediction (README, "PTD-P's GPT configurations").
MATMUL_EFFICIENCY = 0.64
# Bandwidth-bound kernels reach about this share of the datasheet HBM rate (an assumption).
MEMORY_EFFICIENCY = 0.8
ELEMENT_BYTES = 2  # bf16 / fp16 activations and the GEMMs' weights
# Parameter bytes as the planner counts them: Megatron's mixed precision keeps fp32 main
# gradients, master weights and Adam moments, so the planner's memory rule (parameters x
# (1 weight + 1 gradient + 2 Adam moments)) on 4-byte parameters gives 16 bytes per
# parameter (Megatron: 18 with its 16-bit working copy), and gradients all-reduce in fp32
# as Megatron's main_grad does.
PARAM_BYTES = 4


@dataclass(frozen=True)
class DeviceRates:
    """A device's datasheet rates (dense 16-bit tensor-core FLOP/s, HBM bytes/s)."""

    name: str
    matmul_flops_per_s: float
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    source: str


DEVICE_RATES = {
    "a100-80gb": DeviceRates("A100-SXM4-80GB", 312e12, 2.039e12, 80 * 2**30,
                             "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e"),
    "a100-40gb": DeviceRates("A100-SXM4-40GB", 312e12, 1.555e12, 40 * 2**30,
                             "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 1,555 GB/s HBM2"),
    "h100-sxm": DeviceRates("H100-SXM5-80GB", 989e12, 3.35e12, 80 * 2**30,
                            "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3"),
}


@dataclass(frozen=True)
class GPTShape:
    layers: int
    hidden: int
    heads: int
    seq_len: int = 2048
    vocab: int = 51200

    @property
    def parameters(self) -> int:
        """Eq. 2 of the PTD-P paper: 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h))."""
        h, l = self.hidden, self.layers
        return 12 * l * h * h + 13 * l * h + (self.vocab + self.seq_len) * h

    def training_flops(self, batch_size: int) -> float:
        """Eq. 3 (full recomputation): 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) per iteration."""
        b, s, l, h, v = batch_size, self.seq_len, self.layers, self.hidden, self.vocab
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


@dataclass(frozen=True)
class _Rates:
    flops: float  # effective GEMM FLOP/s
    bytes: float  # effective HBM bytes/s

    def ms(self, flops: float, elements: float) -> float:
        return (flops / self.flops + elements * ELEMENT_BYTES / self.bytes) * 1e3


def _check(shape: GPTShape, batch_size: int) -> None:
    for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
        if getattr(shape, name) < 1:
            raise InputError(f"GPT {name} must be >= 1 (got {getattr(shape, name)})")
    if shape.hidden % shape.heads:
        raise InputError(f"GPT hidden size {shape.hidden} is not a multiple of its {shape.heads} heads")
    if batch_size < 1:
        raise InputError(f"batch size must be >= 1 (got {batch_size})")


def estimate_gpt(shape: GPTShape, rates: DeviceRates, batch_size: int, *, recompute: bool = True,
                 matmul_efficiency: float = MATMUL_EFFICIENCY, memory_efficiency: float = MEMORY_EFFICIENCY,
                 tp_efficiency: float = 1.0) -> Profile:
    """The what-if profile of ``shape`` on ``rates`` for minibatches of ``batch_size``
    sequences (module docstring). Layers: the embedding, one per block, the head (final
    LayerNorm, logits, cross-entropy). O(layers)."""
    _check(shape, batch_size)
    if not (0 < matmul_efficiency <= 1 and 0 < memory_efficiency <= 1):
        raise InputError(f"efficiencies must be in (0, 1] (got {matmul_efficiency}, {memory_efficiency})")
    run = _Rates(rates.matmul_flops_per_s * matmul_efficiency, rates.memory_bandwidth_bytes_per_s * memory_efficiency)
    tokens = batch_size * shape.seq_len
    layers = [_embedding(shape, tokens, run)]
    layers += [_block(shape, tokens, run, i + 1, recompute) for i in range(shape.layers)]
    layers.append(_head(shape, tokens, run, shape.layers + 1))
    params = sum(layer.param_bytes for layer in layers) - shape.vocab * shape.hidden * PARAM_BYTES  # tied once
    # optimizer steps are bandwidth-bound: fp32 bytes read and written per parameter byte
    optimizer_ms = {name: passes * params / run.bytes * 1e3 for name, passes in (("sgd", 3), ("momentum", 5), ("adam", 7))}
    how = (f"what-if, not measured: {rates.source}; GEMMs at {matmul_efficiency:g} of peak (calibrated), "
           f"elementwise at {memory_efficiency:g} of HBM; Megatron GPT FLOP and byte counts"
           + ("; full activation recomputation" if recompute else ""))
    key = f"gpt l={shape.layers} h={shape.hidden} a={shape.heads} s={shape.seq_len} V={shape.vocab}"
    return Profile(
        model=f"GPT {shape.parameters / 1e9:.1f}B ({key})",
        fingerprint="sha256:" + hashlib.sha256(key.encode()).hexdigest(),
        device=DeviceInfo("cuda", rates.name),
        batch_size=batch_size,
        dtype="bfloat16",
        layers=tuple(layers),
        step_ms=sum(layer.compute_ms for layer in layers),
        input_bytes=tokens * 8,
        optimizer_ms=optimizer_ms,
        tp_efficiency=tp_efficiency,
        estimated=how,
    )


def _embedding(shape: GPTShape, tokens: int, run: _Rates) -> LayerProfile:
    """Word (vocab-parallel: each rank looks up its rows, one all-reduce) + position embedding."""
    h = shape.hidden
    elements = 3 * tokens * h  # two lookups written, summed
    forward = run.ms(0.0, elements)
    return LayerProfile(
        0, "embedding", "VocabParallelEmbedding", (), forward, 2 * forward, tokens * h * ELEMENT_BYTES,
        (shape.vocab + shape.seq_len) * h * PARAM_BYTES, tokens * 8, model_inputs=(0,),
        tp_units=shape.vocab, tp_split_param_bytes=shape.vocab * h * PARAM_BYTES,
        tp_allreduce_bytes=tokens * h * ELEMENT_BYTES, tp_forward_allreduces=1,
    )


def _block(shape: GPTShape, tokens: int, run: _Rates, index: int, recompute: bool) -> LayerProfile:
    """A transformer block; its GEMMs, softmax, attention dropout and GeLU split by heads."""
    h, a, s = shape.hidden, shape.heads, shape.seq_len
    split_flops = tokens * (24.0 * h * h + 4.0 * s * h)
    # element reads + writes per token: GeLU on 4h (8h), scale-mask-softmax (2 a s) and
    # dropout (2.5 a s) on the scores split by heads; two LayerNorms (4h) and two
    # bias-dropout-adds (7h) repeated on every rank
    split_elements, repeated_elements = tokens * (8.0 * h + 4.5 * a * s), tokens * 11.0 * h
    split_f, repeated_f = run.ms(split_flops, split_elements), run.ms(0.0, repeated_elements)
    split_b, repeated_b = 2 * split_f, 2 * repeated_f
    activation = tokens * h * ELEMENT_BYTES
    if recompute:  # the backward runs the forward again first; only the block's input is kept
        split_b, repeated_b = split_b + split_f, repeated_b + repeated_f
        saved, split_saved = activation, 0
    else:
        saved = int(tokens * h * (34 + 5 * a * s / h))
        split_saved = int(tokens * h * (24 + 5 * a * s / h))
    params = (12 * h * h + 13 * h) * PARAM_BYTES
    return LayerProfile(
        index, f"blocks.{index - 1}", "ParallelTransformerLayer", (index - 1,), split_f + repeated_f,
        split_b + repeated_b, activation, params, saved,
        tp_units=a, tp_split_forward_ms=split_f, tp_split_backward_ms=split_b,
        tp_split_param_bytes=(12 * h * h + 7 * h) * PARAM_BYTES, tp_split_saved_bytes=split_saved,
        tp_allreduce_bytes=activation, tp_forward_allreduces=2, tp_backward_allreduces=2 + (2 if recompute else 0),
    )


def _head(shape: GPTShape, tokens: int, run: _Rates, index: int) -> LayerProfile:
    """Final LayerNorm, logits (column-parallel over the vocabulary, the tied embedding
    weight) and vocab-parallel cross-entropy; one all-reduce of the input gradient."""
    h, v = shape.hidden, shape.vocab
    split_f = run.ms(2.0 * tokens * h * v, 3.0 * tokens * v)  # logits written, softmax read + written
    repeated_f = run.ms(0.0, 2.0 * tokens * h)  # the LayerNorm
    split_b, repeated_b = run.ms(4.0 * tokens * h * v, 3.0 * tokens * v), 2 * repeated_f
    return LayerProfile(
        index, "head", "VocabParallelHead", (index - 1,), split_f + repeated_f, split_b + repeated_b, 4,
        (v * h + 2 * h) * PARAM_BYTES, 2 * tokens * h * ELEMENT_BYTES + tokens * v * ELEMENT_BYTES,
        tp_units=v, tp_split_forward_ms=split_f, tp_split_backward_ms=split_b,
        tp_split_param_bytes=v * h * PARAM_BYTES, tp_split_saved_bytes=tokens * v * ELEMENT_BYTES,
        tp_allreduce_bytes=tokens * h * ELEMENT_BYTES, tp_backward_allreduces=1,
    )
