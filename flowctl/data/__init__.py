"""Datasets and input pipelines: synthetic (the default), arrays from .npy/.npz files, a table
(CSV or Parquet: `tables.py`), a text corpus batched for language models, and a folder of images
(one sub-folder per class: `images.py`). Each source has a resumable cursor (`state()`/`restore()`).

`make_source` takes the spec's `data:` section as a plain mapping, so this package needs nothing
from the spec package (ARCHITECTURE: data imports numpy and the engine only)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from flowctl.data.arrays import ArraySource
from flowctl.data.base import DataSource, InputSpec
from flowctl.data.bpe import ByteBPE, read_text
from flowctl.data.images import ImageSource
from flowctl.data.parallel import ParallelTextSource
from flowctl.data.synthetic import SyntheticSource
from flowctl.data.tables import TableEncoding, TableSource, learn_table
from flowctl.data.text import SentenceSource, TextSource, Vocabulary, read_words, unigram_perplexity
from flowctl.engine.errors import SpecError


SPLITS = ("train", "validation")
# The held-out stream of a synthetic source: another draw of the same task (the same teacher).
VALIDATION_STREAM = 1_000_003


def make_source(config: Mapping[str, Any], inputs: Sequence[InputSpec], batch_size: int,
                base_dir: str | Path = ".", split: str = "train", tokenizer: ByteBPE | None = None,
                table: TableEncoding | None = None, on_warning: Callable[[str], None] | None = None) -> DataSource:
    """A source from a `data:` mapping (`source: synthetic | arrays | table | text | parallel_text |
    images`); relative paths are taken from `base_dir` (the spec file's directory). `split`: "train",
    or "validation" for the held-out data (`validation:` file, the last `validation_fraction` of the
    file, or for synthetic data a stream of its own), read in order without shuffling. `tokenizer`:
    for a text source with `tokenizer: bpe`, the one to encode with (a run's stored one); by default
    it is learned here from the training corpus (`learn_tokenizer`). `table`: likewise a table
    source's encoding (a run's stored one; by default learned here from the training split,
    `learn_table`). `on_warning`: where an images source with `on_corrupt: skip` reports each file
    it leaves out (default: Python's `warnings`)."""
    cfg = dict(config)
    kind = cfg.get("source", "synthetic")
    inputs = list(inputs)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    held = split == "validation"
    if kind == "synthetic":
        src = SyntheticSource(inputs, batch_size, seed=cfg.get("seed", 0), task=cfg.get("task", "random"))
        if held:
            src.rng = np.random.default_rng([int(cfg.get("seed", 0)), VALIDATION_STREAM])
        return src
    path, part = _split_of(cfg, base_dir, held)
    if kind == "arrays":
        return ArraySource(inputs, batch_size, path, features=cfg.get("features"),
                           shuffle=cfg.get("shuffle", True) and not held, seed=cfg.get("seed", 0), part=part)
    if kind == "table":
        return TableSource(inputs, batch_size, path, table or learn_table(cfg, base_dir),
                           fmt=cfg.get("format"), shuffle=cfg.get("shuffle", True) and not held,
                           seed=cfg.get("seed", 0), part=part)
    if kind == "text":
        ints = {i.name: i for i in inputs if i.is_int}
        name = cfg.get("input") or next(iter(ints), None)
        if name is None or name not in ints or len(ints[name].shape) != 1:
            raise SpecError("a text source needs an integer model input of shape [unroll]")
        if cfg.get("lengths"):  # sentences of their own lengths
            return _sentences(cfg, inputs, batch_size, Path(base_dir), ints, name, held)
        if cfg.get("tokenizer", "words") == "bpe":
            return TextSource(inputs, batch_size, path, unroll=ints[name].shape[0], input_name=cfg.get("input"),
                              target_name=cfg.get("target"), part=part,
                              tokenizer=tokenizer or learn_tokenizer(cfg, base_dir))
        vocab = None
        if held and cfg.get("validation"):  # encoded with the training corpus's words
            vocab = Vocabulary.build(read_words(Path(base_dir) / cfg["path"]), cfg.get("vocab_size"))
        return TextSource(inputs, batch_size, path, unroll=ints[name].shape[0], vocab_size=cfg.get("vocab_size"),
                          input_name=cfg.get("input"), target_name=cfg.get("target"), part=part, vocab=vocab)
    if kind == "images":
        return ImageSource(inputs, batch_size, path, Path(base_dir) / cfg["path"], image_name=cfg.get("input"),
                           label_name=cfg.get("label"), resize=cfg.get("resize"), crop=cfg.get("crop", "center"),
                           flip=cfg.get("flip", False), mean=cfg.get("mean") or (0.0,), std=cfg.get("std") or (1.0,),
                           on_corrupt=cfg.get("on_corrupt", "error"), workers=cfg.get("workers"),
                           shuffle=cfg.get("shuffle", True), seed=cfg.get("seed", 0), part=part, training=not held,
                           on_warning=on_warning)
    if kind == "parallel_text":
        base = Path(base_dir)
        target = base / (cfg["validation_target"] if held and cfg.get("validation") else cfg["target_path"])
        return ParallelTextSource(inputs, batch_size, path, target, cfg.get("feeds") or {},
                                  vocab_paths=(base / cfg["path"], base / cfg["target_path"]),
                                  vocab_sizes=(cfg.get("vocab_size"), cfg.get("target_vocab_size")), part=part,
                                  bucket=cfg.get("bucket", False), shuffle=not held, seed=cfg.get("seed", 0))
    raise SpecError(f"unknown data source {kind!r}: synthetic, arrays, table, text, parallel_text or images")


def learn_tokenizer(config: Mapping[str, Any], base_dir: str | Path = ".") -> ByteBPE:
    """The byte-level BPE of a `tokenizer: bpe` text source, learned on its training corpus (all
    of `path`, as the word vocabulary is built from all of it) with `vocab_size` tokens."""
    if not config.get("vocab_size"):
        raise SpecError("data.tokenizer bpe needs data.vocab_size (the BPE vocabulary, at least 256)")
    return ByteBPE.train(read_text(Path(base_dir) / config["path"]), int(config["vocab_size"]))


def has_validation(config: Mapping[str, Any]) -> bool:
    return config.get("source", "synthetic") == "synthetic" or bool(
        config.get("validation") or config.get("validation_fraction"))


def _split_of(cfg: Mapping[str, Any], base_dir: str | Path, held: bool) -> tuple[Path, tuple[float, float]]:
    """The file a split reads and the part of it: training reads all of `path` but a held-out
    fraction; validation its own file or that fraction."""
    fraction = cfg.get("validation_fraction") or 0.0
    if not held:
        return Path(base_dir) / cfg["path"], (0.0, 1.0 - fraction)
    if cfg.get("validation"):
        return Path(base_dir) / cfg["validation"], (0.0, 1.0)
    if not fraction:
        raise SpecError("no validation data: set data.validation (a file) or data.validation_fraction")
    return Path(base_dir) / cfg["path"], (1.0 - fraction, 1.0)


def _sentences(cfg: dict[str, Any], inputs: list[InputSpec], batch_size: int, base_dir: Path,
               ints: dict[str, InputSpec], name: str, held: bool) -> SentenceSource:
    lengths = cfg["lengths"]
    if lengths not in ints or ints[lengths].shape != ():
        raise SpecError(f"data.lengths names '{lengths}', which must be a scalar integer model input "
                        f"(shape [], dtype int32); the integer inputs are {', '.join(ints) or 'none'}")
    rest = [n for n in ints if n not in (name, lengths)]
    target = cfg.get("target") or (rest[0] if rest else None)
    if target is None or target not in ints:
        raise SpecError("a text source with lengths feeds three integer inputs: tokens, next tokens, lengths")
    path, part = _split_of(cfg, base_dir, held)
    return SentenceSource(inputs, batch_size, path, unroll=ints[name].shape[0],
                          input_name=name, target_name=target, lengths_name=lengths,
                          vocab_size=cfg.get("vocab_size"), bucket=cfg.get("bucket", False),
                          seed=cfg.get("seed", 0), part=part, vocab_path=base_dir / cfg["path"],
                          shuffle=not held)


__all__ = ["ArraySource", "ByteBPE", "DataSource", "ImageSource", "InputSpec", "ParallelTextSource", "SPLITS",
           "SentenceSource", "SyntheticSource", "TableEncoding", "TableSource", "TextSource", "Vocabulary",
           "has_validation", "learn_table", "learn_tokenizer", "make_source", "unigram_perplexity"]
