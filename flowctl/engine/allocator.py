"""Host memory for kernel outputs: freed buffers stay in the process heap for the next step.

numpy takes every array from malloc. glibc serves a large request with a fresh mmap until a free
raises its mmap threshold, and then trims the top of the heap whenever more than twice that
threshold lies free there, which a step's several large temporaries (an LSTM's per-step weight
gradients, the logits) do every step: the pages go back to the kernel and are faulted in, newly
zeroed, on the next step, about 40,000 minor page faults per lstm_lm step. Device threads fault
concurrently and serialise on the kernel's memory-map lock, which shows as step times 30-80%
above the median now and then. TensorFlow's answer is its own allocator that keeps what it took
(BFC); ours is to tell malloc to keep it: requests up to the largest mmap threshold glibc allows
come from the heap, and the heap is never trimmed, so the same memory is reused step after step.
The cost is the process's resident size staying at its peak, as with any caching allocator.
Setting the mmap threshold alone would be worse than nothing (fixing it also fixes the trim
threshold at its small default), so all three settings go together.

`tune()` is idempotent and a no-op off glibc or with FLOWCTL_MALLOC=system.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)  # glibc's ceiling: 32 MiB on 64-bit
TRIM_THRESHOLD = 1 << 40  # never give the heap back

_state: dict[str, bool] = {}


def tune() -> bool:
    """Make malloc keep and reuse large buffers (see the module doc). True when it took effect."""
    if "done" in _state:
        return _state["done"]
    ok = False
    if sys.platform.startswith("linux") and os.environ.get("FLOWCTL_MALLOC", "").lower() != "system":
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            mallopt.restype = ctypes.c_int
            ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
                mallopt(M_TRIM_THRESHOLD, ctypes.c_int(min(TRIM_THRESHOLD, 2**31 - 1)).value)) and bool(
                mallopt(M_TOP_PAD, 64 << 20))
        except (OSError, AttributeError):  # not glibc (musl, macOS): leave malloc as it is
            ok = False
    _state["done"] = ok
    return ok
