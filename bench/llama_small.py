"""A small Hugging Face Llama built from a config (no download), for `bench/bench_schedules.py`.

hidden 256, 16 decoder layers, 8 heads, intermediate 688, vocabulary 2048, 64 tokens:
about 14M parameters, each decoder layer one pipeplan layer (``LEAF_MODULES``).
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEQ = 64
CONFIG = LlamaConfig(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=16,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=2048,
    max_position_embeddings=256,
    use_cache=False,
)
LEAF_MODULES = ["LlamaDecoderLayer"]


def build_model() -> torch.nn.Module:
    return LlamaForCausalLM(CONFIG)


def sample_batch(batch_size: int):
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]
