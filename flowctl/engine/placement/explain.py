"""What a placer decided and why, as data (ARCHITECTURE.md, Placement item 5).

A `Placement` is the mapping node -> device plus everything `flowctl place --explain` shows: per
group the feasible set, what narrowed it, the candidates' estimated finish times and the choice;
per node the same in node terms with its simulated start and finish; per device the ops, FLOPs,
bytes in and out, peak memory and busy time (from the simulator); the predicted step time.
Every class has `to_dict()` giving JSON-ready plain data; rendering is the CLI's business.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from flowctl.engine.errors import PlacementError
from flowctl.engine.graph import Graph
from flowctl.engine.placement.simulator import (EXPECTATION_SAMPLES, DeviceStats, Expectation, LinkStats,
                                                SimResult, expected_step_time, fmt_bytes, held_at_peak)

if TYPE_CHECKING:
    from flowctl.engine.cluster import Cluster
    from flowctl.engine.placement.coarsen import Coarsening
    from flowctl.engine.placement.cost import CostTable


@dataclass
class Candidate:
    device: str
    finish: float | None = None  # estimated finish of the deciding node there, seconds
    score: float | None = None  # what was compared (the least eligible wins): finish + rest of group + comm
    comm: float | None = None  # transfers to neighbours already placed elsewhere, seconds
    note: str = ""  # why it was not eligible (memory), if it was not

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Decision:
    """One group's device, and how it was chosen."""

    group: int
    first: str  # the group's first member (its name in reports)
    size: int
    feasible: list[str]
    narrowed_by: list[str]  # constraints, kernels, colocation
    merged: list[str]  # why the group's members are together (coarsening)
    choice: str
    reason: str  # "earliest estimated finish", "rule 'encoder/*'", "follows input 'x'", ...
    trigger: str = ""  # the node at which the placer decided (greedy: the first member reached)
    candidates: list[Candidate] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["candidates"] = [c.to_dict() for c in self.candidates]
        return d


