"""A GPU plan's step captured as one CUDA graph (issue 30).

A `Plan` on one GPU compiles to straight-line Python that launches one or a few kernels per node
(`executor.Plan.run`). Launched from Python each costs 16-18 us (measured, H200), far more than the
kernels of a small step; replayed from a captured graph about 1-2 us, and no Python runs at all.
`CapturedStep` runs a plan that way:

1. **Warm-up** (the plan's first two steps): run eagerly on the plan's own stream, inside a memory
   pool private to this step. Kernels compile, library handles and cuDNN plans are made, the pool
   grows to what the step needs. The feeds are copied into static device buffers first, and the
   step reads those. The second step checks that every variable keeps its array (each update
   writes in place); where one does not, the plan is not captured.
2. **Capture** (the third step): the same Python step runs under stream capture; nothing executes,
   every launch is recorded. The pool, warmed by the same allocation sequence, serves the capture
   from blocks it already holds; the arrays the step returns are its static outputs. The graph is
   then launched once for this step.
3. **Replay** (every later step): copy the feeds into the static buffers, launch the graph, hand back
   the static outputs (the caller reads them before the next step).

A step's fetched values and its guard flags can also come back *late* (`run(late=True)`, issue 30:
no host synchronisation in the step): copies to host buffers are queued on the step's stream after
it (the backend's `read_async`), and a `LateRead` waits for them only when the host asks, by which
time the trainer has launched the next step. The guard of the loss is sticky: once a step trips
it, every later step skips its updates until the host reads the flag and resets it, so a host
that learns of a non-finite step one step late still sees the state from before it.

What a replay relies on, and how it is kept:
- *State at fixed addresses.* Variables update in place on a GPU (kernels/state.py); a capture after
  which some variable's array is not the one it had is refused. A variable given a new array between
  steps (a restored checkpoint) is copied into the captured array before the next replay, which is
  then put back in its slot.
- *No host in the step.* cupy raises on host copies, synchronisations and its own cuBLAS calls
  inside a capture; a kernel that must read a device value to the host (CheckNumerics of the
  step's guard) writes a device flag instead (`StepGuard`), updates skip themselves where it is 0,
  and the host reads it after the step, or one step late (`NonFiniteError` from the guard's node,
  as an uncaptured step raises it).
- *Random numbers on the device.* A random op draws from a counter-based generator keyed by
  (seed, element), its draw number in a device cell that the graph itself advances
  (`RngState.device_counter`); the host keeps a mirror, advanced per replay by what the captured
  step advanced it by, so a checkpoint reads no device memory.
Refusals are decided once, with the reason recorded (`CapturedStep.reason`); the step then runs
eagerly as before. A step with asynchronous kernels (Send/Recv, queues) or control flow frames is
not captured (`refusal`).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import weakref

import numpy as np

from flowctl.engine.errors import ExecutionError, NonFiniteError
from flowctl.kernels.registry import to_host

# Steps of different feed shapes captured per plan (an evaluation batch, a last partial batch).
MAX_SHAPES = 4


def refusal(plan: Any) -> str | None:
    """Why `plan` can never be captured, or None."""
    if plan.has_async:
        ops = sorted({n.op for n, a in zip(plan.nodes, plan.is_async) if a})
        return f"asynchronous kernels ({', '.join(ops)})"
    if plan.frame_tables is not None:
        return "control flow (a loop or a conditional: the host decides which kernels run)"
    return None


class _Shape:
    """One feed-shape signature's static buffers and graph."""

    __slots__ = ("static", "graph", "outputs", "slots", "advance", "runs", "nodes")

    def __init__(self, static: list[Any]) -> None:
        self.static = static
        self.graph: Any = None
        self.outputs: list[Any] = []
        self.slots: list[tuple[Any, Any]] = []  # (slot, the array the graph reads and writes)
        self.advance: list[tuple[Any, int]] = []  # (RngState, draws per step)
        self.runs = 0
        self.nodes = 0


