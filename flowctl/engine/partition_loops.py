"""Loops whose body spans devices (whitepaper §4.4, "distributed execution" of control flow).

A loop's control (its Merges, Switches, NextIterations and the predicate) runs on one device. Every
other device that holds part of the body gets a *control loop* of its own, a Const entering the
frame, a Merge, a Switch on the predicate received from the controlling device each iteration, and
a NextIteration: so that device knows when an iteration starts and when the loop ends, as the paper
describes. Every Recv inside the frame takes a control edge from its device's Merge for that frame,
so it runs once per iteration, and the rendezvous key carries the frame and iteration (the frame
executor's StepContext). A value that is dead on the sending side travels as a dead token, so the
Send and Recv of every iteration meet, the final one included.

A value enters a loop on the device that reads it. An Enter read on another device gets a copy
there (`_enter/<enter>/cpu1`), fed in the parent frame, so the value crosses once, before the
loop, and each device's Enter hands it to every iteration of its own frame instance. Sending the
Enter's output would put the transfer *inside* the frame, where its Recv runs every iteration: a
loop invariant's Enter alone on a device (the weights' Enters of a backward loop, placed with the
weights) sends in iteration 0 only, as that device has no later iterations, so the Recv of
iteration 1 waits for ever; and a loop variable's Recv would wait on the very Merge it feeds. A
device holding an Enter of a loop nested in frame F (a copy included) runs a control loop of F.

Limits, reported as PlacementError: a loop's control nodes must share one device, and a loop nested
in another may not span devices.
"""
from __future__ import annotations

import numpy as np

from flowctl.engine.devices import short_device
from flowctl.engine.errors import PlacementError
from flowctl.engine.frames import ROOT, Frames, assign_frames, has_control_flow
from flowctl.engine.graph import Graph, Node, make_ref, parse_ref
from flowctl.engine.opdef import get_op

_CONTROL = ("Merge", "Switch", "NextIteration")


def add_control_loops(graph: Graph, members: list[str], where: dict[str, str]
                      ) -> tuple[Graph, list[str], dict[str, str], Frames | None, dict[tuple[str, str], str]]:
    """(graph with control loops added, members, placement, frames, anchors): `anchors[(frame,
    device)]` is the node whose control edge puts a Recv on that device into that frame."""
    if not has_control_flow(graph.nodes[n] for n in members):
        return graph, members, where, None, {}
    graph = graph.copy()
    where = dict(where)
    members = _enter_where_read(graph, members, where)
    frames = assign_frames(graph, members)
    by_frame: dict[str, set[str]] = {}
    for n in members:
        f = frames.exec_frame[n]
        if f != ROOT:
            by_frame.setdefault(f, set()).add(n)
    anchors: dict[tuple[str, str], str] = {}
    for frame, names in by_frame.items():
        control = sorted(n for n in names if _is_loop_control(graph, n))
        owners = {where[n] for n in control}
        if len(owners) != 1:
            raise PlacementError(f"loop '{frame}': its control nodes (Merge, Switch, NextIteration) are placed "
                                 f"on {sorted(owners) or 'no device'}; they must share one device (colocate them)")
        owner = owners.pop()
        merge = next(n for n in control if graph.nodes[n].op == "Merge")
        anchors[(frame, owner)] = merge
        pred = next(graph.nodes[n].inputs[1] for n in control if graph.nodes[n].op == "Switch")
        for device in sorted({where[n] for n in names} - {owner}):
            if frames.parent[frame] != ROOT:
                raise PlacementError(f"loop '{frame}' is nested in loop '{frames.parent[frame]}' and its body "
                                     f"spans {owner} and {device}: place a nested loop on one device")
            made = _control_loop(graph, frame, frames.parallel.get(frame, 1), pred, device)
            for n in made:
                where[n] = device
                members.append(n)
            anchors[(frame, device)] = made[2]
    return graph, members, where, assign_frames(graph, members), anchors


