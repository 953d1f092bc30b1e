"""The §3.1 dataflow executor extended with frames and iteration tags (whitepaper §4.4).

A plan holding Switch/Merge/Enter/Exit/NextIteration runs here (`Plan.run_dataflow` hands over).
Every value carries a tag, (frame instance, iteration): a frame instance is one activation of a
loop (a new one for each iteration of the enclosing frame), and each of its iterations keeps its
own pending counts and values, created when its first value arrives and dropped when it is done.

- Enter passes a value from the parent's tag into iteration 0 of the child frame; a loop-invariant
  Enter (`is_constant`) into every iteration, present and future.
- NextIteration passes a value to the next iteration; at most `parallel_iterations` iterations are
  in flight, later values wait until the oldest iteration is done.
- Exit passes the final iteration's value back to the parent tag.
- Switch sends its input to one output and a *dead* token (kernels.backend.DEAD) to the other. A
  node with a dead input (or a dead control predecessor) does not run: its outputs are dead too.
  Merge fires on its first live input, or dead when every input it can get is dead (a loop's Merge
  gets one input per iteration: the Enter in iteration 0, the NextIteration after). A dead
  NextIteration is dropped, which is how a loop ends; an Exit that never fired alive sends a dead
  token when its frame is done.

An iteration is done when nothing in it is queued or running, no child frame is active, every Enter
of the frame has arrived (iteration 0), and every earlier iteration is done; a frame is done when
its last iteration is. Values are released by reference count within an iteration.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Sequence

from flowctl.engine.errors import ExecutionError
from flowctl.engine.frames import ROOT, assign_frames
from flowctl.engine.graph import parse_ref
from flowctl.engine.ledger import Ledger
from flowctl.kernels.registry import DEAD, check_finite

if TYPE_CHECKING:
    from flowctl.engine.executor import Plan, RunStats
    from flowctl.engine.rendezvous import StepContext

NORMAL, ENTER, EXIT, NEXT, MERGE = range(5)
DEAD_TOLERANT = frozenset({"AccPush"})
# A Send runs even with a dead input, to hand the dead token to its Recv (§4.4 across devices).
ALWAYS_RUN = frozenset({"Send"})
_KINDS = {"Enter": ENTER, "Exit": EXIT, "NextIteration": NEXT, "Merge": MERGE}


class FrameTables:
    """What the frame executor needs of a plan beyond its dataflow tables, computed once."""

    def __init__(self, plan: "Plan") -> None:
        graph = plan.graph
        frames = assign_frames(graph, plan.order)
        index = {n: i for i, n in enumerate(plan.order)}
        nodes = plan.nodes
        self.kind = [_KINDS.get(n.op, NORMAL) for n in nodes]
        self.exec_frame = [frames.exec_frame[n.name] for n in nodes]
        self.child = [n.attrs["frame_name"] if n.op == "Enter" else "" for n in nodes]
        self.constant = [bool(n.op == "Enter" and n.attrs["is_constant"]) for n in nodes]
        # An accumulator push stays alive when its value is dead (a cond's untaken branch inside a
        # loop): the slot keeps the iteration count right, and the gradient that reads it is dead.
        self.dead_if_first = [n.op in DEAD_TOLERANT for n in nodes]
        self.always_run = [n.op in ALWAYS_RUN for n in nodes]
        self.parallel = dict(frames.parallel)
        self.enters: dict[str, int] = {}
        self.exits: dict[str, list[int]] = {}
        for i, n in enumerate(nodes):
            if n.op == "Enter":
                self.enters[n.attrs["frame_name"]] = self.enters.get(n.attrs["frame_name"], 0) + 1
            elif n.op == "Exit":
                self.exits.setdefault(n.attrs["frame_name"], []).append(i)
        # Successors that count down a pending count, and Merge inputs: (merge, position, port).
        self.succ: list[list[int]] = [[c for c in plan.succ[i] if self.kind[c] != MERGE] for i in range(len(nodes))]
        self.merge_succ: list[list[tuple[int, int, int]]] = [[] for _ in nodes]
        # Control successors: a dead node makes them dead (data successors see its dead values).
        self.ctrl_succ: list[list[int]] = [[] for _ in nodes]
        for c, n in enumerate(nodes):
            for p in n.control_inputs:
                if p in index:
                    self.ctrl_succ[index[p]].append(c)
        self.merge_need = [0] * len(nodes)
        fed = set(plan.feeds)
        for c, n in enumerate(nodes):
            if n.op != "Merge":
                continue
            back = [graph.is_back_edge(n, r) for r in n.inputs]
            self.merge_need[c] = 1 if any(back) else len(n.inputs)  # a loop's Merge: one per iteration
            for pos, r in enumerate(n.inputs):
                if r in fed:
                    raise ExecutionError(f"Merge '{n.name}' input '{r}' is fed: feed a loop's initial "
                                         f"value instead", node=n.name, op=n.op, device=plan.device)
                src, port = parse_ref(r)
                self.merge_succ[index[src]].append((c, pos, port))
        # Only non-Merge readers hold a value in an iteration's table (Merge takes it as it arrives).
        self.uses = [0] * plan.num_slots
        for i, ins in enumerate(plan.in_slots):
            if self.kind[i] != MERGE:
                for s in ins:
                    self.uses[s] += 1
        for ref in plan.fetches:
            node = parse_ref(ref)[0]
            if ref not in fed and frames.out_frame.get(node, ROOT) != ROOT:
                raise ExecutionError(f"cannot fetch '{ref}': it lives inside loop frame "
                                     f"'{frames.out_frame[node]}' (fetch the loop's results, its Exits)",
                                     node=node, device=plan.device)
        self.root_nodes = sum(1 for f in self.exec_frame if f == ROOT)


class _Iteration:
    __slots__ = ("pending", "values", "uses", "dead", "merge_in", "merge_dead", "merged", "outstanding",
                 "children")

    def __init__(self) -> None:
        self.pending: dict[int, int] = {}
        self.values: dict[int, Any] = {}
        self.uses: dict[int, int] = {}
        self.dead: set[int] = set()  # nodes with a dead control predecessor
        self.merge_in: dict[int, tuple[Any, int]] = {}
        self.merge_dead: dict[int, int] = {}
        self.merged: set[int] = set()
        self.outstanding = 0  # nodes of this iteration queued or running
        self.children = 0  # child frame instances still active


class _Frame:
    """One activation of a frame: its live iterations, its invariants and its held iterations."""

    def __init__(self, name: str, parent: "_Frame | None", parent_iter: int, limit: int, enters: int) -> None:
        self.name = name
        self.parent = parent
        self.parent_iter = parent_iter
        self.path: str = name if parent is None or parent.parent is None else f"{parent.path}:{parent_iter}/{name}"
        self.limit = max(1, limit)
        self.pending_enters = enters
        self.iters: dict[int, _Iteration] = {}
        self.oldest = 0
        self.invariants: list[tuple[int, tuple[Any, ...], bool]] = []
        self.held: deque[tuple[int, int, tuple[Any, ...]]] = deque()
        self.children: dict[tuple[str, int], _Frame] = {}
        self.live_exits: set[int] = set()


class FrameStep:
    """One step of a plan with control flow: the ready queue of tagged nodes and the frame tree."""

    def __init__(self, plan: "Plan", tables: FrameTables, check_numerics: bool,
                 step: "StepContext | None", timed: bool) -> None:
        self.plan = plan
        self.t = tables
        self.check = check_numerics
        self.step = step
        self.timed = timed
        self.root = _Frame(ROOT, None, 0, 1, 0)
        self.root.iters[0] = _Iteration()
        self.ready: deque[tuple[int, _Frame, int]] = deque()
        self.completed: deque[tuple[int, _Frame, int, Any, BaseException | None]] = deque()
        self.cond = threading.Condition()
        self.outstanding_async = 0
        self.ran: list[str] = []
        self.root_ran = 0
        self.ledger = Ledger() if timed else None  # memory accounting, for RunStats
        self.idle = 0.0  # timed steps: seconds spent waiting with nothing ready
        self.starts: list[tuple[str, float]] = []
        self.finishes: list[tuple[str, float]] = []
        self.keep = set(plan.fetch_slots) | set(range(len(plan.feeds)))

    # ------------------------------------------------------------------ the loop
    def run(self, feeds: Sequence[Any]) -> list[Any]:
        it0 = self.root.iters[0]
        for s, v in enumerate(feeds):
            it0.values[s] = v
            it0.uses[s] = self.t.uses[s]
            if self.ledger is not None:
                self.ledger.resident(v)
        for i, p in enumerate(self.plan.pending0):
            if p == 0 and self.t.kind[i] != MERGE:
                self._queue(i, self.root, 0)
        while True:
            if self.completed:
                i, f, k, out, err = self.completed.popleft()
                self.outstanding_async -= 1
                if err is not None:
                    raise self.plan._error(err, i) from err
                self._finish(i, f, k, out, dead=out is DEAD)  # a Recv of a dead token
            elif self.ready:
                self._execute(*self.ready.popleft())
            elif self.outstanding_async:
                t = time.perf_counter() if self.timed else 0.0
                with self.cond:
                    while not self.completed:
                        self.cond.wait()
                if self.timed:
                    self.idle += time.perf_counter() - t
            else:
                break
        return self._results()

    def _queue(self, i: int, f: _Frame, k: int) -> None:
        f.iters[k].outstanding += 1
        if self.plan.is_async[i]:
            self.ready.appendleft((i, f, k))  # a transfer leaves ahead of queued compute (§5.3)
        else:
            self.ready.append((i, f, k))

    def _execute(self, i: int, f: _Frame, k: int) -> None:
        plan = self.plan
        it = f.iters[k]
        if self.timed:
            self.starts.append((plan.order[i], time.perf_counter()))
        if self.t.kind[i] == MERGE:
            value, pos = it.merge_in.pop(i)
            dead = value is DEAD
            out = None if dead else plan.kernels[i](value, pos)
            self._finish(i, f, k, out, dead)
            return
        ins = [it.values[s] for s in plan.in_slots[i]]
        self._release(it, plan.in_slots[i])
        if self.t.always_run[i]:
            dead = False
        elif self.t.dead_if_first[i]:
            dead = i in it.dead or ins[0] is DEAD
        else:
            dead = i in it.dead or any(x is DEAD for x in ins)
        if dead:
            self._finish(i, f, k, None, dead=True)
        elif plan.is_async[i]:
            self.outstanding_async += 1
            plan._start_async(i, self._context(f, k), tuple(ins), _Tagged(self, f, k), self.cond)
        else:
            try:
                out = plan.kernels[i](*ins)
            except Exception as e:  # noqa: BLE001 -- reported with its node
                raise plan._error(e, i) from e
            self._finish(i, f, k, out, dead=False)

    def _context(self, f: _Frame, k: int) -> "StepContext | None":
        if self.step is None or f is self.root:
            return self.step
        from flowctl.engine.rendezvous import StepContext

        # §4.4: the rendezvous key names the frame instance and iteration, so each iteration's
        # transfer meets its own Recv.
        return StepContext(self.step.step_id, self.step.rendezvous, f.path, k)

    # ------------------------------------------------------------------ routing values by tag
    def _finish(self, i: int, f: _Frame, k: int, out: Any, dead: bool) -> None:
        """Node i ran (or was dead) at tag (f, k): route its outputs, then see whether (f, k) is done."""
        plan = self.plan
        n_out = len(plan.out_slots[i])
        if dead:
            outs: tuple[Any, ...] = (DEAD,) * n_out
        else:
            outs = (out,) if n_out == 1 else tuple(out or ())
            if self.timed:
                self.finishes.append((plan.order[i], time.perf_counter()))
            if self.check:
                self._check(i, outs)
            self.ran.append(plan.order[i])  # a dead node is accounted as done, not as run
        if f is self.root:
            self.root_ran += 1
        kind = self.t.kind[i]
        if kind == ENTER:
            self._enter(i, f, k, outs, dead)
        elif kind == EXIT:
            if not dead:
                f.live_exits.add(i)
                self._deliver(i, outs, f.parent, f.parent_iter, False)  # type: ignore[arg-type]
        elif kind == NEXT:
            if not dead:  # a dead NextIteration is how a loop ends: no next iteration
                self._next_iteration(i, f, k + 1, outs)
        else:
            self._deliver(i, outs, f, k, dead)
        f.iters[k].outstanding -= 1
        self._advance(f)

    def _check(self, i: int, outs: tuple[Any, ...]) -> None:

        try:
            for v, is_f in zip(outs, self.plan.float_out[i]):
                if is_f and v is not DEAD:
                    check_finite(v)
        except Exception as e:  # noqa: BLE001
            raise self.plan._error(e, i) from e

    def _enter(self, i: int, f: _Frame, k: int, outs: tuple[Any, ...], dead: bool) -> None:
        name = self.t.child[i]
        child = f.children.get((name, k))
        if child is None:
            child = _Frame(name, f, k, self.t.parallel.get(name, 1), self.t.enters.get(name, 0))
            f.children[(name, k)] = child
            f.iters[k].children += 1
            child.iters[0] = _Iteration()
        child.pending_enters -= 1
        if self.t.constant[i]:
            child.invariants.append((i, outs, dead))
            for kk in list(child.iters):
                self._deliver(i, outs, child, kk, dead)
        else:
            self._deliver(i, outs, child, 0, dead)
        self._advance(child)

    def _next_iteration(self, i: int, f: _Frame, k: int, outs: tuple[Any, ...]) -> None:
        if k not in f.iters:
            if k >= f.oldest + f.limit:
                f.held.append((k, i, outs))  # parallel_iterations reached: wait for the oldest
                return
            self._new_iteration(f, k)
        self._deliver(i, outs, f, k, False)

    def _new_iteration(self, f: _Frame, k: int) -> None:
        f.iters[k] = _Iteration()
        for j, outs, dead in f.invariants:
            self._deliver(j, outs, f, k, dead)

    def _deliver(self, i: int, outs: tuple[Any, ...], f: _Frame, k: int, dead: bool) -> None:
        """Outputs of node i arrive at tag (f, k): store them, count down consumers, feed Merges."""
        plan = self.plan
        it = f.iters[k]
        led = self.ledger
        for s, v in zip(plan.out_slots[i], outs):
            uses = self.t.uses[s]
            stored = bool(uses) or s in self.keep
            if stored:
                it.values[s] = v
                it.uses[s] = uses
            if led is not None and v is not DEAD:
                if s not in plan.counted:
                    led.resident(v)
                else:
                    led.acquire(v)
                    if not stored:  # nobody reads it: dropped at once
                        led.release(v)
        pending0 = plan.pending0
        if dead:
            it.dead.update(self.t.ctrl_succ[i])
        for c in self.t.succ[i]:
            p = it.pending.get(c, pending0[c]) - 1
            if p == 0:
                it.pending.pop(c, None)
                self._queue(c, f, k)
            else:
                it.pending[c] = p
        for c, pos, port in self.t.merge_succ[i]:
            if c in it.merged:
                continue
            v = outs[port]
            if v is DEAD:
                it.merge_dead[c] = it.merge_dead.get(c, 0) + 1
                if it.merge_dead[c] < self.t.merge_need[c]:
                    continue
            it.merged.add(c)
            it.merge_in[c] = (v, pos)
            self._queue(c, f, k)

    def _release(self, it: _Iteration, slots: list[int]) -> None:
        for s in slots:
            left = it.uses[s] - 1
            if left == 0 and s not in self.keep:
                v = it.values.pop(s)
                del it.uses[s]
                if v is not DEAD and s in self.plan.counted and self.ledger is not None:
                    self.ledger.release(v)  # §3.1: the buffer goes once its last reader ran
            else:
                it.uses[s] = left

    # ------------------------------------------------------------------ iterations and frames ending
    def _advance(self, f: _Frame) -> None:
        """Retire f's finished iterations oldest first, admit held ones, and end f when all are done."""
        if f is self.root:
            return
        while True:
            it = f.iters.get(f.oldest)
            if it is None:
                break
            if it.outstanding or it.children or (f.oldest == 0 and f.pending_enters):
                return
            self._drop_values(it)
            del f.iters[f.oldest]
            f.oldest += 1
            while f.held and f.held[0][0] < f.oldest + f.limit:
                k, i, outs = f.held.popleft()
                if k not in f.iters:
                    self._new_iteration(f, k)
                self._deliver(i, outs, f, k, False)
        if not f.held:
            self._end_frame(f)

    def _end_frame(self, f: _Frame) -> None:
        parent = f.parent
        assert parent is not None
        for e in self.t.exits.get(f.name, ()):
            if e not in f.live_exits:  # the loop never ran alive (it sat on an untaken branch)
                self._deliver(e, (DEAD,), parent, f.parent_iter, True)
        del parent.children[(f.name, f.parent_iter)]
        parent.iters[f.parent_iter].children -= 1
        self._advance(parent)

    def _drop_values(self, it: _Iteration) -> None:
        for s, v in it.values.items():
            if v is not DEAD and s in self.plan.counted and self.ledger is not None:
                self.ledger.release(v)
        it.values.clear()

    def _results(self) -> list[Any]:
        plan = self.plan
        if self.root.children or self.root_ran != self.t.root_nodes:
            active = ", ".join(sorted(f"'{name}'" for name, _ in self.root.children)) or "none"
            raise ExecutionError(f"step on {plan.device} stopped with work left: {self.t.root_nodes - self.root_ran} "
                                 f"node(s) of the root frame never ready, loop frame(s) still active: {active}",
                                 device=plan.device)
        values = self.root.iters[0].values
        out = []
        for ref, s in zip(plan.fetches, plan.fetch_slots):
            v = values.get(s)
            if v is DEAD:
                raise ExecutionError(f"fetched tensor '{ref}' is dead: it lies on a branch that did not run",
                                     node=parse_ref(ref)[0], device=plan.device)
            out.append(v)
        return out

    def fill(self, stats: "RunStats") -> None:
        stats.nodes_run = self.ran
        stats.peak_bytes = self.ledger.peak if self.ledger is not None else 0
        stats.starts = self.starts
        stats.finishes = self.finishes
        stats.idle_s = self.idle


class _Tagged:
    """The completion queue as an async kernel sees it: results come back with their tag."""

    def __init__(self, run: FrameStep, f: _Frame, k: int) -> None:
        self.run, self.f, self.k = run, f, k

    def append(self, item: tuple[int, Any, BaseException | None]) -> None:
        i, out, err = item
        self.run.completed.append((i, self.f, self.k, out, err))


def run_frames(plan: "Plan", feeds: Sequence[Any], stats: "RunStats | None", check_numerics: bool,
               step: "StepContext | None") -> list[Any]:
    tables = plan.frame_tables
    assert tables is not None
    run = FrameStep(plan, tables, check_numerics, step, stats is not None)
    out = run.run(feeds)
    if stats is not None:
        run.fill(stats)
    return out
