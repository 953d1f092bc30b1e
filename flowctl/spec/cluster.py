"""The spec's `devices:` as an engine `Cluster`, or a what-if cluster from profiles (`4xgpu:k40`).

CPU devices listed without a profile are *virtual* CPU devices of this machine: the cores are split
evenly between them (Cluster.local). A GPU device without a profile is this machine's GPU of that
index, as the driver describes it, where there is one; otherwise it is planned as a K40, the GPU of
the learned-placement paper.
"""
from __future__ import annotations

from typing import Any

from flowctl.engine.cluster import LINKS, Cluster, Device, DeviceProfile, Link, gpu_profile_for
from flowctl.engine.devices import parse_device


def cluster_for(spec: Any, devices: str | None = None) -> Cluster:
    """`devices` (a `--devices` string) wins over the spec's list."""
    if devices:
        return Cluster.from_spec(devices)
    entries = list(spec.devices)
    cpus = [e for e in entries if "device:cpu" in e.name]
    local = Cluster.local(max(1, len(cpus)))
    local_cpu = local.devices[0].profile
    out: list[Device] = []
    links: dict[tuple[str, str], Link] = {}
    for e in entries:
        is_gpu = "device:gpu" in e.name
        base = gpu_profile_for(e.name) if is_gpu else local_cpu
        p = e.profile
        prof = base if p is None else DeviceProfile(
            name=f"{base.name}*", type=base.type, peak_flops=p.peak_flops or base.peak_flops,
            mem_bandwidth=p.memory_bandwidth or base.mem_bandwidth, memory=p.memory or base.memory,
            op_overhead=base.op_overhead)
        out.append(Device(e.name, prof, threads=1 if is_gpu else local.devices[0].threads))
        for peer, link in e.links.items():
            links[(e.name, peer)] = Link(link.bandwidth, link.latency)
    if spec.cluster.type == "ray":  # tensors between worker tasks travel through Ray, unless the spec says
        for a in out:
            for b in out:
                if a.name < b.name and _task(a.name) != _task(b.name) and (a.name, b.name) not in links \
                        and (b.name, a.name) not in links:
                    links[(a.name, b.name)] = LINKS["ray"]
    default = local.default_link if not any("device:gpu" in e.name for e in entries) else Cluster.from_spec("gpu").default_link
    return Cluster(out, default_link=default, links=links)


def _task(name: str) -> tuple[str, int]:
    d = parse_device(name)
    return d.job, d.task
