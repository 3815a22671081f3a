"""``pipeplan profile``: measure a model file layer by layer and write profile.json."""

from __future__ import annotations

import click

__all__ = ["profile"]


@click.command(
    "profile",
    epilog="""\b
Examples:
  pipeplan profile mlp                                   # a bundled model: mlp, vgg, resnet, gpt
  pipeplan profile model.py -o profile.json --batch-size 64
  pipeplan profile gpt --device cuda --dtype bfloat16 --repeats 20
  PIPEPLAN_GPT_LAYERS=12 PIPEPLAN_GPT_DIM=768 pipeplan profile gpt --device cuda
  pipeplan profile hf_gpt2.py --leaf-modules GPT2Block    # one layer per GPT-2 block
""",
)
@click.argument("model", metavar="MODEL")
@click.option(
    "-o",
    "--output",
    "output_path",
    type=click.Path(dir_okay=False),
    default="profile.json",
    show_default=True,
    help="Where to write the profile (JSON, schema pipeplan.profile/2).",
)
@click.option(
    "--batch-size",
    "-b",
    type=int,
    default=32,
    show_default=True,
    help="Samples per minibatch (passed to the model file's sample_batch).",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default=None,
    help="Where to measure (default: cuda when available, else cpu).",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help="Precision of the parameters and the floating-point inputs.",
)
@click.option("--warmup", type=int, default=3, show_default=True, help="Untimed passes before measuring.")
@click.option(
    "--repeats",
    type=int,
    default=10,
    show_default=True,
    help="Timed passes; times are the median, spread the interquartile range.",
)
@click.option(
    "--threads",
    type=int,
    default=None,
    help="CPU threads torch may use while measuring (default: torch's default).",
)
@click.option("--allow-nonfinite", is_flag=True, help="Profile even when the loss is NaN or infinite.")
@click.option(
    "--leaf-modules",
    "leaf_modules",
    default=None,
    metavar="CLASS,CLASS",
    help="Module classes kept whole, one layer per call (e.g. GPT2Block); "
    "overrides LEAF_MODULES in the model file.",
)
@click.option(
    "--opaque-modules",
    "opaque_modules",
    default=None,
    metavar="CLASS,CLASS",
    help="Module classes run as themselves, never traced into (opaque layers); overrides "
    "OPAQUE_MODULES in the model file. A module torch.export fails in is made opaque anyway.",
)
@click.option(
    "--build",
    "build",
    type=click.Choice(["auto", "eager", "meta"]),
    default="auto",
    show_default=True,
    help="eager: build the whole model and measure it at once; meta: build on the meta device and "
    "materialise one layer at a time (peak memory: the largest layer); auto: meta above 1 GiB "
    "of parameters and buffers.",
)
@click.option(
    "--no-whole-step",
    is_flag=True,
    help="With a meta build, measure the layers only, never the whole model at once "
    "(peak memory: the largest layer, whatever the depth).",
)
@click.option(
    "--time-every-layer",
    is_flag=True,
    help="With a meta build, time every layer (default: identical layers are timed once).",
)
def profile(
    model: str,
    output_path: str,
    batch_size: int,
    device: str | None,
    dtype: str,
    warmup: int,
    repeats: int,
    threads: int | None,
    allow_nonfinite: bool,
    leaf_modules: str | None,
    opaque_modules: str | None,
    build: str,
    time_every_layer: bool,
    no_whole_step: bool,
) -> None:
    """Measure MODEL (a model file, or a bundled model's name) layer by layer.

    Per layer: forward and backward time (median and spread over --repeats runs after
    --warmup), output, parameter and saved-for-backward bytes; and the whole model's
    measured step, to compare with the sum of the layers.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pipeplan.modelfile import parse_leaf_modules
    from pipeplan.profiler.profile_model import profile_model
    from pipeplan.reporting.profile_table import profile_table, summary_lines

    console = Console()
    if not console.is_terminal:  # a file or a pipe: no terminal width to respect
        console = Console(width=160)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    errors = Console(stderr=True)
    with Progress(*columns, console=errors, transient=True, disable=not errors.is_terminal) as bar:
        task = bar.add_task(f"profiling {model}: loading and tracing", total=None)

        def advance(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=f"profiling {model}: {label}")

        leaves = parse_leaf_modules(leaf_modules) if leaf_modules is not None else None
        result = profile_model(
            model,
            batch_size,
            device,
            dtype,
            warmup,
            repeats,
            advance,
            threads,
            allow_nonfinite=allow_nonfinite,
            leaf_modules=leaves,
            opaque_modules=parse_leaf_modules(opaque_modules) if opaque_modules is not None else None,
            build=build,
            time_every_layer=time_every_layer,
            whole_step=not no_whole_step,
        )
    result.save(output_path)
    console.print(profile_table(result))
    for line in summary_lines(result):
        console.print(line, highlight=False)
    console.print(f"wrote {output_path}", highlight=False)
