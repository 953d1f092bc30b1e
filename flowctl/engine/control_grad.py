"""The gradient of a while loop (whitepaper §4.1 with §4.4).

The backward pass is another loop that runs the forward body's gradient once per forward iteration,
in reverse. What it needs of the forward pass is saved per iteration: the forward loop gets extra
loop variables, a counter (its final value is the trip count) and one accumulator per saved tensor,
to which each iteration appends that tensor's value (AccPush, chained through the loop so the last
push precedes the loop's end). Backward iteration j reads entry n-1-j (AccRead).

Backward loop variables: the counter j; for each float loop variable, the gradient with respect to
its value at the current forward iteration (it starts as the gradient of its Exit); for each float
loop invariant, the sum of its gradient over the iterations so far. The results are the gradients
of the loop's initial values and of its invariants.

Nested loops: the inner loop is differentiated while the outer body's gradient is being built, so
its backward loop lands inside the outer backward body. The inner loop's counter and accumulators
are made afresh in every outer iteration (their sources hang off the outer body), and the outer
backward reads them, like any other forward value of its body, through accumulators of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from flowctl.engine.control_flow import colocate_loop_control
from flowctl.engine.errors import GraphError
from flowctl.engine.dtypes import is_float
from flowctl.engine.graph import Graph, Node, Tensor, parse_ref


# The nodes a backward loop adds to the *forward* graph (counters, accumulators), by name, with the
# frame their outputs live in. A loop nested in another loop's body is differentiated while the
# outer body's gradient is being built; the outer backward must then tell these forward additions
# from its own new nodes (it rewrites only its own) and read them per outer iteration like any other
# forward value. Each `_Backward.build` in progress holds one dict; an addition is recorded in all.
_FORWARD_ADDED: list[dict[str, str]] = []


@dataclass
class LoopVar:
    enter: Node
    merge: Node
    switch: Node
    exit: Node
    body: Node  # Identity of the Switch's true output: the body's input
    next: Node  # NextIteration: its input is the body's output


@dataclass
class Loop:
    frame: str
    pred: str  # ref of the loop condition
    vars: list[LoopVar] = field(default_factory=list)
    invariants: list[Node] = field(default_factory=list)  # constant Enters
    parallel: int = 10
    expected: int = 0  # stated trip count


def find_loop(graph: Graph, frame: str) -> Loop:
    """The loop structure of `frame`, read off the graph (so a loop read from JSON has one too)."""
    users = graph.consumers()
    loop: Loop | None = None
    vars_: list[LoopVar] = []
    invariants: list[Node] = []
    for node in graph.nodes.values():
        if node.op != "Enter" or node.attrs["frame_name"] != frame:
            continue
        if node.attrs["is_constant"]:
            invariants.append(node)
            continue
        merge = _only(graph, users[node.name], "Merge", node)
        switch = next(graph.nodes[u] for u in users[merge.name]
                      if graph.nodes[u].op == "Switch" and graph.nodes[u].inputs[0] == f"{merge.name}:0")
        exit_ = next(graph.nodes[u] for u in users[switch.name] if graph.nodes[u].op == "Exit")
        body = next(graph.nodes[u] for u in users[switch.name] if graph.nodes[u].op == "Identity"
                    and graph.nodes[u].inputs[0] == f"{switch.name}:1")
        nxt = graph.nodes[parse_ref(merge.inputs[1])[0]]
        vars_.append(LoopVar(node, merge, switch, exit_, body, nxt))
        if loop is None:
            loop = Loop(frame, switch.inputs[1], parallel=int(node.attrs["parallel_iterations"]),
                        expected=int(node.attrs["expected_iterations"]))
    if loop is None:
        raise GraphError(f"frame '{frame}' has no loop variable")
    loop.vars, loop.invariants = vars_, invariants
    return loop


def _only(graph: Graph, names: list[str], op: str, after: Node) -> Node:
    found = [graph.nodes[n] for n in names if graph.nodes[n].op == op]
    if len(found) != 1:
        raise GraphError(f"loop Enter '{after.name}' feeds {len(found)} {op} nodes, not one")
    return found[0]


def add_loop_var(graph: Graph, loop: Loop, init: Callable[[], Tensor], step: Any, parent: str) -> Tensor:
    """A new variable of an existing loop: `init()` (made in the loop's parent frame `parent`)
    enters, `step(value)` is the next value; returns its Exit. Built after the loop, for what a
    gradient must save."""
    from flowctl.engine.ops.api import make1
    from flowctl.engine.ops.control import identity, merge, switch

    before = set(graph.nodes)
    # In a nested loop the parent frame is itself a loop body: a source made for it must run there,
    # once per parent iteration, so it hangs off a node of that frame (the loop's first Enter's input).
    anchor = [parse_ref(loop.vars[0].enter.inputs[0])[0]] if parent else []
    with graph.control_dependencies(anchor):
        first = init()
    enter = make1("Enter", [first], {"frame_name": loop.frame, "parallel_iterations": loop.parallel,
                                     "expected_iterations": loop.expected}, name="Enter")
    m = merge([enter, enter], name="Merge")[0]
    off, on = switch(m, graph.tensor(loop.pred), name="Switch")
    exit_ = make1("Exit", [off], {"frame_name": loop.frame}, name="Exit")
    body = identity(on, name="body")
    with graph.control_dependencies([body]):  # a constant the step makes runs in the loop's frame
        value = step(body)
    nxt = make1("NextIteration", [value], {"frame_name": loop.frame}, name="NextIteration")
    graph.nodes[m.node].inputs[1] = nxt.name
    colocate_loop_control(graph, loop.vars[0].merge.name, [t.node for t in (enter, m, off, exit_, body, nxt)])
    outside = {first.node, exit_.node}
    for record in _FORWARD_ADDED:
        record.update({n: (parent if n in outside else loop.frame) for n in graph.nodes if n not in before})
    return exit_


def while_gradient(graph: Graph, frame: str, exit_grads: dict[str, Tensor], name: str,
                   gradients: Callable[..., list[Tensor | None]]) -> list[tuple[str, Tensor]]:
    """Build the backward loop of `frame`, given the gradients of (some of) its Exits. Returns the
    gradient of each float Enter's input (initial values and invariants) as (input ref, gradient)
    pairs: one tensor that enters twice (an initial value also read as an invariant) has two, the
    caller sums them.
    `gradients` is autodiff's own (§4.1), for the loop body: passed in, as autodiff calls this."""
    from flowctl.engine.control_flow import _no_outer_control
    from flowctl.engine.executor import needed_nodes
    from flowctl.engine.frames import assign_frames

    loop = find_loop(graph, frame)
    # The forward graph only: when this loop is nested, the graph also holds the outer backward loop.
    forward = assign_frames(graph, needed_nodes(graph, [v.exit.name for v in loop.vars], set()))
    with graph.name_scope(graph.unique_name(name)) as bframe, _no_outer_control(graph):
        back = _Backward(graph, loop, bframe, forward.out_frame, forward.parent.get(frame, ""), gradients)
        return back.build(exit_grads)


class _Backward:
    def __init__(self, graph: Graph, loop: Loop, bframe: str, out_frame: dict[str, str], parent: str,
                 gradients: Callable[..., list[Tensor | None]]) -> None:
        self.g = graph
        self.parent = parent  # the frame the forward loop runs in ("" at the top level)
        self.gradients = gradients
        self.loop = loop
        self.bframe = bframe
        self.out_frame = out_frame
        self.fvars = [v for v in loop.vars if is_float(v.exit.outputs[0].dtype)]
        self.finv = [e for e in loop.invariants if is_float(e.outputs[0].dtype)]
        self.entered: dict[str, Tensor] = {}  # outside ref -> its invariant Enter into the backward loop
        self.reads: dict[str, Tensor] = {}  # forward ref -> its AccRead in the backward body

    def build(self, exit_grads: dict[str, Tensor]) -> list[tuple[str, Tensor]]:
        self.added: dict[str, str] = {}
        _FORWARD_ADDED.append(self.added)
        try:
            return self._build(exit_grads)
        finally:
            _FORWARD_ADDED.remove(self.added)

    def _build(self, exit_grads: dict[str, Tensor]) -> list[tuple[str, Tensor]]:
        from flowctl.engine.ops import elementwise as ew
        from flowctl.engine.ops.api import constant, make1
        from flowctl.engine.ops.control import identity, merge, switch

        g = self.g
        trips = add_loop_var(g, self.loop, lambda: constant(0, "int32", graph=g), lambda i: i + 1, self.parent)
        inits = [constant(0, "int32", graph=g)]
        inits += [exit_grads.get(v.exit.name) or ew.zeros_like(Tensor(g, v.exit.name, 0)) for v in self.fvars]
        with g.control_dependencies([trips]):
            # Running sums that LoopSum writes into: each loop's own buffer (the control edge keeps
            # CSE from sharing one zeros node between two loops' sums).
            inits += [ew.zeros_like(g.tensor(e.inputs[0])) for e in self.finv]
        enters = [make1("Enter", [x], {"frame_name": self.bframe, "parallel_iterations": self.loop.parallel,
                                       "expected_iterations": self.loop.expected}, name="Enter") for x in inits]
        merges = [merge([e, e], name="Merge")[0] for e in enters]
        n = self.enter(trips.name)
        pred = ew.less(merges[0], n)
        switches = [switch(m, pred, name="Switch") for m in merges]
        exits = [make1("Exit", [s[0]], {"frame_name": self.bframe}, name="Exit") for s in switches]
        body = [identity(s[1], name="body") for s in switches]
        j = body[0]
        with g.control_dependencies([j]):
            one = constant(1, "int32", graph=g)
        self.index = n - j - one  # backward iteration j reads forward iteration n-1-j
        nv = len(self.fvars)
        ys = [Tensor(g, *parse_ref(v.next.inputs[0])) for v in self.fvars]
        gys = body[1:1 + nv]
        for pushed, stack_grad in self.stacked(exit_grads):
            # An accumulator stacked after the loop (AccStack): iteration t's pushed value gets
            # row t of the stack's gradient.
            from flowctl.engine.ops.array import gather, reshape, squeeze

            ys.append(g.tensor(pushed))
            gys.append(squeeze(gather(self.enter(stack_grad.name), reshape(self.index, [1])), [0]))
        before = set(g.nodes)
        grads = self.gradients(ys, [Tensor(g, v.body.name, 0) for v in self.fvars]
                                   + [Tensor(g, e.name, 0) for e in self.finv],
                                   grad_ys=gys, name="body_grad",
                                   stop_at={v.body.name for v in self.loop.vars})
        made = [node for name, node in g.nodes.items() if name not in before and name not in self.added]
        for node in made:
            node.inputs = [self.backward_ref(r) for r in node.inputs]
            # A control edge from a forward value cannot cross into the backward frame: the value is
            # there (read per iteration) or the node runs once per backward iteration anyway.
            node.control_inputs = [c for c in node.control_inputs if self.forward_frame(c) is None]
            if not node.inputs and not node.control_inputs:
                node.control_inputs.append(j.node)
        nexts = [j + one]
        for k in range(nv):
            gk = grads[k]
            nexts.append(g.tensor(self.backward_ref(gk.name)) if gk is not None else ew.zeros_like(body[1 + k]))
        for m, e in enumerate(self.finv):
            gm = grads[nv + m]
            acc = body[1 + nv + m]
            nexts.append(make1("LoopSum", [acc, g.tensor(self.backward_ref(gm.name))], name="grad_sum")
                         if gm is not None else identity(acc))
        control = [t.node for t in enters + merges + exits + body] + [s[0].node for s in switches]
        for m_, x in zip(merges, nexts):
            nxt = make1("NextIteration", [x], {"frame_name": self.bframe}, name="NextIteration")
            g.nodes[m_.node].inputs[1] = nxt.name
            control.append(nxt.node)
        colocate_loop_control(g, merges[0].node, control)
        return ([(v.enter.inputs[0], exits[1 + k]) for k, v in enumerate(self.fvars)]
                + [(e.inputs[0], exits[1 + nv + m]) for m, e in enumerate(self.finv)])

    def stacked(self, exit_grads: dict[str, Tensor]) -> list[tuple[str, Tensor]]:
        """(pushed ref, gradient of the stack) for each accumulator variable with a gradient."""
        out = []
        for v in self.loop.vars:
            if v.exit.outputs[0].dtype == "variant" and v.exit.name in exit_grads:
                push = self.g.nodes[parse_ref(v.next.inputs[0])[0]]
                if push.op != "AccPush":
                    raise GraphError(f"loop '{self.loop.frame}': accumulator '{v.enter.name}' is not "
                                     f"advanced by one AccPush per iteration")
                out.append((push.inputs[1], exit_grads[v.exit.name]))
        return out

    def enter(self, ref: str) -> Tensor:
        from flowctl.engine.ops.api import make1

        if ref not in self.entered:
            self.entered[ref] = make1("Enter", [self.g.tensor(ref)], {"frame_name": self.bframe,
                                                                      "is_constant": True}, name="invariant")
        return self.entered[ref]

    def backward_ref(self, ref: str) -> str:
        """A ref the backward body may read: forward values through accumulators, invariants
        and outside values through Enters of the backward frame."""
        src = self.g.nodes[parse_ref(ref)[0]]
        frame = self.forward_frame(src.name)
        if frame is None:
            return ref  # made for the backward loop
        if frame != self.loop.frame:
            return self.enter(ref).name
        if src.op == "Enter":
            return self.enter(src.inputs[0]).name
        return self.read(ref).name

    def forward_frame(self, name: str) -> str | None:
        """The frame a forward node's outputs live in; None for a node made for a backward loop."""
        frame = self.out_frame.get(name)
        return frame if frame is not None else self.added.get(name)

    def read(self, ref: str) -> Tensor:
        from flowctl.engine.ops.api import make1

        if ref not in self.reads:
            g = self.g
            spec = g.tensor(ref).spec
            saved = add_loop_var(g, self.loop, lambda: make1("AccCreate", [], name="acc", graph=g),
                                 lambda a: make1("AccPush", [a, g.tensor(ref)], name="push"), self.parent)
            self.reads[ref] = make1("AccRead", [self.enter(saved.name), self.index],
                                    {"dtype": spec.dtype, "shape": spec.shape}, name="read")
        return self.reads[ref]
