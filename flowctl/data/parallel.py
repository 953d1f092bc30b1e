"""Sentence pairs for translation (the NMT setting of Sutskever et al. 2014 and Mirhoseini et al.
2017): two files aligned line by line, one example per pair, each side of its own length.

Per example: the source sentence's ids cut or padded with 0 to the source input's length, and that
length; the target twice, shifted: `target_in` is `<eos>` then the words (the decoder's input,
`<eos>` serving as the start symbol, as it starts every sentence of the text readers too), and
`target_out` the words then `<eos>` (what the decoder predicts), both cut or padded to the target
input's length, with the target length (words + 1, at most that). Each side has its own
vocabulary, built from the training file of that side. A loss and an attention given the lengths
(`softmax_cross_entropy: [logits, target_out, target_lengths]`, `attention: [decoder, encoder,
source_lengths]`) never see the padding.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from flowctl.data.base import DataSource, InputSpec
from flowctl.data.text import EOS, Vocabulary, read_lines, read_words
from flowctl.engine.errors import SpecError

FEEDS = ("source", "source_lengths", "target_in", "target_out", "target_lengths")


def vocabularies(source_path: Path, target_path: Path, sizes: tuple[int | None, int | None] = (None, None)
                 ) -> tuple[Vocabulary, Vocabulary]:
    """Each side's vocabulary, from that side's training file."""
    return (Vocabulary.build(read_words(source_path), sizes[0]), Vocabulary.build(read_words(target_path), sizes[1]))


class ParallelTextSource(DataSource):
    kind = "parallel_text"

    def __init__(self, inputs: list[InputSpec], batch_size: int, source_path: str | Path, target_path: str | Path,
                 feeds: Mapping[str, str], vocab_paths: tuple[Path, Path] | None = None,
                 vocab_sizes: tuple[int | None, int | None] = (None, None), part: tuple[float, float] = (0.0, 1.0),
                 bucket: bool = False, shuffle: bool = True, seed: int = 0) -> None:
        """`feeds`: which model input gets each of FEEDS. `vocab_paths`: the training files the two
        vocabularies come from (default: these files). `part`: the fraction of the pairs read
        (start, stop). `bucket`: batches of pairs of similar source length. `shuffle=False`: file
        order (held-out data)."""
        super().__init__(inputs, batch_size, seed)
        missing = [k for k in FEEDS if k not in feeds]
        if missing:
            raise SpecError(f"a parallel_text source feeds {', '.join(FEEDS)}; data.feeds lacks {', '.join(missing)}")
        by_name = {i.name: i for i in inputs}
        unknown = [v for v in feeds.values() if v not in by_name]
        if unknown:
            raise SpecError(f"data.feeds names '{unknown[0]}', which is not a model input")
        self.feeds = dict(feeds)
        self.dtypes = {k: by_name[v].dtype for k, v in self.feeds.items()}
        self.paths = (Path(source_path), Path(target_path))
        src_lines, tgt_lines = read_lines(self.paths[0]), read_lines(self.paths[1])
        if len(src_lines) != len(tgt_lines):
            raise SpecError(f"{self.paths[0]} has {len(src_lines)} lines and {self.paths[1]} {len(tgt_lines)}: "
                            f"a parallel corpus pairs them line by line")
        pairs = [(s, t) for s, t in zip(src_lines, tgt_lines) if s and t]
        pairs = pairs[round(part[0] * len(pairs)):round(part[1] * len(pairs))]
        self.batches_per_epoch = len(pairs) // batch_size
        if self.batches_per_epoch < 1:
            raise SpecError(f"{self.paths[0]}: {len(pairs)} sentence pairs (of the part read) are too few for "
                            f"one batch of {batch_size}")
        self.vocabs = vocabularies(*(vocab_paths or self.paths), vocab_sizes)
        ts, tt = (self._steps(by_name[self.feeds[k]], k) for k in ("source", "target_in"))
        if by_name[self.feeds["target_out"]].shape != (tt,):
            raise SpecError(f"target_in and target_out inputs differ in length: {tt} and "
                            f"{by_name[self.feeds['target_out']].shape}")
        n = len(pairs)
        self.arrays = {"source": np.zeros((n, ts), np.int64), "source_lengths": np.zeros(n, np.int64),
                       "target_in": np.zeros((n, tt), np.int64), "target_out": np.zeros((n, tt), np.int64),
                       "target_lengths": np.zeros(n, np.int64)}
        eos = self.vocabs[1].ids[EOS]
        for i, (s, t) in enumerate(pairs):
            ids = self.vocabs[0].encode(s)[:ts]
            self.arrays["source"][i, :len(ids)] = ids
            self.arrays["source_lengths"][i] = len(ids)
            words = self.vocabs[1].encode(t)
            k = min(len(words) + 1, tt)
            self.arrays["target_in"][i, :k] = np.concatenate([[eos], words])[:k]
            self.arrays["target_out"][i, :k] = np.concatenate([words, [eos]])[:k]
            self.arrays["target_lengths"][i] = k
        self.bucket, self.shuffle = bool(bucket), bool(shuffle)

    @staticmethod
    def _steps(spec: InputSpec, key: str) -> int:
        if len(spec.shape) != 1 or not spec.is_int:
            raise SpecError(f"parallel_text: {key} input '{spec.name}' must be integer ids of shape [steps], "
                            f"got {list(spec.shape)} {spec.dtype}")
        return int(spec.shape[0])

    def _order(self, epoch: int) -> np.ndarray:
        """Pair indices in this epoch's order, a pure function of (seed, epoch): a resumed run
        sees the same batches."""
        b, nb = self.batch_size, self.batches_per_epoch
        if not self.shuffle:
            return np.arange(nb * b)
        rng = np.random.default_rng([self.seed, epoch])
        if not self.bucket:
            return rng.permutation(len(self.arrays["source_lengths"]))[:nb * b]
        by_length = np.argsort(self.arrays["source_lengths"], kind="stable")[:nb * b]
        return by_length.reshape(nb, b)[rng.permutation(nb)].reshape(-1)

    def _next(self) -> dict[str, np.ndarray]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        rows = self._order(self.epoch)[self.position * self.batch_size:(self.position + 1) * self.batch_size]
        return {self.feeds[k]: a[rows].astype(self.dtypes[k]) for k, a in self.arrays.items()}
