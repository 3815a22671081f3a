"""Tensor parallelism in ``pipeplan run``: which parameters split (``plans``), the mesh (``mesh``), the split stage (``apply``).

A plan stage with ``tensor_parallel`` t > 1 runs each replica on t ranks: the stage's
column- and row-parallel linear pairs are split over them with
``torch.distributed.tensor.parallel.parallelize_module`` (``apply``), on the tensor
dimension of a (pipeline, data, tensor) ``DeviceMesh`` (``mesh``). ``plans`` holds the
built-in plans (Hugging Face GPT-2, BERT, Llama; pipeplan's GPT) and reads a model
file's ``TP_PLAN``. Importing this package does not import ``torch.distributed``'s
tensor modules; ``apply`` does.
"""