class CapturedStep:
    """Runs one plan on a GPU by warm-up, capture and replay (see the module doc)."""

    def __init__(self, plan: Any, backend: Any, xp: Any, slots: list[Any], rngs: list[Any],
                 guards: list[Any], say: Callable[[str], None] | None = None) -> None:
        self.plan, self.backend, self.xp = plan, backend, xp
        self.slots, self.rngs, self.guards = slots, rngs, guards
        self.say = say or (lambda _m: None)
        self.reason: str | None = refusal(plan)
        self.shapes: dict[tuple[Any, ...], _Shape] = {}
        self.captured_steps = 0
        self.eager_steps = 0

    @property
    def captured(self) -> bool:
        return any(s.graph is not None for s in self.shapes.values())

    def report(self) -> dict[str, Any]:
        return {"captured": self.captured, "reason": self.reason, "captured_steps": self.captured_steps,
                "eager_steps": self.eager_steps,
                "graph_nodes": max((s.nodes for s in self.shapes.values()), default=0)}

    def run(self, feeds: Sequence[Any], late: bool = False) -> Any:
        """One step on host (numpy) or device feed values; returns device arrays, valid until the
        next step, or (`late`) a `LateRead` of them and of the guard flags, copied to the host
        behind the step with no host wait."""
        key = tuple((tuple(np.shape(v)), str(getattr(v, "dtype", ""))) for v in feeds)
        entry = self.shapes.get(key)
        if entry is None:
            if len(self.shapes) >= MAX_SHAPES:
                return self._eager(feeds, late)
            entry = self.shapes[key] = _Shape([self.xp.empty(np.shape(v), dtype=v.dtype) for v in feeds])
        b = self.backend
        with b.running():
            for dst, v in zip(entry.static, feeds):
                b.copy_in(dst, v)
            if entry.graph is not None:
                self._restore(entry)
                b.launch(entry.graph)
                for st, n in entry.advance:
                    st.device_draws += n
                self.captured_steps += 1
                out = entry.outputs
            elif entry.runs == 0 or self.reason is not None:
                out = self.plan.run(entry.static)  # warm-up (or a refused plan): eagerly
                self.eager_steps += 1
            elif entry.runs == 1:
                out = self._rehearse(entry)
            else:
                out = self._capture(entry)
            entry.runs += 1
            if late:
                return self._late(out)
        self._check_guards()
        return list(out)

    def _eager(self, feeds: Sequence[Any], late: bool) -> Any:
        with self.backend.running():
            out = self.plan.run([self._device(v) for v in feeds])
            self.eager_steps += 1
            if late:
                return self._late(out)
        self._check_guards()
        return list(out)

    def _late(self, out: Sequence[Any]) -> "LateRead":
        """Queue the copies of the step's outputs and of its raising guards' flags to the host, on
        the step's stream (under `running`), behind the step."""
        guards = [g for g in self.guards if g.raises]
        values = [*out, *(g.flag(self.xp) for g in guards)]
        read_async = getattr(self.backend, "read_async", None)
        if read_async is None:  # a backend without asynchronous copies: read now
            return LateRead([to_host(v) for v in values], len(out), guards)
        return LateRead(read_async(values), len(out), guards)

    def _device(self, v: Any) -> Any:
        return v if isinstance(v, self.xp.ndarray) else self.xp.asarray(v)

    def _rehearse(self, entry: _Shape) -> list[Any]:
        """The second step, eagerly, watching the variables: a capture needs every update to write
        in place, and an update that replaces its variable's array in a step run eagerly (where a
        new array is a correct result) would do so in the capture too. (The first step may
        replace some legitimately: an initial value still shared with the initializer's Const.)"""
        before = [(s, _weak(s.value)) for s in self.slots]
        out = self.plan.run(entry.static)
        self.eager_steps += 1
        moved = [s.name for s, ref in before if s.value is not ref()]
        if moved:
            self.reason = f"the update of {moved[0]} is not in place ({len(moved)} variable(s))"
            self.say(f"this step runs uncaptured: {self.reason}")
        return out

    def _capture(self, entry: _Shape) -> list[Any]:
        b = self.backend
        # Weak references: a strong one would count as a holder, and keep the updates from writing
        # in place (kernels/state.updatable_in_place) -- the very thing the capture needs.
        before = [(s, _weak(s.value)) for s in self.slots]
        draws = [(st, st.device_draws) for st in self.rngs]
        b.begin()
        try:
            out = self.plan.run(entry.static)
        except Exception as e:  # noqa: BLE001 -- any refusal inside the capture: run this plan eagerly
            b.abandon()
            self._undo(before, draws)
            return self._refuse(entry, f"{type(e).__name__}: {e}".split("\n")[0][:300])
        graph = b.end(lambda: self.plan.run(entry.static))
        moved = [s.name for s, ref in before if s.value is not ref()]
        if moved:
            del out, graph
            self._undo(before, draws)
            return self._refuse(entry, f"the update of {moved[0]} is not in place ({len(moved)} variable(s))")
        entry.graph, entry.outputs = graph, list(out)
        if hasattr(graph, "outputs"):  # a stand-in that re-runs the step writes into these
            graph.outputs = entry.outputs
        entry.slots = [(s, s.value) for s, _ in before]  # held: the graph reads and writes these arrays
        entry.advance = [(st, st.device_draws - n) for st, n in draws]
        entry.nodes = int(getattr(graph, "nodes", 0) or 0)
        if not b.ran_during_capture:  # a CUDA capture ran nothing: this step runs now
            b.upload(graph)
            b.launch(graph)
        self.captured_steps += 1
        self.say(f"step captured as one CUDA graph ({len(self.plan.nodes)} nodes)")
        return entry.outputs

    def _refuse(self, entry: _Shape, reason: str) -> list[Any]:
        self.reason = reason
        self.say(f"this step runs uncaptured: {reason}")
        out = self.plan.run(entry.static)
        self.eager_steps += 1
        return out

    @staticmethod
    def _undo(before: list[tuple[Any, Any]], draws: list[tuple[Any, int]]) -> None:
        """Put back what a capture that is dropped changed on the host: variables given new arrays
        (on a GPU nothing ran, so such an array holds nothing) and the generators' draw counts."""
        lost = []
        for s, ref in before:
            v = ref()
            if v is None:
                lost.append(s.name)
            else:
                s.value = v
        for st, n in draws:
            st.device_draws = n
        if lost:
            raise ExecutionError(f"a CUDA-graph capture was dropped after the update of {lost[0]} replaced its "
                                 f"array, whose values are gone: run with FLOWCTL_CUDA_GRAPH=0 (and report this)")

    def _restore(self, entry: _Shape) -> None:
        """Put each variable's captured array back in its slot, with the slot's current value
        copied in where it was given a new array (a restore, an initializer run again)."""
        for slot, arr in entry.slots:
            v = slot.value
            if v is not arr:
                if v is not None:
                    self.backend.copy_in(arr, v)
                slot.value = arr

    def _check_guards(self) -> None:
        for g in self.guards:
            if g.raises and not g.ok():
                g.reset()
                raise guard_error(g)


