"""Shrinking the graph before placing it (placement-notes.md: Mirhoseini et al. 2017, Baechi 2020).

Placers decide per *group*, not per node. Groups are built in three phases; a merge in phases 2
and 3 is kept only when the merged groups share a feasible device and the heavier one loses none
of its own (hard colocation is never broken, and a cheap op never drags a heavy one off a GPU):

1. Colocation groups (§4.3), from `feasibility`: hard constraints.
2. Forward single-consumer merges, over the forward graph only (nodes without `follows`; edges
   into NoOp/Group sinks ignored, so a train op does not swallow every variable update). In reverse
   topological order, a group A whose outputs feed exactly one other group B joins B when doing
   so cannot hide parallelism:
     (a) A reads nothing computed outside B and does less work than B (it hangs off B:
         variables and their update chains; not a whole tower hanging off a fed input), or
     (b) A is B's only computed input (a chain), or
     (c) A's work is no more than sending its outputs to B, so running A elsewhere cannot pay,
         and A reads no more bytes from computed groups other than B than it sends to B: else
         joining B only moves the cut one op upstream, and a chain of cheap ops (an unrolled
         LSTM's cells, each cheaper than sending its state) snowballs into one group that
         swallows the layers below it too (4 pipelined layers became one device's work).
   Without the guard, the literature's bare rule folds every branch of an in-tree into its join
   (two parallel matmul towers feeding one Add become one group, one device).
3. Backward nodes follow their forward node (`Node.follows`, set by autodiff), so a layer's
   gradient runs where the layer ran.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flowctl.engine.graph import Graph, parse_ref
from flowctl.engine.opdef import CONTROL
from flowctl.engine.placement.cost import CostTable
from flowctl.engine.placement.feasibility import Feasibility, UnionFind

MAX_GROUP = 512  # stop growing a group past this: keeps coarsening linear and leaves placers a choice
MAX_REASONS = 6


@dataclass
class Group:
    id: int  # the graph index of its first member
    members: list[str]  # graph order
    feasible: list[str]  # device names
    merged: list[str] = field(default_factory=list)  # why members share this group

    def to_dict(self) -> dict[str, object]:
        return {"id": self.id, "size": len(self.members), "members": list(self.members),
                "feasible": list(self.feasible), "merged": list(self.merged)}


@dataclass
class Coarsening:
    feas: Feasibility
    group_of: list[int]  # per graph node index -> group id
    groups: dict[int, Group]  # by id, in graph order
    feasible_idx: dict[int, frozenset[int]]  # group id -> device indices

    def group(self, node: str) -> Group:
        return self.groups[self.group_of[self.feas.index[node]]]


def coarsen(graph: Graph, feas: Feasibility, table: CostTable | None = None) -> Coarsening:
    """Groups for the placers (module docstring). `table` supplies op times and tensor sizes for
    rule (c); without it rule (c) is off."""
    m = _Merging(feas, table)  # phase 1: the colocation groups
    _merge_loops(graph, m)
    view = _ForwardView(graph, feas, table)
    cheapest_link = _cheapest_transfer(table) if table is not None and len(feas.devices) > 1 else None
    _merge_forward(m, view, graph.topo_order(), cheapest_link)
    # Phase 3: §4.1 gradients were made for a forward node; keep them together.
    for i, nd in enumerate(view.nodes):
        if nd.follows and nd.follows in feas.index:
            m.union(i, feas.index[nd.follows], f"gradients follow their forward node '{nd.follows}'")
    return m.result()


def _merge_loops(graph: Graph, m: "_Merging") -> None:
    """§4.4: a while loop is placed as a unit. Its body runs once per iteration, so a body split
    over devices pays a transfer (and a control-loop message) per iteration for every value that
    crosses; the cost model's loop weights make the unit cost its iterations. A nested loop joins
    the loop around it. (Nodes a device constraint pins elsewhere stay apart: `union` keeps every
    hard constraint.)"""
    from flowctl.engine.frames import ROOT, assign_frames, has_control_flow

    if not has_control_flow(graph.nodes.values()):
        return
    frames = assign_frames(graph)
    anchor: dict[str, int] = {}
    for name, frame in frames.exec_frame.items():
        if frame == ROOT or name not in m.feas.index:
            continue
        while frames.parent.get(frame, ROOT) != ROOT:
            frame = frames.parent[frame]
        i = m.feas.index[name]
        if frame not in anchor:
            anchor[frame] = i
        else:
            m.union(anchor[frame], i, f"one while loop, '{frame}', is placed as a unit (§4.4)")


class _Merging:
    """Groups as they merge: a union-find over graph indices, and per root its feasible devices,
    members, work per device and the reasons for its merges."""

    def __init__(self, feas: Feasibility, table: CostTable | None) -> None:
        N = len(feas.order)
        self.feas = feas
        self.uf = UnionFind(N)
        self.gfeas: dict[int, frozenset[int]] = {}
        self.members: dict[int, list[int]] = {}
        self.reasons: dict[int, list[str]] = {}
        for g, ms in feas.members.items():
            for m in ms[1:]:
                self.uf.union(g, m)
            self.gfeas[g] = feas.feasible[g]
            self.members[g] = list(ms)
            if len(ms) > 1:
                self.reasons[g] = ["colocation: " + r for r in feas.links.get(g, [])[:MAX_REASONS]]
        D = len(feas.devices)
        work = [[0.0] * D for _ in range(N)]  # per node; merged groups sum theirs
        if table is not None:
            for k, name in enumerate(table.names):
                work[feas.index[name]] = list(table.times[k])
        self.gwork: dict[int, list[float]] = {}
        for g, ms in self.members.items():
            self.gwork[g] = [sum(work[m][d] for m in ms) for d in range(D)]

    def union(self, a: int, b: int, why: str) -> bool:
        """Merge the groups of a and b when the rules allow it (module docstring); true when they
        are one group afterwards."""
        uf, gfeas, members, gwork, reasons = self.uf, self.gfeas, self.members, self.gwork, self.reasons
        ra, rb = uf.find(a), uf.find(b)
        if ra == rb:
            return True
        inter = gfeas[ra] & gfeas[rb]
        if not inter or len(members[ra]) + len(members[rb]) > MAX_GROUP:
            return False
        # A soft merge may narrow the lighter side only: a heavy op capable of a GPU must not be
        # pinned to the CPU because its cheap consumer has only a CPU kernel.
        heavy = ra if min(gwork[ra], default=0.0) >= min(gwork[rb], default=0.0) else rb
        if inter != gfeas[heavy]:
            return False
        r = uf.union(ra, rb)
        o = rb if r == ra else ra
        gfeas[r] = inter
        members[r] = sorted(members[ra] + members[rb])
        gwork[r] = [x + y for x, y in zip(gwork[ra], gwork[rb])]
        rs = reasons.get(r, []) + reasons.get(o, [])
        if len(rs) < MAX_REASONS:
            rs.append(why)
        reasons[r] = rs[:MAX_REASONS]
        for table_ in (gfeas, members, gwork, reasons):
            table_.pop(o, None)  # type: ignore[attr-defined]
        return True

    def result(self) -> Coarsening:
        feas, order = self.feas, self.feas.order
        group_of = [self.uf.find(i) for i in range(len(order))]
        groups: dict[int, Group] = {}
        for g in sorted(self.members):
            groups[g] = Group(g, [order[m] for m in self.members[g]],
                              [feas.devices[d] for d in sorted(self.gfeas[g])], list(self.reasons.get(g, [])))
        return Coarsening(feas, group_of, groups, dict(self.gfeas))


class _ForwardView:
    """Producers/consumers among the step's nodes that are not gradients, without ref edges and
    without edges into CONTROL sinks; and the step's data edges with their sizes, for rule (c)."""

    def __init__(self, graph: Graph, feas: Feasibility, table: CostTable | None) -> None:
        order = feas.order
        N = len(order)
        self.nodes = nodes = [graph.nodes[n] for n in order]
        in_step = [True] * N
        if table is not None:  # only what the step runs: initialisers must not link groups together
            in_step = [False] * N
            for name in table.names:
                in_step[feas.index[name]] = True
        self.forward = forward = [not nd.follows and in_step[i] for i, nd in enumerate(nodes)]
        self.computed = [bool(nd.inputs) for nd in nodes]  # sources (Const, Variable, Placeholder) are not
        self.prod: list[list[int]] = [[] for _ in range(N)]
        self.cons: list[list[int]] = [[] for _ in range(N)]
        # (consumer, producer port, bytes) per producer; (producer, port, bytes) per consumer
        self.out_edges: list[list[tuple[int, int, int]]] = [[] for _ in range(N)]
        self.in_edges: list[list[tuple[int, int, int]]] = [[] for _ in range(N)]
        if table is not None:
            for k, name in enumerate(table.names):
                for j, p in table.inputs[k]:
                    src, dst, nb = feas.index[table.names[j]], feas.index[name], table.out_bytes[j][p]
                    self.out_edges[src].append((dst, p, nb))
                    self.in_edges[dst].append((src, p, nb))
        for i, nd in enumerate(nodes):
            if not forward[i] or nd.opdef.group == CONTROL:
                continue
            skip = nd.opdef.ref_inputs
            srcs = [parse_ref(r)[0] for k, r in enumerate(nd.inputs) if k not in skip] + list(nd.control_inputs)
            for s in dict.fromkeys(srcs):
                j = feas.index[s]
                if forward[j]:
                    self.prod[i].append(j)
                    self.cons[j].append(i)

    def scan(self, m: _Merging, root: int) -> tuple[set[int], set[int]]:
        """(consumer groups, computed-producer groups) of a group in the forward view."""
        cons: set[int] = set()
        prods: set[int] = set()
        find = m.uf.find
        for x in m.members[root]:
            for c in self.cons[x]:
                cons.add(find(c))
            for p in self.prod[x]:
                if self.computed[p]:
                    prods.add(find(p))
        cons.discard(root)
        prods.discard(root)
        return cons, prods


