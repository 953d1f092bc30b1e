"""The same kernels on cupy: each graph run on gpu:0 must match the numpy run on the same inputs.
Skipped cleanly where cupy or a CUDA device is missing."""
from __future__ import annotations

import numpy as np
import pytest

import flowctl as fc

pytestmark = pytest.mark.gpu


def _both(build, feeds_np, tol=1e-5):
    g = fc.Graph(seed=5)
    with g.as_default():
        phs = {k: fc.placeholder(v.dtype.name, v.shape, name=k) for k, v in feeds_np.items()}
        outs = build(**phs)
    feeds = {phs[k]: v for k, v in feeds_np.items()}
    cpu = fc.Session(g, store=fc.ContainerStore()).run(outs, feeds)
    gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs, feeds)
    for a, b in zip(cpu, gpu):
        assert isinstance(b, np.ndarray) or np.isscalar(b)
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol)


def test_elementwise_and_gradients_match_numpy(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    y = rng.uniform(0.5, 2, (16,)).astype(np.float32)

    def build(x, y):
        z = fc.tanh(x) * y + fc.exp(-fc.square(x)) / y
        return [z] + fc.gradients(z, [x, y])

    _both(build, {"x": x, "y": y})


def test_mlp_step_matches_numpy(rng):
    x = rng.standard_normal((32, 20)).astype(np.float32)
    w = rng.standard_normal((20, 5)).astype(np.float32)
    labels = rng.integers(0, 5, 32).astype(np.int32)

    def build(x, w, labels):
        loss = fc.reduce_mean(fc.sparse_softmax_cross_entropy(fc.relu(fc.matmul(x, w)), labels))
        return [loss] + fc.gradients(loss, [x, w])

    _both(build, {"x": x, "w": w, "labels": labels})


def test_conv_and_pool_match_numpy(rng):
    x = rng.standard_normal((2, 9, 9, 3)).astype(np.float32)
    f = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)

    def build(x, f):
        y = fc.max_pool(fc.conv2d(x, f, strides=(2, 2), padding="SAME"), (2, 2), (1, 1), "VALID")
        return [y] + fc.gradients(y, [x, f])

    _both(build, {"x": x, "f": f}, tol=1e-4)


def test_random_ops_draw_the_same_numbers_on_both_devices():
    g = fc.Graph(seed=9)
    with g.as_default():
        r = fc.random_normal((4, 4), name="r")
    a = fc.Session(g, store=fc.ContainerStore()).run(r)
    b = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(r)
    np.testing.assert_array_equal(a, b)
