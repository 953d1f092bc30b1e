"""`flowctl graph SPEC --out graph.html [--tensorboard DIR]`: one self-contained page of the training step's graph,
collapsed by layer (optimizer and other unlayered nodes under their own name scope), each layer
coloured by the device it was placed on; a click lists the layer's nodes with op and device."""
from __future__ import annotations

import html
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import click

from flowctl.cli import consoles
from flowctl.engine.graph import parse_ref
from flowctl.training.rundir import write_atomic

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac"]
BOX_W, BOX_H, GAP_X, GAP_Y = 170, 34, 60, 14


def collapsed(placed: Any) -> dict[str, Any]:
    """The graph by layer: each group's nodes (name, op, device), its device, and the edges
    between groups (how many tensors cross each)."""
    g = placed.step.graph
    layer_of = placed.layer_of()
    assign = placed.assignment

    def group(name: str) -> str:
        layer = layer_of.get(name, "")
        if layer and layer != "(optimizer and other)":
            return layer
        return name.split("/", 1)[0] if "/" in name else "(other)"

    members: dict[str, list[str]] = defaultdict(list)
    for name in g.nodes:
        members[group(name)].append(name)
    edges: Counter[tuple[str, str]] = Counter()
    for name, node in g.nodes.items():
        dst = group(name)
        for ref in node.inputs:
            src = group(parse_ref(ref)[0])
            if src != dst:
                edges[(src, dst)] += 1
    groups = []
    for name, nodes in members.items():
        devices = Counter(assign.get(n, "") for n in nodes)
        groups.append({"name": name, "device": devices.most_common(1)[0][0], "devices": dict(devices),
                       "nodes": [[n, g.nodes[n].op, assign.get(n, "")] for n in nodes]})
    return {"groups": groups, "edges": [[a, b, n] for (a, b), n in edges.items()],
            "devices": placed.cluster.names, "algorithm": placed.chosen.algorithm,
            "step_ms": placed.chosen.step_time * 1e3}


def _levels(groups: list[dict[str, Any]], edges: list[list[Any]]) -> dict[str, int]:
    """Each group's column: the longest path to it from a group nothing feeds (cycles between
    groups, which a layer's gradients make, are broken by visiting order)."""
    into: dict[str, list[str]] = defaultdict(list)
    for a, b, _ in edges:
        into[b].append(a)
    level: dict[str, int] = {}
    visiting: set[str] = set()

    def depth(n: str) -> int:
        if n in level:
            return level[n]
        if n in visiting:
            return 0
        visiting.add(n)
        level[n] = 1 + max((depth(p) for p in into[n]), default=-1)
        visiting.discard(n)
        return level[n]

    for grp in groups:
        depth(grp["name"])
    return level


def page(data: dict[str, Any], title: str) -> str:
    levels = _levels(data["groups"], data["edges"])
    rows: dict[int, int] = defaultdict(int)
    pos: dict[str, tuple[int, int]] = {}
    for grp in sorted(data["groups"], key=lambda g: (levels[g["name"]], g["name"])):
        col = levels[grp["name"]]
        pos[grp["name"]] = (20 + col * (BOX_W + GAP_X), 50 + rows[col] * (BOX_H + GAP_Y))
        rows[col] += 1
    colour = {d: PALETTE[i % len(PALETTE)] for i, d in enumerate(data["devices"])}
    width = max(x for x, _ in pos.values()) + BOX_W + 40
    height = max(y for _, y in pos.values()) + BOX_H + 60
    parts = []
    for a, b, n in data["edges"]:
        (x1, y1), (x2, y2) = pos[a], pos[b]
        if x2 > x1:
            parts.append(f'<path class="edge" d="M{x1 + BOX_W},{y1 + BOX_H / 2} C{x1 + BOX_W + GAP_X / 2},'
                         f'{y1 + BOX_H / 2} {x2 - GAP_X / 2},{y2 + BOX_H / 2} {x2},{y2 + BOX_H / 2}">'
                         f'<title>{html.escape(a)} → {html.escape(b)}: {n} tensor(s)</title></path>')
    for i, grp in enumerate(data["groups"]):
        x, y = pos[grp["name"]]
        short = grp["device"].rsplit("device:", 1)[-1]
        label = html.escape(grp["name"] if len(grp["name"]) <= 22 else grp["name"][:21] + "…")
        parts.append(f'<g class="layer" data-index="{i}" data-device="{html.escape(grp["device"])}" '
                     f'transform="translate({x},{y})"><rect width="{BOX_W}" height="{BOX_H}" rx="5" '
                     f'fill="{colour.get(grp["device"], "#999")}"/><text x="8" y="15">{label}</text>'
                     f'<text x="8" y="29" class="sub">{len(grp["nodes"])} nodes · {html.escape(short)}</text></g>')
    legend = " ".join(f'<span class="key" style="background:{c}"></span>{html.escape(d.rsplit("device:", 1)[-1])}'
                      for d, c in colour.items())
    payload = json.dumps(data["groups"]).replace("</", "<\\/")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 0; display: flex; height: 100vh; }}
