"""`gru` against torch.nn.GRU's equations (gates r, z, n; the recurrent bias inside r's product):
static and dynamic unroll give a float64 numpy loop's outputs, their gradients pass the
finite-difference check, lengths stop the state as the LSTM's do, the parameter count is the
built graph's, and a small GRU language model learns under `flowctl train`."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import flowctl as fc
from flowctl.cli.main import cli
from flowctl.engine.errors import SpecError
from flowctl.engine.gradcheck import check_gradients
from flowctl.engine.graph import Tensor
from flowctl.spec import load_text
from flowctl.spec.layers import LAYERS, Weight
from flowctl.spec.model import build_model
from test_train_runs import losses

B, T, D, U = 3, 5, 4, 6

SPEC = f"""
version: 1
model:
  dtype: float64
  layers:
    - {{name: x, type: input, shape: [{T}, {D}], dtype: float64}}
    - {{name: lengths, type: input, shape: [], dtype: int32, classes: {T + 1}}}
    - {{name: rnn, type: gru, units: {U}, unroll: UNROLL, return_sequences: SEQ, inputs: [x LENGTHS]}}
"""


def spec(unroll: str, sequences: bool = True, lengths: bool = False) -> str:
    return (SPEC.replace("UNROLL", unroll).replace("SEQ", str(sequences).lower())
            .replace(" LENGTHS", ", lengths" if lengths else ""))


def reference(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray, rbias: np.ndarray,
              lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """torch.nn.GRU's step in float64: (outputs [B, T, U], last state [B, U]); past an example's
    length its state stays and its outputs are zero."""
    w_x, w_h = kernel[:D], kernel[D:]
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))
    h = np.zeros((x.shape[0], U))
    outs = np.zeros((x.shape[0], x.shape[1], U))
    for t in range(x.shape[1]):
        gx, gh = x[:, t] @ w_x + bias, h @ w_h + rbias
        r = sig(gx[:, :U] + gh[:, :U])
        z = sig(gx[:, U:2 * U] + gh[:, U:2 * U])
        n = np.tanh(gx[:, 2 * U:] + r * gh[:, 2 * U:])
        h2 = (1 - z) * n + z * h
        alive = np.ones((x.shape[0], 1)) if lengths is None else (t < lengths)[:, None].astype(float)
        outs[:, t] = h2 * alive
        h = h2 * alive + h * (1 - alive)
    return outs, h


def weights(rng: np.random.Generator) -> list[np.ndarray]:
    # Non-zero biases: the recurrent one sits inside r's product, so it must not fold into the other.
    return [rng.uniform(-0.6, 0.6, (D + U, 3 * U)), rng.uniform(-0.5, 0.5, 3 * U), rng.uniform(-0.5, 0.5, 3 * U)]


def run_layer(text: str, x: np.ndarray, ws: list[np.ndarray], lengths: np.ndarray | None = None,
              stats: fc.RunStats | None = None) -> np.ndarray:
    model = build_model(load_text(text, "gru.yaml"), training=False)
    sess = fc.Session(model.graph, store=fc.ContainerStore())
    sess.run(model.initializer())
    sess.load_variables({v.node: w for v, w in zip(model.variables["rnn"], ws)})
    feeds = {model.inputs["x"]: x}
    if lengths is not None:
        feeds[model.inputs["lengths"]] = lengths
    return sess.run(model.outputs["rnn"], feeds, stats=stats)


@pytest.mark.parametrize("sequences", [True, False])
def test_static_and_dynamic_give_the_numpy_reference(rng, sequences):
    x = rng.standard_normal((B, T, D))
    ws = weights(rng)
    outs, last = reference(x, *ws)
    want = outs if sequences else last
    got = {u: run_layer(spec(u, sequences), x, ws) for u in ("static", "dynamic")}
    for u in got:
        np.testing.assert_allclose(got[u], want, rtol=1e-10, atol=1e-12, err_msg=u)
    np.testing.assert_allclose(got["dynamic"], got["static"], rtol=1e-12, atol=1e-14)


class _Params:
    """A Builder whose variables are the gradient checker's placeholders."""

    def __init__(self, graph: fc.Graph, tensors: dict[str, Tensor]) -> None:
        self.graph, self.training, self.dtype, self.steps, self.split_layers = graph, True, "float64", {}, False
        self.tensors = tensors

    def variable(self, w: Weight) -> Tensor:
        assert self.tensors[w.name].shape == w.shape
        return self.tensors[w.name]


