"""How the compiled CPU kernels are compiled and run.

- numba's `njit`, compiled on first call per argument types, with `cache=True` (the machine code is
  kept beside the module, or in numba's user cache where that is read-only), so a second process
  loads instead of compiling; `nogil=True`, so flowctl's intra-op threads (kernels/intra.py) run
  pieces of one kernel on several cores at once.
- No numba threading (`parallel=True` and prange stay unused): its default layer is not safe across
  flowctl's device threads, and a reduction split by numba's scheduler would sum in an order that
  depends on the thread count. Pieces are fixed by the shapes alone and their partial sums are
  combined in piece order on the calling thread, so one thread and eight give the same bits (the
  contract of kernels/intra.py).
- No fastmath: the kernels round as the reference's numpy passes do, element by element.

`available()` is what a variant's rule asks: numba importable (a plain install carries it; the
GPU machines do too). `compiled(builder)` builds a module's kernels once, on first use.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from typing import Any, Callable

FLOAT_TYPES = ("float32", "float64")  # fp16/bf16 on the CPU stay on the numpy path
LANES = 16  # float32 values in one 512-bit vector register: a block of channels a kernel vectorises


@functools.cache
def available() -> bool:
    return importlib.util.find_spec("numba") is not None


@functools.cache
def wide_registers() -> bool:
    """The target numba compiles for has AVX-512's 32 vector registers of 512 bits (its features:
    NUMBA_CPU_FEATURES where set, else the host's): the register blocks' shapes and the rules of
    the kernels built on them (gemm_jit.py, recurrent.py, conv.py's direct pass) ask this."""
    from numba.core import config

    features = config.CPU_FEATURES
    if features is None:
        from llvmlite import binding

        features = binding.get_host_cpu_features().flatten()
    return "+avx512f" in features.split(",")


_said = {"cache": False}


@functools.cache
def _cache_writes_may_fail() -> None:
    """A JIT cache that cannot be written (a full disk, a file-size limit, a read-only tree) costs
    the next process a compile, never this step: numba raises the OSError from the kernel's first
    call, after the machine code is already in memory. Said once on stderr."""
    from numba.core import caching  # type: ignore[import-untyped]

    save = caching.Cache.save_overload

    def save_overload(self: Any, sig: Any, data: Any) -> None:
        try:
            save(self, sig, data)
        except OSError as e:
            if not _said["cache"]:
                _said["cache"] = True
                print(f"flowctl: the compiled kernels' cache could not be written ({e.strerror or e}); "
                      f"they will be compiled again in the next process", file=sys.stderr)

    caching.Cache.save_overload = save_overload


def njit(fn: Callable[..., Any] | None = None, *, inline: bool = False) -> Any:
    """fn compiled as every kernel here is: cached, without the GIL, exact arithmetic. `inline`
    (as `@njit(inline=True)`): a helper numba inlines into its callers at the IR level, so the
    caller's loops see its arithmetic (vectorised with theirs) instead of a call."""
    import numba  # type: ignore[import-untyped]

    _cache_writes_may_fail()

    def build(f: Callable[..., Any]) -> Any:
        return numba.njit(cache=True, nogil=True, fastmath=False, error_model="numpy",
                          inline="always" if inline else "never")(f)

    return build if fn is None else build(fn)


def compiled(builder: Callable[[], Any]) -> Callable[[], Any]:
    """builder() once, on first call: a module's kernels, defined inside it so numba is imported
    only when one is wanted."""
    return functools.cache(builder)


def floats_nhwc(ins: Any, positions: tuple[int, ...] = (0,)) -> bool:
    """Rule: numba present and the inputs at `positions` rank-4 float32/float64 (NHWC)."""
    if not available():
        return False
    try:
        return all(ins[i].dtype in FLOAT_TYPES and len(ins[i].shape) == 4 for i in positions)
    except (IndexError, TypeError):
        return False