def _merge_forward(m: _Merging, view: _ForwardView, topo: list[str],
                   cheapest_link: Callable[[int], float] | None) -> None:
    """Phase 2: in reverse topological order, a group whose outputs feed exactly one other group
    joins it under rule (a), (b) or (c) of the module docstring."""
    index, members, gwork, find = m.feas.index, m.members, m.gwork, m.uf.find
    for name in reversed(topo):
        u = index[name]
        if not view.forward[u]:
            continue
        a = find(u)
        if len(members[a]) > MAX_GROUP:
            continue
        cons, prods_a = view.scan(m, a)
        if len(cons) != 1:
            continue
        b = next(iter(cons))
        if prods_a <= {b} and min(gwork[a]) <= min(gwork[b]):
            m.union(a, b, f"'{name}' hangs off its only consumer group, which does more work")
            continue
        _, prods_b = view.scan(m, b)
        if prods_b <= {a}:
            m.union(a, b, f"'{name}' feeds its only consumer, which reads nothing else computed")
            continue
        if cheapest_link is not None:
            mine = min(gwork[a])
            crossing = {(x, p): nb for x in members[a] for c, p, nb in view.out_edges[x] if find(c) == b}
            # One transfer per tensor and device (§3.2.2): a tensor read twice is received once.
            received = {(s, p): nb for x in members[a] for s, p, nb in view.in_edges[x]
                        if view.forward[s] and view.computed[s] and find(s) not in (a, b)}
            sent = sum(crossing.values())
            if mine <= cheapest_link(sent) and sum(received.values()) <= sent:
                m.union(a, b, f"'{name}' is cheaper to run than to send to another device")


def _cheapest_transfer(table: CostTable) -> Callable[[int], float]:
    D = len(table.devices)
    pairs = [(a, b) for a in range(D) for b in range(D) if a != b]

    def cost(nbytes: int) -> float:
        return min(table.transfer(nbytes, a, b) for a, b in pairs)

    return cost
