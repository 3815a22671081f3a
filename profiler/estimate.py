"""What-if profiles: a GPT's per-layer costs on a device not at hand, from its datasheet rates.

``estimate_gpt(shape, rates, batch_size)`` builds a ``Profile`` (marked ``estimated``)
for a Megatron GPT (learned position embeddings, pre-LayerNorm blocks of attention and a
4h GeLU MLP, a head tied to the embedding, vocab-parallel cross-entropy) without running
it: each kernel runs at its roofline, the slower of its FLOPs at the GEMM rate (peak x
``matmul_efficiency``) and its bytes at the HBM rate (datasheet x ``memory_efficiency``),
and a layer's time is the sum of its kernels':

    dense GEMMs: 24 h^2 FLOPs per token and block (QKV, projection, MLP), compute-bound: at
        s = 2048 tokens even one sequence per micro-batch gives them >= 700 FLOP/byte (h >=
        2304), far above the A100's ridge (~130 FLOP/byte at these efficiencies);
    attention's batched GEMMs (scores Q K^T and scores x V, per head [s, h/a] x [h/a, s]):
        4 s h FLOPs per token over 2 (2 h + a s) elements per token read and written, about
        s (h/a) / (s + 2 h/a) FLOP/byte: 88 at h/a = 96 (the 1.7B row, memory-bound), 138
        at h/a = 160 (the 1T row, at the ridge), and a larger share of the FLOPs in small
        GPTs (s / 6h: 15% at h = 2304, 1.3% at h = 25600): one reason small GPTs reach less
        of the peak than large ones;
    elementwise kernels (layer norms, GeLU, softmax, dropout, bias-dropout-add): bytes only,
        as Megatron's fused kernels read and write them (counts below, 2-byte elements);

with the FLOPs of Narayanan et al. (SC'21, eq. 3: per block and token 24 h^2 + 4 s h
forward, twice that backward; the head 2 h V forward). A backward kernel pair costs
twice its forward: of a GEMM's backward, half is the input gradient and half the weight
gradient (``backward_input_ms``: a zero-bubble schedule's "I" is everything but the
weight GEMMs, with the recomputed forward; the embedding's backward is all "W"). Full activation
recomputation (the paper's setting, ``recompute=True``) keeps only each block's input for
backward and runs its forward again inside the backward. Sizes follow Korthikanti et al.
(2022): a block saves s b h (34 + 5 a s / h) bytes without recomputation, of which
s b h (24 + 5 a s / h) split t ways (their Table 2: s b h (10 + 24 / t + 5 a s / (h t)) per
rank). Estimated without recomputation (``recompute=False``), a block also carries its
selective option (``LayerProfile.selective_saved_bytes``): recomputing only the attention
core (Q K^T, softmax, dropout on the scores, scores x V) frees the 5 a s^2 b bytes that grow
with s^2, leaving 34 s b h (Table 2's "selective": s b h (10 + 24 / t) per rank, 34 s b h / t
with sequence parallelism), at the core's forward again (``selective_recompute_ms``: the
two batched GEMMs, 4 b s^2 h FLOPs, at their roofline, plus softmax and dropout traffic,
4.5 a s elements per token). Every layer carries its tensor-parallel split
(``pipeplan.profile``): blocks split by heads, the embedding and head by the vocabulary.
Parameters count 2 bytes each (``PARAM_BYTES``: Megatron's bf16 weights) with float32
masters (``master_dtype``), 18 bytes per parameter with Adam in the planner. Left out:
the cross-entropy's small all-reduces (3 floats per token), kernel launch
gaps, and the transient activations of the one block being recomputed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pipeplan.errors import InputError
from pipeplan.profile import DeviceInfo, LayerProfile, Profile

__all__ = [
    "DeviceRates",
    "DEVICE_RATES",
    "GPTShape",
    "estimate_gpt",
    "MATMUL_EFFICIENCY",
    "MEMORY_EFFICIENCY",
    "PARAM_BYTES",
    "MASTER_BYTES",
]

# Calibrated, not measured (no A100 at hand): the one factor that brings the roofline of the
# PTD-P paper's smallest row (1.7B, pure data parallelism: no pipeline, no tensor
# parallelism; its float32 gradient all-reduce after the last backward, 1% of the
# iteration) to its reported 137 TFLOP/s (``python bench/bench_ptdp.py --calibrate``:
# 0.6869; 0.6752 while the planner priced that all-reduce in bf16); every other row is
# then a prediction (README, "PTD-P's GPT configurations").
MATMUL_EFFICIENCY = 0.687
# Bandwidth-bound kernels reach about this share of the datasheet HBM rate (an assumption).
MEMORY_EFFICIENCY = 0.8
ELEMENT_BYTES = 2  # bf16 / fp16 activations and the GEMMs' weights
# Megatron's mixed precision: the layers run on bf16 weights (the profile's parameter bytes,
# 2 per parameter) and the optimizer keeps float32 masters, gradients and moments: the
# profile says master_dtype "float32" and the planner's memory rule (planner.memory) charges
# 2 + 4 + 4 + 8 = 18 bytes per parameter with Adam, Megatron's figure. The planner prices
# the replicas' gradient all-reduce on float32 gradients, 4 bytes per parameter
# (``Precision.gradient_ratio``), as pipeplan's runtime and Megatron's float32 main_grad
# all-reduce them; tensor-parallel all-reduces and pipeline sends carry bf16 activations.
PARAM_BYTES = 2
MASTER_BYTES = 4  # float32 masters, gradients and moments


@dataclass(frozen=True)
class DeviceRates:
    """A device's datasheet rates (dense 16-bit tensor-core FLOP/s, HBM bytes/s)."""

    name: str
    matmul_flops_per_s: float
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    source: str


