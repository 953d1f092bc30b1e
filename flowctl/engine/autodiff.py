"""Automatic differentiation (whitepaper §4.1): extend the graph with gradient nodes.

Walking backwards from the ys, each op's registered gradient function receives the gradients of its
outputs and returns those of its inputs. Where an output is used several times the contributions are
summed with one AddN; an unused output of a multi-output op contributes a zero gradient.
Gradient nodes are named under `gradients/<forward node>` and remember the forward node they follow,
which the placer uses to keep them on the same device.

A sum of weight gradients of products, sum_t A_t^T B_t (a weight used at every step of an unrolled
recurrence), is built as one product of the stacked operands, [A_1; ...; A_T]^T [B_1; ...; B_T]:
the same sum, but one BLAS call of T times the rows instead of T small ones and a T-way AddN.
"""
from __future__ import annotations

from typing import Any, Sequence

from flowctl.engine.control_grad import while_gradient
from flowctl.engine.dtypes import is_float
from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Graph, Node, Tensor, parse_ref


class OpView:
    """What a gradient function sees of the forward node."""

    def __init__(self, graph: Graph, node: Node) -> None:
        self.graph = graph
        self.node = node
        self.name = node.name
        self.attrs = node.attrs
        self.inputs = [Tensor(graph, *parse_ref(r)) for r in node.inputs]
        self.outputs = [Tensor(graph, node.name, i) for i in range(len(node.outputs))]


def _between(graph: Graph, ys: Sequence[Tensor], xs: Sequence[Tensor]) -> set[str]:
    """Nodes on some path from an x to a y."""
    users = graph.consumers()
    fwd: set[str] = set()
    stack = [x.node for x in xs]
    while stack:
        n = stack.pop()
        if n in fwd:
            continue
        fwd.add(n)
        stack.extend(users[n])
    back: set[str] = set()
    stack = [y.node for y in ys]
    while stack:
        n = stack.pop()
        if n in back or n not in fwd:
            continue
        back.add(n)
        stack.extend(parse_ref(r)[0] for r in graph.nodes[n].inputs)
    return back


def gradients(ys: Tensor | Sequence[Tensor], xs: Tensor | Sequence[Tensor],
              grad_ys: Sequence[Any] | None = None, name: str = "gradients",
              stop_at: set[str] | frozenset[str] = frozenset()) -> list[Tensor | None]:
    """d(sum of ys)/d(each x). A y's gradient defaults to ones; an x no y depends on gets None.
    Nodes named in `stop_at` pass no gradient to their inputs.

    §4.4: a while loop met on the way is differentiated as a unit once the gradients of all its
    Exits are known (engine/control_grad.py); a cond's Switch and Merge have gradients of their own."""
    from flowctl.engine.ops import elementwise as ew

    ys = [ys] if isinstance(ys, Tensor) else list(ys)
    xs = [xs] if isinstance(xs, Tensor) else list(xs)
    if not ys:
        raise GraphError("gradients: no ys given")
    graph = ys[0].graph
    relevant = _between(graph, ys, xs)
    contribs: dict[str, list[Tensor]] = {}
    before = set(graph.nodes)
    loops = _Loops(graph, relevant, ys[0].node, before)

    with graph.as_default(), graph.name_scope(name):
        for i, y in enumerate(ys):
            gy = grad_ys[i] if grad_ys is not None and grad_ys[i] is not None else None
            if gy is None:
                with graph.following(y.node):
                    gy = ew.ones_like(y, name=f"{y.node}_seed")
            contribs.setdefault(y.name, []).append(gy)

        for name_ in reversed(graph.topo_order(relevant)):
            node = graph.nodes[name_]
            out_refs = [f"{name_}:{p}" for p in range(len(node.outputs))]
            if loops.inside(name_):
                for ref, g in loops.exit_reached(node, contribs, name):
                    if ref.split(":")[0] in relevant and is_float(graph.tensor(ref).dtype):
                        contribs.setdefault(ref, []).append(g)
                continue
            if not any(r in contribs for r in out_refs):
                continue
            opdef = node.opdef
            if not opdef.differentiable or not node.inputs or name_ in stop_at:
                continue
            if opdef.grad is None:
                raise GraphError(f"no gradient registered for op {node.op} (node '{name_}'), which lies "
                                 f"between the ys and the xs")
            view = OpView(graph, node)
            with graph.name_scope(name_), graph.following(name_), graph.device(node.device):
                out_grads = [_summed(graph, contribs.get(ref), before) for ref in out_refs]
                if len(out_grads) > 1 and any(g is None for g in out_grads):
                    out_grads = [g if g is not None else ew.zeros_like(view.outputs[p], name=f"zero_grad_{p}")
                                 for p, g in enumerate(out_grads)]
                in_grads = list(opdef.grad(view, out_grads))
            if len(in_grads) != len(node.inputs):
                raise GraphError(f"gradient of {node.op} returned {len(in_grads)} values for "
                                 f"{len(node.inputs)} inputs (node '{name_}')")
            for ref, g in zip(node.inputs, in_grads):
                if g is None:
                    continue
                src, port = parse_ref(ref)
                dtype = graph.nodes[src].outputs[port].dtype
                # A "variant" gradient is an accumulator's: a stack of per-iteration gradients.
                if src not in relevant or not (is_float(dtype) or dtype == "variant"):
                    continue
                contribs.setdefault(f"{src}:{port}", []).append(g)

        result: list[Tensor | None] = []
        for x in xs:
            with graph.name_scope(x.node), graph.following(x.node):
                result.append(_summed(graph, contribs.get(x.name), before))
    return result


