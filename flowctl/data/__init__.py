"""Datasets and input pipelines: synthetic (the default), arrays from .npy/.npz files, and a text
corpus batched for language models. Each source has a resumable cursor (`state()`/`restore()`).

`make_source` takes the spec's `data:` section as a plain mapping, so this package needs nothing
from the spec package (ARCHITECTURE: data imports numpy and the engine only)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from flowctl.data.arrays import ArraySource
from flowctl.data.base import DataSource, InputSpec
from flowctl.data.synthetic import SyntheticSource
from flowctl.data.text import SentenceSource, TextSource, Vocabulary
from flowctl.engine.errors import SpecError


def make_source(config: Mapping[str, Any], inputs: Sequence[InputSpec], batch_size: int,
                base_dir: str | Path = ".") -> DataSource:
    """A source from a `data:` mapping (`source: synthetic | arrays | text`); relative paths are
    taken from `base_dir` (the spec file's directory)."""
    cfg = dict(config)
    kind = cfg.get("source", "synthetic")
    inputs = list(inputs)
    if kind == "synthetic":
        return SyntheticSource(inputs, batch_size, seed=cfg.get("seed", 0), task=cfg.get("task", "random"))
    if kind == "arrays":
        return ArraySource(inputs, batch_size, Path(base_dir) / cfg["path"], features=cfg.get("features"),
                           shuffle=cfg.get("shuffle", True), seed=cfg.get("seed", 0))
    if kind == "text":
        ints = {i.name: i for i in inputs if i.is_int}
        name = cfg.get("input") or next(iter(ints), None)
        if name is None or name not in ints or len(ints[name].shape) != 1:
            raise SpecError("a text source needs an integer model input of shape [unroll]")
        if cfg.get("lengths"):
            return _sentences(cfg, inputs, batch_size, Path(base_dir), ints, name)
        return TextSource(inputs, batch_size, Path(base_dir) / cfg["path"], unroll=ints[name].shape[0],
                          vocab_size=cfg.get("vocab_size"), input_name=cfg.get("input"),
                          target_name=cfg.get("target"))
    raise SpecError(f"unknown data source {kind!r}: synthetic, arrays or text")


def _sentences(cfg: dict[str, Any], inputs: list[InputSpec], batch_size: int, base_dir: Path,
               ints: dict[str, InputSpec], name: str) -> SentenceSource:
    lengths = cfg["lengths"]
    if lengths not in ints or ints[lengths].shape != ():
        raise SpecError(f"data.lengths names '{lengths}', which must be a scalar integer model input "
                        f"(shape [], dtype int32); the integer inputs are {', '.join(ints) or 'none'}")
    rest = [n for n in ints if n not in (name, lengths)]
    target = cfg.get("target") or (rest[0] if rest else None)
    if target is None or target not in ints:
        raise SpecError("a text source with lengths feeds three integer inputs: tokens, next tokens, lengths")
    return SentenceSource(inputs, batch_size, base_dir / cfg["path"], unroll=ints[name].shape[0],
                          input_name=name, target_name=target, lengths_name=lengths,
                          vocab_size=cfg.get("vocab_size"), bucket=cfg.get("bucket", False),
                          seed=cfg.get("seed", 0))


__all__ = ["ArraySource", "DataSource", "InputSpec", "SentenceSource", "SyntheticSource", "TextSource", "Vocabulary",
           "make_source"]
