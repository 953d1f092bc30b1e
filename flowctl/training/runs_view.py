"""Many runs side by side (issue 35): `flowctl runs` lists run directories, `flowctl runs compare`
puts two together. Both only read, so they can look at a run while it trains.

A run's status, from what its trainer leaves (trainer.py writes run.json at each start and end):
  running      its writer lock (RUN/.lock, rundir.RunLock) is held by a live process
  finished     run.json says finished (or early_stopped): the trainer's last write
  interrupted  run.json says interrupted (Ctrl-C or SIGTERM, with the signal), or says running
               while no process holds the lock (the process was killed: the lock file is stale)
  failed       run.json says failed, with the error that ended the run
The lock is tested with a non-blocking shared flock on a read-only descriptor: a live writer's
exclusive lock refuses it at once and is untouched; with no writer it is held for the two system
calls it takes and released. Nothing is ever written: metrics.jsonl is read as it is, a last line
the trainer is still writing (or any damaged one) is passed over without a word.
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowctl.engine.errors import FlowctlError
from flowctl.training.rundir import Damaged, RunLock, metrics_record, parse_json

__all__ = ["Comparison", "RunView", "compare_runs", "list_runs", "lock_held", "set_lines", "view_run"]

ENDED = {"finished": "finished", "early_stopped": "finished", "interrupted": "interrupted", "failed": "failed"}


@dataclass
class RunView:
    path: str
    spec: str  # the spec's name (or its model's)
    strategy: str
    step: int  # steps done
    planned: int | None
    metric: str  # checkpoint.keep_best's metric, else the training loss
    mode: str  # min or max: which of its values is best
    last: float | None
    best: float | None
    best_step: int | None
    seconds: float | None  # wall time, every process of the run together
    status: str  # running, finished, interrupted, failed (unknown: run.json unreadable)
    detail: str = ""  # the signal, the error, "process gone", "stopped early"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def lock_held(run: Path) -> bool:
    """Whether a live process holds `run`'s writer lock (see the module head for why this cannot
    disturb it)."""
    try:
        fd = os.open(run / RunLock.NAME, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # no lock file (or not a plain one): no trainer has taken it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        raise
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _read_json(path: Path) -> Any:
    try:
        return parse_json(path.read_bytes())
    except (OSError, Damaged):
        return None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's step records, in order; a torn or damaged line is passed over."""
    try:
        raw = path.read_bytes()
    except OSError:
        return []
    out = []
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            rec = metrics_record(line)
        except Damaged:
            continue
        if "event" not in rec:  # a remote run's restart line carries no metrics
            out.append(rec)
    return out


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _resolved(run: Path) -> dict[str, Any]:
    doc = _read_json(run / "spec.resolved.json")
    spec = doc.get("spec") if isinstance(doc, dict) else None
    return spec if isinstance(spec, dict) else {}


def _metric(spec: dict[str, Any]) -> tuple[str, str]:
    keep = (spec.get("checkpoint") or {}).get("keep_best") if isinstance(spec.get("checkpoint"), dict) else None
    if isinstance(keep, dict) and isinstance(keep.get("metric"), str):
        return keep["metric"], "max" if keep.get("mode") == "max" else "min"
    return "loss", "min"


