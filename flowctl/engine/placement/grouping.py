"""The learned placer's fixed first stage: the coarsened groups (coarsen.py) gathered into a few
placement units, and each unit described by a fixed-size feature vector (placement-notes.md,
Mirhoseini et al. 2017: "op-type embedding, output shapes, adjacency").

Units are built so that a policy can learn a placement in minutes:
1. Coarse groups the step runs are keyed by (spec layer, feasible set): a layer and its gradients
   form one unit (gradients follow their forward node in coarsening already). Without a layer
   map every coarse group keys by its feasible set alone.
2. While there are fewer units than `max_units`, the heaviest unit with more than one coarse
   group is split in two halves of equal work, in topological order (an unrolled LSTM layer
   splits into its early and late time steps, which can then pipeline on two devices).
3. While there are more, the lightest unit joins its topological neighbour with the same
   feasible set.
A unit's members always share a feasible set, so the policy masks devices per unit and never
breaks a colocation or device constraint.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from flowctl.engine.placement.problem import Problem

OP_BUCKETS = 32  # op types hashed into this many buckets: the features do not depend on the graph
SHAPE_FEATURES = 8
MAX_DEVICES = 8  # the policy's output width; clusters with fewer devices mask the rest


@dataclass
class Units:
    """Placement units over a Problem: `groups[u]` the coarse group ids of unit u, `feasible[u]`
    its device indices, `step_unit[i]` the unit of step node i (numpy, for fast placements)."""

    groups: list[list[int]]
    feasible: list[frozenset[int]]
    step_unit: np.ndarray
    work: list[float]  # per unit: seconds on its fastest feasible device
    names: list[str]  # per unit: its layer (or first member) and part, for reports

    def __len__(self) -> int:
        return len(self.groups)

    def node_devices(self, unit_dev: np.ndarray) -> np.ndarray:
        """Each step node's device index under a device per unit."""
        return unit_dev[self.step_unit]

    def group_devices(self, unit_dev: np.ndarray) -> dict[int, int]:
        return {g: int(unit_dev[u]) for u, gs in enumerate(self.groups) for g in gs}

    def project(self, pb: Problem, node_dev: list[int]) -> np.ndarray:
        """A node-level placement (step node -> device) expressed per unit: each unit on the
        feasible device where most of its work ran."""
        D = len(pb.devices)
        acc = np.zeros((len(self.groups), D))
        for i, d in enumerate(node_dev):
            acc[self.step_unit[i], d] += pb.table.times[i][d] + 1e-12
        out = np.zeros(len(self.groups), dtype=np.int64)
        for u in range(len(self.groups)):
            fs = sorted(self.feasible[u])
            out[u] = max(fs, key=lambda d: (acc[u, d], -d))
        return out


def build_units(pb: Problem, layers: Mapping[str, str] | None = None, max_units: int = 24,
                seed: Mapping[int, int] | None = None) -> Units:
    """`seed`: a device per coarse group (a heuristic's placement) that the units must be able to
    express exactly: coarse groups on different seed devices never share a unit (merges in step 3
    join same-device neighbours; only past twice `max_units` do they join across devices)."""
    t, co = pb.table, pb.coarse
    D = len(pb.devices)
    gwork: dict[int, np.ndarray] = {}
    first: dict[int, int] = {}
    for i, g in enumerate(pb.step_group):
        gwork.setdefault(g, np.zeros(D))
        gwork[g] += np.asarray(t.times[i][:D])
        first.setdefault(g, i)
    order = sorted(gwork, key=lambda g: first[g])

    def label(g: int) -> str:
        if layers:
            for m in co.groups[g].members:
                name = m
                for _ in range(64):  # gradients take their forward node's layer
                    if name in layers:
                        return layers[name]
                    name = pb.graph.nodes[name].follows if name in pb.graph.nodes else ""
                    if not name:
                        break
        return ""

    def cheapest(gs: list[int]) -> float:
        fs = co.feasible_idx[gs[0]]
        return float(min(sum(gwork[g][d] for g in gs) for d in fs))

    sd = seed or {}
    keyed: dict[tuple[str, frozenset[int], int], list[int]] = {}
    for g in order:
        keyed.setdefault((label(g), co.feasible_idx[g], sd.get(g, -1)), []).append(g)
    units = sorted(keyed.values(), key=lambda gs: first[gs[0]])
    names = [label(gs[0]) or co.groups[gs[0]].members[0] for gs in units]
    while len(units) < max_units:
        splittable = [(cheapest(gs), k) for k, gs in enumerate(units) if len(gs) > 1]
        if not splittable:
            break
        _, k = max(splittable)
        gs = units[k]
        total, acc, cut = cheapest(gs), 0.0, 1
        for j, g in enumerate(gs[:-1]):
            acc += float(min(gwork[g][d] for d in co.feasible_idx[g]))
            if acc >= total / 2:
                cut = j + 1
                break
        units[k:k + 1] = [gs[:cut], gs[cut:]]
        names[k:k + 1] = [names[k] + "/a", names[k] + "/b"]
    def same(j: int, k: int, strict: bool) -> bool:
        a, b = units[j][0], units[k][0]
        return co.feasible_idx[a] == co.feasible_idx[b] and (not strict or sd.get(a, -1) == sd.get(b, -1))

    while len(units) > max_units:
        merged = False
        strict = len(units) <= 2 * max_units
        for _, k in sorted((cheapest(gs), k) for k, gs in enumerate(units)):
            nb = [j for j in (k - 1, k + 1) if 0 <= j < len(units) and same(j, k, strict)]
            if nb:
                j = min(nb, key=lambda j: cheapest(units[j]))
                lo, hi = min(j, k), max(j, k)
                units[lo:hi + 1] = [sorted(units[lo] + units[hi], key=lambda g: first[g])]
                names[lo:hi + 1] = [names[lo]]
                merged = True
                break
        if not merged:
            break  # every unit's neighbours differ in feasible set: as coarse as constraints allow
    unit_of = {g: u for u, gs in enumerate(units) for g in gs}
    step_unit = np.asarray([unit_of[g] for g in pb.step_group], dtype=np.int64)
    return Units(units, [co.feasible_idx[gs[0]] for gs in units], step_unit, [cheapest(gs) for gs in units], names)


