"""``pipeplan.profiler``: measure a model layer by layer (times, bytes) into a ``Profile``.

Modules: ``timing`` (CUDA-event / perf_counter timers, median and IQR), ``memory``
(output, parameter, saved-for-backward and backward working bytes), ``live_bytes`` (the
tensor storage bytes a window of code makes), ``measure`` (the layer-by-layer
training pass and the whole step), ``device`` (device, dtype, device name),
``profile_model`` (model file -> ``Profile``), ``pipedream_graph`` (PipeDream's profiled
graph file -> ``Profile``). The profile's table and summary are ``pipeplan.reporting.profile_table``.
"""

from pipeplan.profiler.profile_model import BUNDLED_MODELS, profile_model, resolve_model_path

__all__ = ["BUNDLED_MODELS", "profile_model", "resolve_model_path"]
