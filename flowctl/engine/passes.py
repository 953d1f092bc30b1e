"""Graph passes (whitepaper §4.2, §5.1): pruning for partial execution, common-subexpression
elimination, and constant folding. Each pass is a function `Graph -> Graph` that ends with
`graph.check()`.

`keep` names nodes a caller will fetch or feed. A fed tensor replaces its producer's value at run
time, so a kept node is never treated as a known constant, never chosen as the survivor other nodes
are merged into, and never loses its name: otherwise a feed would silently stop reaching (or start
reaching) consumers it was not meant for.
"""
from __future__ import annotations

import hashlib
import heapq
from typing import Any, Iterable, Sequence

import numpy as np

from flowctl.engine.devices import CPU0
from flowctl.engine.dtypes import itemsize, np_dtype
from flowctl.engine.errors import GraphError
from flowctl.engine.executor import Plan, needed_nodes
from flowctl.engine.frames import CONTROL_FLOW_OPS
from flowctl.engine.graph import Graph, Node, Tensor, attrs_equal, make_ref, parse_ref
from flowctl.engine.opdef import (
    COMMUNICATION, ELEMENTWISE, MATRIX, MOVEMENT, NN, REDUCTION, get_op,
)
from flowctl.engine.shapes import TensorSpec

__all__ = ["prune", "cse", "fold_constants", "fix_references", "optimize", "MAX_FOLD_BYTES"]

# Folding trades run-time work for graph size: a folded value is stored in the GraphDef and shipped
# to every worker, so only small results are worth it (TF's grappler uses a similar cap).
MAX_FOLD_BYTES = 1 << 20

# Pure computation only: sources, state, random, control flow and communication have identity or
# effects beyond their value (a CheckNumerics guard must still run, a Recv must still wait).
_FOLDABLE_GROUPS = frozenset({ELEMENTWISE, REDUCTION, MOVEMENT, MATRIX, NN})


# ---------------------------------------------------------------------------- helpers
def _fetch_name(f: Tensor | str) -> tuple[str, str | None]:
    """(node name, ref or None for a bare node name)."""
    if isinstance(f, Tensor):
        return f.node, f.name
    if ":" in f:
        node, port = parse_ref(f)
        return node, make_ref(node, port)
    return f, None


