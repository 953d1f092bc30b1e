"""Ray clusters for the distributed engine (whitepaper §3.3; ARCHITECTURE "Distribution").

Joining or starting Ray, the devices of worker tasks as an engine `Cluster`, and the Ray resources
that pin each task's actor to a node able to hold its devices. Every failure to get a usable cluster
(a bad address, a Ray version mismatch, a resource no node has) is a `PlacementError` (exit 4) with
one message: the cluster cannot hold the placement.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from flowctl.engine.cluster import LINKS, PROFILES, Cluster, Device, Link, gpu_profile_for
from flowctl.engine.devices import canonical, parse_device
from flowctl.engine.errors import PlacementError

WORKER_JOB = "worker"
_ADDRESS = re.compile(r"^(auto|ray://[\w.-]+:\d+|[\w.-]+:\d+)$")


@dataclass
class TaskSpec:
    """One worker task: its devices (canonical) and the Ray resources its actor asks for."""

    task: int
    devices: list[str]
    num_cpus: float
    num_gpus: float
    resources: dict[str, float] = field(default_factory=dict)

    @property
    def needs(self) -> dict[str, float]:
        out = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v for k, v in out.items() if v}


def worker_cluster(devices: Sequence[str], threads: int = 1, link: Link | None = None) -> Cluster:
    """The devices of worker tasks (`worker0/cpu:0`, `worker1/gpu:0`, ...) as a `Cluster`: a CPU
    device gets `threads` cores, a GPU is planned as the spec's rule has it (a K40 when remote);
    links between tasks cost a Ray transfer (`link`, LINKS["ray"] by default), links within a task
    the in-process hop."""
    names = list(dict.fromkeys(canonical(d) for d in devices))
    core = PROFILES["cpu_core"]
    out = []
    for name in names:
        d = parse_device(name)
        if d.job != WORKER_JOB:
            raise PlacementError(f"device {name} is not on a worker task: write e.g. 'worker0/cpu:0' "
                                 f"(/job:{WORKER_JOB}/task:N/device:...)")
        if d.type == "cpu":
            from flowctl.engine.cluster import DeviceProfile

            prof = DeviceProfile(f"cpu_x{threads}", "cpu", core.peak_flops * threads, core.mem_bandwidth,
                                 core.memory, core.op_overhead)
            out.append(Device(name, prof, threads=threads))
        else:
            out.append(Device(name, gpu_profile_for(name)))
    remote = link or LINKS["ray"]
    links = {(a, b): remote for a in names for b in names
             if a < b and parse_device(a).task != parse_device(b).task}
    return Cluster(out, default_link=LINKS["local"], links=links)


def tasks_of(cluster: Cluster, resources: Mapping[int, Mapping[str, float]] | None = None) -> list[TaskSpec]:
    """The cluster's worker tasks in task order. A task asks Ray for one GPU per GPU device, its
    CPU devices' threads (at least one CPU), and `resources[task]` (custom resources that pin it to
    chosen nodes, e.g. {"node:10.0.0.2": 0.01} or a label given to `ray start --resources`)."""
    by_task: dict[int, list[str]] = {}
    for dev in cluster.devices:
        d = parse_device(dev.name)
        if d.job != WORKER_JOB:
            raise PlacementError(f"a Ray session runs worker tasks only; device {dev.name} is on job '{d.job}' "
                                 f"(write it as 'worker{d.task}/{d.type}:{d.index}')")
        by_task.setdefault(d.task, []).append(dev.name)
    extra = dict(resources or {})
    unknown = sorted(set(extra) - set(by_task))
    if unknown:
        raise PlacementError(f"resources are given for task(s) {unknown}, which have no device; "
                             f"tasks: {sorted(by_task)}")
    out = []
    for task in sorted(by_task):
        devs = [cluster.device(n) for n in by_task[task]]
        cpus = sum(d.threads for d in devs if d.type == "cpu")
        gpus = sum(1 for d in devs if d.type == "gpu")
        out.append(TaskSpec(task, by_task[task], float(max(1, cpus)), float(gpus),
                            {k: float(v) for k, v in extra.get(task, {}).items()}))
    return out


def task_resources(by_name: Mapping[str, Mapping[str, float]]) -> dict[int, dict[str, float]]:
    """The spec's `cluster.resources` ({"worker1": {"gpu_box": 1}}) keyed by task index."""
    out = {}
    for key, res in by_name.items():
        m = re.fullmatch(r"worker(\d+)", key)
        if m is None:
            raise PlacementError(f"resources are keyed by worker task ('worker0', 'worker1', ...), not {key!r}")
        out[int(m[1])] = {k: float(v) for k, v in res.items()}
    return out


def connect(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None,
            temp_dir: str | None = None, object_store_memory: int | None = None) -> bool:
    """Make this process a Ray driver: join the cluster at `address` ('auto', 'ray://host:10001' or
    'host:6379'), or with None start a local one with `num_cpus` CPUs. Already connected: nothing
    is done. True when this call started or joined (the caller then shuts Ray down)."""
    if address is not None and not _ADDRESS.match(address):
        raise PlacementError(f"cannot read Ray address {address!r}: write 'auto', 'ray://HOST:10001' or "
                             f"'HOST:6379' (or leave it out to start a local cluster)")
    if address is not None and address != "auto":
        _reachable(address)
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if address is None:
        kwargs.update(num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=object_store_memory)
        if temp_dir is not None:
            kwargs["_temp_dir"] = temp_dir
    else:
        kwargs["address"] = address
    try:
        ray.init(**kwargs)
    except Exception as e:  # noqa: BLE001 -- any failure to get a cluster is one placement error
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = f"at {address}" if address else "locally"
        hint = (" (the cluster runs another Ray version: install the same one here)"
                if "version" in str(e).lower() else "")
        raise PlacementError(f"cannot {'start' if address is None else 'join'} a Ray cluster {where}: "
                             f"{first}{hint}") from None
    return True


def _reachable(address: str, timeout: float = 5.0) -> None:
    """Fail at once on an address nothing listens at (Ray itself would retry for minutes)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise PlacementError(f"cannot join a Ray cluster at {address}: nothing answers at {host}:{port} "
                             f"({e.strerror or e}); start one there with `ray start --head` or fix the "
                             f"address") from None


def check_resources(tasks: Sequence[TaskSpec]) -> list[dict[str, Any]]:
    """Every task must fit on some live node of the cluster (by its total resources); otherwise one
    PlacementError naming the task, what it asks for and what the nodes have. Returns the nodes."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for t in tasks:
        if not any(all(n["Resources"].get(k, 0.0) >= v for k, v in t.needs.items()) for n in nodes):
            have = "; ".join(f"{n.get('NodeManagerAddress', '?')}: " + ", ".join(
                f"{k}={v:g}" for k, v in sorted(n["Resources"].items())
                if not k.startswith(("node:", "memory", "object_store_memory"))) for n in nodes)
            asks = ", ".join(f"{k}={v:g}" for k, v in t.needs.items())
            raise PlacementError(f"worker task {t.task} ({', '.join(t.devices)}) needs {asks}, but no node of "
                                 f"the Ray cluster has that; nodes: {have or 'none'}")
    return nodes
