"""TensorBoard event files, through tensorboardX (a maintained writer that needs no TensorFlow)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np


class EventWriter:
    """Scalars every step; weight histograms every `histograms_every` steps when asked.
    `purge_step` tells TensorBoard to drop events a crashed run wrote past its last checkpoint."""

    def __init__(self, directory: Path, purge_step: int | None = None, histograms_every: int = 0) -> None:
        from tensorboardX import SummaryWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(logdir=str(directory), purge_step=purge_step, flush_secs=10)
        self.histograms_every = histograms_every

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, step)

    def histograms(self, step: int, variables: Mapping[str, Any]) -> None:
        for name, v in variables.items():
            self.writer.add_histogram(f"weights/{name}", np.asarray(v), step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
