"""Checkpoints (whitepaper §3.3 "Fault Tolerance": Save/Restore of every Variable, every N steps).

A checkpoint directory holds one committed checkpoint per saved step, `ckpt-<step:08d>/`, with
  tensors.safetensors   every tensor (variables and optimizer slots), safetensors format (no pickle)
  manifest.json         step, each tensor's dtype/shape/sha256, the tensor file's size and sha256,
                        flowctl version, spec hash, and the caller's state (RNG, data cursor, ...)
  COMMIT                the manifest's sha256, written last: a directory without it was never committed
plus a `latest` pointer file naming the newest one (for people and tools; restore scans the
directories, so a crash between the rename and the pointer update loses nothing).

A save is crash-safe by construction: everything is written and fsynced inside `.tmp-<...>`, the
directory is fsynced and renamed into place (the commit point), the parent fsynced, then `latest`
replaced atomically, then old checkpoints pruned. A SIGKILL at any moment leaves either the previous
state or the new checkpoint, plus `.tmp-*` debris that `restore_latest` deletes. A failed save (a full
disk, an unwritable directory) raises `CheckpointError` and leaves the last good checkpoint and
`latest` as they were. One writer per directory is assumed (one trainer per run dir).

Warnings (a damaged checkpoint skipped, a checkpoint pruned from an abandoned timeline) go to the
`on_warning` callback given to `CheckpointDir`, or to `warnings.warn(..., CheckpointWarning)`
when none is given; `restore_latest` also returns them in `Checkpoint.warnings`.

Fault injection: `CheckpointDir(..., fault=f)` calls `f(phase)` as a save reaches each of
`SAVE_PHASES`; the crash tests pass one that SIGKILLs the process at a chosen phase.
"""
from __future__ import annotations

import base64
import builtins
import errno
import hashlib
import json
import math
import os
import re
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from flowctl.engine.errors import CheckpointError, FlowctlError
from flowctl.version import __version__

if TYPE_CHECKING:
    from flowctl.engine.optimizers import Optimizer
    from flowctl.engine.session import Session

__all__ = [
    "Checkpoint", "CheckpointInvalid", "CheckpointDir", "CheckpointWarning", "SAVE_PHASES",
    "apply", "capture", "decode_state", "encode_state", "free_space", "load",
    "why_write_failed",
]

FORMAT = "flowctl.checkpoint"
FORMAT_VERSION = 1
TENSORS = "tensors.safetensors"
MANIFEST = "manifest.json"
COMMIT = "COMMIT"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
_REPLACED = TMP_PREFIX + "replaced-"
_NAME = re.compile(r"^ckpt-(\d{8,})$")

# In the order a save reaches them. `mid_tensors` is half-way through writing the tensor file (a
# torn write, if the process dies there); `mid_prune` after the first old checkpoint is moved aside
# but before it is deleted.
SAVE_PHASES = ("mid_tensors", "after_tensors", "after_manifest", "before_commit_marker", "before_rename",
               "before_latest", "before_prune", "mid_prune")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped or removed; the run goes on."""


class CheckpointInvalid(CheckpointError):
    """One check on one file failed. `str(err)` is one line: `<file>: <check> (<detail>)`.
    `check` is one of: missing, truncated, checksum mismatch, not committed, spec mismatch,
    unreadable, dtype mismatch, shape mismatch, inconsistent."""

    def __init__(self, path: Path, check: str, detail: str = "") -> None:
        super().__init__(f"{path}: {check}" + (f" ({detail})" if detail else ""))
        self.path = path
        self.check = check


@dataclass
class Checkpoint:
    """A verified checkpoint: its tensors by name and the caller's state, decoded."""

    step: int
    path: Path
    tensors: dict[str, np.ndarray]
    state: dict[str, Any]
    manifest: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- lossless state in JSON
