"""The rendezvous where Send and Recv meet (whitepaper §3.2.2, §5.3).

A Send puts a tensor under a key; the matching Recv registers a continuation that runs when the
tensor is there (at once if it already is). The key names the step, both devices, the tensor and
the control-flow frame and iteration, so the same table could serve several steps, devices and
(later) loop iterations without collisions. Frame and iteration are "" and 0 until control flow
exists; they are in the key now so that adding loops does not change the wire format.

`LocalRendezvous` is the in-process one the multi-device runtime uses: one per step (so aborting a
failed step never touches another step in flight), guarded by one lock, with every continuation
called *outside* the lock because a continuation may run a kernel's follow-up work. Across machines
the same interface is carried by the distributed engine (ARCHITECTURE.md, "Distribution").

Collectives (CollectiveAllReduce, issue 33) meet here too: `collective(key, rank, size, value,
reduce, done)` is a rendezvous of N participants instead of two. Each rank's kernel deposits its
value and registers its continuation, and returns at once (it holds no device thread while it
waits, as a Recv does); the last to arrive runs `reduce` on the N values, in rank order, on its own
thread and outside the lock, then calls every rank's continuation with its share. An abort wakes
every rank already waiting with the error and fails later arrivals at once, so a failed device's
step never leaves another device's collective hanging.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from flowctl.engine.errors import ExecutionError

RecvCallback = Callable[[Any, "BaseException | None"], None]
# A collective's reduction: the N ranks' values in rank order -> each rank's output, in rank order.
Reduce = Callable[[list[Any]], list[Any]]

_step_ids = itertools.count(1)


def next_step_id() -> int:
    """A process-wide fresh step id: two sessions' steps never share rendezvous keys."""
    return next(_step_ids)


class RendezvousKey(NamedTuple):
    step_id: int
    src_device: str
    dst_device: str
    tensor_name: str
    frame: str = ""
    iteration: int = 0

    def __str__(self) -> str:
        return (f"step {self.step_id} {self.tensor_name} {self.src_device} -> {self.dst_device}"
                + (f" frame {self.frame!r}:{self.iteration}" if self.frame else ""))


class RendezvousAborted(ExecutionError):
    """A Send or Recv on a step that another device's failure aborted. `cause` is that failure; the
    runtime reports the cause, not this."""

    def __init__(self, message: str, cause: BaseException, node: str | None = None,
                 device: str | None = None) -> None:
        super().__init__(message, node=node, device=device)
        self.cause = cause


