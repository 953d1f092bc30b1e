"""The dataflow graph (whitepaper §2): nodes by unique name, tensor refs `"node:port"`, control
inputs `"^node"`, attributes resolved at construction, and a JSON GraphDef that round-trips exactly.

Shapes and dtypes are inferred as a node is added, so a mismatch is an error at construction that
names the node and its inputs. `Graph.check()` re-verifies the whole graph after any pass.
"""
from __future__ import annotations

import contextlib
import heapq
import json
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Sequence

import numpy as np

from flowctl.engine.dtypes import as_dtype
from flowctl.engine.errors import GraphError, did_you_mean
from flowctl.engine.opdef import OpDef, get_op
from flowctl.engine.shapes import InferError, TensorSpec

GRAPHDEF_VERSION = 1


def parse_ref(ref: str) -> tuple[str, int]:
    """`"node:port"` -> (node, port); a bare node name means port 0."""
    name, sep, port = ref.rpartition(":")
    if sep and port.isdigit():
        return name, int(port)
    return ref, 0


def make_ref(node: str, port: int) -> str:
    return f"{node}:{port}"


@dataclass
class Node:
    name: str
    op: str
    inputs: list[str] = field(default_factory=list)  # "node:port"
    control_inputs: list[str] = field(default_factory=list)  # node names (written "^node" in JSON)
    attrs: dict[str, Any] = field(default_factory=dict)
    device: str = ""  # the user's requested, possibly partial, device constraint (§4.3)
    colocate_with: list[str] = field(default_factory=list)  # node names this node must share a device with
    assigned_device: str | None = None  # set by placement
    source: str = ""  # where the node came from (a spec file:line and layer), for error messages
    follows: str = ""  # for gradient nodes: the forward node they belong with (a placement hint)
    outputs: list[TensorSpec] = field(default_factory=list)  # inferred

    @property
    def opdef(self) -> OpDef:
        return get_op(self.op)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "op": self.op}
        if self.inputs or self.control_inputs:
            d["inputs"] = list(self.inputs) + ["^" + c for c in self.control_inputs]
        if self.attrs:
            d["attrs"] = self.opdef.encode_attrs(self.attrs)
        for key in ("device", "colocate_with", "assigned_device", "source", "follows"):
            v = getattr(self, key)
            if v:
                d[key] = list(v) if isinstance(v, list) else v
        return d


class Tensor:
    """A handle on one output of a node, for the Python API. The IR itself stores only refs."""

    __slots__ = ("graph", "node", "port")
    __array_priority__ = 100  # so ndarray + Tensor defers to Tensor.__radd__

    def __init__(self, graph: "Graph", node: str, port: int = 0) -> None:
        self.graph = graph
        self.node = node
        self.port = port

    @property
    def name(self) -> str:
        return make_ref(self.node, self.port)

    @property
    def op(self) -> Node:
        return self.graph.nodes[self.node]

    @property
    def spec(self) -> TensorSpec:
        return self.graph.nodes[self.node].outputs[self.port]

    @property
    def shape(self) -> tuple:
        return self.spec.shape

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    def __repr__(self) -> str:
        return f"<Tensor {self.name} shape={self.shape} dtype={self.dtype}>"

    def __hash__(self) -> int:
        return hash((id(self.graph), self.node, self.port))

    def __eq__(self, other: object) -> bool:  # identity of the ref, not elementwise equality
        return (isinstance(other, Tensor) and other.graph is self.graph
                and other.node == self.node and other.port == self.port)

    # The graph knows no op: the op library installs the operators (`a + b` builds an Add node)
    # when it is imported (ops/api.py), so the import arrow points from the ops to the graph.
    OPERATORS: ClassVar[tuple[str, ...]] = (
        "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
        "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__matmul__",
        "__neg__")

    @classmethod
    def _override_operator(cls, name: str, fn: Callable[..., "Tensor"]) -> None:
        """Install one of `OPERATORS` (TensorFlow's Tensor._override_operator)."""
        if name not in cls.OPERATORS:
            raise ValueError(f"Tensor has no operator {name}; it overloads {sorted(cls.OPERATORS)}")
        setattr(cls, name, fn)

    if TYPE_CHECKING:  # the signatures of what the op library installs
        def __add__(self, o: Any) -> Tensor: ...
        def __radd__(self, o: Any) -> Tensor: ...
        def __sub__(self, o: Any) -> Tensor: ...
        def __rsub__(self, o: Any) -> Tensor: ...
        def __mul__(self, o: Any) -> Tensor: ...
        def __rmul__(self, o: Any) -> Tensor: ...
        def __truediv__(self, o: Any) -> Tensor: ...
        def __rtruediv__(self, o: Any) -> Tensor: ...
        def __floordiv__(self, o: Any) -> Tensor: ...
        def __rfloordiv__(self, o: Any) -> Tensor: ...
        def __mod__(self, o: Any) -> Tensor: ...
        def __rmod__(self, o: Any) -> Tensor: ...
        def __pow__(self, o: Any) -> Tensor: ...
        def __matmul__(self, o: Any) -> Tensor: ...
        def __neg__(self) -> Tensor: ...


