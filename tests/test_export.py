"""`pipeplan export`: plans run by torch.distributed.pipelining and torchtitan, and refusals."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib
from click.testing import CliRunner
from ports import free_port

from pipeplan.cli import cli
from pipeplan.errors import InputError
from pipeplan.export import (
    ModelStructure,
    action_table_csv,
    check_plan,
    export_pipelining,
    model_structure,
    split_points,
    torchtitan_parts,
)
from pipeplan.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
BLOCKS = str(FIXTURES / "export" / "blocks.py")
MLP = str(FIXTURES / "runtime" / "mlp.py")
TIED = str(FIXTURES / "runtime" / "tied.py")
TRAIN_SCRIPT = ROOT / "docs" / "export" / "train_with_pipelining.py"
sys.path.insert(0, str(FIXTURES / "runtime"))

from plans import make_plan  # noqa: E402

LR = 0.05
STEPS = 3


def invoke(*args: str):
    return CliRunner().invoke(cli, ["export", *args])


def saved(plan: Plan, folder: Path, name: str = "plan.json") -> str:
    path = folder / name
    plan.save(path)
    return str(path)


def refusal(result) -> str:
    """The one error line of a refused export (exit code 2, nothing else printed)."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0][len("error: ") :]


# --------------------------------------------------------------------------- a planned MLP


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled MLP, profiled and partitioned straight, 1F1B-flush with 4 micro-batches."""
    folder = tmp_path_factory.mktemp("mlp")
    runner = CliRunner()
    profiled = runner.invoke(
        cli,
        [
            "profile",
            "mlp",
            "-o",
            str(folder / "profile.json"),
            "--batch-size",
            "32",
            "--warmup",
            "1",
            "--repeats",
            "3",
            "--threads",
            "1",
        ],
    )
    assert profiled.exit_code == 0, profiled.output
    planned = runner.invoke(
        cli,
        [
            "partition",
            str(folder / "profile.json"),
            "--topology",
            "local-cpu",
            "--straight",
            "--schedule",
            "1f1b-flush",
            "--microbatches",
            "4",
            "-o",
            str(folder / "plan.json"),
        ],
    )
    assert planned.exit_code == 0, planned.output
    assert len(Plan.load(folder / "plan.json").stages) == 2, planned.output
    return folder


def torchrun(args: list[str], cwd: Path, timeout_s: float = 180.0) -> str:
    """Two gloo ranks under torchrun in their own process group, killed after ``timeout_s`` seconds."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(args[:2])} ran past {timeout_s} s: {output[-2000:]}")
    assert process.returncode == 0, output[-3000:]
    return output


@pytest.mark.multiprocess
def test_exported_split_runs_on_pipelining_with_pipeplans_losses(mlp_plan: Path) -> None:
    plan = Plan.load(mlp_plan / "plan.json")
    first = plan.stages[1].layer_start
    exported = invoke(
        str(mlp_plan / "plan.json"),
        "--to",
        "pipelining",
        "--model",
        "mlp",
        "-o",
        str(mlp_plan / "split.json"),
    )
    assert exported.exit_code == 0, exported.output
    meta = json.loads((mlp_plan / "split.json").read_text())
    # the bundled MLP is an nn.Sequential: stage 1 begins at child `first`
    assert meta["split_points"] == [str(first)]
    assert meta["schedule_class"] == "Schedule1F1B" and meta["microbatches"] == 4
    assert meta["microbatch_size"] == plan.batch_size // 4
    (mlp_plan / "split.py").write_text(meta["python"])
    (mlp_plan / "schedule.csv").write_text(meta["csv"])

    torchrun(
        [
            "-m",
            "pipeplan",
            "run",
            "plan.json",
            "--model",
            "mlp",
            "--steps",
            str(STEPS),
            "--lr",
            str(LR),
            "--metrics",
            "metrics.json",
            "--no-progress",
        ],
        cwd=mlp_plan,
    )
    ours = json.loads((mlp_plan / "metrics.json").read_text())["losses"]
    common = [
        str(TRAIN_SCRIPT),
        "split.py",
        "--model",
        "mlp",
        "--batch-size",
        str(plan.batch_size),
        "--steps",
        str(STEPS),
        "--lr",
        str(LR),
    ]
    torchrun([*common, "--losses", "by_class.json"], cwd=mlp_plan)
    torchrun([*common, "--csv", "schedule.csv", "--losses", "by_csv.json"], cwd=mlp_plan)
    by_class = json.loads((mlp_plan / "by_class.json").read_text())["losses"]
    by_csv = json.loads((mlp_plan / "by_csv.json").read_text())["losses"]
    assert len(ours) == len(by_class) == len(by_csv) == STEPS
    assert by_class == pytest.approx(ours, rel=1e-5, abs=1e-6)
    assert by_csv == pytest.approx(ours, rel=1e-5, abs=1e-6)
    assert max(abs(loss - ours[0]) for loss in ours[1:]) > 1e-4  # training moved the weights
    # the engine ran the plan's stages and micro-batches, not merely the same maths
    held = [
        [f"{i}.{kind}" for i in stage.layers if i % 2 == 0 for kind in ("bias", "weight")]
        for stage in plan.stages
    ]  # the MLP's Linear children are the even ones
    for run in ("by_class.json", "by_csv.json"):
        record = json.loads((mlp_plan / run).read_text())
        assert record["microbatches"] == [4] * STEPS
        assert record["parameters_by_rank"] == [sorted(names) for names in held]


