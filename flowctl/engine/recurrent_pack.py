"""A recurrent weight packed once per step on the CPU, its per-time-step products reading the packed
copy (issue 32: "the recurrent product with its weight packed once per sequence").

An unrolled LSTM's loop multiplies the same W_h (lstm_lm: 650 x 2600, 6.8 MB) by a 20-row h at
every time step, forward (RecurrentMatMul, h W_h) and backward (its gradient's dh, the MatMul
W_h dz^T): 68 products each way a step. OpenBLAS packs W_h into its own panels on every one of
those calls; flowctl's few-row kernel (kernels/cpu/gemm_jit.py) reads W_h where it is, which on a
target without AVX-512 lost to OpenBLAS (kernels/cpu/recurrent.py). Here W_h is packed once per
step, into contiguous panels of one vector register's columns (`PackPanels`, and once more as
W_h^T's panels for the backward), and each product reads a panel as one stream
(`PanelMatMul`). Measured on lstm_lm's shapes (a 2-core AMD EPYC, AVX2, two intra-op threads,
two weights taking turns as the two layers do): forward 0.75 against OpenBLAS's 1.18 ms a
product, backward 0.79 against 0.92; in the step, the forward products 59-79 ms against 90.

As conv_affine.py, a pass over a CPU plan (`Session._plan`), never something a spec or the placer
sees; the rewritten products keep their names, so whatever read or fetched them reads them as
before. What is rewritten: the RecurrentMatMul nodes the plan runs that read one weight (float32,
a shape known when the graph is built), at least MIN_PRODUCTS of them, and the gradient's
MatMul(W_h, dz, transpose_b) nodes reading the same weight; the pack nodes take the first
product's device fields. A plan with control flow is left alone (a while loop's products run
per iteration: the pass would need a frame of its own).

The rule: where PanelMatMul's compiled variant applies (numba present), asked of the kernel
registry; panels of one vector register's columns, 16 on a target with AVX-512's registers and 8
on AVX2's. On AVX-512 the unpacked few-row kernel (RecurrentMatMul's variant) had measured as fast
as the packed one, without the copy, so only AVX2 targets packed; once the packed kernel took two
panels at a time (kernels/cpu/gemm_jit.py) it measured, on lstm_lm's shapes (a 2-core Xeon with
AVX-512, two intra-op threads, two weights taking turns): forward 0.40 ms a product against the
unpacked kernel's 0.61 and OpenBLAS's 0.56, backward 0.42 against OpenBLAS's 0.76.
`FLOWCTL_PACK_RECURRENT=0` turns the pass off, `=1` on whatever the registry says.
"""
from __future__ import annotations

import functools
import os
from typing import Sequence

from flowctl.engine.graph import Graph, Node, make_ref, parse_ref
from flowctl.engine.multi_apply import plan_scope
from flowctl.engine.shapes import TensorSpec
from flowctl.kernels.registry import applicable

MIN_PRODUCTS = 4  # a pack costs about as much as two products


WIDTHS = (16, 8)  # panel widths asked of the registry, widest first: AVX-512's register, AVX2's


def _compiled_width() -> int | None:
    """The panel width whose product PanelMatMul's compiled variant takes on this target, if any."""
    h = TensorSpec((None, 64), "float32")
    for width in WIDTHS:
        packed = TensorSpec((256 // width, 64, width), "float32")
        if applicable("PanelMatMul", "cpu", {"n": 256, "transpose_out": False}, [h, packed]) is not None:
            return width
    return None


@functools.cache
def lanes() -> int:
    """Columns per panel: one vector register of float32 on the target numba compiles for, as the
    registry's rule for the compiled product says (8 where no compiled product applies)."""
    return _compiled_width() or WIDTHS[-1]


@functools.cache
def enabled() -> bool:
    """The rule (module doc), asked of the kernel registry: PanelMatMul's compiled variant applies
    to a float32 product at some width; or FLOWCTL_PACK_RECURRENT's 0 or 1."""
    env = os.environ.get("FLOWCTL_PACK_RECURRENT", "")
    if env == "0":
        return False
    return env == "1" or _compiled_width() is not None


def pack_recurrent(graph: Graph, fetches: Sequence[str], feeds: Sequence[str], targets: Sequence[str]) -> Graph:
    """`graph` itself where nothing is packed, else a copy in which each recurrent weight read by at
    least MIN_PRODUCTS RecurrentMatMul nodes is packed once, and those products and the gradient's
    dh products read the packed copies (module doc)."""
    scope = plan_scope(graph, fetches, feeds, targets)
    if scope is None:
        return graph
    need, _keep = scope
    forward: dict[str, list[Node]] = {}
    backward: dict[str, list[Node]] = {}
    for name in graph.topo_order(need):
        node = graph.nodes[name]
        if node.op == "RecurrentMatMul" and node.outputs and node.outputs[0].dtype == "float32":
            forward.setdefault(node.inputs[1], []).append(node)
        elif (node.op == "MatMul" and not node.attrs["transpose_a"] and node.attrs["transpose_b"]
              and node.outputs and node.outputs[0].dtype == "float32"):
            backward.setdefault(node.inputs[0], []).append(node)
    weights = {w: nodes for w, nodes in forward.items()
               if len(nodes) >= MIN_PRODUCTS and _known_matrix(graph, w)}
    if not weights:
        return graph
    g = graph.copy()
    width = lanes()
    for w, products in weights.items():
        k, n = graph.nodes[parse_ref(w)[0]].outputs[parse_ref(w)[1]].shape
        packed = _pack_node(g, w, products[0], width, transpose=False)
        for node in products:
            _rewrite(g, node, [node.inputs[0], packed], n, transpose_out=False)
        grads = backward.get(w, [])
        if grads:
            packed_t = _pack_node(g, w, grads[0], width, transpose=True)
            for node in grads:
                _rewrite(g, node, [node.inputs[1], packed_t], k, transpose_out=True)
    return g


def _known_matrix(graph: Graph, ref: str) -> bool:
    src, port = parse_ref(ref)
    spec = graph.nodes[src].outputs[port]
    return len(spec.shape) == 2 and None not in spec.shape


def _pack_node(g: Graph, w: str, like: Node, width: int, transpose: bool) -> str:
    base = f"{parse_ref(w)[0]}/packed{'_t' if transpose else ''}"
    name, i = base, 1
    while name in g.nodes:
        name, i = f"{base}_{i}", i + 1
    node = Node(name, "PackPanels", [w], [], {}, like.device, list(like.colocate_with), like.assigned_device,
                like.source, like.follows)
    node.attrs = node.opdef.normalize_attrs({"lanes": width, "transpose": transpose}, name)
    node.outputs = g._infer(node)
    g.nodes[name] = node
    return make_ref(name, 0)


def _rewrite(g: Graph, old: Node, inputs: list[str], n: int, transpose_out: bool) -> None:
    node = Node(old.name, "PanelMatMul", inputs, list(old.control_inputs), {}, old.device, list(old.colocate_with),
                old.assigned_device, old.source, old.follows)
    node.attrs = node.opdef.normalize_attrs({"n": n, "transpose_out": transpose_out}, old.name)
    node.outputs = g._infer(node)
    g.nodes[old.name] = node
