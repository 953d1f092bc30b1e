"""The shipped specs and the layer library: published parameter counts and shapes, hand-derived
counts, static inference agreeing with the graph actually built, and forward passes that run."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import flowctl as fc
from flowctl.spec import load_spec, load_text
from flowctl.spec.model import build_model
from flowctl.spec.summary import summarize

SPECS = Path(__file__).resolve().parent.parent / "specs"
CASES = Path(__file__).resolve().parent / "cases"


def _feeds(model, batch: int, rng: np.random.Generator) -> dict:
    feeds = {}
    for name, ph in model.inputs.items():
        info = model.loaded.layers[name]
        shape = (batch, *info.output.shape[1:])
        if info.output.dtype.startswith("int"):
            feeds[ph] = rng.integers(0, info.layer.classes or 2, shape).astype(info.output.dtype)
        else:
            feeds[ph] = rng.standard_normal(shape).astype(info.output.dtype)
    return feeds


def test_inception_v3_matches_the_published_counts_and_shapes():
    loaded = load_spec(SPECS / "inception_v3.yaml")
    assert loaded.params() == (23_817_352, 23_851_784 - 23_817_352)
    want = {"conv_1a_3x3": (149, 149, 32), "maxpool_5a_3x3": (35, 35, 192), "mixed_5b": (35, 35, 256),
            "mixed_5c": (35, 35, 288), "mixed_5d": (35, 35, 288), "mixed_6a": (17, 17, 768),
            "mixed_6e": (17, 17, 768), "mixed_7a": (8, 8, 1280), "mixed_7b": (8, 8, 2048),
            "mixed_7c": (8, 8, 2048), "avg_pool": (2048,), "logits": (1000,)}
    for name, shape in want.items():
        assert loaded.layers[loaded.resolve(name)].output.shape == (None, *shape), name
    # 94 convolutions, each with batch norm (Keras' conv2d_bn)
    assert sum(1 for i in loaded.layers.values() if i.layer.type == "conv2d") == 94


def test_inception_v3_graph_agrees_and_a_forward_pass_gives_finite_logits():
    loaded = load_spec(SPECS / "inception_v3.yaml")
    model = build_model(loaded, training=False)
    assert model.params() == loaded.params()
    assert model.outputs["mixed_5b/concat"].shape == (None, 35, 35, 256)
    # Every node a layer made carries the layer's scope and the spec line.
    node = model.graph.nodes["mixed_5b/branch3x3dbl_2/conv"]
    assert node.op == "Conv2D" and "inception_v3.yaml:" in node.source
    sess = fc.Session(model.graph, store=fc.ContainerStore())
    sess.run(model.initializer())
    x = np.random.default_rng(0).standard_normal((2, 299, 299, 3)).astype(np.float32)
    logits = sess.run(model.outputs["logits"], {model.inputs["image"]: x})
    assert logits.shape == (2, 1000) and np.isfinite(logits).all()


def test_inception_v3_flops_match_the_known_cost():
    # Inception-v3 is ~5.7 G multiply-adds per 299x299 image, so ~11.5 GFLOPs forward.
    report = summarize(load_spec(SPECS / "inception_v3.yaml"))
    per_image = report["flops"]["forward"] / report["batch_size"]
    assert 11.0e9 < per_image < 12.0e9
    assert 2.5 < report["flops"]["training_step"] / report["flops"]["forward"] < 3.5


def test_lstm_lm_flops_count_every_time_step_and_the_softmax_over_batch_times_time():
    # The softmax's product and the LSTMs' run over batch x time rows (20 x 35 = 700): a fold whose
    # first dimension is derived from the batch, which once counted as the batch alone (3.5x under).
    report = summarize(load_spec(SPECS / "lstm_lm.yaml"))
    rows, hidden, vocab = 20 * 35, 650, 10_000
    products = 2 * rows * (hidden * vocab + 2 * (2 * hidden) * (4 * hidden))
    assert 0.99 * products < report["flops"]["forward"] < 1.02 * products
    assert 2.5 < report["flops"]["training_step"] / report["flops"]["forward"] < 3.5


def test_lstm_lm_parameter_count_by_hand():
    loaded = load_spec(SPECS / "lstm_lm.yaml")
    vocab, hidden, emb = 10_000, 650, 650
    embedding = vocab * emb
    lstm = lambda d, u: (d + u) * 4 * u + 4 * u  # one fused [x, h] -> 4 gates kernel, plus biases
    softmax = hidden * vocab + vocab
    assert loaded.params() == (embedding + lstm(emb, hidden) + lstm(hidden, hidden) + softmax, 0)
    assert loaded.params()[0] == 19_775_200
    assert loaded.layers["softmax"].output.shape == (None, 35, 10_000)
    assert loaded.global_batch == 20
    drop = [i.layer.rate for i in loaded.layers.values() if i.layer.type == "dropout"]
    assert drop == [0.5, 0.5, 0.5]


def test_nmt_and_demo_validate():
    nmt = load_spec(SPECS / "nmt.yaml")
    assert nmt.layers["attention"].output.shape == (None, 40, 1024)
    assert nmt.spec.devices[1].name == "/job:localhost/task:0/device:gpu:0"
    assert nmt.spec.devices[1].profile.memory == 12 * 1024**3
    demo = load_spec(SPECS / "demo.yaml")
    assert demo.params() == (16 * 64 + 64 + 64 * 32 + 32 + 32 * 4 + 4, 0)


SMALL = """
version: 1
model:
  defaults:
    conv2d: {batch_norm: true, activation: relu}
  blocks:
    branches:
      params: {f: null}
      layers:
        - {name: a, type: conv2d, filters: "${f}", kernel: 3, inputs: [$input]}
        - {name: b, type: conv2d, filters: "${f}", kernel: [1, 3], inputs: [$input]}
        - {name: p, type: avg_pool, pool: 3, strides: 1, padding: same, inputs: [$input]}
        - {name: cat, type: concat, inputs: [a, b, p]}
  layers:
    - {name: image, type: input, shape: [9, 9, 2]}
    - {name: stem, type: conv2d, filters: 4, kernel: 3, strides: 2, padding: valid}
    - {name: m, block: branches, repeat: 2, each: [{f: 3}, {f: 5}]}
    - {name: pool, type: max_pool, pool: 2}
    - {name: flat, type: flatten}
    - {name: drop, type: dropout, rate: 0.3}
    - {name: logits, type: dense, units: 6}
    - {name: label, type: input, shape: [], dtype: int32, classes: 6}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, label]}
