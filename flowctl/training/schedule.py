"""Learning-rate schedules as pure functions of the global step, so a resumed run continues the
schedule exactly where it stopped (it is never restarted by a resume)."""
from __future__ import annotations

import math
from typing import Any


def learning_rate(spec: Any, step: int) -> float:
    """The rate for `step` (0-based) from a constant or a `Schedule` mapping of the spec."""
    if isinstance(spec, (int, float)):
        return float(spec)
    base = _decayed(spec, step)
    if spec.warmup_steps and step < spec.warmup_steps:
        return base * (step + 1) / spec.warmup_steps
    return base


def _decayed(s: Any, step: int) -> float:
    if s.schedule == "constant":
        return float(s.initial)
    if s.schedule == "step":
        return float(s.initial * s.decay_rate ** (step // s.decay_steps))
    if s.schedule == "exponential":
        return float(s.initial * s.decay_rate ** (step / s.decay_steps))
    if s.schedule == "cosine":
        t = min(step, s.decay_steps) / s.decay_steps
        return float(s.initial * 0.5 * (1.0 + math.cos(math.pi * t)))
    if s.schedule == "piecewise":
        for boundary, value in zip(s.boundaries, s.values):
            if step < boundary:
                return float(value)
        return float(s.values[-1])
    raise ValueError(f"unknown schedule {s.schedule!r}")
