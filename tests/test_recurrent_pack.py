"""A recurrent weight packed once a step (engine/recurrent_pack.py; PackPanels and PanelMatMul,
kernels/recurrent.py and kernels/cpu/recurrent.py): the packed form holds w's columns (tails zero),
compiled and reference packing agree to the bit, the packed product is the float64 one to float32
rounding with the same bits at any intra-op thread count, and the pass rewrites an LSTM's
products so its outputs and gradients are the unpacked graph's to float32 rounding, and stays away
where it does not pay or does not apply."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import flowctl as fc  # noqa: E402
from flowctl.engine import recurrent_pack  # noqa: E402
from flowctl.engine.shapes import TensorSpec  # noqa: E402
from flowctl.kernels import intra  # noqa: E402
from flowctl.kernels.cpu import recurrent  # noqa: E402
from flowctl.kernels.registry import bind, chosen, reference_kernels  # noqa: E402
from flowctl.spec import load_text  # noqa: E402
from flowctl.spec.model import build_model  # noqa: E402
from plan_runs import run_plan  # noqa: E402


def _spec(a: np.ndarray) -> TensorSpec:
    return TensorSpec(tuple(a.shape), str(a.dtype))


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("k,n", [(1, 8), (5, 7), (37, 24), (13, 41)])
def test_packing_holds_ws_columns_and_the_compiled_pack_is_the_references(lanes, transpose, k, n) -> None:
    rng = np.random.default_rng(k * 100 + n)
    w = rng.standard_normal((n, k) if transpose else (k, n)).astype("float32")
    attrs = {"lanes": lanes, "transpose": transpose}
    assert chosen("PackPanels", "cpu", attrs, [_spec(w)]).name == "numba"
    got = bind("PackPanels", "cpu", attrs, [_spec(w)])(w)
    with reference_kernels():
        want = bind("PackPanels", "cpu", attrs, [_spec(w)])(w)
    np.testing.assert_array_equal(got, want)
    p = -(-n // lanes)
    assert got.shape == (p, k, lanes)
    flat = got.transpose(1, 0, 2).reshape(k, p * lanes)
    np.testing.assert_array_equal(flat[:, :n], w.T if transpose else w)
    assert not flat[:, n:].any()  # the last panel is zero past N


@pytest.mark.parametrize("m", [1, 3, 10, 14, 20, 23])
@pytest.mark.parametrize("k,n,lanes", [(650, 2600, 8), (650, 2600, 16), (37, 41, 8), (5, 7, 16), (64, 20, 8)])
def test_the_packed_product_is_the_float64_ones_to_float32_rounding(m, k, n, lanes) -> None:
    rng = np.random.default_rng(m * 1000 + k + n + lanes)
    a = rng.standard_normal((m, k)).astype("float32")
    w = rng.standard_normal((k, n)).astype("float32")
    wp = recurrent.pack(w, lanes, False)
    want = a.astype("float64") @ w.astype("float64")
    bound = 1e-5 * np.sqrt(k) * float(np.abs(a).max() * np.abs(w).max())  # k terms, each rounded once
    runs = []
    for threads in (1, 2, 3):
        with intra.fixed(threads):
            runs.append(recurrent.panel_matmul(a, wp, n, False))
    assert runs[0].dtype == np.float32 and runs[0].shape == (m, n)
    np.testing.assert_allclose(runs[0], want, rtol=1e-5, atol=bound)
    for other in runs[1:]:
        np.testing.assert_array_equal(runs[0], other)
    out_t = recurrent.panel_matmul(a, wp, n, True)
    np.testing.assert_array_equal(out_t, runs[0].T)
    # each output is one in-order fused sum over k: a row alone has the bits it has among the others
    np.testing.assert_array_equal(recurrent.panel_matmul(a[m - 1:], wp, n, False), runs[0][m - 1:])
    attrs = {"n": n, "transpose_out": False}
    with reference_kernels():
        ref = bind("PanelMatMul", "cpu", attrs, [_spec(a), _spec(wp)])(a, wp)
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=bound)


def test_panels_taken_two_at_a_time_have_the_bits_of_panels_taken_alone() -> None:
    # 16 lanes: the kernel pairs neighbouring panels (one h broadcast for both); a run of one panel
    # cannot pair, so panel by panel is the unpaired product
    from flowctl.kernels.cpu.gemm_jit import packed_matmul

    rng = np.random.default_rng(11)
    m, k, n = 20, 650, 16 * 7 + 5  # seven whole panels (three pairs and one alone) and a tail
    a_t = np.ascontiguousarray(rng.standard_normal((m, k)).astype("float32").T)
    wp = recurrent.pack(rng.standard_normal((k, n)).astype("float32"), 16, False)
    paired, alone = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    tail = np.empty((m, 16), np.float32)
    packed_matmul(a_t, wp, paired, tail, 0, wp.shape[0])
    for p in range(wp.shape[0]):
        packed_matmul(a_t, wp, alone, tail, p, p + 1)
    np.testing.assert_array_equal(paired, alone)


def test_the_pass_runs_wherever_the_compiled_product_does() -> None:
    # one vector register's columns a panel: 16 with AVX-512's registers, 8 with AVX2's
    from flowctl.kernels.cpu.gemm_jit import wide_registers

    recurrent_pack.enabled.cache_clear()
    assert recurrent_pack.enabled()
    width = 16 if wide_registers() else 8
    assert recurrent_pack.lanes() == width
    # the compiled product takes the register's width only (another width: the reference's unpacking)
    h, attrs = TensorSpec((None, 64), "float32"), {"n": 256, "transpose_out": False}
    other = 24 - width
    assert chosen("PanelMatMul", "cpu", attrs, [h, TensorSpec((256 // width, 64, width), "float32")]) is not None
    assert chosen("PanelMatMul", "cpu", attrs, [h, TensorSpec((256 // other, 64, other), "float32")]) is None


def test_the_passs_width_does_not_depend_on_the_reference_switch() -> None:
    # first asked while a plan is bound to the reference kernels, the rule still sees the variants
    from flowctl.kernels.cpu.gemm_jit import wide_registers

    recurrent_pack.lanes.cache_clear()
    recurrent_pack.enabled.cache_clear()
    try:
        with reference_kernels():
            assert recurrent_pack.lanes() == (16 if wide_registers() else 8) and recurrent_pack.enabled()
    finally:
        recurrent_pack.lanes.cache_clear()
        recurrent_pack.enabled.cache_clear()


def test_past_max_rows_the_packed_product_is_the_references() -> None:
    rng = np.random.default_rng(5)
    a = rng.standard_normal((recurrent.MAX_ROWS + 1, 30)).astype("float32")
    w = rng.standard_normal((30, 50)).astype("float32")
    wp = recurrent.pack(w, 8, False)
    attrs = {"n": 50, "transpose_out": False}
    with reference_kernels():
        want = bind("PanelMatMul", "cpu", attrs, [_spec(a), _spec(wp)])(a, wp)
    np.testing.assert_array_equal(recurrent.panel_matmul(a, wp, 50, False), want)


def _lstm(steps: int, units: int, dtype: str):
    spec = f"""
