"""`flowctl` entry point. Each command lives in its own module; this file only wires them up and
turns every FlowctlError into one clear message and its exit code (a traceback is a bug)."""
from __future__ import annotations

import sys
from typing import Any

import click

from flowctl import __version__
from flowctl.engine.errors import FlowctlError


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


@click.group(cls=FlowctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flowctl")
def cli() -> None:
    """Declarative runner for dataflow machine learning (TensorFlow whitepaper, 2015).

    Exit codes: 0 ok, 1 other error, 2 spec error, 3 graph error, 4 placement error,
    5 execution error, 6 checkpoint error, 130 interrupted.
    """


def _register() -> None:
    from flowctl.cli import bench, demo, place, train

    cli.add_command(bench.bench)
    cli.add_command(demo.demo)
    cli.add_command(train.train)
    cli.add_command(train.resume)
    cli.add_command(place.place)
    import importlib.util

    if importlib.util.find_spec("flowctl.cli.spec_commands") is None:
        return  # the spec front end has not landed yet
    from flowctl.cli import spec_commands

    for cmd in spec_commands.COMMANDS:
        cli.add_command(cmd)


_register()


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
