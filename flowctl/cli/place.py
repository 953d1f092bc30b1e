"""`flowctl place SPEC --explain`: which node runs where, and why (tables on stdout, or JSON with
--json, the tables then on stderr; the learned placer's progress on stderr: consoles.py)."""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import click
from rich.console import Console

from flowctl.cli import consoles
from flowctl.cli.tables import Col, fit
from flowctl.engine.devices import spec_name
from flowctl.engine.errors import FlowctlError, PlacementError
from flowctl.engine.placement import ALGORITHMS


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:,.2f}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@click.command()
@click.argument("spec")
@click.option("--algorithm", "-a", type=click.Choice(ALGORITHMS), help="Placer (default: the spec's).")
@click.option("--devices", help="The spec's device names (cpu:0,cpu:1), or a what-if cluster from profiles "
                                "(4xgpu:k40, 2xgpu:v100@nvlink).")
@click.option("--explain", is_flag=True, help="Per node (or layer): feasible set, constraints, candidates, choice.")
@click.option("--by", "by", type=click.Choice(["node", "layer"]), default="node", show_default=True)
@click.option("--limit", default=40, show_default=True, help="Rows of the explanation to show (0: all).")
@click.option("--batch", type=int, help="Batch size to cost (default: the spec's per-replica batch).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Change one spec key (YAML value), e.g. --set training.batch_size=64. Repeatable.")
@click.option("--json", "as_json", is_flag=True, help="The placement and its explanation as JSON on stdout.")
@click.option("--budget", help="learned: training time, e.g. 90s, 10m (default: the spec's time_budget_s).")
@click.option("--seed", type=int, default=0, show_default=True, help="learned: the policy's seed.")
@click.option("--steps", type=int, help="learned: policy updates to run (reproducible; the budget still stops it).")
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="learned: save training here (.npz).")
@click.option("--resume", is_flag=True, help="learned: continue the training saved in --checkpoint.")
@click.option("--warm-start", type=click.Path(dir_okay=False), help="learned: start from a policy trained "
              "on another graph or cluster (a --checkpoint file).")
@click.option("--reward", type=click.Choice(["simulated", "measured"]), default="simulated", show_default=True,
              help="learned: step times from the simulator, or measured on the devices (which must be here).")
def place(spec: str, algorithm: str | None, devices: str | None, explain: bool, by: str, limit: int,
          batch: int | None, overrides: tuple[str, ...], as_json: bool, budget: str | None, seed: int,
          steps: int | None, checkpoint: str | None, resume: bool, warm_start: str | None, reward: str) -> None:
    """Place SPEC's training step on its devices (or --devices) and show where every node runs and why."""
    from flowctl.spec.loader import load_spec
    from flowctl.spec.overrides import device_names
    from flowctl.training.program import plan

    names = device_names(devices) if devices else None
    if names:
        overrides += (f"devices=[{', '.join(names)}]",)
    what_if = None if names else devices
    loaded = _on_what_if(spec, overrides, what_if) if what_if else None
    if loaded is None:
        loaded = load_spec(spec, overrides)
    alg = algorithm or loaded.spec.placement.algorithm
    try:
        if reward == "measured" and alg != "learned":
            raise PlacementError("--reward measured is the learned placer's; add --algorithm learned")
        if alg == "learned":
            p = _place_learned(consoles.progress(), loaded, what_if, batch, budget, seed, steps, checkpoint, resume,
                               warm_start, reward)
        else:
            p = plan(loaded, algorithm, what_if, batch=batch)
    except PlacementError as e:
        if as_json:  # the whole story (every member of a conflict, every node on a full device)
            click.echo(json.dumps({"error": str(e), "details": e.details}, default=str))
        raise
    chosen = p.chosen
    if as_json:
        out = chosen.to_dict(nodes=explain)
        out["expected"] = chosen.expected().to_dict()
        out["compared"] = {k: (v.step_time if not isinstance(v, str) else v) for k, v in p.compared.items()}
        out["compared_expected"] = {k: v.expected().to_dict() for k, v in p.compared.items() if not isinstance(v, str)}
        out["cluster"] = p.cluster.describe()
        out["nodes_in_step"] = len(chosen.simulation.start)
        if explain and by == "layer":
            out["layers"] = _by_layer(p)
        if explain:
            out["loops"] = p.loops()
            out["held_at_peak"] = chosen.held_at_peak(limit=limit or 1 << 30)
        click.echo(json.dumps(out, default=str))
    _render(consoles.result(as_json), p, explain, by, limit)


