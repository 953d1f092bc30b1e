"""Data sources on files the tests create: synthetic, arrays, text; each cursor resumes exactly."""
from __future__ import annotations

import json

import numpy as np
import pytest

import flowctl as fc
from flowctl.data import ArraySource, InputSpec, SyntheticSource, TextSource, Vocabulary, make_source

IMAGE = InputSpec("image", (4, 4, 3), "float32")
LABEL = InputSpec("label", (), "int32", classes=5)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def _resume_matches(make, steps: int = 7, split: int = 3) -> None:
    """N batches straight == k batches, save the cursor (through JSON), restore into a fresh
    source, N-k more batches."""
    straight = make()
    want = [straight.next_batch() for _ in range(steps)]
    first = make()
    for _ in range(split):
        first.next_batch()
    state = json.loads(json.dumps(first.state()))
    second = make()
    second.restore(state)
    for i in range(split, steps):
        _same(second.next_batch(), want[i])


def test_synthetic_shapes_dtypes_and_ranges():
    src = SyntheticSource([IMAGE, LABEL], batch_size=6, seed=3)
    b = src.next_batch()
    assert b["image"].shape == (6, 4, 4, 3) and b["image"].dtype == np.float32
    assert b["label"].shape == (6,) and b["label"].dtype == np.int32
    assert b["label"].min() >= 0 and b["label"].max() < 5


def test_synthetic_is_seeded_and_resumable():
    _same(SyntheticSource([IMAGE, LABEL], 4, seed=1).next_batch(), SyntheticSource([IMAGE, LABEL], 4, seed=1).next_batch())
    a, b = SyntheticSource([IMAGE], 4, seed=1).next_batch(), SyntheticSource([IMAGE], 4, seed=2).next_batch()
    assert not np.array_equal(a["image"], b["image"])
    _resume_matches(lambda: SyntheticSource([IMAGE, LABEL], 4, seed=9))


def test_synthetic_learnable_labels_follow_a_fixed_teacher():
    src = SyntheticSource([IMAGE, LABEL], 64, seed=0, task="learnable")
    b = src.next_batch()
    w = src.teacher[2]
    # Recompute the labels another way: per example, the class with the largest score.
    for x, y in zip(b["image"], b["label"]):
        scores = [float(np.dot(x.ravel().astype(np.float64), w[:, c])) for c in range(5)]
        assert y == max(range(5), key=lambda c: scores[c])
    with pytest.raises(fc.SpecError, match="one float input"):
        SyntheticSource([IMAGE], 4, task="learnable")


def test_arrays_npz_batches_epochs_and_resume(tmp_path):
    x = np.arange(10 * 4 * 4 * 3, dtype=np.float32).reshape(10, 4, 4, 3)
    y = np.arange(10, dtype=np.int64) % 5
    np.savez(tmp_path / "d.npz", x=x, label=y)
    make = lambda: ArraySource([IMAGE, LABEL], 3, tmp_path / "d.npz", features={"image": "x"}, seed=4)
    src = make()
    assert src.batches_per_epoch == 3  # 10 // 3, the partial batch is dropped
    seen = []
    for _ in range(3):
        b = src.next_batch()
        assert b["image"].shape == (3, 4, 4, 3) and b["label"].dtype == np.int32
        # Each row's label still belongs to its image.
        idx = (b["image"][:, 0, 0, 0] / (4 * 4 * 3)).astype(int)
        np.testing.assert_array_equal(b["label"], y[idx])
        seen.extend(idx.tolist())
    assert len(set(seen)) == 9  # an epoch visits distinct examples
    b = src.next_batch()
    assert src.epoch == 1
    _resume_matches(make, steps=8, split=4)