DEVICE_RATES = {
    "a100-80gb": DeviceRates(
        "A100-SXM4-80GB",
        312e12,
        2.039e12,
        80 * 2**30,
        "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e",
    ),
    "a100-40gb": DeviceRates(
        "A100-SXM4-40GB",
        312e12,
        1.555e12,
        40 * 2**30,
        "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 1,555 GB/s HBM2",
    ),
    "h100-sxm": DeviceRates(
        "H100-SXM5-80GB",
        989e12,
        3.35e12,
        80 * 2**30,
        "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3",
    ),
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
        """Compute-bound GEMMs (``flops``) plus bandwidth-bound elementwise kernels (``elements``)."""
        return (flops / self.flops + elements * ELEMENT_BYTES / self.bytes) * 1e3

    def roofline_ms(self, flops: float, elements: float) -> float:
        """A kernel of ``flops`` over ``elements`` read and written: the slower of the two rates."""
        return max(flops / self.flops, elements * ELEMENT_BYTES / self.bytes) * 1e3


def _check(shape: GPTShape, batch_size: int) -> None:
    for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
        if getattr(shape, name) < 1:
            raise InputError(f"GPT {name} must be >= 1 (got {getattr(shape, name)})")
    if shape.hidden % shape.heads:
        raise InputError(f"GPT hidden size {shape.hidden} is not a multiple of its {shape.heads} heads")
    if batch_size < 1:
        raise InputError(f"batch size must be >= 1 (got {batch_size})")


def estimate_gpt(
    shape: GPTShape,
    rates: DeviceRates,
    batch_size: int,
    *,
    recompute: bool = True,
    matmul_efficiency: float = MATMUL_EFFICIENCY,
    memory_efficiency: float = MEMORY_EFFICIENCY,
    tp_efficiency: float = 1.0,
    mixed_precision: bool = True,
) -> Profile:
    """The what-if profile of ``shape`` on ``rates`` for minibatches of ``batch_size``
    sequences (module docstring). ``mixed_precision`` (Megatron's): 2-byte bf16 parameters
    with float32 masters, 18 bytes per parameter with Adam in the planner's memory rule;
    without it every tensor of training is 4-byte (16 bytes per parameter with Adam).
    Layers: the embedding, one per block, the head (final LayerNorm, logits,
    cross-entropy). O(layers)."""
    _check(shape, batch_size)
    if not (0 < matmul_efficiency <= 1 and 0 < memory_efficiency <= 1):
        raise InputError(f"efficiencies must be in (0, 1] (got {matmul_efficiency}, {memory_efficiency})")
    run = _Rates(
        rates.matmul_flops_per_s * matmul_efficiency, rates.memory_bandwidth_bytes_per_s * memory_efficiency
    )
    tokens = batch_size * shape.seq_len
    size = _Bytes(PARAM_BYTES if mixed_precision else MASTER_BYTES)
    layers = [_embedding(shape, tokens, run, size)]
    layers += [_block(shape, tokens, run, i + 1, recompute, size) for i in range(shape.layers)]
    layers.append(_head(shape, tokens, run, shape.layers + 1, size))
    count = sum(layer.param_bytes for layer in layers) / size.per - shape.vocab * shape.hidden  # tied once
    # optimizer steps are bandwidth-bound: float32 passes over the parameters (sgd: read the
    # weight and gradient, write the weight; each moment adds a read and a write), plus the
    # bf16 copy written back under mixed precision
    copy = PARAM_BYTES if mixed_precision else 0
    optimizer_ms = {
        name: (passes * MASTER_BYTES + copy) * count / run.bytes * 1e3
        for name, passes in (("sgd", 3), ("momentum", 5), ("adam", 7))
    }
    how = (
        f"what-if, not measured: {rates.source}; kernels at their roofline, GEMMs at {matmul_efficiency:g} of "
        f"peak (calibrated), bytes at {memory_efficiency:g} of HBM; Megatron GPT FLOP and byte counts; "
        + ("bf16 weights with float32 masters" if mixed_precision else "float32 weights")
        + ("; full activation recomputation" if recompute else "")
    )
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
        master_dtype="float32" if mixed_precision else None,
    )


