"""What CPU a benchmark ran on, recorded beside its figures: the same code measured 0.85-0.98 of
PyTorch on a 2-core AMD EPYC (AVX2) and 1.12-1.23 on a 2-core Xeon with AVX-512 (2026-12-07),
so a ratio says little without the host it came from."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# Vector extensions by width, widest first, as Linux's /proc/cpuinfo names them
ISAS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("asimd", "NEON"), ("sse4_2", "SSE4.2"))


def _cpuinfo(text: str | None = None) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _l2_kib() -> int | None:
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in sorted(root.glob("index*")):
            if (index / "level").read_text().strip() == "2":
                text = (index / "size").read_text().strip().upper()
                return int(text.rstrip("KM")) * (1024 if text.endswith("M") else 1)
    except (OSError, ValueError):
        pass
    return None


def describe(cpuinfo: str | None = None) -> dict[str, Any]:
    """{"cpu": model name, "vector_isa": the widest vector extension, "l2_kib": one core's L2
    (None where unknown), "cpus": logical CPUs}."""
    info = _cpuinfo(cpuinfo)
    flags = set((info.get("flags") or info.get("Features") or "").split())
    isa = next((name for flag, name in ISAS if flag in flags), platform.machine() or "unknown")
    model = info.get("model name") or info.get("Model") or platform.processor() or platform.machine() or "unknown"
    return {"cpu": model, "vector_isa": isa, "l2_kib": _l2_kib(), "cpus": os.cpu_count()}


def line(host: dict[str, Any]) -> str:
    """'Intel(R) Xeon(R) Processor, AVX-512, 2 MiB L2 a core'."""
    l2 = host.get("l2_kib")
    size = "" if not l2 else (f", {l2 // 1024} MiB L2 a core" if l2 % 1024 == 0 else f", {l2} KiB L2 a core")
    return f"{host.get('cpu', 'unknown')}, {host.get('vector_isa', 'unknown')}{size}"