_default = threading.local()


class Graph:
    def __init__(self, seed: int = 0) -> None:
        self.nodes: dict[str, Node] = {}
        self.seed = int(seed)
        self._scope: list[str] = []
        self._device: list[str] = []
        self._colocate: list[list[str]] = []
        self._control: list[list[str]] = []
        self._source: list[str] = []
        self._follows: list[str] = []
        self._counts: dict[str, int] = {}

    # ------------------------------------------------------------------ construction contexts
    @contextlib.contextmanager
    def as_default(self) -> Iterator["Graph"]:
        stack = _default.__dict__.setdefault("stack", [])
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()

    @contextlib.contextmanager
    def name_scope(self, name: str) -> Iterator[str]:
        self._scope.append(name.strip("/"))
        try:
            yield "/".join(self._scope)
        finally:
            self._scope.pop()

    @contextlib.contextmanager
    def absolute_scope(self, name: str = "") -> Iterator[str]:
        """Leave every enclosing name scope (then enter `name`, if given): for state named after
        another node wherever the caller stands, such as optimizer slots."""
        saved, self._scope = self._scope, [name.strip("/")] if name else []
        try:
            yield "/".join(self._scope)
        finally:
            self._scope = saved

    @contextlib.contextmanager
    def device(self, device: str) -> Iterator[None]:
        self._device.append(device)
        try:
            yield
        finally:
            self._device.pop()

    @contextlib.contextmanager
    def colocate_with(self, *tensors: "Tensor | str") -> Iterator[None]:
        self._colocate.append([t.node if isinstance(t, Tensor) else t for t in tensors])
        try:
            yield
        finally:
            self._colocate.pop()

    @contextlib.contextmanager
    def control_dependencies(self, deps: Iterable["Tensor | str"]) -> Iterator[None]:
        self._control.append([d.node if isinstance(d, Tensor) else parse_ref(d.lstrip("^"))[0]
                              for d in deps])
        try:
            yield
        finally:
            self._control.pop()

    @contextlib.contextmanager
    def source(self, where: str) -> Iterator[None]:
        self._source.append(where)
        try:
            yield
        finally:
            self._source.pop()

    @contextlib.contextmanager
    def following(self, node: str) -> Iterator[None]:
        self._follows.append(node)
        try:
            yield
        finally:
            self._follows.pop()

    def relative_name(self, full: str) -> str:
        """`full` (a node name made under the current name scope) relative to that scope."""
        prefix = "/".join(self._scope)
        return full[len(prefix) + 1:] if prefix and full.startswith(prefix + "/") else full

    def unique_name(self, base: str) -> str:
        full = "/".join(self._scope + [base]) if base else "/".join(self._scope)
        if full not in self.nodes and full not in self._counts:
            self._counts[full] = 0
            return full
        n = self._counts.get(full, 0)
        while True:
            n += 1
            cand = f"{full}_{n}"
            if cand not in self.nodes:
                self._counts[full] = n
                self._counts.setdefault(cand, 0)
                return cand

    # ------------------------------------------------------------------ adding nodes
    def add_node(self, op: str, inputs: Sequence["Tensor | str"] = (), attrs: dict[str, Any] | None = None,
                 name: str | None = None, control_inputs: Sequence["Tensor | str"] = (),
                 device: str | None = None) -> Node:
        """Add a node, inferring its output shapes and dtypes now (a mismatch raises GraphError)."""
        opdef = get_op(op)
        name = self.unique_name(name or op)
        refs = [self._as_ref(x) for x in inputs]
        ctrl = [c for group in self._control for c in group]
        ctrl += [x.node if isinstance(x, Tensor) else parse_ref(x.lstrip("^"))[0] for x in control_inputs]
        node = Node(
            name=name, op=op, inputs=refs, control_inputs=list(dict.fromkeys(ctrl)),
            attrs=opdef.normalize_attrs(dict(attrs or {}), name),
            device=device if device is not None else (self._device[-1] if self._device else ""),
            colocate_with=list(self._colocate[-1]) if self._colocate else [],
            source=self._source[-1] if self._source else "",
            follows=self._follows[-1] if self._follows else "",
        )
        for c in node.control_inputs:
            if c not in self.nodes:
                raise GraphError(f"node '{name}': control input '^{c}' refers to missing node '{c}'")
        node.outputs = self._infer(node)
        self.nodes[name] = node
        return node

    def _as_ref(self, x: "Tensor | str") -> str:
        if isinstance(x, Tensor):
            if x.graph is not self:
                raise GraphError(f"tensor {x.name} belongs to another graph")
            return x.name
        node, port = parse_ref(x)
        return make_ref(node, port)

    def input_specs(self, node: Node) -> list[TensorSpec]:
        specs = []
        for ref in node.inputs:
            src, port = parse_ref(ref)
            producer = self.nodes.get(src)
            if producer is None:
                raise GraphError(f"node '{node.name}' input '{ref}' refers to missing node '{src}'")
            if port >= len(producer.outputs):
                if not producer.outputs and self.is_back_edge(node, ref):
                    continue  # a loop's Merge read before its NextIteration (GraphDef order)
                raise GraphError(f"node '{node.name}' input '{ref}': node '{src}' ({producer.op}) has "
                                 f"{len(producer.outputs)} output(s), no port {port}")
            specs.append(producer.outputs[port])
        return specs

    def _infer(self, node: Node) -> list[TensorSpec]:
        opdef = node.opdef
        n = len(node.inputs)
        if opdef.num_inputs is not None and n != opdef.num_inputs:
            raise GraphError(f"node '{node.name}' ({node.op}) takes {opdef.num_inputs} input(s), got {n}")
        if n < opdef.min_inputs:
            raise GraphError(f"node '{node.name}' ({node.op}) takes at least {opdef.min_inputs} inputs, got {n}")
        specs = self.input_specs(node)
        try:
            out = opdef.infer(specs, node.attrs)
        except InferError as e:
            described = ", ".join(f"'{r}' {tuple(s.shape)} {s.dtype}" for r, s in zip(node.inputs, specs))
            raise GraphError(f"node '{node.name}' ({node.op}): {e}; inputs: {described or 'none'}") from None
        return [TensorSpec(tuple(s.shape), as_dtype(s.dtype)) for s in out]

    # ------------------------------------------------------------------ queries
    def tensor(self, ref: str) -> Tensor:
        node, port = parse_ref(ref)
        if node not in self.nodes:
            raise GraphError(f"no node named '{node}'" + did_you_mean(node, self.nodes))
        if port >= len(self.nodes[node].outputs):
            raise GraphError(f"node '{node}' has no output {port}")
        return Tensor(self, node, port)

    def consumers(self) -> dict[str, list[str]]:
        """node name -> names of nodes that read any of its outputs or depend on it by control."""
        out: dict[str, list[str]] = {n: [] for n in self.nodes}
        for node in self.nodes.values():
            for src in dict.fromkeys([parse_ref(r)[0] for r in node.inputs] + node.control_inputs):
                if src in out:
                    out[src].append(node.name)
        return out

    def is_back_edge(self, consumer: Node, ref: str) -> bool:
        """§4.4: the edge NextIteration -> Merge closes a loop; orders and cycle checks skip it."""
        return consumer.op == "Merge" and self.nodes[parse_ref(ref)[0]].op == "NextIteration"

    def dependencies(self, node: Node, next_iterations: dict[str, list[str]] | None = None) -> set[str]:
        """The nodes `node` waits for, back edges left out. An Exit is also ordered after every
        NextIteration of its frame, so a whole loop precedes anything that reads its results."""
        deps = {parse_ref(r)[0] for r in node.inputs if not self.is_back_edge(node, r)}
        deps.update(node.control_inputs)
        if node.op == "Exit" and next_iterations:
            deps.update(next_iterations.get(node.attrs["frame_name"], ()))
        return deps

    def _next_iterations(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for n in self.nodes.values():
            if n.op == "NextIteration":
                out.setdefault(n.attrs["frame_name"], []).append(n.name)
        return out

    def topo_order(self, names: Iterable[str] | None = None, earliest_first: bool = False) -> list[str]:
        """Kahn's algorithm over the given nodes (default all) in insertion order, deterministic:
        breadth first (ready nodes in the order they became ready), or with `earliest_first` the
        ready node built earliest first. The executor's plans take the latter: a model built layer
        by layer then runs each layer's chain (an unrolled LSTM's 35 steps) before the next
        layer's instead of the two interleaved, so one layer's weights stay in cache (lstm_lm's step
        3-5% faster on a 2-core VM); the values are the same bits.
        Raises GraphError naming two nodes on a cycle (a loop's back edge is no cycle)."""
        if names is None:
            subset = list(self.nodes)
        else:
            wanted = set(names)
            subset = [n for n in self.nodes if n in wanted]
        member = set(subset)
        nexts = self._next_iterations()
        pending: dict[str, int] = {}
        users: dict[str, list[str]] = {n: [] for n in subset}
        for n in subset:
            deps = self.dependencies(self.nodes[n], nexts) & member
            pending[n] = len(deps)
            for d in deps:
                users[d].append(n)
        built = {n: i for i, n in enumerate(subset)}
        ready = [n for n in subset if pending[n] == 0]
        heap = [(built[n], n) for n in ready]  # already a heap: built in increasing order
        order: list[str] = []
        i = 0
        while (heap if earliest_first else i < len(ready)):
            if earliest_first:
                n = heapq.heappop(heap)[1]
            else:
                n = ready[i]
                i += 1
            order.append(n)
            for u in users[n]:
                pending[u] -= 1
                if pending[u] == 0:
                    if earliest_first:
                        heapq.heappush(heap, (built[u], u))
                    else:
                        ready.append(u)
        if len(order) != len(subset):
            stuck = [n for n in subset if pending[n] > 0]
            cycle = self._find_cycle(set(stuck), nexts)
            raise GraphError("cycle in graph: " + " -> ".join(f"'{c}'" for c in cycle))
        return order

    def _find_cycle(self, stuck: set[str], nexts: dict[str, list[str]]) -> list[str]:
        # Walk predecessors inside the stuck set until a node repeats: that stretch is a cycle.
        start = min(stuck, key=list(self.nodes).index)
        path, seen = [start], {start: 0}
        cur = start
        while True:
            preds = sorted(self.dependencies(self.nodes[cur], nexts), key=list(self.nodes).index)
            nxt = next(p for p in preds if p in stuck)
            if nxt in seen:
                cyc = path[seen[nxt]:] + [nxt]
                return list(reversed(cyc))
            seen[nxt] = len(path)
            path.append(nxt)
            cur = nxt

    # ------------------------------------------------------------------ verification
    def check(self, device_kernels: bool = True) -> "Graph":
        """Verify the IR: inputs exist, no cycle, shapes and dtypes agree, placed nodes have kernels.
        Re-infers every node in topological order and records the result."""
        for node in self.nodes.values():
            for ref in node.inputs:
                src, _ = parse_ref(ref)
                if src not in self.nodes:
                    raise GraphError(f"node '{node.name}' input '{ref}' refers to missing node '{src}'")
            for c in node.control_inputs:
                if c not in self.nodes:
                    raise GraphError(f"node '{node.name}' control input '^{c}' refers to missing node '{c}'")
            get_op(node.op)
        for name in self.topo_order():
            node = self.nodes[name]
            before = list(node.outputs)
            node.outputs = self._infer(node)
            if before and before != node.outputs:
                raise GraphError(f"node '{name}' ({node.op}) records outputs {before} but its inputs "
                                 f"give {node.outputs}")
            if device_kernels and node.assigned_device:
                from flowctl.engine.devices import device_type
                from flowctl.kernels.registry import has_kernel

                dtype = device_type(node.assigned_device)
                if not has_kernel(node.op, dtype):
                    raise GraphError(f"node '{name}' ({node.op}) is placed on {node.assigned_device} "
                                     f"but {node.op} has no {dtype} kernel")
        return self

    # ------------------------------------------------------------------ GraphDef JSON
    def to_dict(self) -> dict[str, Any]:
        return {"graphdef_version": GRAPHDEF_VERSION, "seed": self.seed,
                "nodes": [n.to_dict() for n in self.nodes.values()]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Graph":
        if d.get("graphdef_version") != GRAPHDEF_VERSION:
            raise GraphError(f"GraphDef version {d.get('graphdef_version')!r} is not {GRAPHDEF_VERSION}")
        g = cls(seed=d.get("seed", 0))
        for nd in d["nodes"]:
            name = nd["name"]
            if name in g.nodes:
                raise GraphError(f"GraphDef names node '{name}' twice")
            opdef = get_op(nd["op"])
            raw_inputs = nd.get("inputs", [])
            node = Node(
                name=name, op=nd["op"],
                inputs=[make_ref(*parse_ref(r)) for r in raw_inputs if not r.startswith("^")],
                control_inputs=[r[1:] for r in raw_inputs if r.startswith("^")],
                attrs=opdef.normalize_attrs(opdef.decode_attrs(nd.get("attrs", {}), name), name),
                device=nd.get("device", ""), colocate_with=list(nd.get("colocate_with", [])),
                assigned_device=nd.get("assigned_device"), source=nd.get("source", ""),
                follows=nd.get("follows", ""),
            )
            g.nodes[name] = node
            g._counts.setdefault(name, 0)
        return g.check()

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        return cls.from_dict(json.loads(text))

    def copy(self) -> "Graph":
        g = Graph(self.seed)
        for name, n in self.nodes.items():
            g.nodes[name] = Node(n.name, n.op, list(n.inputs), list(n.control_inputs), dict(n.attrs),
                                 n.device, list(n.colocate_with), n.assigned_device, n.source,
                                 n.follows, list(n.outputs))
        g._counts = dict(self._counts)
        return g

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, name: object) -> bool:
        return name in self.nodes


def default_graph() -> Graph:
    stack = _default.__dict__.setdefault("stack", [])
    if not stack:
        g = _default.__dict__.get("implicit")
        if g is None:
            g = _default.__dict__["implicit"] = Graph()
        return g
    return stack[-1]


def reset_default_graph() -> None:
    _default.__dict__["implicit"] = Graph()


def attrs_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Attribute equality with arrays compared by dtype, shape and bytes (used by CSE and tests)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype
                    and x.shape == y.shape and x.tobytes() == y.tobytes()):
                return False
        elif x != y:
            return False
    return True
