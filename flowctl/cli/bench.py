"""`flowctl bench`: measured speed, as JSON (stdout with --json, a file with --out) and a table (on
stdout, or on stderr beside --json; the progress on stderr: consoles.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from flowctl.bench.host import line as host_line
from flowctl.cli import consoles
from flowctl.cli.tables import Col, fit
from flowctl.engine.errors import FlowctlError
from flowctl.training.rundir import write_atomic

SUITES = ("engine", "strategies", "prefetch", "placement", "peers", "fusion", "launches", "scaling", "dataparallel")


@click.command()
@click.argument("target")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Also write the JSON here.")
@click.option("--quick", is_flag=True, help="Smaller sizes, for a smoke test.")
@click.option("--algorithms", default="single,expert,greedy", show_default=True,
              help="Placers to measure (a spec target).")
@click.option("--steps", default=5, show_default=True,
              help="Timed steps per placement and round (a spec target).")
@click.option("--rounds", default=3, show_default=True,
              help="Rounds in which the placements take turns (a spec target).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Change one spec key (YAML value), e.g. --set training.batch_size=64. Repeatable.")
@click.option("--full", is_flag=True, help="placement: the whole grid (2/4/8 GPUs x K40/V100/H100).")
@click.option("--learned-budget", default=20.0, show_default=True, help="placement: seconds per learned row.")
@click.option("--learned-steps", type=int, default=None,
              help="placement: policy updates per learned row instead of seconds (the same figures whatever "
                   "else the machine runs).")
@click.option("--rows", default=None, help="peers: rows to measure, comma-separated (default: "
              "lstm_lm,inception_v3_b8,inception_v3_infer_b8; also inception_v3_b32). placement: models "
              "or MODEL/NxPROFILE rows, e.g. lstm4,nmt/2xk40. scaling: models (lstm_lm,inception_v3).")
@click.option("--devices", "--device", "devices",
              help="A spec target: measure on these devices instead of the spec's (e.g. cpu:0,cpu:1). "
                   "peers: the one device both frameworks run on (cpu:0, the default, or gpu:0). "
                   "scaling: one worker's device profile (default gpu:h100).")
@click.option("--calibration", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="scaling: this machine's measured 1- and 2-worker points (default "
                   "benchmarks/results/dataparallel-cpu.json; absent: the table says uncalibrated).")
@click.option("--profile", is_flag=True, help="peers: also where each framework's step time goes, by op.")
@click.option("--threads", type=int, default=None,
              help="peers: threads for both frameworks (default: all CPUs). dataparallel: the one process's "
                   "threads (default 1; each Ray worker gets its device's share of the cores).")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
              help="peers: flowctl's training.precision, PyTorch's autocast type; launches: the rows' precision.")
@click.option("--reference-kernels", is_flag=True,
              help="peers: also time flowctl with its reference kernels only (no compiled variants), in the "
                   "same rounds: what the compiled kernels are worth.")
@click.option("--in-process", is_flag=True,
              help="peers: on a CPU, both frameworks in this one process (by default each runs in a process of "
                   "its own, taking turns: in one they share malloc's heap).")
@click.option("--peer-malloc", type=click.Choice(["flowctl", "stock"]), default="flowctl", show_default=True,
              help="peers: PyTorch's process with flowctl's malloc settings (the same allocator policy on both "
                   "sides) or glibc's defaults, as PyTorch ships.")
@click.option("--trace", "trace_dir", type=click.Path(file_okay=False, path_type=Path),
              help="A spec target: trace one more step of each placement into this directory "
                   "(trace-<placer>.json: chrome://tracing or ui.perfetto.dev).")
def bench(target: str, as_json: bool, out: Path | None, quick: bool, algorithms: str, steps: int,
          rounds: int, overrides: tuple[str, ...], full: bool, learned_budget: float, learned_steps: int | None,
          rows: str | None, devices: str | None, profile: bool, threads: int | None, trace_dir: Path | None,
          precision: str = "fp32", reference_kernels: bool = False, calibration: Path | None = None,
          in_process: bool = False, peer_malloc: str = "flowctl") -> None:
    """Benchmark TARGET: a built-in suite (`engine`: dispatch, Conv2D, LSTM cell; `strategies`: data
    parallel and pipeline ratios on 2 virtual CPU devices; `prefetch`: a slow input with and without
    prefetching; `fusion`: training steps with and without element-wise fusion; `scaling`: data
    parallel over 1-64 workers, simulated, parameter device vs ring all-reduce; `dataparallel`:
    lstm_lm over two Ray workers against one process, measured) or a spec file (placements measured on its devices beside the simulator's
    predictions; results also go to runs/bench-<name>.json)."""
    err = consoles.progress(soft_wrap=True)
    if trace_dir is not None and target in SUITES:
        raise FlowctlError(f"--trace traces a spec's placements; '{target}' is a built-in suite")
    if devices is not None and target in SUITES and target not in ("peers", "scaling"):
        raise FlowctlError(f"--devices chooses a spec's devices; '{target}' is a built-in suite")
    if target == "engine":
        from flowctl.bench.engine import run_engine_suite

        with err.status("benchmarking") as status:
            results = run_engine_suite(quick=quick, progress=lambda m: status.update(m))
        render: Any = _render
    elif target == "strategies":
        from flowctl.bench.strategies import strategy_benchmarks

        with err.status("benchmarking") as status:
            results = strategy_benchmarks(steps=2 if quick else steps, progress=lambda m: status.update(m))
        render = _render_ratios
    elif target == "prefetch":
        from flowctl.bench.prefetch import prefetch_benchmark

        with err.status("benchmarking: steps/s with and without prefetching a slow input"):
            results = prefetch_benchmark(steps=10 if quick else 40, rounds=2 if quick else 4)
        render = _render_ratios
    elif target == "placement":
        from flowctl.bench.placement import placement_suite

        with err.status("benchmarking placement") as status:
            results = placement_suite(full=full, learned_budget=2.0 if quick else learned_budget, rows=rows,
                                      learned_steps=learned_steps, progress=lambda m: status.update(m))
        render = _render_placement
    elif target == "launches":
        from flowctl.bench.launches import launches_suite

        picked = [r.strip() for r in rows.split(",") if r.strip()] if rows else None
        with err.status("counting") as status:
            results = launches_suite(picked, progress=lambda m: status.update(m), precision=precision)
        render = _render_launches
    elif target == "fusion":
        from flowctl.bench.fusion import fusion_benchmark

        with err.status("benchmarking") as status:
            results = fusion_benchmark(steps=steps, rounds=rounds, quick=quick, progress=lambda m: status.update(m))
        render = _render_ratios
    elif target == "scaling":
        from flowctl.bench.scaling import CALIBRATION, GPU, scaling_suite, select_models

        with err.status("simulating") as status:
            results = scaling_suite(select_models(rows), device=devices or GPU, calibration=calibration or CALIBRATION,
                                    progress=lambda m: status.update(m))
        render = _render_scaling
    elif target == "dataparallel":
        from flowctl.bench.dataparallel import dataparallel_benchmark

        with err.status("benchmarking") as status:
            results = dataparallel_benchmark(steps=1 if quick else steps, rounds=1 if quick else rounds,
                                             threads=threads or 1, progress=lambda m: status.update(m))
        render = _render_dataparallel
    elif target == "peers":
        results, render = _peers(err, rows, 1 if quick else steps, 1 if quick else rounds, threads, profile,
                                 devices or "cpu:0", precision, overrides, reference_kernels, in_process, peer_malloc)
    elif Path(target).exists():
        from flowctl.spec.loader import load_spec
        from flowctl.bench.spec import bench_spec

        from flowctl.spec.overrides import device_names

        names = device_names(devices) if devices else None
        if names:  # the spec's own kind of devices, named: as `train --devices` and `place --devices`
            overrides += (f"devices=[{', '.join(names)}]",)
        loaded = load_spec(target, overrides)
        algs = tuple(a.strip() for a in algorithms.split(",") if a.strip())
        with err.status("benchmarking") as status:
            results = bench_spec(loaded, algs, steps=2 if quick else steps, rounds=1 if quick else rounds,
                                 devices=None if names else devices, progress=lambda m: status.update(m),
                                 trace=trace_dir)
        out = out or Path("runs") / f"bench-{results['spec']}.json"
        render = _render_spec
    else:
        raise FlowctlError(f"no spec file or built-in suite named '{target}'; built-in suites: {', '.join(SUITES)}")
    if out is not None:
        write_atomic(out, json.dumps(results, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(results, indent=2))
    render(consoles.result(as_json), results)  # tables wrapped to the terminal (err soft-wraps its status lines)


def _render_placement(console: Console, r: dict[str, Any]) -> None:
    from flowctl.bench.placement import PLACERS

    rows = []
    for row in r["rows"]:
        cells = []
        for alg in PLACERS:
            x = row["results"].get(alg)
            cells.append("-" if x is None else "rules" if x.get("kind") == "rules_overflow" else "x" if "error" in x
                         else f"{x['step_ms']:,.1f}")
        ratio = row.get("learned_vs_best_other")
        dev = row["devices"].replace("gpu:", "").split(":")[0] + (" cap" if row["capped"] else "")
        last = row.get("verdict") if row.get("verdict") == "does not fit (rules)" else \
            "-" if ratio is None else f"{ratio:.3f}"
        rows.append([row["model"], dev, *cells, last])
    cols = [Col("model"), Col("devices", "right")] + [Col(c, "right", True) for c in (*PLACERS, "learned/best")]
    console.print(fit("predicted step ms (simulated; x: failed, rules: the spec's device constraints leave no fit, "
                      "see --json; cap: 60% of the one-device need)",
                      cols, rows, console.width))


def _peers(err: Console, rows: str | None, steps: int, rounds: int, threads: int | None,
           profile: bool = False, device: str = "cpu:0", precision: str = "fp32",
           overrides: tuple[str, ...] = (), reference: bool = False, in_process: bool = False,
           peer_malloc: str = "flowctl") -> tuple[dict[str, Any], Any]:
    """`flowctl bench peers`: flowctl beside PyTorch (flowctl/bench/peers.py)."""
    from flowctl.bench.peers import run_peers
    from flowctl.engine.devices import canonical

    if "," in device:
        raise FlowctlError(f"bench peers runs both frameworks on one device; got '{device}'")
    short = canonical(device).rsplit("device:", 1)[1]
    picked = [r.strip() for r in rows.split(",") if r.strip()] if rows else None
    with err.status("benchmarking against PyTorch") as status:
        results = run_peers(picked, steps=steps, rounds=rounds, progress=lambda m: status.update(m), threads=threads,
                            profile=profile, device=short, precision=precision, overrides=overrides,
                            reference=reference, in_process=in_process, peer_malloc=peer_malloc)
    return results, _render_peers


def _render_launches(console: Console, r: dict[str, Any]) -> None:
    keys = ("launches", "custom", "syncs", "h2d", "allocations", "graph_launches")
    rows = []
    for name, row in r["rows"].items():
        for phase, c in row["phases"].items():
            rows.append([name if phase == "warm-up" else "", phase] + [f"{c[k]:,}" for k in keys])
    console.print(fit("per training step on the launch ledger (a GPU step's host side, counted on any machine)",
                      [Col("row"), Col("step")] + [Col(k, "right") for k in keys], rows, console.width))
    for name, row in r["rows"].items():
        what = (f"captured: {row['graph_nodes']:,} kernels in the graph" if row["captured"]
                else f"not captured: {row['reason']}")
        console.print(f"  {name} (batch {row['batch']}, {row.get('precision', 'fp32')}, {row['nodes']:,} nodes): {what}")


def _render_peers(console: Console, r: dict[str, Any]) -> None:
    rows = []
    for name, row in r["rows"].items():
        f, p = row["flowctl"], row["pytorch"]
        rows.append([name, f"{f['median_s']:.3f} [{f['ci95_s'][0]:.3f}-{f['ci95_s'][1]:.3f}]",
                     f"{p['median_s']:.3f} [{p['ci95_s'][0]:.3f}-{p['ci95_s'][1]:.3f}]",
                     f"{row['ratio']:.2f} [{row['ratio_ci95'][0]:.2f}-{row['ratio_ci95'][1]:.2f}]",
                     " / ".join(f"{row['memory'][k].get('gpu_peak_mib', row['memory'][k].get('peak_mib', 0)):,.0f}"
                                for k in ("flowctl", "pytorch"))
                     if "memory" in row else "-",
                     f"{row['params']['spec']:,} / {row['params']['pytorch']:,}"])
    console.print(fit(f"seconds per step, flowctl vs PyTorch (median of {r['rounds']} rounds x {r['steps']} "
                      f"steps, 95% interval)",
                      [Col("row")] + [Col(c, "right") for c in ("flowctl s", "PyTorch s", "ratio",
                                                                "peak MiB (flowctl / PyTorch; on a GPU its memory)",
                                                                "params (spec / twin)")],
                      rows, console.width))
    for name, row in r["rows"].items():
        if len(row.get("round_ratios", ())) > 1:
            per = row["round_ratios"]
            console.print(f"  {name}: round by round (each round's two blocks back to back) {min(per):.2f}-"
                          f"{max(per):.2f}, median {row['ratio_paired']:.2f}")
        if "flowctl_reference" in row:
            ref = row["flowctl_reference"]
            console.print(f"  {name}: flowctl with its reference kernels only {ref['median_s']:.3f} s "
                          f"[{ref['ci95_s'][0]:.3f}-{ref['ci95_s'][1]:.3f}]; the compiled kernels' step is "
                          f"{row['kernels_ratio']:.2f} of it")
        jit = row.get("memory", {}).get("jit")
        if jit:
            console.print(f"  {name}: flowctl's first step (building it included) "
                          f"{jit['first_step_s_empty_cache']:.1f} s with an empty JIT cache, "
                          f"{jit['first_step_s_warm_cache']:.1f} s with a warm one; PyTorch's "
                          f"{row['memory']['pytorch']['first_step_s']:.1f} s")
        if "ratio_captured" in row:
            cap, eager = row["pytorch_captured"], row.get("flowctl_eager")
            console.print(f"  {name} ({row['precision']}): PyTorch's step captured {cap['median_s'] * 1e3:.2f} ms, "
                          f"flowctl / that {row['ratio_captured']:.2f} [{row['ratio_captured_ci95'][0]:.2f}-"
                          f"{row['ratio_captured_ci95'][1]:.2f}]" + (
                              f"; flowctl eager {eager['median_s'] * 1e3:.2f} ms (capture x{row['capture_speedup']:.1f})"
                              if eager else ""))
    for name, row in r["rows"].items():
        if row.get("processes") == "one per framework":
            console.print(f"  {name}: each framework in a process of its own, taking turns; PyTorch's with "
                          + ("flowctl's malloc settings" if row["peer_malloc"] == "flowctl" else "glibc's malloc defaults"))
        elif row.get("processes") == "one":
            console.print(f"  {name}: both frameworks in this one process")
    m = r["machine"]
    if "gpu" in m:
        console.print(f"  on {m['device']}, {m['gpu']}: tensor-core peak (8192^2 product through PyTorch) "
                      f"{m['tf32_tflops']:.0f} TFLOP/s TF32, {m['bf16_tflops']:.0f} bf16; driver "
                      f"{m['cuda_driver']}, CUDA runtime {m['cuda_runtime']}, cupy {m['cupy']}, "
                      f"PyTorch {m['torch']} (CUDA {m['cuda_torch']}, cuDNN {m['cudnn_torch']})")
    blas = m["blas_gflops"]
    console.print(f"  BLAS peak (2048^2 float32 product): numpy {blas['numpy']:.0f} GFLOP/s, "
                  f"PyTorch {blas['pytorch']:.0f} GFLOP/s; {m['threads']} threads on "
                  f"{m['cpus']} CPUs" + (f" ({host_line(m['host'])})" if "host" in m else ""))
    for name, row in r["rows"].items():
        if "profile" in row:
            _render_profile(console, name, row["profile"])


def _render_profile(console: Console, name: str, prof: dict[str, Any]) -> None:
    """Where each framework's step goes, its costliest ops side by side."""
    f, p = prof["flowctl"], prof["pytorch"]
    cells = []
    for i in range(max(len(f["ops"]), len(p["ops"]))):
        row = []
        for side in (f, p):
            e = side["ops"][i] if i < len(side["ops"]) else None
            row += [e["op"], f"{e['ms']:,.1f}"] if e else ["", ""]
        cells.append(row)
    console.print(fit(f"{name}: ms per profiled step by op (flowctl {f['step_ms']:,.0f} ms, "
                      f"PyTorch {p['step_ms']:,.0f} ms under its profiler)",
                      [Col("flowctl op"), Col("ms", "right"), Col("PyTorch op"), Col("ms ", "right")],
                      cells, console.width))