version: 1
model:
  dtype: {dtype}
  layers:
    - {{name: x, type: input, shape: [{steps}, 4], dtype: {dtype}}}
    - {{name: lstm_1, type: lstm, units: {units}, forget_bias: 1.0}}
    - {{name: lstm_2, type: lstm, units: {units}}}
"""
    model = build_model(load_text(spec, "lstm.yaml"), training=True)
    g = model.graph
    params = [v for name in ("lstm_1", "lstm_2") for v in model.variables[name]]
    rng = np.random.default_rng(steps + units)
    with g.as_default():
        y = model.outputs["lstm_2"]
        loss = fc.reduce_sum(y * fc.constant(rng.standard_normal((3, steps, units)).astype(dtype)))
        grads = fc.gradients(loss, params + [model.inputs["x"]])
    feeds = {model.inputs["x"]: rng.standard_normal((3, steps, 4)).astype(dtype)}
    return model, [y] + grads, feeds


@pytest.mark.parametrize("reference", [False, True])
def test_the_pass_packs_an_lstms_weights_and_keeps_its_gradients(monkeypatch, reference) -> None:
    steps, units = 6, 21  # 4 * 21 = 84 columns: a tail panel at 8 and 16 lanes, and in W_h^T's 21
    model, fetches, feeds = _lstm(steps, units, "float32")
    monkeypatch.setattr(recurrent_pack, "enabled", lambda: False)
    s, want, ops = run_plan(model, fetches, feeds)
    assert "PanelMatMul" not in ops
    monkeypatch.setattr(recurrent_pack, "enabled", lambda: True)
    with reference_kernels(reference):
        s2, got, ops = run_plan(model, fetches, feeds, s.store)
    # without the passes (what the placement profiler times): the graph's own products
    bare = [n.op for n in s2.plan_for(fetches, feeds, passes=False).nodes]
    assert "PanelMatMul" not in bare and bare.count("RecurrentMatMul") == 2 * (steps - 1)
    # each layer's W_h packed twice (its products, its gradient's W_h^T products); every product rewritten
    assert ops.count("PackPanels") == 4 and "RecurrentMatMul" not in ops
    assert ops.count("PanelMatMul") == 2 * 2 * (steps - 1)
    for i, (a, b) in enumerate(zip(got, want)):
        scale = max(float(np.abs(b).max()), 1.0)
        np.testing.assert_allclose(a, b, rtol=0, atol=4e-7 * scale * steps, err_msg=str(i))


@pytest.mark.parametrize("steps,dtype", [(4, "float32"), (6, "float64")])
def test_the_pass_leaves_few_products_and_float64_alone(monkeypatch, steps, dtype) -> None:
    # steps - 1 recurrent products a layer: 3 do not pay for a pack; float64 keeps the BLAS's product
    monkeypatch.setattr(recurrent_pack, "enabled", lambda: True)
    model, fetches, feeds = _lstm(steps, 8, dtype)
    _, _, ops = run_plan(model, fetches, feeds)
    assert "PackPanels" not in ops and "PanelMatMul" not in ops and "RecurrentMatMul" in ops
