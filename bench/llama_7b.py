"""A Llama with a 7B model's architecture, built from a config (no download): for `pipeplan profile`.

hidden 4096, 32 layers, intermediate 11008, vocabulary 32000: 6.7e9 parameters, 27 GB in
float32. PIPEPLAN_LLAMA_LAYERS / PIPEPLAN_LLAMA_SEQ scale it down for quick runs.
"""

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

LAYERS = int(os.environ.get("PIPEPLAN_LLAMA_LAYERS", "32"))
SEQ = int(os.environ.get("PIPEPLAN_LLAMA_SEQ", "128"))
CONFIG = LlamaConfig(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=LAYERS,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    max_position_embeddings=4096,
    use_cache=False,
)
LEAF_MODULES = ["LlamaDecoderLayer"]


def build_model() -> torch.nn.Module:
    return LlamaForCausalLM(CONFIG)


def sample_batch(batch_size: int):
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]