def _insertion_topo(graph: Graph) -> list[str]:
    """A topological order that is the insertion order wherever that order is already topological
    (the usual case: the builders add inputs first). CSE keeps the first node of a duplicate set in
    this order, so the survivor is the one the user created first."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    pending: dict[str, int] = {}
    users: dict[str, list[str]] = {n: [] for n in graph.nodes}
    nexts = graph._next_iterations()
    for name, node in graph.nodes.items():
        deps = graph.dependencies(node, nexts)  # §4.4: a loop's back edge is no dependency
        pending[name] = len(deps)
        for d in deps:
            users[d].append(name)
    heap = [index[n] for n, p in pending.items() if p == 0]
    heapq.heapify(heap)
    names = list(graph.nodes)
    order: list[str] = []
    while heap:
        n = names[heapq.heappop(heap)]
        order.append(n)
        for u in users[n]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(heap, index[u])
    if len(order) != len(names):
        graph.topo_order()  # raises, naming the cycle
    return order


def fix_references(graph: Graph, renamed: dict[str, str]) -> None:
    """Point colocation constraints and placement hints at nodes that still exist."""
    for node in graph.nodes.values():
        if node.colocate_with:
            node.colocate_with = [c for c in dict.fromkeys(renamed.get(c, c) for c in node.colocate_with)
                                  if c in graph.nodes]
        if node.follows:
            follows = renamed.get(node.follows, node.follows)
            node.follows = follows if follows in graph.nodes else ""


# ---------------------------------------------------------------------------- §4.2 pruning
def prune(graph: Graph, fetches: Sequence[Tensor | str], feeds: Iterable[Tensor | str] = ()) -> Graph:
    """A new graph holding only what `fetches` (refs, or node names for targets) need given the fed
    refs (§4.2). A fed tensor whose producer nothing else needs is produced by a Placeholder of the
    same name, shape and dtype, as TensorFlow's partial-execution rewrite does, so feeds keep their
    names. The input graph is left unchanged."""
    fed: set[str] = set()
    for f in feeds:
        node, ref = _fetch_name(f)
        ref = ref or make_ref(node, 0)
        graph.tensor(ref)  # an unknown name raises with a did-you-mean
        fed.add(ref)
    roots: list[str] = []
    for f in fetches:
        node, ref = _fetch_name(f)
        if node not in graph.nodes or ref is not None:
            graph.tensor(ref or node)
        if ref is None or ref not in fed:
            roots.append(node)
    need = needed_nodes(graph, roots, fed)

    def close(need: set[str]) -> set[str]:
        # A ref input (Assign's Variable) is named, not read, so needed_nodes skips it; the IR still
        # needs the node it names.
        while True:
            extra = {parse_ref(node.inputs[i])[0] for n in need for node in [graph.nodes[n]]
                     for i in node.opdef.ref_inputs if i < len(node.inputs)} - need
            if not extra:
                return need
            need = need | needed_nodes(graph, list(extra), fed)

    need = close(need)
    placeholders: dict[str, TensorSpec] = {}
    for ref in sorted(fed):
        node, port = parse_ref(ref)
        if node in need:
            continue
        producer = graph.nodes[node]
        if len(producer.outputs) == 1:
            placeholders[node] = producer.outputs[0]
        else:
            # A Placeholder has one output, so it cannot stand in for port 1 of a multi-output node
            # under the same ref; keep the producer (it still does not run when the port is fed).
            need = close(need | needed_nodes(graph, [node], fed))
    out = Graph(graph.seed)
    out._counts = dict(graph._counts)
    ph = get_op("Placeholder")
    for name, n in graph.nodes.items():
        if name in need:
            out.nodes[name] = Node(n.name, n.op, list(n.inputs), list(n.control_inputs), dict(n.attrs),
                                   n.device, list(n.colocate_with), n.assigned_device, n.source,
                                   n.follows, list(n.outputs))
        elif name in placeholders:
            spec = placeholders[name]
            out.nodes[name] = Node(name, "Placeholder",
                                   attrs=ph.normalize_attrs({"dtype": spec.dtype, "shape": spec.shape}, name),
                                   device=n.device, assigned_device=n.assigned_device, source=n.source,
                                   outputs=[spec])
    fix_references(out, {})
    return out.check()


# ---------------------------------------------------------------------------- §5.1 CSE
def _mergeable(node: Node) -> bool:
    d = node.opdef
    # Stateful ops and ops owning a resource have identity (two Variables, two random streams);
    # a Placeholder is an input of its own even when its attrs match another's. Control-flow
    # primitives are the structure of a frame (two loop variables may enter from one tensor).
    return not (d.stateful or d.resource or d.ref_inputs or d.is_async or d.group == COMMUNICATION
                or node.op == "Placeholder" or node.op in CONTROL_FLOW_OPS)


def _attr_key(attrs: dict[str, Any]) -> tuple[Any, ...]:
    """A hashable digest of the attrs for bucketing; `attrs_equal` still decides equality."""
    out: list[Any] = []
    for k in sorted(attrs):
        v = attrs[k]
        if isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v)
            v = ("ndarray", a.dtype.str, a.shape, hashlib.blake2b(a.tobytes(), digest_size=16).digest())
        else:
            try:
                hash(v)
            except TypeError:
                v = repr(v)
        out.append((k, v))
    return tuple(out)


def cse(graph: Graph, keep: Iterable[str] = ()) -> Graph:
    """Common-subexpression elimination (§5.1), in place: nodes with the same op, the same inputs
    (after earlier merges), the same control inputs, equal attrs and the same device request are
    merged into the first of them; consumers are rewired to the survivor. A kept duplicate keeps
    its name and becomes an Identity of the survivor (a multi-output or output-less one is left)."""
    kept = set(keep)
    survivor: dict[str, str] = {}
    table: dict[tuple[Any, ...], list[str]] = {}
    for name in _insertion_topo(graph):
        node = graph.nodes[name]
        node.inputs = [make_ref(survivor.get(s, s), p) for s, p in map(parse_ref, node.inputs)]
        node.control_inputs = list(dict.fromkeys(survivor.get(c, c) for c in node.control_inputs))
        if not _mergeable(node):
            continue
        key = (node.op, tuple(node.inputs), tuple(sorted(node.control_inputs)), node.device,
               tuple(sorted(survivor.get(c, c) for c in node.colocate_with)), _attr_key(node.attrs))
        match = next((m for m in table.get(key, ()) if attrs_equal(graph.nodes[m].attrs, node.attrs)), None)
        if match is None:
            if name not in kept:
                table.setdefault(key, []).append(name)
        elif name not in kept:
            survivor[name] = match
        elif len(node.outputs) == 1:
            node.op = "Identity"
            node.inputs = [make_ref(match, 0)]
            node.attrs = get_op("Identity").normalize_attrs({}, name)
    for name in survivor:
        del graph.nodes[name]
    fix_references(graph, survivor)
    return graph.check()


# ---------------------------------------------------------------------------- constant folding
def _out_bytes(node: Node) -> int | None:
    total = 0
    for s in node.outputs:
        if any(d is None for d in s.shape):
            return None
        total += int(np.prod(s.shape, dtype=np.int64)) * itemsize(s.dtype)
    return total


def _can_fold(node: Node) -> bool:
    from flowctl.kernels.registry import has_kernel

    d = node.opdef
    if d.group not in _FOLDABLE_GROUPS or d.stateful or d.resource or d.is_async or not node.outputs:
        return False
    size = _out_bytes(node)
    return size is not None and size <= MAX_FOLD_BYTES and has_kernel(node.op, "cpu")


def _no_resource(node: Node) -> Any:
    raise GraphError(f"node '{node.name}' ({node.op}) holds state and is never folded")


def _evaluate(graph: Graph, sources: set[str], frontier: dict[str, list[int]]) -> dict[str, list[np.ndarray]]:
    """Run the constant subgraph once on the cpu, in a scratch graph without control edges (the
    values cannot depend on them) and with a private store (nothing stateful is in it anyway)."""
    scratch = Graph(graph.seed)
    for name, n in graph.nodes.items():
        if name in sources:
            scratch.nodes[name] = Node(n.name, n.op, list(n.inputs), [], dict(n.attrs),
                                       outputs=list(n.outputs))
    scratch.check(device_kernels=False)

    def run(names: list[str]) -> dict[str, list[np.ndarray]]:
        refs = [make_ref(n, p) for n in names for p in frontier[n]]
        values = iter(Plan(scratch, refs, [], [], CPU0, _no_resource).run([]))
        return {n: [next(values) for _ in frontier[n]] for n in names}

    try:
        return run(list(frontier))
    except Exception:  # noqa: BLE001
        # One failing node (say a Cast that overflows) must not stop the others from folding; it is
        # left as it was and fails, with its own name, only if a step ever needs it.
        out: dict[str, list[np.ndarray]] = {}
        for name in frontier:
            try:
                out.update(run([name]))
            except Exception:  # noqa: BLE001
                continue
        return out


def fold_constants(graph: Graph, keep: Iterable[str] = ()) -> Graph:
    """Constant folding, in place: a pure node (no state, no randomness) whose inputs are all
    constants, transitively, and whose outputs total at most MAX_FOLD_BYTES is computed once and
    replaced by a Const of the same name, so refs stay valid. A multi-output node's consumed
    outputs become Consts `<node>/folded_<port>` and the node goes. Control inputs of the folded
    subgraph move onto the new Consts, so the order the graph asked for is kept."""
    kept = set(keep)
    data_users: dict[str, list[str]] = {n: [] for n in graph.nodes}
    ctrl_users: dict[str, list[str]] = {n: [] for n in graph.nodes}
    for node in graph.nodes.values():
        for src in dict.fromkeys(parse_ref(r)[0] for r in node.inputs):
            data_users[src].append(node.name)
        for c in node.control_inputs:
            ctrl_users[c].append(node.name)
    folds = _foldable(graph, kept, ctrl_users)
    frontier = _fold_frontier(graph, kept, folds, data_users, ctrl_users)
    if not frontier:
        return graph.check()
    sources: set[str] = set()
    stack = list(frontier)
    while stack:
        n = stack.pop()
        if n not in sources:
            sources.add(n)
            stack.extend(parse_ref(r)[0] for r in graph.nodes[n].inputs)
    values = _evaluate(graph, sources, frontier)
    _replace_folded(graph, kept, folds, frontier, values, data_users)
    return graph.check()


def _foldable(graph: Graph, kept: set[str], ctrl_users: dict[str, list[str]]) -> dict[str, set[str]]:
    """Pass 1: the nodes that will be computed here (constant-valued), each with the control
    inputs it carries transitively."""
    const_ctrl: dict[str, set[str]] = {}  # usable as a constant input (kept nodes never are)
    folds: dict[str, set[str]] = {}
    for name in graph.topo_order():
        node = graph.nodes[name]
        srcs = [parse_ref(r)[0] for r in node.inputs]
        if node.op == "Const":
            if name not in kept:
                const_ctrl[name] = set(node.control_inputs)
            continue
        if not _can_fold(node) or not all(s in const_ctrl for s in srcs):
            continue
        if len(node.outputs) > 1 and (name in kept or ctrl_users[name]):
            continue  # its name must survive with every port: fold only what it feeds
        ctrl = set(node.control_inputs).union(*(const_ctrl[s] for s in srcs))
        folds[name] = ctrl
        if name not in kept:
            const_ctrl[name] = ctrl
    return folds


def _fold_frontier(graph: Graph, kept: set[str], folds: dict[str, set[str]], data_users: dict[str, list[str]],
                   ctrl_users: dict[str, list[str]]) -> dict[str, list[int]]:
    """Pass 2: only the frontier (read by something that stays, or kept) needs a value: folded
    node -> the output ports read from outside."""
    frontier: dict[str, list[int]] = {}
    for name in folds:
        node = graph.nodes[name]
        outside = [u for u in data_users[name] if u not in folds] + ctrl_users[name]
        if name in kept or outside:
            if len(node.outputs) == 1:
                frontier[name] = [0]
            else:
                used = {parse_ref(r)[1] for u in data_users[name] if u not in folds
                        for r in graph.nodes[u].inputs if parse_ref(r)[0] == name}
                frontier[name] = sorted(used)
    return frontier


def _replace_folded(graph: Graph, kept: set[str], folds: dict[str, set[str]], frontier: dict[str, list[int]],
                    values: dict[str, list[np.ndarray]], data_users: dict[str, list[str]]) -> None:
    """Pass 3: replace the frontier by Consts, then drop what only the folded nodes read."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    orphan_roots: list[str] = []
    for name, arrays in values.items():
        node = graph.nodes[name]
        if any(np.asarray(a).dtype != np_dtype(node.outputs[p].dtype) or np.shape(a) != node.outputs[p].shape
               for p, a in zip(frontier[name], arrays)):
            continue  # a kernel at odds with inference stays as it is: a cast here would change the result
        ctrl_list = sorted(folds[name], key=index.__getitem__)
        orphan_roots.extend(parse_ref(r)[0] for r in node.inputs)
        if len(node.outputs) == 1:
            graph.nodes[name] = _const_like(node, name, 0, arrays[0], ctrl_list)
            continue
        renamed = {}
        for port, value in zip(frontier[name], arrays):
            new_name = graph.unique_name(f"{name}/folded_{port}")
            graph.nodes[new_name] = _const_like(node, new_name, port, value, ctrl_list)
            renamed[make_ref(name, port)] = make_ref(new_name, 0)
        for u in data_users[name]:
            if u in graph.nodes:
                user = graph.nodes[u]
                user.inputs = [renamed.get(r, r) for r in user.inputs]
        del graph.nodes[name]
    _drop_orphans(graph, orphan_roots, kept, set(folds))
    fix_references(graph, {})