# JSON alone would silently turn tuples into lists, int dict keys into strings, arrays into nothing,
# and NaN into non-standard tokens; a resumed run must see exactly the state it saved (issue 4: the
# commonest resume bug is a silently reset RNG or data position). So those are tagged.
_TAGS = ("__ndarray__", "__tuple__", "__float__", "__items__")


def encode_state(obj: Any, where: str = "state") -> Any:
    """`obj` as plain JSON values, losslessly: ndarrays and numpy scalars as dtype + shape +
    base64 little-endian bytes, tuples, non-string dict keys and non-finite floats tagged."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, np.generic):
        return {"__ndarray__": _encode_array(np.asarray(obj), where), "scalar": True}
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else {"__float__": repr(float(obj))}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": _encode_array(obj, where)}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj):
            clash = [k for k in obj if k in _TAGS]
            if clash:
                raise CheckpointError(f"{where}: key {clash[0]!r} is reserved by the checkpoint format")
            return {k: encode_state(v, f"{where}.{k}") for k, v in obj.items()}
        return {"__items__": [[encode_state(k, f"{where} key"), encode_state(v, f"{where}[{k!r}]")]
                              for k, v in obj.items()]}
    raise CheckpointError(f"{where}: cannot store a {type(obj).__name__} in a checkpoint "
                          f"(use numbers, strings, lists, tuples, dicts or numpy arrays)")


def _encode_array(arr: np.ndarray, where: str) -> dict[str, Any]:
    if arr.dtype.hasobject:
        raise CheckpointError(f"{where}: cannot store an object array in a checkpoint")
    le = _little_endian(arr)
    return {"dtype": le.dtype.str, "shape": list(le.shape), "data": base64.b64encode(le.tobytes()).decode()}


def decode_state(obj: Any) -> Any:
    """The inverse of `encode_state`."""
    if isinstance(obj, list):
        return [decode_state(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__ndarray__" in obj:
        enc = obj["__ndarray__"]
        arr = np.frombuffer(base64.b64decode(enc["data"]), dtype=np.dtype(enc["dtype"]))
        arr = arr.reshape(tuple(enc["shape"])).astype(arr.dtype.newbyteorder("="))  # native order, writable copy
        return arr[()] if obj.get("scalar") else arr
    if "__tuple__" in obj:
        return tuple(decode_state(v) for v in obj["__tuple__"])
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__items__" in obj:
        return {_hashable(decode_state(k)): decode_state(v) for k, v in obj["__items__"]}
    return {k: decode_state(v) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


# ---------------------------------------------------------------------------- durable file operations
def _write_bytes(path: Path, data: bytes | memoryview, halfway: Callable[[], None] | None = None) -> None:
    """Write, flush and fsync one new file; the data is on disk when this returns. `halfway` is
    called with half of it written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        for part in ((view[: len(view) // 2], view[len(view) // 2:]) if halfway is not None else (view,)):
            while part:
                n = os.write(fd, part)
                part = part[n:]
            if halfway is not None:
                halfway()
                halfway = None
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # A rename or a new file is durable only once its directory entry is (POSIX leaves it to us).
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _little_endian(arr: np.ndarray) -> np.ndarray:
    """C order, little-endian, same shape (np.ascontiguousarray would turn a 0-d array into 1-d)."""
    return np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C")


def _tensor_bytes(arr: np.ndarray) -> memoryview:
    """The bytes a tensor's sha256 is taken over: C order, little-endian (what safetensors stores).
    A view, not a copy: checkpoints of large models should not double their memory to hash."""
    return _little_endian(arr).data


def _step_of(path: Path) -> int | None:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------- loading and verifying
def load(path: str | Path, spec_hash: str | None = None, allow_spec_change: bool = False) -> Checkpoint:
    """Read one checkpoint directory and verify it: the commit marker, the manifest's checksum and
    contents, the spec hash (refused when it differs from `spec_hash` unless `allow_spec_change`),
    the tensor file's size and sha256, and every tensor's dtype, shape and sha256. Any failure
    raises `CheckpointInvalid` (a `CheckpointError`) naming the file and the check."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointInvalid(path, "missing", "no such checkpoint directory")
    commit = _read(path / COMMIT, "not committed", "commit marker missing")
    manifest_path = path / MANIFEST
    raw = _read(manifest_path, "missing")
    if commit.decode(errors="replace").strip() != _sha256(raw):
        raise CheckpointInvalid(manifest_path, "checksum mismatch", "sha256 differs from the commit marker")
    try:
        manifest = json.loads(raw)
        step = int(manifest["step"])
        entries: dict[str, dict[str, Any]] = manifest["tensors"]
        tfile: dict[str, Any] = manifest["tensor_file"]
        state = decode_state(manifest["state"])
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        # RecursionError: JSON nested deeper than the parser's (or decode_state's) stack allows.
        raise CheckpointInvalid(manifest_path, "unreadable", f"{type(e).__name__}: {e}") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointInvalid(manifest_path, "unreadable", f"not a {FORMAT} v{FORMAT_VERSION} manifest")
    if _step_of(path) is not None and _step_of(path) != step:
        raise CheckpointInvalid(manifest_path, "inconsistent", f"manifest says step {step}, directory "
                                                               f"{path.name}")
    saved_hash = manifest.get("spec_hash")
    if spec_hash is not None and saved_hash is not None and saved_hash != spec_hash and not allow_spec_change:
        raise CheckpointInvalid(manifest_path, "spec mismatch",
                                f"saved with spec {saved_hash[:12]}, this run's spec is {spec_hash[:12]}; "
                                f"allow a spec change to restore it anyway")
    tensors = _verify_tensors(path / TENSORS, tfile, entries)
    return Checkpoint(step=step, path=path, tensors=tensors, state=state, manifest=manifest)


def _read(path: Path, check: str, detail: str = "") -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CheckpointInvalid(path, check, detail) from None
    except OSError as e:
        raise CheckpointInvalid(path, "unreadable", e.strerror or str(e)) from None


def _verify_tensors(tpath: Path, tfile: Mapping[str, Any], entries: Mapping[str, Mapping[str, Any]]
                    ) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load as st_load

    data = _read(tpath, "missing")
    size = int(tfile["size"])
    if len(data) < size:
        raise CheckpointInvalid(tpath, "truncated", f"{len(data)} of {size} bytes")
    if len(data) > size:
        raise CheckpointInvalid(tpath, "checksum mismatch", f"{len(data)} bytes, {size} were written")
    try:
        tensors = st_load(data)
    except SafetensorError as e:
        # The size matched, so the header itself was damaged.
        raise CheckpointInvalid(tpath, "checksum mismatch", f"header unreadable: {e}") from None
    extra = sorted(set(tensors) - set(entries))
    if extra:
        raise CheckpointInvalid(tpath, "inconsistent", f"tensor {extra[0]!r} is not in the manifest")
    for name, ent in entries.items():
        arr = tensors.get(name)
        if arr is None:
            raise CheckpointInvalid(tpath, "missing", f"tensor {name!r} listed in the manifest")
        if arr.dtype.name != ent["dtype"]:
            raise CheckpointInvalid(tpath, "dtype mismatch", f"tensor {name!r} is {arr.dtype.name}, the "
                                                             f"manifest says {ent['dtype']}")
        if list(arr.shape) != list(ent["shape"]):
            raise CheckpointInvalid(tpath, "shape mismatch", f"tensor {name!r} has shape {tuple(arr.shape)}, "
                                                             f"the manifest says {tuple(ent['shape'])}")
        digest = _sha256(_tensor_bytes(arr))
        if digest != ent["sha256"]:
            raise CheckpointInvalid(tpath, "checksum mismatch", f"tensor {name!r} sha256 {digest[:12]}, "
                                                                f"expected {ent['sha256'][:12]}")
    # Every tensor passed, so a whole-file mismatch is in the header or its padding.
    if _sha256(data) != tfile["sha256"]:
        raise CheckpointInvalid(tpath, "checksum mismatch", "file sha256 differs: header damaged")
    return tensors


# ---------------------------------------------------------------------------- the directory
class CheckpointDir:
    """Saves and restores the checkpoints of one run in `directory`, keeping the newest `keep`
    (all of them when None). `spec_hash` is recorded in every save and compared on every restore.
    `on_warning` receives each warning line; without it they go to `warnings.warn`. `fault`, for
    tests, is called with each of `SAVE_PHASES` as a save reaches it."""

    def __init__(self, directory: str | Path, keep: int | None = 5, spec_hash: str | None = None,
                 on_warning: Callable[[str], None] | None = None,
                 fault: Callable[[str], None] | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (or None for all), not {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.spec_hash = spec_hash
        self.on_warning = on_warning
        self.fault = fault
        # Checkpoints verified whole in this process (path -> the commit marker's mtime): each is
        # read and hashed at most once when pruning decides what `keep` keeps.
        self._verified: dict[Path, float] = {}

    def _reach(self, phase: str) -> None:
        if self.fault is not None:
            self.fault(phase)

    def path_for(self, step: int) -> Path:
        return self.directory / f"ckpt-{step:08d}"

    # ------------------------------------------------------------------ save
    def save(self, step: int, tensors: Mapping[str, Any], state: Mapping[str, Any] | None = None) -> Path:
        """Write checkpoint `step` and return its directory. Raises `CheckpointError` when it cannot
        be written; the previous checkpoints and `latest` are then as they were."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise CheckpointError(f"checkpoint step must be a non-negative integer, not {step!r}")
        step = int(step)
        payload, tfile, entries = self._serialize(tensors)
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
            "flowctl_version": __version__, "spec_hash": self.spec_hash, "created_unix": time.time(),
            "tensor_file": tfile, "tensors": entries, "state": encode_state(dict(state or {})),
        }
        raw = json.dumps(manifest, indent=1, allow_nan=False).encode()  # key order is state too
        final = self.path_for(step)
        tmp = self.directory / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        current = self.directory
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            current = tmp / TENSORS
            _write_bytes(current, payload, halfway=lambda: self._reach("mid_tensors"))
            self._reach("after_tensors")
            current = tmp / MANIFEST
            _write_bytes(current, raw)
            self._reach("after_manifest")
            # The marker must never be durable while a file it vouches for is not: entries first.
            current = tmp
            _fsync_dir(tmp)
            self._reach("before_commit_marker")
            current = tmp / COMMIT
            _write_bytes(current, (_sha256(raw) + "\n").encode())
            current = tmp
            _fsync_dir(tmp)
            self._reach("before_rename")
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._write_failed(e, current) from None
        replaced = self._commit(tmp, final)
        self._reach("before_latest")
        try:
            self._point_latest(final.name)
        except OSError as e:
            self._rollback(final, replaced)
            raise self._write_failed(e, self.directory / LATEST) from None
        self._reach("before_prune")
        self._prune(step, replaced)
        return final

    def _serialize(self, tensors: Mapping[str, Any]) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
        from safetensors.numpy import save as st_save

        arrays: dict[str, np.ndarray] = {}
        entries: dict[str, Any] = {}
        for name, value in tensors.items():
            arr = np.asarray(value)
            if not isinstance(name, str) or arr.dtype.hasobject or arr.dtype.kind in "USVMm":
                raise CheckpointError(f"tensor {name!r}: cannot store dtype {arr.dtype} in a checkpoint")
            arr = _little_endian(arr)
            arrays[name] = arr
            entries[name] = {"dtype": arr.dtype.name, "shape": list(arr.shape),
                             "sha256": _sha256(_tensor_bytes(arr))}
        try:
            payload = st_save(arrays)
        except Exception as e:  # safetensors raises its own SafetensorError for unsupported dtypes
            raise CheckpointError(f"cannot serialize the tensors: {e}") from None
        return payload, {"name": TENSORS, "size": len(payload), "sha256": _sha256(payload)}, entries

    def _write_failed(self, e: OSError, where: Path) -> CheckpointError:
        what = why_write_failed(e)
        if e.errno == errno.EEXIST and where == self.directory:
            what = "exists and is not a directory"
        last = self.latest()
        kept = f"the last good checkpoint {last.name} is untouched" if last else "no earlier checkpoint"
        return CheckpointError(f"{where}: write failed ({what}); {kept}; {free_space(where)}")

    def _commit(self, tmp: Path, final: Path) -> Path | None:
        """Rename the finished directory into place (the commit point). An existing checkpoint of the
        same step (a resume that saves the step it restored) is moved aside first and deleted at
        prune time; if we die in between, `remove_temporaries` moves it back."""
        replaced = None
        try:
            if final.exists():
                replaced = self.directory / f"{_REPLACED}{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, replaced)
            os.rename(tmp, final)
            _fsync_dir(self.directory)
        except OSError as e:
            if replaced is not None and not final.exists():
                os.rename(replaced, final)
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._write_failed(e, final) from None
        return replaced

    def _rollback(self, final: Path, replaced: Path | None) -> None:
        # Best effort, and atomic first: rename away, then delete, so `final` is never half-deleted.
        gone = self.directory / f"{TMP_PREFIX}rollback-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(final, gone)
            if replaced is not None:
                os.rename(replaced, final)
            _fsync_dir(self.directory)
        except OSError:
            pass
        shutil.rmtree(gone, ignore_errors=True)

    def _point_latest(self, name: str) -> None:
        tmp = self.directory / f"{TMP_PREFIX}{LATEST}-{uuid.uuid4().hex[:8]}"
        try:
            _write_bytes(tmp, (name + "\n").encode())
            os.replace(tmp, self.directory / LATEST)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        try:
            _fsync_dir(self.directory)
        except OSError as e:
            # The pointer has moved already, and restore scans the directories rather than trusting
            # it, so an undurable pointer is worth a warning, not a failed save.
            self._warn(f"could not fsync {self.directory} after moving {LATEST}: {e.strerror or e}")

    def _prune(self, step: int, replaced: Path | None) -> None:
        """Delete what the new checkpoint supersedes: checkpoints beyond the newest `keep`, and any
        with a larger step (left by a run that went back to an older checkpoint: restoring one of them
        later would silently jump to that abandoned run). A failure here is only a warning: the save
        itself has succeeded."""
        doomed: list[Path] = [replaced] if replaced is not None else []
        committed = self.list()
        newer = [p for p in committed if (_step_of(p) or 0) > step]
        for p in newer:
            self._warn(f"{p.name} removed: newer than the checkpoint {step} just saved, so from an abandoned run")
        kept = [p for p in committed if (_step_of(p) or 0) <= step]
        doomed += newer + (self._beyond_keep(kept, step) if self.keep is not None else [])
        for p in doomed:
            self._remove(p)

    def _remove(self, p: Path) -> None:
        try:
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p)
                return
            gone = self.directory / f"{TMP_PREFIX}pruned-{p.name}-{uuid.uuid4().hex[:8]}"
            os.rename(p, gone)  # atomic: a checkpoint is either whole or gone
            self._reach("mid_prune")
            shutil.rmtree(gone)
        except OSError as e:
            self._warn(f"could not remove old checkpoint {p}: {e.strerror or e}")

    def retain(self, steps: builtins.set[int]) -> builtins.list[Path]:
        """Delete every checkpoint whose step is not in `steps` (a ranking decides what stays, not
        recency: checkpoints/best/ under checkpoint.keep_best.count); returns what went."""
        gone = [p for p in self._all_dirs() if _step_of(p) not in steps]
        for p in gone:
            self._remove(p)
        return gone

    def _beyond_keep(self, kept: builtins.list[Path], step: int) -> builtins.list[Path]:
        """What `keep` lets go, newest first counting only checkpoints that verify: a damaged one
        counts for nothing (it would push a good one out) and goes too, with a warning."""
        assert self.keep is not None
        whole, out = 0, []
        for p in reversed(kept):
            if whole >= self.keep:
                out.append(p)
            elif _step_of(p) == step or self._whole(p):  # the one just written was verified as written
                whole += 1
            else:
                self._warn(f"{p.name} removed: damaged, so it does not count toward keep {self.keep}")
                out.append(p)
        return out

    def _whole(self, path: Path) -> bool:
        try:
            stamp = (path / COMMIT).stat().st_mtime
        except OSError:
            return False
        if self._verified.get(path) == stamp:
            return True
        try:
            load(path, allow_spec_change=True)
        except CheckpointError:
            return False
        self._verified[path] = stamp
        return True

    # ------------------------------------------------------------------ restore
    def restore(self, step: int, allow_spec_change: bool = False) -> Checkpoint:
        """Load and verify the checkpoint of `step` (no fallback)."""
        return load(self.path_for(step), self.spec_hash, allow_spec_change)

    def restore_latest(self, allow_spec_change: bool = False,
                       accept: Callable[[Checkpoint], None] | None = None) -> Checkpoint:
        """The newest checkpoint whose checks pass. Damaged ones are skipped with a warning (in
        `Checkpoint.warnings` and to `on_warning`); leftover `.tmp-*` entries are deleted and
        `latest` is pointed at the checkpoint restored. A spec mismatch is raised, not skipped: every
        checkpoint of the run has the same spec. Raises `CheckpointError` when none is valid.

        `accept`, when given, is called on each checkpoint that passed the file checks, newest first,
        and usually loads it; if it raises a `FlowctlError` (or the KeyError, TypeError, ValueError,
        IndexError or AttributeError of a state it cannot use: a cursor without its keys, a bad RNG
        state), that checkpoint is skipped as damaged and the previous one is tried, so a caller that
        loads state piecewise must let a later call overwrite all of it."""
        self.remove_temporaries()
        candidates = sorted(self._all_dirs(), key=lambda p: _step_of(p) or 0, reverse=True)
        if not candidates:
            raise CheckpointInvalid(self.directory, "missing", "no checkpoint in this directory")
        skipped: list[str] = []
        for path in candidates:
            try:
                ckpt = load(path, self.spec_hash, allow_spec_change)
                if accept is not None:
                    _accepted(accept, ckpt)
            except CheckpointInvalid as e:
                if e.check == "spec mismatch":
                    raise
                skipped.append(str(e))
                self._warn(f"skipping damaged checkpoint {path.name}: {e}")
                continue
            ckpt.warnings = [f"skipping damaged checkpoint: {s}" for s in skipped]
            if self._read_latest() != path.name:
                try:
                    self._point_latest(path.name)
                except OSError as e:
                    self._warn(f"could not update {self.directory / LATEST}: {e.strerror or e}")
                    ckpt.warnings.append(f"could not update {self.directory / LATEST}")
            return ckpt
        raise CheckpointError(f"{self.directory}: no valid checkpoint ({'; '.join(skipped)})")

    def empty(self) -> bool:
        """No checkpoint directory at all, committed or damaged (a run stopped before its first
        save; `.tmp-*` debris does not count)."""
        return not self._all_dirs()

    def remove_temporaries(self) -> list[Path]:
        """Delete `.tmp-*` debris of interrupted saves; return what was removed. A checkpoint that
        was moved aside to be replaced, and whose replacement never landed, is moved back instead."""
        removed: list[Path] = []
        if not self.directory.is_dir():
            return removed
        for p in sorted(self.directory.iterdir()):
            if not p.name.startswith(TMP_PREFIX):
                continue
            if p.name.startswith(_REPLACED) and (p / COMMIT).is_file():
                final = self.directory / p.name[len(_REPLACED):].rsplit("-", 1)[0]
                if _NAME.match(final.name) and not final.exists():
                    os.rename(p, final)
                    continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
        if removed:
            _fsync_dir(self.directory)
        return removed

    def latest(self) -> Path | None:
        """The committed checkpoint `latest` names, else the newest committed one; None if none.
        Checks only the commit marker: `restore_latest` is the one that verifies checksums."""
        name = self._read_latest()
        if name and _NAME.match(name) and (self.directory / name / COMMIT).is_file():
            return self.directory / name
        committed = self.list()
        return committed[-1] if committed else None

    def _read_latest(self) -> str | None:
        try:
            raw = (self.directory / LATEST).read_bytes()
        except OSError:
            return None
        # A damaged pointer (binary, NULs) names no checkpoint; restore scans the directories anyway.
        name = raw.decode("ascii", errors="replace").strip()
        return name if _NAME.match(name) else None

    def _all_dirs(self) -> builtins.list[Path]:
        if not self.directory.is_dir():
            return []
        return [p for p in self.directory.iterdir() if _NAME.match(p.name) and p.is_dir()]

    def _warn(self, message: str) -> None:
        if self.on_warning is not None:
            self.on_warning(message)
        else:
            warnings.warn(message, CheckpointWarning, stacklevel=3)

    def list(self) -> builtins.list[Path]:
        """Committed checkpoint directories (commit marker present), oldest first."""
        return sorted((p for p in self._all_dirs() if (p / COMMIT).is_file()), key=lambda p: _step_of(p) or 0)


def _accepted(accept: Callable[[Checkpoint], None], ckpt: Checkpoint) -> None:
    try:
        accept(ckpt)
    except CheckpointInvalid:
        raise
    except (FlowctlError, KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError) as e:
        detail = str(e) if isinstance(e, FlowctlError) else f"{type(e).__name__}: {e}"
        raise CheckpointInvalid(ckpt.path / MANIFEST, "inconsistent", f"its state cannot be restored: {detail}"
                                ) from None


_WHY = {errno.ENOSPC: "no space left on device", errno.EFBIG: "file too large",
        errno.EROFS: "read-only file system", errno.EDQUOT: "disk quota exceeded"}


def why_write_failed(e: OSError) -> str:
    """The reason for a failed write, in words (the usual storage failures in lower case)."""
    return _WHY.get(e.errno or 0) or (os.strerror(e.errno) if e.errno else str(e))


def free_space(path: str | Path) -> str:
    """`N GiB free there`, for the filesystem holding `path` (its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return "free space unknown"
    size = float(free)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.0f} {unit} free there" if unit == "B" else f"{size:.1f} {unit} free there"


# ---------------------------------------------------------------------------- session glue
def capture(session: Session, optimizer: Optimizer | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """What a checkpoint of `session` holds: every Variable's value (optimizer slots are Variables,
    §4.7) and, in the state, every random op's generator state, so a resumed run draws the same
    numbers (issue 4: resumes that reset the random state). The trainer adds the data cursor,
    the schedule position and the step to the state itself."""
    values = session.variable_values()
    missing = [n.name for n in session.graph.nodes.values() if n.op == "Variable" and n.name not in values]
    if missing:
        raise CheckpointError(f"variable {missing[0]!r} is not initialized; run the initializer before "
                              f"saving a checkpoint")
    values = _primaries(session.graph, values)
    state: dict[str, Any] = {
        "graph_seed": session.graph.seed,
        "rng": session.rng_states(),
        "trainable": sorted(n.name for n in session.graph.nodes.values()
                            if n.op == "Variable" and n.attrs.get("trainable")),
    }
    if optimizer is not None:
        state["optimizer"] = {"name": optimizer.name,
                              "variables": [v.op.name for v in optimizer.variables()]}
    return values, state


def mirrors(graph: Any) -> dict[str, str]:
    """mirror -> primary: the Variables an all-reduce replica holds as copies of replica 0's
    (engine/allreduce.py). A checkpoint holds the primaries only."""
    return {n.name: n.attrs["mirror_of"] for n in graph.nodes.values() if n.op == "Variable" and n.attrs.get("mirror_of")}


def _primaries(graph: Any, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`values` without the mirrors, after checking that each trainable mirror and each optimizer
    slot mirror equals its primary bitwise (replicas that drifted apart are a bug, not a state to
    save; mirrors of non-trainable model state, such as batch norm's moving averages, which only
    replica 0 updates, are not compared)."""
    from flowctl.engine.graph import parse_ref

    m = mirrors(graph)
    if not m:
        return dict(values)
    updated = {parse_ref(r)[0] for n in graph.nodes.values() if n.opdef.ref_inputs
               for i, r in enumerate(n.inputs) if i in n.opdef.ref_inputs and not n.name.endswith("/init")}
    for mirror, primary in m.items():
        if mirror in updated and not np.array_equal(values[mirror], values[primary]):
            raise CheckpointError(f"replica variable {mirror!r} differs from {primary!r}: the all-reduce replicas "
                                  f"drifted apart, so there is no one state to save")
    return {k: v for k, v in values.items() if k not in m}


