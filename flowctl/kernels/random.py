"""Random kernels. Every draw comes from the node's own host-side generator
(`attrs["_resource"].generator`, a numpy Generator the engine seeds per node) and is then moved to
the device with `xp.asarray`: cpu and gpu see the same numbers, and a draw never depends on which
other random ops ran before it (the engine's determinism rule). numpy is used here for that host-side
drawing only."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flowctl.kernels.registry import kernel

# TensorFlow's truncated normal: values more than this many standard deviations out are redrawn.
TRUNCATE_AT = 2.0


def truncated_standard_normal(gen: Any, shape: tuple[int, ...]) -> Any:
    """Standard normal draws with |z| > 2 redrawn until none remain (about 4.6% per round, so a few
    rounds); the redraws come from the same generator, so the result stays deterministic."""
    z = gen.standard_normal(shape)
    bad = abs(z) > TRUNCATE_AT
    n = int(bad.sum())
    while n:
        z[bad] = gen.standard_normal(n)
        bad = abs(z) > TRUNCATE_AT
        n = int(bad.sum())
    return z


@kernel("RandomUniform")
def random_uniform(xp: Any, attrs: dict[str, Any]) -> Callable[[], Any]:
    gen = attrs["_resource"].generator
    shape, dtype = tuple(attrs["shape"]), attrs["dtype"]
    lo, hi = attrs["minval"], attrs["maxval"]
    if dtype.startswith(("int", "uint")):
        ilo, ihi = int(lo), int(hi)

        def run_int() -> Any:
            return xp.asarray(gen.integers(ilo, ihi, size=shape).astype(dtype))

        return run_int

    # Drawn in float64 and then rounded, so one seed gives the same numbers in every float dtype.
    # Rounding can land on maxval itself; clamp to the largest value below it to keep [lo, hi).
    top = np.nextafter(np.dtype(dtype).type(hi), np.dtype(dtype).type(lo))

    def run() -> Any:
        return xp.asarray(np.minimum(gen.uniform(lo, hi, size=shape).astype(dtype), top))

    return run


@kernel("RandomNormal")
def random_normal(xp: Any, attrs: dict[str, Any]) -> Callable[[], Any]:
    gen = attrs["_resource"].generator
    shape, dtype, mean, std = tuple(attrs["shape"]), attrs["dtype"], attrs["mean"], attrs["stddev"]

    def run() -> Any:
        return xp.asarray((mean + std * gen.standard_normal(shape)).astype(dtype))

    return run


@kernel("TruncatedNormal")
def truncated_normal(xp: Any, attrs: dict[str, Any]) -> Callable[[], Any]:
    gen = attrs["_resource"].generator
    shape, dtype, mean, std = tuple(attrs["shape"]), attrs["dtype"], attrs["mean"], attrs["stddev"]

    def run() -> Any:
        return xp.asarray((mean + std * truncated_standard_normal(gen, shape)).astype(dtype))

    return run
