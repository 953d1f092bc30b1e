"""`lstm: {unroll: dynamic}`: one cell in a while loop over time (§4.4) against the static unroll:
the same loss and gradients at equal length, a graph whose size does not grow with the length,
and exact resume of a training run."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowctl as fc
from flowctl.spec.loader import load_text
from flowctl.spec.model import build_model
from test_train_runs import assert_same_state, losses, resumed, straight

SPEC = """\
version: 1
name: tiny_lm
model:
  layers:
    - {name: tokens, type: input, shape: [T], dtype: int32, classes: 50}
    - {name: embedding, type: embedding, vocab: 50, dim: 8, init_scale: 0.1, inputs: [tokens]}
    - {name: lstm_1, type: lstm, units: 12, init_scale: 0.1, forget_bias: 1.0, unroll: UNROLL}
    - {name: lstm_2, type: lstm, units: 12, init_scale: 0.1, unroll: UNROLL}
    - {name: softmax, type: dense, units: 50}
    - {name: targets, type: input, shape: [T], dtype: int32, classes: 50}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
data: {source: synthetic, seed: 0}
training:
  optimizer: {type: adam}
  batch_size: 4
  steps: 8
  seed: 2
checkpoint: {every_steps: 100, keep: 3}
"""


def spec(unroll: str, steps: int = 7) -> str:
    return SPEC.replace("UNROLL", unroll).replace("[T]", f"[{steps}]")


def loss_and_grads(unroll: str, tokens: np.ndarray, targets: np.ndarray) -> list[np.ndarray]:
    model = build_model(load_text(spec(unroll, tokens.shape[1])))
    variables = sorted(model.trainable_variables(), key=lambda v: v.node)
    with model.graph.as_default():
        grads = fc.gradients(model.loss, variables)
    sess = fc.Session(model.graph)
    sess.run(model.initializer())
    return sess.run([model.loss] + grads, {model.inputs["tokens"]: tokens, model.inputs["targets"]: targets})


def test_dynamic_lstm_gives_the_static_loss_and_gradients() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, (4, 7)).astype(np.int32)
    targets = rng.integers(0, 50, (4, 7)).astype(np.int32)
    static = loss_and_grads("static", tokens, targets)
    dynamic = loss_and_grads("dynamic", tokens, targets)
    assert len(static) == len(dynamic) == 1 + 2 * 2 + 1 + 2  # loss, two LSTMs, embedding, dense
    for s, d in zip(static, dynamic):
        np.testing.assert_allclose(d, s, rtol=1e-5, atol=1e-7)


def test_dynamic_lstm_graph_does_not_grow_with_the_length() -> None:
    sizes = {}
    for unroll in ("static", "dynamic"):
        for steps in (5, 35):
            model = build_model(load_text(spec(unroll, steps)))
            sizes[unroll, steps] = len(model.layer_nodes["lstm_1"])
    assert sizes["dynamic", 5] == sizes["dynamic", 35] < 100
    assert sizes["static", 35] > sizes["static", 5] + 25  # a cell node and its product per step


@pytest.mark.parametrize("k", [3])
def test_exact_resume_with_a_dynamic_lstm(tmp_path: Path, k: int) -> None:
    path = tmp_path / "lm.yaml"
    path.write_text(spec("dynamic"))

    full = straight(path, tmp_path / "full", 8)
    straight(path, tmp_path / "split", k)
    again = resumed(path, tmp_path / "split", 8)
    assert losses(tmp_path / "full") == losses(tmp_path / "split")  # bitwise, step by step
    assert_same_state(full, again)


LENGTHS = """\
version: 1
name: tiny_lm_lengths
model:
  layers:
    - {name: tokens, type: input, shape: [7], dtype: int32, classes: 50}
    - {name: lengths, type: input, shape: [], dtype: int32, classes: 8}
    - {name: embedding, type: embedding, vocab: 50, dim: 8, init_scale: 0.1, inputs: [tokens]}
    - {name: lstm_1, type: lstm, units: 12, init_scale: 0.1, unroll: dynamic, inputs: [embedding, LENGTHS]}
    - {name: softmax, type: dense, units: 50}
    - {name: targets, type: input, shape: [7], dtype: int32, classes: 50}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
