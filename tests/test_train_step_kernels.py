"""The CPU kernels that make the lstm_lm training step fast, against the whole-array kernels they
stand in for and float64 references: the blocked softmax cross-entropy, the fused SGD update and
the clipping sums (see also tests/test_optimizers.py)."""
from __future__ import annotations

import numpy as np
import pytest

from flowctl.kernels import nn as nn_kernels
from flowctl.kernels.registry import bind


@pytest.mark.parametrize("shape", [(300, 3000), (7, 5), (0, 4)])
def test_blocked_sparse_xent_equals_the_whole_array_kernel_bit_for_bit(shape, rng):
    n, c = shape
    logits = (3.0 * rng.standard_normal(shape)).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.int32)
    blocked = bind("SparseSoftmaxCrossEntropyWithLogits", "cpu", {})
    whole = nn_kernels.sparse_softmax_xent(np, {})
    assert blocked is not whole
    (l1, g1), (l2, g2) = blocked(logits, labels), whole(logits, labels)
    np.testing.assert_array_equal(l1, l2)
    np.testing.assert_array_equal(g1, g2)
    # and against float64: loss = logsumexp - logit at the label; backprop = softmax - one-hot
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1) if n else np.zeros(0)
    np.testing.assert_allclose(l1, lse - x[np.arange(n), labels], rtol=1e-5, atol=1e-5)
    p = np.exp(x - x.max(1, keepdims=True)) if n else x
    p = p / p.sum(1, keepdims=True) if n else p
    p[np.arange(n), labels] -= 1.0
    np.testing.assert_allclose(g1, p, atol=1e-6)


def test_blocked_sparse_xent_names_a_bad_label():
    run = bind("SparseSoftmaxCrossEntropyWithLogits", "cpu", {})
    with pytest.raises(ValueError, match="label 5 .example 1. is out of range for 4 classes"):
        run(np.zeros((2, 4), np.float32), np.array([0, 5], np.int32))
