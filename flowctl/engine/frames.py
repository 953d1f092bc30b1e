"""Frames: which control-flow context each node runs in (whitepaper §4.4).

A while loop's body runs in a *frame* named by its Enter nodes' `frame_name`; a frame nested in a
loop body has that loop's frame as its parent, and the root frame is "". Values cross frame
boundaries only through Enter (parent -> child) and Exit (child -> parent); a NextIteration passes a
value from one iteration of a frame to the next. Everything else runs in the frame of its inputs.

`assign_frames` derives this from the graph alone (the frame names are attributes), so a graph
read back from JSON has the same frames, and it rejects a graph where a value would cross a frame
boundary any other way (a GraphError naming both nodes and both frames).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Graph, Node, parse_ref

CONTROL_FLOW_OPS = frozenset({"Switch", "Merge", "Enter", "Exit", "NextIteration"})
LOOP_OPS = frozenset({"Enter", "Exit", "NextIteration"})
ROOT = ""


@dataclass
class Frames:
    exec_frame: dict[str, str] = field(default_factory=dict)  # node -> the frame it runs in
    out_frame: dict[str, str] = field(default_factory=dict)  # node -> the frame its outputs live in
    parent: dict[str, str] = field(default_factory=dict)  # frame -> enclosing frame
    parallel: dict[str, int] = field(default_factory=dict)  # frame -> parallel_iterations
    expected: dict[str, int] = field(default_factory=dict)  # frame -> stated trip count (0: unknown)

    def weight(self, node: str) -> float:
        """How many times the node runs per step, as far as stated: the product of the expected
        trip counts of its frame and the frames around it (an unknown count counts as 1)."""
        return self.frame_weight(self.exec_frame.get(node, ROOT))

    def frame_weight(self, frame: str) -> float:
        """How many times per step an iteration of `frame` runs (1 for the root frame)."""
        w = 1.0
        while frame != ROOT:
            w *= max(1, self.expected.get(frame, 0))
            frame = self.parent[frame]
        return w


def has_control_flow(nodes: Iterable[Node]) -> bool:
    return any(n.op in CONTROL_FLOW_OPS for n in nodes)


def switch_reach(graph: Graph, switches: Iterable[str], within: Iterable[str] | None = None,
                 past_merge: bool = False) -> set[str]:
    """The Switches and every node their outputs reach by data or control edges (within `within`,
    default the whole graph): what may be dead when a Switch sends its untaken side (§4.4). A
    Merge is live when either input is, so the reach stops before one unless `past_merge`."""
    users = graph.consumers()
    inside = set(within) if within is not None else None
    out: set[str] = set()
    todo = list(switches)
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        todo.extend(u for u in users[n] if (inside is None or u in inside)
                    and (past_merge or graph.nodes[u].op != "Merge"))
    return out


def run_counts(graph: Graph) -> dict[str, float]:
    """node -> expected runs per step (1 outside loops): what cost models multiply an op's cost by,
    so a loop counts as its iteration cost times its trip count (§4.4)."""
    if not has_control_flow(graph.nodes.values()):
        return {}
    fr = assign_frames(graph)
    return {n: fr.weight(n) for n in graph.nodes if fr.exec_frame[n] != ROOT}


def output_counts(graph: Graph) -> dict[str, float]:
    """node -> how many times per step its outputs are produced (1 where absent): a node's run
    count, except an Exit's, whose value leaves the loop once per run of the frame around it (an
    Enter's already runs in the frame it is read from). A tensor crossing devices crosses this
    many times."""
    if not has_control_flow(graph.nodes.values()):
        return {}
    fr = assign_frames(graph)
    out = {}
    for n, node in graph.nodes.items():
        frame = fr.out_frame.get(n, ROOT) if node.op == "Exit" else fr.exec_frame[n]
        if frame != ROOT:
            out[n] = fr.frame_weight(frame)
    return out


def assign_frames(graph: Graph, names: Iterable[str] | None = None) -> Frames:
    """Frames of the given nodes (default all), checked: every data input of a node comes from
    its own frame, except an Enter's (from the parent) and a Merge's back edge (same frame)."""
    fr = Frames()
    for name in graph.topo_order(names):
        node = graph.nodes[name]
        here = _input_frame(graph, node, fr)
        fr.exec_frame[name] = here
        if node.op == "Enter":
            child = node.attrs["frame_name"]
            known = fr.parent.setdefault(child, here)
            if known != here:
                raise GraphError(f"Enter '{name}' enters frame '{child}' from frame '{here}', but "
                                 f"other Enters of that frame come from '{known}'")
            fr.parallel[child] = max(fr.parallel.get(child, 1), int(node.attrs["parallel_iterations"]))
            fr.expected[child] = max(fr.expected.get(child, 0), int(node.attrs["expected_iterations"]))
            fr.out_frame[name] = child
        elif node.op == "Exit":
            if here != node.attrs["frame_name"]:
                raise GraphError(f"Exit '{name}' leaves frame '{node.attrs['frame_name']}' but its input "
                                 f"runs in frame '{here}'")
            fr.out_frame[name] = fr.parent.get(here, ROOT)
        else:
            fr.out_frame[name] = here
    return fr


def _input_frame(graph: Graph, node: Node, fr: Frames) -> str:
    """The frame a node runs in: that of its inputs, which must agree."""
    frame: str | None = None
    first = ""
    # A ref input names state (a Variable in any frame) and carries no value: it sets no frame.
    refs = [r for k, r in enumerate(node.inputs)
            if not graph.is_back_edge(node, r) and k not in node.opdef.ref_inputs]
    for src in [parse_ref(r)[0] for r in refs] + list(node.control_inputs):
        f = fr.out_frame.get(src)
        if f is None:
            continue  # outside the subset being analysed (fed, or pruned away)
        if frame is None:
            frame, first = f, src
        elif f != frame:
            raise GraphError(f"node '{node.name}' ({node.op}) reads '{first}' from frame "
                             f"{_show(frame)} and '{src}' from frame {_show(f)}: values enter a loop "
                             f"only through Enter and leave it through Exit")
    return frame if frame is not None else ROOT


def _show(frame: str) -> str:
    return "(root)" if frame == ROOT else f"'{frame}'"
