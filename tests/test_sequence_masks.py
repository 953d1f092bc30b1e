"""Variable-length sequences done right: a loss masked by each example's length is the mean
cross-entropy over real tokens only, attention stays off padded memory, and evaluation counts real
tokens. Checked against float64 numpy references and by changing what lies in the padding."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.errors import SpecError
from flowctl.spec.loader import load_text
from flowctl.spec.model import build_model
from test_dynamic_rnn import SENTENCES as _DYNAMIC_SENTENCES, _corpus

V, T, B = 7, 5, 4

LOSS = f"""\
version: 1
name: masked
model:
  layers:
    - {{name: logits, type: input, shape: [{T}, {V}], dtype: float64}}
    - {{name: labels, type: input, shape: [{T}], dtype: int32, classes: {V}}}
    - {{name: lengths, type: input, shape: [], dtype: int32, classes: {T + 1}}}
    - {{name: loss, type: softmax_cross_entropy, inputs: [logits, labels, lengths]}}
"""


def _data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, T, V)), rng.integers(0, V, (B, T)).astype(np.int32),
            np.array([5, 1, 3, 0], np.int32))


def _reference(logits: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> float:
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    nll = [-logp[b, t, labels[b, t]] for b in range(B) for t in range(lengths[b])]
    return float(np.mean(nll))


def test_a_masked_loss_is_the_mean_over_real_tokens_and_ignores_the_padding() -> None:
    model = build_model(load_text(LOSS))
    x, y, n = (model.inputs[k] for k in ("logits", "labels", "lengths"))
    (dx,) = fc.gradients(model.loss, [x])
    sess = fc.Session(model.graph)
    logits, labels, lengths = _data(0)
    loss, grad = sess.run([model.loss, dx], {x: logits, y: labels, n: lengths})
    assert loss == pytest.approx(_reference(logits, labels, lengths), rel=1e-12)
    alive = np.arange(T)[None, :] < lengths[:, None]
    assert not grad[~alive].any() and np.abs(grad[alive]).sum() > 0  # no gradient flows into padding
    # Whatever lies in the padding, the loss and its gradient stay the same.
    other_logits, other_labels, _ = _data(1)
    logits2, labels2 = np.where(alive[..., None], logits, other_logits), np.where(alive, labels, other_labels)
    loss2, grad2 = sess.run([model.loss, dx], {x: logits2, y: labels2, n: lengths})
    assert loss2 == loss
    np.testing.assert_array_equal(grad2, grad)


def test_a_lengths_input_needs_sequence_logits_and_integer_lengths() -> None:
    bad = LOSS.replace("shape: [], dtype: int32, classes: 6", "shape: [], dtype: float32")
    with pytest.raises(SpecError, match="lengths 'lengths' must be one integer per example"):
        load_text(bad)


ATTENTION = f"""\
version: 1
name: attend
model:
  dtype: float64
  layers:
    - {{name: queries, type: input, shape: [3, 4], dtype: float64}}
    - {{name: memory, type: input, shape: [{T}, 4], dtype: float64}}
    - {{name: lengths, type: input, shape: [], dtype: int32, classes: {T + 1}}}
    - {{name: attention, type: attention, inputs: [queries, memory, lengths]}}
