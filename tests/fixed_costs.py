"""A cost model with the op times a test chooses, for placer and simulator tests."""
from __future__ import annotations

from flowctl.engine.cluster import Cluster
from flowctl.engine.graph import Graph, Node
from flowctl.engine.placement import StaticCostModel


class FixedCosts:
    """Op times from a table (`default` for the others); tensor sizes from the graph's static
    shapes; transfers over the cluster's links (latency + bytes / bandwidth)."""

    name = "fixed"
    batch = 1

    def __init__(self, cluster: Cluster, times: dict[str, float], default: float = 1e-6) -> None:
        self.static = StaticCostModel(cluster, 1)
        self.times, self.default = times, default

    def op_time(self, graph: Graph, node: Node, device: str) -> float:
        return self.times.get(node.name, self.default)

    def tensor_bytes(self, graph: Graph, ref: str) -> int:
        return self.static.tensor_bytes(graph, ref)

    def transfer_time(self, nbytes: int, src: str, dst: str) -> float:
        return self.static.transfer_time(nbytes, src, dst)

    def fallbacks(self) -> list[str]:
        return []
