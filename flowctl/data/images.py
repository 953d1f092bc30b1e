"""A folder of images, one sub-folder per class (ImageNet's layout), as batches of a float image
input [H, W, C] and an integer label input.

Classes are the sorted sub-folder names of the training folder, so class i is the same on every
machine and in the validation folder. Each example is decoded with Pillow, resized so its shorter
side is `resize` pixels, cropped to H x W (centre, or a random offset while training), flipped left
to right with probability 1/2 while training (`flip`), then scaled to [0, 1] and normalised per
channel by `mean` and `std`.

Decoding runs on worker processes (started at the first batch, forked where the platform can), so
a 2-core machine decodes while the model computes (the trainer's Prefetcher thread waits on them).
Nothing a worker does depends on which worker it is: the epoch's order is a function of
(seed, epoch), and each example's crop offset and flip are drawn from a generator seeded with
(seed, epoch, file index). So a batch is the same with 0, 1 or 8 workers, and a resumed run (the
cursor: epoch, position in it, seed) sees the same images with the same crops and flips.

A file Pillow cannot read is found when the folder is listed (each file's header is read on the
workers): `on_corrupt: error` stops with one error naming it; `on_corrupt: skip` warns, naming it,
and leaves it out of every epoch. A file whose header reads but whose data is cut short is found
only when it is decoded: an error naming it, or with `skip` a warning, and that example is
replaced by the next file of the epoch's order (which file is a function of the files, so resume
stays exact).

Pillow is an optional dependency (`pip install 'flowctl[images]'`), imported only for this source.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import warnings
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from flowctl.data.base import DataSource, InputSpec, epoch_order
from flowctl.engine.errors import SpecError

NEEDS = "an images source needs Pillow: pip install 'flowctl[images]'"
EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp"})
SCAN_CHUNK = 64  # files per worker task when headers are read: one task per file costs more than the read


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise SpecError(NEEDS) from None
    return Image


def list_classes(folder: Path) -> list[str]:
    """The class names of an image folder: its sub-folders, sorted (hidden ones left out)."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def list_files(folder: Path, classes: Sequence[str], part: tuple[float, float] = (0.0, 1.0)
               ) -> tuple[list[str], list[int]]:
    """Every image file (by extension) of each class's sub-folder, in sorted order, and its class
    index. `part` is taken per class (the last fraction of each class is held out, so validation
    sees every class)."""
    known = set(classes)
    extra = [name for name in list_classes(folder) if name not in known]
    if extra:
        raise SpecError(f"{folder}: sub-folder(s) {', '.join(extra)} are not classes of the training folder "
                        f"({', '.join(classes)})")
    files: list[str] = []
    labels: list[int] = []
    for k, name in enumerate(classes):
        sub = folder / name
        names = sorted(p.name for p in sub.iterdir() if p.suffix.lower() in EXTENSIONS) if sub.is_dir() else []
        lo, hi = round(part[0] * len(names)), round(part[1] * len(names))
        files += [str(sub / n) for n in names[lo:hi]]
        labels += [k] * (hi - lo)
    return files, labels


@dataclasses.dataclass(frozen=True)
class Augment:
    """What a worker needs to make one example (plain data: it travels to the worker processes)."""

    height: int
    width: int
    channels: int
    resize: int
    random_crop: bool
    flip: bool
    seed: int


