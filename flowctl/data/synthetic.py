"""Synthetic data shaped from the model's inputs (the default source): floats from a normal
distribution, integers uniform in [0, classes). With `task: learnable` the integer label is the
argmax of a fixed random linear teacher applied to the float input, so a model can actually learn
it and a demo's loss falls."""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.data.base import DataSource, InputSpec
from flowctl.engine.errors import SpecError


class SyntheticSource(DataSource):
    kind = "synthetic"

    def __init__(self, inputs: list[InputSpec], batch_size: int, seed: int = 0, task: str = "random") -> None:
        super().__init__(inputs, batch_size, seed)
        if task not in ("random", "learnable"):
            raise SpecError(f"synthetic task must be random or learnable, not {task!r}")
        self.task = task
        self.teacher: tuple[str, str, np.ndarray] | None = None
        if task == "learnable":
            floats = [i for i in inputs if not i.is_int]
            labels = [i for i in inputs if i.is_int and i.shape == () and i.classes]
            if len(floats) != 1 or len(labels) != 1:
                raise SpecError(f"a learnable synthetic task needs one float input and one scalar integer "
                                f"input with classes; the model has {len(floats)} float and {len(labels)} "
                                f"such integer inputs")
            x, y = floats[0], labels[0]
            # The teacher is drawn from its own stream, so it is the same whatever the cursor.
            w = np.random.default_rng([self.seed, 1]).standard_normal((int(np.prod(x.shape)), int(y.classes or 2)))
            self.teacher = (x.name, y.name, w)

    def _next(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        n = self.batch_size
        for spec in self.inputs:
            if spec.is_int:
                hi = spec.classes or 2
                out[spec.name] = self.rng.integers(0, hi, size=(n, *spec.shape)).astype(spec.dtype)
            else:
                out[spec.name] = self.rng.standard_normal((n, *spec.shape)).astype(spec.dtype)
        if self.teacher is not None:
            xname, yname, w = self.teacher
            flat = out[xname].reshape(n, -1).astype(np.float64)
            out[yname] = np.argmax(flat @ w, axis=1).astype(out[yname].dtype)
        return out

    def state(self) -> dict[str, Any]:
        return super().state()
