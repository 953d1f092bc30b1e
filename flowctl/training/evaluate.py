"""Evaluation: the spec's model run forward only on held-out data (whitepaper §4.2: a run executes
only what its fetches need, so no gradient or update runs), with dropout off and batch norm on its
moving statistics (the model built with `training=False`). The evaluation graph's Variables have
the training graph's names, so a Session on the training store reads the current weights (§4.7).

Metrics (`training.metrics`), reported as `val/<name>`: `loss` (the mean over every example),
`accuracy` and `top5` (the label among the logits' best 1 or 5; per token for sequences), and
`perplexity` (exp of the mean loss: a language model's cross-entropy per token). A loss masked by
sequence lengths makes all three count real tokens only: the loss is weighted by each batch's
tokens, and padded positions are neither hits nor misses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

import flowctl as fc
from flowctl.data import ByteBPE, DataSource, TableEncoding, make_source
from flowctl.engine.container import ContainerStore
from flowctl.engine.errors import SpecError
from flowctl.spec.check import LoadedSpec
from flowctl.spec.model import BuiltModel, build_model
from flowctl.training.inputs import model_inputs


@dataclass
class Scores:
    """What an evaluation measured: `val/<metric>` -> value, over `examples` examples."""

    values: dict[str, float]
    examples: int

    def to_dict(self) -> dict[str, Any]:
        return {**self.values, "examples": self.examples}


class Evaluator:
    def __init__(self, loaded: LoadedSpec, store: ContainerStore, device: str,
                 metrics: Sequence[str] | None = None, tokenizer: ByteBPE | None = None,
                 table: TableEncoding | None = None, precision: str | None = None) -> None:
        """`tokenizer`: the run's byte-level BPE, for a text source that asks for one; `table`: the
        run's table encoding, for a table source; `precision`: another than the spec's (the float32
        master variables are the same either way)."""
        if loaded.loss is None:
            raise SpecError("the spec names no loss layer (model.loss), so there is nothing to evaluate")
        self.loaded = loaded
        self.metrics = list(metrics or loaded.spec.training.metrics)
        self.tokenizer = tokenizer
        self.table = table
        self.model: BuiltModel = build_model(loaded, training=False, precision=precision)
        assert self.model.loss is not None
        loss_layer = loaded.layers[loaded.loss]
        self.logits: fc.Tensor | None = None
        self.labels: str | None = None
        self.lengths: str | None = None  # a masked sequence loss: metrics count real tokens only
        if loss_layer.layer.type == "softmax_cross_entropy":
            self.logits = self.model.outputs[loss_layer.inputs[0]]
            self.labels = loss_layer.inputs[1]
            self.lengths = loss_layer.inputs[2] if len(loss_layer.inputs) > 2 else None
        elif set(self.metrics) - {"loss"}:
            raise SpecError(f"metrics {self.metrics} need a softmax_cross_entropy loss")
        self.session = fc.Session(self.model.graph, device=device, store=store)

    @property
    def graph(self) -> fc.Graph:
        return self.model.graph

    def source(self, batch: int, config: dict[str, Any] | None = None, split: str = "validation") -> DataSource:
        """The held-out data of the spec (or of `config`, a `data:` mapping) in batches of `batch`."""
        cfg = config if config is not None else self.loaded.spec.data.model_dump()
        return make_source(cfg, model_inputs(self.loaded), batch, base_dir=self.loaded.base_dir, split=split,
                           tokenizer=self.tokenizer, table=self.table)

    def run(self, source: DataSource, batches: int | None = None) -> Scores:
        """Evaluate `batches` batches of `source` (default: one pass over a file's held-out part, or
        the synthetic source's `validation_batches`)."""
        if batches is None:
            batches = int(getattr(source, "batches_per_epoch", 0) or self.loaded.spec.data.model_dump().get(
                "validation_batches", 16))
        loss_sum, weight, examples, hits, hits5, tokens = 0.0, 0, 0, 0, 0, 0
        fetches: list[Any] = [self.model.loss] + ([self.logits] if self.logits is not None else [])
        for _ in range(batches):
            batch = source.next_batch()
            feeds = {self.model.inputs[k]: v for k, v in batch.items() if k in self.model.inputs}
            out = self.session.run(fetches, feeds)
            n = len(next(iter(batch.values())))
            examples += n
            keep = None
            if self.lengths is not None:  # the loss is a mean over this batch's real tokens
                steps = out[1].shape[1]
                keep = (np.arange(steps)[None, :] < np.asarray(batch[self.lengths]).reshape(-1, 1)).reshape(-1)
                loss_sum += float(out[0]) * int(keep.sum())
                weight += int(keep.sum())
            else:
                loss_sum += float(out[0]) * n
                weight += n
            if self.logits is not None and self.labels is not None and np.issubdtype(batch[self.labels].dtype,
                                                                                      np.integer):
                logits = np.asarray(out[1]).reshape(-1, out[1].shape[-1])
                labels = batch[self.labels].reshape(-1)
                if keep is not None:
                    logits, labels = logits[keep], labels[keep]
                hits += int((logits.argmax(axis=1) == labels).sum())
                k = min(5, logits.shape[1])
                top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
                hits5 += int((top == labels[:, None]).any(axis=1).sum())
                tokens += len(labels)
        mean = loss_sum / max(weight, 1)
        values: dict[str, float] = {}
        for m in self.metrics:
            if m == "loss":
                values["val/loss"] = mean
            elif m == "perplexity":
                values["val/perplexity"] = math.exp(min(mean, 700.0))
            elif m in ("accuracy", "top5"):
                if not tokens:
                    raise SpecError(f"metric {m} needs integer class labels")
                values[f"val/{m}"] = (hits if m == "accuracy" else hits5) / tokens
        return Scores(values, examples)


def improved(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    if best is None or math.isnan(best):
        return not math.isnan(value)
    return value < best - min_delta if mode == "min" else value > best + min_delta


def ranked(ranking: Sequence[Sequence[float]], value: float, step: int, mode: str,
           count: int) -> list[list[float]]:
    """`ranking` ([value, step] pairs, best first) with this evaluation placed, at most `count`
    long: after every entry as good or better (a tie keeps the earlier), never a NaN."""
    out = [[float(v), int(s)] for v, s in ranking]
    if math.isnan(value):
        return out[:count]
    at = sum(1 for v, _ in out if (v <= value if mode == "min" else v >= value))
    out.insert(at, [float(value), int(step)])
    return out[:count]


__all__ = ["Evaluator", "Scores", "improved", "ranked"]
