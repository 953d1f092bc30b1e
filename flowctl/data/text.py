"""A plain-text corpus as language-model batches, the way Zaremba et al.'s PTB reader does it.

Words are split on whitespace with an `<eos>` at each line end; the vocabulary keeps the most
frequent words (ties in alphabetical order, so it is the same on every machine), the rest become
`<unk>`. The id stream is cut into `batch` parallel rows; batch i reads columns
[i*unroll, (i+1)*unroll) as input and the same shifted by one as target, so an LSTM's state can
carry from one batch to the next along each row.
"""
from __future__ import annotations

import collections
from pathlib import Path

import numpy as np

from flowctl.data.base import DataSource, InputSpec
from flowctl.engine.errors import SpecError

EOS = "<eos>"
UNK = "<unk>"


def read_words(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"text corpus {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"text corpus {path} is not UTF-8 text: {e}") from None
    words: list[str] = []
    for line in text.splitlines():
        words.extend(line.split())
        words.append(EOS)
    return words


class Vocabulary:
    def __init__(self, words: list[str]) -> None:
        self.words = list(words)
        self.ids = {w: i for i, w in enumerate(self.words)}
        if UNK not in self.ids:
            raise ValueError("a vocabulary must contain <unk>")

    @classmethod
    def build(cls, words: list[str], size: int | None = None) -> "Vocabulary":
        counts = collections.Counter(words)
        counts.pop(UNK, None)
        ranked = sorted(counts, key=lambda w: (-counts[w], w))
        keep = ranked if size is None else ranked[:size - 1]  # one slot is <unk>
        return cls(sorted(keep + [UNK], key=lambda w: (-counts.get(w, 0), w)))

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, words: list[str]) -> np.ndarray:
        unk = self.ids[UNK]
        return np.array([self.ids.get(w, unk) for w in words], dtype=np.int64)

    def decode(self, ids: np.ndarray) -> list[str]:
        return [self.words[int(i)] for i in ids]


class TextSource(DataSource):
    kind = "text"

    def __init__(self, inputs: list[InputSpec], batch_size: int, path: str | Path, unroll: int,
                 vocab_size: int | None = None, input_name: str | None = None,
                 target_name: str | None = None, seed: int = 0, part: tuple[float, float] = (0.0, 1.0),
                 vocab: Vocabulary | None = None) -> None:
        """`part`: the fraction of the corpus this source reads, (start, stop) in token order.
        `vocab`: the vocabulary to encode with (a validation file uses the training corpus's);
        by default it is built from the whole of `path`, so both parts of a split share it."""
        super().__init__(inputs, batch_size, seed)
        ints = [i.name for i in inputs if i.is_int]
        self.input_name = input_name or (ints[0] if ints else "")
        self.target_name = target_name or (ints[1] if len(ints) > 1 else "")
        if not self.input_name or not self.target_name:
            raise SpecError(f"a text source feeds two integer inputs (tokens, next tokens); the model has "
                            f"{len(ints)}: {', '.join(ints) or 'none'}")
        self.unroll = int(unroll)
        self.path = Path(path)
        words = read_words(self.path)
        self.vocab = vocab or Vocabulary.build(words, vocab_size)
        ids = self.vocab.encode(words)
        ids = ids[round(part[0] * len(ids)):round(part[1] * len(ids))]
        self.batch_len = len(ids) // batch_size
        self.batches_per_epoch = (self.batch_len - 1) // self.unroll
        if self.batches_per_epoch < 1:
            raise SpecError(f"{self.path}: {len(ids)} tokens are too few for one batch of {batch_size} rows × "
                            f"{self.unroll + 1} tokens (need at least {batch_size * (self.unroll + 1)})")
        self.data = ids[:batch_size * self.batch_len].reshape(batch_size, self.batch_len)
        dtypes = {i.name: i.dtype for i in inputs}
        self.dtypes = (dtypes.get(self.input_name, "int32"), dtypes.get(self.target_name, "int32"))

    def _next(self) -> dict[str, np.ndarray]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        i = self.position * self.unroll
        x = self.data[:, i:i + self.unroll].astype(self.dtypes[0])
        y = self.data[:, i + 1:i + self.unroll + 1].astype(self.dtypes[1])
        return {self.input_name: x, self.target_name: y}

    @property
    def epoch_start(self) -> bool:
        """True when the next batch begins an epoch: an LSTM's carried state should be reset."""
        return self.position % self.batches_per_epoch == 0