def _render_scaling(console: Console, r: dict[str, Any]) -> None:
    """`bench scaling`: a table per link, one row per (model, workers), the two schemes side by side."""
    def table(title: str, rows: list[dict[str, Any]]) -> None:
        by: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
        for x in rows:
            by.setdefault((x["model"], x["workers"]), {})[x["scheme"]] = x
        cells, last = [], None
        for (model, n), schemes in by.items():
            cells.append([model if model != last else "", str(n)] + [c for s in ("parameter_device", "allreduce") for c in (
                f"{schemes[s]['examples_per_s']:,.0f}", f"{schemes[s]['speedup']:.2f}x",
                f"{100 * schemes[s]['efficiency']:.0f}%")])
            last = model
        cols = [Col("model"), Col("workers", "right", True)] + [
            Col(f"{s} {c}", "right", True) for s in ("param device", "allreduce")
            for c in ("examples/s", "speed-up", "eff.")]
        console.print(fit(title, cols, cells, console.width))

    for name, link in r["links"].items():
        table(f"simulated data parallel over {name} ({link['bandwidth_Bps'] / 1e9:.1f} GB/s, "
              f"{link['latency_s'] * 1e6:.0f} us), one {r['device']} per worker at the spec's batch (weak "
              f"scaling); allreduce: ring, {r['bucket_mib']:g} MiB buckets overlapping the backward pass; "
              f"param device: one, worker 0's; eff.: speed-up / workers", [x for x in r["rows"] if x["link"] == name])
    c = r["calibration"]
    rates = ", ".join(f"{s} {k['bandwidth_Bps'] / 1e9:.2f} GB/s at {k['latency_s'] * 1e3:.1f} ms"
                      for s, k in c["links"].items())
    calibrated = c["status"] == "calibrated"
    if calibrated:
        head = (f"calibrated on {c['file']}: compute x{c['compute_scale']:.2f} the simulator's, per-step overhead "
                f"{c['overhead_s'] * 1e3:.1f} ms, links {rates} (fitted: {', '.join(c['fitted']) or 'none'})")
    else:
        head = (f"uncalibrated: no measured points at {c['file']}; the simulator's CPU step, the nominal Ray "
                f"link ({c['links']['allreduce']['bandwidth_Bps'] / 1e9:.2f} GB/s)")
    table(f"{c['model']} on this machine's CPU worker (1 thread) over Ray, {head}", c["rows"])
    cells = [[p["scheme"], str(p["workers"]), f"{p['predicted_examples_per_s']:,.1f}",
              "-" if p["measured_examples_per_s"] is None else f"{p['measured_examples_per_s']:,.1f}",
              "-" if p["ratio"] is None else f"{p['ratio']:.2f}"] for p in c["points"]]
    console.print(fit(f"{c['model']}, predicted beside measured (examples/s): "
                      f"{'calibrated' if calibrated else 'uncalibrated'}",
                      [Col("scheme"), Col("workers", "right", True), Col("predicted", "right", True),
                       Col("measured", "right", True), Col("predicted / measured", "right", True)],
                      cells, console.width))


