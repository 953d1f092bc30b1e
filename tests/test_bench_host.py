"""The host a benchmark ran on (flowctl/bench/host.py): model, widest vector extension and L2 read
from /proc/cpuinfo and sysfs, and printed beside the BLAS peak."""
from __future__ import annotations

from flowctl.bench import host

XEON = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Processor
flags		: fpu sse sse2 avx avx2 fma avx512f avx512bw amx_tile

processor	: 1
model name	: another
"""
EPYC = """processor	: 0
model name	: AMD EPYC 7B13
flags		: fpu sse sse2 sse4_2 avx avx2 fma
"""
GRAVITON = """processor	: 0
BogoMIPS	: 243.75
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32
"""


def test_the_widest_vector_extension_and_the_first_processors_model() -> None:
    x = host.describe(XEON)
    assert (x["cpu"], x["vector_isa"]) == ("Intel(R) Xeon(R) Processor", "AVX-512")
    assert host.describe(EPYC)["vector_isa"] == "AVX2"
    assert host.describe(GRAVITON)["vector_isa"] == "NEON"
    here = host.describe()
    assert here["cpus"] >= 1 and here["cpu"] and here["vector_isa"]
    assert here["l2_kib"] is None or here["l2_kib"] >= 64


def test_the_line_says_the_l2_in_its_unit() -> None:
    assert host.line({"cpu": "X", "vector_isa": "AVX2", "l2_kib": 512}) == "X, AVX2, 512 KiB L2 a core"
    assert host.line({"cpu": "X", "vector_isa": "AVX-512", "l2_kib": 2048}) == "X, AVX-512, 2 MiB L2 a core"
    assert host.line({"cpu": "X", "vector_isa": "AVX-512", "l2_kib": None}) == "X, AVX-512"
