"""One optimizer update node for many variables on a GPU (issue 30: "one multi-tensor optimizer
update instead of one launch per variable"; PyTorch's multi_tensor_apply).

An optimizer builds one ApplyGradientDescent / ApplyMomentum / ApplyAdam node per variable
(optimizers.py): Inception-v3's step has hundreds, and on a GPU each is a kernel launch of its own
(16-18 µs from Python, a node in the captured graph). `group_updates` replaces every set of such
nodes that agree on the op, its attributes, the dtype, the device and the step's guard with one
`MultiApply*` node (ops/training.py) whose kernel updates them all, in a few launches
(kernels/cuda/state.py).

Why a pass at plan time, and only for a GPU plan (`Session._plan`), rather than an optimizer
option: the graph a spec builds stays as it is -- every per-variable node keeps its name, the
Variables and slots their checkpoint keys, and CPU plans, placement, the simulator and the
distributed runtimes never see a MultiApply node -- and the grouping needs facts only a plan has
(which nodes this step runs, which are fetched). The node's kernel is, per variable, the
per-variable kernel's arithmetic in the same order (the generic kernel calls it, the GPU kernel
shares its device function), so the grouped step's bits are the ungrouped step's.

What is grouped: an update node the plan runs, not fetched, whose output no node reads but a
Group (the optimizer's target, which only waits for it; Adam's power updates wait by control
edge), taking
Variables (port 0) by reference. What is left alone: a plan with control flow (fp16's cond: an
update inside a branch), a set whose members depend on one another (the pass checks, and also
gives up on a grouping that would close a cycle between two sets: AdamW's decays then its Adam
steps are two sets, one after the other). The MultiApply node takes the union of its members'
control inputs (the Variables' reads, the guard), and whatever waited for a member waits for it.

`FLOWCTL_MULTI_APPLY=0` turns the pass off (the per-variable nodes run as built)."""
from __future__ import annotations

import os
from typing import Sequence

from flowctl.engine.errors import GraphError
from flowctl.engine.executor import needed_nodes
from flowctl.engine.frames import has_control_flow
from flowctl.engine.graph import Graph, Node, parse_ref
from flowctl.engine.ops.training import MULTI_APPLY

ENABLED = os.environ.get("FLOWCTL_MULTI_APPLY", "1") != "0"

# The ops whose device flag a state write reads (as session.GUARDS, which imports this module).
GUARDS = ("CheckNumerics", "GuardFlag")

# Attributes of the per-variable op that the multi node carries over.
_ATTRS = {"ApplyGradientDescent": (), "ApplyMomentum": ("momentum", "nesterov"),
          "ApplyAdam": ("beta1", "beta2", "epsilon")}


def plan_scope(graph: Graph, fetches: Sequence[str], feeds: Sequence[str],
               targets: Sequence[str]) -> tuple[set[str], set[str]] | None:
    """What a GPU-plan pass may rewrite: (the nodes the plan runs, the names it must keep: fetched,
    fed, targets), or None for a plan with control flow (its frames are left alone)."""
    fed = set(feeds)
    roots = [parse_ref(r)[0] for r in fetches if r not in fed] + list(targets)
    need = needed_nodes(graph, roots, fed)
    if has_control_flow(graph.nodes[n] for n in need):
        return None
    return need, {parse_ref(r)[0] for r in list(fetches) + list(feeds)} | set(targets)


def readers_and_controls(graph: Graph) -> tuple[dict[str, int], set[str]]:
    """How many inputs read each node's outputs, and the nodes some node waits on (its control
    inputs): what a plan pass asks before it folds a node into its reader."""
    readers: dict[str, int] = {}
    controls: set[str] = set()
    for node in graph.nodes.values():
        controls.update(node.control_inputs)
        for r in node.inputs:
            src = parse_ref(r)[0]
            readers[src] = readers.get(src, 0) + 1
    return readers, controls


