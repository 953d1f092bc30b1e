"""Device names (whitepaper §3 "Devices"): canonical `/job:NAME/task:N/device:TYPE:I` strings.

The spec may write `cpu:0`, `gpu:1` or `worker1/gpu:0`; everything past the loader sees canonical
names. A partial constraint such as `gpu` or `/job:worker` matches many devices (§4.3).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from flowctl.engine.errors import PlacementError

DEFAULT_JOB = "localhost"
_FULL = re.compile(r"^/job:(?P<job>[\w-]+)/task:(?P<task>\d+)/device:(?P<type>cpu|gpu):(?P<index>\d+)$")
_SHORT = re.compile(r"^(?:(?P<job>[A-Za-z_][\w-]*?)(?P<task>\d*)/)?(?P<type>cpu|gpu)(?::(?P<index>\d+))?$")


@dataclass(frozen=True)
class DeviceName:
    job: str
    task: int
    type: str
    index: int

    def __str__(self) -> str:
        return f"/job:{self.job}/task:{self.task}/device:{self.type}:{self.index}"


def parse_device(name: str) -> DeviceName:
    """Parse a full or short device name; raises PlacementError on anything else."""
    s = name.strip().lower()
    m = _FULL.match(s)
    if m:
        return DeviceName(m["job"], int(m["task"]), m["type"], int(m["index"]))
    m = _SHORT.match(s)
    if m:
        job = m["job"] or DEFAULT_JOB
        task = int(m["task"]) if m["task"] else 0
        return DeviceName(job, task, m["type"], int(m["index"] or 0))
    raise PlacementError(f"cannot read device name {name!r}: write e.g. 'cpu:0', 'gpu:1', 'worker1/gpu:0' "
                         f"or '/job:worker/task:1/device:gpu:0'")


def canonical(name: str) -> str:
    return str(parse_device(name))


def device_type(name: str) -> str:
    return parse_device(name).type


@functools.lru_cache(maxsize=None)
def spec_name(name: str) -> str:
    """The device as a spec writes it, for people to read: `cpu:1` in this process, `worker1/cpu:0`
    on another task (two workers' `cpu:0` are two devices); the canonical name where a short one
    would read back as another device (a job whose name ends in a digit)."""
    d = parse_device(name)
    if (d.job, d.task) == (DEFAULT_JOB, 0):
        return f"{d.type}:{d.index}"
    short = f"{d.job}{d.task}/{d.type}:{d.index}"
    return short if parse_device(short) == d else str(d)


CPU0 = canonical("cpu:0")


_PARTIAL_FULL = re.compile(r"^(?:/job:(?P<job>[\w-]+))?(?:/task:(?P<task>\d+))?"
                           r"(?:/device:(?P<type>cpu|gpu)(?::(?P<index>\d+))?)?$")


def parse_constraint(spec: str) -> dict[str, str | int]:
    """A partial device constraint (§4.3) as the fields it fixes: 'gpu' fixes the type only,
    'gpu:1' type and index, 'worker1/gpu' job, task and type, '/job:worker' the job."""
    s = spec.strip().lower()
    if not s:
        return {}
    m = _PARTIAL_FULL.match(s) if s.startswith("/") else None
    if m is None:
        m = _SHORT.match(s)
        if m is None:
            raise PlacementError(f"cannot read device constraint {spec!r}")
        out: dict[str, str | int] = {"type": m["type"]}
        if m["index"] is not None:
            out["index"] = int(m["index"])
        if m["job"]:
            out["job"] = m["job"]
            out["task"] = int(m["task"] or 0)
        return out
    return {k: (int(v) if k in ("task", "index") else v) for k, v in m.groupdict().items() if v is not None}


def device_matches(constraint: str, device: str) -> bool:
    d = parse_device(device)
    return all(getattr(d, k) == v for k, v in parse_constraint(constraint).items())


@functools.lru_cache(maxsize=None)
def short_device(device: str) -> str:
    """`cpu1` for /job:localhost/task:0/device:cpu:1; `worker2_gpu0` for other jobs and tasks: the
    device's part of the names the partitioner gives the nodes it adds."""
    d = parse_device(device)
    base = f"{d.type}{d.index}"
    return base if (d.job, d.task) == ("localhost", 0) else f"{d.job}{d.task}_{base}"
