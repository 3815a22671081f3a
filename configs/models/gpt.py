"""A GPT-style decoder: token + learned position embedding, N pre-LN blocks, a tied head.

A bundled pipeplan model file. Attention uses
``F.scaled_dot_product_attention(..., is_causal=True)`` and reshapes without reading
tensor shapes, so the model traces with ``torch.fx``; the output head reuses the token
embedding matrix (``F.linear(x, wte.weight)``), a parameter shared by the first and the
last layer. Scale it with environment variables (defaults profile in a few seconds on a
CPU; GPT-2 small is ``PIPEPLAN_GPT_LAYERS=12 PIPEPLAN_GPT_DIM=768 PIPEPLAN_GPT_HEADS=12
PIPEPLAN_GPT_VOCAB=50257 PIPEPLAN_GPT_SEQ=1024``):

- ``PIPEPLAN_GPT_LAYERS`` transformer blocks (default 2)
- ``PIPEPLAN_GPT_DIM``    model width (default 128)
- ``PIPEPLAN_GPT_HEADS``  attention heads, dividing the width (default 4)
- ``PIPEPLAN_GPT_VOCAB``  vocabulary size (default 512)
- ``PIPEPLAN_GPT_SEQ``    sequence length in tokens (default 64)

Each sequence follows ``t[i+1] = (5 * t[i] + 3) mod vocab`` from a random start, so next-token
prediction is learnable. Targets are the next-token ids; the loss is cross-entropy over
(batch * seq, vocab). ``sample_batch`` is deterministic given ``torch.manual_seed``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

LAYERS = int(os.environ.get("PIPEPLAN_GPT_LAYERS", "2"))
DIM = int(os.environ.get("PIPEPLAN_GPT_DIM", "128"))
HEADS = int(os.environ.get("PIPEPLAN_GPT_HEADS", "4"))
VOCAB = int(os.environ.get("PIPEPLAN_GPT_VOCAB", "512"))
SEQ = int(os.environ.get("PIPEPLAN_GPT_SEQ", "64"))

if DIM % HEADS:
    raise ValueError(f"PIPEPLAN_GPT_DIM ({DIM}) must be a multiple of PIPEPLAN_GPT_HEADS ({HEADS})")


class LearnedPositions(nn.Module):
    """Adds a learned (seq, dim) position embedding to (batch, seq, dim) token embeddings."""

    def __init__(self, seq: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(seq, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each (batch, seq, dim)
        q = q.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)  # (batch, heads, seq, head_dim)
        k = k.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        v = v.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(-2))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = LearnedPositions(seq, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(dim)
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.wpe(self.wte(idx)))
        return F.linear(self.ln_f(x), self.wte.weight)  # tied output head: (batch, seq, vocab)


def build_model() -> nn.Module:
    return GPT(VOCAB, SEQ, DIM, HEADS, LAYERS)


def _affine_powers(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_i, b_i) with t[i] = (a_i * t[0] + b_i) mod VOCAB for the recurrence t' = 5t + 3."""
    scale, shift = [1], [0]
    for _ in range(length - 1):
        scale.append(5 * scale[-1] % VOCAB)
        shift.append((5 * shift[-1] + 3) % VOCAB)
    return torch.tensor(scale), torch.tensor(shift)


_SCALE, _SHIFT = _affine_powers(SEQ + 1)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, next_tokens)``: both int64 (batch_size, PIPEPLAN_GPT_SEQ)."""
    start = torch.randint(0, VOCAB, (batch_size, 1))
    tokens = (start * _SCALE + _SHIFT) % VOCAB  # the whole recurrence at once: (batch, SEQ + 1)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over (batch * seq, vocab)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
