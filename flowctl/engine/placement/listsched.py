"""List-scheduling placers: the whitepaper's greedy (§3.2.1) and HEFT.

Both walk the step's nodes while simulating every device, and decide a group's device when they
reach the group's first node: each feasible device is tried, its estimated finish time computed
from the device's free time, the arrival of every input (a transfer over the link when the input
lives elsewhere, one per tensor and device as in the partition), and the op's cost there; the
device where it would finish soonest wins (plus, to compare unlike devices fairly, the work the
rest of the group would then do there). Later members of the group go where it went.

They differ in the walk. `greedy` takes nodes in order of their estimated ready time, which is
"simulates the activity on each device as it progresses" (§3.2.1). `heft` takes them by upward
rank (the longest cost path to the end of the step, Topcuoglu et al. 2002), so the critical path
is placed first; it wins where greedy fills devices with short off-path work early.

Sources that compute nothing (Variables, Consts, Placeholders), and ops on parameters alone (an
LSTM's slice of its kernel), are not decided on their own: a variable's device is best decided by
whoever brings it activations, so they are deferred to their first such consumer (which counts
them as local). Without this, a layer's weights go wherever a weight-only op happened to find an
idle device at time zero, and drag the layer with them.

Memory: each device's resident state plus live tensors is tracked as the walk goes; a device that
would overflow is not a candidate. The simulator checks the result, and the placer retries with
the offending device's budget lowered when it still overflows; if the walks still overflow,
memfit.py moves groups off the overflowing device to where memory is free.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from flowctl.engine.placement.explain import Candidate, Decision, Placement
from flowctl.engine.placement.memfit import fit_memory, polish
from flowctl.engine.placement.problem import Problem, finalize
from flowctl.engine.placement.simulator import fmt_bytes

RETRIES = 2


def place_greedy(pb: Problem, priority: str = "ready") -> Placement:
    started = time.perf_counter()
    caps = [float(pb.cluster.device(d).profile.memory) for d in pb.devices]
    notes: list[str] = []
    walks: list[tuple[Placement, dict[int, int], list[Decision]]] = []
    name = "greedy" if priority == "ready" else "heft"
    for attempt in range(RETRIES + 1):
        group_dev, decisions = list_schedule(pb, priority, caps)
        pl = finalize(pb, name, group_dev, decisions, started, list(notes))
        if pl.valid and attempt == 0:
            return pl
        walks.append((pl, group_dev, decisions))
        if pl.valid:
            break
        if attempt == RETRIES:
            break
        # The walk's memory estimate falls short of the simulated peak (tensors live longer in
        # the real schedule than the walk assumes): scale each overflowing device's budget by how
        # far short it fell, with a margin, so the next walk moves work to where memory is free.
        for s in pl.simulation.devices:
            if s.peak_memory > s.capacity:
                d = pb.devices.index(s.device)
                caps[d] *= 0.95 * s.capacity / s.peak_memory
                notes.append(f"retry {attempt + 1}: {s.device} overflowed by "
                             f"{fmt_bytes(s.peak_memory - s.capacity)}; its budget lowered to {fmt_bytes(caps[d])}")
    # The first walk overflowed: each walk is repaired by memfit (a valid retry stays as it is)
    # and the fastest that fits wins. The lowered budgets distort a walk (lstm_lm on two capped
    # H100s: heft's third walk, repaired, 6.3 ms; its first, 4.0; Inception on two capped K40s:
    # greedy's valid retry 311 ms), so the first walk is repaired too, and the walk without any
    # budget: the placer's own choice, moved only as far as memory demands.
    group_dev, decisions = list_schedule(pb, priority, [float("inf")] * len(pb.devices))
    free = finalize(pb, name, group_dev, decisions, started, ["the walk without memory budgets, then fitted"])
    walks.append((free, group_dev, decisions))
    fits = [fit_memory(pb, pl, gd, name, list(dec), started, list(pl.notes), search=False) for pl, gd, dec in walks]
    valid = [x for x in fits if x.valid]
    if valid:
        best = min(valid, key=lambda x: x.step_time)
    else:
        best = min(fits, key=lambda x: sum(max(0, s.peak_memory - s.capacity) for s in x.simulation.devices))
    return polish(pb, best, name, started, origin=free)


def place_heft(pb: Problem) -> Placement:
    return place_greedy(pb, priority="rank")


def upward_rank(pb: Problem) -> list[float]:
    """HEFT's rank: mean op time over the feasible devices plus the longest path (with mean
    transfer times) to a sink."""
    t = pb.table
    n, D = len(t.names), len(pb.devices)
    if D > 1:
        pairs = [(a, b) for a in range(D) for b in range(D) if a != b]
        lat = sum(t.transfer(0, a, b) for a, b in pairs) / len(pairs)
        per_byte = sum(t.transfer(1 << 30, a, b) - t.transfer(0, a, b) for a, b in pairs) / len(pairs) / (1 << 30)
    else:
        lat = per_byte = 0.0
    feas = pb.coarse.feasible_idx
    w = []
    for i in range(n):
        fs = feas[pb.step_group[i]]
        w.append(sum(t.times[i][d] for d in fs) / len(fs))
    rank = [0.0] * n
    for i in range(n - 1, -1, -1):
        best = 0.0
        for s in t.succ[i]:
            nbytes = sum(t.out_bytes[i][p] for j, p in t.inputs[s] if j == i)
            c = (lat + nbytes * per_byte) * t.runs(i)
            if c + rank[s] > best:
                best = c + rank[s]
        rank[i] = w[i] + best
    return rank


def list_schedule(pb: Problem, priority: str, caps: list[float]) -> tuple[dict[int, int], list[Decision]]:
    """A device per group and the decisions that chose them: the walk of the module docstring,
    by estimated ready time (`priority="ready"`, greedy) or upward rank (`"rank"`, HEFT), within
    each device's memory budget `caps`."""
    walk = _Walk(pb, priority, caps)
    walk.run()
    walk.decide_unpulled()
    return walk.group_dev, walk.decisions


