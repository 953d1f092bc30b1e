"""Feasible devices per node and colocation groups (whitepaper §4.3).

A device is feasible for a node when it has a kernel for the node's op and satisfies the node's
partial device constraint (`gpu`, `/job:worker`, `gpu:1`). Colocation constraints (a node's
`colocate_with`, and a stateful op that takes a Variable by reference, which must run where the
Variable's state lives) are merged with union-find; each group's feasible set is the intersection
of its members' sets. An empty intersection is a `PlacementError` naming the node that emptied it,
the constraints and group members in conflict, and the devices available.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from flowctl.engine.cluster import Cluster
from flowctl.engine.devices import device_matches
from flowctl.engine.errors import PlacementError
from flowctl.engine.graph import Graph, Node, parse_ref
from flowctl.kernels.registry import has_kernel


class UnionFind:
    """Union-find over node indices whose root is always the smallest index, so group ids (and
    every order derived from them) follow the graph's insertion order: placement is deterministic."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        root = i
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[i] != root:  # path compression
            self.parent[i], i = root, self.parent[i]
        return root

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        lo, hi = (ra, rb) if ra < rb else (rb, ra)
        self.parent[hi] = lo
        return lo


@dataclass
class Feasibility:
    """Per node and per colocation group, which cluster devices may run it and why."""

    devices: list[str]  # the cluster's canonical names; sets below hold indices into this list
    order: list[str]  # every node, in graph order
    index: dict[str, int]
    own: list[frozenset[int]]  # per node: kernel ∩ constraint, before colocation
    reasons: list[list[str]]  # per node: what narrowed its own set (empty: every device)
    group_of: list[int]  # per node: its colocation group's id (the root node's index)
    members: dict[int, list[int]]  # group id -> member node indices, in graph order
    feasible: dict[int, frozenset[int]]  # group id -> intersection of members' sets
    links: dict[int, list[str]] = field(default_factory=dict)  # group id -> why members are colocated

    def node_feasible(self, name: str) -> list[str]:
        """The devices `name` may run on once its colocation group is taken into account."""
        g = self.group_of[self.index[name]]
        return [self.devices[d] for d in sorted(self.feasible[g])]

    def narrowed_by(self, name: str) -> list[str]:
        """What narrowed this node's feasible set: its own kernel and constraint, then its group."""
        i = self.index[name]
        out = list(self.reasons[i])
        g = self.group_of[i]
        if len(self.members[g]) > 1:
            others = [self.order[m] for m in self.members[g] if m != i]
            if self.feasible[g] != self.own[i]:
                narrowing = [self.order[m] for m in self.members[g] if m != i and self.own[m] != self.own[i]
                             and not self.own[m] >= self.own[i]]
                out.append(f"colocation group with {_names(others)}"
                           + (f" (narrowed by {_names(narrowing)})" if narrowing else ""))
        return out


    def group_narrowed_by(self, members: Iterable[str], limit: int = 6) -> list[str]:
        """What narrowed a set of nodes placed together: each member's own reasons, by name."""
        out: list[str] = []
        for name in members:
            for r in self.reasons[self.index[name]]:
                if len(out) < limit:
                    out.append(f"{r} on '{name}'")
        return out


def _names(names: Iterable[str], limit: int = 4) -> str:
    names = list(names)
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def colocation_edges(graph: Graph) -> list[tuple[str, str, str]]:
    """(node, other, why) for every colocation constraint: `colocate_with`, and ref inputs (§4.7:
    Assign and friends update the Variable's state in place, so they run on its device)."""
    edges: list[tuple[str, str, str]] = []
    for node in graph.nodes.values():
        linked: set[str] = set()
        for i in node.opdef.ref_inputs:  # first: the more telling reason when both hold
            if i < len(node.inputs):
                src = parse_ref(node.inputs[i])[0]
                if src not in linked:
                    linked.add(src)
                    edges.append((node.name, src, f"'{node.name}' ({node.op}) updates '{src}' by reference"))
        for other in node.colocate_with:
            if other not in graph.nodes:
                raise PlacementError(f"node '{node.name}' ({node.op}) asks to be colocated with '{other}', "
                                     f"which is not in the graph")
            if other not in linked:
                linked.add(other)
                edges.append((node.name, other, f"'{node.name}' colocate_with '{other}'"))
    return edges


def _own_set(node: Node, devices: list[str], types: list[str], kernels: dict[tuple[str, str], bool],
             constraint_cache: dict[str, frozenset[int]]) -> tuple[frozenset[int], list[str]]:
    all_devs = frozenset(range(len(devices)))
    with_kernel = []
    for d, t in enumerate(types):
        key = (node.op, t)
        if key not in kernels:
            kernels[key] = has_kernel(node.op, t)
        if kernels[key]:
            with_kernel.append(d)
    kset = frozenset(with_kernel)
    reasons = []
    if kset != all_devs:
        kinds = sorted({types[d] for d in kset})
        reasons.append(f"kernels: {node.op} runs on {', '.join(kinds) or 'no device type'}")
    if node.device:
        cset = constraint_cache.get(node.device)
        if cset is None:
            cset = constraint_cache[node.device] = frozenset(
                d for d, name in enumerate(devices) if device_matches(node.device, name))
        if cset != all_devs:
            reasons.append(f"constraint device='{node.device}'")
    else:
        cset = all_devs
    return kset & cset, reasons


