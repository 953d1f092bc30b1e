"""NMT on variable-length sentence pairs (issue 18): a parallel corpus read pair by pair, dynamic
LSTMs that stop at each sentence's length, attention kept off the source padding and a loss over
real target tokens. The task (each target is its source reversed) is one a small model learns."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.data import InputSpec, make_source
from flowctl.engine.errors import SpecError
from test_train_runs import losses, resumed, straight

SPEC = """\
version: 1
name: nmt_pairs
model:
  layers:
    - {name: source, type: input, shape: [8], dtype: int32, classes: 12}
    - {name: source_len, type: input, shape: [], dtype: int32, classes: 9}
    - {name: target_in, type: input, shape: [9], dtype: int32, classes: 12}
    - {name: target_out, type: input, shape: [9], dtype: int32, classes: 12}
    - {name: target_len, type: input, shape: [], dtype: int32, classes: 10}
    - {name: encoder/embedding, type: embedding, vocab: 12, dim: 16, init_scale: 0.1, inputs: [source]}
    - {name: encoder/lstm, type: lstm, units: 24, init_scale: 0.1, unroll: dynamic,
       inputs: [encoder/embedding, source_len]}
    - {name: decoder/embedding, type: embedding, vocab: 12, dim: 16, init_scale: 0.1, inputs: [target_in]}
    - {name: decoder/lstm, type: lstm, units: 24, init_scale: 0.1, unroll: dynamic,
       inputs: [decoder/embedding, target_len]}
    - {name: attention, type: attention, inputs: [decoder/lstm, encoder/lstm, source_len]}
    - {name: projection, type: dense, units: 12}
    - {name: loss, type: softmax_cross_entropy, inputs: [projection, target_out, target_len]}
data:
  source: parallel_text
  path: train.src
  target_path: train.tgt
  validation_fraction: 0.2
  feeds: {source: source, source_lengths: source_len, target_in: target_in, target_out: target_out,
          target_lengths: target_len}
  bucket: true
  seed: 2
training: {optimizer: {type: adam}, learning_rate: 0.02, batch_size: 8, steps: 160, seed: 1,
           eval_every_steps: 80, metrics: [loss, accuracy]}
