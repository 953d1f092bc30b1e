"""Linear warm-up (`learning_rate.warmup_steps: W`) before every schedule kind: step s < W runs at
(s+1)/W of the schedule's value at s -- a straight ramp from initial/W up to the schedule, which
then goes on unshifted -- checked against each schedule written out here, and in a run's metrics."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from flowctl.spec.schema import Schedule
from flowctl.training.schedule import learning_rate

W = 5
KINDS = {
    "constant": ({"initial": 0.3}, lambda s: 0.3),
    "step": ({"initial": 0.3, "decay_rate": 0.5, "decay_steps": 3}, lambda s: 0.3 * 0.5 ** (s // 3)),
    "exponential": ({"initial": 0.3, "decay_rate": 0.5, "decay_steps": 3}, lambda s: 0.3 * 0.5 ** (s / 3)),
    "cosine": ({"initial": 0.3, "decay_steps": 12},
               lambda s: 0.3 * 0.5 * (1 + math.cos(math.pi * min(s, 12) / 12))),
    "piecewise": ({"boundaries": [2, 8], "values": [0.3, 0.1, 0.01]},
                  lambda s: 0.3 if s < 2 else 0.1 if s < 8 else 0.01),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_warmup_ramps_linearly_into_every_schedule(kind):
    keys, schedule = KINDS[kind]
    spec = Schedule.model_validate({"schedule": kind, "warmup_steps": W, **keys})
    plain = Schedule.model_validate({"schedule": kind, **keys})
    for s in range(20):
        want = schedule(s) * (s + 1) / W if s < W else schedule(s)
        assert learning_rate(spec, s) == pytest.approx(want, rel=1e-15), (kind, s)
        assert learning_rate(plain, s) == pytest.approx(schedule(s), rel=1e-15)
    # the ramp's factor is linear from 1/W (near 0) to 1 at the last warm-up step, then stays 1
    factors = [learning_rate(spec, s) / schedule(s) for s in range(12)]
    np.testing.assert_allclose(factors[:W], np.arange(1, W + 1) / W, rtol=1e-15)
    np.testing.assert_allclose(factors[W:], 1.0, rtol=1e-15)
    assert learning_rate(spec, 0) <= schedule(0) / W * (1 + 1e-15)


def test_constant_warmup_is_a_straight_line():
    spec = Schedule.model_validate({"schedule": "constant", "initial": 1.0, "warmup_steps": 100})
    lrs = np.array([learning_rate(spec, s) for s in range(100)])
    np.testing.assert_allclose(np.diff(lrs), 0.01, rtol=1e-12)  # equal increments
    assert lrs[0] == pytest.approx(0.01) and lrs[-1] == 1.0 and learning_rate(spec, 100) == 1.0


def test_a_run_logs_the_warmed_up_rates_and_resume_keeps_them(tmp_path):
    from flowctl.spec.loader import load_spec
    from flowctl.training.trainer import Trainer

    p = tmp_path / "w.yaml"
    p.write_text("""version: 1
model:
  layers:
    - {name: x, type: input, shape: [4]}
    - {name: y, type: input, shape: [], dtype: int32, classes: 3}
    - {name: logits, type: dense, units: 3, inputs: [x]}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: synthetic, seed: 1, task: learnable}
training:
  batch_size: 4
  learning_rate: {schedule: cosine, initial: 0.1, decay_steps: 8, warmup_steps: 4}
""")
    first = Trainer(load_spec(p), tmp_path / "run", steps=3, prefetch=0)
    first.start_fresh(p.read_text(), str(p))
    first.train()
    first.close()
    again = Trainer(load_spec(p), tmp_path / "run", steps=7, prefetch=0)
    again.restore()
    again.train()
    again.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    cosine = [0.1 * 0.5 * (1 + math.cos(math.pi * s / 8)) for s in range(7)]
    want = [c * (s + 1) / 4 if s < 4 else c for s, c in enumerate(cosine)]
    np.testing.assert_allclose(lrs, want, rtol=1e-15)