def _why_empty(node: Node, devices: list[str], types: list[str]) -> str:
    """The reason a single node has no feasible device, in the node's own terms."""
    by_constraint = [d for d, name in enumerate(devices) if not node.device or device_matches(node.device, name)]
    if not by_constraint:
        return f"its device constraint '{node.device}' matches no device"
    kinds = sorted({t for t in set(types) if has_kernel(node.op, t)})
    if node.device:
        allowed = ", ".join(devices[d] for d in by_constraint)
        return (f"its device constraint '{node.device}' allows {allowed}, but {node.op} has kernels only for "
                f"{', '.join(kinds) or 'no device type'}")
    return f"{node.op} has kernels only for {', '.join(kinds) or 'no device type'}"


def _describe(node: Node, own: frozenset[int], devices: list[str]) -> str:
    where = ", ".join(devices[d] for d in sorted(own)) or "no device"
    constraint = f"device='{node.device}'" if node.device else "no device constraint"
    return f"'{node.name}' ({node.op}, {constraint}) can run on {where}"


def feasible_sets(graph: Graph, cluster: Cluster) -> Feasibility:
    """§4.3: feasible devices per node, colocation groups by union-find, intersected per group."""
    devices = cluster.names
    types = [cluster.device(d).type for d in devices]
    available = ", ".join(devices)
    order = list(graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    kernels: dict[tuple[str, str], bool] = {}
    ccache: dict[str, frozenset[int]] = {}
    own: list[frozenset[int]] = []
    reasons: list[list[str]] = []
    for name in order:
        node = graph.nodes[name]
        try:
            s, r = _own_set(node, devices, types, kernels, ccache)
        except PlacementError as e:  # an unreadable constraint: say which node wrote it
            raise PlacementError(f"node '{name}' ({node.op}): {e}") from None
        if not s:
            raise PlacementError(f"cannot place node '{name}' ({node.op}): {_why_empty(node, devices, types)}; "
                                 f"devices available: {available}")
        own.append(s)
        reasons.append(r)

    uf = UnionFind(len(order))
    why: list[tuple[int, str]] = []
    for a, b, text in colocation_edges(graph):
        why.append((uf.union(index[a], index[b]), text))
    group_of = [uf.find(i) for i in range(len(order))]
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_of):
        members.setdefault(g, []).append(i)
    links: dict[int, list[str]] = {}
    for g, text in why:
        links.setdefault(uf.find(g), []).append(text)

    feasible: dict[int, frozenset[int]] = {}
    for g, ms in members.items():
        acc = own[ms[0]]
        for k, m in enumerate(ms[1:], 1):
            nxt = acc & own[m]
            if not nxt:
                raise _conflict(graph, order, devices, own, ms[:k], m, links.get(g, []), available)
            acc = nxt
        feasible[g] = acc
    return Feasibility(devices, order, index, own, reasons, group_of, members, feasible, links)


def _conflict(graph: Graph, order: list[str], devices: list[str], own: list[frozenset[int]],
              before: list[int], m: int, links: list[str], available: str, shown: int = 4) -> PlacementError:
    """The error for a colocation group whose intersection emptied at member `m`: it names `m`, the
    earlier members whose own sets narrowed the group (the ones in conflict: one per distinct
    op and constraint), a few members and why they are colocated. The message stays
    short however large the group; `details` holds every member, culprit and link."""
    node = graph.nodes[order[m]]
    all_devs = frozenset(range(len(devices)))
    narrowing = [i for i in before if own[i] != all_devs] or before
    distinct: dict[tuple[str, str, frozenset[int]], int] = {}
    for i in narrowing:
        n = graph.nodes[order[i]]
        distinct.setdefault((n.op, n.device, own[i]), i)
    firsts = list(distinct.values())[:max(1, shown // 2)]
    culprits = " and ".join(_describe(graph.nodes[order[i]], own[i], devices) for i in firsts)
    if len(narrowing) > len(firsts):
        culprits += f" (and {len(narrowing) - len(firsts)} more member(s) so constrained)"
    members = [order[i] for i in before + [m]]
    group = ", ".join(f"'{n}'" for n in members[:shown]) + (
        f" and {len(members) - shown} more" if len(members) > shown else "")
    few = max(1, shown // 2)
    because = "; ".join(links[:few]) if len(links) > shown else "; ".join(links)
    because = because or "of colocation constraints"
    if len(links) > shown:
        because += f"; and {len(links) - few} more"
    truncated = len(members) > shown or len(links) > shown or len(narrowing) > len(firsts)
    details: dict[str, object] = {
        "kind": "colocation_conflict", "node": node.name, "members": members,
        "conflicting": [_describe(graph.nodes[order[i]], own[i], devices) for i in narrowing],
        "colocated_because": list(links), "devices": list(devices)}
    return PlacementError(
        f"cannot place node '{node.name}' ({node.op}): no device satisfies its colocation group "
        f"[{group}]: {_describe(node, own[m], devices)}, but {culprits}; colocated because "
        f"{because}; devices available: {available}" + (" (place --json lists them all)" if truncated else ""),
        details)