def _summed(graph: Graph, parts: list[Tensor] | None, before: set[str]) -> Tensor | None:
    """One gradient from the contributions of an output's several uses (None: no use)."""
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else _sum(graph, parts, before)


class _Loops:
    """The while loops a gradient walk meets: their nodes are skipped one by one, and each loop is
    differentiated when the walk (in reverse topological order) has passed all its relevant Exits,
    which is after every use of their values."""

    def __init__(self, graph: Graph, relevant: set[str], y: str, before: set[str]) -> None:
        from flowctl.engine.executor import needed_nodes
        from flowctl.engine.frames import assign_frames, has_control_flow

        self.graph = graph
        self.before = before  # the nodes that were there before this gradients() call
        # Frames of what the walk can meet only: in a nested loop's gradient the graph also holds the
        # outer backward loop, half built.
        self.frames = (assign_frames(graph, needed_nodes(graph, list(relevant), set()))
                       if has_control_flow(graph.nodes.values()) else None)
        self.here = self.frames.out_frame[y] if self.frames else ""
        self.waiting: dict[str, int] = {}
        if self.frames:
            for n in relevant:
                node = graph.nodes[n]
                if node.op == "Exit" and self.frames.parent.get(node.attrs["frame_name"]) == self.here:
                    f = node.attrs["frame_name"]
                    self.waiting[f] = self.waiting.get(f, 0) + 1

    def inside(self, name: str) -> bool:
        return self.frames is not None and self.frames.exec_frame.get(name, self.here) != self.here

    def exit_reached(self, node: Node, contribs: dict[str, list[Tensor]], scope: str) -> list[tuple[str, Tensor]]:
        if node.op != "Exit" or node.attrs["frame_name"] not in self.waiting:
            return []
        frame = node.attrs["frame_name"]
        self.waiting[frame] -= 1
        if self.waiting[frame]:
            return []
        exit_grads: dict[str, Tensor] = {}
        for n in list(self.graph.nodes.values()):  # (add_n adds nodes)
            if n.op == "Exit" and n.attrs["frame_name"] == frame:
                summed = _summed(self.graph, contribs.get(f"{n.name}:0"), self.before)
                if summed is not None:
                    exit_grads[n.name] = summed
        if not exit_grads:
            return []
        return while_gradient(self.graph, frame, exit_grads, "grad", gradients)


def _stackable_products(graph: Graph, parts: list[Tensor], before: set[str]) -> bool:
    """True when every part is a fresh MatMul A^T B (a right operand's gradient) that nothing
    else reads, all on one device: then their sum is one product of the stacked operands."""
    nodes = []
    for p in parts:
        node = graph.nodes[p.node]
        if (p.port != 0 or node.op != "MatMul" or p.node in before or not node.attrs["transpose_a"]
                or node.attrs["transpose_b"]):
            return False
        nodes.append(node)
    if len({n.device for n in nodes}) != 1 or len({p.node for p in parts}) != len(parts):
        return False
    names = {n.name for n in nodes}
    for name in graph.nodes:  # only the nodes this gradients() call made can read them
        if name not in before and any(parse_ref(r)[0] in names for r in graph.nodes[name].inputs):
            return False
    return True


def _sum(graph: Graph, parts: list[Tensor], before: set[str]) -> Tensor:
    from flowctl.engine.ops import elementwise as ew
    from flowctl.engine.ops.array import concat
    from flowctl.engine.ops.matrix import matmul

    if not _stackable_products(graph, parts, before):
        return ew.add_n(parts, name="sum_fanout")
    nodes = [graph.nodes[p.node] for p in parts]
    a = [graph.tensor(n.inputs[0]) for n in nodes]
    b = [graph.tensor(n.inputs[1]) for n in nodes]
    with graph.device(nodes[0].device):
        out = matmul(concat(a, axis=0, name="stack_a"), concat(b, axis=0, name="stack_b"),
                     transpose_a=True, name="sum_products")
    for n in nodes:
        del graph.nodes[n.name]  # the per-part products: replaced, and read by nothing
    return out
