"""`cond` and `while_loop`: conditionals and loops built from the §4.4 primitives.

Both call the user's functions once, to build the graph, and then make what those functions built
live inside the construct:
- a tensor made outside and used inside is *captured*: routed through a Switch on the predicate
  (cond) or a loop-invariant Enter (while_loop), so it is dead on an untaken branch and present in
  every iteration;
- a node with no inputs made inside (a constant) gets a control edge from the construct's pivot,
  so it runs in the right frame and dies with its branch;
- shapes are checked now: a loop variable must keep the shape it entered with (or fit its
  `shape_invariants` entry), and both branches of a cond must give the same dtypes and ranks.

Frame names are the loop's name scope, unique in the graph, so a graph written to JSON and read
back has the same frames (engine/frames.py derives them from the Enter attributes).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Graph, Node, Tensor, parse_ref
from flowctl.engine.ops.api import convert, graph_of
from flowctl.engine.ops.control import _compatible, merge, switch

LoopFn = Callable[..., Any]


def _as_list(x: Any) -> tuple[list[Any], bool]:
    if isinstance(x, (list, tuple)):
        return list(x), True
    return [x], False


@contextlib.contextmanager
def _no_outer_control(graph: Graph) -> Iterator[None]:
    """Nodes inside a construct take no control inputs from the enclosing control_dependencies
    context: those would cross the frame boundary (the construct's entry nodes carry them)."""
    saved, graph._control = graph._control, []
    try:
        yield
    finally:
        graph._control = saved


def _new_nodes(graph: Graph, before: set[str]) -> list[Node]:
    return [n for name, n in graph.nodes.items() if name not in before]


def _pin_sources(graph: Graph, made: list[Node], pivot: Tensor) -> None:
    """A node with no inputs made inside a construct runs under its pivot (§4.4)."""
    for node in made:
        if not node.inputs and not node.control_inputs:
            node.control_inputs.append(pivot.node)


# ---------------------------------------------------------------------------------------------------
def cond(pred: Tensor, true_fn: Callable[[], Any], false_fn: Callable[[], Any],
         name: str = "cond") -> Any:
    """`true_fn()` if `pred` else `false_fn()`, as dataflow: only the taken branch runs."""
    if not isinstance(pred, Tensor) or pred.dtype != "bool" or pred.shape not in ((), (1,)):
        raise GraphError(f"cond '{name}': the predicate must be a bool scalar tensor, got "
                         f"{pred.shape if isinstance(pred, Tensor) else type(pred).__name__}")
    g = pred.graph
    with g.as_default(), g.name_scope(g.unique_name(name)):
        p_false, p_true = switch(pred, pred, name="pivot_switch")
        pivots = (_identity(p_false, "pivot_f"), _identity(p_true, "pivot_t"))
        results = []
        for branch, fn in ((1, true_fn), (0, false_fn)):
            with g.name_scope("true" if branch else "false"), _no_outer_control(g):
                before = set(g.nodes)
                out, many = _as_list(fn())
                out = [convert(o, g) for o in out]
                made = _new_nodes(g, before)
                out = _capture_branch(g, made, out, pred, branch, pivots[branch])
            results.append((out, many))
        (t_out, many), (f_out, _) = results
        if len(t_out) != len(f_out):
            raise GraphError(f"cond '{name}': the true branch returns {len(t_out)} value(s), "
                             f"the false branch {len(f_out)}")
        merged = []
        for t, f in zip(t_out, f_out):
            if t.dtype != f.dtype or len(t.shape) != len(f.shape):
                raise GraphError(f"cond '{name}': branches disagree: true gives '{t.name}' {t.shape} "
                                 f"{t.dtype}, false gives '{f.name}' {f.shape} {f.dtype}")
            merged.append(merge([f, t], name="Merge")[0])
    return merged if many else merged[0]


def _identity(x: Tensor, name: str) -> Tensor:
    from flowctl.engine.ops.control import identity

    return identity(x, name=name)


def _capture_branch(g: Graph, made: list[Node], out: list[Tensor], pred: Tensor, branch: int,
                    pivot: Tensor) -> list[Tensor]:
    """Route every outside tensor a branch reads through a Switch on the predicate."""
    inside = {n.name for n in made}
    routed: dict[str, Tensor] = {}

    def route(ref: str) -> str:
        if ref not in routed:
            with g.control_dependencies([]):
                routed[ref] = switch(g.tensor(ref), pred, name="capture")[branch]
        return routed[ref].name

    for node in made:
        node.inputs = [r if parse_ref(r)[0] in inside or k in node.opdef.ref_inputs else route(r)
                       for k, r in enumerate(node.inputs)]
    _pin_sources(g, made, pivot)
    return [o if o.node in inside else g.tensor(route(o.name)) for o in out]


# ---------------------------------------------------------------------------------------------------
def while_loop(cond_fn: LoopFn, body: LoopFn, loop_vars: Any, parallel_iterations: int = 10,
               shape_invariants: Sequence[Any] | None = None, name: str = "while",
               expected_iterations: int = 0) -> Any:
    """Repeat `loop_vars = body(*loop_vars)` while `cond_fn(*loop_vars)`; returns the final
    loop_vars. Up to `parallel_iterations` iterations run at once where the data allows (§4.4).
    `expected_iterations` is the trip count placement and cost estimates assume (0: unknown)."""
    vars_, many = _as_list(loop_vars)
    if not vars_:
        raise GraphError(f"while_loop '{name}': no loop variables")
    g = graph_of(*vars_)
    vars_ = [convert(v, g) for v in vars_]
    invariants = list(shape_invariants) if shape_invariants is not None else [None] * len(vars_)
    if len(invariants) != len(vars_):
        raise GraphError(f"while_loop '{name}': {len(invariants)} shape invariants for {len(vars_)} loop variables")
    with g.as_default(), g.name_scope(g.unique_name(name)) as frame:
        from flowctl.engine.ops.api import make1

        enters = [make1("Enter", [v], {"frame_name": frame, "parallel_iterations": parallel_iterations,
                                       "shape": inv, "expected_iterations": expected_iterations},
                        name="Enter") for v, inv in zip(vars_, invariants)]
        with _no_outer_control(g):
            loop = _build_loop(g, frame, enters, cond_fn, body, name)
    return loop if many else loop[0]


def _build_loop(g: Graph, frame: str, enters: list[Tensor], cond_fn: LoopFn, body: LoopFn,
                name: str) -> list[Tensor]:
    merges = [merge([e, e], name="Merge")[0] for e in enters]  # input 1 becomes the back edge
    before = set(g.nodes)
    pred = cond_fn(*merges)
    if not isinstance(pred, Tensor) or pred.dtype != "bool" or pred.shape not in ((), (1,)):
        raise GraphError(f"while_loop '{name}': cond must return a bool scalar tensor, got "
                         f"{pred.shape if isinstance(pred, Tensor) else type(pred).__name__}")
    cond_made = _new_nodes(g, before)
    switches = [switch(m, pred, name="Switch") for m in merges]
    exits = [_make(g, "Exit", s[0], frame) for s in switches]
    body_in = [_identity(s[1], "body") for s in switches]
    before = set(g.nodes)
    out, _ = _as_list(body(*body_in))
    out = [convert(o, g) for o in out]
    body_made = _new_nodes(g, before)
    if len(out) != len(enters):
        raise GraphError(f"while_loop '{name}': body returns {len(out)} value(s) for {len(enters)} loop variables")
    own = {t.node for t in merges + body_in} | {s[0].node for s in switches} | {e.node for e in exits}
    _capture_loop(g, frame, cond_made + body_made, own | {n.name for n in cond_made + body_made})
    loop_roots = {t.node for t in body_in}
    _pin_sources(g, cond_made, merges[0])
    _pin_sources(g, body_made, body_in[0])
    for i, (e, o, m) in enumerate(zip(enters, out, merges)):
        if o.dtype != e.dtype or not _compatible(e.shape, o.shape):
            raise GraphError(f"while_loop '{name}': loop variable {i} enters as '{g.nodes[e.node].inputs[0]}' "
                             f"{e.shape} {e.dtype} but the body returns '{o.name}' {o.shape} {o.dtype}; "
                             f"pass shape_invariants (None for a dimension that changes)")
        if not _depends_on_loop(g, o, loop_roots, frame):
            # A value the body does not compute from the loop would stay alive in the last
            # iteration and start another: gate it on the pivot.
            with g.control_dependencies([body_in[0]]):
                o = _identity(o, "invariant")
        nxt = _make(g, "NextIteration", o, frame)
        g.nodes[m.node].inputs[1] = nxt.name
    colocate_loop_control(g, merges[0].node, [t.node for t in enters + merges + exits + body_in]
                          + [s[0].node for s in switches] + [parse_ref(g.nodes[m.node].inputs[1])[0] for m in merges])
    return exits


def colocate_loop_control(g: Graph, anchor: str, names: list[str]) -> None:
    """A loop's control runs on one device (placement treats it as a unit; the partitioner gives
    every other device a control loop of its own): its nodes are colocated with one Merge."""
    for n in names:
        if n != anchor and anchor not in g.nodes[n].colocate_with:
            g.nodes[n].colocate_with.append(anchor)


def _make(g: Graph, op: str, x: Tensor, frame: str) -> Tensor:
    from flowctl.engine.ops.api import make1

    return make1(op, [x], {"frame_name": frame}, name=op)


def _capture_loop(g: Graph, frame: str, made: list[Node], inside: set[str]) -> None:
    """Outside tensors read in the loop enter it once, as loop invariants (§4.4)."""
    entered: dict[str, str] = {}
    for node in made:
        refs = []
        for k, r in enumerate(node.inputs):
            # A ref input (the Variable an Assign updates) names state, reads no value: it needs no Enter.
            if parse_ref(r)[0] not in inside and k not in node.opdef.ref_inputs:
                if r not in entered:
                    from flowctl.engine.ops.api import make1

                    entered[r] = make1("Enter", [g.tensor(r)], {"frame_name": frame, "is_constant": True},
                                       name="invariant").name
                r = entered[r]
            refs.append(r)
        node.inputs = refs
        outside = [c for c in node.control_inputs if c not in inside and c not in entered.values()]
        if outside:
            raise GraphError(f"while_loop: node '{node.name}' has control input(s) {outside} made outside "
                             f"the loop; make them control inputs of the loop itself")


def _depends_on_loop(g: Graph, t: Tensor, roots: set[str], frame: str) -> bool:
    seen: set[str] = set()
    stack = [t.node]
    while stack:
        n = stack.pop()
        if n in roots:
            return True
        if n in seen:
            continue
        seen.add(n)
        node = g.nodes[n]
        if node.op == "Enter" and node.attrs["frame_name"] == frame:
            continue  # this loop's invariants
        stack.extend(parse_ref(r)[0] for r in node.inputs)
        stack.extend(node.control_inputs)
    return False
