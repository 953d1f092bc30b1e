"""Partitioning a placed graph into one subgraph per device (whitepaper §3.2.2, §5.2, §5.5).

`partition(graph, placement)` cuts every cross-device edge x -> y into x -> Send (on x's device) and
Recv -> y (on y's device), as in the paper's Figure 4:
- one Recv per (tensor, destination device), shared by every consumer there, so the tensor moves
  once per device pair and is allocated once on arrival (§3.2.2);
- a cross-device *control* edge x -> ^y becomes a tiny dummy tensor, made on x's device after x,
  sent and received, with the Recv as y's control input (what TensorFlow does); so does a data
  edge into a barrier (a Group: it waits for its inputs but never reads them), so a training
  step's Group does not pull every updated variable to its device;
- edges inside a device are left alone: no Send/Recv between nodes on the same device;
- a fed tensor is never sent: each partition that consumes it gets a Placeholder named
  `feed_node_name(ref)` to be fed directly (the client hands it to every device that reads it);
- a reference edge (Assign's variable input) cannot cross devices: stateful ops must be colocated
  with their variable (§4.3), so that is a PlacementError, never a silent move.

Options:
- `compress=True` (§5.5): float32 tensors travel as their upper 16 bits and are widened on arrival.
- `recv_schedule="alap"` (§5.2): control edges delay each Recv until shortly before it is needed;
  see `_schedule_receives`.

Each partition passes `Graph.check()`, and node names are kept, so an error inside a partition names
the user's node. Inserted nodes are named `_send/...`, `_recv/...`, `_ctrl/...` and `_feed/...`,
and for loops (`partition_loops`) `_loop/...` and `_enter/...`.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from flowctl.engine.devices import canonical, device_matches, short_device
from flowctl.engine.errors import GraphError, PlacementError
from flowctl.engine.frames import ROOT, Frames, switch_reach
from flowctl.engine.graph import Graph, Node, make_ref, parse_ref
from flowctl.engine.ops.communication import COMPRESSIBLE
from flowctl.engine.opdef import COMMUNICATION, CONTROL, get_op
from flowctl.engine.partition_loops import add_control_loops

RECV_SCHEDULES = ("asap", "alap")


def _link(src: str, dst: str) -> str:
    return f"{short_device(src)}_to_{short_device(dst)}"


def send_node_name(ref: str, src: str, dst: str) -> str:
    node, port = parse_ref(ref)
    return f"_send/{node}/{port}/{_link(src, dst)}"


def recv_node_name(ref: str, src: str, dst: str) -> str:
    node, port = parse_ref(ref)
    return f"_recv/{node}/{port}/{_link(src, dst)}"


def feed_node_name(ref: str) -> str:
    """The Placeholder a partition is fed through for the fed tensor `ref`."""
    node, port = parse_ref(ref)
    return f"_feed/{node}/{port}"


def _control_names(node: str, src: str, dst: str) -> tuple[str, str, str]:
    """(dummy Const, Send, Recv) carrying a control edge from `node` to device `dst`."""
    link = _link(src, dst)
    return f"_ctrl/{node}/{link}", f"_send/{node}/ctrl/{link}", f"_recv/{node}/ctrl/{link}"


@dataclass
class _Transfer:
    """One tensor (or control signal) moving from `src` to `dst`: one Send, one Recv."""

    ref: str  # "node:port", or "^node" for a control edge
    src: str
    dst: str
    send: str
    recv: str
    consumers: list[str] = field(default_factory=list)  # on dst, in graph order


def partition(graph: Graph, placement: Mapping[str, str], *, nodes: Iterable[str] | None = None,
              feeds: Iterable[str] = (), compress: bool = False, recv_schedule: str = "asap",
              durations: Mapping[str, float] | None = None) -> dict[str, Graph]:
    """Split `graph` (or the subset `nodes` of it) into {device: partition graph}.

    `placement` maps node name -> device (any spelling; canonicalised). Every node partitioned must
    be in it, on a device its own constraint allows. `feeds`: refs the client feeds (their producers
    need not be among `nodes`). `durations`: estimated seconds per node for the ALAP calculation
    (default 1 per node). Devices with no nodes get no partition."""
    if recv_schedule not in RECV_SCHEDULES:
        raise ValueError(f"recv_schedule must be one of {RECV_SCHEDULES}, not {recv_schedule!r}")
    fed = set(feeds)
    if nodes is None:
        members = list(graph.nodes)
    else:
        wanted = set(nodes)
        members = [n for n in graph.nodes if n in wanted]
    members = _with_ref_producers(graph, members)
    where = _devices(graph, members, placement)
    graph, members, where, frames, anchors = add_control_loops(graph, members, where)
    transfers, feeds_by_device = _find_transfers(graph, members, where, fed)
    parts = _build_partitions(graph, members, where, fed, transfers, feeds_by_device, compress)
    scheduled = transfers
    if frames is not None:  # §4.4: a Recv inside a loop runs once per iteration of its frame
        scheduled = {}
        for key, t in transfers.items():
            frame = frames.out_frame[_producer(t)]
            if frame:
                parts[t.dst].nodes[t.recv].control_inputs.append(anchors[(frame, t.dst)])
            else:
                scheduled[key] = t  # (ALAP places only Recvs of the root frame)
    if recv_schedule == "alap":
        anchors_ok = None if frames is None else _live_root_nodes(graph, members, frames)
        _schedule_receives(graph, members, where, parts, scheduled, durations or {}, anchors_ok)
    for d, g in parts.items():
        try:
            g.check()
        except GraphError as e:
            raise GraphError(f"partition for {d}: {e}") from e
    return parts


def _producer(t: _Transfer) -> str:
    return t.ref[1:] if t.ref.startswith("^") else parse_ref(t.ref)[0]


def _find_transfers(graph: Graph, members: list[str], where: dict[str, str], fed: set[str]
                    ) -> tuple[dict[tuple[str, str], _Transfer], dict[str, list[str]]]:
    """Pass 1: every transfer, keyed by (ref, destination device), with its consumers there in
    graph order; and the fed refs each device consumes, in order of first use."""
    transfers: dict[tuple[str, str], _Transfer] = {}
    feeds_by_device: dict[str, list[str]] = {}
    for name in members:
        node, dst = graph.nodes[name], where[name]
        barrier = _is_barrier(node)
        control_from = list(node.control_inputs)
        for i, ref in enumerate(node.inputs):
            src_node, _ = parse_ref(ref)
            if i in node.opdef.ref_inputs:
                if where.get(src_node) != dst:
                    raise PlacementError(
                        f"node '{name}' ({node.op}) on {dst} updates variable '{src_node}' on "
                        f"{where.get(src_node)}: state and the ops that assign it must share a device "
                        f"(§4.3); colocate them")
                continue
            if ref in fed:
                feeds_by_device.setdefault(dst, [])
                if ref not in feeds_by_device[dst]:
                    feeds_by_device[dst].append(ref)
                continue
            if src_node not in where:
                raise GraphError(f"node '{name}' input '{ref}': '{src_node}' is neither partitioned nor fed")
            src = where[src_node]
            if src != dst and barrier:
                control_from.append(src_node)  # a barrier waits for its inputs, never reads them
            elif src != dst:
                t = transfers.get((ref, dst))
                if t is None:
                    t = transfers[(ref, dst)] = _Transfer(ref, src, dst, send_node_name(ref, src, dst),
                                                          recv_node_name(ref, src, dst))
                t.consumers.append(name)
        for c in dict.fromkeys(control_from):
            if c not in where:
                raise GraphError(f"node '{name}' control input '^{c}' is not among the partitioned nodes")
            src = where[c]
            if src != dst:
                key = ("^" + c, dst)
                t = transfers.get(key)
                if t is None:
                    _, send, recv = _control_names(c, src, dst)
                    t = transfers[key] = _Transfer("^" + c, src, dst, send, recv)
                t.consumers.append(name)
    return transfers, feeds_by_device


def _build_partitions(graph: Graph, members: list[str], where: dict[str, str], fed: set[str],
                      transfers: dict[tuple[str, str], _Transfer], feeds_by_device: dict[str, list[str]],
                      compress: bool) -> dict[str, Graph]:
    """Pass 2: each partition in graph order: feeds first, a Recv just before its first consumer,
    a Send just after its producer (insertion order is the executors' tie-break order)."""
    parts: dict[str, Graph] = {}
    for d in dict.fromkeys(where[n] for n in members):
        parts[d] = Graph(seed=graph.seed)
    for d, refs in feeds_by_device.items():
        for ref in refs:
            spec = graph.tensor(ref).spec
            _add(parts[d], Node(feed_node_name(ref), "Placeholder",
                                attrs={"dtype": spec.dtype, "shape": spec.shape}, assigned_device=d), new=True)
    recv_of = {(t.ref, t.dst): t.recv for t in transfers.values()}
    # A Recv of a value that may be dead (a cond's untaken side, not past its Merge) must reach
    # an executor that propagates deadness, even where its partition has no control-flow op.
    dead = switch_reach(graph, [n for n in members if graph.nodes[n].op == "Switch"], members)
    sends_after: dict[str, list[_Transfer]] = {}
    recvs_before: dict[str, list[_Transfer]] = {}
    for t in transfers.values():
        sends_after.setdefault(_producer(t), []).append(t)
        recvs_before.setdefault(t.consumers[0], []).append(t)
    for name in members:
        d = where[name]
        g = parts[d]
        for t in recvs_before.get(name, []):
            _add(g, _recv_node(graph, t, compress, parse_ref(t.ref.lstrip("^"))[0] in dead), new=True)
        _add(g, _local_node(graph.nodes[name], d, where, fed, recv_of))
        for t in sends_after.get(name, []):
            for extra in _send_nodes(graph, t, compress):
                _add(g, extra, new=True)
    return parts


def _local_node(node: Node, d: str, where: dict[str, str], fed: set[str],
                recv_of: dict[tuple[str, str], str]) -> Node:
    """`node`'s copy in the partition of its device `d`: fed inputs read the partition's feed
    Placeholder, inputs from other devices their Recv (a barrier's become control inputs)."""
    inputs = []
    control_from = list(node.control_inputs)
    for i, ref in enumerate(node.inputs):
        if i not in node.opdef.ref_inputs and ref in fed:
            inputs.append(make_ref(feed_node_name(ref), 0))
        elif i not in node.opdef.ref_inputs and where[parse_ref(ref)[0]] != d:
            if _is_barrier(node):
                control_from.append(parse_ref(ref)[0])
            else:
                inputs.append(make_ref(recv_of[(ref, d)], 0))
        else:
            inputs.append(ref)
    control = [c if where[c] == d else recv_of[("^" + c, d)] for c in control_from]
    return Node(node.name, node.op, inputs, list(dict.fromkeys(control)), dict(node.attrs), node.device,
                list(node.colocate_with), d, node.source, node.follows, list(node.outputs))


def _is_barrier(node: Node) -> bool:
    """A control op with no outputs (Group) takes data inputs only to wait for them: across devices
    a control transfer (an empty tensor) does the same job without moving the data."""
    return node.opdef.group == CONTROL and not node.outputs


def _with_ref_producers(graph: Graph, members: list[str]) -> list[str]:
    """Add the variables that partitioned nodes assign (ref inputs): the assignment needs its
    Variable node in its partition even when no one reads the variable this step."""
    have = set(members)
    extra = set()
    for name in members:
        node = graph.nodes[name]
        for i in node.opdef.ref_inputs:
            src = parse_ref(node.inputs[i])[0]
            if src not in have:
                extra.add(src)
    if not extra:
        return members
    return [n for n in graph.nodes if n in have or n in extra]


def _devices(graph: Graph, members: list[str], placement: Mapping[str, str]) -> dict[str, str]:
    where: dict[str, str] = {}
    missing = [n for n in members if n not in placement]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise PlacementError(f"the placement gives no device for node(s) "
                             f"{', '.join(repr(m) for m in missing[:5])}{more}")
    for n in members:
        d = canonical(placement[n])
        node = graph.nodes[n]
        if node.device and not device_matches(node.device, d):
            raise PlacementError(f"node '{n}' ({node.op}) asks for device '{node.device}' but the "
                                 f"placement puts it on {d}")
        if node.opdef.group == COMMUNICATION:
            raise GraphError(f"node '{n}' ({node.op}): the graph is already partitioned")
        where[n] = d
    return where


def _add(g: Graph, node: Node, new: bool = False) -> None:
    if node.name in g.nodes:
        raise GraphError(f"partition: node name '{node.name}' is taken; rename the node "
                         f"(names starting _send/, _recv/, _ctrl/, _feed/, _loop/, _enter/ are reserved)")
    if new:  # (a copied node's attrs are normalised already; doing it again would copy tensors)
        node.attrs = get_op(node.op).normalize_attrs(node.attrs, node.name)
    g.nodes[node.name] = node
    g._counts.setdefault(node.name, 0)


def _link_attrs(t: _Transfer, compress: bool) -> dict[str, object]:
    return {"tensor_name": t.ref, "send_device": t.src, "recv_device": t.dst, "compress": compress}


def _send_nodes(graph: Graph, t: _Transfer, compress: bool) -> list[Node]:
    if t.ref.startswith("^"):
        # A control edge carries no data: send an empty float32 tensor made after the source ran.
        dummy, _, _ = _control_names(t.ref[1:], t.src, t.dst)
        const = Node(dummy, "Const", control_inputs=[t.ref[1:]],
                     attrs={"value": np.zeros((0,), np.float32)}, assigned_device=t.src)
        send = Node(t.send, "Send", [make_ref(dummy, 0)], attrs=_link_attrs(t, False), assigned_device=t.src)
        return [const, send]
    squeeze = compress and graph.tensor(t.ref).dtype == COMPRESSIBLE
    return [Node(t.send, "Send", [t.ref], attrs=_link_attrs(t, squeeze), assigned_device=t.src)]


def _recv_node(graph: Graph, t: _Transfer, compress: bool, maybe_dead: bool = False) -> Node:
    if t.ref.startswith("^"):
        attrs = {**_link_attrs(t, False), "dtype": "float32", "shape": (0,)}
    else:
        spec = graph.tensor(t.ref).spec
        attrs = {**_link_attrs(t, compress and spec.dtype == COMPRESSIBLE), "dtype": spec.dtype,
                 "shape": spec.shape}
    if maybe_dead:
        attrs["maybe_dead"] = True
    return Node(t.recv, "Recv", attrs=attrs, assigned_device=t.dst)


def _live_root_nodes(graph: Graph, members: list[str], frames: Frames) -> set[str]:
    """The nodes that may delay a root-frame Recv in a graph with control flow (§4.4): those whose
    outputs live in the root frame (a control edge from inside a loop would pull the Recv into the
    loop's frame) and that are never dead, i.e. downstream of no cond's Switch in the root frame
    (a dead control input would make the Recv, and its consumer, dead)."""
    switches = [n for n in members if graph.nodes[n].op == "Switch" and frames.exec_frame[n] == ROOT]
    maybe_dead = switch_reach(graph, switches, members, past_merge=True)
    return {n for n in members if frames.out_frame[n] == ROOT and n not in maybe_dead}


def _schedule_receives(graph: Graph, members: list[str], where: dict[str, str], parts: dict[str, Graph],
                       transfers: dict[tuple[str, str], _Transfer], durations: Mapping[str, float],
                       anchors_ok: set[str] | None = None) -> None:
    """§5.2 ASAP/ALAP: give each Recv a control input so it starts shortly before it is needed.

    An ASAP pass over the whole (unpartitioned) graph estimates each node's start and finish with
    `durations` (1 per node by default; transfers and device contention are ignored). For a Recv
    whose first consumer c (in a topological order of the whole graph) would start at s(c), the
    control input comes from the node u on the same device that finishes latest with
    f(u) <= s(c) and that precedes c in that order (ties go to c's direct inputs, then the later
    node). No such u: the Recv keeps starting at once.

    Why this cannot deadlock across devices: place each Recv just before c in the global order.
    Every original edge, every Send (just after its producer) -> Recv (just before c) pair and every
    new u -> Recv edge then points forward in one total order, so the partitioned graph, with the
    rendezvous links, stays acyclic.

    `anchors_ok`: the only nodes u may be (None: any); see `_live_root_nodes`.
    """
    member_set = set(members)
    # (A topological order of the whole graph, restricted to the members, is one of the members.)
    order = [n for n in graph.topo_order() if n in member_set]
    pos = {n: i for i, n in enumerate(order)}
    finish: dict[str, float] = {}
    start: dict[str, float] = {}
    for n in order:
        node = graph.nodes[n]
        preds = [parse_ref(r)[0] for i, r in enumerate(node.inputs)
                 if i not in node.opdef.ref_inputs and not graph.is_back_edge(node, r)]
        s = max((finish[p] for p in preds + node.control_inputs if p in member_set), default=0.0)
        start[n] = s
        finish[n] = s + float(durations.get(n, 1.0))
    # Per device, sweep the nodes in order, keeping their (finish, position) sorted; each Recv's
    # query (latest finish <= s(c) among nodes before c) is then one bisection.
    queries: dict[str, list[tuple[int, _Transfer]]] = {}
    for t in transfers.values():
        c = min(t.consumers, key=pos.__getitem__)
        queries.setdefault(t.dst, []).append((pos[c], t))
    for dev, qs in queries.items():
        qs.sort(key=lambda q: q[0])
        seen: list[tuple[float, int]] = []
        mine = iter(n for n in order if where[n] == dev and (anchors_ok is None or n in anchors_ok))
        nxt = next(mine, None)
        for pc, t in qs:
            while nxt is not None and pos[nxt] < pc:
                bisect.insort(seen, (finish[nxt], pos[nxt]))
                nxt = next(mine, None)
            c = order[pc]
            k = bisect.bisect_right(seen, (start[c], len(order)))
            if k == 0:
                continue  # nothing on this device finishes before c starts: keep the Recv ASAP
            best_finish, best_pos = seen[k - 1]
            cnode = graph.nodes[c]
            direct = [pos[p] for p in [parse_ref(r)[0] for r in cnode.inputs] + cnode.control_inputs
                      if p in member_set and where[p] == dev and finish[p] == best_finish
                      and (anchors_ok is None or p in anchors_ok)]
            chosen = order[max(direct) if direct else best_pos]
            parts[dev].nodes[t.recv].control_inputs.append(chosen)
