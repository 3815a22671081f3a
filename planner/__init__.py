"""The planner: PipeDream's hierarchical DP, memory model, placement and PipeDream import.

``partition(profile, topology, options) -> Plan`` is the entry point.
"""

from pipeplan.planner.partition import PartitionOptions, partition

__all__ = ["PartitionOptions", "partition"]
