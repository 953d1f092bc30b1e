"""Element-wise fusion, a graph pass `Graph -> Graph` (same conventions as engine/passes.py).

A maximal tree of element-wise ops whose interior values each feed exactly one node of the tree
becomes one FusedElementwise node (engine/ops/fused.py) carrying the tree as a small program. The
node takes the tree root's name, so every ref to the tree's one output stays valid; its inputs are
the tree's external inputs, deduplicated. The whitepaper (§5, "Optimizations") leaves kernel
fusion to the kernels; done as a pass, placement, partitioning (§3.2.2), the simulator, traces and
checkpoints all see an ordinary node.

What may be interior (absorbed, its name gone):
- not in `keep` (a fetched or fed name must survive), no control inputs and not a control input
  of anything (an ordering someone asked for stays expressible);
- its one output read by exactly one node, which is in the same tree.
What may be a member at all:
- an element-wise op with kernels on CPU and GPU, no state, no randomness, no ref inputs, one
  output; not ReduceTo / BroadcastLike (they change shape: no single-pass kernel);
- outside every control-flow frame (§4.4: values inside a frame are tagged per iteration) and
  every branch of a conditional (downstream of a Switch, up to its Merge: such values may be dead);
- the same requested device, colocation constraints and `placement` entry as the root, so fusing
  never changes where anything may run;
- not a sum of L2 losses (an AddN or Add reading an L2Loss: clipping's global norm, an L2
  penalty): a GPU plan makes that sum one MultiL2Loss node (engine/multi_l2.py), 1 + N/32 launches
  for its N terms where a fused tree would still leave each L2Loss its own two; what reads the sum
  (the norm's Mul, Sqrt, Maximum, Div) fuses as before.
The root may be kept, carry control inputs and be a control input: its name is the node's.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from flowctl.engine.frames import ROOT, assign_frames, has_control_flow, switch_reach
from flowctl.engine.graph import Graph, Node, parse_ref
from flowctl.engine.multi_l2 import is_l2_sum
from flowctl.engine.ops.fused import FUSED_OP, FusedProgram, FusedStep
from flowctl.engine.opdef import ELEMENTWISE, get_op
from flowctl.engine.passes import fix_references

__all__ = ["fusable", "fuse", "fused_nodes"]

# Element-wise in the registry's sense but not one value per output element.
_SHAPE_CHANGING = frozenset({"ReduceTo", "BroadcastLike"})


def fusable(node: Node) -> bool:
    """Whether `node` may be part of a fused tree at all (frames and devices aside)."""
    from flowctl.kernels.registry import has_kernel

    d = node.opdef
    return (d.group == ELEMENTWISE and node.op != FUSED_OP and node.op not in _SHAPE_CHANGING
            and not (d.stateful or d.resource or d.ref_inputs or d.is_async) and len(node.outputs) == 1
            and has_kernel(node.op, "cpu") and has_kernel(node.op, "gpu"))


def _bfloat16(graph: Graph, node: Node) -> bool:
    """A node on bfloat16 computes in float32 and rounds what it stores (kernels/bf16.py); a fused
    program would keep its intermediates in float32 and change those bits, so it stays unfused."""
    return (any(s.dtype == "bfloat16" for s in node.outputs)
            or any(graph.tensor(r).dtype == "bfloat16" for r in node.inputs))


def _where(node: Node, placement: Mapping[str, str]) -> tuple[str, tuple[str, ...], str | None, str | None]:
    return node.device, tuple(sorted(node.colocate_with)), placement.get(node.name), node.assigned_device


def _trees(graph: Graph, keep: set[str], placement: Mapping[str, str]) -> list[list[str]]:
    """The groups to fuse, each as its members in topological order, the root last."""
    frames = assign_frames(graph) if has_control_flow(graph.nodes.values()) else None
    # A conditional's branches (its root-frame Switches' reach, up to the Merge; a loop's
    # Switches run in the loop's frame, excluded as a whole): such values may be dead (§4.4).
    branches = switch_reach(graph, [n for n, node in graph.nodes.items() if node.op == "Switch"
                                    and frames.exec_frame.get(n, ROOT) == ROOT]) if frames is not None else set()
    users: dict[str, set[str]] = {n: set() for n in graph.nodes}
    ctrl_users: set[str] = set()
    for node in graph.nodes.values():
        for ref in node.inputs:
            users[parse_ref(ref)[0]].add(node.name)
        ctrl_users.update(node.control_inputs)
    candidates = {n for n, node in graph.nodes.items() if fusable(node) and n not in branches
                  and (frames is None or frames.exec_frame.get(n, ROOT) == ROOT) and not is_l2_sum(graph, node)
                  and not _bfloat16(graph, node)}
    taken: set[str] = set()
    trees: list[list[str]] = []
    for root in reversed(graph.topo_order()):  # consumers first: each tree grows from its bottom
        if root not in candidates or root in taken:
            continue
        where = _where(graph.nodes[root], placement)
        members: list[str] = []

        def grow(name: str) -> None:
            for ref in graph.nodes[name].inputs:
                src, port = parse_ref(ref)
                node = graph.nodes[src]
                if (src in candidates and src not in taken and port == 0 and src not in keep
                        and src not in ctrl_users and not node.control_inputs and users[src] == {name}
                        and _where(node, placement) == where):
                    taken.add(src)
                    grow(src)
            members.append(name)  # after its operands: a topological order

        taken.add(root)
        grow(root)
        if len(members) >= 2:
            trees.append(members)
    return trees


def _program(graph: Graph, members: list[str]) -> tuple[FusedProgram, list[str]]:
    """The members as a program, and the node's inputs (external refs, first use first)."""
    inside = {m: j for j, m in enumerate(members)}
    external: list[str] = []
    for m in members:
        for ref in graph.nodes[m].inputs:
            if parse_ref(ref)[0] not in inside and ref not in external:
                external.append(ref)
    n = len(external)
    steps = []
    for m in members:
        node = graph.nodes[m]
        args = tuple(n + inside[parse_ref(r)[0]] if parse_ref(r)[0] in inside else external.index(r)
                     for r in node.inputs)
        steps.append(FusedStep(node.op, dict(node.attrs), args, node.outputs[0].dtype, m))
    dtypes = tuple(graph.tensor(r).dtype for r in external)
    return FusedProgram(dtypes, tuple(steps)), external


def fuse(graph: Graph, keep: Iterable[str] = (), placement: Mapping[str, str] | None = None) -> Graph:
    """Fuse every maximal element-wise tree of two or more ops into one FusedElementwise node, in
    place. `keep`: node names that are fetched or fed (never absorbed). `placement`: devices a
    strategy already fixed (node -> device); a tree never spans two of them."""
    kept = set(keep)
    placement = placement or {}
    renamed: dict[str, str] = {}
    fused_op = get_op(FUSED_OP)
    for members in _trees(graph, kept, placement):
        root = graph.nodes[members[-1]]
        program, inputs = _program(graph, members)
        attrs = fused_op.normalize_attrs({"program": program.to_json()}, root.name)
        graph.nodes[root.name] = Node(root.name, FUSED_OP, inputs, list(root.control_inputs), attrs, root.device,
                                      list(root.colocate_with), root.assigned_device, root.source, root.follows,
                                      list(root.outputs))
        for m in members[:-1]:
            del graph.nodes[m]
            renamed[m] = root.name
    fix_references(graph, renamed)
    return graph.check()


def fused_nodes(graph: Graph) -> list[str]:
    return [n for n, node in graph.nodes.items() if node.op == FUSED_OP]