data: {source: synthetic, seed: 0}
training: {optimizer: {type: adam}, batch_size: 5, steps: 6, seed: 2}
checkpoint: {every_steps: 100, keep: 3}
"""


def test_lengths_freeze_the_state_and_zero_the_outputs_past_each_example() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50, (5, 7)).astype(np.int32)
    lengths = np.array([7, 3, 1, 0, 5], np.int32)
    outs = {}
    for with_lengths in (False, True):
        text = LENGTHS.replace(", LENGTHS]", ", lengths]" if with_lengths else "]")
        model = build_model(load_text(text))
        sess = fc.Session(model.graph)
        sess.run(model.initializer())
        feeds = {model.inputs["tokens"]: tokens}
        if with_lengths:
            feeds[model.inputs["lengths"]] = lengths
        stats = fc.RunStats()
        outs[with_lengths] = sess.run(model.outputs["lstm_1"], feeds, stats=stats)
        if with_lengths:  # the loop ran max(lengths) - 1 = 6 iterations, not more
            assert sum(1 for n in stats.nodes_run if n.endswith("time_loop/NextIteration")) == 6
    full, masked = outs[False], outs[True]
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(masked[b, :n], full[b, :n])
        assert not masked[b, n:].any()


def test_a_dynamic_lstm_trains_on_variable_length_data_and_resumes_exactly(tmp_path: Path) -> None:
    path = tmp_path / "lm.yaml"
    path.write_text(LENGTHS.replace(", LENGTHS]", ", lengths]"))

    straight(path, tmp_path / "full", 6)
    straight(path, tmp_path / "split", 2)
    resumed(path, tmp_path / "split", 6)
    got = losses(tmp_path / "split")
    assert got == losses(tmp_path / "full") and len(got) == 6
    assert all(np.isfinite(got))


SENTENCES = """\
version: 1
name: lm_sentences
model:
  layers:
    - {name: tokens, type: input, shape: [8], dtype: int32, classes: 12}
    - {name: lengths, type: input, shape: [], dtype: int32, classes: 9}
    - {name: targets, type: input, shape: [8], dtype: int32, classes: 12}
    - {name: embedding, type: embedding, vocab: 12, dim: 6, init_scale: 0.1, inputs: [tokens]}
    - {name: lstm_1, type: lstm, units: 8, init_scale: 0.1, unroll: dynamic, inputs: [embedding, lengths]}
    - {name: softmax, type: dense, units: 12}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets, lengths]}
data: {source: text, path: corpus.txt, vocab_size: 12, lengths: lengths, bucket: true, seed: 3}
training: {optimizer: {type: adam}, learning_rate: 0.05, batch_size: 4, steps: 10, seed: 1}
checkpoint: {every_steps: 100, keep: 3}
"""


def _corpus(path: Path, lines: int = 24) -> None:
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat dog ran far".split()
    path.write_text("\n".join(" ".join(rng.choice(words, size=rng.integers(1, 11))) for _ in range(lines)) + "\n")


def test_sentences_with_lengths_and_buckets_from_a_text_file(tmp_path: Path) -> None:
    from flowctl.data import InputSpec, make_source

    _corpus(tmp_path / "corpus.txt")
    inputs = [InputSpec("tokens", (8,), "int32", 12), InputSpec("lengths", (), "int32", 9),
              InputSpec("targets", (8,), "int32", 12)]
    cfg = {"source": "text", "path": "corpus.txt", "lengths": "lengths", "bucket": True, "seed": 3}
    src = make_source(cfg, inputs, 4, base_dir=tmp_path)
    lines = [line.split() for line in (tmp_path / "corpus.txt").read_text().splitlines()]
    batches = [src.next_batch() for _ in range(6)]
    assert sorted(int(n) for b in batches for n in b["lengths"]) == sorted(min(len(w), 8) for w in lines)
    for b in batches:
        assert b["lengths"].max() - b["lengths"].min() <= 3  # a bucket holds similar lengths
        for row, n in zip(b["tokens"], b["lengths"]):
            assert not row[n:].any()
    state = src.state()
    more = [src.next_batch() for _ in range(3)]
    again = make_source(cfg, inputs, 4, base_dir=tmp_path)
    again.restore(state)
    for want in more:
        got = again.next_batch()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_a_dynamic_lstm_lm_trains_on_bucketed_sentences_and_resumes_exactly(tmp_path: Path) -> None:
    _corpus(tmp_path / "corpus.txt")
    path = tmp_path / "lm.yaml"
    path.write_text(SENTENCES)

    straight(path, tmp_path / "full", 10)
    straight(path, tmp_path / "split", 4)
    resumed(path, tmp_path / "split", 10)
    got = losses(tmp_path / "split")
    assert got == losses(tmp_path / "full") and len(got) == 10
    assert np.mean(got[-3:]) < np.mean(got[:3])  # it learns


@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("sequences", [True, False])
def test_dynamic_equals_static_for_short_sequences_and_last_outputs(steps: int, sequences: bool) -> None:
    text = """\
version: 1
name: t
model:
  layers:
    - {name: x, type: input, shape: [STEPS, 3]}
    - {name: lstm_1, type: lstm, units: 4, unroll: UNROLL, return_sequences: SEQ}
data: {source: synthetic, seed: 0}
training: {optimizer: {type: sgd}, batch_size: 2, steps: 1}
""".replace("STEPS", str(steps)).replace("SEQ", str(sequences).lower())
    x = np.random.default_rng(0).standard_normal((2, steps, 3)).astype(np.float32)
    out = {}
    for unroll in ("static", "dynamic"):
        model = build_model(load_text(text.replace("UNROLL", unroll)))
        sess = fc.Session(model.graph)
        sess.run(model.initializer())
        out[unroll] = sess.run(model.outputs["lstm_1"], {model.inputs["x"]: x})
    # The static unroll runs the fused LSTMBlockCell, the loop the composed cell: float32 rounding.
    np.testing.assert_allclose(out["dynamic"], out["static"], rtol=1e-5, atol=1e-6)
