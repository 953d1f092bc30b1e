"""Where a spec's training step would run, and how fast: the graph of one step (forward, gradients,
optimizer update), the spec's cluster and expert rules, and every placer's prediction.

Shared by `flowctl place` (predictions) and `flowctl bench SPEC` (predictions beside measurements).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from flowctl.engine.cluster import Cluster
from flowctl.engine.errors import PlacementError
from flowctl.engine.graph import Graph, Tensor
from flowctl.engine.placement import (
    ALGORITHMS, MeasuredCostModel, Placement, StaticCostModel, place, rule_matches,
)
from flowctl.spec.check import LoadedSpec
from flowctl.spec.cluster import cluster_for
from flowctl.spec.model import BuiltModel


@dataclass
class StepGraph:
    model: BuiltModel
    graph: Graph
    loss: Tensor
    lr: Tensor
    train_op: Tensor
    optimizer: Any


def step_graph(loaded: LoadedSpec) -> StepGraph:
    """The model, its mean loss, a learning-rate placeholder and one train op (the optimizer's
    update, with the spec's gradient clipping, and the batch-norm moving averages): the graph one
    training step of the `single` strategy runs, with the spec's constraints on its nodes."""
    from flowctl.engine import strategies as st
    from flowctl.training.strategies import forward, gradient_process

    model, lr, opt, loss = forward(loaded)
    g = model.graph
    with g.as_default():
        step = st.single_step(g, loss, model.inputs, model.trainable_variables(), opt,
                              updates=list(model.updates), process=gradient_process(loaded.spec))
    apply_constraints(loaded, g, layer_of(g, model))
    return StepGraph(model, g, step.loss, lr, step.train_op, opt)


def layer_of(graph: Graph, model: BuiltModel) -> dict[str, str]:
    """node -> the layer that made it; gradient and optimizer nodes take the layer of the forward
    node they follow (so a layer's constraint covers its backward pass too)."""
    base = model.layer_of()
    out: dict[str, str] = {}
    for name, node in graph.nodes.items():
        layer = base.get(name)
        follow, seen = node.follows, 0
        while layer is None and follow and seen < 64:
            layer = base.get(follow)
            follow = graph.nodes[follow].follows if follow in graph.nodes else ""
            seen += 1
        if layer is None and node.colocate_with:
            layer = base.get(node.colocate_with[0])
        if layer is not None:
            out[name] = layer
    return out


def apply_constraints(loaded: LoadedSpec, graph: Graph, layers: dict[str, str]) -> None:
    """§4.3: the spec's `placement.constraints` become each matching node's device constraint and
    its `colocate:` groups colocation constraints -- binding on every placer, not hints."""
    spec = loaded.spec
    for node in graph.nodes.values():
        layer = layers.get(node.name)
        for c in spec.placement.constraints:
            if rule_matches(c.match, node.name, layer):
                node.device = c.device
    for group in spec.placement.colocate:
        members = [n for n in graph.nodes.values()
                   if any(rule_matches(pattern, n.name, layers.get(n.name)) for pattern in group)]
        if len(members) > 1:
            anchor = next((m for m in members if m.op == "Variable"), members[0])
            for m in members:
                if m is not anchor and anchor.name not in m.colocate_with:
                    m.colocate_with.append(anchor.name)


def expert_rules(loaded: LoadedSpec) -> list[tuple[str, str]]:
    """The spec's own placement: `placement.constraints` and `parallelism.groups`, in that order."""
    spec = loaded.spec
    rules = [(c.match, c.device) for c in spec.placement.constraints]
    for grp in spec.parallelism.groups:
        rules.extend((pattern, grp.device) for pattern in grp.layers)
    return rules


@dataclass
class Plan:
    step: StepGraph
    cluster: Cluster
    cost: Any
    chosen: Placement
    compared: dict[str, Placement | str] = field(default_factory=dict)  # algorithm -> placement or error
    seconds: float = 0.0

    def layer_of(self) -> dict[str, str]:
        """node -> layer, gradient nodes with the layer of the forward node they follow."""
        known = layer_of(self.step.graph, self.step.model)
        return {n: known.get(n, "(optimizer and other)") for n in self.step.graph.nodes}


def plan(loaded: LoadedSpec, algorithm: str | None = None, devices: str | None = None,
         compare: tuple[str, ...] = ("single", "expert"), batch: int | None = None,
         measured: MeasuredCostModel | None = None, time_budget: float | None = None,
         learned: Any = None) -> Plan:
    """`learned`: LearnedOptions for the learned placer (its budget, seed, checkpoint)."""
    spec = loaded.spec
    algorithm = algorithm or spec.placement.algorithm
    started = time.perf_counter()
    step = step_graph(loaded)
    cluster = cluster_for(spec, devices)
    cost = measured or StaticCostModel(cluster, batch=batch or loaded.per_replica_batch)
    rules = expert_rules(loaded)
    layers = step.model.layer_of()
    budget = time_budget if time_budget is not None else spec.placement.time_budget_s

    def run(alg: str) -> Placement:
        return place(step.graph, cluster, cost, alg, targets=[step.train_op.node], rules=rules or None,
                     layers=layers, time_budget=budget, learned=learned)

    chosen = run(algorithm)
    out = Plan(step, cluster, cost, chosen)
    for alg in compare:
        if alg == algorithm or alg not in ALGORITHMS:
            continue
        if alg == "expert" and not rules:
            out.compared[alg] = "no rules in the spec (placement.constraints or parallelism.groups)"
            continue
        try:
            out.compared[alg] = run(alg)
        except PlacementError as e:
            out.compared[alg] = str(e)
    out.seconds = time.perf_counter() - started
    return out