def _render_dataparallel(console: Console, r: dict[str, Any]) -> None:
    """`bench dataparallel`: examples/s of each row and its ratio to one process at `threads`."""
    one = r["one_process"]["examples_per_s"]
    rows = [("1 process", r["one_process"], f"{r['threads']} thread(s)"),
            ("1 process", r["one_process_all_threads"], f"{r['cores']} threads"),
            *((("2 processes, no exchange (ceiling)", r["two_processes"],
                f"{r['threads']} thread(s) each"),) if "two_processes" in r else ()),
            *((f"2 Ray workers, {s}", r["two_workers"][s], f"{r['threads']} thread(s) each")
              for s in ("allreduce", "parameter_device"))]
    body = [[name, threads, str(f["batch"]), f"{f['step_s'] * 1e3:,.0f}",
             f"{f['examples_per_s']:,.1f} [{min(f['rounds_examples_per_s']):,.1f}-"
             f"{max(f['rounds_examples_per_s']):,.1f}]", f"{f['examples_per_s'] / one:.2f}x"]
            for name, f, threads in rows]
    where = f"{r['cores']} cores" + (f": {host_line(r['host'])}" if "host" in r else "")
    console.print(fit(f"{r['model']}: data parallel on this machine ({where}), median of "
                      f"{r['rounds']} rounds x {r['steps']} steps [rounds' range]",
                      [Col("row"), Col("threads"), Col("batch", "right"), Col("step ms", "right"),
                       Col("examples/s", "right"), Col(f"vs 1 process, {r['threads']} thread(s)", "right")],
                      body, console.width))
    if "two_processes" in r:
        ceiling = r["two_processes"]["examples_per_s"]
        console.print("  of the ceiling: " + ", ".join(
            f"{s} {r['two_workers'][s]['examples_per_s'] / ceiling:.0%}" for s in ("allreduce", "parameter_device")))
    if "ray_idle" in r:
        idle = r["ray_idle"]
        console.print(f"  Ray's own processes with two idle actors: {idle['ms_per_s']:.0f} ms of CPU per second, "
                      f"{idle['share_of_cores']:.1%} of the cores")


