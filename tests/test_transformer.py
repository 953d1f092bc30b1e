"""The Transformer layers (issue 34) against float64 numpy references written here: attention with
PyTorch's scaled_dot_product_attention semantics (causal, padding mask, rotary positions), the
tanh GELU, the block's parameter count, weight tying, GPT-2 small's 124,439,808 parameters, and
the ONNX export of the small spec."""
from __future__ import annotations

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

import flowctl as fc
from flowctl.cli.main import cli
from flowctl.engine.errors import SpecError
from flowctl.engine.gradcheck import check_gradients, run_graph
from flowctl.spec.layers.transformer import self_attention
from flowctl.spec.loader import load_spec, load_text
from flowctl.spec.model import build_model

ROOT = Path(__file__).resolve().parents[1]
B, T, D, H = 2, 5, 8, 2


# ---------------------------------------------------------------------------- references
def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """torch.nn.functional.scaled_dot_product_attention on [batch, heads, T, hd], a boolean mask
    (True: attend), in float64; a row with nothing to attend to takes the dtype's lowest score."""
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = np.where(keep, s, np.finfo(np.float64).min)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def rope(x: np.ndarray) -> np.ndarray:
    """GPT-NeoX / LLaMA rotary positions, rotate-half convention, base 10000, on [.., T, hd]."""
    steps, hd = x.shape[-2:]
    inv = 1.0 / 10000 ** (np.arange(0, hd, 2) / hd)
    ang = np.outer(np.arange(steps), inv)
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + np.concatenate([-x2, x1], -1) * sin


def attention_ref(x, wqkv, bqkv, wo, bo, heads, causal, lengths=None, rotary=False):
    b, t, d = x.shape
    hd = d // heads
    qkv = x @ wqkv + bqkv
    q, k, v = (qkv[..., i * d:(i + 1) * d].reshape(b, t, heads, hd).transpose(0, 2, 1, 3) for i in range(3))
    if rotary:
        q, k = rope(q), rope(k)
    keep = np.ones((b, 1, t, t), bool)
    if causal:
        keep &= np.tril(np.ones((t, t), bool))
    if lengths is not None:
        keep &= (np.arange(t)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]
    ctx = sdpa(q, k, v, keep).transpose(0, 2, 1, 3).reshape(b, t, d)
    return ctx @ wo + bo


def _weights(rng, d=D):
    return {"wqkv": rng.standard_normal((d, 3 * d)) / math.sqrt(d), "bqkv": rng.standard_normal(3 * d) * 0.1,
            "wo": rng.standard_normal((d, d)) / math.sqrt(d), "bo": rng.standard_normal(d) * 0.1}


def _attend(heads, causal, rotary, with_lengths, training=False, dropout=0.0):
    def build(x, wqkv, bqkv, wo, bo, lengths=None):
        b = SimpleNamespace(graph=x.graph, training=training)
        w = {"qkv_kernel": wqkv, "qkv_bias": bqkv, "output_kernel": wo, "output_bias": bo}
        return self_attention(b, x, lengths if with_lengths else None, w, heads, causal, dropout,
                              "rotary" if rotary else "none")
    return build


CASES = list(itertools.product([False, True], [False, True], [False, True]))  # causal, padding, rotary


@pytest.mark.parametrize("causal,padding,rotary", CASES)
def test_self_attention_forward_is_sdpa(causal, padding, rotary):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, T, D))
    w = _weights(rng)
    lengths = np.array([3, 5], np.int32)
    feeds = {"x": x, **w} | ({"lengths": lengths} if padding else {})
    got = run_graph(_attend(H, causal, rotary, padding), **feeds)
    want = attention_ref(x, w["wqkv"], w["bqkv"], w["wo"], w["bo"], H, causal, lengths if padding else None, rotary)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal,padding,rotary", [(True, True, True), (False, False, False), (True, False, True),
                                                   (False, True, False)])
def test_self_attention_gradients_match_the_reference_and_finite_differences(causal, padding, rotary):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, T, D))
    w = _weights(rng)
    lengths = np.array([2, 5], np.int32)
    feeds = {"x": x, **w} | ({"lengths": lengths} if padding else {})
    build = _attend(H, causal, rotary, padding)
    check_gradients(build, feeds, max_elements=40)
    # The analytic gradient of sum(r * y) against central differences of the numpy reference.
    r = rng.standard_normal((B, T, D))
    g = fc.Graph()
    with g.as_default():
        phs = {k: fc.placeholder(v.dtype.name, v.shape, name=k) for k, v in feeds.items()}
        y = build(**phs)
        grads = fc.gradients([y], [phs["x"], phs["wqkv"]], grad_ys=[fc.constant(r)])
    gx, gw = fc.Session(g, store=fc.ContainerStore()).run(grads, {phs[k]: v for k, v in feeds.items()})

    def objective(xx, ww):
        return float(np.sum(r * attention_ref(xx, ww, w["bqkv"], w["wo"], w["bo"], H, causal,
                                              lengths if padding else None, rotary)))
    eps = 1e-6
    for name, arr, analytic in (("x", x, gx), ("wqkv", w["wqkv"], gw)):
        for i in rng.choice(arr.size, 25, replace=False):
            up, down = arr.copy(), arr.copy()
            up.flat[i] += eps
            down.flat[i] -= eps
            args = (up, w["wqkv"]) if name == "x" else (x, up)
            args_down = (down, w["wqkv"]) if name == "x" else (x, down)
            numeric = (objective(*args) - objective(*args_down)) / (2 * eps)
            assert abs(analytic.flat[i] - numeric) < 1e-6 + 1e-6 * abs(numeric), (name, i)


