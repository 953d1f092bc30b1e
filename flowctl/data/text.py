"""A plain-text corpus as language-model batches, the way Zaremba et al.'s PTB reader does it.

Words are split on whitespace with an `<eos>` at each line end; the vocabulary keeps the most
frequent words (ties in alphabetical order, so it is the same on every machine), the rest become
`<unk>`. The id stream is cut into `batch` parallel rows; batch i reads columns
[i*unroll, (i+1)*unroll) as input and the same shifted by one as target, so an LSTM's state can
carry from one batch to the next along each row.

With a `ByteBPE` tokenizer (flowctl.data.bpe) instead of the word vocabulary, the same stream is
the corpus's byte-level BPE ids, cut into rows the same way: a decoder-only LM's input and its
targets shifted by one.
"""
from __future__ import annotations

import collections
from pathlib import Path

import numpy as np

from flowctl.data.base import DataSource, InputSpec
from flowctl.data.bpe import ByteBPE, read_text
from flowctl.engine.errors import SpecError

EOS = "<eos>"
UNK = "<unk>"


def read_lines(path: Path) -> list[list[str]]:
    """The words of each line of a UTF-8 text file; one clear error where it is missing or not text."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"text corpus {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"text corpus {path} is not UTF-8 text: {e}") from None
    return [line.split() for line in text.splitlines()]


def read_words(path: Path) -> list[str]:
    words: list[str] = []
    for line in read_lines(path):
        words.extend(line)
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
                 vocab: Vocabulary | None = None, tokenizer: ByteBPE | None = None) -> None:
        """`part`: the fraction of the corpus this source reads, (start, stop) in token order.
        `vocab`: the vocabulary to encode with (a validation file uses the training corpus's);
        by default it is built from the whole of `path`, so both parts of a split share it.
        `tokenizer`: encode with this byte-level BPE instead of words (`vocab` is then None)."""
        super().__init__(inputs, batch_size, seed)
        ints = [i.name for i in inputs if i.is_int]
        self.input_name = input_name or (ints[0] if ints else "")
        self.target_name = target_name or (ints[1] if len(ints) > 1 else "")
        if not self.input_name or not self.target_name:
            raise SpecError(f"a text source feeds two integer inputs (tokens, next tokens); the model has "
                            f"{len(ints)}: {', '.join(ints) or 'none'}")
        self.unroll = int(unroll)
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.vocab: Vocabulary | None = None
        if tokenizer is not None:
            ids = tokenizer.encode(read_text(self.path))
            size = len(tokenizer)
        else:
            words = read_words(self.path)
            self.vocab = vocab or Vocabulary.build(words, vocab_size)
            ids = self.vocab.encode(words)
            size = len(self.vocab)
        classes = {i.name: i.classes for i in inputs}
        room = min((c for c in (classes.get(self.input_name), classes.get(self.target_name)) if c), default=None)
        if tokenizer is not None and room is not None and size > room:
            raise SpecError(f"the tokenizer has {size} tokens but the model's inputs '{self.input_name}' and "
                            f"'{self.target_name}' take {room} classes: make them at least {size}, or "
                            f"data.vocab_size at most {room}")
        self.ids = ids[round(part[0] * len(ids)):round(part[1] * len(ids))]  # the stream this part reads
        ids = self.ids
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


def unigram_cross_entropy(train: np.ndarray, held: np.ndarray, classes: int) -> float:
    """The cross-entropy (nats per token) on the ids `held` of the unigram model of `train`: each
    of `classes` ids with its training frequency, add-one smoothed (an id training never saw
    keeps a finite cost). A language model that beats it has learned more than token counts;
    exp of it is the unigram perplexity."""
    counts = np.bincount(np.asarray(train, np.int64), minlength=classes)[:classes].astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(held, np.int64)].mean())


def unigram_perplexity(train: TextSource, held: TextSource) -> float:
    """The unigram perplexity of `held`'s stream (a validation source) under `train`'s counts, over
    the training source's vocabulary or tokenizer: the figure a trained LM's `val/perplexity` (per
    token, on the same stream) should fall below."""
    classes = len(train.tokenizer) if train.tokenizer is not None else len(train.vocab or ())
    return float(np.exp(unigram_cross_entropy(train.ids, held.ids, classes)))


class SentenceSource(DataSource):
    """One line of the corpus per example (variable-length data for a dynamic RNN, §4.4): its
    words as input, the same shifted by one (ending in `<eos>`) as target, both cut or padded with
    id 0 to `unroll`, and its length (at most `unroll`) fed to the `lengths` input. Each epoch
    visits the lines in an order drawn from (seed, epoch); with `bucket`, batches are runs of lines
    of similar length (sorted by length, then the batches shuffled), so a dynamic loop runs about
    as many steps as its longest line needs."""

    kind = "text_sentences"

    def __init__(self, inputs: list[InputSpec], batch_size: int, path: str | Path, unroll: int,
                 input_name: str, target_name: str, lengths_name: str, vocab_size: int | None = None,
                 bucket: bool = False, seed: int = 0, part: tuple[float, float] = (0.0, 1.0),
                 vocab_path: str | Path | None = None, shuffle: bool = True) -> None:
        """`part`: the fraction of the file's non-empty lines this source reads (start, stop);
        `vocab_path`: the corpus the vocabulary is built from (default `path`: held-out data is
        encoded with the training corpus's words); `shuffle=False` reads the lines in file order
        (held-out data), bucketing or not."""
        super().__init__(inputs, batch_size, seed)
        self.path = Path(path)
        self.unroll = int(unroll)
        self.names = (input_name, target_name, lengths_name)
        self.bucket = bool(bucket)
        self.shuffle = bool(shuffle)
        self.vocab = Vocabulary.build(read_words(Path(vocab_path or self.path)), vocab_size)
        lines = read_lines(self.path)
        lines = [words for words in lines if words]
        lines = lines[round(part[0] * len(lines)):round(part[1] * len(lines))]
        self.batches_per_epoch = len(lines) // batch_size
        if self.batches_per_epoch < 1:
            raise SpecError(f"{self.path}: {len(lines)} non-empty lines (of the part read) are too few for "
                            f"one batch of {batch_size}")
        n = self.unroll
        self.tokens = np.zeros((len(lines), n), np.int64)
        self.targets = np.zeros((len(lines), n), np.int64)
        self.lengths = np.zeros(len(lines), np.int64)
        for i, words in enumerate(lines):
            ids = self.vocab.encode(words + [EOS])
            k = min(len(words), n)
            self.tokens[i, :k] = ids[:k]
            self.targets[i, :k] = ids[1:k + 1]
            self.lengths[i] = k
        self.dtypes = {i.name: i.dtype for i in inputs}

    def _order(self, epoch: int) -> np.ndarray:
        """Line indices in this epoch's order; a pure function of (seed, epoch), so resuming
        mid-epoch sees the same order."""
        rng = np.random.default_rng([self.seed, epoch])
        b = self.batch_size
        if not self.shuffle:
            return np.arange(self.batches_per_epoch * b)
        if not self.bucket:
            return rng.permutation(len(self.lengths))[:self.batches_per_epoch * b]
        by_length = np.argsort(self.lengths, kind="stable")[:self.batches_per_epoch * b]
        batches = by_length.reshape(self.batches_per_epoch, b)
        return batches[rng.permutation(self.batches_per_epoch)].reshape(-1)

    def _next(self) -> dict[str, np.ndarray]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        rows = self._order(self.epoch)[self.position * self.batch_size:(self.position + 1) * self.batch_size]
        x, y, lens = self.names
        return {x: self.tokens[rows].astype(self.dtypes.get(x, "int32")),
                y: self.targets[rows].astype(self.dtypes.get(y, "int32")),
                lens: self.lengths[rows].astype(self.dtypes.get(lens, "int32"))}
