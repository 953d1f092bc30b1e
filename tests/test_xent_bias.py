"""A classifier's last bias and its loss as one node each way on the CPU (engine/xent_bias.py,
kernels/cpu/softmax.py): the compiled BiasSparseXent and XentGradBias against the unfused pairs'
kernels (bit for bit, at 1, 2 and 3 intra-op threads) and the float64 reference; the pass's rewrite
of a language model's loss (through its fold and unfold Reshapes) with the same bits as the unfused
plan, and where it stays away."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import flowctl as fc  # noqa: E402
from flowctl.engine import xent_bias  # noqa: E402
from flowctl.engine.shapes import TensorSpec  # noqa: E402
from flowctl.kernels import intra  # noqa: E402
from flowctl.kernels.registry import bind, chosen, reference_kernels  # noqa: E402
from flowctl.spec import load_text  # noqa: E402
from flowctl.spec.model import build_model  # noqa: E402
from plan_runs import run_plan  # noqa: E402

SHAPES = [(37, 1030), (5, 3), (64, 2051), (1, 17), (130, 4096)]


def _specs(*arrays: np.ndarray) -> list[TensorSpec]:
    return [TensorSpec(tuple(a.shape), str(a.dtype)) for a in arrays]


def _logits(n: int, c: int, dtype: str, seed: int):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, c)) * 3).astype(dtype)
    b = rng.standard_normal(c).astype(dtype)
    labels = rng.integers(0, c, n).astype("int32")
    return x, b, labels


@pytest.mark.parametrize("n,c", SHAPES)
def test_the_fused_loss_gives_the_pairs_bits(n, c) -> None:
    x, b, labels = _logits(n, c, "float32", n + c)
    ins = _specs(x, b, labels)
    assert chosen("BiasSparseXent", "cpu", {}, ins).name == "numba"
    for threads in (1, 2, 3):
        with intra.fixed(threads):
            logits = bind("BiasAdd", "cpu", {}, ins[:2])(x, b)
            want = bind("SparseSoftmaxCrossEntropyWithLogits", "cpu", {}, _specs(logits, labels))(logits, labels)
            got = bind("BiasSparseXent", "cpu", {}, ins)(x, b, labels)
        for g, w in zip(got, want):
            assert g.dtype == np.float32
            np.testing.assert_array_equal(g, w)
    x64, b64 = x.astype("float64"), b.astype("float64")
    with reference_kernels():
        ref = bind("BiasSparseXent", "cpu", {}, _specs(x64, b64, labels))(x64, b64, labels)
        pair = bind("SparseSoftmaxCrossEntropyWithLogits", "cpu", {}, _specs(x64, labels))(x64 + b64, labels)
    for g, r, p in zip(got, ref, pair):
        np.testing.assert_array_equal(r, p)  # the reference is the pair's kernels, in turn
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(r).max())))


@pytest.mark.parametrize("n,c", SHAPES)
def test_the_fused_gradient_gives_the_pairs_bits(n, c) -> None:
    rng = np.random.default_rng(n * c)
    m = rng.standard_normal((n, c)).astype("float32")
    dy = rng.standard_normal(n).astype("float32")
    ins = _specs(dy, m)
    assert chosen("XentGradBias", "cpu", {}, ins).name == "numba"
    g = bind("XentGrad", "cpu", {}, ins)(dy, m)
    db = bind("BiasAddGrad", "cpu", {}, _specs(g))(g)
    for threads in (1, 2, 3):
        with intra.fixed(threads):
            got_g, got_db = bind("XentGradBias", "cpu", {}, ins)(dy, m)
        np.testing.assert_array_equal(got_g, g)
        np.testing.assert_array_equal(got_db, db)
    with reference_kernels():
        ref_g, ref_db = bind("XentGradBias", "cpu", {}, _specs(dy.astype("float64"), m.astype("float64")))(
            dy.astype("float64"), m.astype("float64"))
    np.testing.assert_allclose(got_g, ref_g, rtol=1e-6)
    np.testing.assert_allclose(got_db, ref_db, rtol=1e-4, atol=1e-5 * np.sqrt(n))


def test_the_in_place_kernels_write_over_their_input() -> None:
    from flowctl.kernels.cpu import softmax

    x, b, labels = _logits(9, 700, "float32", 1)
    want = softmax.sparse_xent_bias(x, b, labels)
    x2 = x.copy()
    loss, e = softmax.sparse_xent_bias(x2, b, labels, into=True)
    assert e is x2
    np.testing.assert_array_equal(loss, want[0])
    np.testing.assert_array_equal(e, want[1])
    dy = np.linspace(-1, 1, 9, dtype="float32")
    g, db = softmax.xent_grad_bias(dy, want[1])
    m = want[1].copy()
    g2, db2 = softmax.xent_grad_bias(dy, m, into=True)
    assert g2 is m
    np.testing.assert_array_equal(g2, g)
    np.testing.assert_array_equal(db2, db)


def _language_model(dtype: str):
    """lstm_lm's loss in small: a dense layer over [batch, steps, dim] whose logits the loss folds to
    rows (BiasAdd -> Reshape (unfold) -> Reshape (fold) -> loss, and back)."""
    spec = f"""