@pytest.mark.multiprocess
def test_tied_stage_modules_train_under_torchrun_with_identical_copies(tmp_path: Path) -> None:
    """tied.py's head reuses the embedding weight; cut between them, the export writes pipeplan's
    stage modules whose copies' gradients are summed: under torchrun (schedule class and CSV
    table) the losses are pipeplan run's and the two ranks' copies end identical."""
    plan = make_plan(TIED, [[0, 1], [2, 3, 4]], [1, 1], "1f1b-flush", batch_size=4, microbatches=2)
    plan.save(tmp_path / "plan.json")
    for name in ("split.py", "schedule.csv"):
        result = invoke(
            str(tmp_path / "plan.json"), "--to", "pipelining", "--model", TIED, "-o", str(tmp_path / name)
        )
        assert result.exit_code == 0, result.output
    assert "from pipeplan.export.stage_modules import" in (tmp_path / "split.py").read_text()
    common = [str(TRAIN_SCRIPT), "split.py", "--model", TIED, "--batch-size", "4", "--steps", str(STEPS)]
    torchrun([*common, "--lr", "0.5", "--losses", "by_class.json"], cwd=tmp_path)
    torchrun([*common, "--lr", "0.5", "--csv", "schedule.csv", "--losses", "by_csv.json"], cwd=tmp_path)
    run = ["-m", "pipeplan", "run", "plan.json", "--model", TIED, "--steps", str(STEPS), "--lr", "0.5"]
    torchrun([*run, "--metrics", "metrics.json", "--no-progress"], cwd=tmp_path)
    ours = json.loads((tmp_path / "metrics.json").read_text())["losses"]
    assert max(abs(loss - ours[0]) for loss in ours[1:]) > 1e-4  # training moved the weights
    for run_name in ("by_class.json", "by_csv.json"):
        record = json.loads((tmp_path / run_name).read_text())
        assert record["losses"] == pytest.approx(ours, rel=1e-5, abs=1e-6), run_name
        # both ranks hold the tied weight, and their copies stayed identical
        assert all("wte.weight" in names for names in record["parameters_by_rank"])
        assert record["tied_spread"] == {"wte.weight": 0.0}, run_name


def test_torchtitan_fragment_of_the_planned_mlp(mlp_plan: Path) -> None:
    plan = Plan.load(mlp_plan / "plan.json")
    result = invoke(str(mlp_plan / "plan.json"), "--to", "torchtitan", "--model", "mlp")
    assert result.exit_code == 0, result.output
    section = tomllib.loads(result.output)["parallelism"]
    # the MLP's units are its Sequential children "0".."8", one per layer
    assert section["module_fqns_per_model_part"] == [[str(i) for i in stage.layers] for stage in plan.stages]
    assert section["pipeline_parallel_degree"] == 2
    assert section["pipeline_parallel_schedule"] == "1F1B"
    assert section["pipeline_parallel_microbatch_size"] * 4 == plan.batch_size


def test_torchtitan_fragment_loads_into_torchtitans_own_config(mlp_plan: Path) -> None:
    """Where torchtitan is installed (0.3.0 checked; not a test dependency: it pulls datasets,
    wandb, tensorboard), the fragment is a valid ``ParallelismConfig`` of its config module,
    read from its source without importing the package (which imports its trainer's deps)."""
    import importlib.util

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtitan is not installed")
    source = Path(list(spec.submodule_search_locations)[0]) / "config" / "configs.py"
    loaded = importlib.util.spec_from_file_location("torchtitan_configs", source)
    assert loaded is not None and loaded.loader is not None
    configs = importlib.util.module_from_spec(loaded)
    sys.modules["torchtitan_configs"] = configs  # dataclasses look their module up
    loaded.loader.exec_module(configs)
    result = invoke(str(mlp_plan / "plan.json"), "--to", "torchtitan", "--model", "mlp")
    section = tomllib.loads(result.output)["parallelism"]
    parallelism = configs.ParallelismConfig(**section)  # an unknown key raises TypeError
    assert parallelism.module_fqns_per_model_part == section["module_fqns_per_model_part"]
    assert parallelism.pipeline_parallel_degree == 2