def _render_ratios(console: Console, r: dict[str, Any]) -> None:
    """A flat table of a suite's figures (nested results one level down)."""
    rows = []
    for k, v in r.items():
        items = v.items() if isinstance(v, dict) else [("", v)]
        for sub, val in items:
            if isinstance(val, (int, float, str)):
                rows.append([f"{k}.{sub}" if sub else k, f"{val:,.3f}" if isinstance(val, float) else str(val)])
    console.print(fit("results", [Col("figure"), Col("value", "right")], rows, console.width))


def spec_table(r: dict[str, Any]) -> tuple[list[Col], list[list[str]], list[str]]:
    """`bench SPEC`'s table: columns, rows, and the notes under it (what the speed-up column
    compares with; why a placer has no row of figures). Numeric columns hold numbers or "-"."""
    base = r.get("one_device_all_threads")  # virtual CPU devices only; with a GPU, `single` is the baseline
    ref = r.get("one_device_reference")
    cols = [Col("placement")] + [Col(c, "right") for c in ("devices", "predicted ms", "measured ms", "error",
                                                           "examples/s")]
    cols += [Col("vs best 1 device", "right")] if ref else []
    base_label = f"1 device, {base['threads']} threads" if base else ""

    def measured(p: dict[str, Any]) -> str:
        lo, med, hi = (p[k] * 1e3 for k in ("measured_low_s", "measured_step_s", "measured_high_s"))
        return f"{med:,.1f} [{lo:,.1f}-{hi:,.1f}]"

    def speedup(p: dict[str, Any]) -> list[str]:
        return [f"{ref['step_s'] / p['measured_step_s']:.2f}x"] if ref else []

    rows, notes = [], []
    if base:
        rows.append([base_label, "1", "-", measured(base), "-", f"{base['examples_per_s']:,.1f}", *speedup(base)])
    for alg, p in r["placements"].items():
        if p.get("error") is not None:
            rows.append([alg, "-", "-", "-", "-", "-", *(["-"] if ref else [])])
            notes.append(f"{alg}: not measured: {p['error']}")
            continue
        rows.append([alg, str(len(p["devices_used"])), f"{p['predicted_step_s'] * 1e3:,.1f}", measured(p),
                     f"{100 * p['prediction_error']:+.0f}%", f"{p['examples_per_s']:,.1f}", *speedup(p)])
    if ref:
        name = base_label if ref["name"] == "one_device_all_threads" else ref["name"]
        others = []
        if base and ref["name"] != "one_device_all_threads":
            others.append(f"{base_label}: {base['measured_step_s'] * 1e3:,.1f} ms")
        single = r["placements"].get("single", {})
        if ref["name"] != "single" and single.get("error") is None and len(single.get("devices_used", [])) == 1:
            others.append(f"single: {single['measured_step_s'] * 1e3:,.1f} ms")
        which = f"the faster one-device run ({'; '.join(others)})" if others else "the only one-device run measured"
        notes.insert(0, f"vs best 1 device: the step of {name} ({ref['step_s'] * 1e3:,.1f} ms), {which}, "
                        f"over each row's")
    return cols, rows, notes