def test_a_fully_masked_row_and_large_float16_scores_stay_finite():
    rng = np.random.default_rng(3)
    w = _weights(rng)
    x = rng.standard_normal((B, T, D))
    got = run_graph(_attend(H, True, False, True), x=x, **w, lengths=np.array([0, 4], np.int32))
    assert np.isfinite(got).all()  # length 0: every key masked, the weights average them
    np.testing.assert_allclose(got[1], attention_ref(x, *w.values(), H, True, [0, 4])[1], rtol=1e-12)
    # float16 scores in the hundreds: exp would overflow without the max subtracted first
    x16 = (x * 30).astype(np.float16)
    w16 = {k: v.astype(np.float16) for k, v in w.items()}
    got16 = run_graph(_attend(H, True, True, True), x=x16, **w16, lengths=np.array([3, 5], np.int32))
    want = attention_ref(x16.astype(np.float64), *(v.astype(np.float64) for v in w16.values()), H, True, [3, 5],
                         True)
    assert got16.dtype == np.float16 and np.isfinite(got16).all()
    np.testing.assert_allclose(got16.astype(np.float64), want, rtol=0.05, atol=0.05 * np.abs(want).max())


def test_attention_dropout_drops_weights_only_while_training():
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((B, T, D)), **_weights(rng)}
    plain = run_graph(_attend(H, True, False, False), **feeds)
    dropped = run_graph(_attend(H, True, False, False, training=True, dropout=0.5), **feeds)
    assert not np.allclose(plain, dropped)
    np.testing.assert_array_equal(run_graph(_attend(H, True, False, False, training=False, dropout=0.5), **feeds),
                                  plain)


# ---------------------------------------------------------------------------- GELU (tanh form)
def test_gelu_tanh_is_its_formula_and_its_gradient_checks():
    x = np.linspace(-6, 6, 97)
    want = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(run_graph(lambda x: fc.gelu_tanh(x), x=x), want, rtol=1e-14, atol=1e-15)
    check_gradients(lambda x: fc.gelu_tanh(x), {"x": x})
    # within 1e-3 of the exact (erf) form, as the approximation claims
    assert np.abs(run_graph(lambda x: fc.gelu(x), x=x) - want).max() < 1e-3


# ---------------------------------------------------------------------------- specs
SMALL = """\
version: 1
name: tiny_lm
model:
  dtype: {dtype}
  name: tiny_lm
  layers:
    - {{name: tokens, type: input, shape: [6], dtype: int32, classes: 11}}
    - {{name: lengths, type: input, shape: [], dtype: int32}}
    - {{name: wte, type: embedding, vocab: 11, dim: 8, inputs: [tokens]}}
    - {{name: wpe, type: position_embedding, max_length: 7}}
    - {{name: h1, type: transformer_block, heads: 2, activation: {act}, positions: {pos}, inputs: [wpe, lengths]}}
    - {{name: ln_f, type: layer_norm}}
    - {{name: logits, type: dense, units: 11, {head}}}
    - {{name: targets, type: input, shape: [6], dtype: int32, classes: 11}}
    - {{name: loss, type: softmax_cross_entropy, inputs: [logits, targets]}}
data: {{source: synthetic}}
training: {{optimizer: {{type: sgd}}, learning_rate: 0.1, batch_size: 3}}
"""


def _small(head="tie: wte, use_bias: false", act="gelu", pos="none", dtype="float64"):
    return load_text(SMALL.format(head=head, act=act, pos=pos, dtype=dtype), "tiny.yaml")


@pytest.mark.parametrize("act,pos", [("gelu", "none"), ("gelu_tanh", "rotary")])
def test_the_blocks_parameters_are_the_built_graphs_variables(act, pos):
    loaded = _small(act=act, pos=pos)
    d = 8
    block = loaded.layers["h1"].params[0]
    assert block == 12 * d * d + 13 * d  # ln 2d, qkv 3d²+3d, proj d²+d, ln 2d, mlp 8d²+5d
    built = build_model(loaded)
    assert sum(math.prod(v.shape) for v in built.variables["h1"]) == block
    assert built.params() == loaded.params()


