"""A convolution and the inference batch norm that reads it, as one node on the CPU (issue 32).

In inference a batch norm is one ChannelAffine (x * scale + shift, and its ReLU: ops/nn.py
`batch_norm`); on Inception-v3 each of its 94 reads a Conv2D's output that nothing else reads. As a
pair that output is written by the convolution and read back and rewritten by the affine, a pass
over every activation (Inception-v3 at batch 8: 287 MB, 29.5 ms of a 0.52 s inference step).
`fuse_conv_affine` makes each such pair one `FusedConv2D` node (ops/nn.py), whose compiled CPU
kernels (kernels/cpu/conv.py) apply the affine to each piece of the output as the convolution
makes it, while the piece is in cache -- what TensorFlow's grappler remapper does with
Conv2D + FusedBatchNorm + Relu (`_FusedConv2D`) and oneDNN's post-ops do for PyTorch.

As multi_l2.py on a GPU, a pass over a CPU plan (`Session._plan`), never something a spec or the
placer sees. The fused node takes the ChannelAffine's name, so whatever read or fetched the batch
norm reads it as before; its bits are the pair's (the reference kernel runs the two kernels in turn;
the variants run the same GEMMs and the same affine kernel, tests/test_conv_affine.py).

What is fused: a ChannelAffine the plan runs whose input 0 is a Conv2D's output (port 0) that the
plan runs, not fetched or fed, read by nothing else and no control input of anything; the two on
the same device, both float32 or float64. A plan with control flow is left alone.

`FLOWCTL_CONV_AFFINE=0` turns the pass off.
"""
from __future__ import annotations

import os
from typing import Sequence

from flowctl.engine.graph import Graph, Node, parse_ref
from flowctl.engine.multi_apply import plan_scope, readers_and_controls, same_place

ENABLED = os.environ.get("FLOWCTL_CONV_AFFINE", "1") != "0"
_FLOATS = ("float32", "float64")


def fuse_conv_affine(graph: Graph, fetches: Sequence[str], feeds: Sequence[str],
                     targets: Sequence[str]) -> Graph:
    """`graph` itself where nothing fuses, else a copy in which each Conv2D -> ChannelAffine pair
    (module doc) is one FusedConv2D node named as the ChannelAffine was."""
    scope = plan_scope(graph, fetches, feeds, targets)
    if scope is None:
        return graph
    need, keep = scope
    readers, controls = readers_and_controls(graph)
    pairs = []
    for name in need:
        affine = graph.nodes[name]
        if affine.op != "ChannelAffine":
            continue
        src, port = parse_ref(affine.inputs[0])
        conv = graph.nodes[src]
        if (conv.op == "Conv2D" and port == 0 and src in need and src not in keep and src not in controls
                and readers.get(src) == 1 and same_place(conv, affine)
                and conv.outputs[0].dtype in _FLOATS and affine.outputs[0].dtype == conv.outputs[0].dtype):
            pairs.append((conv, affine))
    if not pairs:
        return graph
    g = graph.copy()
    for conv, affine in pairs:
        control = list(dict.fromkeys(conv.control_inputs + affine.control_inputs))
        attrs = {"strides": conv.attrs["strides"], "padding": conv.attrs["padding"],
                 "activation": affine.attrs["activation"]}
        node = Node(affine.name, "FusedConv2D", conv.inputs + affine.inputs[1:], control, {}, affine.device,
                    list(affine.colocate_with), affine.assigned_device, affine.source, affine.follows)
        node.attrs = node.opdef.normalize_attrs(attrs, affine.name)
        node.outputs = g._infer(node)
        g.nodes[affine.name] = node
        del g.nodes[conv.name]
    into = {conv.name: affine.name for conv, affine in pairs}
    for node in g.nodes.values():  # whatever had to share the convolution's device shares the node's
        if any(c in into for c in node.colocate_with):
            node.colocate_with = [c for c in dict.fromkeys(into.get(c, c) for c in node.colocate_with)
                                  if c != node.name]
    return g

