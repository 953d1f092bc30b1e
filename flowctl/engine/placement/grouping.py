"""The learned placer's fixed first stage: the coarsened groups (coarsen.py) gathered into a few
placement units, and each unit described by a fixed-size feature vector (placement-notes.md,
Mirhoseini et al. 2017: "op-type embedding, output shapes, adjacency").

Units are built so that a policy can learn a placement in minutes:
1. Atoms: the coarse groups the step runs; a coarse group heavier than an average unit, or one
   the heuristic seed spreads over devices, splits into its hard colocation groups (coarsening
   soft-merges a dense layer's two gradient matmuls with it; they could run apart).
2. With a layer map, atoms are keyed by (spec layer, feasible set, seed device): a layer and its
   gradients form one unit. While there are fewer units than `max_units`, the heaviest unit
   splits in two halves of equal work, in step order (an unrolled LSTM layer splits into its
   early and late time steps, which can then pipeline on two devices).
3. Without one, every atom starts as a unit. Either way, while there are more than `max_units`, the lightest
   unit joins the neighbour it exchanges the most bytes with (same feasible set; same seed
   device while within twice the target).
A unit's members always share a feasible set, so the policy masks devices per unit and never
breaks a colocation or device constraint; and the seed's placement is one the policy can emit
(unless expressing it takes more than twice `max_units` units).
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flowctl.engine.placement.cost import CostTable
from flowctl.engine.placement.problem import Problem, complete

OP_BUCKETS = 32  # op types hashed into this many buckets: the features do not depend on the graph
SHAPE_FEATURES = 8
MAX_DEVICES = 8  # the policy's output width; clusters with fewer devices mask the rest


@dataclass
class Units:
    """Placement units over a Problem. A unit is a list of atoms; an atom is a coarse group, or,
    for a coarse group heavier than an average unit, one of its hard colocation groups (so the
    two gradient matmuls of a large dense layer, soft-merged with it by coarsening, can run on
    two devices). `atoms[a]` = (coarse group, hard group or -1 for the whole coarse group);
    `feasible[u]` the unit's device indices; `step_unit[i]` the unit of step node i."""

    groups: list[list[int]]  # per unit: its atoms
    atoms: list[tuple[int, int]]
    feasible: list[frozenset[int]]
    step_unit: np.ndarray
    work: list[float]  # per unit: seconds on its fastest feasible device
    names: list[str]  # per unit: its layer (or first member) and part, for reports

    def __len__(self) -> int:
        return len(self.groups)

    def node_devices(self, unit_dev: np.ndarray) -> np.ndarray:
        """Each step node's device index under a device per unit."""
        return unit_dev[self.step_unit]

    def assignment(self, pb: Problem, unit_dev: np.ndarray) -> dict[str, str]:
        """Every node of the graph on a device: step nodes by their unit; the rest of a coarse
        group with its first atom, or with its hard group's atom; groups the step does not run
        where `complete` puts them."""
        gd: dict[int, int] = {}
        hard: dict[int, int] = {}
        for u, atoms in enumerate(self.groups):
            for a in atoms:
                g, h = self.atoms[a]
                gd.setdefault(g, int(unit_dev[u]))
                if h >= 0:
                    hard[h] = int(unit_dev[u])
        gd = complete(pb, gd)
        feas, co = pb.feas, pb.coarse
        return {n: pb.devices[hard.get(feas.group_of[i], gd[co.group_of[i]])] for i, n in enumerate(feas.order)}

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
                seed: Sequence[int] | None = None) -> Units:
    """`seed`: a device per step node (a heuristic's placement) that the units must be able to
    express exactly: atoms on different seed devices never share a unit (merges in step 3 join
    same-device neighbours; only past twice `max_units` do they join across devices)."""
    t, D = pb.table, len(pb.devices)
    atoms, step_atom = _atoms(pb, max_units, seed)
    afeas = [pb.coarse.feasible_idx[g] if h < 0 else pb.feas.feasible[h] for g, h in atoms]
    awork = np.zeros((len(atoms), D))
    first: list[int] = [-1] * len(atoms)
    for i, a in enumerate(step_atom):
        awork[a] += np.asarray(t.times[i][:D])
        if first[a] < 0:
            first[a] = i

    def cheapest(xs: list[int]) -> float:
        return float(min(sum(awork[a][d] for a in xs) for d in afeas[xs[0]]))

    sd = [seed[first[a]] for a in range(len(atoms))] if seed is not None else [-1] * len(atoms)
    if layers:
        keyed: dict[tuple[str, frozenset[int], int], list[int]] = {}
        for a in range(len(atoms)):
            keyed.setdefault((_label(pb, layers, t.names[first[a]]), afeas[a], sd[a]), []).append(a)
        units = sorted(keyed.values(), key=lambda xs: first[xs[0]])
    else:
        units = [[a] for a in range(len(atoms))]
    names = [_label(pb, layers, t.names[first[xs[0]]]) or t.names[first[xs[0]]] for xs in units]
    _split_heaviest(units, names, max_units, awork, afeas, cheapest)
    if len(units) > max_units:
        units, names = _merge(units, names, max_units, step_atom, t, afeas, sd, cheapest)
    unit_of = {a: u for u, xs in enumerate(units) for a in xs}
    step_unit = np.asarray([unit_of[a] for a in step_atom], dtype=np.int64)
    return Units(units, atoms, [afeas[xs[0]] for xs in units], step_unit, [cheapest(xs) for xs in units], names)