def _enter_where_read(graph: Graph, members: list[str], where: dict[str, str]) -> list[str]:
    """Give every Enter read on another device a copy on that device (see the module head), rewire
    the readers there to it, and drop an Enter no reader on its own device is left with. `graph`
    and `where` are updated in place; returns the new members, each copy just after its original."""
    member_set = set(members)
    readers: dict[str, dict[str, list[str]]] = {}  # Enter -> device -> its readers there
    for n in members:
        node = graph.nodes[n]
        for src in dict.fromkeys([parse_ref(r)[0] for r in node.inputs] + node.control_inputs):
            if src in member_set and graph.nodes[src].op == "Enter" and where[src] != where[n]:
                readers.setdefault(src, {}).setdefault(where[n], []).append(n)
    if not readers:
        return members
    copies: dict[str, list[str]] = {}
    for enter, by_device in readers.items():
        e = graph.nodes[enter]
        for device, users in by_device.items():
            name = f"_enter/{enter}/{short_device(device)}"
            if name in graph.nodes:
                raise PlacementError(f"node name '{name}' is reserved for the copy of Enter '{enter}' on {device}")
            graph.nodes[name] = Node(name, "Enter", list(e.inputs), list(e.control_inputs), dict(e.attrs),
                                     assigned_device=device, source=e.source, follows=e.follows,
                                     outputs=list(e.outputs))
            where[name] = device
            copies.setdefault(enter, []).append(name)
            for u in users:
                node = graph.nodes[u]
                node.inputs = [make_ref(name, parse_ref(r)[1]) if parse_ref(r)[0] == enter else r
                               for r in node.inputs]
                node.control_inputs = list(dict.fromkeys(name if c == enter else c for c in node.control_inputs))
    read_at_home: set[str] = set()
    for n in members:
        node = graph.nodes[n]
        for src in [parse_ref(r)[0] for r in node.inputs] + node.control_inputs:
            if src in readers and where[src] == where[n]:
                read_at_home.add(src)
    out: list[str] = []
    for n in members:
        if n not in readers or n in read_at_home:
            out.append(n)
        out.extend(copies.get(n, ()))
    return out


def _is_loop_control(graph: Graph, name: str) -> bool:
    node = graph.nodes[name]
    if node.op == "Merge":
        return any(graph.is_back_edge(node, r) for r in node.inputs)
    if node.op == "Switch":  # a loop's Switch reads its Merge (a cond's Switch does not)
        src = graph.nodes[parse_ref(node.inputs[0])[0]]
        return src.op == "Merge" and any(graph.is_back_edge(src, r) for r in src.inputs)
    return node.op == "NextIteration"


def _control_loop(graph: Graph, frame: str, parallel: int, pred: str, device: str) -> list[str]:
    """Const -> Enter -> Merge -> Switch(pred) -> Identity -> NextIteration -> Merge, on `device`."""
    base = f"_loop/{frame}/{short_device(device)}"
    names = [f"{base}/{part}" for part in ("start", "enter", "merge", "switch", "pivot", "next")]
    start, enter, merge, switch, pivot, nxt = names
    specs: list[tuple[str, str, list[str], dict[str, object]]] = [
        (start, "Const", [], {"value": np.zeros((0,), np.float32)}),
        (enter, "Enter", [f"{start}:0"], {"frame_name": frame, "parallel_iterations": parallel}),
        (merge, "Merge", [f"{enter}:0", f"{nxt}:0"], {}),
        (switch, "Switch", [f"{merge}:0", pred], {}),
        (pivot, "Identity", [f"{switch}:1"], {}),
        (nxt, "NextIteration", [f"{pivot}:0"], {"frame_name": frame}),
    ]
    for name, op, inputs, attrs in specs:
        if name in graph.nodes:
            raise PlacementError(f"node name '{name}' is reserved for the control loop of '{frame}'")
        graph.nodes[name] = Node(name, op, inputs, attrs=get_op(op).normalize_attrs(attrs, name),
                                 assigned_device=device)
    graph.check(device_kernels=False)
    return names