def test_zbv_plan_exports_in_torchs_v_order(tmp_path: Path) -> None:
    """A zb-v plan on 2 ranks: model stage 2 (chunk 1 of rank 0) holds the last layer, torch's
    stage 3; both engines get the stages along the layers and rank r builds (r, 3 - r)."""
    plan = make_plan(
        MLP, [[0, 1], [2], [5], [3, 4]], [1] * 4, "zb-v", batch_size=8, microbatches=4, virtual_stages=2
    )
    path = saved(plan, tmp_path)
    result = invoke(path, "--to", "torchtitan", "--model", MLP)
    assert result.exit_code == 0, result.output
    section = tomllib.loads(result.output)["parallelism"]
    assert section["module_fqns_per_model_part"] == [["0", "1"], ["2"], ["3", "4"], ["5"]]
    assert (
        section["pipeline_parallel_schedule"] == "ZBVZeroBubble" and section["pipeline_parallel_degree"] == 2
    )
    exported = invoke(path, "--to", "pipelining", "--model", MLP, "-o", str(tmp_path / "split.json"))
    assert exported.exit_code == 0, exported.output
    meta = json.loads((tmp_path / "split.json").read_text())
    assert meta["schedule_class"] == "ScheduleZBVZeroBubble" and meta["stage_style"] == "v"
    assert meta["split_points"] == ["2", "3", "5"]
    assert meta["stage_layers"] == [["0", "1"], ["2"], ["3", "4"], ["5"]]
    namespace: dict = {}
    exec(compile(meta["python"], "split.py", "exec"), namespace)
    assert [namespace["stage_ids"](rank, 4) for rank in range(2)] == [(0, 3), (1, 2)]
    assert meta["csv"].splitlines()[0].startswith("0F0,0F1,0F2,3F0,3I0,3W0")  # rank 0: stage 0, then 3


def test_dualpipev_plan_exports_to_torchs_class_and_torchtitans_name(tmp_path: Path) -> None:
    """A dualpipev plan on 2 ranks, 4 micro-batches (2P): torch's ScheduleDualPipeV in the V
    (rank r builds stages r and 3 - r), torchtitan's "DualPipeV"; its table's "B" cells are
    torch's FULL_BACKWARD beside the split ones."""
    plan = make_plan(
        MLP, [[0, 1], [2], [5], [3, 4]], [1] * 4, "dualpipev", batch_size=8, microbatches=4, virtual_stages=2
    )
    path = saved(plan, tmp_path)
    result = invoke(path, "--to", "torchtitan", "--model", MLP)
    assert result.exit_code == 0, result.output
    assert tomllib.loads(result.output)["parallelism"]["pipeline_parallel_schedule"] == "DualPipeV"
    exported = invoke(path, "--to", "pipelining", "--model", MLP, "-o", str(tmp_path / "split.json"))
    assert exported.exit_code == 0, exported.output
    meta = json.loads((tmp_path / "split.json").read_text())
    assert meta["schedule_class"] == "ScheduleDualPipeV" and meta["stage_style"] == "v"
    compute = [cell for cell in meta["csv"].splitlines()[0].split(",") if cell]
    assert compute[:6] == ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0"] and "3B1" in compute


@pytest.mark.parametrize("schedule", ["v-half", "v-min"])
def test_controllable_memory_vs_export_their_action_table(tmp_path: Path, schedule: str) -> None:
    """No torch class runs V-Half or V-Min: the snippet builds torch's _PipelineScheduleRuntime in
    the V and loads the plan's own table; torchtitan, which names classes only, refuses in one line."""
    plan = make_plan(
        MLP, [[0, 1], [2], [5], [3, 4]], [1] * 4, schedule, batch_size=8, microbatches=4, virtual_stages=2
    )
    path = saved(plan, tmp_path)
    exported = invoke(path, "--to", "pipelining", "--model", MLP, "-o", str(tmp_path / "split.json"))
    assert exported.exit_code == 0, exported.output
    meta = json.loads((tmp_path / "split.json").read_text())
    assert meta["schedule_class"] == "_PipelineScheduleRuntime" and meta["stage_style"] == "v"
    namespace: dict = {}
    exec(compile(meta["python"], "split.py", "exec"), namespace)
    assert namespace["ACTION_TABLE"] == meta["csv"] == action_table_csv(plan)
    assert [namespace["stage_ids"](rank, 4) for rank in range(2)] == [(0, 3), (1, 2)]
    assert refusal(invoke(path, "--to", "torchtitan", "--model", MLP)) == (
        f"plan schedule {schedule} has no torchtitan pipeline_parallel_schedule (no torch class runs it); "
        "`pipeplan export --to pipelining` runs its action table on torch's _PipelineScheduleRuntime"
    )