@dataclass(frozen=True)
class _Bytes:
    """Bytes of a count of parameters, ``per`` each (whole bytes)."""

    per: float

    def __call__(self, count: int) -> int:
        return int(round(count * self.per))


def _embedding(shape: GPTShape, tokens: int, run: _Rates, size: _Bytes) -> LayerProfile:
    """Word (vocab-parallel: each rank looks up its rows, one all-reduce) + position embedding."""
    h = shape.hidden
    elements = 3 * tokens * h  # two lookups written, summed
    forward = run.ms(0.0, elements)
    return LayerProfile(
        0,
        "embedding",
        "VocabParallelEmbedding",
        (),
        forward,
        2 * forward,
        tokens * h * ELEMENT_BYTES,
        size((shape.vocab + shape.seq_len) * h),
        tokens * 8,
        backward_input_ms=0.0,  # token ids take no gradient: the whole backward is the tables' "W"
        model_inputs=(0,),
        tp_units=shape.vocab,
        tp_split_param_bytes=size(shape.vocab * h),
        tp_allreduce_bytes=tokens * h * ELEMENT_BYTES,
        tp_forward_allreduces=1,
        largest_param_bytes=size(shape.vocab * h),
    )


def _block(
    shape: GPTShape, tokens: int, run: _Rates, index: int, recompute: bool, size: _Bytes
) -> LayerProfile:
    """A transformer block; its GEMMs, softmax, attention dropout and GeLU split by heads."""
    h, a, s = shape.hidden, shape.heads, shape.seq_len
    # element reads + writes per token: GeLU on 4h (8h), scale-mask-softmax (2 a s) and
    # dropout (2.5 a s) on the scores split by heads; two LayerNorms (4h) and two
    # bias-dropout-adds (7h) repeated on every rank
    split_elements, repeated_elements = tokens * (8.0 * h + 4.5 * a * s), tokens * 11.0 * h
    # attention's two batched GEMMs per head: Q, K (scores, V) read, scores (output) written
    attention = 2 * run.roofline_ms(tokens * 2.0 * s * h, tokens * (2.0 * h + a * s))
    split_f = run.ms(tokens * 24.0 * h * h, split_elements) + attention
    repeated_f = run.ms(0.0, repeated_elements)
    split_b, repeated_b = 2 * split_f, 2 * repeated_f
    activation = tokens * h * ELEMENT_BYTES
    selective_saved, selective_ms = -1, -1.0
    if recompute:  # the backward runs the forward again first; only the block's input is kept
        split_b, repeated_b = split_b + split_f, repeated_b + repeated_f
        saved, split_saved = activation, 0
    else:
        saved = int(tokens * h * (34 + 5 * a * s / h))
        split_saved = int(tokens * h * (24 + 5 * a * s / h))
        # the attention core again (Korthikanti et al.'s selective): its GEMMs, softmax, dropout
        selective_saved, selective_ms = 34 * tokens * h, attention + run.ms(0.0, tokens * 4.5 * a * s)
    params = size(12 * h * h + 13 * h)
    # "W": the four weight GEMMs' gradients (grad_y.T @ x, as many FLOPs as their forward);
    # "I" is the rest: the input GEMMs, attention (no weights), the elementwise kernels, and
    # under recomputation the forward run again before them
    weight_ms = run.ms(tokens * 24.0 * h * h, 0.0)
    return LayerProfile(
        index,
        f"blocks.{index - 1}",
        "ParallelTransformerLayer",
        (index - 1,),
        split_f + repeated_f,
        split_b + repeated_b,
        activation,
        params,
        saved,
        tp_units=a,
        tp_split_forward_ms=split_f,
        tp_split_backward_ms=split_b,
        backward_input_ms=split_b + repeated_b - weight_ms,
        tp_split_param_bytes=size(12 * h * h + 7 * h),
        tp_split_saved_bytes=split_saved,
        tp_allreduce_bytes=activation,
        tp_forward_allreduces=2,
        tp_backward_allreduces=2 + (2 if recompute else 0),
        largest_param_bytes=size(4 * h * h),  # each MLP GEMM's weight (h x 4h)
        recompute_kept_bytes=activation,  # its input: what full recomputation keeps (Korthikanti et al.)
        selective_saved_bytes=selective_saved,
        selective_recompute_ms=selective_ms,
    )


