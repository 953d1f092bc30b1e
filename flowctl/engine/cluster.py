"""Devices, device profiles and clusters (whitepaper §3 "Devices", §3.2).

A `Cluster` is the list of devices plus the links between them. The same object serves the runtime
(which devices exist and how many threads each may use) and the simulator (how fast each device
computes and each link moves bytes). A `DeviceProfile` can describe hardware that is not present,
so `4xgpu:k40` is a cluster one can plan for on a laptop.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace

from flowctl.engine.devices import canonical, parse_device
from flowctl.engine.errors import PlacementError, did_you_mean
from flowctl.kernels import registry as kernels

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceProfile:
    """Roofline figures for one device: an op takes max(flops / peak_flops, bytes / mem_bandwidth)
    plus a fixed dispatch overhead."""

    name: str
    type: str  # "cpu" | "gpu"
    peak_flops: float  # FLOP/s (float32)
    mem_bandwidth: float  # bytes/s
    memory: int  # bytes
    op_overhead: float = 5e-6  # s per op: kernel launch or Python dispatch
    bus: str = "pcie3"  # the host interface (a LINKS key) two such GPUs talk over by default


def detected_gpu_profile(index: int) -> DeviceProfile | None:
    """The profile of this machine's GPU `index`, or None where there is none. Peak float32 FLOP/s
    is multiprocessors x float32 lanes x 2 x clock, memory bandwidth 2 x memory clock x bus width;
    where the runtime reports no clocks, the published figures of a known model by name."""
    p = kernels.gpu_properties(index)
    if p is None:
        return None
    known = next((k for k in PROFILES if PROFILES[k].type == "gpu" and k in p["name"].lower()), None)
    lanes = 64 if p["capability"] in ((6, 0), (7, 0), (7, 5), (8, 0)) else 128
    flops = p["multiprocessors"] * lanes * 2 * p["clock_khz"] * 1e3
    bandwidth = 2 * p["memory_clock_khz"] * 1e3 * p["bus_bits"] / 8
    bus = "pcie3"
    if known is not None:
        bus = PROFILES[known].bus
        flops = flops or PROFILES[known].peak_flops
        bandwidth = bandwidth or PROFILES[known].mem_bandwidth
    elif not flops or not bandwidth:
        return None  # an unknown model with no clocks: better the documented default than a guess
    slug = re.sub(r"[^a-z0-9]+", "_", p["name"].lower()).strip("_")
    return DeviceProfile(slug, "gpu", float(flops), float(bandwidth), p["memory"] or 16 * GiB, 5e-6, bus)


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s
    latency: float  # s


# Published peak figures (float32, boost clock), memory sizes and host interfaces (each GPU's
# PCIe generation: a K40 to a V100 PCIe 3.0 x16, an A100 PCIe 4.0, an H100 PCIe 5.0); link figures
# are typical effective rates per direction (PCIe 3.0 x16 about 12 GB/s, 4.0 about 24, 5.0 about 50
# -- published peer-to-peer measurements of Gen5 x16 pairs give 50-56 GB/s of 63 -- and NVLink 2.0
# about 25 GB/s per link).
PROFILES: dict[str, DeviceProfile] = {
    "k40": DeviceProfile("k40", "gpu", 4.29e12, 288e9, 12 * GiB, 8e-6, "pcie3"),
    "k80": DeviceProfile("k80", "gpu", 4.37e12, 240e9, 12 * GiB, 8e-6, "pcie3"),
    "p100": DeviceProfile("p100", "gpu", 9.3e12, 732e9, 16 * GiB, 6e-6, "pcie3"),
    "v100": DeviceProfile("v100", "gpu", 15.7e12, 900e9, 16 * GiB, 5e-6, "pcie3"),
    "a100": DeviceProfile("a100", "gpu", 19.5e12, 1555e9, 40 * GiB, 5e-6, "pcie4"),
    "h100": DeviceProfile("h100", "gpu", 67e12, 3350e9, 80 * GiB, 4e-6, "pcie5"),
    # One modern server core with AVX2 FMA: 2 FMA units x 8 float32 lanes x 2 FLOP x ~3 GHz.
    "cpu_core": DeviceProfile("cpu_core", "cpu", 96e9, 10e9, 8 * GiB, 3e-6),
}


def gpu_profile_for(name: str) -> DeviceProfile:
    """The profile a spec's GPU device without one is planned with: this machine's GPU of that
    index as the driver describes it, for a device of this process; otherwise a K40, the GPU of
    the learned-placement paper."""
    d = parse_device(name)
    found = detected_gpu_profile(d.index) if (d.job, d.task) == ("localhost", 0) else None
    return found or PROFILES["k40"]


LINKS: dict[str, Link] = {
    "pcie3": Link(12e9, 10e-6),
    "pcie4": Link(24e9, 10e-6),
    "pcie5": Link(50e9, 10e-6),
    "nvlink": Link(25e9, 5e-6),  # NVLink 2.0, one link (a V100 pair in a DGX-1's hybrid cube mesh)
    # Through NVSwitch every pair has a GPU's whole NVLink bandwidth; the published figures per
    # direction (A100: 12 links, 300 GB/s; H100: 18 links, 450 GB/s), not measured here.
    "nvlink3": Link(300e9, 5e-6),
    "nvlink4": Link(450e9, 5e-6),
    # Between virtual CPU devices of one process: no copy (arrays are shared), but a Send/Recv hop
    # costs a rendezvous and a wake-up of the other device's thread: measured 33-35 µs per hop on a
    # 50-hop ping-pong between two devices on the 2-core CI machine.
    "local": Link(20e9, 33e-6),
    # Between machines: typical effective rates per direction of 10 and 100 Gb/s Ethernet (about 88%
    # of the line rate once framing and TCP are paid: 1.1 of 1.25 GB/s, 11 of 12.5), not measured here.
    "ethernet10g": Link(1.1e9, 50e-6),
    "ethernet100g": Link(11e9, 20e-6),
    # Between two Ray worker processes of one machine (the distributed engine's cross-task Send/Recv:
    # an actor call carrying the tensor up to 100 KiB; above, the sender's ray.put and the call
    # carrying its ref, read zero-copy by the receiver): measured by `python -m flowctl.bench.ray` on
    # the shared 2-core CI machine, 0.91-1.65 ms per 4-byte crossing; beyond that, 1.2-1.3 GB/s for a
    # 4 MiB tensor (0.8-1.0 under load; the chain's best runs 1.8) and 5.5-5.9 GB/s for 64 MiB. The
    # 4 MiB rate is the one here: the sender's ray.put costs 1.4-3 ms whatever the size below a few
    # MiB (Ray's calls to its raylet), which a per-byte rate can only spread over the bytes. Across
    # machines the network adds its own.
    "ray": Link(1.2e9, 1.0e-3),
}


def bus_link(profiles: list[DeviceProfile]) -> Link:
    """The link GPUs of these profiles share by default: the slowest of their host interfaces
    (PCIe 3.0 where there is no GPU)."""
    return min((LINKS[p.bus] for p in profiles if p.type == "gpu"), key=lambda k: k.bandwidth,
               default=LINKS["pcie3"])


@dataclass
class Device:
    name: str  # canonical
    profile: DeviceProfile
    threads: int = 1  # execution threads (and BLAS threads) this device may use

    @property
    def type(self) -> str:
        return self.profile.type


@dataclass
class Cluster:
    devices: list[Device]
    default_link: Link = field(default_factory=lambda: LINKS["local"])
    links: dict[tuple[str, str], Link] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise PlacementError(f"cluster names a device twice: {names}")
        self._by_name = {d.name: d for d in self.devices}

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.devices]

    def device(self, name: str) -> Device:
        try:
            return self._by_name[canonical(name)]
        except KeyError:
            raise PlacementError(f"no device {name} in this cluster; devices: {', '.join(self.names)}") from None

    def link(self, src: str, dst: str) -> Link:
        if src == dst:
            return Link(float("inf"), 0.0)
        return self.links.get((src, dst)) or self.links.get((dst, src)) or self.default_link

    # ------------------------------------------------------------------ constructors
    @classmethod
    def local(cls, virtual_cpus: int = 1, threads: int | None = None) -> "Cluster":
        """This machine's CPU split into `virtual_cpus` devices of equal thread counts (at least one
        each), so model parallelism is real without a GPU."""
        cores = threads or os.cpu_count() or 1
        per = max(1, cores // virtual_cpus)
        core = PROFILES["cpu_core"]
        devices = [Device(canonical(f"cpu:{i}"),
                          DeviceProfile(f"cpu_x{per}", "cpu", core.peak_flops * per, core.mem_bandwidth,
                                        core.memory, core.op_overhead), threads=per)
                   for i in range(virtual_cpus)]
        return cls(devices, default_link=LINKS["local"])

    @classmethod
    def from_spec(cls, text: str) -> "Cluster":
        """What-if clusters from profiles: `4xgpu:k40`, `2xgpu:v100+cpu`, `gpu:p100,gpu:p100`.
        Devices are numbered per type in order; GPUs are linked by PCIe of their own generation
        (the slowest of the GPUs named: `gpu:k40+gpu:h100` talk at PCIe 3.0 rates) unless a link
        follows, `4xgpu:h100@nvlink`.
        A memory size after the profile caps each device's memory: `4xgpu:k40:2GiB` (GiB, MiB)."""
        devices: list[Device] = []
        counters: dict[str, int] = {}
        link: Link | None = None
        for part in re.split(r"[,+]", text.replace(" ", "")):
            if not part:
                continue
            if "@" in part:
                part, link_name = part.split("@", 1)
                if link_name not in LINKS:
                    raise PlacementError(f"unknown link '{link_name}'{did_you_mean(link_name, LINKS)} "
                                         f"(known: {', '.join(LINKS)})")
                link = LINKS[link_name]
            m = re.fullmatch(r"(?:(\d+)x)?(cpu|gpu)(?::([a-z]\w*))?(?::(\d+(?:\.\d+)?)(GiB|MiB))?", part)
            if m is None:
                raise PlacementError(f"cannot read device group '{part}': write e.g. '4xgpu:k40', "
                                     f"'4xgpu:k40:2GiB' or 'cpu'")
            count, dtype, prof = int(m[1] or 1), m[2], m[3]
            cap = int(float(m[4]) * (GiB if m[5] == "GiB" else 1 << 20)) if m[4] else None
            if prof is None:
                prof = "k40" if dtype == "gpu" else "cpu_core"
            if prof not in PROFILES:
                raise PlacementError(f"unknown device profile '{prof}'{did_you_mean(prof, PROFILES)} "
                                     f"(known: {', '.join(PROFILES)})")
            if PROFILES[prof].type != dtype:
                raise PlacementError(f"profile '{prof}' describes a {PROFILES[prof].type}, not a {dtype}")
            profile = PROFILES[prof] if cap is None else replace(PROFILES[prof], memory=cap)
            for _ in range(count):
                idx = counters.get(dtype, 0)
                counters[dtype] = idx + 1
                devices.append(Device(canonical(f"{dtype}:{idx}"), profile))
        if not devices:
            raise PlacementError(f"no devices in '{text}'")
        return cls(devices, default_link=link or bus_link([d.profile for d in devices]))

    def describe(self) -> list[dict[str, object]]:
        return [{"name": d.name, "profile": d.profile.name, "type": d.type, "threads": d.threads,
                 "peak_gflops": d.profile.peak_flops / 1e9, "memory_gib": d.profile.memory / GiB}
                for d in self.devices]


def device_index(name: str) -> int:
    return parse_device(name).index