def _render_spec(console: Console, r: dict[str, Any]) -> None:
    cols, rows, notes = spec_table(r)
    console.print(fit(f"{r['spec']}: measured vs predicted step time (batch {r['batch']}; median of "
                      f"{r['rounds']} rounds x {r['steps']} steps, 95% interval)", cols, rows, console.width))
    for line in notes:
        console.print(f"  {line}")
    for alg, path in r.get("traces", {}).items():
        console.print(f"  trace of one {alg} step: {path}")
    inp = r.get("input")
    if inp:
        h, w = inp["size"]
        model = inp["model_examples_per_s"]
        versus = "" if model is None else (f"; the model {model:,.1f} examples/s: the "
                                           f"{'input' if inp['limits'] == 'input' else 'model'} limits")
        console.print(f"  input: {inp['images_per_s']:,.1f} images/s decoded and augmented at {h}x{w} "
                      f"({inp['workers']} worker process(es), {inp['files']} files, measured alone){versus}")
    if "jitter" in r:
        exact = ", ".join(f"{alg} {p['predicted_exact_s'] * 1e3:,.1f}" for alg, p in r["placements"].items()
                          if p.get("error") is None)
        console.print(f"  predicted: the mean simulated step with each op's time off by its measured spread "
                      f"(sd of log {r['jitter']:.2f}); at exactly the profiled times (ms): {exact}")
    c = r.get("contention")
    if c:
        console.print(f"  contention: the step on 2 devices at once took {c['ratio']:.2f}x its time alone "
                      f"({c['together_s'] * 1e3:,.1f} vs {c['alone_s'] * 1e3:,.1f} ms); simulated as a "
                      f"{c['factor']:.2f}x slowdown while devices of one process compute together")
    if "same_ranking" in r:
        for p in r["pairs"]:
            what = {"same": "measured in the same order", "reversed": "measured in the OPPOSITE order",
                    "tie": "a tie: the measurements cannot separate them",
                    "predicted tie": "predicted even, but the measurements separate them",
                    "same placement": "the same placement"}[p["verdict"]]
            console.print(f"  {p['predicted_faster']} predicted {p['predicted_ratio']:.3f}x {p['other']}; measured "
                          f"{p['measured_ratio']:.3f}x [{p['measured_low']:.3f}-{p['measured_high']:.3f}], "
                          f"p={p['p']:.3f}: {what}")
        console.print(f"ranking predicted {r['ranking_predicted']}, measured {r['ranking_measured']}: "
                      f"{'consistent' if r['same_ranking'] else 'DIFFERENT'}")


