"""Asynchronous data-parallel training (whitepaper §7, Figure 7 bottom): the loop `Trainer` runs
for `parallelism.strategy: async_data_parallel` -- one client thread per replica, each reading the
parameters as they are and applying its own update, the calling thread coordinating checkpoints,
Ctrl-C and errors."""
from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from flowctl.engine import strategies as st
from flowctl.engine.errors import NonFiniteError
from flowctl.training.faults import Stop, checked_learning_rate
from flowctl.training.rundir import MetricsLog
from flowctl.training.events import StepEvent

if TYPE_CHECKING:
    from flowctl.training.trainer import Trainer


class AsyncState:
    """What the replica threads and the coordinating thread share, guarded by `cond`.
    `reserved`: updates started (a replica took a batch); `applied`: updates finished; replicas
    start no update at or past `hold`, so a checkpoint is taken with none in flight."""

    def __init__(self, step: int, hold: int) -> None:
        self.cond = threading.Condition()
        self.apply_lock = threading.Lock()
        self.reserved = step
        self.applied = step
        self.hold = hold
        self.stop = False
        self.error: BaseException | None = None
        self.staleness: list[int] = []
        self.loss = float("nan")


class AsyncRun:
    """Figure 7 bottom: one client thread per replica, each taking its own batches, computing
    gradients on its device against the parameters as it reads them, and applying them through the
    shared update. The calling thread only coordinates: checkpoints (every N updates or seconds,
    taken with no update in flight, so each replica's data cursor matches the parameters), Ctrl-C,
    errors. A metrics line per update carries the replica and the update's staleness."""

    def __init__(self, trainer: Trainer, metrics: MetricsLog, writer: Any, t0: float) -> None:
        a = trainer.program.step.async_step
        assert a is not None
        self.t, self.a, self.metrics, self.writer, self.t0 = trainer, a, metrics, writer, t0
        self.total = trainer.total_steps
        self.every = trainer.ckpt_every_steps
        self.s = AsyncState(trainer.step, self.next_hold(trainer.step))

    def next_hold(self, applied: int) -> int:
        every = self.every
        return min(self.total, (applied // every + 1) * every) if every else self.total

    def replica(self, k: int) -> None:
        t, a, s = self.t, self.a, self.s
        src = t.sources[k]
        fetch = [a.losses[k], a.grads[k], a.version] + ([a.side_updates[k]] if a.side_updates[k] is not None else [])
        try:
            while True:
                with s.cond:
                    while not s.stop and s.error is None and s.hold <= s.reserved < self.total:
                        s.cond.wait()
                    if s.stop or s.error is not None or s.reserved >= self.total:
                        return
                    s.reserved += 1
                ts = time.perf_counter()
                loss_arr, grads, read = t.session.run(fetch, st.split_batch(src.next_batch(), [a.inputs[k]]))[:3]
                loss_v = float(loss_arr)
                if not math.isfinite(loss_v):
                    raise NonFiniteError(f"update {s.applied + 1}: replica {k}'s loss is not finite "
                                         f"({loss_v}); the update was not applied")
                with s.apply_lock:
                    self.apply(k, grads, int(read), loss_v, ts)
                with s.cond:
                    s.applied += 1
                    s.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 -- handed to the coordinating thread
            with s.cond:
                s.error = s.error or e
                s.cond.notify_all()

    def apply(self, k: int, grads: list[Any], read: int, loss_v: float, started: float) -> None:
        """Apply replica k's gradients (under the apply lock) and log the update; the learning rate
        is the schedule's at this update's index."""
        t, a, s = self.t, self.a, self.s
        feeds: dict[Any, Any] = dict(zip(a.grad_inputs, grads))
        lr = checked_learning_rate(t.spec.training.learning_rate, t.step)
        feeds[t.lr] = np.asarray(lr, dtype=t.lr.dtype)
        applied = int(t.session.run([a.applied, a.apply], feeds)[0])
        t.step = applied
        stale = applied - 1 - read
        eps = t.batch / (time.perf_counter() - started)
        s.staleness.append(stale)
        s.loss = loss_v
        self.metrics.write(f'{{"step": {applied}, "replica": {k}, "staleness": {stale}, "loss": {loss_v!r}, '
                           f'"lr": {lr!r}, "examples_per_s": {eps:.1f}, "time": {time.time():.3f}}}\n')
        self.writer.scalars(applied, {"loss": loss_v, "learning_rate": lr, "examples_per_s": eps,
                                      "staleness": stale, f"replica_{k}/loss": loss_v})
        t.on_step(StepEvent(applied, self.total, loss_v, lr, eps, time.perf_counter() - self.t0, t.batch))

    def run(self, stop: Stop) -> tuple[float, list[float], str | None, bool, dict[str, Any]]:
        s = self.s
        threads = [threading.Thread(target=self.replica, args=(k,), name=f"flowctl-replica-{k}", daemon=True)
                   for k in range(len(self.a.losses))]
        for th in threads:
            th.start()
        try:
            last_path, interrupted = self.coordinate(stop)
        finally:
            with s.cond:  # wake any replica waiting at the hold, so that it sees the stop
                s.stop = True
                s.cond.notify_all()
            for th in threads:
                th.join()
        if s.error is not None:
            raise s.error
        stale = {"mean": float(np.mean(s.staleness)) if s.staleness else 0.0,
                 "max": int(max(s.staleness, default=0)), "updates": len(s.staleness)}
        # The run's rate is all replicas together: examples applied over the time taken.
        elapsed = time.perf_counter() - self.t0
        rates = [len(s.staleness) * self.t.batch / elapsed] if s.staleness and elapsed > 0 else []
        return s.loss, rates, last_path, interrupted, stale

    def coordinate(self, stop: Stop) -> tuple[str | None, bool]:
        """Wait for updates; checkpoint at each hold; stop on Ctrl-C, an error or the last update."""
        s, t = self.s, self.t
        last_save = self.t0
        last_path: str | None = None
        interrupted = False
        while True:
            with s.cond:
                s.cond.wait(0.05)
                quiet = s.applied == s.reserved
                if s.error is not None:
                    break
                if stop.requested and not s.stop:
                    s.stop = interrupted = True
                    s.cond.notify_all()
                if (s.stop and quiet) or s.applied >= self.total:
                    break
                if t.ckpt_every_seconds and time.perf_counter() - last_save >= t.ckpt_every_seconds:
                    s.hold = min(s.hold, s.reserved)  # start no more updates until the save
                save = quiet and s.applied == s.hold and s.applied < self.total
            if save:
                self.metrics.flush()
                last_path = t.save()
                last_save = time.perf_counter()
                with s.cond:
                    s.hold = self.next_hold(s.applied)
                    s.cond.notify_all()
        return last_path, interrupted
