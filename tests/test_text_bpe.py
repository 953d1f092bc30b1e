"""The text source's byte-level BPE (issue 34): learned once at a run's first start, kept in the
run directory and read back by resume, evaluate and predict; ids round-trip; exact resume; one
clear error without the `tokenizers` package; and the Markov corpus whose entropy rate bounds a
language model's perplexity."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("tokenizers")

from flowctl.cli.main import cli  # noqa: E402
from flowctl.data import InputSpec, TextSource, make_source, unigram_perplexity  # noqa: E402
from flowctl.data.bpe import NEEDS, ByteBPE  # noqa: E402
from flowctl.data.markov import MarkovCorpus  # noqa: E402
from flowctl.engine.errors import CheckpointError, SpecError  # noqa: E402
from flowctl.spec.loader import load_spec  # noqa: E402
from flowctl.training.inputs import TOKENIZER  # noqa: E402
from flowctl.training.trainer import Trainer  # noqa: E402

CORPUS = MarkovCorpus.random(words=8, seed=0)
VOCAB = CORPUS.bpe_vocab_size()  # 272: every " word" one token

# tests/tiny_specs.py's shrunk lstm_lm shape (two 12-unit LSTMs, 8-d embedding, 6 steps) over
# the BPE's vocabulary; dropout so that the resumed RNG state matters too.
SPEC = f"""\
version: 1
name: bpe_lm
model:
  layers:
    - {{name: tokens, type: input, shape: [6], dtype: int32, classes: {VOCAB}}}
    - {{name: embedding, type: embedding, vocab: {VOCAB}, dim: 8}}
    - {{name: lstm_1, type: lstm, units: 12}}
    - {{name: drop, type: dropout, rate: 0.2}}
    - {{name: lstm_2, type: lstm, units: 12}}
    - {{name: softmax, type: dense, units: {VOCAB}}}
    - {{name: targets, type: input, shape: [6], dtype: int32, classes: {VOCAB}}}
    - {{name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}}
data: {{source: text, path: corpus.txt, tokenizer: bpe, vocab_size: {VOCAB}, validation_fraction: 0.1}}
training:
  optimizer: {{type: adam}}
  learning_rate: 0.02
  batch_size: 4
  steps: 20
  seed: 3
  eval_every_steps: 10
  metrics: [loss, perplexity]