# --------------------------------------------------------------------------- torchtitan units


def test_torchtitan_fragment_lists_every_unit_once_in_stage_order(tmp_path: Path) -> None:
    import torch

    from pipeplan.modelfile import load_model_file

    # layers: 0 embed | 1-3 layers.0 | 4-6 layers.1 | 7-9 layers.2 | 10 head
    plan = make_plan(
        BLOCKS, [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], [1, 1], "gpipe", batch_size=12, microbatches=3
    )
    out = tmp_path / "pp.toml"
    result = invoke(saved(plan, tmp_path), "--to", "torchtitan", "--model", BLOCKS, "-o", str(out))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "2 stages on 2 ranks, GPipe, micro-batch size 4 samples",
        f"wrote {out}",
    ]
    section = tomllib.loads(out.read_text())["parallelism"]
    parts = section["module_fqns_per_model_part"]
    assert parts == [["embed", "layers.0"], ["layers.1", "layers.2", "head"]]
    model = load_model_file(BLOCKS).build()
    units = [
        f"{name}.{key}" if isinstance(child, torch.nn.ModuleList) else name
        for name, child in model.named_children()
        for key in (range(len(child)) if isinstance(child, torch.nn.ModuleList) else [None])
    ]
    flat = [unit for part in parts for unit in part]
    assert flat == units  # every unit once, in the model's order = stage order here
    structure = model_structure(BLOCKS, plan)
    for stage, part in zip(plan.stages, parts):  # each stage's layers live in its own units
        assert {
            structure.layer_names[i].rsplit(".", 1)[0]
            if "." in structure.layer_names[i]
            else structure.layer_names[i]
            for i in stage.layers
        } == set(part)
    assert section["pipeline_parallel_schedule"] == "GPipe"
    assert section["pipeline_parallel_microbatch_size"] == 4


def test_unit_without_layers_joins_the_stage_before_it() -> None:
    structure = ModelStructure(
        layer_names=("a", "b"),
        layer_parameters=(frozenset({"a.weight"}), frozenset({"b.weight"})),
        modules={"": "M", "a": "Linear", "unused": "Linear", "b": "Linear"},
        containers=frozenset(),
        calls={"": 1, "a": 1, "unused": 0, "b": 1},
    )
    assert torchtitan_parts(structure, [0, 1], 2) == (("a", "unused"), ("b",))


# --------------------------------------------------------------------------- split points