def guard_error(g: Any) -> NonFiniteError:
    """What a step whose guard `g` found a non-finite value raises (its flag read on the host)."""
    return NonFiniteError(f"node '{g.name}' (CheckNumerics): the step's values are not finite "
                          f"(found on the device after the step; nothing was updated)",
                          node=g.name, op="CheckNumerics")


class LateRead:
    """A step's outputs and guard flags on their way to the host (`CapturedStep.run(late=True)`):
    `result()` waits for the copies (the first call only) and then does what an uncaptured read
    does right after the step: a guard found tripped is reset and raised (`NonFiniteError`);
    otherwise the outputs, host arrays. `values` is the backend's pending read (`wait()` gives
    the host arrays) or, for a backend without one, the host arrays themselves."""

    __slots__ = ("_read", "_n", "_guards", "_out", "_error")

    def __init__(self, values: Any, n: int, guards: list[Any]) -> None:
        self._read, self._n, self._guards = values, n, guards
        self._out: list[Any] | None = None
        self._error: NonFiniteError | None = None

    def result(self) -> list[Any]:
        if self._error is not None:
            raise self._error
        if self._out is None:
            got = self._read.wait() if hasattr(self._read, "wait") else self._read
            self._read = None  # the host buffers go back to the backend's ring
            for g, flag in zip(self._guards, got[self._n:]):
                if int(np.asarray(flag).reshape(-1)[0]) != 1:
                    g.reset()  # (a step launched after this one found it tripped, and skipped its updates)
                    self._error = guard_error(g)
                    raise self._error
            self._out = list(got[:self._n])
        return self._out


class _Strong:
    """A reference that is strong, for a value that cannot be referenced weakly (None, a scalar)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


def _weak(value: Any) -> Any:
    try:
        return weakref.ref(value)
    except TypeError:
        return _Strong(value)
