"""A prefetching input pipeline (whitepaper §4.5, §4.6): read the next batches on a background
thread while the model computes on the current one.

`Prefetcher(source, depth)` wraps any `DataSource` and is one: the trainer calls `next_batch()`,
`state()` and `restore()` on it exactly as on the source. A background thread calls
`source.next_batch()` and keeps up to `depth` batches ready in a bounded buffer; it waits while the
buffer is full, so the source is never more than `depth + 1` batches ahead of the trainer.

The cursor stays exact for checkpoints (§3.3: a resumed run sees the batches an uninterrupted one
would): each buffered batch carries the source's state from just after it was produced, and when
the trainer takes a batch that state becomes the Prefetcher's cursor. So `state()` always describes
the NEXT batch the trainer will get, however far the thread has read ahead, and it is the
underlying source's own state (same kind and keys): a checkpoint taken with prefetching restores
into a run without it, and the other way round. `restore()` stops the thread, drops the buffer and
restores the source; the thread starts again on the next `next_batch()`.

Why a host-side buffer and not an engine queue fed by a background `session.run` (§4.6): the batch
and its cursor must travel together, and the cursor (a position, an epoch, a bit-generator state)
is not a tensor; the batches reach the model through the session's feeds either way, so a graph
queue would add a step per batch and a second place for the data position to live, and buy nothing
on one machine. A graph queue (flowctl.engine.ops.queues) is the tool when the consumer is itself a
graph (gradient accumulation, bucketing inside a step).

The overlap is real when the source spends its time outside the GIL: file reads, sleeps, numpy's
larger kernels. A source that is pure Python competes with the step for the interpreter.
"""
from __future__ import annotations

import copy
import threading
from collections import deque
from typing import Any

import numpy as np

from flowctl.data.base import DataSource
from flowctl.engine.errors import SpecError

Cursor = tuple[dict[str, Any], int, int]  # (source state, position, epoch) before the next batch


class Prefetcher(DataSource):
    def __init__(self, source: DataSource, depth: int = 2) -> None:
        if depth < 1:
            raise SpecError(f"prefetch depth must be >= 1, got {depth}")
        super().__init__(source.inputs, source.batch_size, source.seed)
        self.source = source
        self.kind = source.kind  # restore() checks kinds against the source's own states
        self.depth = int(depth)
        self._cond = threading.Condition()
        self._buf: deque[tuple[dict[str, np.ndarray], Cursor]] = deque()
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ahead = False  # the source may have read past the cursor (a thread ran since restore)
        self._set_cursor(self._capture())

    # ------------------------------------------------------------------ the DataSource interface
    def next_batch(self) -> dict[str, np.ndarray]:
        self._start()
        with self._cond:
            while not self._buf and self._error is None:
                self._cond.wait()
            if not self._buf:
                assert self._error is not None
                raise self._error  # the source failed after the batches before it were taken
            batch, cursor = self._buf.popleft()
            self._cond.notify_all()  # room for the thread
        self._set_cursor(cursor)
        return batch

    def state(self) -> dict[str, Any]:
        """The source's state before the next batch the trainer will take (not the thread's)."""
        return copy.deepcopy(self._cursor[0])

    def restore(self, state: dict[str, Any]) -> None:
        self._halt()
        self.source.restore(state)
        self._ahead = False
        self._set_cursor(self._capture())

    def close(self) -> None:
        """Stop the background thread (it is a daemon, but an idle one holds the source), and the
        source's own workers where it has them (an images source's decoding processes)."""
        self._halt()
        stop = getattr(self.source, "close", None)
        if stop is not None:
            stop()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        # Everything else (vocab, batches_per_epoch, ...) is the source's. Cursor-derived values
        # must come from the cursor, not from the source, which has read ahead.
        if name in ("source", "_cursor") or "source" not in self.__dict__:
            raise AttributeError(name)
        if name == "epoch_start" and hasattr(self.source, "batches_per_epoch"):
            return self.position % int(self.source.batches_per_epoch) == 0
        return getattr(self.source, name)

    # ------------------------------------------------------------------ the thread
    def _capture(self) -> Cursor:
        return copy.deepcopy(self.source.state()), int(self.source.position), int(self.source.epoch)

    def _set_cursor(self, cursor: Cursor) -> None:
        self._cursor = cursor
        self.position, self.epoch = cursor[1], cursor[2]

    def _start(self) -> None:
        if self._thread is not None:
            return
        if self._ahead:  # an earlier thread read past the cursor and its batches were dropped
            self.source.restore(self._cursor[0])
        self._stop = False
        self._error = None
        self._ahead = True
        self._thread = threading.Thread(target=self._fill, name="flowctl-prefetch", daemon=True)
        self._thread.start()

    def _halt(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread.join()  # at most one next_batch() of the source
        self._thread = None
        self._buf.clear()
        self._error = None

    def _fill(self) -> None:
        while True:
            with self._cond:
                while len(self._buf) >= self.depth and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
            try:
                batch = self.source.next_batch()
                cursor = self._capture()
            except BaseException as e:  # noqa: BLE001 -- handed to the trainer at this batch
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                if self._stop:
                    return
                self._buf.append((batch, cursor))
                self._cond.notify_all()