def _on_what_if(spec: str, overrides: tuple[str, ...], what_if: str) -> Any:
    """The spec with its devices replaced by the what-if cluster's (gpu:0..gpu:3 for 4xgpu:h100),
    where its strategy names devices (replicas, layer groups) -- so `--devices 4xgpu:h100 --set
    parallelism=...` can name the cluster's GPUs; None for `single` (the placer picks among the
    cluster's devices; the spec's own stay, for its placement rules) or when the spec does not
    load that way (then it loads as written, and its own error is the one shown)."""
    from flowctl.engine.cluster import Cluster
    from flowctl.engine.devices import spec_name
    from flowctl.spec.loader import load_spec

    try:
        listed = [spec_name(n) for n in Cluster.from_spec(what_if).names]
        loaded = load_spec(spec, overrides + (f"devices=[{', '.join(listed)}]",))
    except FlowctlError:
        return None
    return loaded if loaded.spec.parallelism.strategy != "single" else None


def parse_duration(text: str) -> float:
    """Seconds in '90', '90s', '10m', '1.5h'."""
    from flowctl.engine.errors import SpecError

    t = text.strip().lower()
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(t[-1:], None)
    try:
        value = float(t[:-1] if scale else t) * (scale or 1.0)
    except ValueError:
        raise SpecError(f"--budget '{text}' is not a duration (e.g. 90s, 10m, 1h)") from None
    if value <= 0:
        raise SpecError(f"--budget '{text}' must be positive")
    return value


