"""The run directory: the resolved spec and its hash, the devices, metrics (JSONL and TensorBoard
event files), the graph that was trained, and the checkpoints.

    RUN/run.json            status, spec path, step, what the last process did
    RUN/spec.yaml           the spec file as given
    RUN/spec.resolved.json  the validated spec after defaults and block expansion; its hash
    RUN/graph.json          the GraphDef that was trained
    RUN/devices.json        the devices
    RUN/tokenizer.json      a text source's byte-level BPE, learned at the first start (inputs.py)
    RUN/metrics.jsonl       one line per step: step, loss, learning rate, examples/s, time
    RUN/metrics.<time>.jsonl  the metrics of a run started over (`resume --restart`), set aside
    RUN/events/             TensorBoard event files
    RUN/checkpoints/        ckpt-<step>/ directories and the `latest` pointer

What a run directory survives (issue 21): every file is written atomically (metadata) or appended
(metrics, events), never through a symlink that leads out of the directory; a failed write (a full
disk, a read-only one) is one `CheckpointError` naming the file and the free space, and leaves the
checkpoints as they were; a damaged metrics line (torn by a crash, garbage) is skipped with a
warning and dropped when a resume rewrites the file; a damaged run.json or spec.resolved.json is
a warning, the run's spec.yaml and the checkpoints' own spec hash stand in for them.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Callable, Protocol

from flowctl.engine.checkpoint import free_space, why_write_failed
from flowctl.engine.devices import parse_device
from flowctl.engine.errors import CheckpointError, FlowctlError

Warn = Callable[[str], None]

# Keys that say how long or how often, or how the same values are computed (fusion is bitwise the
# unfused step on the CPU), or where else the run is recorded (tracking), not what is computed:
# changing them is not a spec change.
SCHEDULING_KEYS = ("training.steps", "training.log_every_steps", "training.fuse", "checkpoint", "tracking")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write to a temporary file beside `path`, fsync it, rename it over `path`, fsync the dir. The
    file gets the mode a plain open would give it (0666 less the umask), not mkstemp's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide run.json from other readers
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


def _names_a_gpu(d: dict[str, Any]) -> bool:
    """Whether a resolved spec lists a GPU device (or devices it cannot read: then it may)."""
    devices = d.get("devices")
    if not isinstance(devices, list):
        return True
    for entry in devices:
        name = entry.get("name") if isinstance(entry, dict) else entry
        if not isinstance(name, str):
            return True
        try:
            if parse_device(name).type == "gpu":
                return True
        except FlowctlError:
            return True
    return False


def _without_inert(resolved_spec: Any) -> Any:
    """A copy without the keys that compute nothing as set: at fp32 (the default) the precision
    and fp16's loss scale; `training.allow_tf32` at its default (true), and on a spec without a
    GPU (a CPU's float32 products are IEEE either way). So a run started before those keys existed
    resumes, changing the loss scale of an fp32 run is no spec change, and switching a GPU run's
    float32 products between TF32 and IEEE is one (its numerics change)."""
    d = json.loads(json.dumps(resolved_spec))
    training = d.get("training") if isinstance(d, dict) else None
    if isinstance(training, dict) and training.get("precision", "fp32") == "fp32":
        training.pop("precision", None)
        training.pop("loss_scale", None)
    if isinstance(training, dict) and (training.get("allow_tf32", True) is True or not _names_a_gpu(d)):
        training.pop("allow_tf32", None)
    return d


def spec_hash(resolved_spec: dict[str, Any]) -> str:
    """sha256 of the resolved spec without its scheduling keys (nor inert ones: `_without_inert`)."""
    d = _without_inert(resolved_spec)
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
    if not prefix:
        old, new = _without_inert(old), _without_inert(new)
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


def write_failed(path: Path, e: OSError) -> CheckpointError:
    """One line for a failed write of a run's file: which, why, the free space there, and that the
    checkpoints were not touched (they are written apart from the metrics and the metadata)."""
    return CheckpointError(f"{path}: write failed ({why_write_failed(e)}; {free_space(path)}); "
                           f"the checkpoints are untouched")


class Damaged(ValueError):
    """A metrics line or metadata file that does not parse as what it should be."""


def parse_json(raw: bytes | str) -> Any:
    """`json.loads`, with every way bytes can fail to be JSON (undecodable, truncated, nested past
    the parser's stack) as one `Damaged`."""
    try:
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except RecursionError:
        raise Damaged("JSON nested too deeply") from None
    except (ValueError, TypeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise Damaged(f"not JSON: {str(e)[:80]}") from None


def metrics_record(line: bytes) -> dict[str, Any]:
    """One metrics.jsonl line as a record with an integer `step`, else `Damaged`."""
    rec = parse_json(line)
    if not isinstance(rec, dict):
        raise Damaged(f"a JSON {type(rec).__name__}, not an object")
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise Damaged("no integer step")
    return rec


class Mirror(Protocol):
    """Something that sees every metrics line as it is written, and each flush (an experiment
    tracker: flowctl.training.tracking). It never raises: the file is the run's record."""

    def line(self, text: str) -> None: ...

    def flush(self) -> None: ...


class MetricsLog:
    """metrics.jsonl open for appending: never through a symlink (O_NOFOLLOW), and a failed write
    or flush is `write_failed`. Used as the trainer's file: `write(line)`, `flush()`; `mirror`
    sees each line once it is in the file, and each flush."""

    def __init__(self, path: Path, mirror: Mirror | None = None) -> None:
        self.path = path
        self.mirror = mirror
        self._file: IO[str] = self._open()

    def _open(self) -> IO[str]:
        path = self.path
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(f"{path}: is a symlink; refusing to write a run's metrics through it "
                                      f"(replace it with a plain file)") from None
            raise write_failed(path, e) from None
        return os.fdopen(fd, "a")

    def write(self, line: str) -> None:
        try:
            self._file.write(line)
        except OSError as e:
            raise write_failed(self.path, e) from None
        if self.mirror is not None:
            self.mirror.line(line)

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as e:
            raise write_failed(self.path, e) from None
        if self.mirror is not None:
            self.mirror.flush()

    def reopen(self) -> None:
        """Open the file again, after a restore rewrote it (a remote run's recovery)."""
        self.close()
        self._file = self._open()

    def close(self, failing: bool = False) -> None:
        """Flush and close; when `failing` (another error is on its way out) a second failure is
        dropped so that the first is the one reported."""
        try:
            self._file.close()
        except OSError as e:
            if not failing:
                raise write_failed(self.path, e) from None

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self.close(failing=kind is not None)


class RunDir:
    def __init__(self, path: Path, on_warning: Warn | None = None) -> None:
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.metrics = self.path / "metrics.jsonl"
        self.events = self.path / "events"
        self.ray_log = self.path / "ray.log"  # Ray's own text in a run on Ray (distributed/ray_log.py)
        self.on_warning = on_warning or (lambda m: None)

    def exists(self) -> bool:
        return (self.path / "run.json").exists()

    def create(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_failed(self.path, e) from None

    def inside(self, path: Path) -> Path:
        """`path`, once it is known not to lead out of the run directory (a symlink to elsewhere
        would make the run write where nobody asked it to)."""
        root = self.path.resolve()
        real = path.resolve()
        if real != root and root not in real.parents:
            raise CheckpointError(f"{path}: leads to {real}, outside the run directory {root} (a symlink); "
                                  f"refusing to write there")
        return path

    # ------------------------------------------------------------------ metadata
    def read_json(self, name: str) -> Any:
        """A metadata file; `CheckpointError` when it is missing, unreadable or not JSON."""
        path = self.path / name
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{path}: unreadable ({e.strerror or e})") from None
        try:
            return parse_json(raw)
        except Damaged as e:
            raise CheckpointError(f"{path}: damaged ({e})") from None

    def read_info(self) -> dict[str, Any]:
        info = self.read_json("run.json")
        if not isinstance(info, dict):
            raise CheckpointError(f"{self.path / 'run.json'}: damaged (a JSON {type(info).__name__}, not an object)")
        return info

    def info_or_empty(self) -> dict[str, Any]:
        """run.json, or {} with a warning when it is damaged: what it records (the spec's path, the
        overrides) is then taken from the run's own copies, and it is rewritten on the next update."""
        try:
            return self.read_info()
        except CheckpointError as e:
            self.on_warning(f"{e}; using the run's spec.yaml (its relative paths are read from the current "
                            f"directory), and rewriting run.json")
            return {}

    def update_info(self, **fields: Any) -> None:
        info = self.info_or_empty()
        info.update(fields)
        self.write_info(info)

    def write_info(self, info: dict[str, Any]) -> None:
        self._write(self.path / "run.json", json.dumps(info, indent=2) + "\n")

    def write_json(self, name: str, data: Any) -> None:
        self._write(self.path / name, json.dumps(data, indent=2) + "\n")

    def write_text(self, name: str, text: str) -> None:
        self._write(self.path / name, text)

    def _write(self, path: Path, text: str) -> None:
        self.inside(path)
        try:
            write_atomic(path, text)
        except OSError as e:
            raise write_failed(path, e) from None

    # ------------------------------------------------------------------ metrics
    def open_metrics(self, mirror: Mirror | None = None) -> MetricsLog:
        return MetricsLog(self.metrics, mirror)

    def _metric_lines(self) -> list[tuple[bytes, dict[str, Any]]]:
        """The lines of metrics.jsonl that parse, each with its record; one warning for the rest."""
        try:
            raw = self.metrics.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:
            raise CheckpointError(f"{self.metrics}: unreadable ({e.strerror or e})") from None
        good: list[tuple[bytes, dict[str, Any]]] = []
        bad: list[str] = []
        for n, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                good.append((line, metrics_record(line)))
            except Damaged as e:
                bad.append(f"line {n}: {e}")
        if bad:
            more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
            self.on_warning(f"{self.metrics}: skipped {len(bad)} damaged line(s) ({'; '.join(bad[:3])}{more})")
        return good

    def truncate_metrics(self, after_step: int) -> None:
        """Keep the readable lines up to `after_step`: steps a crashed run took after its last
        checkpoint are about to be taken again, and damaged lines (a torn tail) are dropped."""
        if not self.metrics.exists() and not self.metrics.is_symlink():
            return
        keep = [line for line, rec in self._metric_lines() if rec["step"] <= after_step]
        self.inside(self.metrics)
        try:
            write_atomic(self.metrics, b"".join(line + b"\n" for line in keep).decode())
        except OSError as e:
            raise write_failed(self.metrics, e) from None

    def logged_steps(self) -> int:
        """The highest step metrics.jsonl records (0 for none); damaged lines are passed over here
        without a word (the rewrite that follows a resume reports them)."""
        try:
            raw = self.metrics.read_bytes()
        except OSError:
            return 0
        steps = [0]
        for line in raw.split(b"\n"):
            try:
                steps.append(metrics_record(line)["step"])
            except Damaged:
                continue
        return max(steps)

    def set_metrics_aside(self) -> Path | None:
        """Move metrics.jsonl to metrics.<UTC time>.jsonl, so a run started over from step 0 writes
        a file of its own; the path it went to, or None when there was none."""
        if not self.metrics.exists():
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.path / f"metrics.{stamp}.jsonl"
        n = 1
        while target.exists():
            n += 1
            target = self.path / f"metrics.{stamp}-{n}.jsonl"
        self.inside(self.metrics)
        try:
            os.rename(self.metrics, target)
        except OSError as e:
            raise write_failed(self.metrics, e) from None
        return target

    def read_metrics(self) -> list[dict[str, Any]]:
        """The metric records in order; damaged lines are skipped with a warning."""
        return [rec for _, rec in self._metric_lines()]


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
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_failed(self.path, e) from None
        try:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise write_failed(self.file, e) from None
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
