"""`flowctl runs [DIR]` (a table of the run directories in DIR, ./runs by default) and `flowctl
runs compare A B` (how B's spec differs from A's, as --set lines, and both runs' curves). Both read
only: a live run is not disturbed (flowctl.training.runs_view)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from flowctl.cli import consoles
from flowctl.cli.tables import Col, fit

DIR = click.Path(file_okay=False, path_type=Path)


def _value(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _wall(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def _name(path: str, directory: Path) -> str:
    """A run by its folder name; the directory listed, when it is the run, as given."""
    return path if Path(path) == directory else Path(path).name


class RunsGroup(click.Group):
    """`runs [DIR]` lists; `runs compare A B` compares: a first argument that is no subcommand's
    name is the directory to list."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("-h", "--help")):
            args = ["list", *args]
        return super().parse_args(ctx, args)


@click.group(cls=RunsGroup)
def runs() -> None:
    """The runs in a directory, and two of them compared.

    \b
    flowctl runs [DIR]           a table of DIR's runs (default ./runs): spec, strategy, steps,
                                 last and best metric, wall time, status
    flowctl runs compare A B     B's spec as --set lines on A's, and both runs' curves"""


@runs.command("list")
@click.argument("directory", required=False, default="runs", type=DIR)
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON on stdout.")
def list_command(directory: Path, as_json: bool) -> None:
    """A table of the runs in DIRECTORY (default ./runs), or of DIRECTORY itself if it is a run.
    Status: running (its lock is held), finished, interrupted (a signal, or the process gone),
    failed (an error)."""
    from flowctl.training.runs_view import list_runs

    views = list_runs(directory)
    con = consoles.result(as_json)
    if not views:
        con.print(f"no runs in {directory}")
    else:
        metrics = sorted({v.metric for v in views})
        shared = len(metrics) == 1  # then named once, in the title, and the table fits 80 columns
        rows = [[_name(v.path, directory), v.spec, v.strategy,
                 f"{v.step}/{v.planned if v.planned is not None else '?'}", *([] if shared else [v.metric]),
                 _value(v.last), _value(v.best) + (f" @{v.best_step}" if v.best_step is not None else ""),
                 _wall(v.seconds), v.status + (f": {v.detail}" if v.detail else "")] for v in views]
        cols = [Col("run"), Col("spec"), Col("strategy"), Col("steps", "right", True),
                *([] if shared else [Col("metric")]), Col("last", "right", True), Col("best", "right", True),
                Col("wall", "right", True), Col("status")]
        title = f"runs in {directory}" + (f" ({metrics[0]})" if shared else "")
        con.print(fit(title, cols, rows, con.width))
    if as_json:
        click.echo(json.dumps([v.to_dict() for v in views]))


@runs.command("compare")
@click.argument("a", type=DIR)
@click.argument("b", type=DIR)
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path),
              help="Also draw the curves into this PNG (needs matplotlib: flowctl[plot]).")
@click.option("--json", "as_json", is_flag=True, help="Print the differences and curves as JSON on stdout.")
def compare(a: Path, b: Path, png: Path | None, as_json: bool) -> None:
    """B's spec as --set lines on A's, and the two runs' loss (and keep_best metric) by step."""
    from flowctl.cli.charts import text_chart, write_png
    from flowctl.training.runs_view import compare_runs

    c = compare_runs(a, b)
    con = consoles.result(as_json, soft_wrap=True)
    con.print(f"{b} differs from {a} by:" if c.set else f"{a} and {b} have the same spec", markup=False,
              highlight=False)
    for line in c.set:
        con.print(f"  --set {_quoted(line)}", markup=False, highlight=False)
    for metric, curves in c.curves.items():
        con.print("")
        con.print(text_chart(f"{metric} by step", list(curves.items())), markup=False, highlight=False)
    if png is not None:
        write_png(png, c.curves)
        consoles.progress().print(f"wrote {png}", markup=False, highlight=False)
    if as_json:
        out: dict[str, Any] = c.to_dict()
        click.echo(json.dumps({**out, **({"png": str(png)} if png else {})}))


def _quoted(line: str) -> str:
    """A --set line as a shell word: quoted when the shell would split or expand it."""
    import shlex

    return shlex.quote(line)


COMMANDS = [runs]
