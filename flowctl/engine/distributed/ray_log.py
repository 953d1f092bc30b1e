"""Ray's own text in this driver process, to a file instead of the terminal.

Two streams reach a driver's terminal whatever `ray.init(log_to_driver=False)` says (that option
covers the workers' stdout and stderr only): the records of Ray's `ray` logger ("Started a local
Ray instance", its token-authentication warning, ...) and the messages the raylet pushes to the
driver, which a thread of Ray's prints to stdout itself ("A worker died or was killed while
executing a task by an unexpected system error. To troubleshoot ...", a paragraph per lost
worker). Ray offers no option for the second: `RayLog` replaces the function that thread prints
through (`ray._private.worker.print_to_stdstream`, looked up by name at each message; where a Ray
version lacks it, the messages reach the terminal as before). A run's log keeps Ray's account of
a failure; the person gets flowctl's own line about it (the trainer's warning).
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RayLog:
    """While open, Ray's text in this process is appended to `path` (made, with its folder, at the
    first line), not printed. `close` puts Ray's printing back. Sessions opened one inside another
    close in the reverse order (each puts back what it found)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.lines = 0  # written so far (a test or a caller can tell whether Ray said anything)
        self._lock = threading.Lock()
        self._handler: logging.Handler | None = None
        self._hidden: list[logging.Handler] = []
        self._before: list[logging.Handler] = []  # the logger's handlers, in order, when opened
        self._printer: Any = None  # Ray's print_to_stdstream, while replaced

    def open(self) -> "RayLog":
        if self._handler is not None:
            return self
        logger = logging.getLogger("ray")
        self._before = list(logger.handlers)
        self._hidden = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)
                        and not isinstance(h, logging.FileHandler)]
        for h in self._hidden:
            logger.removeHandler(h)
        self._handler = _Handler(self)
        self._handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(self._handler)
        try:
            import ray._private.worker as ray_worker
        except ImportError:  # no Ray: nothing prints
            return self
        if hasattr(ray_worker, "print_to_stdstream"):
            self._printer = ray_worker.print_to_stdstream
            ray_worker.print_to_stdstream = self._print
        return self

    def close(self) -> None:
        if self._handler is None:
            return
        logger = logging.getLogger("ray")
        logger.removeHandler(self._handler)
        # Ray's handlers back in their places; any added meanwhile (pytest's, another tool's) after them
        kept = [h for h in self._before if h in self._hidden or h in logger.handlers]
        logger.handlers = kept + [h for h in logger.handlers if h not in kept]
        self._handler, self._hidden, self._before = None, [], []
        if self._printer is not None:
            import ray._private.worker as ray_worker

            if ray_worker.print_to_stdstream == self._print:
                ray_worker.print_to_stdstream = self._printer
            self._printer = None

    def write(self, text: str) -> None:
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text.rstrip("\n") + "\n")
            self.lines += 1

    def _print(self, data: dict[str, Any], ignore_prefix: bool = False) -> None:
        """In place of Ray's print_to_stdstream: {"lines": [...], "pid": "raylet", ...}."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        who = data.get("pid", "ray")
        for line in data.get("lines", []):
            self.write(f"{stamp} ({who}) {line}")


class _Handler(logging.Handler):
    def __init__(self, log: RayLog) -> None:
        super().__init__()
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.write(self.format(record))
        except Exception:  # noqa: BLE001 -- a log that cannot be written must not fail the run
            self.handleError(record)


__all__ = ["RayLog"]
