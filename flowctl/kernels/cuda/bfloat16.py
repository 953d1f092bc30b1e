"""bfloat16 in our own numba-cuda kernels: arrays passed as their uint16 bit patterns (numba-cuda has
no bfloat16 array type, and its CUDA simulator no bfloat16 at all), converted in the kernel by
arithmetic that the simulator runs as it is (math.ldexp and math.frexp, which numba-cuda lowers to
libdevice's ldexpf and frexpf; ldexp's exponent is an int32 there and a Python int in the simulator).

- `widen(u)`: the float32 a bfloat16 pattern stands for, exactly (normal, subnormal, zeros,
  infinities; a NaN pattern gives a NaN).
- `narrow(v)`: float32 to the nearest bfloat16 pattern, ties to even: what ml_dtypes and cupy's
  conversion give (tests/test_cuda_kernels.py checks every class of value against ml_dtypes),
  overflow to infinity, a NaN to the quiet NaN 0x7FC0.
- `ld`, `st`, `kept`: a 2-D uint16 array's element as the LSTM cell kernels take them (kernels.py).

So a kernel of ours computes on bfloat16 as kernels/bf16.py's rule says every op does: its float32
arithmetic on widened inputs, each stored output rounded once.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np


@functools.cache
def device_functions() -> Any:
    """numba-cuda device functions `widen(u)` and `narrow(v)` (numba imported on first use)."""
    from types import SimpleNamespace

    from flowctl.kernels.cuda.jit import numba_cuda, simulated

    cuda = numba_cuda()
    f32, i32, u16 = np.float32, np.int32, np.uint16
    # ldexp's exponent: an int32 for numba-cuda's ldexpf signature, a Python int for the simulator's math
    power = int if simulated() else np.int32
    inf, nan, one = f32(np.inf), f32(np.nan), f32(1.0)

    @cuda.jit(device=True)
    def widen(u: Any) -> Any:
        e = i32((u >> 7) & 0xFF)
        m = i32(u & 0x7F)
        if e == 255:
            v = inf if m == 0 else nan
        elif e == 0:
            v = f32(math.ldexp(f32(m), power(-133)))  # subnormal: m units of 2**-133
        else:
            v = f32(math.ldexp(f32(m + 128), power(e - 134)))  # (1 + m/128) * 2**(e - 127)
        return -v if (u >> 15) & 1 else v

    @cuda.jit(device=True)
    def nearest_even(x: Any) -> Any:
        """round(x) for x >= 0, a half to the even neighbour (x - floor(x) is exact here)."""
        q = i32(math.floor(x))
        d = x - q
        if d > 0.5 or (d == 0.5 and (q & 1) == 1):
            q += 1
        return q

    @cuda.jit(device=True)
    def narrow(v: Any) -> Any:
        if v != v:
            return u16(0x7FC0)
        sign = i32(0x8000) if v < 0 or (v == 0 and math.copysign(one, v) < 0) else i32(0)
        a = abs(v)
        if a == inf:
            return u16(sign | 0x7F80)
        if a == 0:
            return u16(sign)
        m, e = math.frexp(a)  # a = m * 2**e, 0.5 <= m < 1: exponent e - 1
        if e >= -125:  # a normal bfloat16: 8 significant bits, m * 256 in [128, 256)
            q = nearest_even(f32(m) * f32(256.0))
            field = i32(e - 1 + 127)
            if q == 256:
                q = i32(128)
                field += 1
            if field >= 255:
                return u16(sign | 0x7F80)
            return u16(sign | (field << 7) | (q - 128))
        q = nearest_even(f32(math.ldexp(a, power(133))))  # subnormal units; 128 is the smallest normal
        return u16(sign | q)

    # A kernel's element [b, j] of a uint16 array: read as float32; written rounded; and, once
    # written, the float32 value itself (the rule rounds outputs, not what the kernel goes on with).
    @cuda.jit(device=True)
    def ld(a: Any, b: Any, j: Any) -> Any:
        return widen(a[b, j])

    @cuda.jit(device=True)
    def st(a: Any, b: Any, j: Any, v: Any) -> None:
        a[b, j] = narrow(v)

    @cuda.jit(device=True)
    def kept(a: Any, b: Any, j: Any, v: Any) -> Any:
        return v

    return SimpleNamespace(widen=widen, narrow=narrow, ld=ld, st=st, kept=kept)
