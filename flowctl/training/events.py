"""TensorBoard event files: tensorboardX's protocol buffers and record framing, written from the
training thread itself.

Why not tensorboardX's `SummaryWriter`: it writes from a background thread through a bounded
queue, and when a write fails (a full disk) that thread dies while the training thread blocks for
ever on the full queue, and again in `close()` and at interpreter exit (issue 21). Written here,
a failed write is an ordinary error in the step that made it (`write_failed`: one line, the file,
the free space), and the file is created new (O_EXCL) and never through a symlink.
"""
from __future__ import annotations

import os
import socket
import struct
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from flowctl.training.rundir import write_failed


def _tensorflow_bins() -> list[float]:
    # TensorFlow's default histogram buckets: +-1e-12 growing by 10% to 1e20, and zero.
    edges = []
    v = 1e-12
    while v < 1e20:
        edges.append(v)
        v *= 1.1
    return [-e for e in reversed(edges)] + [0.0] + edges


class EventWriter:
    """Scalars every step; weight histograms every `histograms_every` steps when asked.
    `purge_step` tells TensorBoard to drop events a crashed run wrote past its last checkpoint.
    The file is flushed every `flush_secs` and on `close()`."""

    def __init__(self, directory: Path, purge_step: int | None = None, histograms_every: int = 0,
                 flush_secs: float = 10.0) -> None:
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self.histograms_every = histograms_every
        self.flush_secs = flush_secs
        # The pid and a random tag: a resume in the same second must not reopen (and truncate) the
        # file of the process before it.
        name = (f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}."
                f"{uuid.uuid4().hex[:6]}")
        self.path = directory / name
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            raise write_failed(self.path, e) from None
        self._file = os.fdopen(fd, "wb")
        self._last_flush = time.monotonic()
        self._bins: list[float] | None = None
        self._event(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            self._event(Event(step=purge_step, file_version="brain.Event:2"))
            self._event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboardX.summary import scalar

        for tag, v in values.items():
            self._summary(scalar(tag, v), step)
        self._maybe_flush()

    def histograms(self, step: int, variables: Mapping[str, Any]) -> None:
        from tensorboardX.summary import histogram

        if self._bins is None:
            self._bins = _tensorflow_bins()
        for name, v in variables.items():
            self._summary(histogram(f"weights/{name}", np.asarray(v), self._bins), step)
        self._maybe_flush()

    def _summary(self, summary: Any, step: int) -> None:
        from tensorboardX.proto.event_pb2 import Event

        self._event(Event(summary=summary, wall_time=time.time(), step=int(step)))

    def _event(self, event: Any) -> None:
        # The TFRecord framing: length, its masked CRC32C, the data, its masked CRC32C.
        from tensorboardX.record_writer import masked_crc32c

        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        try:
            self._file.write(header + struct.pack("<I", masked_crc32c(header)) + data
                             + struct.pack("<I", masked_crc32c(data)))
        except OSError as e:
            raise write_failed(self.path, e) from None

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        if now - self._last_flush >= self.flush_secs:
            self._last_flush = now
            try:
                self._file.flush()
            except OSError as e:
                raise write_failed(self.path, e) from None

    def close(self, failing: bool = False) -> None:
        """Flush and close; when `failing` (another error is on its way out), a failure here is
        dropped so that the first one is reported."""
        try:
            self._file.close()
        except OSError as e:
            if not failing:
                raise write_failed(self.path, e) from None
