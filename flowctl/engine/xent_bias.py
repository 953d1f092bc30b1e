"""A classifier's last bias and its loss as one node each way on the CPU (issue 32).

A classifier ends in a dense layer's BiasAdd read only by SparseSoftmaxCrossEntropyWithLogits;
its gradient, XentGrad's, is read by BiasAddGrad (and the layer's MatMul gradients). Each pair
crosses the logits twice where once would do: lstm_lm's are 700 x 10000 (28 MB), and its BiasAdd
and BiasAddGrad passes cost ~4 ms of a ~330 ms step on a 2-core Zen 4 (`flowctl train --trace`).
`fuse_xent_bias` makes the forward pair one `BiasSparseXent(x, bias, labels)` node, whose compiled
kernel biases each row in a scratch row as the softmax reads it (the biased logits are never
written), and the backward pair one `XentGradBias(dy, m)` node with two outputs, the loss
gradient and its column sums, summed as the gradient is written (kernels/cpu/softmax.py) -- what
TensorFlow's grappler remapper does for MatMul + BiasAdd and oneDNN's post-ops for PyTorch.

As conv_affine.py, a pass over a CPU plan (`Session._plan`, and each CPU partition of a placed
step: runtime.compile_partition), never something a spec or the placer sees. The forward node takes
the loss node's name and the backward node XentGrad's, so what read them reads them as before;
what read BiasAddGrad reads XentGradBias's second output. Their bits are the pairs': the reference
kernels run the two kernels in turn; the compiled ones make the same float32 sums and products
(tests/test_xent_bias.py).

What is fused: a SparseSoftmaxCrossEntropyWithLogits the plan runs whose logits are a BiasAdd's
output that the plan runs, not fetched or fed, read by nothing else and no control input of
anything -- directly (a matrix) or through such a Reshape to rows that keeps the last axis (lstm_lm
folds its [batch, 35, 10000] logits); and a BiasAddGrad the plan runs, not fetched, no control
input of anything, whose input is an XentGrad's output that the plan runs, directly or through a
Reshape keeping the last axis (which stays, for the MatMul gradients that read it too: the column
sums of the rows are the sums over every axis but the last, in the same order). Each pair on one
device, float32 or float64. A plan with control flow is left alone.

`FLOWCTL_XENT_BIAS=0` turns the pass off.
"""
from __future__ import annotations

import os
from typing import Sequence

from flowctl.engine.graph import Graph, Node, make_ref, parse_ref
from flowctl.engine.multi_apply import plan_scope, readers_and_controls, same_place

ENABLED = os.environ.get("FLOWCTL_XENT_BIAS", "1") != "0"
_FLOATS = ("float32", "float64")


def fuse_xent_bias(graph: Graph, fetches: Sequence[str], feeds: Sequence[str],
                   targets: Sequence[str]) -> Graph:
    """`graph` itself where nothing fuses, else a copy with each pair of the module doc one node."""
    scope = plan_scope(graph, fetches, feeds, targets)
    if scope is None:
        return graph
    need, keep = scope
    readers, controls = readers_and_controls(graph)

    def free(name: str) -> bool:  # the plan runs it; nothing fetches, feeds or waits on it
        return name in need and name not in keep and name not in controls

    def keeps_last_axis(node: Node) -> bool:
        before = graph.tensor(node.inputs[0]).shape
        after = node.outputs[0].shape
        return bool(before) and bool(after) and before[-1] is not None and before[-1] == after[-1]

    def through_reshapes(ref: str, sole: bool) -> tuple[str, int, Node | None]:
        """(node, port) behind `ref` past a chain of Reshapes that keep the last axis (the
        bias's), which commute with BiasAdd and BiasAddGrad (lstm_lm unfolds its rows of logits to
        [batch, 35, 10000] and folds them back for the loss), and the chain's first Reshape (None:
        no chain). `sole`: each must be the plan's and its input's only reader."""
        first = None
        src, port = parse_ref(ref)
        while graph.nodes[src].op == "Reshape" and port == 0 and keeps_last_axis(graph.nodes[src]):
            node = graph.nodes[src]
            if sole and not (free(src) and readers.get(src) == 1):
                break
            first = node
            src, port = parse_ref(node.inputs[0])
        return src, port, first

    forward: list[tuple[Node, Node, Node | None]] = []  # (BiasAdd, loss, the first Reshape between)
    backward: list[tuple[Node, Node]] = []  # (XentGrad, BiasAddGrad)
    grads_taken: set[str] = set()
    for name in sorted(need):
        node = graph.nodes[name]
        if node.op == "SparseSoftmaxCrossEntropyWithLogits":
            src, port, fold = through_reshapes(node.inputs[0], sole=True)
            bias = graph.nodes[src]
            if (bias.op == "BiasAdd" and port == 0 and free(src) and readers.get(src) == 1
                    and same_place(bias, node) and bias.outputs[0].dtype in _FLOATS
                    and (fold is None or same_place(fold, node))
                    and (fold is not None or len(bias.outputs[0].shape) == 2)):
                forward.append((bias, node, fold))
        elif node.op == "BiasAddGrad" and free(name):
            src, port, _ = through_reshapes(node.inputs[0], sole=False)  # (they stay: MatMuls read them)
            grad = graph.nodes[src]
            if (grad.op == "XentGrad" and port == 0 and src in need and src not in grads_taken
                    and same_place(grad, node) and grad.outputs[0].dtype in _FLOATS):
                backward.append((grad, node))
                grads_taken.add(src)
    if not forward and not backward:
        return graph
    g = graph.copy()
    for bias, loss, fold in forward:
        x, b = bias.inputs
        if fold is not None:  # the chain's first Reshape now reshapes x itself; the loss reads its last
            g.nodes[fold.name].inputs = [x] + fold.inputs[1:]
            x = loss.inputs[0]
        _replace(g, loss, "BiasSparseXent", [x, b] + loss.inputs[1:], bias.control_inputs + loss.control_inputs)
        del g.nodes[bias.name]
    moved: dict[str, str] = {}
    for grad, bias_grad in backward:
        _replace(g, grad, "XentGradBias", grad.inputs, grad.control_inputs + bias_grad.control_inputs)
        del g.nodes[bias_grad.name]
        moved[make_ref(bias_grad.name, 0)] = make_ref(grad.name, 1)
    if moved:
        for node in g.nodes.values():
            node.inputs = [moved.get(r, r) for r in node.inputs]
    gone = {bias.name: loss.name for bias, loss, _ in forward} | {bg.name: grad.name for grad, bg in backward}
    for node in g.nodes.values():  # what had to share a removed node's device shares its stand-in's
        if any(c in gone for c in node.colocate_with):
            node.colocate_with = [c for c in dict.fromkeys(gone.get(c, c) for c in node.colocate_with)
                                  if c != node.name]
    return g


def _replace(g: Graph, old: Node, op: str, inputs: list[str], control: list[str]) -> None:
    node = Node(old.name, op, list(inputs), list(dict.fromkeys(control)), {}, old.device, list(old.colocate_with),
                old.assigned_device, old.source, old.follows)
    node.attrs = node.opdef.normalize_attrs({}, old.name)
    node.outputs = g._infer(node)
    g.nodes[old.name] = node