def test_arrays_npy_and_errors(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((5, 4, 4, 3), np.float32))
    src = ArraySource([IMAGE], 2, tmp_path / "x.npy", shuffle=False)
    assert src.next_batch()["image"].shape == (2, 4, 4, 3)
    with pytest.raises(fc.SpecError, match="holds one array"):
        ArraySource([IMAGE, LABEL], 2, tmp_path / "x.npy")
    np.savez(tmp_path / "bad.npz", image=np.zeros((5, 4, 4, 2), np.float32), label=np.zeros(5, np.int32))
    with pytest.raises(fc.SpecError, match=r"shape \[4, 4, 2\], the model expects \[4, 4, 3\]"):
        ArraySource([IMAGE, LABEL], 2, tmp_path / "bad.npz")
    np.savez(tmp_path / "len.npz", image=np.zeros((5, 4, 4, 3), np.float32), label=np.zeros(4, np.int32))
    with pytest.raises(fc.SpecError, match="differ in length"):
        ArraySource([IMAGE, LABEL], 2, tmp_path / "len.npz")
    with pytest.raises(fc.SpecError, match="no array 'label'"):
        ArraySource([IMAGE, LABEL], 2, _npz_without_label(tmp_path))


def _npz_without_label(tmp_path):
    np.savez(tmp_path / "nolabel.npz", image=np.zeros((5, 4, 4, 3), np.float32))
    return tmp_path / "nolabel.npz"


CORPUS = "the cat sat on the mat\nthe dog sat\na cat ran on the mat\n"


def test_vocabulary_by_frequency_then_alphabet():
    words = CORPUS.replace("\n", " <eos> ").split()
    v = Vocabulary.build(words, size=5)
    # 'the' x4, '<eos>' x3, then cat/mat/on/sat x2 (alphabetical: cat first), rest -> <unk>
    assert v.words[:4] == ["the", "<eos>", "cat", "mat"] and "<unk>" in v.words and len(v) == 5
    assert v.decode(v.encode(["the", "zebra"])) == ["the", "<unk>"]


def test_text_ptb_batching_and_resume(tmp_path):
    (tmp_path / "c.txt").write_text(CORPUS * 3)
    toks, tgts = InputSpec("tokens", (3,), "int32", 100), InputSpec("targets", (3,), "int32", 100)
    src = TextSource([toks, tgts], batch_size=2, path=tmp_path / "c.txt", unroll=3)
    words = (CORPUS * 3).replace("\n", " <eos> ").split()
    ids = src.vocab.encode(words)
    rows = ids[: 2 * (len(ids) // 2)].reshape(2, -1)
    b0, b1 = src.next_batch(), src.next_batch()
    np.testing.assert_array_equal(b0["tokens"], rows[:, 0:3])
    np.testing.assert_array_equal(b0["targets"], rows[:, 1:4])
    np.testing.assert_array_equal(b1["tokens"], rows[:, 3:6])
    assert b0["tokens"].dtype == np.int32
    # Targets are the next word of the same row (the first word of the next batch continues it).
    np.testing.assert_array_equal(b0["targets"][:, -1], b1["tokens"][:, 0])
    _resume_matches(lambda: TextSource([toks, tgts], 2, tmp_path / "c.txt", unroll=3), steps=12, split=5)


def test_text_too_short_and_make_source(tmp_path):
    (tmp_path / "s.txt").write_text("a b\n")
    toks, tgts = InputSpec("tokens", (5,), "int32", 10), InputSpec("targets", (5,), "int32", 10)
    with pytest.raises(fc.SpecError, match="too few"):
        TextSource([toks, tgts], 2, tmp_path / "s.txt", unroll=5)
    (tmp_path / "c.txt").write_text(CORPUS * 5)
    src = make_source({"source": "text", "path": "c.txt", "vocab_size": 6}, [toks, tgts], 2, base_dir=tmp_path)
    assert isinstance(src, TextSource) and len(src.vocab) == 6 and src.next_batch()["tokens"].shape == (2, 5)
    assert isinstance(make_source({}, [IMAGE], 2), SyntheticSource)
    with pytest.raises(fc.SpecError, match="cannot restore"):
        src.restore(make_source({}, [IMAGE], 2).state())
