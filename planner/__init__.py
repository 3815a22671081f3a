"""The planner: PipeDream's hierarchical DP, memory model, placement and tensor-parallel pricing.

``partition(profile, topology, options) -> Plan`` is the entry point.
"""

from pipeplan.planner.partition import PartitionOptions, partition

__all__ = ["PartitionOptions", "partition"]
