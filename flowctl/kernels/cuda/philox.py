"""Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; Random123),
the project's one counter-based generator for random numbers made on a GPU: a numpy reference
(vectorised) and a numba-cuda device function with the same output, word for word.

The stream (`uniform`): output element i of draw n of an op whose 64-bit seed is s uses

    key     = (s mod 2**32, s >> 32)
    counter = (i // 4 mod 2**32, i // 4 >> 32, n mod 2**32, n >> 32)

and takes word i % 4 of the block, as a float32 uniform in [0, 1): (word >> 8) * 2**-24. The
numbers are keyed by the op (its seed), the draw and the element's index, never by how a kernel's
threads are laid out: any launch configuration, and the numpy reference, gives the same ones.

Arithmetic is done in uint64 throughout (each 32x32-bit product is exact in 64 bits; sums are masked
back to 32 bits), so numpy scalars in the CUDA simulator never overflow and numba never mixes signed
and unsigned integers (which it would type as float64)."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # the key bumps (the golden ratio, sqrt(3) - 1)
ROUNDS = 10
_MASK = 0xFFFFFFFF
UNIFORM_SCALE = 2.0 ** -24


def philox4x32(counter: Any, key: Any, rounds: int = ROUNDS) -> np.ndarray:
    """Philox4x32-`rounds` of each counter (shape (..., 4)) under its key (shape (..., 2), broadcast
    against the counters): uint32 words of shape (..., 4)."""
    c = np.asarray(counter, dtype=np.uint64)
    k = np.asarray(key, dtype=np.uint64)
    shape = np.broadcast_shapes(c.shape[:-1], k.shape[:-1])
    c0, c1, c2, c3 = (np.broadcast_to(c[..., j], shape).copy() for j in range(4))
    k0, k1 = (np.broadcast_to(k[..., j], shape).copy() for j in range(2))
    m0, m1, mask, s32 = np.uint64(M0), np.uint64(M1), np.uint64(_MASK), np.uint64(32)
    for r in range(rounds):
        if r:
            k0 = (k0 + np.uint64(W0)) & mask
            k1 = (k1 + np.uint64(W1)) & mask
        p0 = c0 * m0
        p1 = c2 * m1
        c0, c1, c2, c3 = (p1 >> s32) ^ c1 ^ k0, p1 & mask, (p0 >> s32) ^ c3 ^ k1, p0 & mask
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def split64(x: int) -> tuple[int, int]:
    """A 64-bit unsigned integer as (low 32 bits, high 32 bits)."""
    x = int(x) & 0xFFFFFFFFFFFFFFFF
    return x & _MASK, x >> 32


def uniform_words(seed: int, draw: int, size: int) -> np.ndarray:
    """The uint32 words of elements 0..size-1 of draw `draw` of the op seeded `seed` (see the module
    docstring)."""
    blocks = (size + 3) // 4
    j = np.arange(blocks, dtype=np.uint64)
    n_lo, n_hi = split64(draw)
    counter = np.stack([j & np.uint64(_MASK), j >> np.uint64(32), np.full_like(j, n_lo), np.full_like(j, n_hi)],
                       axis=-1)
    return philox4x32(counter, np.array(split64(seed), dtype=np.uint64)).reshape(-1)[:size]


def uniform(seed: int, draw: int, size: int) -> np.ndarray:
    """float32 uniforms in [0, 1) of elements 0..size-1 of draw `draw` of the op seeded `seed`."""
    w = uniform_words(seed, draw, size)
    return ((w >> np.uint32(8)).astype(np.float32) * np.float32(UNIFORM_SCALE)).astype(np.float32)


@functools.cache
def device_functions() -> Any:
    """numba-cuda device functions (import numba on first use):

    - `philox(c0, c1, c2, c3, k0, k1)`: the four output words (uint64 values below 2**32) of one
      block, every argument a uint64 below 2**32;
    - `to_uniform(word)`: (word >> 8) * 2**-24 as float32."""
    from types import SimpleNamespace

    from flowctl.kernels.cuda.jit import numba_cuda

    cuda = numba_cuda()
    u64 = np.uint64
    m0, m1, w0, w1, mask, s32, s8 = u64(M0), u64(M1), u64(W0), u64(W1), u64(_MASK), u64(32), u64(8)
    scale = np.float32(UNIFORM_SCALE)

    @cuda.jit(device=True)
    def philox(c0: Any, c1: Any, c2: Any, c3: Any, k0: Any, k1: Any) -> Any:
        for r in range(ROUNDS):
            if r > 0:
                k0 = (k0 + w0) & mask
                k1 = (k1 + w1) & mask
            p0 = c0 * m0
            p1 = c2 * m1
            n0 = (p1 >> s32) ^ c1 ^ k0
            n2 = (p0 >> s32) ^ c3 ^ k1
            c1 = p1 & mask
            c3 = p0 & mask
            c0 = n0
            c2 = n2
        return c0, c1, c2, c3

    @cuda.jit(device=True)
    def to_uniform(word: Any) -> Any:
        return np.float32(word >> s8) * scale

    return SimpleNamespace(philox=philox, to_uniform=to_uniform)
