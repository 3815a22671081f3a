"""Checkpoints of a pipeline run and weights in and out, keyed by the model's qualified names.

``store``: step folders of DCP files sealed by verified manifests; ``state``: a rank's
model, optimizer, scheduler and RNG state as qualified-name keys and back under any plan;
``pretrained``: ``run --weights`` (Hugging Face safetensors or a pipeplan checkpoint);
``write_weights``: ``pipeplan export-weights`` (a ``save_pretrained`` folder or a safetensors file).
"""