def _head(shape: GPTShape, tokens: int, run: _Rates, index: int, size: _Bytes) -> LayerProfile:
    """Final LayerNorm, logits (column-parallel over the vocabulary, the tied embedding
    weight) and vocab-parallel cross-entropy; one all-reduce of the input gradient."""
    h, v = shape.hidden, shape.vocab
    split_f = run.ms(2.0 * tokens * h * v, 3.0 * tokens * v)  # logits written, softmax read + written
    repeated_f = run.ms(0.0, 2.0 * tokens * h)  # the LayerNorm
    split_b, repeated_b = run.ms(4.0 * tokens * h * v, 3.0 * tokens * v), 2 * repeated_f
    return LayerProfile(
        index,
        "head",
        "VocabParallelHead",
        (index - 1,),
        split_f + repeated_f,
        split_b + repeated_b,
        4,
        size(v * h + 2 * h),
        2 * tokens * h * ELEMENT_BYTES + tokens * v * ELEMENT_BYTES,
        tp_units=v,
        tp_split_forward_ms=split_f,
        tp_split_backward_ms=split_b,
        backward_input_ms=split_b + repeated_b - run.ms(2.0 * tokens * h * v, 0.0),  # less the weight GEMM
        tp_split_param_bytes=size(v * h),
        tp_split_saved_bytes=tokens * v * ELEMENT_BYTES,
        tp_allreduce_bytes=tokens * h * ELEMENT_BYTES,
        tp_backward_allreduces=1,
        largest_param_bytes=size(v * h),
    )