def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one example's random choices: a pure function of (seed, epoch, file
    index), never of the worker or of the order examples are decoded in."""
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, epoch, index])


def probe(paths: Sequence[str]) -> list[str | None]:
    """For each file, None where Pillow reads its header, else why not."""
    Image = _pil()
    out: list[str | None] = []
    for path in paths:
        try:
            with Image.open(path) as im:
                im.size  # noqa: B018 -- the header is read by open
            out.append(None)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def decode(job: tuple[str, int, int, Augment]) -> np.ndarray | str:
    """One example as uint8 [H, W, C] (normalised in the parent, on the whole batch), or why the
    file could not be decoded. Runs on a worker process."""
    path, epoch, index, aug = job
    Image = _pil()
    draws = example_rng(aug.seed, epoch, index).random(3)  # always three draws: crop y, crop x, flip
    h, w = aug.height, aug.width
    try:
        with Image.open(path) as im:
            # JPEG: decode at 1/2, 1/4 or 1/8 scale where that still leaves the size asked for.
            small = max(1, aug.resize)
            im.draft("RGB" if aug.channels == 3 else "L", (small, small))
            im = im.convert("RGB" if aug.channels == 3 else "L")
            iw, ih = im.size
            scale = aug.resize / min(iw, ih)
            size = (max(w, round(iw * scale)), max(h, round(ih * scale)))
            if size != (iw, ih):
                im = im.resize(size, Image.BILINEAR)
            dy, dx = size[1] - h, size[0] - w
            y, x = (int(draws[0] * (dy + 1)), int(draws[1] * (dx + 1))) if aug.random_crop else (dy // 2, dx // 2)
            a = np.asarray(im.crop((x, y, x + w, y + h)), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        return f"{type(e).__name__}: {e}"
    if a.ndim == 2:
        a = a[:, :, None]
    if aug.flip and draws[2] < 0.5:
        a = a[:, ::-1]
    return np.ascontiguousarray(a)


def _fork_context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


class ImageSource(DataSource):
    kind = "images"

    def __init__(self, inputs: list[InputSpec], batch_size: int, path: str | Path, classes_from: str | Path,
                 image_name: str | None = None, label_name: str | None = None, resize: int | None = None,
                 crop: str = "center", flip: bool = False, mean: Sequence[float] = (0.0,),
                 std: Sequence[float] = (1.0,), on_corrupt: str = "error", workers: int | None = None,
                 shuffle: bool = True, seed: int = 0, part: tuple[float, float] = (0.0, 1.0),
                 training: bool = True, on_warning: Callable[[str], None] | None = None) -> None:
        """`path`: the folder this split reads; `classes_from`: the training folder, whose sorted
        sub-folders are the classes. `training`: random crops and flips as the spec says; held-out
        data (training False) is centre-cropped, never flipped, read in order."""
        super().__init__(inputs, batch_size, seed)
        _pil()  # the extra's clear error before any work
        self.path = Path(path)
        self.image_name, self.label_name = _pick_inputs(inputs, image_name, label_name)
        by_name = {i.name: i for i in inputs}
        image, label = by_name[self.image_name], by_name[self.label_name]
        h, w, c = image.shape
        self.dtypes = (image.dtype, label.dtype)
        self.classes = list_classes(Path(classes_from))
        if label.classes is not None and len(self.classes) != label.classes:
            raise SpecError(f"{classes_from}: {len(self.classes)} class sub-folders, but input "
                            f"'{self.label_name}' takes {label.classes} classes")
        self.aug = Augment(h, w, c, int(resize or max(h, w)), training and crop == "random",
                           training and bool(flip), self.seed)
        if len(mean) not in (1, c) or len(std) not in (1, c):
            raise SpecError(f"mean and std take 1 or {c} values (one per channel of '{self.image_name}')")
        self.mean = np.asarray(mean, np.float32)
        self.std = np.asarray(std, np.float32)
        self.on_corrupt = on_corrupt
        self.shuffle = shuffle and training
        self.workers = min(2, os.cpu_count() or 1) if workers is None else int(workers)
        self.warn = on_warning or (lambda m: warnings.warn(m, stacklevel=3))
        self._pool: Executor | None = None
        files, labels = list_files(self.path, self.classes, part)
        self.files, self.labels = self._readable(files, labels)
        self.n = len(self.files)
        if self.n < batch_size:
            raise SpecError(f"{self.path}: {self.n} images are fewer than one batch of {batch_size}")
        self.batches_per_epoch = self.n // batch_size
        self._order_epoch = -1
        self._order = np.arange(self.n)

    # ------------------------------------------------------------------ listing
    def _readable(self, files: list[str], labels: list[int]) -> tuple[list[str], np.ndarray]:
        chunks = [files[i:i + SCAN_CHUNK] for i in range(0, len(files), SCAN_CHUNK)]
        why = [w for chunk in self._map(probe, chunks) for w in chunk]
        bad = [(f, y) for f, y in zip(files, why) if y is not None]
        if bad and self.on_corrupt == "error":
            f, y = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise SpecError(f"{f}: cannot read image: {y}{more}; remove it, or set data.on_corrupt: skip")
        for f, y in bad:
            self.warn(f"{f}: cannot read image ({y}); left out (data.on_corrupt: skip)")
        keep = [i for i, y in enumerate(why) if y is None]
        return [files[i] for i in keep], np.asarray([labels[i] for i in keep], np.int64)

    # ------------------------------------------------------------------ workers
    def _map(self, fn: Callable[[Any], Any], jobs: Iterable[Any]) -> list[Any]:
        jobs = list(jobs)
        if self.workers == 0 or len(jobs) <= 1:
            return [fn(j) for j in jobs]
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=_fork_context())
        return list(self._pool.map(fn, jobs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ batches
    def order(self, epoch: int) -> np.ndarray:
        """The file order of an epoch, a function of (seed, epoch) only."""
        if epoch != self._order_epoch:
            self._order = epoch_order(self.seed, epoch, self.n, self.shuffle)
            self._order_epoch = epoch
        return self._order

    def _next(self) -> dict[str, np.ndarray]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        order = self.order(self.epoch)
        at = self.position * self.batch_size
        idx = [int(i) for i in order[at:at + self.batch_size]]
        images = self._map(decode, [(self.files[i], self.epoch, i, self.aug) for i in idx])
        for k, got in enumerate(images):
            if isinstance(got, str):
                images[k], idx[k] = self._replacement(order, at + k, got)
        x = np.stack(images).astype(np.float32) * np.float32(1 / 255)
        x = (x - self.mean) / self.std
        return {self.image_name: x.astype(self.dtypes[0], copy=False),
                self.label_name: self.labels[idx].astype(self.dtypes[1])}

    def _replacement(self, order: np.ndarray, at: int, why: str) -> tuple[np.ndarray, int]:
        """A file that failed to decode: an error, or (skip) the next file of the epoch's order
        that decodes, in its place."""
        bad = self.files[int(order[at])]
        if self.on_corrupt == "error":
            raise SpecError(f"{bad}: cannot decode image: {why}; remove it, or set data.on_corrupt: skip")
        self.warn(f"{bad}: cannot decode image ({why}); the next image of the epoch is used in its place "
                  f"(data.on_corrupt: skip)")
        for step in range(1, self.n):
            i = int(order[(at + step) % self.n])
            got = decode((self.files[i], self.epoch, i, self.aug))
            if not isinstance(got, str):
                return got, i
        raise SpecError(f"{self.path}: no image of the folder decodes")

    # ------------------------------------------------------------------ the cursor
    def state(self) -> dict[str, Any]:
        return {**super().state(), "seed": self.seed, "files": self.n}

    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)
        if int(state.get("files", self.n)) != self.n:
            raise SpecError(f"{self.path}: the run read {state['files']} images and the folder now holds "
                            f"{self.n}: the saved position would name other images")
        self.seed = int(state.get("seed", self.seed))
        self.aug = dataclasses.replace(self.aug, seed=self.seed)
        self._order_epoch = -1


def _pick_inputs(inputs: list[InputSpec], image: str | None, label: str | None) -> tuple[str, str]:
    """The image input (default: the first float input [H, W, C]) and the label input (default:
    the first integer input), checked for shape."""
    by_name = {i.name: i for i in inputs}
    image = image or next((i.name for i in inputs if not i.is_int and len(i.shape) == 3), None)
    label = label or next((i.name for i in inputs if i.is_int), None)
    if image is None or label is None:
        raise SpecError("an images source feeds a float image input [H, W, C] and an integer label input")
    for name in (image, label):
        if name not in by_name:
            raise SpecError(f"'{name}' is not a model input (inputs: {', '.join(by_name)})")
    if len(by_name[image].shape) != 3 or by_name[image].shape[2] not in (1, 3) or by_name[image].is_int:
        raise SpecError(f"image input '{image}' must be float [H, W, 1 or 3], got {list(by_name[image].shape)} "
                        f"{by_name[image].dtype}")
    if not by_name[label].is_int or by_name[label].shape != ():
        raise SpecError(f"label input '{label}' must be an integer scalar (shape [])")
    return image, label