def curve(records: list[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    """(step, value) for each record holding `metric`, a finite number."""
    out = []
    for r in records:
        v = _number(r.get(metric))
        if v is not None and math.isfinite(v):
            out.append((int(r["step"]), v))
    return out


def view_run(run: Path, now: float | None = None) -> RunView:
    """One run directory as `flowctl runs` shows it."""
    now = time.time() if now is None else now
    info = _read_json(run / "run.json")
    info = info if isinstance(info, dict) else None
    spec = _resolved(run)
    records = read_metrics(run / "metrics.jsonl")
    metric, mode = _metric(spec)
    points = curve(records, metric)
    best = (min if mode == "min" else max)(points, key=lambda p: p[1]) if points else None  # the first of ties
    training = spec.get("training") if isinstance(spec.get("training"), dict) else {}
    i = info or {}
    planned = i.get("planned_steps", training.get("steps"))
    recorded = i.get("step") if isinstance(i.get("step"), int) else 0
    step = max([recorded, *(int(r["step"]) for r in records)])  # a live run's run.json lags its metrics
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    name = spec.get("name") or model.get("name")
    held = lock_held(run)
    status, detail = _status(i if info is not None else None, held)
    return RunView(path=str(run), spec=str(name or "?"), strategy=str(i.get("strategy") or "?"), step=step,
                   planned=planned if isinstance(planned, int) else None, metric=metric, mode=mode,
                   last=points[-1][1] if points else None, best=best[1] if best else None,
                   best_step=best[0] if best else None, seconds=_seconds(i, records, held, now),
                   status=status, detail=detail)


def _status(info: dict[str, Any] | None, held: bool) -> tuple[str, str]:
    if held:
        return "running", ""
    if info is None:
        return "unknown", "run.json unreadable"
    recorded = str(info.get("status"))
    if recorded in ENDED:
        detail = {"early_stopped": "stopped early", "interrupted": str(info.get("signal") or ""),
                  "failed": str(info.get("error") or "")}.get(recorded, "")
        return ENDED[recorded], detail
    return "interrupted", "process gone (stale lock)"  # says running, but nothing holds the lock


def _seconds(info: dict[str, Any], records: list[dict[str, Any]], held: bool, now: float) -> float | None:
    """Earlier processes' seconds, plus this one's: to now while it runs, to its last metrics line
    when it was killed. A run from before run.json kept them: its metrics' first to last time."""
    before = _number(info.get("seconds")) or 0.0
    started = _number(info.get("started"))
    times = [t for t in (_number(r.get("time")) for r in records) if t is not None]
    if started is None:
        return times[-1] - times[0] if len(times) > 1 else None
    if held:
        return before + max(0.0, now - started)
    if info.get("status") == "running":  # killed: its last sign of life is its last line
        return before + max(0.0, times[-1] - started) if times and times[-1] >= started else before
    return before


def list_runs(root: Path) -> list[RunView]:
    """`root` itself when it is a run directory, else each run directory in it, by name."""
    if not root.is_dir():
        raise FlowctlError(f"{root}: no such directory (train a run first: runs go to ./runs by default)")
    if (root / "run.json").exists():
        return [view_run(root)]
    now = time.time()
    return [view_run(p, now) for p in sorted(root.iterdir()) if p.is_dir() and (p / "run.json").exists()]


# ---------------------------------------------------------------------------- compare
def _yaml(v: Any, top: bool = True) -> str:
    """`v` as a YAML value that `--set` reads back as `v` (floats keep a '.', which YAML 1.1's
    float needs: 1e-08 would read as a string)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return ".nan"
        if math.isinf(v):
            return ".inf" if v > 0 else "-.inf"
        r = repr(v)
        if "e" in r and "." not in r.split("e")[0]:
            m, e = r.split("e")
            r = f"{m}.0e{e}"
        return r
    if isinstance(v, str):
        from flowctl.spec.source import load_yaml

        bare = top and v == v.strip() and v != "" and not any(c in v for c in "#{}[],&*!|>'\"%@`")
        try:
            bare = bare and load_yaml(v, filename="--set") == v
        except FlowctlError:
            bare = False
        return v if bare else json.dumps(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_yaml(x, False)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_yaml(x, False) for x in v) + "]"
    return json.dumps(v)


def _addressable(key: Any) -> bool:
    """A key `--set`'s dotted path can name: no dot, not empty, not a number (an index)."""
    return isinstance(key, str) and key != "" and "." not in key and "=" not in key and not key.lstrip("-").isdigit()


def set_lines(a: Any, b: Any, prefix: str = "") -> list[str]:
    """`--set KEY=VALUE` lines that turn resolved spec `a` into `b`: the leaves whose values differ,
    or the smallest mapping or list around them that a dotted path can set whole (keys added or
    removed, a list of another length, a key with a dot in it)."""
    if a == b:
        return []
    if isinstance(a, dict) and isinstance(b, dict) and (not prefix or set(a) == set(b)) \
            and all(_addressable(k) for k in set(a) | set(b)):
        out = []
        for k in [*b, *(k for k in a if k not in b)]:
            out += set_lines(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and prefix:
        names = [x.get("name") if isinstance(x, dict) else None for x in b]
        by_name = all(_addressable(n) for n in names) and len(set(names)) == len(names) and \
            names == [x.get("name") if isinstance(x, dict) else None for x in a]
        return [line for i, (x, y) in enumerate(zip(a, b))
                for line in set_lines(x, y, f"{prefix}.{names[i] if by_name else i}")]
    return [f"{prefix}={_yaml(b)}"]


@dataclass
class Comparison:
    a: RunView
    b: RunView
    set: list[str]  # --set lines that turn A's spec into B's
    curves: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)  # metric -> run -> points

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a.to_dict(), "b": self.b.to_dict(), "set": self.set,
                "curves": {m: {k: [list(p) for p in pts] for k, pts in c.items()} for m, c in self.curves.items()}}


def compare_runs(a: Path, b: Path) -> Comparison:
    """A and B's spec differences and their curves: the loss by step, and each run's keep_best
    metric (by evaluation) where both record it."""
    for p in (a, b):
        if not (p / "run.json").exists():
            raise FlowctlError(f"{p}: no run here (run.json missing)")
    views = view_run(a), view_run(b)
    records = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    metrics = ["loss"] + sorted({v.metric for v in views} - {"loss"})
    curves = {}
    for m in metrics:
        pts = {views[0].path: curve(records[0], m), views[1].path: curve(records[1], m)}
        if all(pts.values()):
            curves[m] = pts
    return Comparison(views[0], views[1], set_lines(_resolved(a), _resolved(b)), curves)
