"""Sessions (whitepaper §2 "Sessions", §4.2): Extend the graph, then Run with fetches and feeds.

Any `node:port` can be fed or fetched. A run prunes to what its fetches need, and the compiled plan
is cached per (fetches, feeds, targets) signature, so repeated steps do no graph work.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from flowctl.engine import allocator
from flowctl.engine.capture import CapturedStep
from flowctl.engine.container import ContainerStore, RngState, derive_seed, process_store
from flowctl.engine.devices import CPU0, canonical, device_matches
from flowctl.engine.dtypes import np_dtype
from flowctl.engine.errors import ExecutionError, GraphError, PlacementError
from flowctl.engine.executor import Plan, RunStats
from flowctl.engine.graph import Graph, Node, Tensor, make_ref, parse_ref
from flowctl.engine import (concat_products, conv_affine, conv_siblings, multi_apply, multi_l2, recurrent_pack,
                            xent_bias)
from flowctl.engine.ops.queues import queue_resource
from flowctl.engine.passes import optimize
from flowctl.kernels.registry import StepGuard, array_module, capture_backend, to_host

# The ops whose device flag a step's state writes read (StepGuard).
GUARDS = ("CheckNumerics", "GuardFlag")

# Steps on a GPU are captured as CUDA graphs unless this is 0 (or a Session says capture=False).
CAPTURE = os.environ.get("FLOWCTL_CUDA_GRAPH", "1") != "0"


def require_device(device: str) -> Any:
    """The array module of `device`, or a PlacementError naming it when this machine lacks it
    (never a silent move to another device)."""
    kind = device.rsplit("device:", 1)[-1].split(":")[0]
    try:
        return array_module(kind)
    except RuntimeError:
        raise PlacementError(f"device {device} is not on this machine: cupy or a CUDA device is missing "
                             f"(install flowctl[gpu] where there is one). To plan for hardware that is not "
                             f"here, use `flowctl place --devices ...`") from None


class Session:
    def __init__(self, graph: Graph, device: str = CPU0, store: ContainerStore | None = None,
                 check_numerics: bool = False, optimize: bool = False, executor: str = "auto",
                 capture: bool | None = None) -> None:
        """`store`: where Variables live; the process-wide store by default (§4.7), so sessions on
        the same store share state. `check_numerics`: stop at the first node producing NaN/Inf.
        `optimize`: run CSE and constant folding on each plan's graph. `executor`: "compiled"
        (straight-line), "dataflow" (§3.1 ready queue) or "auto". `capture`: on a GPU, run each
        plan's steps as one captured CUDA graph (engine/capture.py; default: unless
        FLOWCTL_CUDA_GRAPH=0); a step run with stats or check_numerics is never captured."""
        if executor not in ("auto", "compiled", "dataflow"):
            raise ValueError(f"executor must be auto, compiled or dataflow, not {executor!r}")
        allocator.tune()  # large step buffers are reused, not faulted in afresh each step
        self.graph = graph
        self.device = canonical(device)
        self.device_type = self.device.rsplit("device:", 1)[1].split(":")[0]
        self.xp = require_device(self.device)
        self.store = store if store is not None else process_store()
        self.check_numerics = check_numerics
        self.optimize = optimize
        self.executor = executor
        self.rng: dict[str, RngState] = {}
        self._plans: dict[tuple[Any, ...], Plan] = {}
        self.capture = ((CAPTURE if capture is None else capture) and self.device_type == "gpu"
                        and getattr(self.xp, "device_kind", None) == "gpu")
        self.guards: dict[str, StepGuard] = {}
        self._captured: dict[tuple[Any, ...], CapturedStep] = {}

    # ------------------------------------------------------------------ Extend
    def extend(self, other: Graph | str | Mapping[str, Any]) -> None:
        """Add the nodes of another graph (or GraphDef JSON) that this session's graph lacks."""
        if isinstance(other, str):
            other = Graph.from_json(other)
        elif not isinstance(other, Graph):
            other = Graph.from_dict(dict(other))
        for name, node in other.nodes.items():
            mine = self.graph.nodes.get(name)
            if mine is None:
                self.graph.nodes[name] = node
                self.graph._counts.setdefault(name, 0)
            elif mine.to_dict() != node.to_dict():
                raise GraphError(f"extend: node '{name}' already exists with a different definition")
        self.graph.check()

    # ------------------------------------------------------------------ Run
    def run(self, fetches: Any, feeds: Mapping[Any, Any] | None = None, stats: RunStats | None = None) -> Any:
        """Fetch tensors (Tensor, "node:port", or a node name for a target), nested in lists,
        tuples or dicts; `feeds` maps tensors or refs to values."""
        return self._run(fetches, feeds, stats, late=False)

    def launch(self, fetches: Any, feeds: Mapping[Any, Any] | None = None) -> "Pending":
        """`run`, its fetched values handed back as they reach the host: where the step is captured
        (one GPU) it is launched and its values copied back behind it, and nothing waits for the
        device until `Pending.result()`, which also raises what `run` would have raised after the
        step (a NonFiniteError from the step's guard). Anywhere else the step runs as `run` runs
        it, and the Pending holds its values."""
        if type(self).run is not Session.run:  # a session of several devices runs its own way
            out = self.run(fetches, feeds)
            return Pending(lambda: out)
        return self._run(fetches, feeds, None, late=True)

    def _run(self, fetches: Any, feeds: Mapping[Any, Any] | None, stats: RunStats | None, late: bool) -> Any:
        refs: list[str] = []
        targets: list[str] = []
        template = self._flatten(fetches, refs, targets)
        feed_refs: list[str] = []
        feed_vals: list[Any] = []
        captured = self.capture and stats is None and not self.check_numerics and self.executor != "dataflow"
        for key, value in sorted((feeds or {}).items(), key=lambda kv: self._ref(kv[0])):
            ref = self._ref(key)
            feed_refs.append(ref)
            feed_vals.append(self._convert_feed(ref, value, host=captured))
        key = (tuple(refs), tuple(feed_refs), tuple(targets))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(refs, feed_refs, targets)
        if captured:
            values = self._captured_step(key, plan).run(feed_vals, late=late)
            if late:
                return Pending(lambda: self._rebuild(template, iter(values.result())))
        else:
            use_dataflow = self.executor == "dataflow"
            runner = plan.run_dataflow if use_dataflow else plan.run
            values = runner(feed_vals, stats=stats, check_numerics=self.check_numerics)
        out = self._rebuild(template, iter([to_host(v) for v in values]))
        return Pending(lambda: out) if late else out

    def _captured_step(self, key: tuple[Any, ...], plan: Plan) -> CapturedStep:
        step = self._captured.get(key)
        if step is None:
            slots: dict[int, Any] = {}
            rngs: dict[int, Any] = {}
            guards: dict[int, Any] = {}
            for node in plan.nodes:
                kind = node.opdef.resource
                if kind in ("variable", "variable_input", "variable_inputs", "variable_list"):
                    res = self._resource(node)
                    for slot in res if isinstance(res, tuple) else (res,):
                        slots[id(slot)] = slot
                elif kind == "rng":
                    st = self._resource(node)
                    rngs[id(st)] = st
                g = self._guard_for(node)
                if g is not None:
                    guards[id(g)] = g
            step = self._captured[key] = CapturedStep(plan, capture_backend(self.xp), self.xp, list(slots.values()),
                                                      list(rngs.values()), list(guards.values()), say=_say)
        return step

    def capture_report(self) -> dict[str, Any]:
        """Whether this session's steps were captured: per plan, its report (CapturedStep.report)."""
        return {"capture": self.capture, "plans": [s.report() for s in self._captured.values()]}

    def device_bytes(self) -> int:
        """Device memory the captured steps' private pools hold (0 on a CPU)."""
        return sum(s.backend.held_bytes() for s in self._captured.values() if s.backend is not None)

    def _guard_for(self, node: Node) -> StepGuard | None:
        """The StepGuard of a CheckNumerics or GuardFlag node, or of the one a node waits for (the
        state writes of a step's guard, program.guard_state; fp16's skippable update): on a GPU,
        where steps are captured."""
        if node.op in GUARDS:
            name = node.name
        else:
            # (a control input may be a node of the plan's graph alone: a MultiApply, multi_apply.py)
            name = next((c for c in node.control_inputs
                         if c in self.graph.nodes and self.graph.nodes[c].op in GUARDS), None)
            if name is None:
                return None
        g = self.guards.get(name)
        if g is None:
            g = self.guards[name] = StepGuard(name, raises=self.graph.nodes[name].op == "CheckNumerics")
        return g

    def plan_for(self, fetches: Any, feeds: Mapping[Any, Any] | None = None, passes: bool = True) -> Plan:
        """The plan that runs (fetches, feeds). `passes=False`: without the device's plan passes
        (the CPU's FusedConv2D and packed recurrent weights, the GPU's grouped updates), its nodes
        the graph's own: what the placement profiler times, keyed as the placer looks them up."""
        refs: list[str] = []
        targets: list[str] = []
        self._flatten(fetches, refs, targets)
        feed_refs = sorted(self._ref(k) for k in (feeds or {}))
        key: tuple[Any, ...] = (tuple(refs), tuple(feed_refs), tuple(targets))  # as run() keys it
        if not passes:
            key += ("without passes",)
        if key not in self._plans:
            self._plans[key] = self._plan(refs, feed_refs, targets, passes)
        return self._plans[key]

    def _plan(self, refs: list[str], feed_refs: list[str], targets: list[str], passes: bool = True) -> Plan:
        graph = self.graph
        if self.optimize:
            keep = {parse_ref(r)[0] for r in refs + feed_refs} | set(targets)
            graph = optimize(graph.copy(), keep=keep)
        if passes:
            graph = self._passes(graph, refs, feed_refs, targets)
        guards = self._guard_for if self.device_type == "gpu" else None
        plan = Plan(graph, refs, feed_refs, targets, self.device, self._resource, guards)
        for node in plan.nodes:
            if node.device and not device_matches(node.device, self.device):
                raise PlacementError(f"node '{node.name}' ({node.op}) asks for device '{node.device}' but "
                                     f"this session runs on {self.device} only; place the graph across "
                                     f"devices or drop the constraint")
        return plan

    def _passes(self, graph: Graph, refs: list[str], feed_refs: list[str], targets: list[str]) -> Graph:
        if self.device_type == "gpu" and multi_apply.ENABLED:  # one update node per optimizer and dtype
            graph = multi_apply.group_updates(graph, refs, feed_refs, targets)
        if self.device_type == "gpu" and multi_l2.ENABLED:  # one node per sum of L2Loss nodes (clipping's norm)
            graph = multi_l2.fuse_l2_sums(graph, refs, feed_refs, targets)
        if self.device_type == "cpu":
            graph = cpu_passes(graph, refs, feed_refs, targets)
        return graph

    def _ref(self, key: Any) -> str:
        if isinstance(key, Tensor):
            return key.name
        if isinstance(key, str):
            node, port = parse_ref(key)
            return make_ref(node, port)
        raise TypeError(f"feed keys are Tensors or 'node:port' strings, not {type(key).__name__}")

    def _flatten(self, f: Any, refs: list[str], targets: list[str]) -> Any:
        if isinstance(f, (list, tuple)):
            return type(f)(self._flatten(x, refs, targets) for x in f)
        if isinstance(f, dict):
            return {k: self._flatten(v, refs, targets) for k, v in f.items()}
        if isinstance(f, Tensor):
            node = f.op
            if not node.outputs:  # a target such as NoOp or Group
                targets.append(node.name)
                return None
            refs.append(f.name)
            return len(refs) - 1
        if isinstance(f, str):
            name, port = parse_ref(f)
            node_obj = self.graph.nodes.get(name)
            if node_obj is None:
                self.graph.tensor(f)  # raises with a did-you-mean
            assert node_obj is not None
            if ":" not in f and not node_obj.outputs:
                targets.append(name)
                return None
            refs.append(make_ref(name, port))
            return len(refs) - 1
        raise TypeError(f"cannot fetch {type(f).__name__}: fetch Tensors, 'node:port' strings or node names")

    def _rebuild(self, template: Any, values: Any) -> Any:
        if template is None:
            return None
        if isinstance(template, int):
            return next(values)
        if isinstance(template, (list, tuple)):
            return type(template)(self._rebuild(x, values) for x in template)
        return {k: self._rebuild(v, values) for k, v in template.items()}

    def _convert_feed(self, ref: str, value: Any, host: bool = False) -> Any:
        """A feed as the step reads it: on the device, or (`host`: a captured step copies it into its
        static buffer) a contiguous host array of the tensor's dtype."""
        spec = self.graph.tensor(ref).spec
        if host and not isinstance(value, self.xp.ndarray):
            arr = np.asarray(value, dtype=np_dtype(spec.dtype))  # (ascontiguousarray makes a 0-d array 1-d)
            if not arr.flags.c_contiguous:
                arr = arr.copy(order="C")
        else:
            arr = self.xp.asarray(value, dtype=np_dtype(spec.dtype))
        if len(arr.shape) != len(spec.shape) or any(
                d is not None and d != a for d, a in zip(spec.shape, arr.shape)):
            raise ExecutionError(f"feed for '{ref}' has shape {tuple(arr.shape)}, but the tensor's shape "
                                 f"is {spec.shape}", node=parse_ref(ref)[0], device=self.device)
        return arr

    # ------------------------------------------------------------------ resources (§4.7)
    def _resource(self, node: Node) -> Any:
        kind = node.opdef.resource
        if kind == "variable":
            return self.store.get(node.attrs["container"]).slot(node.attrs["shared_name"] or node.name)
        if kind == "variable_input":
            return self._input_variable(node, 0)
        if kind == "variable_inputs":  # one slot per ref input, in order (an update of a parameter and its slots)
            return tuple(self._input_variable(node, i) for i in node.opdef.ref_inputs)
        if kind == "variable_list":  # a multi-tensor update (multi_apply.py): each variable, then its slots
            return tuple(self._resource(self.graph.nodes[v]) for v in node.attrs["variables"])
        if kind == "rng":
            st = self.rng.get(node.name)
            if st is None:
                seed = derive_seed(self.graph.seed, node.name, int(node.attrs.get("seed", 0) or 0))
                st = self.rng[node.name] = RngState(node.name, seed)
            return st
        if kind == "queue":  # §4.6/§4.7: in the store like a Variable, so sessions and threads share it
            return queue_resource(self.graph, node, self.store)
        raise GraphError(f"node '{node.name}': unknown resource kind {kind!r}")

    def _input_variable(self, node: Node, i: int) -> Any:
        src = self.graph.nodes[parse_ref(node.inputs[i])[0]]
        if src.op != "Variable":
            which = "first input" if i == 0 else f"input {i}"
            raise GraphError(f"node '{node.name}' ({node.op}) must take a Variable as its {which}, "
                             f"not '{src.name}' ({src.op})")
        return self._resource(src)

    def variable_values(self) -> dict[str, np.ndarray]:
        """Current value of every initialized Variable in the graph, by node name (host arrays)."""
        out = {}
        for n in self.graph.nodes.values():
            if n.op == "Variable":
                v = self._resource(n).value
                if v is not None:
                    out[n.name] = to_host(v)
        return out

    def load_variables(self, values: Mapping[str, Any]) -> None:
        for name, v in values.items():
            node = self.graph.nodes.get(name)
            if node is None or node.op != "Variable":
                raise GraphError(f"no Variable named '{name}' in the graph")
            self._resource(node).value = self.xp.asarray(v, dtype=np_dtype(node.attrs["dtype"]))

    def rng_states(self) -> dict[str, dict[str, Any]]:
        """Every random op's generator state, for checkpoints (a resumed run continues exactly)."""
        for n in self.graph.nodes.values():
            if n.opdef.resource == "rng":
                self._resource(n)
        return {k: v.get_state() for k, v in self.rng.items()}

    def set_rng_states(self, states: Mapping[str, dict[str, Any]]) -> None:
        for name, st in states.items():
            node = self.graph.nodes.get(name)
            if node is None:
                raise GraphError(f"random state for unknown node '{name}'")
            self._resource(node).set_state(st)