@dataclass
class NodeReport:
    name: str
    op: str
    device: str
    group: int
    feasible: list[str]
    narrowed_by: list[str]
    source: str = ""  # the spec line and layer that made the node
    start: float | None = None  # simulated, seconds into the step (None: not run by the step)
    finish: float | None = None
    flops: float = 0.0
    time: float | None = None  # the cost model's op time on its device

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Placement:
    algorithm: str
    assignment: dict[str, str]  # node name -> canonical device name, every node of the graph
    simulation: SimResult
    decisions: list[Decision] = field(default_factory=list)
    cost_model: str = "static"
    fallbacks: list[str] = field(default_factory=list)  # nodes a measured model costed statically
    alternatives: dict[str, Any] = field(default_factory=dict)  # other candidates' predicted step times
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time the placer took
    measured_step: float | None = None  # seconds per step measured on the devices (learned, measured reward)
    # For node reports (built on demand: a 20k-node graph needs them only when asked).
    graph: Graph | None = field(default=None, repr=False, compare=False)
    coarse: Coarsening | None = field(default=None, repr=False, compare=False)
    node_times: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    node_flops: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    # What `expected` re-simulates: the step's cost table, each step node's device index, the cluster.
    table: CostTable | None = field(default=None, repr=False, compare=False)
    device_index: list[int] = field(default_factory=list, repr=False, compare=False)
    cluster: Cluster | None = field(default=None, repr=False, compare=False)
    _expected: dict[tuple[int, int], Expectation] = field(default_factory=dict, repr=False, compare=False)

    @property
    def step_time(self) -> float:
        return self.simulation.step_time

    @property
    def valid(self) -> bool:
        return self.simulation.valid

    def expected(self, samples: int = EXPECTATION_SAMPLES, seed: int = 0) -> Expectation:
        """The step time in expectation over the cost model's jitter (simulator.expected_step_time):
        what a measurement of this placement should show, where `step_time` is one exact schedule."""
        key = (samples, seed)
        if key not in self._expected:
            if self.table is None or self.cluster is None:  # built by hand: the exact schedule is all there is
                t = self.step_time
                self._expected[key] = Expectation(t, t, t, 0.0, 0)
            else:
                self._expected[key] = expected_step_time(self.table, self.device_index, self.cluster, samples, seed)
        return self._expected[key]

    @property
    def devices(self) -> list[DeviceStats]:
        return self.simulation.devices

    @property
    def links(self) -> list[LinkStats]:
        return self.simulation.links

    def __getitem__(self, node: str) -> str:
        return self.assignment[node]

    def held_at_peak(self, limit: int = 5) -> dict[str, list[dict[str, Any]]]:
        """Per device that computes something: the largest tensors it holds at its simulated peak
        (what makes `peak_memory`), up to `limit` each."""
        if self.table is None or not self.device_index or self.cluster is None:
            return {}
        held = held_at_peak(self.table, self.device_index, self.cluster)
        return {s.device: [h.to_dict() for h in held[k][:limit]]
                for k, s in enumerate(self.simulation.devices) if s.ops}

    def memory_report(self, limit: int = 50) -> list[dict[str, Any]]:
        """Per device whose simulated peak exceeds its memory: the peak, the capacity, and what the
        device holds at that moment, largest first (resident state -- Variables, optimizer slots,
        fed inputs --, outputs not yet freed, copies received), up to `limit` each: the tensors
        whose bytes make the peak, not merely the largest ever made there."""
        t, dev = self.table, self.device_index
        over = [k for k, s in enumerate(self.simulation.devices) if s.peak_memory > s.capacity]
        held = held_at_peak(t, dev, self.cluster) if over and t is not None and dev and self.cluster else None
        out = []
        for k in over:
            s = self.simulation.devices[k]
            at_peak = held[k] if held is not None else []
            out.append({"device": s.device, "peak": s.peak_memory, "capacity": s.capacity, "resident": s.resident,
                        "over": s.peak_memory - s.capacity,
                        "largest": [{"node": h.node, "bytes": h.bytes, "kind": h.kind} for h in at_peak[:limit]]})
        return out

    def check(self) -> Placement:
        if not self.valid:
            report = self.memory_report()
            raise PlacementError(f"{self.algorithm} placement is invalid: " + "; ".join(with_largest(
                self.simulation.problems, report)), {"kind": "out_of_memory", "algorithm": self.algorithm,
                                                     "devices": report})
        return self

    def apply(self, graph: Graph) -> Graph:
        """Record the placement on the graph's nodes (`Node.assigned_device`), in place."""
        for name, node in graph.nodes.items():
            if name not in self.assignment:
                raise PlacementError(f"node '{name}' ({node.op}) is not in the {self.algorithm} placement")
            node.assigned_device = self.assignment[name]
        return graph

    def node_reports(self) -> list[NodeReport]:
        if self.graph is None or self.coarse is None:
            return []
        sim = self.simulation
        feas = self.coarse.feas
        out = []
        for name, node in self.graph.nodes.items():
            g = self.coarse.group_of[feas.index[name]]
            out.append(NodeReport(
                name=name, op=node.op, device=self.assignment[name], group=g,
                feasible=feas.node_feasible(name), narrowed_by=feas.narrowed_by(name), source=node.source,
                start=sim.start.get(name), finish=sim.finish.get(name), flops=self.node_flops.get(name, 0.0),
                time=self.node_times.get(name)))
        return out

    def to_dict(self, nodes: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "algorithm": self.algorithm, "step_time": self.step_time, "measured_step": self.measured_step,
            "valid": self.valid,
            "problems": list(self.simulation.problems), "cost_model": self.cost_model,
            "fallbacks": list(self.fallbacks), "seconds": self.seconds, "notes": list(self.notes),
            "alternatives": dict(self.alternatives),
            "devices": [x.to_dict() for x in self.simulation.devices],
            "links": [x.to_dict() for x in self.simulation.links],
            "groups": [x.to_dict() for x in self.decisions],
            "assignment": dict(self.assignment),
        }
        if nodes:
            d["nodes"] = [x.to_dict() for x in self.node_reports()]
        return d


def with_largest(problems: list[str], report: list[dict[str, Any]], shown: int = 3) -> list[str]:
    """Each device's overflow line with the largest tensors it holds at its peak (the report's
    order is the problems' order: both list overflowing devices in cluster order)."""
    out = []
    for line, r in zip(problems, report):
        top = ", ".join(f"'{x['node']}' ({fmt_bytes(x['bytes'])} {x['kind']})" for x in r["largest"][:shown])
        out.append(line + (f" (largest there at the peak: {top})" if top else ""))
    return out + problems[len(report):]