def _const_like(node: Node, name: str, port: int, value: Any, control_inputs: list[str]) -> Node:
    """A Const holding `value` in place of output `port` of `node`, where the node was placed."""
    spec = node.outputs[port]
    arr = np.asarray(value, dtype=np_dtype(spec.dtype)).reshape(spec.shape)
    return Node(name, "Const", [], list(control_inputs), get_op("Const").normalize_attrs({"value": arr}, name),
                node.device, list(node.colocate_with), node.assigned_device, node.source, node.follows, [spec])


def _drop_orphans(graph: Graph, roots: list[str], kept: set[str], folded: set[str]) -> None:
    """Remove Consts and folded-away nodes that nothing reads any more (never kept ones, and never
    anything else: a dead init Assign is not ours to drop)."""
    users = graph.consumers()
    stack = list(roots)
    while stack:
        name = stack.pop()
        node = graph.nodes.get(name)
        if node is None or name in kept or users.get(name):
            continue
        if node.op != "Const" and name not in folded:
            continue
        del graph.nodes[name]
        for src in dict.fromkeys([parse_ref(r)[0] for r in node.inputs] + node.control_inputs):
            if src in users:
                users[src] = [u for u in users[src] if u != name]
                stack.append(src)


def optimize(graph: Graph, keep: Iterable[str] = ()) -> Graph:
    """Constant folding, then CSE, both in place on `graph` (Session(optimize=True) passes a copy)."""
    keep = set(keep)
    return cse(fold_constants(graph, keep), keep)