#graph {{ flex: 1; overflow: auto; }} #side {{ width: 380px; overflow: auto; border-left: 1px solid #ccc; padding: 8px; }}
.layer {{ cursor: pointer; }} .layer text {{ fill: white; font-size: 12px; }} .layer text.sub {{ font-size: 10px; }}
.layer.selected rect {{ stroke: black; stroke-width: 2; }} .edge {{ fill: none; stroke: #888; stroke-width: 1.2; }}
.key {{ display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 10px; vertical-align: middle; }}
table {{ border-collapse: collapse; font-size: 12px; }} td {{ padding: 1px 6px; border-bottom: 1px solid #eee; }}
</style></head><body>
<div id="graph"><div style="padding:8px"><b>{html.escape(title)}</b>: {len(data["groups"])} groups,
{sum(len(g["nodes"]) for g in data["groups"]):,} nodes, placed by {html.escape(data["algorithm"])}
(predicted step {data["step_ms"]:,.2f} ms). {legend}</div>
<svg id="svg" width="{width}" height="{height}">{"".join(parts)}</svg></div>
<div id="side"><p>Click a layer to list its nodes.</p></div>
<script>
const GROUPS = {payload};
for (const el of document.querySelectorAll('.layer')) {{
  el.addEventListener('click', () => {{
    document.querySelectorAll('.layer.selected').forEach(e => e.classList.remove('selected'));
    el.classList.add('selected');
    const g = GROUPS[+el.dataset.index];
    const rows = g.nodes.slice(0, 500).map(n => '<tr><td>' + n[0] + '</td><td>' + n[1] + '</td><td>' +
      n[2].split('device:').pop() + '</td></tr>').join('');
    document.getElementById('side').innerHTML = '<h3>' + g.name + '</h3><p>' + g.nodes.length +
      ' nodes</p><table>' + rows + '</table>';
  }});
}}
</script></body></html>
"""


@click.command()
@click.argument("spec")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="The HTML file.")
@click.option("--tensorboard", "tensorboard", type=click.Path(file_okay=False, path_type=Path),
              help="Also write the graph as a TensorBoard event file in this directory (its Graphs tab).")
@click.option("--algorithm", "-a", help="Placer (default: the spec's).")
@click.option("--devices", help="The spec's device names (cpu:0,cpu:1) or a what-if cluster (4xgpu:k40).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Change one spec key. Repeatable.")
def graph(spec: str, out: Path | None, tensorboard: Path | None, algorithm: str | None, devices: str | None,
          overrides: tuple[str, ...]) -> None:
    """Write SPEC's placed training step as one self-contained HTML page (--out), by layer,
    coloured by device, and/or as a TensorBoard graph (--tensorboard DIR)."""
    from flowctl.spec.loader import load_spec
    from flowctl.spec.overrides import device_names
    from flowctl.training.events import EventWriter, graph_def
    from flowctl.training.program import plan

    if out is None and tensorboard is None:
        raise click.UsageError("give --out FILE.html, --tensorboard DIR, or both")
    names = device_names(devices) if devices else None
    if names:
        overrides += (f"devices=[{', '.join(names)}]",)
    loaded = load_spec(spec, overrides)
    placed = plan(loaded, algorithm, None if names else devices, compare=())
    con = consoles.result()
    used = f"{len(placed.step.graph):,} nodes on {len(placed.devices_used())} device(s)"
    if out is not None:
        data = collapsed(placed)
        write_atomic(out, page(data, loaded.spec.name or loaded.spec.model.name))
        con.print(f"wrote {out}: {len(data['groups'])} groups of {used}")
    if tensorboard is not None:
        writer = EventWriter(tensorboard)
        try:
            writer.graph(graph_def(placed.step.graph, placed.assignment, placed.step.layers))
        finally:
            writer.close()
        con.print(f"wrote {writer.path}: the graph of {used} (tensorboard --logdir {tensorboard})")
