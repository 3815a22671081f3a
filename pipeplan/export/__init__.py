"""Plans for other engines: torch.distributed.pipelining split points and schedules, torchtitan fragments."""

from pipeplan.export.pipelining import PipeliningExport, action_table_csv, export_pipelining, split_points
from pipeplan.export.run_check import StagedModel, StageRunError, check_staged
from pipeplan.export.stage_modules import (
    PipeliningStageModule,
    all_reduce_tied,
    pipelining_stage_modules,
    stage_examples,
    staged_loss,
)
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
    "PipeliningStageModule",
    "StageRunError",
    "StagedModel",
    "TorchtitanExport",
    "action_table_csv",
    "all_reduce_tied",
    "check_exportable",
    "check_plan",
    "check_staged",
    "export_pipelining",
    "export_torchtitan",
    "model_structure",
    "pipelining_stage_modules",
    "split_points",
    "stage_examples",
    "staged_loss",
    "torchtitan_parts",
]