def apply(session: Session, tensors: Mapping[str, np.ndarray], state: Mapping[str, Any], strict: bool = True,
          origin: str | Path = "checkpoint") -> None:
    """Load a checkpoint's tensors and RNG states into `session`. Shapes and dtypes must match the
    graph's Variables. With `strict` (the default) every Variable and random op of the graph must
    be in the checkpoint and every tensor must have a Variable: a partial restore would silently
    leave some state at its initial value. `origin` names the checkpoint in error messages."""
    from flowctl.engine.dtypes import np_dtype

    nodes = session.graph.nodes
    mirrored = mirrors(session.graph)
    variables = {n.name: n for n in nodes.values() if n.op == "Variable" and n.name not in mirrored}
    if strict:
        absent = sorted(set(variables) - set(tensors))
        if absent:
            raise CheckpointError(f"{origin}: missing (no tensor for variable {absent[0]!r})")
        unknown = sorted(set(tensors) - set(variables))
        if unknown:
            raise CheckpointError(f"{origin}: inconsistent (tensor {unknown[0]!r} has no Variable in the graph)")
    load_now: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        node = variables.get(name)
        if node is None:
            continue
        want_shape, want_dtype = tuple(node.attrs["shape"]), np.dtype(np_dtype(node.attrs["dtype"]))
        if tuple(arr.shape) != want_shape:
            raise CheckpointError(f"{origin}: shape mismatch (tensor {name!r} has shape {tuple(arr.shape)}, "
                                  f"the variable {want_shape})")
        if arr.dtype != want_dtype:
            raise CheckpointError(f"{origin}: dtype mismatch (tensor {name!r} is {arr.dtype}, the variable "
                                  f"{want_dtype})")
        load_now[name] = arr
    rng: Mapping[str, Any] = state.get("rng", {})
    random_ops = {n.name for n in nodes.values() if n.opdef.resource == "rng"}
    if strict:
        absent = sorted(random_ops - set(rng))
        if absent:
            raise CheckpointError(f"{origin}: missing (no random state for op {absent[0]!r})")
        unknown = sorted(set(rng) - random_ops)
        if unknown:
            raise CheckpointError(f"{origin}: inconsistent (random state for {unknown[0]!r}, which is not a "
                                  f"random op of the graph)")
    load_now.update({m: load_now[p] for m, p in mirrored.items() if p in load_now})
    session.load_variables(load_now)
    session.set_rng_states({k: v for k, v in rng.items() if k in random_ops})
