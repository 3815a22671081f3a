"""A Hugging Face GPT-2 for pipeplan, built from a config: nothing is downloaded.

The model is used as transformers builds it (no wrapper): it returns a
``CausalLMOutputWithCrossAttentions``; pipeplan's default loss takes its ``.logits``
(batch, seq, vocab) against the (batch, seq) next-token targets. Its ``past_key_values``
cache is not a tensor and the loss does not use it, so pipeplan drops it (None) when
it captures the graph. Sizes come from the environment so that one file serves a
2-block smoke test and a 12-block profile:

    HF_GPT2_LAYERS=12 HF_GPT2_WIDTH=128 pipeplan profile docs/tutorial/hf_gpt2.py

Dropout is 0 so that a pipelined run can be compared with single-process training.
"""

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

LAYERS = int(os.environ.get("HF_GPT2_LAYERS", "2"))  # transformer blocks
WIDTH = int(os.environ.get("HF_GPT2_WIDTH", "64"))  # hidden size
SEQ = int(os.environ.get("HF_GPT2_SEQ", "32"))  # tokens per sample
VOCAB = 512

# Optional: module classes kept whole, one layer per call. Without it, a GPT2Block is
# 4 layers (ln_1, attn, ln_2, mlp); `pipeplan profile --leaf-modules GPT2Block` overrides.
LEAF_MODULES: list[str] = []


def build_model() -> torch.nn.Module:
    config = GPT2Config(
        n_layer=LAYERS,
        n_embd=WIDTH,
        n_head=4,
        n_positions=SEQ,
        vocab_size=VOCAB,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)  # lm_head.weight is transformer.wte.weight (tied)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # sequences that count up from a random start: a next-token task the model can learn
    start = torch.randint(0, VOCAB, (batch_size, 1))
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]  # inputs, next-token targets