class Pending:
    """A step's fetched values, read on the host when asked (`Session.launch`)."""

    __slots__ = ("_get",)

    def __init__(self, get: Any) -> None:
        self._get = get

    def result(self) -> Any:
        """The values (waiting for their copies to the host the first time), or the error the
        step raises once they are read."""
        return self._get()


def _say(message: str) -> None:
    print(f"flowctl: {message}", file=sys.stderr)


def cpu_passes(graph: Graph, refs: Sequence[str], feed_refs: Sequence[str], targets: Sequence[str]) -> Graph:
    """The CPU's plan passes, for a session's one device and for each CPU partition of a placed
    step alike (runtime.compile_partition), so a CPU device runs the same kernels whether the step
    is split or not: a convolution and the inference batch norm reading it as one node, sibling 1x1
    convolutions as one, a recurrent weight packed once a step, a classifier's last bias and its loss
    as one node each way, products written into the rows of the Concat that reads them. Each copies the graph it changes."""
    refs, feed_refs, targets = list(refs), list(feed_refs), list(targets)
    if conv_affine.ENABLED:
        graph = conv_affine.fuse_conv_affine(graph, refs, feed_refs, targets)
    if conv_siblings.ENABLED:
        graph = conv_siblings.merge_siblings(graph, refs, feed_refs, targets)
    if recurrent_pack.enabled():
        graph = recurrent_pack.pack_recurrent(graph, refs, feed_refs, targets)
    if xent_bias.ENABLED:
        graph = xent_bias.fuse_xent_bias(graph, refs, feed_refs, targets)
    if concat_products.ENABLED:
        graph = concat_products.fuse_concat_products(graph, refs, feed_refs, targets)
    return graph