def test_gpt2_small_has_124_439_808_parameters():
    loaded = load_spec(ROOT / "specs" / "transformer_lm.yaml")
    d, vocab, ctx = 768, 50257, 1024
    assert loaded.params() == (vocab * d + ctx * d + 12 * 7_087_872 + 2 * d, 0) == (124_439_808, 0)
    assert loaded.layers["logits"].weights == []  # the head is the embedding's table
    assert [i.name for i in loaded.instances] == [f"h_{k}" for k in range(1, 13)]
    r = CliRunner().invoke(cli, ["inspect", str(ROOT / "specs" / "transformer_lm.yaml")])
    assert r.exit_code == 0 and "124,439,808" in r.output


def test_a_tied_head_shares_one_variable_whose_gradient_sums_both_uses():
    tied, untied = _small(), _small(head="use_bias: false")
    assert tied.params()[0] == untied.params()[0] - 11 * 8
    feeds_np = {"tokens": np.array([[1, 2, 3, 4, 5, 6], [0, 10, 9, 8, 7, 6], [3, 3, 3, 3, 3, 3]], np.int32),
                "lengths": np.array([6, 4, 1], np.int32), "targets": np.arange(18, dtype=np.int32).reshape(3, 6) % 11}
    grads = {}
    for name, loaded in (("tied", tied), ("untied", untied)):
        m = build_model(loaded, training=False)
        with m.graph.as_default():
            table = m.variables["wte"][0]
            wrt = [table] + ([m.variables["logits"][0]] if name == "untied" else [])
            assert all(not vs for vs in [m.variables["logits"]]) == (name == "tied")
            gs = fc.gradients([m.loss], wrt)
            init = m.initializer()
            copy = None
            if name == "untied":  # the untied twin starts from the tied model's table, twice
                copy = [fc.assign(table, fc.constant(grads["table_value"])),
                        fc.assign(wrt[1], fc.constant(grads["table_value"].T.copy()))]
            value = table
        s = fc.Session(m.graph, store=fc.ContainerStore())
        s.run(init)
        if copy:
            s.run(copy)
        feeds = {m.inputs[k]: v for k, v in feeds_np.items()}
        grads[name] = s.run(gs, feeds)
        grads["table_value"] = s.run(value)
    (g_tied,) = grads["tied"]
    g_emb, g_kernel = grads["untied"]
    assert np.abs(g_emb).max() > 0 and np.abs(g_kernel).max() > 0
    np.testing.assert_allclose(g_tied, g_emb + g_kernel.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("head,message", [
    ("tie: h1", "'h1' is a transformer_block layer: `tie` takes an embedding layer"),
    ("tie: wtee", "unknown layer 'wtee' to tie to"),
])
def test_a_bad_tie_is_a_located_spec_error(head, message):
    with pytest.raises(SpecError, match="tiny.yaml:13:") as e:
        _small(head=head)
    assert message in str(e.value)


def test_heads_that_do_not_split_the_features_are_a_located_spec_error():
    text = SMALL.format(head="tie: wte", act="gelu", pos="none", dtype="float32").replace("heads: 2", "heads: 3")
    with pytest.raises(SpecError, match="tiny.yaml:11:.*8 features do not split over 3 heads"):
        load_text(text, "tiny.yaml")


# ---------------------------------------------------------------------------- ONNX
def test_the_small_specs_onnx_export_agrees_with_onnxruntime(tmp_path):
    onnx = pytest.importorskip("onnx")
    from flowctl.training.inference import open_run

    run = tmp_path / "run"
    shrink = [f"--set={k}={v}" for k, v in (
        ("model.layers.tokens.shape", "[16]"), ("model.layers.tokens.classes", 97),
        ("model.layers.targets.shape", "[16]"), ("model.layers.targets.classes", 97),
        ("model.layers.wte.vocab", 97), ("model.layers.logits.units", 97), ("model.layers.wpe.max_length", 16),
        ("model.blocks.decoder.params.positions", "rotary"))]
    r = CliRunner().invoke(cli, ["train", str(ROOT / "specs" / "transformer_small.yaml"), "--run-dir", str(run),
                                 "--steps", "2", *shrink])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["export", str(run), "--out", str(tmp_path / "o"), "--format", "onnx"])
    assert r.exit_code == 0, r.output
    path = next((tmp_path / "o").glob("*.onnx"))
    model = onnx.load(str(path))
    tokens = np.random.default_rng(6).integers(0, 97, (3, 16)).astype(np.int32)
    try:
        import onnxruntime
        got = onnxruntime.InferenceSession(str(path)).run(None, {model.graph.input[0].name: tokens})[0]
    except ImportError:
        from onnx.reference import ReferenceEvaluator
        got = ReferenceEvaluator(model).run(None, {model.graph.input[0].name: tokens})[0]
    opened = open_run(run)
    want = opened.session.run(opened.evaluator.logits, {opened.evaluator.model.inputs["tokens"]: tokens})
    assert got.shape == (3, 16, 97)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
