"""Placement (whitepaper §3.2.1, §4.3): feasible sets, cost models, the step simulator, graph
coarsening, and the placers. See ARCHITECTURE.md, "Placement".

    from flowctl.engine.placement import place, simulate, StaticCostModel
    cluster = Cluster.from_spec("4xgpu:k40")
    pl = place(graph, cluster, StaticCostModel(cluster, batch=32), "greedy", targets=[train_op.node])
    pl.assignment      # node -> canonical device
    pl.step_time       # simulated seconds per step, at exactly the modelled costs
    pl.expected().mean # the same in expectation over the cost model's jitter: what to expect measured
    pl.to_dict()       # the explanation, JSON-ready
"""
from __future__ import annotations

from flowctl.engine.placement.coarsen import Coarsening, Group
from flowctl.engine.placement.cost import (
    CostModel,
    CostTable,
    MeasuredCostModel,
    StaticCostModel,
)
from flowctl.engine.placement.explain import Candidate, Decision, NodeReport, Placement
from flowctl.engine.placement.feasibility import Feasibility, feasible_sets
from flowctl.engine.placement.placers import ALGORITHMS, evaluate, place, rule_matches
from flowctl.engine.placement.problem import Problem, prepare
from flowctl.engine.placement.simulator import (
    DeviceStats,
    Expectation,
    LinkStats,
    SimResult,
    expect,
    expected_step_time,
    simulate,
    step_nodes,
)

__all__ = [
    "ALGORITHMS", "Candidate", "Coarsening", "CostModel", "CostTable", "Decision", "DeviceStats", "Expectation",
    "Feasibility", "Group", "LinkStats", "MeasuredCostModel", "NodeReport", "Placement", "Problem", "SimResult",
    "StaticCostModel", "evaluate", "expect", "expected_step_time", "feasible_sets", "place", "prepare",
    "rule_matches", "simulate", "step_nodes",
]
