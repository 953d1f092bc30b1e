"""Products that only a row Concat reads, written straight into its rows on the CPU (issue 32).

An LSTM's kernel is one [input + units, 4 units] variable split into its input rows and its
recurrent rows (spec/layers/recurrent.py), so its gradient is the Concat, along axis 0, of two
products: the input rows' (the whole sequence's inputs by its gate gradients) and the recurrent
rows' (autodiff's one product of the stacked steps, autodiff.py `_sum`). Each product is written,
then copied into the Concat: lstm_lm's two layers copy 2 x 13.5 MB a step (~1 ms each on a 2-core
Zen 4). `fuse_concat_products` makes such a Concat one `ConcatMatMul` node (ops/matrix.py) that
hands each product its rows of the output (TensorFlow's ScopedAllocator does as much for a
Concat's inputs). The node takes the Concat's name; its bits are the Concat's (the same BLAS call
per product: tests/test_concat_products.py).

What is fused: a Concat along axis 0 the plan runs, of two or more 2-D MatMul outputs (port 0)
that the plan runs, each read by nothing else, not fetched or fed and no control input of
anything; all on the Concat's device, all float32 or all float64. A plan with control flow is left
alone. As the other CPU passes (session.cpu_passes), never something a spec or the placer sees.

`FLOWCTL_CONCAT_PRODUCTS=0` turns the pass off.
"""
from __future__ import annotations

import os
from typing import Sequence

from flowctl.engine.graph import Graph, Node, parse_ref
from flowctl.engine.multi_apply import plan_scope, readers_and_controls, same_place

ENABLED = os.environ.get("FLOWCTL_CONCAT_PRODUCTS", "1") != "0"
_FLOATS = ("float32", "float64")


def fuse_concat_products(graph: Graph, fetches: Sequence[str], feeds: Sequence[str],
                         targets: Sequence[str]) -> Graph:
    """`graph` itself where nothing fuses, else a copy in which each such Concat (module doc) is one
    ConcatMatMul node named as the Concat was."""
    scope = plan_scope(graph, fetches, feeds, targets)
    if scope is None:
        return graph
    need, keep = scope
    readers, controls = readers_and_controls(graph)
    found: list[tuple[Node, list[Node]]] = []
    for name in sorted(need):
        concat = graph.nodes[name]
        if concat.op != "Concat" or concat.attrs.get("axis") != 0 or len(concat.inputs) < 2:
            continue
        products = []
        for r in concat.inputs:
            src, port = parse_ref(r)
            node = graph.nodes[src]
            if (node.op != "MatMul" or port != 0 or src not in need or src in keep or src in controls
                    or readers.get(src) != 1 or not same_place(node, concat)
                    or node.outputs[0].dtype not in _FLOATS or node.outputs[0].dtype != concat.outputs[0].dtype):
                break
            products.append(node)
        else:
            if len({p.name for p in products}) == len(products):
                found.append((concat, products))
    if not found:
        return graph
    g = graph.copy()
    for concat, products in found:
        inputs = [r for p in products for r in p.inputs]
        control = list(dict.fromkeys(c for n in products + [concat] for c in n.control_inputs))
        node = Node(concat.name, "ConcatMatMul", inputs, control, {}, concat.device, list(concat.colocate_with),
                    concat.assigned_device, concat.source, concat.follows)
        node.attrs = node.opdef.normalize_attrs(
            {"transpose_a": [int(p.attrs["transpose_a"]) for p in products],
             "transpose_b": [int(p.attrs["transpose_b"]) for p in products]}, concat.name)
        node.outputs = g._infer(node)
        g.nodes[concat.name] = node
        for p in products:
            del g.nodes[p.name]
    gone = {p.name: concat.name for concat, products in found for p in products}
    for node in g.nodes.values():  # what had to share a product's device shares the node's
        if any(c in gone for c in node.colocate_with):
            node.colocate_with = [c for c in dict.fromkeys(gone.get(c, c) for c in node.colocate_with)
                                  if c != node.name]
    return g

