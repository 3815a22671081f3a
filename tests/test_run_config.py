"""The run configuration (``pipeplan.runtime.config``) and the click options generated from it."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pipeplan.cli.dataclass_options import config_from_options, config_options, dataclass_options
from pipeplan.cli.run import run
from pipeplan.errors import InputError
from pipeplan.optimizers import LR_SCHEDULES, OPTIMIZERS
from pipeplan.runtime.config import (
    BUILD_MODES,
    OPTION,
    BuildConfig,
    CheckpointConfig,
    OptimizerConfig,
    OutputConfig,
    RunConfig,
    ScheduleConfig,
    check_layer_recompute,
    check_options,
    check_recompute,
)
from pipeplan.schedules import SCHEDULE_NAMES

FIXTURES = Path(__file__).parent / "fixtures" / "runtime"
sys.path.insert(0, str(FIXTURES))

from plans import make_plan  # noqa: E402

GROUPS = (ScheduleConfig, OptimizerConfig, BuildConfig, CheckpointConfig, OutputConfig)


def _options_by_flag() -> dict[str, click.Option]:
    return {p.opts[0]: p for p in run.params if isinstance(p, click.Option)}


def test_every_option_field_is_one_click_option_with_its_flag_default_and_choices() -> None:
    generated = _options_by_flag()
    fields = config_options(RunConfig)
    assert [f.option.flag for f in fields] == list(generated)
    for field in fields:
        option = generated[field.option.flag]
        assert option.name == field.name
        assert option.help == field.option.help
        assert option.hidden == field.option.hidden
        if field.value_type is bool:
            assert option.is_flag and option.default == field.default
            assert option.flag_value == (not field.default)
        elif field.default is dataclasses.MISSING:
            assert option.required
        else:
            assert option.default == field.default
            assert bool(option.show_default) == (field.default is not None)
        if field.option.choices is not None:
            assert isinstance(option.type, click.Choice)
            assert tuple(option.type.choices) == field.option.choices


def test_the_options_keep_their_flags_types_and_choices() -> None:
    """As ``pipeplan run`` has always spelled them (flag -> click type name: a path is a file,
    a directory or either)."""
    options = _options_by_flag()
    kinds = {flag: option.type.name for flag, option in options.items()}
    assert kinds == {
        "--model": "file",
        "--steps": "integer",
        "--schedule": "choice",
        "--microbatches": "integer",
        "--recompute": "boolean",
        "--optimizer": "choice",
        "--lr": "float",
        "--weight-decay": "float",
        "--lr-schedule": "choice",
        "--warmup-steps": "integer",
        "--min-lr": "float",
        "--clip-grad-norm": "float",
        "--build": "choice",
        "--dtype": "choice",
        "--seed": "integer",
        "--checkpoint-dir": "directory",
        "--checkpoint-every": "text",  # N or auto
        "--checkpoint-overhead": "float",
        "--checkpoint-async": "boolean",
        "--resume": "boolean",
        "--weights": "path",
        "--metrics": "file",
        "--trace": "file",
        "--log-dir": "directory",
        "--no-progress": "boolean",
        "--record": "directory",
        "--timeout": "float",
        "--allow-nonfinite": "boolean",
    }
    assert list(options["--schedule"].type.choices) == list(SCHEDULE_NAMES)  # type: ignore[attr-defined]
    assert list(options["--optimizer"].type.choices) == list(OPTIMIZERS)  # type: ignore[attr-defined]
    assert list(options["--lr-schedule"].type.choices) == list(LR_SCHEDULES)  # type: ignore[attr-defined]
    assert options["--record"].hidden and not options["--model"].hidden
    assert options["--model"].required


def test_build_modes_are_the_capture_builds() -> None:
    from pipeplan.capture.materialise import BUILDS

    assert BUILD_MODES == BUILDS


def test_every_group_field_is_an_option() -> None:
    for group in GROUPS:
        assert all(OPTION in f.metadata for f in dataclasses.fields(group)), group.__name__


def _parse(tmp_path: Path, *args: str) -> RunConfig:
    """The ``RunConfig`` that ``pipeplan run PLAN args`` builds (without running it)."""
    plan = make_plan(
        str(FIXTURES / "mlp.py"), [[0, 1, 2], [3, 4, 5]], [1, 1], "1f1b-flush", batch_size=8, microbatches=2
    )
    built: list[RunConfig] = []

    @click.command()
    @dataclass_options(RunConfig)
    def command(**options: object) -> None:
        built.append(config_from_options(RunConfig, options, plan=plan))

    result = CliRunner().invoke(command, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return built[0]


def test_a_command_line_builds_the_nested_config(tmp_path: Path) -> None:
    config = _parse(
        tmp_path,
        "--model",
        "m.py",
        "--steps",
        "7",
        "--schedule",
        "gpipe",
        "--microbatches",
        "4",
        "--recompute",
        "--optimizer",
        "adamw",
        "--lr",
        "0.5",
        "--weight-decay",
        "0.1",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--min-lr",
        "0.01",
        "--clip-grad-norm",
        "1",
        "--build",
        "meta",
        "--dtype",
        "bfloat16",
        "--seed",
        "3",
        "--checkpoint-dir",
        "ck",
        "--checkpoint-every",
        "2",
        "--resume",
        "--weights",
        "w",
        "--metrics",
        "m.json",
        "--trace",
        "t.json",
        "--log-dir",
        "logs",
        "--no-progress",
        "--record",
        "rec",
        "--timeout",
        "9",
        "--allow-nonfinite",
    )
    assert config == RunConfig(
        plan=config.plan,
        model_path="m.py",
        steps=7,
        pipeline=ScheduleConfig(schedule="gpipe", microbatches=4, recompute=True),
        optim=OptimizerConfig(
            optimizer="adamw",
            lr=0.5,
            weight_decay=0.1,
            lr_schedule="cosine",
            warmup_steps=2,
            min_lr=0.01,
            clip_grad_norm=1.0,
        ),
        build=BuildConfig(mode="meta", dtype="bfloat16", seed=3),
        checkpoints=CheckpointConfig(directory="ck", every="2", resume=True, weights="w"),
        outputs=OutputConfig(
            metrics_path="m.json", trace_path="t.json", log_dir="logs", progress=False, record_dir="rec"
        ),
        timeout_s=9.0,
        allow_nonfinite=True,
    )
    assert (config.schedule, config.microbatches, config.optimizer) == ("gpipe", 4, "adamw")
    assert config.precision.dtype == "bfloat16" and config.precision.mixed


def test_defaults_come_from_the_fields_and_the_plan(tmp_path: Path) -> None:
    config = _parse(tmp_path, "--model", "m.py")
    assert config == RunConfig(plan=config.plan, model_path="m.py")
    assert config.steps == 10 and config.optim.lr == 0.01
    assert config.timeout_s == 300.0 and config.outputs.progress
    plan = config.plan
    assert (config.schedule, config.microbatches, config.optimizer) == (plan.schedule, 2, plan.optimizer)
    assert config.precision == plan.precision
    whole = dataclasses.replace(config, pipeline=ScheduleConfig(schedule="1f1b-rr", microbatches=4))
    assert whole.microbatches == 1  # 1F1B-RR takes whole minibatches


def test_recompute_runs_under_gpipe_only(tmp_path: Path) -> None:
    config = _parse(tmp_path, "--model", "m.py", "--recompute")
    with pytest.raises(InputError, match="--recompute applies to gpipe, not 1f1b-flush"):
        check_recompute(config)
    check_recompute(dataclasses.replace(config, pipeline=ScheduleConfig(schedule="gpipe", recompute=True)))


def test_checkpoint_every_takes_steps_or_auto_and_a_bad_value_is_one_line(tmp_path: Path) -> None:
    config = _parse(tmp_path, "--model", "m.py", "--checkpoint-every", "auto", "--checkpoint-async")
    assert config.checkpoints.interval is None and config.checkpoints.asynchronous
    assert config.checkpoints.overhead_pct == 3.5  # CheckFreq's figure
    assert _parse(tmp_path, "--model", "m.py", "--checkpoint-every", "4").checkpoints.interval == 4
    for flags, message in (
        (("--checkpoint-every", "often"), "--checkpoint-every must be an integer >= 0 or auto (got 'often')"),
        (("--checkpoint-every", "-1"), "--checkpoint-every must be an integer >= 0 or auto (got '-1')"),
        (("--checkpoint-overhead", "0"), "--checkpoint-overhead must be a percentage in (0, 100) (got 0.0)"),
    ):
        with pytest.raises(InputError) as error:
            check_options(_parse(tmp_path, "--model", "m.py", *flags))
        assert str(error.value) == message


def test_planned_layer_recomputation_runs_under_flush_schedules_without_mixed_precision(
    tmp_path: Path,
) -> None:
    config = _parse(tmp_path, "--model", "m.py")
    check_layer_recompute(config)  # no stage recomputes
    stages = (dataclasses.replace(config.plan.stages[0], recompute_layers=(1,)), *config.plan.stages[1:])
    recomputing = dataclasses.replace(config, plan=dataclasses.replace(config.plan, stages=stages))
    check_layer_recompute(recomputing)  # 1f1b-flush, float32
    with pytest.raises(
        InputError,
        match=r"recomputes layers of stage\(s\) \[0\], which runs under 1f1b-flush or gpipe, not 1f1b-rr",
    ):
        check_layer_recompute(dataclasses.replace(recomputing, pipeline=ScheduleConfig(schedule="1f1b-rr")))
    mixed = dataclasses.replace(
        recomputing, plan=dataclasses.replace(recomputing.plan, dtype="bfloat16", master_dtype="float32")
    )
    with pytest.raises(InputError, match="without mixed precision"):
        check_layer_recompute(mixed)


def test_planned_selective_recomputation_is_refused_where_layer_recomputation_is(tmp_path: Path) -> None:
    config = _parse(tmp_path, "--model", "m.py")
    stages = (dataclasses.replace(config.plan.stages[0], selective_layers=(1,)), *config.plan.stages[1:])
    selective = dataclasses.replace(config, plan=dataclasses.replace(config.plan, stages=stages))
    check_layer_recompute(selective)  # 1f1b-flush, float32
    with pytest.raises(
        InputError, match=r"recomputes layers of stage\(s\) \[0\], which runs under 1f1b-flush"
    ):
        check_layer_recompute(dataclasses.replace(selective, pipeline=ScheduleConfig(schedule="1f1b-rr")))
    mixed = dataclasses.replace(
        selective, plan=dataclasses.replace(selective.plan, dtype="bfloat16", master_dtype="float32")
    )
    with pytest.raises(InputError, match="without mixed precision"):
        check_layer_recompute(mixed)
