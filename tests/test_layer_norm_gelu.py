"""The layer_norm layer and the gelu activation (issue 20) against float64 numpy references, their
parameter counts, spec errors, and gradients through them by finite differences."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.errors import SpecError
from flowctl.engine.gradcheck import check_gradients
from flowctl.spec import load_text
from flowctl.spec.model import build_model

SPEC = """
version: 1
model:
  dtype: float64
  layers:
    - {{name: x, type: input, shape: [3, 5], dtype: float64}}
    - {{name: h, type: dense, units: 4, activation: gelu}}
    - {{name: ln, type: layer_norm, epsilon: 0.001{extra}}}
"""


def _session(text: str):
    model = build_model(load_text(text, "ln.yaml"), training=False)
    sess = fc.Session(model.graph, store=fc.ContainerStore())
    sess.run(model.initializer())
    return model, sess


def test_layer_norm_and_gelu_match_numpy(rng):
    model, sess = _session(SPEC.format(extra=""))
    assert model.loaded.params() == (5 * 4 + 4 + 4 + 4, 0)
    for v in model.variables["ln"]:  # give gamma and beta values other than their initial 1 and 0
        sess.run(fc.assign(v, fc.constant(rng.standard_normal(v.shape), graph=model.graph)))
    kernel, bias = sess.run(model.variables["h"])
    gamma, beta = sess.run(model.variables["ln"])
    x = rng.standard_normal((2, 3, 5))
    got = sess.run(model.outputs["ln"], {model.inputs["x"]: x})
    z = x @ kernel + bias
    h = z * 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    mean = h.mean(axis=-1, keepdims=True)
    var = ((h - mean) ** 2).mean(axis=-1, keepdims=True)
    ref = (h - mean) / np.sqrt(var + 1e-3) * gamma + beta
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-13)


def test_layer_norm_without_scale_or_center_has_no_weights(rng):
    model, sess = _session(SPEC.format(extra=", scale: false, center: false"))
    assert model.loaded.params() == (5 * 4 + 4, 0)
    got = sess.run(model.outputs["ln"], {model.inputs["x"]: rng.standard_normal((2, 3, 5))})
    np.testing.assert_allclose(got.mean(axis=-1), 0.0, atol=1e-12)


def test_layer_norm_gradient():
    def build(x, g, b):
        m = fc.reduce_mean(x, axis=-1, keepdims=True)
        c = x - m
        return c * fc.rsqrt(fc.reduce_mean(fc.square(c), axis=-1, keepdims=True) + 1e-5) * g + b

    r = np.random.default_rng(3)
    check_gradients(build, {"x": r.standard_normal((3, 4)), "g": r.standard_normal(4), "b": r.standard_normal(4)})


def test_layer_norm_refuses_integer_input():
    text = """
version: 1
model:
  layers:
    - {name: x, type: input, shape: [4], dtype: int32}
    - {name: ln, type: layer_norm}
"""
    with pytest.raises(SpecError, match="float"):
        load_text(text, "bad.yaml")
