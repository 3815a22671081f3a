"""The ``pipeplan`` command: a thin click group, one module per command.

Commands are imported lazily so ``pipeplan --help`` never imports torch. Any
``PipeplanError`` (bad input, infeasible plan, failed run) is printed as one line on
stderr with exit code 2; never a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, NoReturn

import click

from pipeplan import __version__
from pipeplan.errors import PipeplanError

__all__ = ["main", "cli"]

# command name -> "module:attribute" of its click.Command
COMMANDS = {
    "profile": "pipeplan.cli.profile:profile",
    "partition": "pipeplan.cli.partition:partition",
    "run": "pipeplan.cli.run:run",
    "simulate": "pipeplan.cli.simulate:simulate",
    "report": "pipeplan.cli.report:report",
    "demo": "pipeplan.cli.demo:demo",
    "calibrate": "pipeplan.cli.calibrate:calibrate",
    "export": "pipeplan.cli.export:export",
    "estimate": "pipeplan.cli.estimate:estimate",
    "export-weights": "pipeplan.cli.export_weights:export_weights",
}


def fail(message: str) -> NoReturn:
    """Print ``error: message`` on one line to stderr and exit 2."""
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        return getattr(importlib.import_module(module_name), attribute)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PipeplanError as exc:
            fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pipeplan")
def cli() -> None:
    """Plan and run pipeline-parallel training (PipeDream 1F1B-RR and friends).

    \b
    pipeplan profile model.py -o profile.json
    pipeplan partition profile.json --topology cluster.yaml -o plan.json
    torchrun --nproc-per-node 2 -m pipeplan run plan.json --model model.py
    """


def main() -> None:
    fix_hash_seed()
    cli(prog_name="pipeplan")


def fix_hash_seed() -> None:
    """Run under ``PYTHONHASHSEED=0``: where it is unset (or ``random``), re-execute this command
    once with it set.

    Some models iterate a set of strings in their forward (transformers' ModernBERT, Gemma 3,
    OLMo 3 and others loop over ``set(config.layer_types)`` to compute their rotary tables), and
    a set's order follows the interpreter's string hashes, random per process unless
    ``PYTHONHASHSEED`` fixes them. The captured graph follows that order, and the profile, the
    plan's fingerprint and every rank of a run must capture one graph (ranks exchange values in
    an order derived from it)."""
    if os.environ.get("PYTHONHASHSEED", "random") not in ("", "random"):
        return
    os.environ["PYTHONHASHSEED"] = "0"
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