def test_pipelining_cuts_inside_a_block_torchtitan_refuses(tmp_path: Path) -> None:
    # stage 1 begins at layers.1.up: inside the ModuleList entry layers.1
    plan = make_plan(
        BLOCKS, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10]], [1, 1], "1f1b-flush", batch_size=8, microbatches=2
    )
    path = saved(plan, tmp_path)
    assert refusal(invoke(path, "--to", "torchtitan", "--model", BLOCKS, "-o", str(tmp_path / "x.toml"))) == (
        "cut between layer 4 (layers.1.norm, stage 0) and layer 5 (layers.1.up, stage 1) falls inside "
        "layers.1 (Block), which torchtitan keeps or deletes whole (its units: the model's children and "
        "the entries of a ModuleList/ModuleDict child); `--to pipelining` can cut there; "
        "`pipeplan partition PROFILE --for torchtitan` plans only such cuts"
    )
    assert not (tmp_path / "x.toml").exists()
    result = invoke(path, "--to", "pipelining", "--model", BLOCKS, "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["split_points"] == ["layers.1.up"]


def test_split_point_is_the_outermost_module_beginning_there(tmp_path: Path) -> None:
    plan = make_plan(
        BLOCKS, [[0], [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], [1, 1, 1], "gpipe", batch_size=6, microbatches=3
    )
    result = invoke(saved(plan, tmp_path), "--to", "pipelining", "--model", BLOCKS, "--format", "json")
    assert result.exit_code == 0, result.output
    # stage 1 begins at layers.0.norm, whose block layers.0 begins there too; not `layers` (embed is before)
    assert json.loads(result.output)["split_points"] == ["layers.0", "layers.2"]


def structure_of(names: tuple[str, ...], modules: tuple[str, ...]) -> ModelStructure:
    """Leaf modules ``modules`` under a root; a module is called once per layer naming it."""
    return ModelStructure(
        names,
        (frozenset(),) * len(names),
        {"": "M", **dict.fromkeys(modules, "L")},
        frozenset(),
        {"": 1, **{m: names.count(m) for m in modules}},
    )


def test_pipelining_refuses_a_stage_beginning_at_a_functional_op() -> None:
    structure = structure_of(("a", "add_1", "b"), ("a", "b"))
    with pytest.raises(InputError) as error:
        split_points(structure, [0, 1, 1])
    assert str(error.value) == (
        "stage 1 begins at layer 1 (add_1), a functional op, not a module: torch.distributed.pipelining "
        "splits before module calls; a plan that cuts before a module layer carries over"
    )
    assert split_points(structure, [0, 0, 1]) == ("b",)


def test_pipelining_refuses_a_stage_beginning_at_a_module_called_twice() -> None:
    structure = structure_of(("a", "shared", "b", "shared"), ("a", "shared", "b"))
    with pytest.raises(InputError) as error:
        split_points(structure, [0, 1, 1, 1])
    assert str(error.value) == (
        "stage 1 begins at layer 1 (shared), a module called 2 times per forward pass (layers 1, 3): "
        "SplitPoint.BEGINNING would split before every call; a plan whose stages begin at modules called "
        "once carries over"
    )


def test_torchtitan_refuses_a_functional_op_of_the_root() -> None:
    with pytest.raises(InputError) as error:
        torchtitan_parts(structure_of(("a", "add_1", "b"), ("a", "b")), [0, 0, 1], 2)
    assert str(error.value) == (
        "layer 1 (add_1) is a functional op of the root module: torchtitan places "
        "modules, not ops; `--to pipelining` carries it over"
    )


# --------------------------------------------------------------------------- refusals of the plan


@pytest.mark.parametrize("target", ["pipelining", "torchtitan"])
def test_refuses_1f1b_rr(tmp_path: Path, target: str) -> None:
    plan = make_plan(MLP, [[0, 1, 2], [3, 4, 5]], [1, 1], "1f1b-rr")
    assert refusal(invoke(saved(plan, tmp_path), "--to", target, "--model", MLP)) == (
        "plan schedule 1F1B-RR (PipeDream weight stashing, no flush) does not carry over: "
        "torch.distributed.pipelining and torchtitan run flush schedules only (1f1b-flush, gpipe, "
        "interleaved-1f1b, zb-h1, zb-v, v-half, v-min, dualpipev); re-plan with `pipeplan partition PROFILE --schedule 1f1b-flush --straight`"
    )


def test_refuses_2bw() -> None:
    plan = make_plan(MLP, [[0, 1, 2], [3, 4, 5]], [1, 1], "1f1b-flush", microbatches=2)
    object.__setattr__(plan, "schedule", "2bw")  # a registered schedule export refuses
    with pytest.raises(InputError) as error:
        check_plan(plan)
    assert str(error.value).startswith(
        "plan schedule 2BW (PipeDream-2BW double-buffered weights, no flush) does not carry over: "
    )
    assert str(error.value).endswith(
        "re-plan with `pipeplan partition PROFILE --schedule 1f1b-flush --straight`"
    )


@pytest.mark.parametrize("target", ["pipelining", "torchtitan"])
def test_refuses_uneven_replication(tmp_path: Path, target: str) -> None:
    plan = make_plan(MLP, [[0, 1, 2], [3, 4, 5]], [2, 1], "1f1b-flush", microbatches=2)
    assert refusal(invoke(saved(plan, tmp_path), "--to", target, "--model", MLP)) == (
        "plan replicates stages unevenly (replicas per stage 2, 1): torch.distributed.pipelining and "
        "torchtitan run one device per stage; re-plan with "
        "`pipeplan partition PROFILE --straight --schedule 1f1b-flush`"
    )


def test_interleaved_replicas_export_as_data_parallel_copies(tmp_path: Path) -> None:
    """PTD-P: 2 positions x 2 replicas x 2 chunks, 8 micro-batches of an 8-sample batch:
    each copy of the pipeline runs 4 micro-batches of its 4 samples under
    ScheduleInterleaved1F1B, torchtitan's data_parallel_replicate_degree = 2."""
    plan = make_plan(
        BLOCKS,
        [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9], [10]],
        [2, 2, 2, 2],
        "interleaved-1f1b",
        8,
        8,
        virtual_stages=2,
    )
    out = tmp_path / "pp.toml"
    result = invoke(saved(plan, tmp_path), "--to", "torchtitan", "--model", BLOCKS, "-o", str(out))
    assert result.exit_code == 0, result.output
    section = tomllib.loads(out.read_text())["parallelism"]
    assert section["data_parallel_replicate_degree"] == 2 and section["pipeline_parallel_degree"] == 2
    assert section["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert section["pipeline_parallel_microbatch_size"] == 1  # 4 samples per copy / 4 micro-batches
    made = export_pipelining(plan, model_structure(BLOCKS, plan))
    assert (made.schedule_class, made.replicas, made.batch_size, made.microbatches) == (
        "ScheduleInterleaved1F1B",
        2,
        4,
        4,
    )
    assert "the plan runs 2 copies of this pipeline (4 ranks)" in made.python()
    # the action table is one copy's: the unreplicated plan's of 4 micro-batches on 2 ranks
    one = make_plan(
        BLOCKS,
        [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9], [10]],
        [1] * 4,
        "interleaved-1f1b",
        4,
        4,
        virtual_stages=2,
    )
    assert made.csv == action_table_csv(one) and made.csv.splitlines()[1].split(",")[:3] == ["", "1F0", "1F1"]


@pytest.mark.parametrize(
    "replicas, schedule, micro, virtual, message",
    [
        ([2, 1], "gpipe", 2, 1, "plan replicates stages unevenly (replicas per stage 2, 1)"),
        ([2, 2], "gpipe", 3, 1, "plan routes 3 micro-batches of a 6-sample batch over 2 replicas"),
        ([2] * 4, "zb-v", 4, 2, "plan replicates every stage 2 times under zb-v, whose replicas share one"),
    ],
)
def test_refuses_replicas_the_engines_cannot_run(
    replicas: list[int], schedule: str, micro: int, virtual: int, message: str
) -> None:
    layers = [[0, 1, 2], [3, 4, 5]] if virtual == 1 else [[0], [1, 2], [4, 5], [3]]
    plan = make_plan(MLP, layers, replicas, schedule, 6 if micro == 3 else 8, micro, virtual_stages=virtual)
    with pytest.raises(InputError, match=re.escape(message)):
        check_plan(plan)


def test_refuses_a_stage_that_is_not_a_contiguous_range() -> None:
    plan = make_plan(MLP, [[0, 1, 2], [3, 4, 5]], [1, 1], "gpipe", microbatches=2)
    first, second = plan.stages
    plan = dataclasses.replace(
        plan,
        stages=(
            dataclasses.replace(first, layers=(0, 2), layer_start=0, layer_end=3),
            dataclasses.replace(second, layers=(1, 3, 4, 5), layer_start=1, layer_end=6),
        ),
    )
    with pytest.raises(InputError) as error:
        check_plan(plan)
    assert str(error.value) == (
        "plan stage 0 holds layers 0..2 but not 1: torch.distributed.pipelining and torchtitan cut the "
        "execution order, so every stage must be a contiguous range of layers; a plan cut along the layer "
        "order carries over"
    )


def test_refuses_fewer_microbatches_than_stages_for_1f1b(tmp_path: Path) -> None:
    plan = make_plan(MLP, [[0, 1], [2, 3], [4, 5]], [1, 1, 1], "1f1b-flush", batch_size=8, microbatches=2)
    assert refusal(invoke(saved(plan, tmp_path), "--to", "pipelining", "--model", MLP)) == (
        "plan runs 2 micro-batch(es) per minibatch on 3 stages: Schedule1F1B needs at least one per stage; "
        "re-plan with `--microbatches 3` (or more)"
    )


def test_refuses_a_parameter_shared_by_two_stages_for_torchtitan(tmp_path: Path) -> None:
    # tied.py: the head reuses the embedding's weight; layers 0 wte .. 4 head
    plan = make_plan(TIED, [[0, 1], [2, 3, 4]], [1, 1], "gpipe", batch_size=4, microbatches=2)
    assert refusal(invoke(saved(plan, tmp_path), "--to", "torchtitan", "--model", TIED)) == (
        "parameter wte.weight is shared by layer 0 (wte) in stage 0, layer 4 (head) in stage 1: "
        "torch.distributed.pipelining copies it into each stage and trains the copies apart, torchtitan "
        "keeps it on one stage; a plan that puts every layer using it in one stage carries over; "
        "`pipeplan partition PROFILE --for torchtitan` plans only such cuts"
    )


def test_exports_stage_modules_that_sum_a_tied_gradient(tmp_path: Path) -> None:
    # the same cut for pipelining: pipeplan's stage modules, the tied copies' gradients summed
    plan = make_plan(TIED, [[0, 1], [2, 3, 4]], [1, 1], "gpipe", batch_size=4, microbatches=2)
    result = invoke(
        saved(plan, tmp_path), "--to", "pipelining", "--model", TIED, "-o", str(tmp_path / "s.py")
    )
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1] == (
        "stages: pipeplan's stage modules in PipelineStage, since parameter wte.weight is used by stages "
        "0, 1 (tied), whose copies torch's pipeline() trains apart; the export sums their gradients"
    )
    assert result.output.splitlines()[2].startswith("checked: every stage ran forward and backward")
    snippet = (tmp_path / "s.py").read_text()
    assert 'TIED = {\n    "wte.weight": (0, 1),\n}' in snippet
    assert "STAGE_OF_LAYER = (0, 0, 1, 1, 1)" in snippet


