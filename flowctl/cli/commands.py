"""The `flowctl` command group. Each command lives in its own module; this file only wires them up
and turns every FlowctlError into one clear message and its exit code (a traceback is a bug).
The console script enters through `main.py`, which imports this module inside its Ctrl-C guard."""
from __future__ import annotations

import sys
from typing import Any

import click

from flowctl.cli import bench, demo, graph_page, place, run_commands, runs, spec_commands, train
from flowctl.engine.errors import FlowctlError
from flowctl.version import __version__


class FlowctlGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FlowctlError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except OSError as e:
            # The stages map the failures they expect (a run's files: exit 6); this is the net for
            # the rest, so that an operating-system error is still one line, not a traceback.
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"error: {where}{e.strerror or e}", err=True)
            sys.exit(1)
        except MemoryError as e:
            # A spec's sizes are bounded (spec/check.py), but a model under the bounds can still be
            # more than this machine holds: numpy's message says how much it asked for.
            click.echo(f"error: out of memory: {e or 'an allocation failed'}", err=True)
            sys.exit(1)


@click.group(cls=FlowctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flowctl")
def cli() -> None:
    """Declarative runner for dataflow machine learning (TensorFlow whitepaper, 2015).

    Exit codes: 0 ok, 1 other error, 2 spec error, 3 graph error, 4 placement error,
    5 execution error, 6 checkpoint or run-directory error (a damaged checkpoint, a failed write),
    130 interrupted (Ctrl-C), 143 terminated (SIGTERM); both write a checkpoint first.
    """


for command in (bench.bench, demo.demo, train.train, train.resume, place.place, graph_page.graph,
                *spec_commands.COMMANDS, *run_commands.COMMANDS, *runs.COMMANDS):
    cli.add_command(command)