"""


def test_attention_with_memory_lengths_never_looks_at_the_padding() -> None:
    model = build_model(load_text(ATTENTION))
    q, m, n = (model.inputs[k] for k in ("queries", "memory", "lengths"))
    align = model.graph.tensor("attention/align:0")
    sess = fc.Session(model.graph)
    sess.run(model.initializer())
    rng = np.random.default_rng(2)
    queries, memory, lengths = rng.standard_normal((B, 3, 4)), rng.standard_normal((B, T, 4)), np.array([5, 1, 3, 2])
    out, weights = sess.run([model.outputs["attention"], align], {q: queries, m: memory, n: lengths})
    alive = np.arange(T)[None, :] < lengths[:, None]
    assert not weights.transpose(0, 2, 1)[~alive].any()  # exactly zero weight on padded memory
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-12)
    padded = np.where(alive[..., None], memory, 1e3 * rng.standard_normal((B, T, 4)))
    np.testing.assert_array_equal(sess.run(model.outputs["attention"], {q: queries, m: padded, n: lengths}), out)


# The dynamic-LSTM sentence model of test_dynamic_rnn, held out a quarter and evaluated.
SENTENCES = (_DYNAMIC_SENTENCES
             .replace("bucket: true, seed: 3}", "validation_fraction: 0.25, seed: 3}")
             .replace("steps: 10, seed: 1}", "steps: 3, seed: 1,\n           metrics: [loss, accuracy, perplexity]}"))


def test_evaluation_of_sentences_reads_held_out_lines_and_counts_real_tokens(tmp_path: Path) -> None:
    from flowctl.training.evaluate import Evaluator

    _corpus(tmp_path / "corpus.txt", 32)
    (tmp_path / "lm.yaml").write_text(SENTENCES)
    loaded = load_text(SENTENCES, str(tmp_path / "lm.yaml"), base_dir=tmp_path)
    store = fc.ContainerStore()
    ev = Evaluator(loaded, store, "cpu:0")
    fc.Session(ev.graph, store=store).run(ev.model.initializer())
    held = ev.source(4)
    train = ev.source(4, split="train")
    assert held.batches_per_epoch == 2 and train.batches_per_epoch == 6  # the last quarter of the lines
    scores = ev.run(held)

    # The same figures from the logits, by hand: only positions below each line's length count.
    held = ev.source(4)
    inputs = ev.model.inputs
    nll_sum, hits, tokens = 0.0, 0, 0
    for _ in range(2):
        batch = held.next_batch()
        logits = ev.session.run(ev.logits, {inputs[k]: v for k, v in batch.items() if k in inputs}).astype(np.float64)
        for b, n in enumerate(batch["lengths"]):
            for t in range(n):
                row = logits[b, t] - logits[b, t].max()
                nll_sum -= row[batch["targets"][b, t]] - np.log(np.exp(row).sum())
                hits += int(np.argmax(logits[b, t]) == batch["targets"][b, t])
                tokens += 1
    assert tokens < 2 * 4 * 8  # there was padding to leave out
    assert scores.values["val/accuracy"] == pytest.approx(hits / tokens, abs=1e-12)
    assert scores.values["val/loss"] == pytest.approx(nll_sum / tokens, rel=1e-5)
    assert scores.values["val/perplexity"] == pytest.approx(np.exp(nll_sum / tokens), rel=1e-5)


def test_predict_continues_a_sentence_after_its_last_word(tmp_path: Path) -> None:
    """A sentence model reads the text as one sentence: the next-word distribution is the one at
    its last word, the same as at that position of any longer sentence that starts with it."""
    import json

    from click.testing import CliRunner

    from flowctl.cli.main import cli
    from flowctl.training.inference import open_run

    _corpus(tmp_path / "corpus.txt", 32)
    (tmp_path / "lm.yaml").write_text(SENTENCES)
    r = CliRunner().invoke(cli, ["train", str(tmp_path / "lm.yaml"), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    (tmp_path / "q.txt").write_text("the cat\n")
    r = CliRunner().invoke(cli, ["predict", str(tmp_path / "run"), str(tmp_path / "q.txt"), "--json", "--top", "12"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["context"] == ["the", "cat"]
    m = open_run(tmp_path / "run")
    vocab = {w: i for i, w in enumerate(m.evaluator.source(4).vocab.words)}
    inputs = m.evaluator.model.inputs
    tokens = np.zeros((4, 8), np.int32)
    tokens[:, :5] = [vocab[w] for w in "the cat sat on a".split()]
    logits = m.session.run(m.evaluator.logits, {inputs["tokens"]: tokens, inputs["lengths"]: np.full(4, 5, np.int32)})
    z = logits[0, 1].astype(np.float64)
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    for entry in got["next"]:
        assert entry["probability"] == pytest.approx(p[vocab[entry["word"]]], rel=1e-5)

    # `evaluate --data FILE` reads FILE as the run reads text (sentences with their lengths) and
    # encodes it with the training corpus's vocabulary, exactly as a validation file would be.
    lines = (tmp_path / "corpus.txt").read_text().splitlines()
    # (its own word counts differ: "far" leads, so a vocabulary built from it would renumber words)
    (tmp_path / "other.txt").write_text("\n".join("far far " + line for line in lines[:16]) + "\n")
    r = CliRunner().invoke(cli, ["evaluate", str(tmp_path / "run"), "--data", str(tmp_path / "other.txt"), "--json"])
    assert r.exit_code == 0, r.output
    cfg = {**m.loaded.spec.data.model_dump(exclude={"validation_fraction"}), "validation": str(tmp_path / "other.txt")}
    want = m.evaluator.run(m.evaluator.source(4, config=cfg))
    assert json.loads(r.stdout)["val/loss"] == pytest.approx(want.values["val/loss"], rel=1e-12)


NARROW = """\
version: 1
name: narrow
model:
  layers:
    - {name: tokens, type: input, shape: [6], dtype: TOKENS, classes: 50}
    - {name: label, type: input, shape: [], dtype: LABELS, classes: 4}
    - {name: embedding, type: embedding, vocab: 50, dim: 8, inputs: [tokens]}
    - {name: flat, type: flatten}
    - {name: logits, type: dense, units: 4}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, label]}
data: {source: synthetic, seed: 4}
training: {optimizer: {type: adam}, learning_rate: 0.01, batch_size: 8, steps: 6, seed: 2}
"""


@pytest.mark.parametrize("tokens,labels", [("int16", "uint8"), ("uint16", "int8")])
def test_narrow_integer_inputs_train_exactly_as_int32_ones(tmp_path: Path, tokens: str, labels: str) -> None:
    """Token ids and labels fed as 8- or 16-bit integers (a quarter of the bytes) are widened where
    they index: the run is the int32 run, loss for loss."""
    import json

    from click.testing import CliRunner

    from flowctl.cli.main import cli

    losses = {}
    for name, (t, lab) in {"narrow": (tokens, labels), "wide": ("int32", "int32")}.items():
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(NARROW.replace("TOKENS", t).replace("LABELS", lab))
        r = CliRunner().invoke(cli, ["train", str(spec), "--run-dir", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["narrow"]) == 6 and losses["narrow"] == losses["wide"]