checkpoint: {every_steps: 20, keep: 5}
"""

WORDS = "a b c d e f g h".split()


def _corpus(tmp_path: Path, pairs: int = 200) -> Path:
    rng = np.random.default_rng(0)
    src = [list(rng.choice(WORDS, size=rng.integers(2, 8))) for _ in range(pairs)]
    (tmp_path / "train.src").write_text("\n".join(" ".join(s) for s in src) + "\n")
    (tmp_path / "train.tgt").write_text("\n".join(" ".join(reversed(s)) for s in src) + "\n")
    (tmp_path / "nmt.yaml").write_text(SPEC)
    return tmp_path / "nmt.yaml"


def test_pairs_are_read_with_their_own_lengths_and_the_target_shifted(tmp_path: Path) -> None:
    _corpus(tmp_path)
    inputs = [InputSpec("s", (8,), "int32", 12), InputSpec("sl", (), "int32", 9), InputSpec("ti", (9,), "int32", 12),
              InputSpec("to", (9,), "int32", 12), InputSpec("tl", (), "int32", 10)]
    cfg = {"source": "parallel_text", "path": "train.src", "target_path": "train.tgt", "validation_fraction": 0.2,
           "feeds": {"source": "s", "source_lengths": "sl", "target_in": "ti", "target_out": "to",
                     "target_lengths": "tl"}}
    held = make_source(cfg, inputs, 4, base_dir=tmp_path, split="validation")
    src_lines = (tmp_path / "train.src").read_text().splitlines()
    batch = held.next_batch()
    for i in range(4):  # held-out pairs are the last 20%, in file order
        words = src_lines[160 + i].split()
        n, k = int(batch["sl"][i]), int(batch["tl"][i])
        assert n == len(words) and k == len(words) + 1
        assert held.vocabs[0].decode(batch["s"][i, :n]) == words
        assert not batch["s"][i, n:].any() and not batch["ti"][i, k:].any() and not batch["to"][i, k:].any()
        assert held.vocabs[1].decode(batch["ti"][i, :k]) == ["<eos>"] + words[::-1]
        assert held.vocabs[1].decode(batch["to"][i, :k]) == words[::-1] + ["<eos>"]
    train = make_source(cfg, inputs, 4, base_dir=tmp_path)
    assert train.batches_per_epoch == 40 and held.batches_per_epoch == 10
    (tmp_path / "short.tgt").write_text("a\n")
    with pytest.raises(SpecError, match="pairs them line by line"):
        make_source({**cfg, "target_path": "short.tgt"}, inputs, 4, base_dir=tmp_path)


def test_nmt_learns_variable_length_pairs_and_resumes_exactly(tmp_path: Path) -> None:
    spec = _corpus(tmp_path)

    straight(spec, tmp_path / "full", 160)
    straight(spec, tmp_path / "split", 60)
    resumed(spec, tmp_path / "split", 160)
    got = losses(tmp_path / "split")
    assert got == losses(tmp_path / "full") and len(got) == 160
    assert np.mean(got[-20:]) < 0.5 * np.mean(got[:20])  # it learns to reverse
    r = CliRunner().invoke(cli, ["evaluate", str(tmp_path / "full"), "--json"])
    assert r.exit_code == 0, r.output
    scores = json.loads(r.stdout)
    assert scores["val/accuracy"] > 0.5  # of real target tokens, on held-out pairs (chance: 1/9)

    # Greedy translation of held-out sources: each output word is the decoder's argmax given the
    # words before it, so feeding "<eos> + translation" back reproduces it (teacher forcing).
    lines = (tmp_path / "train.src").read_text().splitlines()[160:176]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    r = CliRunner().invoke(cli, ["predict", str(tmp_path / "full"), str(tmp_path / "in.txt"), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)["translations"]
    assert [t["source"] for t in out] == lines
    from flowctl.training.inference import open_run

    m = open_run(tmp_path / "full")
    src = make_source(m.loaded.spec.data.model_dump(), [i for i in _inputs(m)], 16, base_dir=tmp_path,
                      split="validation")
    words = [t["translation"].split() for t in out]
    ids = np.zeros((16, 9), np.int32)
    eos = src.vocabs[1].ids["<eos>"]
    ids[:, 0] = eos
    for i, w in enumerate(words):
        ids[i, 1:1 + len(w[:8])] = src.vocabs[1].encode(w[:8])
    batch = src.next_batch()
    inputs = m.evaluator.model.inputs
    logits = m.session.run(m.evaluator.logits, {inputs["source"]: batch["source"], inputs["source_len"]: batch["source_len"],
                                                inputs["target_in"]: ids, inputs["target_len"]: np.full(16, 9, np.int32)})
    for i, w in enumerate(words):
        want = list(src.vocabs[1].encode(w)) + ([eos] if len(w) < 9 else [])
        assert list(logits[i, :len(want)].argmax(axis=-1)) == want
    first_right = sum(w[:1] == line.split()[-1:] for w, line in zip(words, lines))
    assert first_right >= 12  # a reversal starts with the last source word


def _inputs(m):
    from flowctl.training.inputs import model_inputs

    return model_inputs(m.loaded)


def test_a_feed_naming_no_model_input_is_one_clear_error(tmp_path: Path) -> None:
    spec = _corpus(tmp_path)
    spec.write_text(SPEC.replace("target_lengths: target_len}", "target_lengths: target_lenght}"))
    r = CliRunner().invoke(cli, ["validate", str(spec)])
    assert r.exit_code != 0
    assert "data.feeds.target_lengths: 'target_lenght' is not a model input" in r.output
    assert "did you mean 'target_len'" in r.output
    assert "Traceback" not in r.output
