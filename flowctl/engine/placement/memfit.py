"""Placement that fits memory: a placement whose simulated peak overflows a device is repaired by
moving groups off it to where memory is free, instead of failing (Baechi's lesson: under a cap
where one device cannot hold the model, a good placer still completes, a little slower).

Each round takes the device that overflows most and an order in which its groups leave:
"dense", the groups holding the most memory per second of work first (resident state --
variables, optimizer slots -- and their outputs: activations kept for the backward pass,
gradients), each to the feasible device with the most memory left; or "suffix", the last in
the forward pass first, all to the one device with the most memory left (a whole model on one
device is cut into consecutive stages: one cut, few transfers). How many leave is found by
bisection on the simulator: the fewest that bring the device under its capacity. A group's
bytes (its outputs) do not say how much a move lowers the peak -- what a step holds at its peak
depends on when tensors are live, and a moved group's outputs read back on the device come
back as received tensors -- so the simulator, not the byte count, decides. Rounds repeat while
a device overflows and the total overflow shrinks; the faster of the two orders that fits wins.
Where neither fits (two devices, each under the step's need with little to spare: a run of
groups that fits one device overflows the other), a descent moves one group at a time, the
move the simulator says shrinks the overflow most. Once it fits, groups that the moves left
apart from a neighbour they exchange large tensors with may rejoin it, where the simulator says
the step is faster and memory still fits. Last, a local search (`polish`) over placement units,
from the fitted placement and from the placer's own overflowing choice, single moves and then
exchanges of two units, keeps what the simulator says is faster and fits: the moves find a fit
with few groups moved, the search a good one. Where the model's layers are known (a spec-built
model: `Problem.layers`), the search also runs over units that keep a layer whole (split where
one is heavy): the moves a person makes, which runs of groups cut anywhere miss (nmt_free with
SGD on two K40s capped at 740 MiB, greedy: 227.7 ms by runs, 190.4 by layers, against 205.8
uncapped). Memory is the simulator's: what a step holds at its peak, the same figure `place`
prints per device, optimizer slots included. Figures below that name no optimizer are NMT's with
Adam, measured before its moments were counted as memory (the caps were then 763 MiB).
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from flowctl.engine.placement.explain import Decision, Placement
from flowctl.engine.placement.grouping import Units, build_units, climb
from flowctl.engine.placement.problem import Problem, build_placement, complete, finalize
from flowctl.engine.placement.simulator import SimResult, fmt_bytes, simulate_table

ROUNDS = 12
DESCENT_ROUNDS = 8  # single-group moves of the last resort
DESCENT_CANDIDATES = 6  # groups tried per overflowing device and move
REJOIN_TRIES = 40  # simulations spent rejoining groups split by the moves
ONE_MOVE_CANDIDATES = 4  # groups tried, each alone, off a device that alone overflows
CUTS_TRIED = 16  # suffix lengths tried, from the fewest that fit to all
LEVELS = (12, 24, 48, 96)  # units of the local search after the moves, coarse to fine
POLISH_WORK = 1.5e6  # its budget: simulations x step nodes (NMT's 1,239 nodes: ~1,200 simulations, ~10 s)
POLISH_SLACK = 0.02
PENALTIES = (10.0, 2.0)  # the climbs from a placer's own overflowing choice: overflow's weight


def footprint(pb: Problem) -> dict[int, tuple[float, float]]:
    """Per group: (bytes it holds -- resident outputs plus every output once, views none -- ,
    seconds of work on its fastest device)."""
    t = pb.table
    out: dict[int, list[float]] = {}
    for i, g in enumerate(pb.step_group):
        row = out.setdefault(g, [0.0, 0.0])
        row[0] += float(sum(t.held[i]))
        row[1] += min(t.times[i])
    return {g: (b, w) for g, (b, w) in out.items()}


ORDERS = ("suffix", "dense")


def fit_memory(pb: Problem, pl: Placement, group_dev: dict[int, int], algorithm: str,
               decisions: list[Decision], started: float, notes: list[str], order: str = "any",
               fixed: frozenset[int] = frozenset(), search: bool = True) -> Placement:
    """`pl` (made from `group_dev`) repaired until it fits, or the least-overflowing attempt
    with its explanation when the cluster's memory cannot hold the step. `order`: which groups
    leave first, "dense" or "suffix" (module docstring); "any": both, the faster that fits, then
    the local search (`polish`) unless `search` is off (a caller that repairs several
    candidates polishes its winner once). `fixed`: groups that stay where they are (the
    expert's rules placed them)."""
    if pl.valid:
        return pl
    tries = [_fit(pb, pl, group_dev, algorithm, list(decisions), started, notes, how, fixed)
             for how in (ORDERS if order == "any" else (order,))]
    if order == "any":
        one = _one_move(pb, pl, algorithm, list(decisions), started, notes, fixed)
        tries += [one] if one is not None else []
    fits = [x for x in tries if x.valid]
    best = min(fits, key=lambda x: x.step_time) if fits else min(tries, key=overflow)
    if not best.valid and order == "any":
        best = descend(pb, best, algorithm, started, fixed)
    if best.valid:
        best = _rejoin(pb, best, algorithm, started, fixed)
    if order == "any" and search:
        best = polish(pb, best, algorithm, started, fixed, origin=pl)
    best.seconds = time.perf_counter() - started
    return best


def polish(pb: Problem, pl: Placement, algorithm: str, started: float,
           fixed: frozenset[int] = frozenset(), origin: Placement | None = None) -> Placement:
    """A local search after the moves (grouping.climb: single moves, then exchanges of two units),
    scored by (overflow, step): from a placement that fits, only fits are kept; from one that
    does not, less overflow first. The moves above fit memory with the fewest groups moved, not
    the best cut: nmt_free on two capped H100s, heft's placement fitted 32.1 ms, polished 22.0.
    `origin`, the placer's own choice that overflowed, is a second and third start: climbed
    first by the step time weighted by the overflow (x PENALTIES per device's capacity), then as
    above. Coarse to fine: each start climbs over LEVELS[0] units (whole runs of groups: moves
    that cross a basin), then over finer units from where it stopped, the better half of the
    starts going on at each level (successive halving), within POLISH_WORK (nmt_free on four
    capped H100s, heft: at one level of 48 units, 22.4 ms; coarse to fine, 17.1, under its own
    uncapped 18.8). With `pb.layers`, every start climbs twice, over units of each kind (module
    docstring), and the halving keeps the better. Units holding a `fixed` group stay. Returns
    `pl` where nothing better was found, or where it fits within POLISH_SLACK of `origin`'s step
    (the cap cost next to nothing)."""
    if origin is not None and pl.valid and pl.step_time <= (1.0 + POLISH_SLACK) * origin.step_time:
        return pl
    cap = float(min(pb.cluster.device(d).profile.memory for d in pb.devices))
    starts: list[tuple[str, list[int], float]] = [("the moves' fit", list(pl.device_index), 0.0)]
    if origin is not None and not origin.valid:
        starts += [(f"{algorithm}'s own placement, overflow weighted x{w:g}", list(origin.device_index), w)
                   for w in PENALTIES]
    # Each start climbs over units of two kinds where the model's layers are known: whole layers
    # (split where one is heavy), the moves a person makes, and runs of groups cut anywhere.
    kinds: list[Mapping[str, str] | None] = [None] + ([pb.layers] if pb.layers else [])
    total = max(50 * len(LEVELS), int(POLISH_WORK / max(1, len(pb.step))))
    alive: list[tuple[tuple[float, float], str, list[int], float, Mapping[str, str] | None, dict[str, str]]] = [
        ((float("inf"), float("inf")), name + (", by layers" if kind else ""), dev, weight, kind, {})
        for name, dev, weight in starts for kind in kinds]
    used = 0
    for level, n_units in enumerate(LEVELS):
        per = max(20, total // len(LEVELS) // len(alive))
        went_on = []
        for _, name, dev, weight, kind, _ in alive:
            key, units, cur, spent = _climb_level(pb, dev, n_units, per, fixed, cap, weight if level == 0 else 0.0,
                                                  kind)
            used += spent
            went_on.append((key, name, units.node_devices(cur).tolist(), weight, kind,
                            units.assignment(pb, cur) if level == len(LEVELS) - 1 else {}))
        went_on.sort(key=lambda x: x[0])
        alive = went_on[:max(1, (len(went_on) + 1) // 2)]
    key, name, dev, _, _, assignment = alive[0]
    if key >= (overflow(pl), pl.step_time):
        return pl
    before = {g: pl.device_index[i] for i, g in enumerate(pb.step_group)}
    after = {g: dev[i] for i, g in enumerate(pb.step_group)}
    decisions = pl.decisions + [pb.decision(g, d, "moved by the local search under the memory cap")
                                for g, d in after.items() if before[g] != d]
    was = f"{pl.step_time * 1e3:.2f} ms" if pl.valid else f"{fmt_bytes(overflow(pl))} over"
    now = f"{key[1] * 1e3:.2f} ms" if key[0] == 0 else f"{fmt_bytes(key[0])} over"
    notes = pl.notes + [f"memory: a local search over {'/'.join(map(str, LEVELS))} units from {name} "
                        f"({was} -> {now}, {used} simulations)"]
    out = build_placement(pb, algorithm, assignment, decisions, started, notes)
    # The units hold whole runs of groups; a group the search left apart from the neighbour it
    # exchanges the most with may still rejoin it (nmt_free on two capped H100s, heft: 23.9 ->
    # 22.0 ms).
    return _rejoin(pb, out, algorithm, started, fixed) if out.valid else out


def _climb_level(pb: Problem, dev: list[int], n_units: int, budget: int, fixed: frozenset[int], cap: float,
                 weight: float, layers: Mapping[str, str] | None = None
                 ) -> tuple[tuple[float, float], Units, np.ndarray, int]:
    """One level of `polish` from `dev` (a device per step node): units built to express it (by
    `layers` where given), a climb by the step weighted by overflow first where `weight` is set,
    then by (overflow, step). Returns the key reached, the units, a device per unit and the
    simulations spent."""
    units = build_units(pb, layers, n_units, dev)
    frozen = frozenset(u for u, atoms in enumerate(units.groups) if any(units.atoms[a][0] in fixed for a in atoms))

    def score(u: np.ndarray) -> tuple[float, float]:
        sim = simulate_table(pb.table, units.node_devices(u).tolist(), pb.cluster)
        return (_overflow_of(sim), sim.step_time)

    def weighted(u: np.ndarray) -> float:
        over, step = score(u)
        return step * (1.0 + weight * over / cap)

    cur, used = units.project(pb, dev), 0
    if weight:
        cur, _, used = climb(units, cur, weighted(cur), weighted, budget // 2, swaps=True, frozen=frozen)
    cur, key, more = climb(units, cur, score(cur), score, budget - used, swaps=True, frozen=frozen)
    return key, units, cur, used + more + 1


def descend(pb: Problem, pl: Placement, algorithm: str, started: float,
            fixed: frozenset[int] = frozenset()) -> Placement:
    """The last resort, where moving a run of groups off a device only overflows the one they
    reach (two devices, each under the step's need, with little to spare): one group at a time,
    the move among a few candidates -- the groups holding the most bytes on each overflowing
    device, each to every other device it can run on -- that leaves the least total overflow by
    the simulator, while the overflow shrinks."""
    t, co = pb.table, pb.coarse
    fp = footprint(pb)
    gd = {g: pl.device_index[i] for i, g in enumerate(pb.step_group)}
    sim = pl.simulation
    moved: dict[int, int] = {}
    for _ in range(DESCENT_ROUNDS):
        over = _overflow_of(sim)
        if over == 0:
            break
        full = {pb.devices.index(s.device): s.peak_memory - s.capacity for s in sim.devices
                if s.peak_memory > s.capacity}
        cands = []
        for d, by in full.items():
            movable = [g for g in fp if gd[g] == d and g not in fixed and len(co.feasible_idx[g]) > 1]
            mine = sorted(movable, key=lambda g: (-fp[g][0], g))[:DESCENT_CANDIDATES]
            # A device a little over: also the smallest groups holding at least what it is over by
            # (the largest may not fit anywhere else: expert on nmt_free over two capped K40s
            # ended 1.69 MiB over with only 117 MiB tables to move).
            mine += [g for g in sorted(movable, key=lambda g: (fp[g][0], g))
                     if fp[g][0] >= by and g not in mine][:DESCENT_CANDIDATES]
            cands += [(g, x) for g in mine for x in sorted(co.feasible_idx[g]) if x != d]
        best: tuple[float, float, int, int] | None = None
        for g, x in cands:
            trial = {**gd, g: x}
            s_ = simulate_table(t, [trial[k] for k in pb.step_group], pb.cluster)
            key = (_overflow_of(s_), s_.step_time, g, x)
            if best is None or key < best:
                best = key
        if best is None or best[0] >= over:
            break
        _, _, g, x = best
        gd[g] = moved[g] = x
        sim = simulate_table(t, [gd[k] for k in pb.step_group], pb.cluster)
    if not moved or _overflow_of(sim) >= overflow(pl):
        return pl
    notes = pl.notes + [f"memory: {len(moved)} group(s) moved one at a time where the simulator said the "
                        f"overflow shrank most"]
    decisions = pl.decisions + [pb.decision(g, x, "moved to fit memory (one group at a time)")
                                for g, x in moved.items()]
    return finalize(pb, algorithm, gd, decisions, started, notes)


def _one_move(pb: Problem, pl: Placement, algorithm: str, decisions: list[Decision], started: float,
              notes: list[str], fixed: frozenset[int]) -> Placement | None:
    """Where one device overflows: the fastest placement that fits after moving one group off it
    (the ONE_MOVE_CANDIDATES holding the most bytes there, each to every other device it can run
    on), else after swapping one of them for a smaller group of the device it reaches; or None. The orders above move the fewest groups that fit, not the cheapest: a placer's
    choice over a little (nmt_free on 8 capped H100s: heft's gpu:0 282 MiB over) loses least by
    moving the one group whose absence costs least."""
    sim = pl.simulation
    full = [pb.devices.index(s.device) for s in sim.devices if s.peak_memory > s.capacity]
    if len(full) != 1:
        return None
    d, co = full[0], pb.coarse
    fp = footprint(pb)
    gd = {g: pl.device_index[i] for i, g in enumerate(pb.step_group)}
    mine = sorted((g for g in fp if gd[g] == d and g not in fixed and len(co.feasible_idx[g]) > 1),
                  key=lambda g: (-fp[g][0], g))[:ONE_MOVE_CANDIDATES]
    best: tuple[float, dict[int, int]] | None = None
    for g in mine:
        for x in sorted(co.feasible_idx[g] - {d}):
            trial = {**gd, g: x}
            s_ = simulate_table(pb.table, [trial[k] for k in pb.step_group], pb.cluster)
            if s_.valid and (best is None or s_.step_time < best[0]):
                best = (s_.step_time, {g: x})
    if best is None:
        # Where the group then overflows the device it reaches (two devices with little to
        # spare), a swap: a smaller group of that device comes back in exchange.
        for g in mine:
            for x in sorted(co.feasible_idx[g] - {d}):
                theirs = sorted((h for h in fp if gd[h] == x and h not in fixed and d in co.feasible_idx[h]
                                 and fp[h][0] < fp[g][0]), key=lambda h: (-fp[h][0], h))[:ONE_MOVE_CANDIDATES]
                for h in theirs:
                    trial = {**gd, g: x, h: d}
                    s_ = simulate_table(pb.table, [trial[k] for k in pb.step_group], pb.cluster)
                    if s_.valid and (best is None or s_.step_time < best[0]):
                        best = (s_.step_time, {g: x, h: d})
    if best is None:
        return None
    moves = best[1]
    decisions = decisions + [pb.decision(g, x, "moved to fit memory (the move or swap that fits and costs least)")
                             for g, x in moves.items()]
    what = " and ".join(f"{fmt_bytes(fp[g][0])} to {pb.devices[x]}" for g, x in moves.items())
    return finalize(pb, algorithm, {**gd, **moves}, decisions, started,
                    notes + [f"memory: {len(moves)} group(s) moved ({what}) where {pb.devices[d]} overflowed"])


def _overflow_of(sim: SimResult) -> float:
    return float(sum(max(0, s.peak_memory - s.capacity) for s in sim.devices))


def _rejoin(pb: Problem, pl: Placement, algorithm: str, started: float, fixed: frozenset[int]) -> Placement:
    """After the moves: the largest tensors that now cross devices, each tried without its
    crossing (its consumer's group joins its producer's device, or the other way), kept where the
    simulator says the step is faster and every device still fits; passes over the crossings
    (counted again after each) repeat while one helps, within REJOIN_TRIES simulations. A group
    that left for memory often leaves its cheap neighbour behind (a projection moved, its loss
    not: its logits cross twice a step)."""
    t, co = pb.table, pb.coarse
    gd = {g: pl.device_index[i] for i, g in enumerate(pb.step_group)}
    best, best_t = dict(gd), pl.step_time
    tried = 0
    improved = True
    while improved and tried < REJOIN_TRIES:
        improved = False
        crossing: dict[tuple[int, int], int] = {}
        for i, ins in enumerate(t.inputs):
            b = pb.step_group[i]
            for j, p in ins:
                a = pb.step_group[j]
                if best[a] != best[b]:
                    crossing[(a, b)] = crossing.get((a, b), 0) + t.out_bytes[j][p]
        for (a, b), _ in sorted(crossing.items(), key=lambda x: (-x[1], x[0])):
            if tried >= REJOIN_TRIES:
                break
            for g, x in ((b, best[a]), (a, best[b])):
                if best[g] == x or x not in co.feasible_idx[g] or g in fixed:
                    continue
                tried += 1
                trial = {**best, g: x}
                sim = simulate_table(t, [trial[k] for k in pb.step_group], pb.cluster)
                if sim.valid and sim.step_time < best_t:
                    best, best_t, improved = trial, sim.step_time, True
                    break
    if best == gd:
        return pl
    moved = sum(1 for g in gd if gd[g] != best[g])
    notes = pl.notes + [f"memory: {moved} group(s) rejoined a neighbour across a large crossing tensor "
                        f"({pl.step_time * 1e3:.2f} -> {best_t * 1e3:.2f} ms)"]
    decisions = pl.decisions + [pb.decision(g, best[g], "rejoined its neighbour after the memory moves")
                                for g in gd if gd[g] != best[g]]
    return finalize(pb, algorithm, best, decisions, started, notes)


def _fit(pb: Problem, pl: Placement, group_dev: dict[int, int], algorithm: str,
         decisions: list[Decision], started: float, notes: list[str], order: str,
         fixed: frozenset[int] = frozenset()) -> Placement:
    if pl.valid:
        return pl
    fp = footprint(pb)
    first = _forward_position(pb)
    gd = complete(pb, group_dev)
    best, best_over = pl, overflow(pl)
    notes = list(notes)
    for _ in range(ROUNDS):
        sim = best.simulation
        over = {pb.devices.index(s.device): s.peak_memory - s.capacity for s in sim.devices
                if s.peak_memory > s.capacity}
        if not over:
            break
        d = max(over, key=lambda k: over[k])
        free = {pb.devices.index(s.device): float(s.capacity - s.peak_memory) for s in sim.devices}
        movable = [g for g in fp if gd.get(g) == d and len(pb.coarse.feasible_idx[g]) > 1 and g not in fixed]
        if order == "suffix":
            # Forward-pass order, latest first; backward-only groups (-1: a global norm over every
            # gradient, which reads from every stage) last.
            mine = sorted(movable, key=lambda g: (first[g] < 0, -first[g]))
        else:
            mine = sorted(movable, key=lambda g: (-fp[g][0] / max(fp[g][1], 1e-9), g))
        moves = _destinations(pb, mine, d, free, fp, order)
        if not moves:
            break
        k = _fewest(pb, gd, moves, d)
        if order == "suffix":
            k = _fastest_cut(pb, gd, moves, k)
        for g, x in moves[:k]:
            gd[g] = x
            decisions.append(pb.decision(g, x, f"moved off {pb.devices[d]} to fit memory "
                                                f"({fmt_bytes(fp[g][0])} of outputs and state)"))
        moved = sum(fp[g][0] for g, _ in moves[:k])
        notes.append(f"memory: moved {k} group(s), {fmt_bytes(moved)}, off {pb.devices[d]} "
                     f"(over by {fmt_bytes(over[d])})")
        cand = finalize(pb, algorithm, dict(gd), decisions, started, notes)
        o = overflow(cand)
        if o >= best_over and not cand.valid:
            break
        best, best_over = cand, o
        if cand.valid:
            break
    return best


def _forward_position(pb: Problem) -> dict[int, int]:
    """Per group: the step index of its first forward node -- one a fed input reaches and no
    gradient does (-1: none; backward or optimizer work only). Neither merely its first computed
    node (a topological order lists the optimizer's ops that read only state, momentum x
    accumulator, before the first layer) nor its first node without `follows` (gradient
    clipping has none, and comes after the whole forward pass): either would sort a group
    holding a kernel's update to one end, and the cut would not be one."""
    t = pb.table
    fed = [False] * len(t.names)
    backward = [False] * len(t.names)
    first: dict[int, int] = {}
    for i, g in enumerate(pb.step_group):  # topological order: inputs come first
        node = pb.graph.nodes[t.names[i]]
        fed[i] = node.op == "Placeholder" or any(fed[j] for j, _ in t.inputs[i])
        backward[i] = bool(node.follows) or any(backward[j] for j, _ in t.inputs[i])
        first.setdefault(g, -1)
        if first[g] < 0 and fed[i] and t.inputs[i] and not backward[i]:
            first[g] = i
    # A group of state (a kernel, its views, its gradient and update) has no such node: it
    # stands where its first forward reader does, so that a cut takes a layer with its weights.
    out = dict(first)
    for i, g in enumerate(pb.step_group):
        if first[g] < 0 and not backward[i]:
            readers = [first[pb.step_group[c]] for c in t.succ[i] if first[pb.step_group[c]] >= 0]
            if readers and (out[g] < 0 or min(readers) < out[g]):
                out[g] = min(readers)
    return out


def _destinations(pb: Problem, mine: list[int], d: int, free: dict[int, float],
                  fp: dict[int, tuple[float, float]], order: str) -> list[tuple[int, int]]:
    """Where each of `mine` would go, in order: "suffix", all to the device with the most memory
    left that can run them (one stage); "dense", each to the feasible device with the most
    memory left after the groups before it (by their bytes: an estimate the bisection checks)."""
    free = dict(free)
    if order == "suffix":
        others = [x for x in free if x != d]
        if not others:
            return []
        x = max(others, key=lambda k: (free[k], -k))
        return [(g, x) for g in mine if x in pb.coarse.feasible_idx[g]]
    out = []
    for g in mine:
        targets = [x for x in pb.coarse.feasible_idx[g] if x != d]
        if targets:
            # Its bytes overstate what a group holds at the peak (not every output is live at
            # once): where none has room by them, the device with the most left may still do.
            roomy = [x for x in targets if free[x] > fp[g][0]] or targets
            x = max(roomy, key=lambda k: (free[k], -k))
            free[x] -= fp[g][0]
            out.append((g, x))
    return out


def _fewest(pb: Problem, gd: dict[int, int], moves: list[tuple[int, int]], d: int) -> int:
    """The fewest leading `moves` after which device d fits, by bisection on the simulator (all
    of them when none does). Fewer moves keep more of the placer's choice, and fewer transfers."""
    cap = pb.cluster.device(pb.devices[d]).profile.memory

    def fits(k: int) -> bool:
        trial = dict(gd)
        trial.update(moves[:k])
        dev = [trial[g] for g in pb.step_group]
        return simulate_table(pb.table, dev, pb.cluster).devices[d].peak_memory <= cap

    lo, hi = 1, len(moves)
    if not fits(hi):
        return hi
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _fastest_cut(pb: Problem, gd: dict[int, int], moves: list[tuple[int, int]], fewest: int) -> int:
    """Among suffixes of `moves` at least `fewest` long (CUTS_TRIED evenly spaced lengths), the
    one after which the step is fastest with every device fitting; `fewest` where none fits. The
    fewest groups that fit cut where memory first allows, not where the step is fastest
    (Inception-v3 on two capped H100s: the fewest, 290 of 759 groups, 33.0 ms; the best cut
    leaves the stem on the first device, 31.5)."""
    n = len(moves)
    span = n - fewest
    lengths = sorted({fewest + (span * j) // CUTS_TRIED for j in range(CUTS_TRIED + 1)})
    best: tuple[float, int] | None = None
    for k in lengths:
        trial = dict(gd)
        trial.update(moves[:k])
        sim = simulate_table(pb.table, [trial[g] for g in pb.step_group], pb.cluster)
        if sim.valid and (best is None or sim.step_time < best[0]):
            best = (sim.step_time, k)
    return best[1] if best else fewest


def overflow(pl: Placement) -> float:
    """Bytes over capacity, summed over the devices (0: the placement fits)."""
    return _overflow_of(pl.simulation)


__all__ = ["ORDERS", "descend", "fit_memory", "footprint", "overflow", "polish"]
