"""`flowctl bench`: measured speed, as JSON (stdout with --json, a file with --out) and a table."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from flowctl.engine.errors import FlowctlError
from flowctl.training.rundir import write_atomic

SUITES = ("engine",)


@click.command()
@click.argument("target")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Also write the JSON here.")
@click.option("--quick", is_flag=True, help="Smaller sizes, for a smoke test.")
def bench(target: str, as_json: bool, out: Path | None, quick: bool) -> None:
    """Benchmark TARGET: a built-in suite (`engine`) or a spec file."""
    err = Console(stderr=True)
    if target not in SUITES:
        if Path(target).exists():
            raise FlowctlError(f"benchmarking a spec ({target}) needs placement across devices, which this "
                               f"version does not have yet; built-in suites: {', '.join(SUITES)}")
        raise FlowctlError(f"no spec file or built-in suite named '{target}'; built-in suites: {', '.join(SUITES)}")
    from flowctl.engine.benchmarks import run_engine_suite

    with err.status("benchmarking") as status:
        results = run_engine_suite(quick=quick, progress=lambda m: status.update(m))
    if out is not None:
        write_atomic(out, json.dumps(results, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(results, indent=2))
    _render(err, results)


def _render(console: Console, r: dict[str, Any]) -> None:
    t = Table(title="engine: dispatch overhead (µs per node above the numpy call)")
    for col in ("graph", "nodes", "step µs/node", "overhead µs/node"):
        t.add_column(col, justify="right")
    for key in ("dispatch_chain", "dispatch_wide"):
        d = r[key]
        t.add_row(key.split("_")[1], str(d["nodes"]), f"{d['step_us_per_node']:.2f}", f"{d['overhead_us_per_node']:.2f}")
    console.print(t)
    t = Table(title="Conv2D forward+backward vs one matmul of the same FLOPs")
    for col in ("shape", "batch", "ms", "matmul ms", "ratio", "GFLOP/s"):
        t.add_column(col, justify="right")
    for d in r["conv2d"]:
        t.add_row(d["shape"], str(d["batch"]), f"{d['fwd_bwd_s'] * 1e3:.1f}", f"{d['matmul_same_flops_s'] * 1e3:.1f}",
                  f"{d['ratio_to_matmul']:.2f}", f"{d['gflops_per_s']:.1f}")
    console.print(t)
    d = r["lstm_cell"]
    console.print(f"LSTM cell (batch {d['batch']}, hidden {d['hidden']}, {d['nodes']} nodes) forward+backward: "
                  f"{d['fwd_bwd_s'] * 1e3:.2f} ms, {d['ratio_to_matmuls']:.2f}x its raw matmuls "
                  f"({d['raw_matmuls_s'] * 1e3:.2f} ms)")
