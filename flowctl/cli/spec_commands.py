"""`flowctl validate` and `flowctl inspect`: click commands and rich rendering, nothing else.

The result (the summary line, the tables, or `--json`, `--schema`) goes to stdout (consoles.py).
Spec problems raise SpecError, which the group in main.py prints and maps to exit code 2.
"""
from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console

from flowctl.cli import consoles
from flowctl.cli.tables import Col, fit
from flowctl.spec import json_schema, load_spec
from flowctl.spec.summary import summarize
from flowctl.training.program import place_for_training, step_memory


def _out() -> Console:
    return consoles.result(highlight=False, soft_wrap=True)


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _bytes(x: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def _shape(shape: list[Any]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


@click.command()
@click.argument("spec", required=False, type=click.Path(dir_okay=False))
@click.option("--schema", is_flag=True, help="Print the spec's JSON schema to stdout and exit.")
@click.option("--no-build", is_flag=True, help="Check the spec without building its graph.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Change one spec key (YAML value), e.g. --set training.batch_size=64. Repeatable.")
def validate(spec: str | None, schema: bool, no_build: bool, overrides: tuple[str, ...]) -> None:
    """Check SPEC: schema, blocks, layer shapes, devices, batch numbers; then everything `train`
    does before its first step: build the strategy's step and place it on the spec's devices.

    Exit 0 with a one-line summary, or the error and its exit code (2 spec, 3 graph, 4 placement).
    """
    if schema:
        click.echo(json.dumps(json_schema(), indent=2))
        return
    if spec is None:
        raise click.UsageError("give a SPEC file (or --schema)")
    loaded = load_spec(spec, overrides)
    trainable, frozen = loaded.params()
    nodes = ""
    if not no_build:
        placed = place_for_training(loaded)
        nodes = (f", {len(placed.step.graph):,} graph nodes in a training step placed by "
                 f"{placed.chosen.algorithm} on {len(placed.devices_used())} device(s)")
    s = loaded.spec
    _out().print(f"ok: {spec}: model '{s.model.name}', {len(loaded.layers)} layers, "
                 f"{trainable + frozen:,} parameters ({trainable:,} trainable){nodes}; "
                 f"{s.parallelism.strategy} × {s.parallelism.replicas}, batch {loaded.global_batch}, "
                 f"{len(s.devices)} device(s)")


@click.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON to stdout.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Change one spec key (YAML value), e.g. --set training.batch_size=64. Repeatable.")
def inspect(spec: str, as_json: bool, overrides: tuple[str, ...]) -> None:
    """Per-layer output shapes and parameters, totals, node count, FLOPs per training step and
    activation memory of SPEC (read off the graph it builds)."""
    loaded = load_spec(spec, overrides)
    report = summarize(loaded)
    report["memory"].update(step_memory(loaded))
    report["spec"] = spec
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    con = _out()
    rows = [[row["name"], row["type"], _shape(row["output_shape"]), f"{row['params']:,}", str(row["nodes"]),
             _si(row["forward_flops"])] for row in report["layers"]]
    con.print(fit(f"{report['name']} ({spec})", [Col("layer"), Col("type"), Col("output"), Col("params", "right", True),
                                                 Col("nodes", "right", True), Col("fwd FLOPs", "right", True)],
                  rows, con.width, title_justify="left"))
    if report["blocks"]:
        rows = [[row["name"], row["block"], _shape(row["output_shape"] or []), f"{row['params']:,}"]
                for row in report["blocks"]]
        con.print(fit("block instances", [Col("instance"), Col("block"), Col("output"), Col("params", "right", True)],
                      rows, con.width, title_justify="left"))
    p, n, f, m = report["params"], report["nodes"], report["flops"], report["memory"]
    con.print(f"parameters: {p['total']:,} ({p['trainable']:,} trainable, {p['non_trainable']:,} not)")
    con.print(f"nodes: {n['model']:,} in the model graph, {n['forward']:,} in the forward pass, "
              f"{n['training_step']:,} in a training step")
    con.print(f"FLOPs at batch {report['batch_size']}: forward {_si(f['forward'])}, training step "
              f"{_si(f['training_step'])}")
    con.print(f"memory at batch {report['batch_size']}: activations {_bytes(m['activation_bytes'])}, "
              f"parameters {_bytes(m['parameter_bytes'])}")
    con.print(f"a training step on {m['device'].rsplit('/', 1)[-1]} holds {_bytes(m['step_peak_bytes'])} at peak "
              f"({_bytes(m['step_resident_bytes'])} resident: parameters, optimizer slots "
              f"{_bytes(m['step_slot_bytes'])}, inputs), as "
              f"`place` simulates it")


COMMANDS = [validate, inspect]
