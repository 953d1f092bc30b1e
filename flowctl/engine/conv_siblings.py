"""Sibling 1x1 convolutions as one: the convolutions that read the same input with 1x1 windows (and
the same strides) made one wider convolution on the CPU, its output split back (issue 32).

Inception's blocks start with two to four 1x1 convolutions of the block's input (Inception-v3 at
batch 8: 35x35x288 -> 64, 48 and 64; 17x17x768 -> 192, 160 and 160; 8x8x2048 -> 320, 384 and 448),
each one GEMM of the same (positions x channels) matrix. Narrow products run far below the BLAS's
peak, and each reads the input again: as one GEMM against the filters side by side they measured
0.81-0.93 of the separate GEMMs' time on a 2-core AMD EPYC (9800 x 288 @ 288 x (64, 48, 64) 13.4 ->
11.7 ms, 2312 x 768 @ 768 x (192, 160, 160) 17.4 -> 13.9; only 512 x 2048 @ 2048 x (320, 384, 448)
came out even) -- what TensorRT's horizontal fusion does with such layers.

As conv_affine.py, a pass over a CPU plan (`Session._plan`, after conv_affine, so an inference
convolution is already a FusedConv2D with its batch norm), never something a spec or the placer
sees. A group is two or more Conv2D nodes, or two or more FusedConv2D nodes with the same
activation, that the plan runs: input 0 the same tensor, 1x1 filters of static shape, the same
strides and dtype (float32 or float64), the same place, none fetched or fed, none a control input
of anything. The group becomes `<first>/siblings/filter` (a Concat of the filters along the output
channels; FusedConv2D's scales and shifts too), one node `<first>/siblings` of the group's op, and
`<first>/siblings/split` (a Split into the members' channel counts: views), whose outputs the
members' readers read. The nodes take the first member's place in the graph's order (a plan runs
ready compute earliest-built first). Each output is the same sum over the input's channels, so
the results agree with the separate convolutions to float32 rounding (the BLAS may block the
wider product differently); the gradients are untouched (the backward nodes read x, the filters and
dy, never a forward output). A plan with control flow is left alone.

`FLOWCTL_CONV_SIBLINGS=0` turns the pass off.
"""
from __future__ import annotations

import os
from typing import Sequence

from flowctl.engine.graph import Graph, Node, make_ref, parse_ref
from flowctl.engine.multi_apply import plan_scope

ENABLED = os.environ.get("FLOWCTL_CONV_SIBLINGS", "1") != "0"
_FLOATS = ("float32", "float64")
_OPS = ("Conv2D", "FusedConv2D")
_MADE = ("", "/filter", "/scale", "/shift", "/split")  # the names a group's nodes take after its first


def merge_siblings(graph: Graph, fetches: Sequence[str], feeds: Sequence[str], targets: Sequence[str]) -> Graph:
    """`graph` itself where no two 1x1 convolutions share an input, else a copy in which each group
    (module doc) is one wider convolution and a Split."""
    scope = plan_scope(graph, fetches, feeds, targets)
    if scope is None:
        return graph
    need, keep = scope
    controls = {c for node in graph.nodes.values() for c in node.control_inputs}
    groups: dict[tuple, list[Node]] = {}
    for name in graph.nodes:  # in build order: the first member is the earliest built
        node = graph.nodes[name]
        if name not in need or name in keep or name in controls or not _one_by_one(graph, node):
            continue
        key = (node.op, parse_ref(node.inputs[0]), tuple(node.attrs["strides"]), node.attrs.get("activation"),
               node.outputs[0].dtype, node.device, node.assigned_device, tuple(sorted(node.colocate_with)))
        groups.setdefault(key, []).append(node)
    taken = set(graph.nodes)
    groups = {k: v for k, v in groups.items()
              if len(v) >= 2 and not {f"{v[0].name}/siblings{s}" for s in _MADE} & taken}
    if not groups:
        return graph
    g = graph.copy()
    made: dict[str, list[Node]] = {}  # first member -> the nodes standing in for the group
    to_split: dict[str, str] = {}  # member -> the split's output it becomes
    merged_of: dict[str, str] = {}  # member -> the wider node
    for members in groups.values():
        made[members[0].name] = _merged(g, members)
        wide, split = made[members[0].name][-2:]
        for k, m in enumerate(members):
            to_split[m.name] = make_ref(split.name, k)
            merged_of[m.name] = wide.name
    nodes: dict[str, Node] = {}
    for name, node in g.nodes.items():
        if name in made:
            nodes.update((n.name, n) for n in made[name])
        elif name not in to_split:
            nodes[name] = node
    g.nodes = nodes
    for node in g.nodes.values():
        node.inputs = [_renamed(r, to_split) for r in node.inputs]
        if any(c in merged_of for c in node.colocate_with):
            node.colocate_with = [c for c in dict.fromkeys(merged_of.get(c, c) for c in node.colocate_with)
                                  if c != node.name]
    return g


def _one_by_one(graph: Graph, node: Node) -> bool:
    if node.op not in _OPS or len(node.outputs) != 1 or node.outputs[0].dtype not in _FLOATS:
        return False
    f = graph.tensor(node.inputs[1]).shape
    return len(f) == 4 and all(isinstance(d, int) for d in f) and f[0] == f[1] == 1


def _renamed(ref: str, to_split: dict[str, str]) -> str:
    name, port = parse_ref(ref)
    return to_split[name] if port == 0 and name in to_split else ref


def _merged(g: Graph, members: list[Node]) -> list[Node]:
    """The nodes for one group: the concatenated parameters, the wider node, its split."""
    first = members[0]
    base = f"{first.name}/siblings"
    sizes = [int(g.tensor(m.inputs[1]).shape[3]) for m in members]

    def node(name: str, op: str, inputs: list[str], attrs: dict, control: list[str] | None = None) -> Node:
        n = Node(name, op, inputs, control or [], {}, first.device, list(first.colocate_with), first.assigned_device,
                 first.source, first.follows)
        n.attrs = n.opdef.normalize_attrs(attrs, name)
        n.outputs = g._infer(n)
        g.nodes[name] = n  # (so that what follows can infer from it; placed in order by the caller)
        return n

    out = [node(f"{base}/filter", "Concat", [m.inputs[1] for m in members], {"axis": 3})]
    inputs = [first.inputs[0], make_ref(out[0].name, 0)]
    if first.op == "FusedConv2D":  # its scale and shift, side by side as the filters are
        for i, part in ((2, "scale"), (3, "shift")):
            out.append(node(f"{base}/{part}", "Concat", [m.inputs[i] for m in members], {"axis": 0}))
            inputs.append(make_ref(out[-1].name, 0))
    control = list(dict.fromkeys(c for m in members for c in m.control_inputs))
    out.append(node(base, first.op, inputs, dict(first.attrs), control))
    out.append(node(f"{base}/split", "Split", [make_ref(base, 0)], {"axis": 3, "sizes": sizes}))
    return out
