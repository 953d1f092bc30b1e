"""The compiled loop of kernels/cpu/dropout.py (its docstring says what it computes), a module
global so that numba's on-disk cache finds it again in the next process (winograd_jit.py's
docstring says why). Imported on first use by `dropout._kernel()`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.kernels.cpu.jit import njit

SHIFT = np.uint32(8)  # a uniform keeps a 32-bit word's top 24 bits, numpy's `next_float`
UNIT = np.float32(2.0 ** -24)


@njit
def apply(x: Any, words: Any, rate: Any, scale: Any, y: Any, mask: Any) -> None:
    """For each element i of the 1-D arrays: u = (words[i] >> 8) * 2**-24 (float32, exact), mask[i]
    = scale where u >= rate else 0, y[i] = x[i] * mask[i]."""
    zero = scale - scale
    for i in range(x.shape[0]):
        u = np.float32(words[i] >> SHIFT) * UNIT
        m = scale if u >= rate else zero
        mask[i] = m
        y[i] = x[i] * m
