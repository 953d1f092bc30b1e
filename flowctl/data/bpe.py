"""A byte-level BPE tokenizer for a text corpus (GPT-2's scheme: Radford et al. 2019, §2.2), from
HuggingFace's `tokenizers` package.

The alphabet is all 256 bytes, so any text encodes and decodes back to itself: no `<unk>`. Merges
are learned by `BpeTrainer` on the training corpus, a pure function of its text and the vocabulary
size (no special tokens, no minimum frequency), so two machines learn the same tokenizer. A run
learns it once, at its first start, and keeps it as RUN/tokenizer.json (flowctl.training.inputs):
resume, evaluate and predict read that file and never learn again, so a corpus edited after the
start cannot change what the ids mean.

Each line of a file is encoded on its own with its line end, and the ids are concatenated: a
token never spans lines, and encoding is the same whether a file is read whole or in parts.

`tokenizers` is an optional dependency (`pip install 'flowctl[text]'`), imported only when a spec
asks for `tokenizer: bpe`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from flowctl.engine.errors import SpecError

NEEDS = "byte-level BPE needs the tokenizers package: pip install 'flowctl[text]'"
ALPHABET = 256  # every byte is a token before any merge


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise SpecError(NEEDS) from None
    return tokenizers


def read_text(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"text corpus {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"text corpus {path} is not UTF-8 text: {e}") from None


class ByteBPE:
    """A trained byte-level BPE: text <-> int64 ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def train(cls, text: str, vocab_size: int) -> "ByteBPE":
        """Learn merges on `text` until the vocabulary has `vocab_size` tokens (or no pair is left
        to merge: a small corpus may give fewer)."""
        if vocab_size < ALPHABET:
            raise SpecError(f"a byte-level BPE vocabulary holds the {ALPHABET} bytes and its merges: "
                            f"vocab_size must be at least {ALPHABET}, not {vocab_size}")
        tk = _tokenizers()
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tokenizer = tk.Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=0, special_tokens=[],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
        return cls(tokenizer)

    @classmethod
    def from_json(cls, text: str) -> "ByteBPE":
        """The tokenizer `to_json` wrote; ValueError when `text` is not one (the caller names the file)."""
        tk = _tokenizers()
        try:
            return cls(tk.Tokenizer.from_str(text))
        except Exception as e:  # tokenizers raises a bare Exception for any malformed file
            raise ValueError(str(e)) from None

    def to_json(self) -> str:
        return str(self.tokenizer.to_str())

    def __len__(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    def encode(self, text: str) -> np.ndarray:
        lines = text.splitlines(keepends=True)
        if not lines:
            return np.zeros(0, np.int64)
        encoded = self.tokenizer.encode_batch(lines, add_special_tokens=False)
        return np.concatenate([np.asarray(e.ids, np.int64) for e in encoded])

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))

    def token(self, i: int) -> str:
        """Token `i` as the text it stands for."""
        return self.decode([i])


__all__ = ["ALPHABET", "ByteBPE", "NEEDS", "read_text"]
