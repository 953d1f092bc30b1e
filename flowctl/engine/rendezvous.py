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
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from flowctl.engine.errors import ExecutionError

RecvCallback = Callable[[Any, "BaseException | None"], None]

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

    def abort(self, error: BaseException) -> None:
        """Fail the step: every waiting Recv is woken with the error, later Sends and Recvs fail at
        once, and buffered values are dropped. The first abort's error is kept (the root cause)."""
        with self._lock:
            if self._error is None:
                self._error = error
            waiting = list(self._waiting.items())
            self._waiting.clear()
            self._values.clear()
        for k, done in waiting:
            done(None, self._aborted(k))

    def pending(self) -> tuple[list[RendezvousKey], list[RendezvousKey]]:
        """(keys sent but not received, keys awaited but not sent): both empty after a clean step."""
        with self._lock:
            return list(self._values), list(self._waiting)

    def _aborted(self, k: RendezvousKey) -> RendezvousAborted:
        cause = self._error
        assert cause is not None
        return RendezvousAborted(f"step {k.step_id} was aborted while {k.tensor_name} was in transit "
                                 f"({k.src_device} -> {k.dst_device}): {cause}", cause=cause,
                                 device=k.dst_device)


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
