"""Tensor parallelism in ``pipeplan run``: the (pipeline, data, tensor) device mesh (``mesh``).

A plan stage with ``tensor_parallel`` t > 1 runs each replica on t ranks: the stage's
column- and row-parallel linear pairs (``pipeplan.tensor_parallel.plans``) are split over
them with ``torch.distributed.tensor.parallel.parallelize_module``
(``pipeplan.tensor_parallel.apply``), on the tensor dimension of the mesh built here.
"""
