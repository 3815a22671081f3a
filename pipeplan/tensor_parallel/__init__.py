"""Tensor parallelism's module rules: which parameters split (``plans``) and how a module is split (``apply``).

Below the profiler and the runtime: ``pipeplan profile`` reads the same rules to fill a
profile's ``tp_*`` fields (``pipeplan.profiler.tensor_split``) as ``pipeplan run`` uses to
split a stage. ``plans`` reads a model file's ``TP_PLAN``, else transformers' own plan
(``library``: ``config.base_model_tp_plan``), else the built-in plans (Hugging Face GPT-2,
BERT, Llama; pipeplan's GPT); ``apply`` runs a module in
DTensor's global view over a 1-D tensor mesh. Importing this package does not import
``torch.distributed``'s tensor modules; ``apply`` does.
"""
