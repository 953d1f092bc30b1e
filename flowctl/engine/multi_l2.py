"""One node for a sum of L2 losses on a GPU (issue 30: "gradient clipping and L2 terms reduced on
the device").

`clip_by_global_norm` (optimizers.py) takes its global norm from one L2Loss node per gradient,
summed by an AddN; an L2 penalty written with `fc.l2_loss` is the same shape of graph (an AddN, or
a chain of Adds `l2_loss(a) + l2_loss(b) + ...`). On a GPU each L2Loss is two launches (a block
reduction, then its finish: kernels/cuda/kernels.py) and the AddN one more: Inception-v3's clipped
step has ~190 of them, ~380 launches for a handful of scalars. `fuse_l2_sums` replaces each such
sum by one `MultiL2Loss` node (ops/training.py) whose GPU kernel reduces all N tensors in
1 + ceil(N / 32) launches.

As multi_apply.py, a pass over a GPU plan (`Session._plan`), not something a spec builds: the
graph, CPU plans, placement and the distributed runtimes never see a MultiL2Loss. The node takes
the AddN's name (the root Add's, for a chain), so whatever read or fetched the sum reads it as
before. Its bits are the unfused graph's: the reference kernel runs the per-tensor L2Loss kernels
then AddN's left-to-right sum; the GPU kernel gives each tensor its own L2Loss launch's grid,
shares and trees, and adds the halves in the same order (tests/test_multi_l2.py).

What is fused: an AddN the plan runs whose every input is an L2Loss (port 0) of the AddN's dtype,
on the AddN's device, read by nothing else, not fetched; or a left-deep chain of such Adds
((l1 + l2) + l3 ...: AddN's order), its inner Adds read by nothing else. Two or more terms. A
plan with control flow is left alone (a member could run in a branch or a loop frame).

`FLOWCTL_MULTI_L2=0` turns the pass off."""
from __future__ import annotations

import os
from typing import Sequence

from flowctl.engine.graph import Graph, Node, parse_ref
from flowctl.engine.multi_apply import plan_scope, readers_and_controls

ENABLED = os.environ.get("FLOWCTL_MULTI_L2", "1") != "0"


def fuse_l2_sums(graph: Graph, fetches: Sequence[str], feeds: Sequence[str],
                 targets: Sequence[str]) -> Graph:
    """`graph` itself where nothing fuses, else a copy in which each sum of two or more L2Loss
    nodes is one MultiL2Loss node named as the sum was (module doc)."""
    scope = plan_scope(graph, fetches, feeds, targets)
    if scope is None:
        return graph
    need, keep = scope
    readers, _ = readers_and_controls(graph)
    taken: set[str] = set()
    sums: list[tuple[Node, list[Node], list[Node]]] = []  # (root, its L2Loss terms in order, inner Adds)
    for name in reversed(graph.topo_order(need)):  # consumers first: a chain from its outermost Add
        root = graph.nodes[name]
        if name in taken or root.op not in ("AddN", "Add") or len(root.outputs) != 1 or root.outputs[0].shape != ():
            continue
        found = _terms(graph, root, need, keep, readers, taken)
        if found is not None and len(found[0]) > 1:
            sums.append((root, *found))
            taken.update(n.name for n in found[0] + found[1])
            taken.add(name)
    if not sums:
        return graph
    return _rewrite(graph, sums)


def is_l2_sum(graph: Graph, node: Node) -> bool:
    """Whether `node` may be (part of) a sum this pass fuses: an AddN or Add reading an L2Loss.
    The fusion pass (`training.fuse`, engine/fusion.py) leaves such nodes to this one."""
    return node.op in ("AddN", "Add") and any(graph.nodes[parse_ref(r)[0]].op == "L2Loss" for r in node.inputs)


def _term(graph: Graph, ref: str, root: Node, need: set[str], keep: set[str], readers: dict[str, int],
          taken: set[str], op: str) -> Node | None:
    """The node behind `ref` where it is an `op` the sum may absorb: run by the plan, not fetched,
    read by the sum alone, of its dtype and on its device; else None."""
    src, port = parse_ref(ref)
    node = graph.nodes[src]
    if node.op != op or port != 0 or src not in need or src in keep or src in taken or readers.get(src) != 1:
        return None
    if node.outputs[0].dtype != root.outputs[0].dtype or node.outputs[0].shape != () \
            or (node.device, node.assigned_device) != (root.device, root.assigned_device):
        return None
    return node


def _terms(graph: Graph, root: Node, need: set[str], keep: set[str], readers: dict[str, int],
           taken: set[str]) -> tuple[list[Node], list[Node]] | None:
    """(the L2Loss terms of `root` in the order they are added, the inner Adds) or None."""
    if root.op == "AddN":
        terms = [_term(graph, r, root, need, keep, readers, taken, "L2Loss") for r in root.inputs]
        return None if any(t is None for t in terms) else ([t for t in terms if t is not None], [])
    terms: list[Node] = []
    inner: list[Node] = []
    node = root
    while True:  # ((l1 + l2) + l3) + l4: down the left operands
        if len(node.inputs) != 2:
            return None
        right = _term(graph, node.inputs[1], root, need, keep, readers, taken, "L2Loss")
        if right is None:
            return None
        terms.insert(0, right)
        left = _term(graph, node.inputs[0], root, need, keep, readers, taken, "L2Loss")
        if left is not None:
            terms.insert(0, left)
            return terms, inner
        node = _term(graph, node.inputs[0], root, need, keep, readers, taken, "Add")
        if node is None:
            return None
        inner.append(node)


def _rewrite(graph: Graph, sums: list[tuple[Node, list[Node], list[Node]]]) -> Graph:
    g = graph.copy()
    into: dict[str, str] = {}  # a removed L2Loss or inner Add -> the node that replaces its sum
    for root, terms, inner in sums:
        members = terms + inner
        gone = {m.name for m in members}
        control = [c for n in [root, *members] for c in n.control_inputs if c not in gone]
        node = Node(root.name, "MultiL2Loss", [t.inputs[0] for t in terms], list(dict.fromkeys(control)), {},
                    root.device, list(root.colocate_with), root.assigned_device, root.source, root.follows)
        node.attrs = node.opdef.normalize_attrs({}, root.name)
        node.outputs = g._infer(node)
        g.nodes[root.name] = node
        for m in members:
            del g.nodes[m.name]
            into[m.name] = root.name
    for node in g.nodes.values():  # whatever waited for a member waits for its sum
        if any(c in into for c in node.control_inputs):
            node.control_inputs = [c for c in dict.fromkeys(into.get(c, c) for c in node.control_inputs)
                                   if c != node.name]
        if any(c in into for c in node.colocate_with):
            node.colocate_with = list(dict.fromkeys(into.get(c, c) for c in node.colocate_with))
    return g