"""

SEQ = """
version: 1
model:
  layers:
    - {name: src, type: input, shape: [4], dtype: int32, classes: 11}
    - {name: src_emb, type: embedding, vocab: 11, dim: 5}
    - {name: enc, type: lstm, units: 6}
    - {name: tgt, type: input, shape: [3], dtype: int32, classes: 13}
    - {name: tgt_emb, type: embedding, vocab: 13, dim: 5}
    - {name: dec, type: lstm, units: 7}
    - {name: att, type: attention, units: 8, inputs: [dec, enc]}
    - {name: proj, type: dense, units: 13}
    - {name: out, type: input, shape: [3], dtype: int32, classes: 13}
    - {name: loss, type: softmax_cross_entropy, inputs: [proj, out]}
"""


@pytest.mark.parametrize("text", [SMALL, SEQ], ids=["convnet", "seq2seq"])
def test_inspect_agrees_with_the_built_graph(text, rng):
    loaded = load_text(text, "small.yaml")
    model = build_model(loaded, training=True)
    report = summarize(loaded, model)
    assert (report["params"]["trainable"], report["params"]["non_trainable"]) == model.params() == loaded.params()
    for row in report["layers"]:
        assert tuple(row["output_shape"]) == model.outputs[row["name"]].shape
        made = [n for n in model.graph.nodes if n == row["name"] or n.startswith(row["name"] + "/")]
        assert row["nodes"] == len(model.layer_nodes[row["name"]]) == len(made)
        counted = sum(math.prod(model.graph.nodes[n].attrs["shape"]) for n in made
                      if model.graph.nodes[n].op == "Variable")
        assert counted == row["params"]
    # The report's FLOPs are the sum of the ops' cost functions over the training step.
    assert report["flops"]["training_step"] > report["flops"]["forward"] > 0
    sess = fc.Session(model.graph, store=fc.ContainerStore())
    sess.run(model.initializer())
    loss, *_ = sess.run([model.loss] + model.updates, _feeds(model, 3, rng))
    assert np.isfinite(loss) and loss > 0


def test_seq2seq_param_count_by_hand():
    loaded = load_text(SEQ, "seq.yaml")
    lstm = lambda d, u: (d + u) * 4 * u + 4 * u
    want = 11 * 5 + lstm(5, 6) + 13 * 5 + lstm(5, 7) + (7 * 6 + (6 + 7) * 8) + (8 * 13 + 13)
    assert loaded.params() == (want, 0)


def test_lstm_layer_matches_a_numpy_reference(rng):
    """The unrolled LSTM against an independent float64 loop over time (gates i, f, g, o)."""
    text = """
version: 1
model:
  dtype: float64
  layers:
    - {name: x, type: input, shape: [3, 2], dtype: float64}
    - {name: rnn, type: lstm, units: 4, forget_bias: 1.0}
"""
    model = build_model(load_text(text, "lstm.yaml"), training=False)
    sess = fc.Session(model.graph, store=fc.ContainerStore())
    sess.run(model.initializer())
    x = rng.standard_normal((5, 3, 2))
    kernel, bias = sess.run(model.variables["rnn"])
    got = sess.run(model.outputs["rnn"], {model.inputs["x"]: x})
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))
    h, c = np.zeros((5, 4)), np.zeros((5, 4))
    for t in range(3):
        z = np.concatenate([x[:, t], h], axis=1) @ kernel + bias
        i, f, g, o = z[:, :4], z[:, 4:8], z[:, 8:12], z[:, 12:]
        c = sig(f + 1.0) * c + sig(i) * np.tanh(g)
        h = sig(o) * np.tanh(c)
        np.testing.assert_allclose(got[:, t], h, rtol=1e-10, atol=1e-12)


def test_demo_spec_learns_in_a_few_steps():
    """Plain SGD on the demo spec's learnable synthetic task: the loss falls."""
    from flowctl.data import InputSpec, make_source

    loaded = load_spec(SPECS / "demo.yaml")
    model = build_model(loaded, training=True)
    g = model.graph
    params = model.trainable_variables()
    with g.as_default():
        grads = fc.gradients(model.loss, params)
        step = fc.group([fc.assign_sub(v, gr * 0.5) for v, gr in zip(params, grads)])
    sess = fc.Session(g, store=fc.ContainerStore())
    sess.run(model.initializer())
    inputs = [InputSpec(i.name, tuple(i.output.shape[1:]), i.output.dtype, i.layer.classes)
              for i in loaded.inputs()]
    data = make_source(loaded.spec.data.model_dump(), inputs, loaded.global_batch)
    losses = []
    for _ in range(150):
        batch = data.next_batch()
        loss, _ = sess.run([model.loss, step], {model.inputs[k]: v for k, v in batch.items()})
        losses.append(loss)
    assert np.mean(losses[-20:]) < 0.6 * np.mean(losses[:20])
