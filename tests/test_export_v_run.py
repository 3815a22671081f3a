"""The exported V plans run under torch's own classes on gloo with pipeplan's losses.

A zb-v, a dualpipev and a v-half plan of the MLP fixture on 2 ranks (4 stages in a V: rank 1 runs the
two middle stages back to back, a transfer to itself) are exported (``export --to
pipelining``: pipeplan's stage modules in ``PipelineStage``, since torch 2.13's traced stages
warm up by sending to the rank itself, which gloo refuses), trained 3 steps under
``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV`` / ``_PipelineScheduleRuntime`` with the
v-half plan's own action table loaded, and under ``pipeplan run`` in one launch of
2 gloo ranks (``tests/fixtures/export/compare_engines.py``): the losses must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from ports import free_port
from test_export_targets import LR, STEPS, launch

from pipeplan.cli import cli

FIXTURES = Path(__file__).parent / "fixtures"
MLP = str(FIXTURES / "runtime" / "mlp.py")


@pytest.mark.multiprocess
def test_exported_v_plans_run_under_torchs_classes_with_pipeplans_losses(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(FIXTURES / "runtime"))
    from plans import make_plan

    cases = []
    for schedule in ("zb-v", "dualpipev", "v-half"):
        plan = make_plan(
            MLP, [[0, 1], [2], [5], [3, 4]], [1] * 4, schedule, batch_size=8, microbatches=4, virtual_stages=2
        )
        plan.save(tmp_path / f"{schedule}.plan.json")
        snippet = tmp_path / f"{schedule}.split.py"
        args = ["export", str(tmp_path / f"{schedule}.plan.json"), "--to", "pipelining", "--model", MLP]
        result = CliRunner().invoke(cli, [*args, "-o", str(snippet)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert "pipeplan's stage modules in PipelineStage, since in a V" in snippet.read_text()
        cases.append(
            {
                "name": schedule,
                "model": MLP,
                "plan": str(tmp_path / f"{schedule}.plan.json"),
                "snippet": str(snippet),
                "steps": STEPS,
                "lr": LR,
                "ports": [free_port(), free_port()],
            }
        )
    launch(cases, tmp_path, timeout_s=240.0)
    for case in cases:
        torch_run = json.loads((tmp_path / f"{case['name']}.pipelining.json").read_text())
        ours = json.loads((tmp_path / f"{case['name']}.pipeplan.json").read_text())["losses"]
        assert len(ours) == STEPS and torch_run["microbatches"] == [4] * STEPS
        assert torch_run["losses"] == pytest.approx(ours, rel=1e-5, abs=1e-6), case["name"]
        assert max(abs(loss - ours[0]) for loss in ours[1:]) > 1e-5  # the weights moved
