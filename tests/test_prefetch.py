"""The prefetching input pipeline (whitepaper §4.5): the same batches as the bare source, a cursor
that describes the trainer's next batch (not the background thread's), exact continuation after
restore in every combination of prefetched and plain, errors delivered at their batch."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flowctl.data import ArraySource, InputSpec, SyntheticSource, TextSource
from flowctl.data.base import DataSource
from flowctl.bench.prefetch import SlowSource, prefetch_benchmark
from flowctl.data.prefetch import Prefetcher

INPUTS = [InputSpec("x", (3,)), InputSpec("y", (), "int32", classes=4)]


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert a[k].dtype == b[k].dtype


@pytest.fixture
def arrays(tmp_path: Path) -> Path:
    path = tmp_path / "d.npz"
    rng = np.random.default_rng(3)
    np.savez(path, x=rng.standard_normal((10, 3)).astype(np.float32), y=rng.integers(0, 4, 10).astype(np.int32))
    return path


def _sources(kind: str, arrays: Path) -> tuple[DataSource, DataSource]:
    if kind == "synthetic":
        return (SyntheticSource(INPUTS, 4, seed=5, task="learnable"),
                SyntheticSource(INPUTS, 4, seed=5, task="learnable"))
    return ArraySource(INPUTS, 3, arrays, seed=2), ArraySource(INPUTS, 3, arrays, seed=2)  # 3 batches/epoch


@pytest.mark.parametrize("kind", ["synthetic", "arrays"])
def test_same_batches_and_cursor_with_and_without_prefetch(kind, arrays):
    plain, inner = _sources(kind, arrays)
    with Prefetcher(inner, depth=3) as pf:
        assert pf.state() == plain.state()
        for _ in range(10):  # crosses epochs for the array source
            _same(pf.next_batch(), plain.next_batch())
            assert (pf.position, pf.epoch) == (plain.position, plain.epoch)
            assert pf.state() == plain.state()
    if kind == "arrays":
        assert plain.epoch >= 3


def _wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.02)  # and a little longer: a thread that does not stop would go on reading


def test_state_is_the_trainers_cursor_not_the_threads():
    inner = SyntheticSource(INPUTS, 4, seed=1)
    with Prefetcher(inner, depth=3) as pf:
        pf.next_batch()
        _wait_for(lambda: inner.position >= 4)  # the thread fills the buffer
        assert inner.position == 4  # 1 taken + 3 buffered, and no further: the buffer is bounded
        assert pf.position == 1 and pf.state()["position"] == 1
        ref = SyntheticSource(INPUTS, 4, seed=1)
        ref.next_batch()
        assert pf.state() == ref.state()


@pytest.mark.parametrize("kind", ["synthetic", "arrays"])
def test_restore_mid_stream_continues_exactly(kind, arrays):
    ref, inner = _sources(kind, arrays)
    expected = [ref.next_batch() for _ in range(12)]
    with Prefetcher(inner, depth=2) as pf:
        for _ in range(5):
            pf.next_batch()
        saved = pf.state()
        for _ in range(3):  # read on and let the thread fill the buffer ahead, then go back
            pf.next_batch()
        _wait_for(lambda: len(pf._buf) == 2)
        pf.restore(saved)
        assert (pf.position, pf.epoch) == (saved["position"], saved["epoch"])
        for j in range(5, 12):
            _same(pf.next_batch(), expected[j])
    # A checkpoint from a prefetched run restores into a plain source, and the other way round.
    plain, fresh = _sources(kind, arrays)
    plain.restore(saved)
    for j in range(5, 9):
        _same(plain.next_batch(), expected[j])
    with Prefetcher(fresh) as pf2:
        pf2.restore(plain.state())
        for j in range(9, 12):
            _same(pf2.next_batch(), expected[j])


def test_restore_refuses_another_kind(arrays):
    with Prefetcher(SyntheticSource(INPUTS, 4)) as pf:
        with pytest.raises(Exception, match="cannot restore"):
            pf.restore(ArraySource(INPUTS, 3, arrays).state())


def test_text_source_attributes_come_through(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(" ".join(f"w{(i * 7 + j) % 11}" for j in range(9)) for i in range(12)))
    ins = [InputSpec("tokens", (4,), "int32", classes=20), InputSpec("next", (4,), "int32", classes=20)]
    plain = TextSource(ins, 2, corpus, unroll=4)
    with Prefetcher(TextSource(ins, 2, corpus, unroll=4), depth=2) as pf:
        assert len(pf.vocab) == len(plain.vocab) and pf.batches_per_epoch == plain.batches_per_epoch
        for _ in range(2 * plain.batches_per_epoch + 1):
            assert pf.epoch_start == plain.epoch_start  # from the cursor, not the thread's position
            _same(pf.next_batch(), plain.next_batch())


class FailingSource(SyntheticSource):
    def _next(self) -> dict[str, Any]:
        if self.position == 3:
            raise OSError("disk gone at batch 3")
        return super()._next()


def test_a_source_error_arrives_after_the_batches_before_it():
    with Prefetcher(FailingSource(INPUTS, 2), depth=4) as pf:
        for _ in range(3):
            pf.next_batch()
        with pytest.raises(OSError, match="disk gone at batch 3"):
            pf.next_batch()
        assert pf.position == 3


def test_slow_source_yields_the_same_batches():
    with Prefetcher(SlowSource(INPUTS, 2, delay=0.002, seed=4)) as pf:
        plain = SyntheticSource(INPUTS, 2, seed=4)
        for _ in range(4):
            _same(pf.next_batch(), plain.next_batch())


def test_depth_must_be_positive():
    with pytest.raises(Exception, match="depth must be >= 1"):
        Prefetcher(SyntheticSource(INPUTS, 2), depth=0)


def test_prefetch_benchmark_runs_and_reports():
    r = prefetch_benchmark(steps=4, input_ms=2.0, compute_ms=2.0, batch=8, features=16, rounds=2)
    assert {"steps", "depth", "input_ms", "compute_ms", "steps_per_s_plain", "steps_per_s_prefetch",
            "speedup", "ideal_speedup"} <= set(r)
    assert r["steps"] == 4 and r["steps_per_s_plain"] > 0 and r["steps_per_s_prefetch"] > 0


def test_close_then_read_on_continues_from_the_cursor():
    ref = SyntheticSource(INPUTS, 4, seed=9)
    expected = [ref.next_batch() for _ in range(5)]
    pf = Prefetcher(SyntheticSource(INPUTS, 4, seed=9), depth=2)
    for j in range(2):
        _same(pf.next_batch(), expected[j])
    _wait_for(lambda: len(pf._buf) == 2)
    pf.close()  # the read-ahead batches are dropped with the thread ...
    for j in range(2, 5):  # ... and read again from the cursor
        _same(pf.next_batch(), expected[j])
    pf.close()
