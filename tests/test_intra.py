"""Intra-op parallelism (flowctl/kernels/intra.py): a kernel's pieces on several threads give the
same bits as on one, and the pool itself orders results, raises task errors and runs nested calls
in line."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from flowctl.kernels import conv, intra, nn

pytestmark = pytest.mark.skipif(intra._blas() is None, reason="intra-op threads need numpy's OpenBLAS")

RNG = np.random.default_rng(7)


def _both(fn):
    """fn() with one intra-op thread and with three (more than the pieces of some runs)."""
    with intra.fixed(1):
        one = fn()
    with intra.fixed(3):
        many = fn()
    return one, many


def _same(a, b):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y), f"max difference {np.abs(x - y).max()}"


# (input H, C, Co, kh, kw, stride, padding): many pieces of GEMM_ROWS positions each; the strided
# ones take col2im for the input gradient, the first two the convolution on dy's side, and the
# last has pieces that are runs of rows inside one image (their windows overlap).
CONVS = [(30, 5, 7, 3, 3, 1, "SAME"), (24, 6, 4, 1, 5, 1, "SAME"), (31, 5, 9, 3, 3, 2, "VALID"),
         (33, 4, 6, 5, 5, 2, "SAME"), (70, 3, 5, 3, 3, 1, "SAME")]


@pytest.mark.parametrize("h,c,co,kh,kw,s,pad", CONVS)
def test_convolution_passes_are_bitwise_the_same_on_any_number_of_threads(h, c, co, kh, kw, s, pad):
    n = 5 if h < 70 else 2
    x = RNG.standard_normal((n, h, h, c), dtype=np.float32)
    f = RNG.standard_normal((kh, kw, c, co), dtype=np.float32)
    rows = 256
    y1, y3 = _both(lambda: conv.conv2d_forward(np, x, f, (s, s), pad, rows))
    assert len(conv.bands(n, y1.shape[1], y1.shape[2], rows)) > 3
    _same(y1, y3)
    dy = RNG.standard_normal(y1.shape, dtype=np.float32)
    _same(*_both(lambda: conv.conv2d_backprop_input(np, dy, f, x.shape, (s, s), pad, rows)))
    _same(*_both(lambda: conv.conv2d_backprop_filter(np, x, dy, f.shape, (s, s), pad, rows)))
    # and against the whole batch as one piece in float64 (the pieces change nothing but speed)
    ref = conv.conv2d_backprop_filter(np, x.astype(np.float64), dy.astype(np.float64), f.shape, (s, s), pad)
    np.testing.assert_allclose(conv.conv2d_backprop_filter(np, x, dy, f.shape, (s, s), pad, rows), ref,
                               rtol=2e-4, atol=2e-3)


@pytest.mark.parametrize("relu", [False, True])
def test_batch_norm_is_bitwise_the_same_on_any_number_of_threads(relu):
    x = RNG.standard_normal((4, 20, 20, 16), dtype=np.float32) * 3 + 1
    scale = RNG.standard_normal(16, dtype=np.float32)
    offset = RNG.standard_normal(16, dtype=np.float32)
    elements = 1000  # 26 pieces
    fwd1, fwd3 = _both(lambda: nn.batch_norm_forward(np, x, scale, offset, 1e-3, relu, elements))
    _same(fwd1, fwd3)
    y, mean, var = fwd1
    dy = RNG.standard_normal(x.shape, dtype=np.float32)
    stats = (RNG.standard_normal(16, dtype=np.float32), RNG.standard_normal(16, dtype=np.float32))
    grads = _both(lambda: nn.batch_norm_grad(np, dy, x, scale, mean, var, y if relu else None, stats, 1e-3,
                                             elements))
    _same(*grads)
    whole = nn.batch_norm_grad(np, dy, x, scale, mean, var, y if relu else None, stats, 1e-3)
    for a, b in zip(grads[0], whole):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["MaxPool", "AvgPool"])
def test_pools_by_images_are_bitwise_the_same_on_any_number_of_threads(op, monkeypatch):
    monkeypatch.setattr(conv, "POOL_ELEMENTS", 2000)  # one image per chunk
    x = RNG.standard_normal((7, 15, 15, 8), dtype=np.float32)
    attrs = {"ksize": (3, 3), "strides": (2, 2), "padding": "SAME"}
    fwd = {"MaxPool": conv.max_pool_cpu, "AvgPool": conv.avg_pool_cpu}[op](np, attrs)
    y1, y3 = _both(lambda: fwd(x))
    _same(y1, y3)
    whole = {"MaxPool": conv.max_pool, "AvgPool": conv.avg_pool}[op](np, x, (3, 3), (2, 2), "SAME")
    _same(y1, whole)
    dy = RNG.standard_normal(y1.shape, dtype=np.float32)
    if op == "MaxPool":
        grad = conv.max_pool_grad_cpu(np, attrs)
        _same(*_both(lambda: grad(x, y1, dy)))
    else:
        grad = conv.avg_pool_grad_cpu(np, attrs)
        _same(*_both(lambda: grad(dy, x)))


def test_run_keeps_order_raises_and_runs_nested_calls_in_line():
    seen: list[str] = []

    def task(i):
        def body():
            seen.append(threading.current_thread().name)
            time.sleep(0.01)  # long enough for the pool's thread to take a task too
            inner = intra.run([lambda: intra.threads()] * 2)  # inside a task: in line, one thread
            return i, inner
        return body

    with intra.fixed(2):
        out = intra.run([task(i) for i in range(6)])
    assert [i for i, _ in out] == list(range(6))
    assert all(inner == [1, 1] for _, inner in out)
    assert any(name.startswith("flowctl-intra") for name in seen)

    def boom():
        raise ValueError("piece 3")

    with intra.fixed(2), pytest.raises(ValueError, match="piece 3"):
        intra.run([lambda: 1, boom, lambda: 2])
    assert intra.chunks(10, 3) == [range(0, 3), range(3, 6), range(6, 10)]
    assert intra.chunks(2, 5) == [range(0, 1), range(1, 2)]


def test_blas_is_one_thread_per_caller_while_tasks_run_and_restored_after():
    blas = intra._blas()
    before = blas.get()
    with intra.fixed(2):
        inside = intra.run([blas.get, blas.get, blas.get])
    assert inside == [1, 1, 1]
    assert blas.get() == before


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_makes_its_own_pool():
    import multiprocessing as mp

    with intra.fixed(2):
        intra.run([lambda: 1, lambda: 2])  # the parent's pool exists now
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(_run_two_in_child).get(timeout=30) == [1, 2]  # hangs without the fork hook


def _run_two_in_child():
    with intra.fixed(2):
        return intra.run([lambda: 1, lambda: 2])


@pytest.mark.parametrize("relu", [False, True])
def test_inference_batch_norm_is_the_chains_bits_on_any_number_of_threads(relu):
    x = RNG.standard_normal((4, 20, 20, 16), dtype=np.float32)
    s, b = RNG.standard_normal(16, dtype=np.float32), RNG.standard_normal(16, dtype=np.float32)
    one, many = _both(lambda: nn.channel_affine(np, x, s, b, relu, elements=1000))
    _same(one, many)
    chain = x * s + b
    _same(one, np.maximum(chain, 0) if relu else chain)


def _numpys_openblas() -> str | None:
    """The file name of the OpenBLAS numpy's core module links, from ldd (None where unknown)."""
    import glob
    import os
    import shutil
    import subprocess

    core = glob.glob(os.path.join(os.path.dirname(np.__file__), "_core", "_multiarray_umath*.so"))
    if not core or shutil.which("ldd") is None:
        return None
    out = subprocess.run(["ldd", core[0]], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if "openblas" in line]
    return names[0] if names else None


def test_the_blas_held_at_one_thread_is_numpys_though_scipys_loaded_too():
    # numba imports scipy, whose wheels bring a second OpenBLAS; threadpoolctl may list it first.
    pytest.importorskip("scipy.linalg")
    from threadpoolctl import ThreadpoolController, threadpool_limits

    name = _numpys_openblas()
    if name is None:
        pytest.skip("numpy's OpenBLAS file is not known here (no ldd, or not a wheel's)")

    def numpys_threads() -> list[int]:
        return [lib.num_threads for lib in ThreadpoolController().lib_controllers
                if lib.filepath and lib.filepath.endswith(name)]

    saved = intra._state["blas"]
    intra._state["blas"] = None  # found again, now that both libraries are loaded
    try:
        with threadpool_limits(2, user_api="blas"), intra.fixed(2):
            assert numpys_threads() == [2]
            inside = intra.run([numpys_threads, numpys_threads])
        assert inside == [[1], [1]]
    finally:
        intra._state["blas"] = saved
