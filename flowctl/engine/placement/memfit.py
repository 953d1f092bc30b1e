"""Placement that fits memory: a placement whose simulated peak overflows a device is repaired by
moving groups off it to where memory is free, instead of failing (Baechi's lesson: under a cap
where one device cannot hold the model, a good placer still completes, a little slower).

Each round takes the device that overflows most, and moves off it the groups holding the most
memory per second of work (resident state -- variables, optimizer slots -- and their outputs:
activations kept for the backward pass, gradients) until the moved bytes cover the overflow with
a margin; each goes to the feasible device with the most memory left. The simulator re-checks
the result; rounds repeat while a device overflows and the overflow shrinks. Memory is the
simulator's: what a step holds at its peak, the same figure `place` prints per device.
"""
from __future__ import annotations

import time

from flowctl.engine.placement.explain import Decision, Placement
from flowctl.engine.placement.problem import Problem, complete, finalize
from flowctl.engine.placement.simulator import fmt_bytes

ROUNDS = 12
MARGIN = 1.3


def footprint(pb: Problem) -> dict[int, tuple[float, float]]:
    """Per group: (bytes it holds -- resident outputs plus every output once -- , seconds of work
    on its fastest device)."""
    t = pb.table
    out: dict[int, list[float]] = {}
    for i, g in enumerate(pb.step_group):
        row = out.setdefault(g, [0.0, 0.0])
        row[0] += float(sum(t.out_bytes[i]))
        row[1] += min(t.times[i])
    return {g: (b, w) for g, (b, w) in out.items()}


def fit_memory(pb: Problem, pl: Placement, group_dev: dict[int, int], algorithm: str,
               decisions: list[Decision], started: float, notes: list[str], order: str = "dense") -> Placement:
    """`pl` (made from `group_dev`) repaired until it fits, or the least-overflowing attempt
    with its explanation when the cluster's memory cannot hold the step. `order`: which groups
    leave first -- "dense", the most bytes per second of work; "suffix", the last in the forward
    pass (a whole model on one device is cut into consecutive stages: one cut, few transfers)."""
    if pl.valid:
        return pl
    fp = footprint(pb)
    # A group's place in the forward pass (-1: backward or optimizer work only, such as a global
    # norm over every gradient: moved last, as it reads from every stage).
    first: dict[int, int] = {}
    for i, g in enumerate(pb.step_group):
        first.setdefault(g, -1)
        if first[g] < 0 and not pb.graph.nodes[pb.table.names[i]].follows:
            first[g] = i
    gd = complete(pb, group_dev)
    best, best_over = pl, _overflow(pl)
    notes = list(notes)
    for r in range(ROUNDS):
        sim = best.simulation
        over = {pb.devices.index(s.device): s.peak_memory - s.capacity for s in sim.devices
                if s.peak_memory > s.capacity}
        if not over:
            break
        d = max(over, key=lambda k: over[k])
        free: dict[int, float] = {pb.devices.index(s.device): float(s.capacity - s.peak_memory)
                                  for s in sim.devices}
        movable = [g for g in fp if gd.get(g) == d and len(pb.coarse.feasible_idx[g]) > 1]
        if order == "suffix":
            mine = sorted(movable, key=lambda g: -first[g])
        else:
            mine = sorted(movable, key=lambda g: (-fp[g][0] / max(fp[g][1], 1e-9), g))
        moved, count, dest = 0.0, 0, -1
        for g in mine:
            if moved >= MARGIN * over[d]:
                break
            targets = [x for x in pb.coarse.feasible_idx[g] if x != d and free[x] > fp[g][0]]
            if not targets:
                continue
            # A suffix goes where the previous moved group went while it has room (one stage).
            x = dest if order == "suffix" and dest in targets else max(targets, key=lambda k: (free[k], -k))
            dest = x
            gd[g] = x
            free[x] -= fp[g][0]
            moved += fp[g][0]
            count += 1
            decisions.append(pb.decision(g, x, f"moved off {pb.devices[d]} to fit memory "
                                                f"({fmt_bytes(fp[g][0])} of outputs and state)"))
        if not count:
            break
        notes.append(f"memory: moved {count} group(s), {fmt_bytes(moved)}, off {pb.devices[d]} "
                     f"(over by {fmt_bytes(over[d])})")
        cand = finalize(pb, algorithm, dict(gd), decisions, started, notes)
        o = _overflow(cand)
        if o >= best_over and not cand.valid:
            break
        best, best_over = cand, o
        if cand.valid:
            break
    best.seconds = time.perf_counter() - started
    return best


def _overflow(pl: Placement) -> float:
    return float(sum(max(0, s.peak_memory - s.capacity) for s in pl.simulation.devices))


__all__ = ["fit_memory", "footprint"]