def same_place(a: Node, b: Node) -> bool:
    """Whether two nodes are bound to one place (device, assignment and colocation alike)."""
    return (a.device, a.assigned_device, sorted(a.colocate_with)) == (b.device, b.assigned_device,
                                                                       sorted(b.colocate_with))


def group_updates(graph: Graph, fetches: Sequence[str], feeds: Sequence[str],
                  targets: Sequence[str]) -> Graph:
    """`graph` itself where nothing groups, else a copy in which each group of two or more
    per-variable updates is one MultiApply node (module doc)."""
    scope = plan_scope(graph, fetches, feeds, targets)
    if scope is None:
        return graph
    need, keep = scope
    # (a Group reads its inputs only to wait for them: the rewrite makes those control edges)
    read = {parse_ref(r)[0] for n in graph.nodes.values() if n.op != "Group" for r in n.inputs}
    groups: dict[tuple, list[Node]] = {}
    for name in graph.topo_order(need):
        node = graph.nodes[name]
        if node.op not in MULTI_APPLY or name in keep or name in read or not node.outputs:
            continue
        k = MULTI_APPLY[node.op][1]
        if len(node.inputs) != k + 3:
            continue
        if any(graph.nodes[parse_ref(r)[0]].op != "Variable" or parse_ref(r)[1] != 0 for r in node.inputs[:k + 1]):
            continue
        guards = tuple(sorted(c for c in node.control_inputs if graph.nodes[c].op in GUARDS))
        key = (node.op, tuple(node.attrs[a] for a in _ATTRS[node.op]), node.outputs[0].dtype, node.device,
               node.assigned_device, guards)
        groups.setdefault(key, []).append(node)
    sets = [members for members in groups.values() if len(members) > 1 and _independent(graph, members)]
    if not sets:
        return graph
    return _rewrite(graph, sets)


def _independent(graph: Graph, members: list[Node]) -> bool:
    """Does no member wait, directly or through other nodes, for another?"""
    names = {m.name for m in members}
    seen: set[str] = set()
    stack = [parse_ref(r)[0] for m in members for r in m.inputs] + [c for m in members for c in m.control_inputs]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n in names:
            return False
        seen.add(n)
        node = graph.nodes[n]
        stack.extend(parse_ref(r)[0] for r in node.inputs)
        stack.extend(node.control_inputs)
    return True


def _rewrite(graph: Graph, sets: list[list[Node]]) -> Graph:
    g = graph.copy()
    into: dict[str, str] = {}  # member -> its multi node
    made = []
    for members in sets:
        first = members[0]
        multi, k = MULTI_APPLY[first.op]
        name = g.unique_name(f"multi_update/{multi}")
        member_names = {m.name for m in members}
        control = [c for m in members for c in m.control_inputs if c not in member_names]
        attrs = {a: first.attrs[a] for a in _ATTRS[first.op]}
        attrs.update(variables=tuple(parse_ref(r)[0] for m in members for r in m.inputs[:k + 1]), slots=k)
        node = Node(name, multi, [m.inputs[k + 1] for m in members] + [m.inputs[k + 2] for m in members],
                    list(dict.fromkeys(control)), {},
                    first.device, [], first.assigned_device, first.source)
        node.attrs = node.opdef.normalize_attrs(attrs, name)
        node.outputs = g._infer(node)
        made.append(node)
        for m in members:
            into[m.name] = name
    for m in into:
        del g.nodes[m]
    for node in made:
        g.nodes[node.name] = node
    for node in g.nodes.values():
        waits = [parse_ref(r)[0] for r in node.inputs if parse_ref(r)[0] in into]
        if waits:  # a Group's
            node.inputs = [r for r in node.inputs if parse_ref(r)[0] not in into]
            node.control_inputs = node.control_inputs + waits
        if any(c in into for c in node.control_inputs):
            node.control_inputs = [c for c in dict.fromkeys(into.get(c, c) for c in node.control_inputs)
                                   if c != node.name]
    try:
        g.topo_order()
    except GraphError:  # two sets waiting for each other through their members: leave the plan be
        return graph
    return g
