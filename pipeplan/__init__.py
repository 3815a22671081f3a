"""pipeplan: plan and run pipeline-parallel training of PyTorch models.

The three data contracts are the public surface; the subsystems
(``pipeplan.profiler``, ``pipeplan.planner``, ``pipeplan.runtime``) talk through them.
"""

from pipeplan.errors import InfeasibleError, InputError, PipeplanError, RuntimeFailure
from pipeplan.plan import Plan, Predicted, StagePlan
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.topology import DeviceSpec, Level, Topology

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "PipeplanError",
    "InputError",
    "InfeasibleError",
    "RuntimeFailure",
    "Profile",
    "LayerProfile",
    "DeviceInfo",
    "Topology",
    "Level",
    "DeviceSpec",
    "Plan",
    "StagePlan",
    "Predicted",
]