def _group_work(pb: Problem) -> tuple[dict[int, list[float]], dict[int, int]]:
    """Each group's work on each device (its remaining work, as the walk goes), and its resident
    bytes (for memory checks)."""
    t = pb.table
    D = len(pb.devices)
    left: dict[int, list[float]] = {}
    gres: dict[int, int] = {}
    for i, g in enumerate(pb.step_group):
        row = left.setdefault(g, [0.0] * D)
        for d in range(D):
            row[d] += t.times[i][d]
        if t.resident[i]:
            gres[g] = gres.get(g, 0) + sum(t.out_bytes[i])
    return left, gres


def _group_edges(pb: Problem) -> dict[int, list[tuple[int, int, int]]]:
    """Cross-group edges per group, one per (tensor, consuming group): the transfers a decision
    commits the group to once its neighbours are placed (the whitepaper's greedy sees only the
    node's own inputs; without this an LSTM cell's tiny gate ops ping-pong between devices to
    win microseconds and pay with every weight gradient crossing a link)."""
    grp = pb.step_group
    gedges: dict[int, list[tuple[int, int, int]]] = {}
    seen_edge: set[tuple[int, int, int]] = set()
    for i, ins in enumerate(pb.table.inputs):
        gi = grp[i]
        for j, p in ins:
            gj = grp[j]
            if gj != gi and (j, p, gi) not in seen_edge:
                seen_edge.add((j, p, gi))
                gedges.setdefault(gi, []).append((j, p, i))
                gedges.setdefault(gj, []).append((j, p, i))
    return gedges