@pytest.mark.parametrize("unroll, lengths", [("static", False), ("dynamic", False), ("dynamic", True)])
def test_gradients_pass_the_finite_difference_check(rng, unroll, lengths):
    layer = LAYERS["gru"](name="rnn", type="gru", units=U, unroll=unroll)
    kernel, bias, rbias = weights(rng)
    inputs = {"x": rng.standard_normal((B, T, D)), "kernel": kernel, "bias": bias, "recurrent_bias": rbias}
    if lengths:
        inputs["lengths"] = np.array([T, 2, 0], np.int32)

    def build(x: Tensor, kernel: Tensor, bias: Tensor, recurrent_bias: Tensor,
              lengths: Tensor | None = None) -> Tensor:
        b = _Params(x.graph, {"kernel": kernel, "bias": bias, "recurrent_bias": recurrent_bias})
        return layer.build(b, [x] if lengths is None else [x, lengths])

    check_gradients(build, inputs, max_elements=40)


def test_lengths_keep_the_state_and_zero_the_outputs_past_each_example(rng):
    x = rng.standard_normal((4, T, D))
    ws = weights(rng)
    lengths = np.array([T, 3, 1, 0], np.int32)
    stats = fc.RunStats()
    got = run_layer(spec("dynamic", lengths=True), x, ws, lengths, stats=stats)
    # the loop ran max(lengths) - 1 iterations
    assert sum(1 for n in stats.nodes_run if n.endswith("time_loop/NextIteration")) == T - 1
    full = run_layer(spec("dynamic"), x, ws)
    want, last = reference(x, *ws, lengths=lengths)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    for b, n in enumerate(lengths):  # the LSTM's convention
        np.testing.assert_array_equal(got[b, :n], full[b, :n])
        assert not got[b, n:].any()
    last_got = run_layer(spec("dynamic", sequences=False, lengths=True), x, ws, lengths)
    np.testing.assert_allclose(last_got, last, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(last_got[3], 0.0)  # length 0: the zero state
    np.testing.assert_array_equal(last_got[1], got[1, 2])  # the state at its length


def test_a_lengths_input_needs_the_dynamic_unroll():
    with pytest.raises(SpecError, match="lengths input needs unroll: dynamic") as e:
        load_text(spec("static", lengths=True), "gru.yaml")
    assert "gru.yaml:" in str(e.value)


@pytest.mark.parametrize("unroll", ["static", "dynamic"])
def test_the_parameter_count_is_the_built_graphs(unroll):
    loaded = load_text(spec(unroll), "gru.yaml")
    assert loaded.params() == ((D + U) * 3 * U + 2 * 3 * U, 0)
    model = build_model(loaded)
    counted = sum(math.prod(n.attrs["shape"]) for n in model.graph.nodes.values() if n.op == "Variable")
    assert counted == loaded.params()[0] == model.params()[0]


LM = """\
version: 1
name: gru_lm
model:
  layers:
    - {name: tokens, type: input, shape: [8], dtype: int32, classes: 12}
    - {name: targets, type: input, shape: [8], dtype: int32, classes: 12}
    - {name: embedding, type: embedding, vocab: 12, dim: 8, init_scale: 0.1, inputs: [tokens]}
    - {name: gru_1, type: gru, units: 16, init_scale: 0.1, unroll: UNROLL}
    - {name: gru_2, type: gru, units: 16, init_scale: 0.1, unroll: UNROLL}
    - {name: softmax, type: dense, units: 12}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
data: {source: text, path: corpus.txt, vocab_size: 12, seed: 3}
training: {optimizer: {type: adam}, learning_rate: 0.03, batch_size: 8, steps: 25, seed: 1}
checkpoint: {every_steps: 100, keep: 3}
"""


def _lm_run(tmp_path: Path, unroll: str, steps: int) -> Path:
    words = "the cat sat on a mat".split()
    (tmp_path / "corpus.txt").write_text(" ".join(words[i % len(words)] for i in range(3000)))
    path = tmp_path / f"gru_lm_{unroll}.yaml"
    path.write_text(LM.replace("UNROLL", unroll))
    run = tmp_path / f"run_{unroll}"
    r = CliRunner().invoke(cli, ["train", str(path), "--run-dir", str(run), "--steps", str(steps)])
    assert r.exit_code == 0, r.output
    return run


@pytest.mark.parametrize("unroll", ["static", "dynamic"])
def test_a_gru_language_model_learns_under_flowctl_train(tmp_path: Path, unroll: str):
    got = losses(_lm_run(tmp_path, unroll, 25))
    assert len(got) == 25 and all(np.isfinite(got))
    assert np.mean(got[-5:]) < 0.5 * np.mean(got[:5]), got

TWIN = """
version: 1
model:
  layers:
    - {name: x, type: input, shape: [7, 4]}
    - {name: rnn, type: gru, units: 6, unroll: UNROLL}
    - {name: lstm, type: lstm, units: 5, forget_bias: 1.0}
    - {name: top, type: gru, units: 3, return_sequences: false}
"""


@pytest.mark.parametrize("unroll", ["static", "dynamic"])
def test_the_pytorch_twin_is_torch_nn_gru_with_the_weights_copied(rng, unroll):
    torch = pytest.importorskip("torch")
    from flowctl.bench.torch_twin import Twin

    loaded = load_text(TWIN.replace("UNROLL", unroll), "twin.yaml")
    model = build_model(loaded, training=False)
    sess = fc.Session(model.graph, store=fc.ContainerStore())
    sess.run(model.initializer())
    # Non-zero biases everywhere, so each lands in its PyTorch slot or the outputs differ.
    values = {name: [rng.uniform(-0.5, 0.5, v.shape).astype(np.float32) for v in model.variables[name]]
              for name in ("rnn", "lstm", "top")}
    sess.load_variables({v.node: a for name in values for v, a in zip(model.variables[name], values[name])})
    x = rng.standard_normal((3, 7, 4)).astype(np.float32)
    want = sess.run([model.outputs[n] for n in values], {model.inputs["x"]: x})

    twin = Twin(loaded)
    assert twin.param_count() == sum(loaded.params())
    twin.load(values)
    with torch.no_grad():
        got = twin({"x": torch.from_numpy(x)})
    for name, w in zip(values, want):
        assert got[name].shape == w.shape
        np.testing.assert_allclose(got[name].numpy(), w, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_static_gru_exports_to_onnx_and_computes_the_runs_logits(tmp_path: Path):
    """The static unroll is MatMul, Add, Split, Sigmoid, Tanh, Mul and Sub nodes, all with ONNX
    forms; the dynamic one's while loop has none here, and the refusal is one line."""
    onnx = pytest.importorskip("onnx")
    from onnx.reference import ReferenceEvaluator

    from flowctl.training.inference import open_run

    run = _lm_run(tmp_path, "static", 3)
    r = CliRunner().invoke(cli, ["export", str(run), "--out", str(tmp_path / "o"), "--format", "onnx", "--json"])
    assert r.exit_code == 0, r.output
    model = onnx.load(json.loads(r.stdout)["file"])
    x = np.random.default_rng(2).integers(0, 12, (3, 8)).astype(np.int32)
    (got,) = ReferenceEvaluator(model).run(None, {"tokens": x})
    m = open_run(run)
    want = m.session.run(m.evaluator.logits, {m.evaluator.model.inputs["tokens"]: x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    run = _lm_run(tmp_path, "dynamic", 1)
    r = CliRunner().invoke(cli, ["export", str(run), "--out", str(tmp_path / "d"), "--format", "onnx"])
    assert r.exit_code != 0 and "has no ONNX form" in r.output and "Traceback" not in r.output