def _atoms(pb: Problem, max_units: int, seed: Sequence[int] | None) -> tuple[list[tuple[int, int]], list[int]]:
    """Step 1 of the module docstring: the atoms (coarse group, hard group or -1), in order of
    their first step node, and each step node's atom."""
    t, feas = pb.table, pb.feas
    total = sum(min(x) for x in t.times) or 1.0
    cwork: dict[int, float] = {}
    for i, g in enumerate(pb.step_group):
        cwork[g] = cwork.get(g, 0.0) + min(t.times[i])
    atom_of: dict[tuple[int, int], int] = {}
    atoms: list[tuple[int, int]] = []
    step_atom = []
    # A coarse group the seed spreads over devices (the expert places hard colocation groups,
    # not coarse ones) splits like a heavy one, so the units can express the seed exactly.
    mixed: set[int] = set()
    if seed is not None:
        seen_dev: dict[int, int] = {}
        for i, g in enumerate(pb.step_group):
            if seen_dev.setdefault(g, seed[i]) != seed[i]:
                mixed.add(g)
    for i, name in enumerate(t.names):
        g = pb.step_group[i]
        h = -1
        if cwork[g] > total / max_units or g in mixed:
            h = feas.group_of[feas.index[name]]
        key = (g, h)
        if key not in atom_of:
            atom_of[key] = len(atoms)
            atoms.append(key)
        step_atom.append(atom_of[key])
    # A heavy coarse group made of one hard group is one atom: no split needed.
    hard_count: dict[int, set[int]] = {}
    for g, h in atoms:
        hard_count.setdefault(g, set()).add(h)
    return [(g, h if len(hard_count[g]) > 1 else -1) for g, h in atoms], step_atom


def _label(pb: Problem, layers: Mapping[str, str] | None, name: str) -> str:
    """The spec layer of step node `name` ("" if none): gradients take their forward node's."""
    if layers:
        for _ in range(64):
            if name in layers:
                return layers[name]
            name = pb.graph.nodes[name].follows if name in pb.graph.nodes else ""
            if not name:
                break
    return ""


def _split_heaviest(units: list[list[int]], names: list[str], max_units: int, awork: np.ndarray,
                    afeas: list[frozenset[int]], cheapest: Callable[[list[int]], float]) -> None:
    """In place: while there are fewer than `max_units` units, the heaviest that has more than
    one atom splits in two halves of equal work, in step order."""
    while len(units) < max_units:
        splittable = [(cheapest(xs), k) for k, xs in enumerate(units) if len(xs) > 1]
        if not splittable:
            break
        _, k = max(splittable)
        xs = units[k]
        whole, acc, cut = cheapest(xs), 0.0, 1
        for j, a in enumerate(xs[:-1]):
            acc += float(min(awork[a][d] for d in afeas[a]))
            if acc >= whole / 2:
                cut = j + 1
                break
        units[k:k + 1] = [xs[:cut], xs[cut:]]
        names[k:k + 1] = [names[k] + "/a", names[k] + "/b"]


