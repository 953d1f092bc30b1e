"""What every data source shares: the model inputs it feeds, and a resumable cursor.

A checkpoint records the data position with the variables (whitepaper §3.3 restores a run from a
checkpoint; a resumed run must see the same batches as an uninterrupted one), so each source's
whole state is an int position, an epoch and a numpy bit-generator state, all JSON-serialisable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from flowctl.engine.errors import SpecError


@dataclass(frozen=True)
class InputSpec:
    """One model input the source feeds: per-example shape (no batch), dtype, and for integer
    inputs the number of values they take (class ids, token ids)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    classes: int | None = None

    @property
    def is_int(self) -> bool:
        return self.dtype.startswith(("int", "uint"))


class DataSource:
    """Yields feed dicts {input name: batch array}. Subclasses set `kind` and implement `_next`."""

    kind = "base"

    def __init__(self, inputs: list[InputSpec], batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise SpecError(f"batch size must be >= 1, got {batch_size}")
        self.inputs = list(inputs)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.position = 0  # batches produced in the current epoch
        self.epoch = 0
        self.rng = np.random.default_rng(self.seed)

    def next_batch(self) -> dict[str, np.ndarray]:
        batch = self._next()
        self.position += 1
        return batch

    def _next(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __iter__(self) -> "DataSource":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self.next_batch()

    # ------------------------------------------------------------------ the cursor
    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "position": self.position, "epoch": self.epoch,
                "rng": self.rng.bit_generator.state}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise SpecError(f"cannot restore a {state.get('kind')!r} data cursor into a {self.kind!r} source")
        self.position = int(state["position"])
        self.epoch = int(state["epoch"])
        self.rng.bit_generator.state = state["rng"]


def epoch_order(seed: int, epoch: int, n: int, shuffle: bool) -> np.ndarray:
    """The order of n examples in an epoch, a function of (seed, epoch) only, so a restored cursor
    sees exactly the batches an uninterrupted run would (arrays, tables and image folders)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, epoch]).permutation(n)