version: 1
model:
  dtype: {dtype}
  layers:
    - {{name: tokens, type: input, shape: [6], dtype: int32, classes: 50}}
    - {{name: embedding, type: embedding, vocab: 50, dim: 12, inputs: [tokens]}}
    - {{name: softmax, type: dense, units: 50}}
    - {{name: targets, type: input, shape: [6], dtype: int32, classes: 50}}
    - {{name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}}
"""
    model = build_model(load_text(spec, "lm.yaml"), training=True)
    g = model.graph
    params = [v for vs in model.variables.values() for v in vs]
    with g.as_default():
        loss = model.outputs["loss"]
        # read through Identity nodes, as an optimizer reads them: a fetched gradient stays unfused
        grads = [fc.identity(g) for g in fc.gradients(loss, params)]
    rng = np.random.default_rng(7)
    feeds = {model.inputs["tokens"]: rng.integers(0, 50, (4, 6)).astype("int32"),
             model.inputs["targets"]: rng.integers(0, 50, (4, 6)).astype("int32")}
    return model, [loss] + grads, feeds


@pytest.mark.parametrize("dtype,reference", [("float32", False), ("float32", True), ("float64", False)])
def test_the_pass_fuses_a_language_models_loss_with_the_same_bits(monkeypatch, dtype, reference) -> None:
    model, fetches, feeds = _language_model(dtype)
    monkeypatch.setattr(xent_bias, "ENABLED", False)
    s, want, ops = run_plan(model, fetches, feeds)
    assert "BiasSparseXent" not in ops and ops.count("BiasAddGrad") == 1
    monkeypatch.setattr(xent_bias, "ENABLED", True)
    with reference_kernels(reference):
        _, got, ops = run_plan(model, fetches, feeds, s.store)
    assert "BiasSparseXent" in ops and "XentGradBias" in ops
    assert "BiasAdd" not in ops and "BiasAddGrad" not in ops and "XentGrad" not in ops
    assert ops.count("Reshape") >= 2  # the fold and unfold stay (the MatMul gradients read them)
    if reference:  # the reference kernels against the compiled ones: float rounding apart
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        return
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=str(i))


def test_the_pass_leaves_a_fetched_bias_or_bias_gradient_alone(monkeypatch) -> None:
    monkeypatch.setattr(xent_bias, "ENABLED", True)
    model, fetches, feeds = _language_model("float32")
    g = model.graph
    bias_add = next(n for n in g.nodes.values() if n.op == "BiasAdd")
    bias_grad = next(n for n in g.nodes.values() if n.op == "BiasAddGrad")
    _, _, ops = run_plan(model, fetches, feeds)
    assert "BiasAdd" not in ops and "BiasAddGrad" not in ops
    # the logits fetched: the forward pair stays; the gradient's pair still fuses
    _, _, ops = run_plan(model, fetches + [g.tensor(f"{bias_add.name}:0")], feeds)
    assert "BiasAdd" in ops and "BiasSparseXent" not in ops and "XentGradBias" in ops
    # the bias gradient fetched by name (not the variable's gradient list): it stays
    s = fc.Session(g)
    s.run(model.initializer())
    ops = [n.op for n in s.plan_for([fetches[0], g.tensor(f"{bias_grad.name}:0")], feeds).nodes]
    assert "BiasAddGrad" in ops and "XentGradBias" not in ops and "BiasSparseXent" in ops