def _merge(units: list[list[int]], names: list[str], max_units: int, step_atom: list[int], t: CostTable,
           afeas: list[frozenset[int]], sd: list[int], cheapest: Callable[[list[int]], float]
           ) -> tuple[list[list[int]], list[str]]:
    """Coarsen units to `max_units`: the lightest unit joins the neighbour it exchanges the most
    bytes with (same feasible set; same seed device while within twice the target); a unit with
    no such neighbour joins the lightest compatible unit, or stays."""
    uid = {a: k for k, xs in enumerate(units) for a in xs}
    adj: dict[int, dict[int, float]] = {k: {} for k in range(len(units))}
    for i, ins in enumerate(t.inputs):
        for j, p in ins:
            a, b = uid[step_atom[i]], uid[step_atom[j]]
            if a != b:
                nb = t.out_bytes[j][p] + 1.0
                adj[a][b] = adj[a].get(b, 0.0) + nb
                adj[b][a] = adj[b].get(a, 0.0) + nb
    live = {k: list(xs) for k, xs in enumerate(units)}
    label = dict(enumerate(names))
    weight = {k: cheapest(xs) for k, xs in live.items()}
    stuck: set[int] = set()
    while len(live) > max_units:
        free = [k for k in live if k not in stuck]
        if not free:
            break
        k = min(free, key=lambda k: (weight[k], k))
        strict = len(live) <= 2 * max_units
        a0 = live[k][0]

        def fits(j: int) -> bool:
            b0 = live[j][0]
            return afeas[a0] == afeas[b0] and (not strict or sd[a0] == sd[b0])

        cands = [j for j in adj[k] if fits(j)]
        if cands:
            j = max(cands, key=lambda j: (adj[k][j], -j))
        else:
            others = [j for j in live if j != k and fits(j)]
            if not others:
                stuck.add(k)
                continue
            j = min(others, key=lambda j: (weight[j], j))
        keep, drop = min(j, k), max(j, k)
        live[keep] = live[keep] + live.pop(drop)
        weight[keep] = cheapest(live[keep])
        for x, nb in adj.pop(drop).items():
            adj[x].pop(drop, None)
            if x != keep:
                adj[keep][x] = adj[keep].get(x, 0.0) + nb
                adj[x][keep] = adj[x].get(keep, 0.0) + nb
        adj[keep].pop(keep, None)
        stuck.discard(keep)
    order = sorted(live, key=lambda k: min(live[k]))  # atoms are numbered in step order
    return [sorted(live[k]) for k in order], [label[k] for k in order]


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
    return [{"unit": u, "name": units.names[u], "atoms": len(gs), "work_ms": round(units.work[u] * 1e3, 3)}
            for u, gs in enumerate(units.groups)]


def climb(units: Units, cur: np.ndarray, cur_key: Any, score: Callable[[np.ndarray], Any], budget: int,
          swaps: bool = False, frozen: frozenset[int] = frozenset()) -> tuple[np.ndarray, Any, int]:
    """First-improvement hill climbing over `units` from `cur` (whose score is `cur_key`): one
    unit moved to another feasible device at a time, the first move whose `score` (any ordered
    key, lower is better) beats the current one kept; passes repeat while one does, within
    `budget` calls of `score`. `swaps`: once no single move helps, passes that also exchange the
    devices of two units (a memory cap leaves no room for a single move onto a full device; an
    exchange frees what it takes). `frozen` units stay. Deterministic: moves in a fixed order.
    Returns the devices, their key and the calls spent."""
    used = 0

    def trials(u: int, with_swaps: bool) -> Iterator[np.ndarray]:
        # Built from `cur` as it stands when each is tried: a kept move changes the next ones.
        if with_swaps:
            for v in range(u + 1, len(cur)):
                if v not in frozen and cur[u] != cur[v] and cur[v] in units.feasible[u] and cur[u] in units.feasible[v]:
                    trial = cur.copy()
                    trial[u], trial[v] = cur[v], cur[u]
                    yield trial
        for d in sorted(units.feasible[u]):
            if d != cur[u]:
                trial = cur.copy()
                trial[u] = d
                yield trial

    def passes(with_swaps: bool) -> None:
        nonlocal cur, cur_key, used
        improved = True
        while improved and used < budget:
            improved = False
            for u in range(len(cur)):
                if u in frozen:
                    continue
                for trial in trials(u, with_swaps):
                    if used >= budget:
                        return
                    used += 1
                    key = score(trial)
                    if key < cur_key:
                        cur, cur_key, improved = trial, key, True

    passes(False)
    if swaps:
        passes(True)
    return cur, cur_key, used


__all__ = ["MAX_DEVICES", "OP_BUCKETS", "SHAPE_FEATURES", "Units", "build_units", "climb", "describe", "device_mask",
           "features"]

