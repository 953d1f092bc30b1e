"""`flowctl graph SPEC --out graph.html [--tensorboard DIR]`: one self-contained page of the training
step's graph by layer, each layer coloured by the device it was placed on.

The page draws the forward pass top-down from the spec's own layers and their inputs (inputs at the
top, the loss at the bottom), so the gradient and optimizer nodes, which each layer lists in its
side panel, never drive the layout; the nodes in no layer (the optimizer's scalars, the gradient
clipping) are a toggle. A spec's block instances (Inception's modules) start collapsed, one box
each, and open on a click. The layout, zoom and side panel are the script of `graph_page.html`
beside this module, which the written page carries inline with its data: it needs no network."""
from __future__ import annotations

import html
import json
import re
from collections import Counter, defaultdict
from importlib import resources
from pathlib import Path
from typing import Any

import click

from flowctl.cli import consoles
from flowctl.training.rundir import write_atomic

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac"]


# A data-parallel replica's copy of a layer is scoped `replica_<k>/`, its gradients
# `replica_<k>/gradients/replica_<k>/`.
_COPY = re.compile(r"^(replica_\d+/)?(gradients/)?(replica_\d+/)?")


def _owner(name: str, layers: dict[str, str], layer_names: set[str]) -> str | None:
    """The layer a node belongs to: the step's own record (a gradient or update node takes the layer
    of the forward node it follows), else the longest layer name that scopes it, past a replica's
    and the gradients' scopes (an optimizer slot `mixed_5b/branch1x1/kernel/Momentum` belongs to
    `mixed_5b/branch1x1`, `replica_1/hidden_1/MatMul` to `hidden_1`)."""
    if name in layers:
        return layers[name]
    scope = _COPY.sub("", name)
    if scope in layer_names:
        return scope
    while "/" in scope:
        scope = scope.rsplit("/", 1)[0]
        if scope in layer_names:
            return scope
    return None


def graph_data(placed: Any) -> dict[str, Any]:
    """What the page draws: the spec's layers in order (inputs, output shape, block, nodes with op
    and device, the device most of them run on), the block instances (nested ones name their
    parent), and the nodes in no layer grouped by their first name scope."""
    step = placed.step
    g = step.graph
    loaded = step.model.loaded
    assign = placed.assignment
    names = set(loaded.layers)
    blocks = sorted(loaded.instances, key=lambda i: len(i.name))

    def innermost(name: str) -> str | None:
        found = None
        for inst in blocks:  # shortest first: the last match is the innermost instance
            if name.startswith(inst.name + "/"):
                found = inst.name
        return found

    members: dict[str, list[list[str]]] = defaultdict(list)
    other: dict[str, list[list[str]]] = defaultdict(list)
    for name, node in g.nodes.items():
        row = [name, node.op, assign.get(name, "")]
        layer = _owner(name, step.layers, names)
        if layer is not None:
            members[layer].append(row)
        else:
            # A data-parallel replica's own optimizer state and update (replica_1/Adam/t) sit with
            # the first replica's (Adam/t), as its copies of a layer sit with the layer.
            plain = re.sub(r"^replica_\d+/", "", name)
            other[plain.split("/", 1)[0] if "/" in plain else "(other)"].append(row)

    def entry(name: str, nodes: list[list[str]]) -> dict[str, Any]:
        devices = Counter(n[2] for n in nodes)
        device = devices.most_common(1)[0][0] if devices else ""
        return {"name": name, "nodes": nodes, "device": device, "devices": dict(devices)}

    layers = []
    for name, info in loaded.layers.items():
        block = innermost(name)
        layers.append({**entry(name, members.get(name, [])), "type": info.layer.type,
                       "inputs": list(info.inputs), "block": block,
                       "label": name[len(block) + 1:] if block else name,
                       "shape": [d if d is not None else "?" for d in info.output.shape],
                       "dtype": info.output.dtype})
    instances = []
    for inst in loaded.instances:
        parent = innermost(inst.name)
        instances.append({"name": inst.name, "block": inst.block, "parent": parent,
                          "label": inst.name[len(parent) + 1:] if parent else inst.name,
                          "output": inst.output})
    return {"layers": layers, "blocks": instances,
            "other": [entry(name, nodes) for name, nodes in other.items()],
            "devices": {d: PALETTE[i % len(PALETTE)] for i, d in enumerate(placed.cluster.names)},
            "algorithm": placed.chosen.algorithm, "step_ms": placed.chosen.step_time * 1e3,
            "nodes": len(g.nodes)}


def page(data: dict[str, Any], title: str) -> str:
    """The page: the template with the title and the data inlined (`</` escaped, so no name in the
    data can close the script), in one pass, so neither is read for the other's placeholder."""
    template = resources.files("flowctl.cli").joinpath("graph_page.html").read_text(encoding="utf-8")
    fill = {"TITLE": html.escape(title),
            "DATA": json.dumps(data, separators=(",", ":")).replace("</", "<\\/")}
    return re.sub(r"__(TITLE|DATA)__", lambda m: fill[m.group(1)], template)


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
        data = graph_data(placed)
        write_atomic(out, page(data, loaded.spec.name or loaded.spec.model.name))
        con.print(f"wrote {out}: {len(data['layers'])} layers, {len(data['blocks'])} blocks, {used}")
    if tensorboard is not None:
        writer = EventWriter(tensorboard)
        try:
            writer.graph(graph_def(placed.step.graph, placed.assignment, placed.step.layers))
        finally:
            writer.close()
        con.print(f"wrote {writer.path}: the graph of {used} (tensorboard --logdir {tensorboard})")
