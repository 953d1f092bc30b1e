"""What the training loop does when the machine or the numbers misbehave (issue 21).

- `Stop`: Ctrl-C (SIGINT) and a scheduler's preemption (SIGTERM) both finish the step, write a
  checkpoint and stop; the exit code is 128 + the signal (130, 143). A second signal stops at once.
- `checked_learning_rate`: the rate fed to a step must be finite; a schedule that gives NaN or
  overflows stops the run (§6 lesson 5: find the first non-finite value, not its consequences).
- `check_finite`: every variable is checked before a checkpoint is written, so no checkpoint ever
  holds non-finite weights (the loss is checked every step; the variables only here, where a
  full pass over them is cheap beside the write).
"""
from __future__ import annotations

import math
import signal
from types import FrameType
from typing import Any, Mapping

import numpy as np

from flowctl.engine.errors import NonFiniteError
from flowctl.training.schedule import learning_rate

__all__ = ["Stop", "check_finite", "checked_learning_rate"]


class Stop:
    """The signals that ask a run to stop: the first finishes the step, checkpoints and stops;
    a second stops at once (KeyboardInterrupt). Installed only from the main thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name

    def __enter__(self) -> "Stop":
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: the signals keep their default handlers
                break
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


def checked_learning_rate(schedule: Any, step: int) -> float:
    """The schedule's rate for `step` (0-based), or `NonFiniteError` when it is NaN or infinite
    (a step run with it would write NaN into every variable the optimizer touches)."""
    try:
        lr = learning_rate(schedule, step)
    except (OverflowError, ZeroDivisionError) as e:
        raise NonFiniteError(f"step {step + 1}: the learning rate (training.learning_rate) cannot be computed "
                             f"({e}); the step was not run") from None
    if not math.isfinite(lr):
        raise NonFiniteError(f"step {step + 1}: the learning rate (training.learning_rate) is not finite ({lr}); "
                             f"the step was not run")
    return lr


def check_finite(tensors: Mapping[str, Any], step: int) -> None:
    """`NonFiniteError` naming the first floating-point tensor that holds a NaN or an infinity."""
    for name, value in tensors.items():
        arr = np.asarray(value)
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
            bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
            raise NonFiniteError(f"step {step}: variable '{name}' holds {bad} non-finite value(s) of {arr.size}; "
                                 f"no checkpoint was written", node=name)
