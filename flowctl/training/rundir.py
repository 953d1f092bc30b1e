"""The run directory: the resolved spec and its hash, the devices, metrics (JSONL and TensorBoard
event files), the graph that was trained, and the checkpoints.

    RUN/run.json            status, spec path, step, what the last process did
    RUN/spec.yaml           the spec file as given
    RUN/spec.resolved.json  the validated spec after defaults and block expansion; its hash
    RUN/graph.json          the GraphDef that was trained
    RUN/devices.json        the devices
    RUN/metrics.jsonl       one line per step: step, loss, learning rate, examples/s, time
    RUN/events/             TensorBoard event files
    RUN/checkpoints/        ckpt-<step>/ directories and the `latest` pointer
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from flowctl.engine.errors import CheckpointError

# Keys that say how long or how often, not what is computed: changing them is not a spec change.
SCHEDULING_KEYS = ("training.steps", "training.log_every_steps", "checkpoint")


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, fsync it, rename it over `path`, fsync the dir."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def resolved(spec: Any) -> dict[str, Any]:
    return spec.model_dump(mode="json")


def spec_hash(resolved_spec: dict[str, Any]) -> str:
    """sha256 of the resolved spec without its scheduling keys."""
    d = json.loads(json.dumps(resolved_spec))
    for key in SCHEDULING_KEYS:
        parts = key.split(".")
        node = d
        for p in parts[:-1]:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(parts[-1], None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def spec_changes(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ, with both values, ignoring scheduling keys."""
    if any(prefix == k or prefix.startswith(k + ".") for k in SCHEDULING_KEYS):
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            p = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append(f"{p}: added ({_short(new[k])})")
            elif k not in new:
                out.append(f"{p}: removed (was {_short(old[k])})")
            else:
                out.extend(spec_changes(old[k], new[k], p))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [c for i, (a, b) in enumerate(zip(old, new)) for c in spec_changes(a, b, f"{prefix}[{i}]")]
    return [] if old == new else [f"{prefix}: {_short(old)} -> {_short(new)}"]


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.metrics = self.path / "metrics.jsonl"
        self.events = self.path / "events"

    def exists(self) -> bool:
        return (self.path / "run.json").exists()

    def read_info(self) -> dict[str, Any]:
        return json.loads((self.path / "run.json").read_text())

    def write_info(self, info: dict[str, Any]) -> None:
        write_atomic(self.path / "run.json", json.dumps(info, indent=2) + "\n")

    def write_json(self, name: str, data: Any) -> None:
        write_atomic(self.path / name, json.dumps(data, indent=2) + "\n")

    def write_text(self, name: str, text: str) -> None:
        write_atomic(self.path / name, text)

    def truncate_metrics(self, after_step: int) -> None:
        """Drop metric lines past `after_step` (steps a crashed run took after its last checkpoint,
        which the resumed run is about to take again)."""
        if not self.metrics.exists():
            return
        keep = [line for line in self.metrics.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= after_step]
        write_atomic(self.metrics, "".join(line + "\n" for line in keep))

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]


class RunLock:
    """One writer per run directory: an exclusive `flock` on RUN/.lock, which holds the holder's PID.

    The kernel drops a flock when its holder exits, however it exits (SIGKILL included), so a lock
    file left behind by a dead process never blocks: the next writer takes the lock and writes its
    own PID. A refused writer only opens the file (no truncation, no write), so it changes nothing
    in the directory. flock locks belong to the open file, so a second RunLock on the same directory
    in the same process is refused too."""

    NAME = ".lock"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = self.path / self.NAME
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            return self
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(f"{self.path} is in use by another flowctl process (PID {holder}): one "
                                  f"writer per run directory; wait for it to finish or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock up; the file stays (removing it would race with a writer opening it)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