def _render(console: Console, r: dict[str, Any]) -> None:
    rows = [[key.split("_")[1], str(r[key]["nodes"]), f"{r[key]['step_us_per_node']:.2f}",
             f"{r[key]['overhead_us_per_node']:.2f}"] for key in ("dispatch_chain", "dispatch_wide")]
    console.print(fit("engine: dispatch overhead (µs per node above the numpy call)",
                      [Col("graph")] + [Col(c, "right", True) for c in ("nodes", "step µs/node", "overhead µs/node")],
                      rows, console.width))
    rows = [[d["shape"], str(d["batch"]), f"{d['fwd_bwd_s'] * 1e3:.1f}", f"{d['matmul_same_flops_s'] * 1e3:.1f}",
             f"{d['ratio_to_matmul']:.2f}", f"{d['gflops_per_s']:.1f}"] for d in r["conv2d"]]
    console.print(fit("Conv2D forward+backward vs one matmul of the same FLOPs",
                      [Col("shape")] + [Col(c, "right", True)
                                        for c in ("batch", "ms", "matmul ms", "ratio", "GFLOP/s")],
                      rows, console.width))
    rows = [[d["shape"], str(d["batch"]), f"{d['gflops']:.2f}", f"{d['matmul_same_flops_s'] * 1e3:.1f}",
             *(f"{d[p]['ratio_to_matmul']:.2f}" for p in ("forward", "input_grad", "filter_grad"))]
            for d in r.get("conv2d_passes", [])]
    console.print(fit("Conv2D kernels vs the matmul of their FLOPs (kernel time / matmul time)",
                      [Col("shape")] + [Col(c, "right", True) for c in ("batch", "GFLOP", "matmul ms", "forward",
                                                                          "input grad", "filter grad")],
                      rows, console.width))
    d = r["lstm_cell"]
    console.print(f"LSTM cell (batch {d['batch']}, hidden {d['hidden']}, {d['nodes']} nodes) forward+backward: "
                  f"{d['fwd_bwd_s'] * 1e3:.2f} ms, {d['ratio_to_matmuls']:.2f}x its raw matmuls "
                  f"({d['raw_matmuls_s'] * 1e3:.2f} ms)")