def _bucket(op: str) -> int:
    return zlib.crc32(op.encode()) % OP_BUCKETS


def features(pb: Problem, units: Units) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per unit: op-type counts (hashed buckets, log scale) [U, OP_BUCKETS]; shape and cost
    features [U, SHAPE_FEATURES]; a row-normalised adjacency over units weighted by the bytes
    crossing [U, U]. All scale-free (logs and fractions), so a policy trained on one batch size
    or cluster reads another's features in the same ranges."""
    t = pb.table
    U = len(units)
    ops = np.zeros((U, OP_BUCKETS))
    shp = np.zeros((U, SHAPE_FEATURES))
    adj = np.zeros((U, U))
    work = np.zeros(U)
    flops = np.zeros(U)
    out_b = np.zeros(U)
    big = np.zeros(U)
    grads = np.zeros(U)
    count = np.zeros(U)
    for i, name in enumerate(t.names):
        u = units.step_unit[i]
        node = pb.graph.nodes[name]
        ops[u, _bucket(node.op)] += 1
        work[u] += min(t.times[i])
        flops[u] += t.flops[i]
        b = float(sum(t.out_bytes[i]))
        out_b[u] += b
        big[u] = max(big[u], b)
        grads[u] += 1.0 if node.follows else 0.0
        count[u] += 1
        for j, p in t.inputs[i]:
            v = units.step_unit[j]
            if v != u:
                adj[u, v] += t.out_bytes[j][p]
                adj[v, u] += t.out_bytes[j][p]
    total = max(work.sum(), 1e-12)
    shp[:, 0] = work / total * U  # 1: an average unit
    shp[:, 1] = np.log1p(work * 1e3)
    shp[:, 2] = np.log1p(flops / 1e9)
    shp[:, 3] = np.log1p(out_b / (1 << 20))
    shp[:, 4] = np.log1p(big / (1 << 20))
    shp[:, 5] = grads / np.maximum(count, 1)
    shp[:, 6] = np.arange(U) / max(U - 1, 1)
    shp[:, 7] = np.array([len(f) for f in units.feasible]) / max(len(pb.devices), 1)
    ops = np.log1p(ops)
    adj = np.log1p(adj / (1 << 20))
    rows = adj.sum(axis=1, keepdims=True)
    adj = np.where(rows > 0, adj / np.maximum(rows, 1e-12), 0.0)
    return ops, shp, adj


def device_mask(pb: Problem, units: Units) -> np.ndarray:
    """[U, MAX_DEVICES]: 0 where a unit may go, a large negative logit elsewhere."""
    m = np.full((len(units), MAX_DEVICES), -1e9)
    for u, fs in enumerate(units.feasible):
        for d in fs:
            m[u, d] = 0.0
    return m


def describe(units: Units) -> list[dict[str, object]]:
    return [{"unit": u, "name": units.names[u], "groups": len(gs), "work_ms": round(units.work[u] * 1e3, 3)}
            for u, gs in enumerate(units.groups)]


__all__ = ["MAX_DEVICES", "OP_BUCKETS", "SHAPE_FEATURES", "Units", "build_units", "describe", "device_mask",
           "features"]

