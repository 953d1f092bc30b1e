"""What every placer starts from and ends with.

`prepare` computes, once, the step's nodes, the cost table, feasible sets and groups; `finalize`
turns a device per group into a `Placement`: it places whatever the placer left open (nodes the
step does not run, such as initialisers, go where their neighbours are), simulates the step, and
attaches the explanation data.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flowctl.engine.cluster import Cluster
from flowctl.engine.errors import PlacementError
from flowctl.engine.graph import Graph, parse_ref
from flowctl.engine.placement.coarsen import Coarsening, coarsen
from flowctl.engine.placement.cost import CostModel, CostTable
from flowctl.engine.placement.explain import Decision, Placement
from flowctl.engine.placement.feasibility import Feasibility, feasible_sets
from flowctl.engine.placement.simulator import simulate_table, step_nodes


@dataclass
class Problem:
    graph: Graph
    cluster: Cluster
    cost_model: CostModel
    targets: list[str] | None
    step: list[str]  # topological order: the table's nodes (what runs, led by the slots it holds)
    table: CostTable  # indexed like `step`
    feas: Feasibility
    coarse: Coarsening
    step_group: list[int]  # per step index: its group id
    memo: dict[str, Any] = field(default_factory=dict)  # what every placer of this problem shares (pinned.py)
    layers: Mapping[str, str] | None = None  # node -> layer of a spec-built model (place() sets it)

    @property
    def devices(self) -> list[str]:
        return self.feas.devices

    def decision(self, g: int, choice: int, reason: str, trigger: str = "") -> Decision:
        grp = self.coarse.groups[g]
        first = grp.members[0]
        return Decision(group=g, first=first, size=len(grp.members), feasible=list(grp.feasible),
                        narrowed_by=self.feas.group_narrowed_by(grp.members), merged=list(grp.merged),
                        choice=self.devices[choice], reason=reason, trigger=trigger)

    def sole_device(self, g: int, name: str) -> str:
        """Why group `g`, decided at node `name`, has one feasible device: the node's own set (its
        kernels, its constraint, its colocation group: `narrowed_by` says which), or a member the
        coarsening grouped it with for cost, whose constraint or kernels the whole group now keeps."""
        feas = self.feas
        mine = feas.feasible[feas.group_of[feas.index[name]]]
        if len(mine) == 1:
            return "only feasible device"
        for m in self.coarse.groups[g].members:
            j = feas.index[m]
            if mine <= feas.feasible[feas.group_of[j]]:
                continue  # allows every device `name` does: not what narrowed the group
            why = feas.narrowed_by(m)
            return f"grouped with '{m}'" + (f" ({why[0]})" if why else "") + ": its only device"
        return "only feasible device of its group"


def prepare(graph: Graph, cluster: Cluster, cost_model: CostModel, targets: Iterable[str] | None = None) -> Problem:
    tl = list(targets) if targets is not None else None
    feas = feasible_sets(graph, cluster)
    table = CostTable.build(graph, cluster, cost_model, step_nodes(graph, tl))
    step = table.names  # what runs, and the state it names by reference (optimizer slots)
    co = coarsen(graph, feas, table)
    step_group = [co.group_of[feas.index[n]] for n in step]
    return Problem(graph, cluster, cost_model, tl, step, table, feas, co, step_group)


def complete(pb: Problem, group_dev: dict[int, int]) -> dict[int, int]:
    """Give every group without a device one: its consumers' device, else its producers', else its
    first feasible device (initialisers run where the variable they fill lives)."""
    out = dict(group_dev)
    co, feas, graph = pb.coarse, pb.feas, pb.graph
    missing = [g for g in co.groups if g not in out]
    if not missing:
        return out
    consumers = graph.consumers()
    order = graph.topo_order()
    for _ in range(3):
        changed = False
        for name in reversed(order):  # consumers first: an initialiser goes where its output is used
            g = co.group_of[feas.index[name]]
            if g in out:
                continue
            for c in consumers[name]:
                d = out.get(co.group_of[feas.index[c]])
                if d is not None and d in co.feasible_idx[g]:
                    out[g] = d
                    changed = True
                    break
        for name in order:
            g = co.group_of[feas.index[name]]
            if g in out:
                continue
            node = graph.nodes[name]
            for ref in list(node.inputs) + node.control_inputs:
                d = out.get(co.group_of[feas.index[parse_ref(ref)[0]]])
                if d is not None and d in co.feasible_idx[g]:
                    out[g] = d
                    changed = True
                    break
        if not changed:
            break
    for g in co.groups:
        if g not in out:
            out[g] = min(co.feasible_idx[g])
    return out


def finalize(pb: Problem, algorithm: str, group_dev: dict[int, int], decisions: list[Decision],
             started: float, notes: list[str] | None = None) -> Placement:
    gd = complete(pb, group_dev)
    co, feas = pb.coarse, pb.feas
    for g, d in gd.items():
        if d not in co.feasible_idx[g]:  # an invariant: every placer picks from the feasible set
            raise PlacementError(f"{algorithm} put group of '{co.groups[g].members[0]}' on {feas.devices[d]}, "
                                 f"outside its feasible set {co.groups[g].feasible}")
    assignment = {n: feas.devices[gd[co.group_of[i]]] for i, n in enumerate(feas.order)}
    return build_placement(pb, algorithm, assignment, decisions, started, notes)


def build_placement(pb: Problem, algorithm: str, assignment: dict[str, str], decisions: list[Decision],
                    started: float, notes: list[str] | None = None) -> Placement:
    index = {d: i for i, d in enumerate(pb.devices)}
    dev = [index[assignment[n]] for n in pb.step]
    sim = simulate_table(pb.table, dev, pb.cluster)
    t = pb.table
    return Placement(
        algorithm=algorithm, assignment=assignment, simulation=sim, decisions=decisions,
        cost_model=getattr(pb.cost_model, "name", type(pb.cost_model).__name__),
        fallbacks=list(pb.cost_model.fallbacks()), notes=list(notes or []),
        seconds=time.perf_counter() - started, graph=pb.graph, coarse=pb.coarse,
        node_times={n: t.times[i][dev[i]] for i, n in enumerate(t.names)},
        node_flops={n: t.flops[i] for i, n in enumerate(t.names)}, table=t, device_index=dev, cluster=pb.cluster)