class _Walk:
    """The state of one list-scheduling walk: every device simulated as nodes are committed to
    it, and the groups decided so far."""

    def __init__(self, pb: Problem, priority: str, caps: list[float]) -> None:
        t = pb.table
        n, D = len(t.names), len(pb.devices)
        self.pb, self.t, self.n, self.caps = pb, t, n, caps
        self.grp = pb.step_group
        self.feas = {g: sorted(s) for g, s in pb.coarse.feasible_idx.items()}
        self.left, self.gres = _group_work(pb)
        self.rank = upward_rank(pb) if priority == "rank" else None
        self.gedges = _group_edges(pb)
        self.group_dev: dict[int, int] = {}
        self.decisions: list[Decision] = []
        self.devn = [-2] * n  # device index; -1: deferred (see the module docstring); -2: not yet reached
        self.finish = [0.0] * n
        self.dev_free = [0.0] * D
        self.link_free: dict[tuple[int, int], float] = {}
        self.arrival: dict[tuple[int, int, int], float] = {}
        self.deferred: dict[int, list[int]] = {}  # group -> its deferred nodes, in walk order
        self.mem = [0.0] * D
        self.users_left = [len(t.succ[i]) for i in range(n)]
        self.received: dict[int, list[int]] = {}  # node -> devices holding a copy of its outputs
        self.param = [False] * n  # deferred and computed from parameters alone (not from fed inputs)
        self.placeholders = {name for name in t.names if pb.graph.nodes[name].op == "Placeholder"}

    def settle(self, g: int, d: int) -> None:
        """Group g is decided: its deferred nodes now live on d (their own deferred inputs are
        pulled along first), ready as soon as their inputs are."""
        inputs, controls, devn, finish = self.t.inputs, self.t.controls, self.devn, self.finish
        self.group_dev[g] = d
        self.mem[d] += self.gres.get(g, 0)
        for j in self.deferred.pop(g, []):
            ready = 0.0
            for k in [k for k, _ in inputs[j]] + controls[j]:
                if devn[k] == -1:
                    self.pull(k, d, j)
                ready = max(ready, finish[k])
            devn[j] = d
            finish[j] = ready + self.t.times[j][d]

    def pull(self, j: int, d: int, reader: int) -> None:
        """A deferred node j is read by `reader` on d: settle j's group there (or on its first
        feasible device when it cannot run on d)."""
        g = self.grp[j]
        if g in self.group_dev:
            return
        self.settle(g, d if d in self.pb.coarse.feasible_idx[g] else self.feas[g][0])
        self.decisions.append(self.pb.decision(g, self.group_dev[g], f"read first by '{self.t.names[reader]}'",
                                               self.t.names[j]))

    def arrive(self, j: int, p: int, d: int, commit: bool) -> float:
        """When output `p` of node j (-1: its control token) is available on d; `commit` books the
        transfer (link time, arrival, memory on d)."""
        t = self.t
        dj = self.devn[j]
        if dj == -1:  # a deferred source: local wherever its group may go, else from its first device
            g = self.grp[j]
            if d in self.pb.coarse.feasible_idx[g]:
                return t.times[j][d]
            dj = self.feas[g][0]
            ready = t.times[j][dj]
        else:
            ready = self.finish[j]
            if dj == d:
                return ready
        key = (j, p, d)
        got = self.arrival.get(key)
        if got is not None:
            return got
        lk = (dj, d)
        nbytes = t.out_bytes[j][p] if p >= 0 else 0
        end = max(ready, self.link_free.get(lk, 0.0)) + t.crossing(j, p, dj, d)
        if commit:
            self.link_free[lk] = end
            self.arrival[key] = end
            if p >= 0:
                self.mem[d] += nbytes
                self.received.setdefault(j, []).append(d)
        return end

    def est(self, i: int, d: int) -> float:
        """Node i's estimated finish on d."""
        s = self.dev_free[d]
        for j, p in self.t.inputs[i]:
            a = self.arrive(j, p, d, False)
            if a > s:
                s = a
        for j in self.t.controls[i]:
            a = self.arrive(j, -1, d, False)
            if a > s:
                s = a
        return s + self.t.times[i][d]

    def comm(self, i: int, d: int) -> float:
        """Transfers group(i) on d would need to and from neighbours already placed elsewhere,
        beyond node i's own inputs (which `est` counts as arrival times)."""
        grp, t = self.grp, self.t
        g = grp[i]
        total = 0.0
        for j, p, c in self.gedges.get(g, ()):
            if c == i:
                continue
            other = grp[c] if grp[j] == g else grp[j]  # edges cross groups: one end is g
            od = self.group_dev.get(other)
            if od is not None and od != d:
                total += t.crossing(j, p, od, d)
        return total

    def extra_bytes(self, i: int, d: int) -> float:
        """The memory node i would add on d: its outputs, its group's resident state if not yet
        placed, and inputs received there."""
        t, grp, devn, gres = self.t, self.grp, self.devn, self.gres
        b = 0.0 if t.resident[i] else float(sum(t.held[i]))  # a view adds nothing
        if grp[i] not in self.group_dev:
            b += gres.get(grp[i], 0)
        for j, p in t.inputs[i]:
            if devn[j] >= 0 and devn[j] != d and (j, p, d) not in self.arrival:
                b += t.out_bytes[j][p]
            elif devn[j] == -1 and grp[j] not in self.group_dev:
                b += gres.get(grp[j], 0)
        return b

    def commit(self, i: int, d: int) -> None:
        """Run node i on d: book its inputs' transfers, the device's time and the memory, and free
        inputs whose last user this was."""
        t, devn, mem = self.t, self.devn, self.mem
        inputs, controls, out_bytes, held = t.inputs, t.controls, t.out_bytes, t.held
        # Inputs first: deferred nodes read here settle here (or on their only devices).
        for j in [j for j, _ in inputs[i]] + controls[i]:
            if devn[j] == -1:
                self.pull(j, d, i)
        s = self.dev_free[d]
        for j, p in inputs[i]:
            s = max(s, self.arrive(j, p, d, True))
        for j in controls[i]:
            s = max(s, self.arrive(j, -1, d, True))
        f = s + t.times[i][d]
        self.finish[i] = f
        self.dev_free[d] = f
        devn[i] = d
        self.left[self.grp[i]][d] -= t.times[i][d]
        if not t.resident[i]:
            mem[d] += sum(held[i])
        for j in dict.fromkeys([j for j, _ in inputs[i]] + controls[i]):
            self.users_left[j] -= 1
            if self.users_left[j] == 0 and not t.resident[j] and devn[j] >= 0:
                mem[devn[j]] -= sum(held[j])
                b = sum(out_bytes[j])  # what crossed is a copy, a view's too
                for r in self.received.pop(j, []):
                    mem[r] -= b

    def choose(self, i: int, fs: list[int]) -> int:
        return choose(self.pb, i, fs, self.est, self.comm, self.extra_bytes, self.left, self.t.times, self.mem,
                      self.caps, self.decisions)

    def run(self) -> None:
        """The walk. Pending counts over unique predecessors; the heap holds ready nodes."""
        t, n, rank = self.t, self.n, self.rank
        inputs, controls, succ = t.inputs, t.controls, t.succ
        pending = [len(set([j for j, _ in inputs[i]] + controls[i])) for i in range(n)]
        heap: list[tuple[float, int]] = []
        for i in range(n):
            if pending[i] == 0:
                heap.append((-rank[i] if rank is not None else 0.0, i))
        heapq.heapify(heap)
        while heap:
            _, i = heapq.heappop(heap)
            g = self.grp[i]
            if g not in self.group_dev:
                self.decide(i, g)
            if self.devn[i] != -1:
                self.commit(i, self.group_dev[g])
            for c in succ[i]:
                pending[c] -= 1
                if pending[c] == 0:
                    heapq.heappush(heap, (self.priority(c), c))

    def decide(self, i: int, g: int) -> None:
        """Node i is the first reached of its undecided group g: defer it, or choose g's device."""
        t = self.t
        fs = self.feas[g]
        preds = [j for j, _ in t.inputs[i]] + t.controls[i]
        if len(fs) > 1 and ((t.resident[i] and not preds) or
                            (preds and all(self.param[j] and self.devn[j] == -1 for j in preds))):
            # A Variable, Const or Placeholder, or an op on parameters alone (a slice of a
            # kernel): decided by the first consumer that brings activations.
            self.devn[i] = -1
            self.param[i] = bool(preds) or t.names[i] not in self.placeholders  # fed data is not a parameter
            self.deferred.setdefault(g, []).append(i)
        else:
            self.settle(g, self.choose(i, fs))

    def priority(self, c: int) -> float:
        """The heap key of a node that just became ready: minus its upward rank (HEFT), or its
        estimated ready time (greedy)."""
        if self.rank is not None:
            return -self.rank[c]
        key = 0.0
        for j, _ in self.t.inputs[c]:
            key = max(key, self.finish[j])
        for j in self.t.controls[c]:
            key = max(key, self.finish[j])
        return key

    def decide_unpulled(self) -> None:
        """Deferred nodes no consumer pulled (work on parameters alone, all the way to a sink) are
        decided now, the ordinary way, in topological order."""
        for i in range(self.n):
            if self.devn[i] != -1:
                continue
            g = self.grp[i]
            if g not in self.group_dev:
                d = self.choose(i, self.feas[g])
                self.group_dev[g] = d
                self.mem[d] += self.gres.get(g, 0)
                self.deferred.pop(g, None)
            self.commit(i, self.group_dev[g])


