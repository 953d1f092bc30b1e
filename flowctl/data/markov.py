"""A text corpus with a known floor: words drawn from a first-order Markov chain, so a language
model's perplexity has a bound to approach (the chain's entropy rate) and a baseline to beat (the
unigram model).

The words are `k` distinct strings of lowercase letters, written one line of text with a space
before each word (" ab cd ab ...") and a single line end. A byte-level BPE (GPT-2's ByteLevel
pre-tokenizer splits text into " word" pieces and never merges across them) with room for every
word's merges, `bpe_vocab_size()` tokens, learns each " word" as one token: then tokens == words,
plus the final line end, and per-token and per-word figures are the same numbers. (With a smaller
vocabulary a word spans several tokens; the bound per token is then H · words / tokens, since the
tokenization is a bijection of the text and the information in it does not change.)

    corpus = MarkovCorpus.random(words=8, seed=0)
    words = corpus.write(path, 20_000, seed=1)
    corpus.entropy_rate()                  # H, nats per word: the best any model can do
    corpus.unigram_cross_entropy(words, 0.1)  # the unigram model's, on the last tenth

Perplexity is exp of the nats: `exp(H)` is the bound, the unigram's is the baseline.
"""
from __future__ import annotations

import math
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flowctl.data.bpe import ALPHABET
from flowctl.data.text import unigram_cross_entropy


@dataclass(frozen=True)
class MarkovCorpus:
    words: tuple[str, ...]
    transitions: np.ndarray  # [k, k]: row i is P(next word | word i)

    @classmethod
    def random(cls, words: int = 8, seed: int = 0, concentration: float = 0.3, letters: int = 2) -> "MarkovCorpus":
        """`words` strings of `letters` letters and transition rows drawn from a Dirichlet of
        `concentration` (below 1: each word has a few likely successors, so the entropy rate is
        well below the unigram's entropy)."""
        if words > len(string.ascii_lowercase) ** letters:
            raise ValueError(f"{words} words do not fit in {letters} letters")
        rng = np.random.default_rng(seed)
        names: list[str] = []
        for i in range(words):
            name, n = "", i
            for _ in range(letters):
                name, n = string.ascii_lowercase[n % 26] + name, n // 26
            names.append(name)
        p = rng.dirichlet(np.full(words, concentration), size=words)
        return cls(tuple(names), p)

    def stationary(self) -> np.ndarray:
        """π with π P = π: the long-run frequency of each word (the unigram model's ideal)."""
        values, vectors = np.linalg.eig(self.transitions.T)
        v = np.real(vectors[:, np.argmin(np.abs(values - 1.0))])
        return v / v.sum()

    def entropy_rate(self) -> float:
        """H = -Σ_i π_i Σ_j P_ij ln P_ij, nats per word: the cross-entropy of the chain itself, the
        floor of any model's on a long stream."""
        p = self.transitions
        logp = np.log(np.where(p > 0, p, 1.0))
        return float(-(self.stationary() * (p * logp).sum(axis=1)).sum())

    def sample(self, n: int, seed: int = 0) -> np.ndarray:
        """`n` word ids, the first drawn from π, the rest from the chain."""
        rng = np.random.default_rng(seed)
        cum = np.cumsum(self.transitions, axis=1)
        out = np.empty(n, np.int64)
        out[0] = rng.choice(len(self.words), p=self.stationary())
        u = rng.random(n)
        for t in range(1, n):
            out[t] = min(int(np.searchsorted(cum[out[t - 1]], u[t], side="right")), len(self.words) - 1)
        return out

    def text(self, ids: np.ndarray) -> str:
        return "".join(" " + self.words[int(i)] for i in ids) + "\n"

    def write(self, path: str | Path, n: int, seed: int = 0) -> np.ndarray:
        """Write `n` words to `path` (one line); returns their ids."""
        ids = self.sample(n, seed)
        Path(path).write_text(self.text(ids), encoding="utf-8")
        return ids

    def bpe_vocab_size(self) -> int:
        """A BPE vocabulary with room for every " word" to become one token: the 256 bytes and at
        most one merge per letter of each word (its space included)."""
        return ALPHABET + sum(len(w) for w in self.words)

    def unigram_cross_entropy(self, ids: np.ndarray, validation_fraction: float) -> float:
        """The unigram model of the first part of `ids` (add-one smoothed counts) on the last
        `validation_fraction` (nats per word): the split a text source's validation_fraction makes."""
        cut = round((1.0 - validation_fraction) * len(ids))
        return unigram_cross_entropy(ids[:cut], ids[cut:], len(self.words))

    def perplexities(self, ids: np.ndarray, validation_fraction: float) -> dict[str, float]:
        """The bound exp(H) and the unigram model's perplexity on the held-out words."""
        return {"bound": math.exp(self.entropy_rate()),
                "unigram": math.exp(self.unigram_cross_entropy(ids, validation_fraction))}


__all__ = ["MarkovCorpus"]
