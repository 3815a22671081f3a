"""Plans for other engines: torch.distributed.pipelining split points and schedules, torchtitan fragments."""

from pipeplan.export.pipelining import PipeliningExport, action_table_csv, export_pipelining, split_points
from pipeplan.export.structure import (
    SCHEDULE_CLASSES,
    TARGETS,
    TORCHTITAN_SCHEDULES,
    CutError,
    ModelStructure,
    check_exportable,
    check_plan,
    model_structure,
)
from pipeplan.export.torchtitan import TorchtitanExport, export_torchtitan, torchtitan_parts

__all__ = [
    "SCHEDULE_CLASSES",
    "TARGETS",
    "TORCHTITAN_SCHEDULES",
    "CutError",
    "ModelStructure",
    "PipeliningExport",
    "TorchtitanExport",
    "action_table_csv",
    "check_exportable",
    "check_plan",
    "export_pipelining",
    "export_torchtitan",
    "model_structure",
    "split_points",
    "torchtitan_parts",
]
