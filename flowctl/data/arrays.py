"""Examples from .npy/.npz files: the first axis indexes examples; each epoch visits them in a
fresh order (when shuffling) and drops the last partial batch, so every batch has one shape."""
from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np

from flowctl.data.base import DataSource, InputSpec, epoch_order
from flowctl.engine.errors import SpecError


# What np.load raises for a file that is not arrays: empty (EOFError), truncated or not a zip
# (BadZipFile, zlib.error, OSError), neither .npy nor .npz (ValueError: it will not unpickle).
READ_ERRORS = (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error)


def cannot_read(path: Path, e: BaseException) -> SpecError:
    """The one message for a file numpy cannot read arrays from."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError:
        head = b"?"
    if not head:
        why = "the file is empty"
    elif not head.startswith((b"\x93NUMPY", b"PK")):
        why = "not an .npy or .npz file (numpy's array formats)"
    else:
        why = f"damaged or cut short ({str(e) or type(e).__name__})"
    return SpecError(f"{path}: cannot read arrays: {why}")


def _load(path: Path, inputs: list[InputSpec], features: dict[str, str]) -> dict[str, np.ndarray]:
    if not path.exists():
        raise SpecError(f"data file {path} does not exist")
    try:
        if path.suffix == ".npy":
            if len(inputs) != 1:
                raise SpecError(f"{path}: a .npy file holds one array but the model has {len(inputs)} inputs "
                                f"({', '.join(i.name for i in inputs)}); use an .npz with one array per input")
            return {inputs[0].name: np.load(path, allow_pickle=False)}
        with np.load(path, allow_pickle=False) as z:
            out = {}
            for spec in inputs:
                key = features.get(spec.name, spec.name)
                if key not in z.files:
                    raise SpecError(f"{path}: no array '{key}' for input '{spec.name}' (arrays: "
                                    f"{', '.join(z.files)})")
                out[spec.name] = z[key]
            return out
    except READ_ERRORS as e:
        raise cannot_read(path, e) from None


def rows_of(total: int, part: tuple[float, float]) -> tuple[int, int]:
    """The examples [lo, hi) of `total` that a (start, stop) fraction covers."""
    return round(part[0] * total), round(part[1] * total)


class ArraySource(DataSource):
    kind = "arrays"

    def __init__(self, inputs: list[InputSpec], batch_size: int, path: str | Path,
                 features: dict[str, str] | None = None, shuffle: bool = True, seed: int = 0,
                 part: tuple[float, float] = (0.0, 1.0)) -> None:
        """`part`: the fraction of the examples this source reads, (start, stop) in file order
        (a validation split holds out the last ones)."""
        super().__init__(inputs, batch_size, seed)
        self.path = Path(path)
        self.shuffle = shuffle
        self.arrays = self._read(inputs, features or {}, part)
        self.n = len(next(iter(self.arrays.values())))
        for spec in inputs:
            a = self.arrays[spec.name]
            if tuple(a.shape[1:]) != tuple(spec.shape):
                raise SpecError(f"{self.path}: array for input '{spec.name}' has examples of shape "
                                f"{list(a.shape[1:])}, the model expects {list(spec.shape)}")
            if spec.is_int != np.issubdtype(a.dtype, np.integer):
                raise SpecError(f"{self.path}: array for input '{spec.name}' is {a.dtype}, the model expects "
                                f"{spec.dtype}")
        if self.n < batch_size:
            raise SpecError(f"{self.path}: {self.n} examples are fewer than one batch of {batch_size}")
        self.batches_per_epoch = self.n // batch_size
        self._order_epoch = -1
        self._order = np.arange(self.n)

    def _read(self, inputs: list[InputSpec], features: dict[str, str], part: tuple[float, float]) -> dict[str, np.ndarray]:
        """{model input: its examples} for the `part` of the file this source reads."""
        arrays = _load(self.path, inputs, features)
        sizes = {name: len(a) for name, a in arrays.items()}
        if len(set(sizes.values())) != 1:
            raise SpecError(f"{self.path}: arrays differ in length: "
                            + ", ".join(f"{k} {v}" for k, v in sizes.items()))
        lo, hi = rows_of(next(iter(sizes.values())), part)
        return {k: a[lo:hi] for k, a in arrays.items()}

    def order(self, epoch: int) -> np.ndarray:
        """The example order of an epoch, a function of (seed, epoch) only, so a restored cursor
        sees exactly the batches an uninterrupted run would."""
        if epoch != self._order_epoch:
            self._order = epoch_order(self.seed, epoch, self.n, self.shuffle)
            self._order_epoch = epoch
        return self._order

    def _next(self) -> dict[str, np.ndarray]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        idx = self.order(self.epoch)[self.position * self.batch_size:(self.position + 1) * self.batch_size]
        return {spec.name: self.arrays[spec.name][idx].astype(spec.dtype, copy=False) for spec in self.inputs}
