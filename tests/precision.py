"""How close a float32 result computed on a GPU should come to numpy's: a tolerance that follows
the precision of the GPU's float32 products (`training.allow_tf32`, `set_fp32_products`).

The model. A product on the GPU rounds its two inputs to the product precision -- TF32 keeps 10
explicit mantissa bits (unit roundoff u = 2**-11), IEEE float32 23 (u = 2**-24) -- so each term
a*b of a dot product is off by at most about 2u of its size, and the float32 accumulation adds
about 2**-24 of the running sum per addition on both sides. K such errors of independent sign add
like a random walk: about sqrt(K) of them, not K (the statistical estimate for rounding errors;
the worst case, K, is far from what rounding does). So a result that sums K products is off by

    sqrt(K) * (2u + 2**-24) * (the size of its terms)

and the tolerance is SAFETY times that. SAFETY = 2 covers the spread of that random walk over the
hundreds to thousands of elements a test compares (with the worst case 2u per term, not the
average) and results that come out of a short chain of products.

Relative to what: a sum's error follows the size of its terms, not of the sum (a sum that
cancels to near zero keeps its terms' error). The tests compare each output with `rtol` = the
tolerance and `atol` = the tolerance times the output's largest magnitude (`assert_fp32_close`),
which no term of a typical output's sums falls far below. With the K of the deepest product in
the graph this overestimates the error of shallower results, never under-.

Around the products, the element-wise work (exp, log, tanh, divisions) differs between cupy and
numpy by a few float32 ulps; `floor` (1e-5 by default, the tests' tolerance before TF32) bounds
that, and is what an IEEE run's tolerance comes to.

Measured (the TF32 rounding emulated on numpy reproduced the H200's differences to three digits):
an MLP step (K = 32) differs by at most 9e-4 of an output's largest magnitude (the tolerance:
1.1e-2), a strided conv with its gradients (K = 50) 3.6e-4 (1.4e-2), two convolutions, pools and
their gradients (K = 286) 6.9e-4 (3.3e-2); a real error -- a wrong window, padding, transpose or
index -- is of the order of the outputs themselves.
"""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

TF32_ROUNDOFF = 2.0 ** -11  # TF32: 10 explicit mantissa bits, round to nearest
FP32_ROUNDOFF = 2.0 ** -24  # IEEE float32: 23
SAFETY = 2.0
FLOOR = 1e-5


def product_roundoff(device: str = "gpu:0") -> float:
    """The unit roundoff of a float32 product's inputs on `device` under the precision in use: a
    CPU's are IEEE float32; a GPU's are TF32 where flowctl's products (`fp32_products()`) or
    cupy's own (CUPY_TF32) run as TF32."""
    from flowctl.engine.devices import parse_device
    from flowctl.kernels.registry import fp32_products

    if parse_device(device).type != "gpu":
        return FP32_ROUNDOFF

    if fp32_products() == "tf32" or os.environ.get("CUPY_TF32", "0") not in ("", "0"):
        return TF32_ROUNDOFF
    return FP32_ROUNDOFF


def fp32_rtol(k: int, device: str = "gpu:0", floor: float = FLOOR) -> float:
    """The relative tolerance of a float32 result on `device` that sums `k` products (the depth
    of the deepest product, or reduction through one, that made it): SAFETY * sqrt(k) *
    (2u + 2**-24), and at least `floor`."""
    u = product_roundoff(device)
    return max(floor, SAFETY * math.sqrt(max(1, k)) * (2 * u + FP32_ROUNDOFF))


def assert_fp32_close(actual: Any, desired: Any, k: int, device: str = "gpu:0", floor: float = FLOOR,
                      err_msg: str = "") -> None:
    """`actual` (computed on `device`) against `desired` (numpy's float32): within `fp32_rtol` of
    each element, or of the output's largest magnitude (the size of the terms its sums add)."""
    tol = fp32_rtol(k, device, floor)
    scale = float(np.max(np.abs(np.asarray(desired, dtype=np.float64)), initial=0.0))
    np.testing.assert_allclose(actual, desired, rtol=tol, atol=tol * max(scale, np.finfo(np.float32).tiny),
                               err_msg=err_msg or f"float32 products of depth {k} on {device}: tolerance {tol:.3g}")