checkpoint: {{every_steps: 100, keep: 2}}
"""

INPUTS = [InputSpec("tokens", (6,), "int32", VOCAB), InputSpec("targets", (6,), "int32", VOCAB)]


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    CORPUS.write(tmp_path / "corpus.txt", 3000, seed=1)
    p = tmp_path / "bpe_lm.yaml"
    p.write_text(SPEC)
    return p


def train(spec_file: Path, run_dir: Path, steps: int, resume: bool = False) -> Trainer:
    t = Trainer(load_spec(spec_file), run_dir, steps=steps, prefetch=0)
    try:
        t.restore() if resume else t.start_fresh(spec_file.read_text(), str(spec_file))
        t.train()
    finally:
        t.close()
    return t


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_ids_round_trip_and_the_tokenizer_is_a_function_of_the_corpus(tmp_path):
    text = "Grüße, 世界! tabs\tand\nlines\n\n  spaced  out\n" + CORPUS.text(CORPUS.sample(500, seed=2))
    a, b = ByteBPE.train(text, 300), ByteBPE.train(text, 300)
    assert a.to_json() == b.to_json()  # the same merges, in the same order
    ids = a.encode(text)
    assert ids.dtype == np.int64 and ids.max() < len(a) <= 300
    assert a.decode(ids) == text
    assert ByteBPE.from_json(a.to_json()).decode(ids) == text
    # bytes it never saw still encode (the alphabet is all 256 bytes), and come back
    unseen = "ÆØÅ ∑ 🙂\n"
    assert a.decode(a.encode(unseen)) == unseen
    # on the Markov corpus with room for every word, one token per word (and the line end)
    words = CORPUS.sample(400, seed=3)
    bpe = ByteBPE.train(CORPUS.text(words), VOCAB)
    encoded = bpe.encode(CORPUS.text(words))
    assert len(encoded) == len(words) + 1
    assert [bpe.token(i) for i in encoded[:-1]] == [" " + CORPUS.words[w] for w in words]


def test_batches_are_shifted_by_one_deterministic_and_resume_exactly(spec_file):
    cfg = {"source": "text", "path": "corpus.txt", "tokenizer": "bpe", "vocab_size": VOCAB, "seed": 4}
    a = make_source(cfg, INPUTS, 4, base_dir=spec_file.parent)
    b = make_source(cfg, INPUTS, 4, base_dir=spec_file.parent)
    assert isinstance(a, TextSource) and a.tokenizer is not None and a.vocab is None
    for _ in range(5):
        x, y = a.next_batch(), b.next_batch()
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
        np.testing.assert_array_equal(x["targets"], y["targets"])
        assert x["tokens"].shape == (4, 6) and x["tokens"].dtype == np.int32
        np.testing.assert_array_equal(x["tokens"][:, 1:], x["targets"][:, :-1])
    # the rows are the contiguous stream: row 0 starts the corpus
    first = make_source(cfg, INPUTS, 4, base_dir=spec_file.parent).next_batch()
    np.testing.assert_array_equal(first["tokens"][0], a.tokenizer.encode((spec_file.parent / "corpus.txt").read_text())[:6])
    state = json.loads(json.dumps(a.state()))
    c = make_source(cfg, INPUTS, 4, base_dir=spec_file.parent)
    c.restore(state)
    np.testing.assert_array_equal(c.next_batch()["tokens"], a.next_batch()["tokens"])


def test_a_model_too_small_for_the_tokenizer_is_one_spec_error(spec_file):
    cfg = {"source": "text", "path": "corpus.txt", "tokenizer": "bpe", "vocab_size": VOCAB}
    small = [InputSpec("tokens", (6,), "int32", 100), InputSpec("targets", (6,), "int32", 100)]
    with pytest.raises(SpecError, match="the tokenizer has 265 tokens but .* take 100 classes"):
        make_source(cfg, small, 4, base_dir=spec_file.parent)


@pytest.mark.parametrize("data, why", [
    ("{source: text, path: c.txt, tokenizer: bpe}", "vocab_size of at least 256"),
    ("{source: text, path: c.txt, tokenizer: bpe, vocab_size: 100}", "vocab_size of at least 256"),
    ("{source: text, path: c.txt, tokenizer: bpe, vocab_size: 300, lengths: n}", "lengths"),
    ("{source: text, path: c.txt, tokenizer: bytes, vocab_size: 300}", "tokenizer"),
])
def test_bad_tokenizer_keys_are_located_spec_errors(tmp_path, data, why):
    spec = tmp_path / "bad.yaml"
    spec.write_text(SPEC.replace(SPEC.split("data: ")[1].split("\n")[0], data))
    r = CliRunner().invoke(cli, ["validate", str(spec)])
    assert r.exit_code == SpecError.exit_code, r.output
    assert why in r.output and "bad.yaml:" in r.output and "Traceback" not in r.output


def test_twenty_steps_straight_equal_ten_then_resume_then_ten_and_resume_never_relearns(
        spec_file, tmp_path, monkeypatch):
    full = train(spec_file, tmp_path / "full", 20)
    train(spec_file, tmp_path / "split", 10)
    stored = (tmp_path / "split" / TOKENIZER).read_text()
    assert stored == (tmp_path / "full" / TOKENIZER).read_text()  # learned once, the same on both

    def no_learning(*args, **kwargs):
        raise AssertionError("resume learned the tokenizer again")

    monkeypatch.setattr(ByteBPE, "train", no_learning)
    again = train(spec_file, tmp_path / "split", 20, resume=True)
    assert losses(tmp_path / "full") == losses(tmp_path / "split")  # bitwise, step by step
    assert len(losses(tmp_path / "split")) == 20
    va, vb = full.session.variable_values(), again.session.variable_values()
    for k in va:
        np.testing.assert_array_equal(va[k], vb[k], err_msg=k)
    assert (tmp_path / "split" / TOKENIZER).read_text() == stored


def test_a_changed_corpus_is_read_with_the_stored_tokenizer_and_a_lost_one_is_refused(spec_file, tmp_path):
    run = tmp_path / "run"
    train(spec_file, run, 4)
    stored = (run / TOKENIZER).read_text()
    # another corpus of other words: a tokenizer learned on it would merge other pairs
    other = MarkovCorpus(tuple(w.upper() + "x" for w in CORPUS.words), CORPUS.transitions)
    other.write(spec_file.parent / "corpus.txt", 3000, seed=7)
    assert ByteBPE.train((spec_file.parent / "corpus.txt").read_text(), VOCAB).to_json() != stored
    t = train(spec_file, run, 6, resume=True)
    assert t.tokenizer is not None and t.tokenizer.to_json() == stored
    (run / TOKENIZER).write_text("{not a tokenizer")
    with pytest.raises(CheckpointError, match="tokenizer.json: damaged"):
        Trainer(load_spec(spec_file), run, prefetch=0)
    (run / TOKENIZER).unlink()
    r = CliRunner().invoke(cli, ["resume", str(run)])
    assert r.exit_code == CheckpointError.exit_code and "tokenizer.json: missing" in r.output, r.output
    assert "Traceback" not in r.output


def test_evaluate_and_predict_use_the_stored_tokenizer(spec_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    r = CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", str(run), "--steps", "12"])
    assert r.exit_code == 0, r.output
    assert (run / TOKENIZER).exists()
    monkeypatch.setattr(ByteBPE, "train", lambda *a, **k: pytest.fail("evaluate learned the tokenizer again"))
    r = CliRunner().invoke(cli, ["evaluate", str(run), "--json"])
    assert r.exit_code == 0, r.output
    e = json.loads(r.stdout)
    assert e["val/perplexity"] == pytest.approx(math.exp(e["val/loss"]))
    assert 1.0 < e["val/perplexity"] < VOCAB
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" aa ab ac")
    r = CliRunner().invoke(cli, ["predict", str(run), str(prompt), "--top", "3", "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)
    assert p["context"] == " aa ab ac" and len(p["next"]) == 3
    assert p["next"][0]["probability"] >= p["next"][1]["probability"] >= p["next"][2]["probability"]
    assert all(0 <= n["token"] < VOCAB and n["word"] == ByteBPE.from_json((run / TOKENIZER).read_text()).token(n["token"]) for n in p["next"])


def test_without_tokenizers_a_bpe_spec_is_one_clear_error(spec_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == SpecError.exit_code, r.output
    assert NEEDS in r.output and "Traceback" not in r.output
    assert not (tmp_path / "run").exists()  # the failed start left nothing behind


def test_the_markov_corpus_bounds_and_the_unigram_baseline(spec_file):
    """The chain's entropy rate is what a long sample's log-likelihood under the chain converges
    to, and lies below the unigram model's cross-entropy; the text source's `unigram_perplexity`
    over BPE tokens agrees with the corpus's over words (one token per word)."""
    ids = CORPUS.sample(40_000, seed=5)
    h = CORPUS.entropy_rate()
    empirical = -np.log(CORPUS.transitions[ids[:-1], ids[1:]]).mean()
    assert empirical == pytest.approx(h, rel=0.03)
    pi = CORPUS.stationary()
    assert h < -(pi * np.log(pi)).sum() < math.log(len(CORPUS.words))
    figures = CORPUS.perplexities(ids, 0.1)
    assert figures["bound"] == pytest.approx(math.exp(h))
    assert figures["bound"] < figures["unigram"] < len(CORPUS.words)

    words = CORPUS.write(spec_file.parent / "corpus.txt", 20_000, seed=6)
    cfg = {"source": "text", "path": "corpus.txt", "tokenizer": "bpe", "vocab_size": VOCAB,
           "validation_fraction": 0.1}
    train_src = make_source(cfg, INPUTS, 4, base_dir=spec_file.parent)
    held = make_source(cfg, INPUTS, 4, base_dir=spec_file.parent, split="validation", tokenizer=train_src.tokenizer)
    assert len(train_src.ids) + len(held.ids) == len(words) + 1
    by_tokens = unigram_perplexity(train_src, held)
    by_words = CORPUS.perplexities(words, 0.1)["unigram"]
    # the same counts up to add-one smoothing over 265 tokens instead of 8 words, and the line end
    assert by_tokens == pytest.approx(by_words, rel=0.03)
    assert CORPUS.perplexities(words, 0.1)["bound"] < by_tokens