def choose(pb: Problem, i: int, fs: list[int], est: Callable[[int, int], float], comm: Callable[[int, int], float],
           extra_bytes: Callable[[int, int], float], left: dict[int, list[float]], times: list[list[float]],
           mem: list[float], caps: list[float], decisions: list[Decision]) -> int:
    """§3.2.1: the feasible device where node i would finish soonest, plus the group's remaining
    work there and the transfers it would need to neighbours already placed elsewhere (each
    Candidate's `score`, the number compared; `finish` is node i's own estimated finish); devices
    that would overflow their memory are not candidates (their `note` says so)."""
    g = pb.step_group[i]
    cands: list[Candidate] = []
    best, best_score = -1, float("inf")
    fallback, fallback_over = fs[0], float("inf")
    for d in fs:
        f = est(i, d)
        c_ = comm(i, d)
        score = f + left[g][d] - times[i][d] + c_
        over = mem[d] + extra_bytes(i, d) - caps[d]
        c = Candidate(pb.devices[d], f, score, c_)
        if over > 0:
            c.note = f"memory: would exceed its budget by {fmt_bytes(over)}"
            if over < fallback_over:
                fallback, fallback_over = d, over
        elif score < best_score:
            best, best_score = d, score
        cands.append(c)
    reason = "earliest estimated group finish"
    if best < 0:
        best = fallback
        reason = "every device over its memory budget: the least over"
    elif len(fs) == 1:
        reason = pb.sole_device(g, pb.table.names[i])
    dec = pb.decision(g, best, reason, pb.table.names[i])
    dec.candidates = cands
    decisions.append(dec)
    return best
