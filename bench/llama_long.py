"""A small Hugging Face Llama on long sequences, built from a config (no download), for
`bench/bench_recompute.py`.

hidden 128, 4 decoder layers, 4 heads (2 key-value heads), intermediate 256, vocabulary 512,
1,024 tokens, eager attention: the attention core is the explicit matmul-softmax-dropout-matmul
chain of ``eager_attention_forward``, whose saved probabilities (heads x 1,024^2 floats per
sample and layer, 16 MiB) dominate the activations, the case selective recomputation frees.
No ``LEAF_MODULES``: a block kept whole would hide its attention core from the profiler.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEQ = 1024
CONFIG = LlamaConfig(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=SEQ,
    use_cache=False,
    attn_implementation="eager",
)


def build_model() -> torch.nn.Module:
    return LlamaForCausalLM(CONFIG)


def sample_batch(batch_size: int):
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ + 1))
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.logits.reshape(-1, CONFIG.vocab_size), target.reshape(-1))