def _place_learned(console: Console, loaded: Any, devices: str | None, batch: int | None, budget: str | None,
                   seed: int, steps: int | None, checkpoint: str | None, resume: bool,
                   warm_start: str | None, reward: str = "simulated") -> Any:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from flowctl.engine.placement.learned import LearnedOptions
    from flowctl.training.program import plan

    seconds = parse_duration(budget) if budget else loaded.spec.placement.time_budget_s
    total = float(steps) if steps else seconds
    with Progress(TextColumn("learned placer"), BarColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("starting from the heuristics", total=total)

        def progress(step: int, best: float, elapsed: float) -> None:
            bar.update(task, completed=min(total, step if steps else elapsed),
                       description=f"step {step}, best {best * 1e3:,.2f} ms")

        opts = LearnedOptions(seed=seed, steps=steps, budget_s=seconds, checkpoint=checkpoint, resume=resume,
                              warm_start=warm_start, progress=progress, reward=reward)
        return plan(loaded, "learned", devices, batch=batch, learned=opts)


def _render(console: Console, p: Any, explain: bool, by: str, limit: int) -> None:
    chosen = p.chosen
    console.print(f"[bold]{chosen.algorithm}[/] placement of {len(chosen.simulation.start):,} step nodes on "
                  f"{len(p.cluster.devices)} device(s), {p.cost.__class__.__name__}, placed in {chosen.seconds:.2f} s")
    jitter = chosen.expected().jitter
    width = console.width
    rows = []
    base = chosen.expected().mean
    for alg, pl in [(chosen.algorithm + " (chosen)", chosen), *p.compared.items()]:
        if isinstance(pl, str):
            rows.append([alg, "-", "-", "-", pl[:70]])
            continue
        e = pl.expected()
        rows.append([alg, _ms(pl.step_time), _ms(e.mean), f"{_ms(e.low)}-{_ms(e.high)}",
                     f"{e.mean / base:.2f}x" if base else "-"])
    console.print(fit("predicted step time (simulated)",
                      [Col("placement"), Col("step ms", "right", True), Col("expected ms", "right", True),
                       Col("10-90%", "right", True), Col("vs chosen", "right")], rows, width))
    if chosen.measured_step is not None:
        console.print(f"  measured on the devices: {_ms(chosen.measured_step)} ms per step "
                      f"(the learned placer's measured reward)")
    console.print("  step ms: the schedule at exactly the modelled op times; expected: its mean over "
                  "runs with every op's time off by the cost model's jitter "
                  f"(sd of log {jitter:.2f}), what a measurement should show")
    profiles = {d.name: d.profile.name for d in p.cluster.devices}
    rows = [[spec_name(d.device), profiles.get(d.device, "?"), f"{d.ops:,}", f"{d.flops / 1e9:,.2f}",
             _bytes(d.bytes_in), _bytes(d.bytes_out), _bytes(d.peak_memory), _ms(d.busy),
             f"{100 * d.busy / chosen.step_time:.0f}" if chosen.step_time else "-"] for d in chosen.devices]
    cols = [Col("device", "right"), Col("profile", "right")] + [Col(c, "right", True) for c in (
        "ops", "GFLOPs", "bytes in", "bytes out", "peak memory", "busy ms", "busy %")]
    title = "per device"
    used = {r[1] for r in rows}
    if len(used) == 1:  # one profile for all: said once, and the sizes keep their units on one line
        title += f" (all {used.pop()})"
        cols.pop(1)
        rows = [r[:1] + r[2:] for r in rows]
    console.print(fit(title, cols, rows, width))
    if chosen.notes:
        for n in chosen.notes:
            console.print(f"note: {n}")
    if not explain:
        return
    rows = [[spec_name(dev), h["node"] + ("" if h["port"] == 0 else f":{h['port']}"), h["kind"], _bytes(h["bytes"])]
            for dev, held in chosen.held_at_peak(limit=3).items() for h in held]
    if rows:
        console.print(fit("at each device's peak, its largest tensors (resident state, outputs not yet freed, "
                          "copies received)",
                          # The tensors' names are what a reader looks for: the key, kept whole; a kind
                          # ("resident") is one word, never folded either.
                          [Col("device", "right"), Col("tensor"), Col("kind", number=True),
                           Col("size", "right", True)], rows, width, key=1))
    loops = p.loops()
    if loops:
        rows = [[r["loop"], str(r["nodes"]), ", ".join(f"{spec_name(k)}×{v}" for k, v in r["devices"].items()),
                 str(r["iterations"]) if r["iterations"] else "unknown (1)", _ms(r["time"]),
                 _ms(r["time"] / max(r["iterations"], 1))] for r in loops]
        console.print(fit("per loop (placed and costed as a unit: an iteration's cost times the trip count)",
                          [Col("loop"), Col("nodes", "right", True), Col("devices"), Col("iterations", "right"),
                           Col("time ms", "right", True), Col("per iteration", "right", True)], rows, width))
    if by == "layer":
        rows = [[r["layer"], str(r["nodes"]), ", ".join(f"{spec_name(k)}×{v}" for k, v in r["devices"].items()),
                 f"{r['flops'] / 1e9:,.3f}", _ms(r["time"]), "; ".join(r["narrowed_by"])[:60] or "-"]
                for r in _by_layer(p)[: limit or None]]
        console.print(fit("per layer", [Col("layer"), Col("nodes", "right", True), Col("devices"),
                                        Col("GFLOPs", "right", True), Col("time ms", "right", True),
                                        Col("narrowed by")], rows, width))
        return
    decisions = {d.first: d for d in chosen.decisions}
    searched = bool(chosen.decisions)  # a strategy that fixes every node leaves no decision to explain
    reports = chosen.node_reports()
    rows = []
    for r in reports[: limit or None]:
        d = decisions.get(r.name)
        cands = "" if d is None else ", ".join(
            f"{spec_name(c.device)}:{_ms(c.score)}{'*' if c.device == d.choice else ''}{'!' if c.note else ''}"
            for c in d.candidates if c.score is not None)
        rows.append([r.name, r.op, spec_name(r.device), ",".join(spec_name(x) for x in r.feasible),
                     "; ".join(r.narrowed_by)[:40] or "-", cands or ("(with its group)" if searched else "-"),
                     d.reason if d else ("" if searched else f"set by {chosen.algorithm}")])
    console.print(fit("per node (groups are placed together; candidates: the estimated finish of the whole group "
                      "on each device, ms -- the node's finish, the rest of its group, transfers to placed "
                      "neighbours: the least wins; * chosen, ! over its memory budget)",
                      [Col(c) for c in ("node", "op", "device", "feasible", "narrowed by", "candidates", "why")],
                      rows, width))
    if limit and len(reports) > limit:
        console.print(f"... {len(reports) - limit:,} more nodes (--limit 0 shows all, --json gives everything)")


def _by_layer(p: Any) -> list[dict[str, Any]]:
    layer_of = p.layer_of()
    agg: dict[str, dict[str, Any]] = {}
    for r in p.chosen.node_reports():
        layer = layer_of.get(r.name, "(other)")
        a = agg.setdefault(layer, {"layer": layer, "nodes": 0, "devices": defaultdict(int), "flops": 0.0,
                                   "time": 0.0, "narrowed_by": set()})
        a["nodes"] += 1
        a["devices"][r.device] += 1
        a["flops"] += r.flops
        a["time"] += r.time or 0.0
        a["narrowed_by"].update(r.narrowed_by)
    out = []
    for a in agg.values():
        a["devices"] = dict(a["devices"])
        a["narrowed_by"] = sorted(a["narrowed_by"])
        out.append(a)
    return out