class LocalRendezvous:
    """In-process rendezvous: a table key -> value (sent, not yet received) or key -> continuation
    (a Recv waiting). Each key is used by exactly one Send and one Recv (§3.2.2: one Recv per
    tensor per destination device), and the entry is dropped once they have met."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[RendezvousKey, Any] = {}
        self._waiting: dict[RendezvousKey, RecvCallback] = {}
        self._groups: dict[tuple[Any, ...], _Group] = {}  # collectives some ranks have joined
        self._error: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def send(self, key: tuple[Any, ...], value: Any) -> None:
        """Deliver `value` under `key`. Never blocks: a local Send buffers until its Recv comes."""
        k = RendezvousKey(*key)
        with self._lock:
            if self._error is not None:
                raise self._aborted(k)
            waiter = self._waiting.pop(k, None)
            if waiter is None:
                if k in self._values:
                    raise ExecutionError(f"rendezvous: {k} was sent twice")
                self._values[k] = value
                return
        waiter(value, None)

    def recv_async(self, key: tuple[Any, ...], done: RecvCallback) -> None:
        """Call `done(value, None)` when `key` arrives, or `done(None, error)` if the step aborts.
        Returns at once either way (§5.3: a Recv holds no thread while it waits)."""
        k = RendezvousKey(*key)
        with self._lock:
            if self._error is not None:
                err: BaseException | None = self._aborted(k)
                value = None
            elif k in self._values:
                value, err = self._values.pop(k), None
            else:
                if k in self._waiting:
                    err, value = ExecutionError(f"rendezvous: {k} was received twice"), None
                else:
                    self._waiting[k] = done
                    return
        done(value, err)

    def collective(self, key: tuple[Any, ...], rank: int, size: int, value: Any, reduce: Reduce,
                   done: RecvCallback) -> None:
        """Rank `rank` of `size` joins the collective `key` with `value`. Returns at once; `done(out,
        None)` is called with this rank's output once all `size` ranks have joined (the last one
        runs `reduce(values in rank order)`, outside the lock), or `done(None, error)` when the step
        aborts or the reduction fails."""
        with self._lock:
            if self._error is not None:
                err: BaseException | None = self._collective_aborted(key, rank)
            elif not 0 <= rank < size:
                err = ExecutionError(f"collective {key}: rank {rank} is not in 0..{size - 1}")
            else:
                group = self._groups.get(key)
                if group is None:
                    group = self._groups[key] = _Group(size)
                if group.size != size or group.done[rank] is not None:
                    why = (f"group sizes {group.size} and {size} disagree" if group.size != size
                           else f"rank {rank} joined twice")
                    err = ExecutionError(f"collective {key}: {why}")
                else:
                    group.values[rank], group.done[rank] = value, done
                    group.joined += 1
                    if group.joined < size:
                        return
                    del self._groups[key]
                    err = None
        if err is not None:
            done(None, err)
            return
        try:  # the last rank to join reduces, on its own thread
            outs = reduce(group.values)
        except Exception as e:  # noqa: BLE001 -- every rank reports the reduction's failure
            for d in group.done:
                assert d is not None
                d(None, e)
            return
        for d, out in zip(group.done, outs):
            assert d is not None
            d(out, None)

    def abort(self, error: BaseException) -> None:
        """Fail the step: every waiting Recv and collective rank is woken with the error, later
        Sends, Recvs and collectives fail at once, and buffered values are dropped. The first
        abort's error is kept (the root cause)."""
        with self._lock:
            if self._error is None:
                self._error = error
            waiting = list(self._waiting.items())
            self._waiting.clear()
            self._values.clear()
            groups = list(self._groups.items())
            self._groups.clear()
        for k, done in waiting:
            done(None, self._aborted(k))
        for key, group in groups:
            for rank, d in enumerate(group.done):
                if d is not None:
                    d(None, self._collective_aborted(key, rank))

    def pending(self) -> tuple[list[RendezvousKey], list[RendezvousKey]]:
        """(keys sent but not received, keys awaited but not sent): both empty after a clean step."""
        with self._lock:
            return list(self._values), list(self._waiting)

    def _collective_aborted(self, key: tuple[Any, ...], rank: int) -> RendezvousAborted:
        cause = self._error
        assert cause is not None
        return RendezvousAborted(f"step {key[0]} was aborted while rank {rank} waited in collective {key[1]!r}: "
                                 f"{cause}", cause=cause)

    def _aborted(self, k: RendezvousKey) -> RendezvousAborted:
        cause = self._error
        assert cause is not None
        return RendezvousAborted(f"step {k.step_id} was aborted while {k.tensor_name} was in transit "
                                 f"({k.src_device} -> {k.dst_device}): {cause}", cause=cause,
                                 device=k.dst_device)


class _Group:
    """One collective's ranks so far: their values and continuations by rank."""

    __slots__ = ("size", "values", "done", "joined")

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: list[Any] = [None] * size
        self.done: list[RecvCallback | None] = [None] * size
        self.joined = 0


@dataclass
class StepContext:
    """What an asynchronous kernel is handed each step (§5.3): the step id and its rendezvous,
    and the control-flow frame and iteration it runs in."""

    step_id: int
    rendezvous: LocalRendezvous
    frame: str = ""
    iteration: int = 0

    def key(self, src_device: str, dst_device: str, tensor_name: str) -> RendezvousKey:
        return RendezvousKey(self.step_id, src_device, dst_device, tensor_name, self.frame, self.iteration)

    def collective_key(self, group_key: str) -> tuple[Any, ...]:
        """The key under which a collective's N ranks of this step (frame, iteration) meet."""
        return (self.step_id, group_key, self.frame, self.iteration)