def test_refuses_another_model_and_a_wrong_format(tmp_path: Path) -> None:
    plan = make_plan(MLP, [[0, 1, 2], [3, 4, 5]], [1, 1], "gpipe", microbatches=2)
    path = saved(plan, tmp_path)
    assert refusal(invoke(path, "--to", "pipelining", "--model", BLOCKS)).startswith(
        f"{BLOCKS} does not match the plan: model fingerprint sha256:"
    )
    assert refusal(invoke(path, "--to", "torchtitan", "--model", MLP, "--format", "python")) == (
        "--to torchtitan writes toml, csv, not python"
    )
    assert refusal(invoke(path, "--to", "torchtitan", "--model", MLP, "-o", str(tmp_path / "x.json"))) == (
        f"--to torchtitan writes toml, csv, not json (from the suffix of {tmp_path / 'x.json'}; pass --format)"
    )


# --------------------------------------------------------------------------- the action table


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 4), (3, 3), (3, 6)])
def test_action_table_loads_and_runs_in_torchs_simulator(
    schedule: str, stages: int, microbatches: int
) -> None:
    """torch validates the table, lowers it to sends/receives and dry-runs it without deadlock."""
    from torch.distributed.pipelining.schedules import (
        _Action,
        _add_send_recv,
        _simulate_comms_compute,
        _validate_schedule,
    )

    groups = [[0, 1], [2, 3], [4, 5]][: stages - 1] + [list(range(2 * (stages - 1), 6))]
    plan = make_plan(MLP, groups, [1] * stages, schedule, batch_size=12, microbatches=microbatches)
    rows = list(csv.reader(io.StringIO(action_table_csv(plan))))
    assert len(rows) == stages
    actions = {rank: [_Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}
    assert _validate_schedule(actions, stages, stages, microbatches) == {s: s for s in range(stages)}
    compute = {rank: [a for a in row if a is not None] for rank, row in actions.items()}
    for rank, row in compute.items():  # every micro-batch once forward, once backward, on its own stage
        assert sorted(str(a) for a in row) == sorted(
            f"{rank}{kind}{m}" for kind in "FB" for m in range(microbatches)
        )
    lowered = _add_send_recv(
        {r: list(row) for r, row in compute.items()}, stage_to_rank=lambda s: s, num_stages=stages
    )
    simulated = _simulate_comms_compute(lowered, lambda s: s, stages)
    assert {
        rank: [a for a in row if a is not None and a.is_compute_op] for rank, row in simulated.items()
    } == compute


@pytest.mark.parametrize(
    "schedule, virtual, ranks, microbatches",
    [("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 2, 2, 2), ("zb-h1", 1, 2, 4), ("zb-h1", 1, 3, 6)],
)
def test_action_table_of_chunked_and_split_backward_schedules(
    schedule: str, virtual: int, ranks: int, microbatches: int
) -> None:
    """Chunk c on rank r is torch stage c * ranks + r; I and W keep their letters; torch dry-runs it."""
    from torch.distributed.pipelining.schedules import (
        _Action,
        _add_send_recv,
        _simulate_comms_compute,
        _validate_schedule,
    )

    stages = virtual * ranks
    plan = SimpleNamespace(
        schedule=schedule, virtual_stages=virtual, stages=[None] * stages, microbatches=microbatches
    )
    rows = list(csv.reader(io.StringIO(action_table_csv(plan))))  # type: ignore[arg-type]
    actions = {rank: [_Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}
    assert _validate_schedule(actions, ranks, stages, microbatches) == {s: s % ranks for s in range(stages)}
    compute = {rank: [a for a in row if a is not None] for rank, row in actions.items()}
    kinds = {a.computation_type.value for row in compute.values() for a in row}
    assert kinds == ({"F", "I", "W"} if schedule == "zb-h1" else {"F", "B"})
    lowered = _add_send_recv(
        {r: list(row) for r, row in compute.items()}, stage_to_rank=lambda s: s % ranks, num_stages=stages
    )
    _simulate_comms_compute(lowered, lambda s: s % ranks, stages)


@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (2, 2), (4, 8), (4, 5)])
def test_zbv_table_is_torchs_own_zbv_order_in_a_v(ranks: int, microbatches: int) -> None:
    """zb-v's chunk 1 on rank r is torch's stage 2 * ranks - 1 - r; each rank's compute order is
    the one ScheduleZBVZeroBubble computes itself; torch validates the V and dry-runs it."""
    from torch.distributed.pipelining.schedules import (
        ScheduleZBVZeroBubble,
        _Action,
        _add_send_recv,
        _simulate_comms_compute,
        _validate_schedule,
    )

    stages = 2 * ranks
    plan = SimpleNamespace(
        schedule="zb-v", virtual_stages=2, stages=[None] * stages, microbatches=microbatches
    )
    rows = list(csv.reader(io.StringIO(action_table_csv(plan))))  # type: ignore[arg-type]
    actions = {rank: [_Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}
    v = {s: s if s < ranks else stages - 1 - s for s in range(stages)}
    assert _validate_schedule(actions, ranks, stages, microbatches) == v
    compute = {rank: [a for a in row if a is not None] for rank, row in actions.items()}
    torch_zbv = object.__new__(ScheduleZBVZeroBubble)  # its order alone, without stages or a group
    torch_zbv.pp_group_size, torch_zbv.num_stages, torch_zbv._n_microbatches = ranks, stages, microbatches
    for rank in range(ranks):
        theirs = [a for a in torch_zbv._calculate_single_rank_operations(rank) if a is not None]
        assert [str(a) for a in compute[rank]] == [str(a) for a in theirs]
    lowered = _add_send_recv(
        {r: list(row) for r, row in compute.items()}, stage_to_rank=v.get, num_stages=stages
    )
    _simulate_comms_compute(lowered, v.get, stages)


def test_action_table_lines_up_by_unit_step() -> None:
    plan = make_plan(MLP, [[0, 1, 2], [3, 4, 5]], [1, 1], "1f1b-flush", batch_size=8, microbatches=4)
    assert action_table_csv(plan) == ("0F0,0F1,,0B0,0F2,0B1,0F3,0B2,,0B3\n,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n")


def test_doctests() -> None:
    import doctest

    from pipeplan.export import pipelining, structure, torchtitan

    results = [doctest.testmod(module) for module in (pipelining, structure, torchtitan)]
    assert sum(r.attempted for r in results) >= 1 and sum(r.failed for r in results) == 0


# --------------------------------------------------------------------------- tensor parallelism


def tensor_parallel(plan: Plan, t: int) -> Plan:
    """``plan`` with every stage split ``t`` ways: replica-major groups of t ranks, on t x the devices."""
    topology = dataclasses.replace(
        plan.topology, levels=(dataclasses.replace(plan.topology.levels[0], count=plan.world_size * t),)
    )
    stages = tuple(
        dataclasses.replace(s, tensor_parallel=t, ranks=tuple(r * t + j for r in s.ranks for j in range(t)))
        for s in plan.stages
    )
    return dataclasses.replace(plan, topology=topology, world_size=topology.world_size, stages=stages)


def test_torchtitan_fragment_carries_the_tensor_parallel_degree(tmp_path: Path) -> None:
    plan = tensor_parallel(
        make_plan(
            BLOCKS, [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], [1, 1], "gpipe", batch_size=12, microbatches=3
        ),
        2,
    )
    out = tmp_path / "pp.toml"
    assert (
        invoke(saved(plan, tmp_path), "--to", "torchtitan", "--model", BLOCKS, "-o", str(out)).exit_code == 0
    )
    section = tomllib.loads(out.read_text())["parallelism"]
    assert (section["tensor_parallel_degree"], section["pipeline_parallel_degree"]) == (2, 2)
    plain = make_plan(
        BLOCKS, [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], [1, 1], "gpipe", batch_size=12, microbatches=3
    )
    assert (
        invoke(
            saved(plain, tmp_path, "plain.json"), "--to", "torchtitan", "--model", BLOCKS, "-o", str(out)
        ).exit_code
        == 0
    )
    assert tomllib.loads(out.read_text())["parallelism"]["tensor_parallel_degree"] == 1


def test_pipelining_refuses_tensor_parallel_plans(tmp_path: Path) -> None:
    plan = tensor_parallel(make_plan(MLP, [[0, 1, 2], [3, 4, 5]], [1, 1], "gpipe", microbatches=2), 2)
    assert refusal(invoke(saved(plan, tmp_path), "--to", "pipelining", "--model", MLP)) == (
        "plan splits every stage 2 ways (tensor_parallel 2): torch.distributed.pipelining runs one device per "
        "stage, without tensor parallelism; export --to torchtitan (tensor_parallel_degree) or re-plan with "
        "--tensor-parallel 1"
    )
