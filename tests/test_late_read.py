"""Late reads (issue 30): on one GPU whose steps are captured, the trainer launches step k+1
before it reads step k's loss, which comes back by an asynchronous copy behind the step; the host
learns of a non-finite step one step late, and the guard's sticky flag keeps the step launched
meanwhile from changing anything. On the launch ledger (the GPU's stand-in over numpy): a replayed
step synchronises nothing, and the run's metrics, checkpoint and errors are the synchronous run's
bit for bit."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine import checkpoint as ckpt
from flowctl.engine import session as session_module
from flowctl.engine.errors import NonFiniteError
from flowctl.kernels.ledger import CaptureError, Ledger
from flowctl.kernels.registry import override_array_module
from flowctl.training.runs import load_training_spec
from flowctl.training.trainer import Trainer

pytest.importorskip("numba")

SPEC = """\
version: 1
name: late
devices: [gpu:0]
model:
  layers:
    - {name: x, type: input, shape: [6]}
    - {name: h, type: dense, units: 16, activation: relu}
    - {name: drop, type: dropout, rate: 0.3}
    - {name: logits, type: dense, units: 3}
    - {name: y, type: input, shape: [], dtype: int32, classes: 3}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: arrays, path: data.npz, shuffle: false}
training:
  optimizer: {type: adam}
  learning_rate: {schedule: exponential, initial: 0.05, decay_rate: 0.5, decay_steps: 4}
  batch_size: 10
  steps: 10
  seed: 3
checkpoint: {every_steps: 5, keep: 3}
"""

TIMING = ("examples_per_s", "time")


def _spec(tmp_path: Path, nan_row: int | None = None, text: str = SPEC) -> str:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 6)).astype(np.float32)  # 10 batches an epoch, read in order
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    if nan_row is not None:
        x[nan_row, 2] = np.nan  # the step reading this row (row // 10 + 1) has a non-finite loss
    np.savez(tmp_path / "data.npz", x=x, y=y)
    p = tmp_path / "late.yaml"
    p.write_text(text)
    return str(p)


def _train(spec: str, run_dir: Path, late: bool, ledger: Ledger, steps: int | None = None,
           counts: list[dict[str, int]] | None = None) -> Trainer:
    """A run on gpu:0 with `ledger` standing in for the GPU; `counts`: the ledger's counts at each
    step's on_step event."""
    loaded, text, path = load_training_spec(spec)
    on_step = None if counts is None else (lambda e: counts.append(dict(ledger.counts)))
    t = Trainer(loaded, run_dir, steps=steps, prefetch=0, on_step=on_step)
    t.late_reads = late
    t.start_fresh(text, path)
    return t


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in lines]


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _between(counts: list[dict[str, int]], i: int) -> dict[str, int]:
    """What the ledger counted between step i's on_step event and step i+1's."""
    return {k: counts[i][k] - counts[i - 1][k] for k in counts[i]}


def test_a_late_read_run_synchronises_nothing_per_replayed_step_and_equals_the_synchronous_run(tmp_path):
    spec = _spec(tmp_path)
    runs = {}
    for late in (False, True):
        ledger, counts = Ledger(), []
        with override_array_module("gpu", ledger):
            t = _train(spec, tmp_path / f"late-{late}", late, ledger, counts=counts)
            done = t.train()
            values = t.session.variable_values()
            t.close()
        runs[late] = (done, counts, values)
    (sync, sync_counts, sync_values), (late, late_counts, late_values) = runs[False], runs[True]
    assert sync.capture["captured"] and late.capture == sync.capture
    assert late.capture["captured_steps"] == 8  # steps 1 and 2 warm up, 3 is captured, 4-10 replay
    # Between the events of steps 3 and 4, and of 7 and 8 (no checkpoint after either): the
    # synchronous run replays step 4 (8) and reads its loss and guard flag on the host (2 syncs);
    # the late run replays step 5 (9), having launched it before reading step 4's (8's) values,
    # which came back by two asynchronous copies: no synchronisation.
    for i in (3, 7):
        s, a = _between(sync_counts, i), _between(late_counts, i)
        assert s["graph_launches"] == 1 and s["syncs"] == 2 and s["d2h_async"] == 0, s
        assert a["graph_launches"] == 1 and a["syncs"] == 0 and a["launches"] == 0, a
        assert a["d2h_async"] == 2 and a["waits"] == 1, a
    # Steps 5 and 10 are checkpointed: no step is launched ahead of their reads, so after step 5's
    # event the checkpoint reads the variables (syncs), and then steps 6 and 7 are launched.
    assert _between(late_counts, 4)["graph_launches"] == 0  # step 5 was launched ahead of step 4's read
    assert _between(late_counts, 5)["syncs"] > 0 and _between(late_counts, 5)["graph_launches"] == 2
    # The same metrics (but the timings), checkpoints and variables, bit for bit.
    assert _metrics(tmp_path / "late-True") == _metrics(tmp_path / "late-False")
    assert len(_metrics(tmp_path / "late-True")) == 10
    for step in (5, 10):
        a, b = (ckpt.load(tmp_path / f"late-{late}" / "checkpoints" / f"ckpt-{step:08d}") for late in (True, False))
        _same(a.tensors, b.tensors)
        np.testing.assert_equal(a.state, b.state)  # step, data cursor, random states, lr
    _same(late_values, sync_values)


@pytest.mark.parametrize("bad_step", [6, 2], ids=["replayed", "warm-up"])
def test_a_non_finite_step_read_late_stops_as_the_synchronous_run_does(tmp_path, monkeypatch, bad_step):
    """Step `bad_step`'s loss is not finite (a NaN in its batch). The late run launched step
    bad_step+1 before it learnt so: that step found the guard's flag still down and skipped every
    update, so the run stops with the synchronous run's error and variables, and those of a run
    whose steps are not captured at all, stopped at the same step."""
    spec = _spec(tmp_path, nan_row=(bad_step - 1) * 10 + 3)
    results = {}
    capture = session_module.CAPTURE
    for name in ("uncaptured", "sync", "late"):
        if name == "uncaptured":
            monkeypatch.setattr(session_module, "CAPTURE", False)
        ledger = Ledger()
        with override_array_module("gpu", ledger):
            t = _train(spec, tmp_path / name, name == "late", ledger)
            with pytest.raises(NonFiniteError) as e:
                t.train()
            results[name] = (str(e.value), e.value.node, t.session.variable_values(), t.step,
                             t.session.rng_states(), t.session.capture_report())
            t.close()
        monkeypatch.setattr(session_module, "CAPTURE", capture)
    un, sync, late = results["uncaptured"], results["sync"], results["late"]
    assert f"step {bad_step}: the loss is not finite; " in late[0] and "node '" in late[0]
    assert late[:2] == sync[:2] == un[:2]
    _same(late[2], un[2])
    _same(sync[2], un[2])
    assert late[3] == sync[3] == un[3] == bad_step - 1
    np.testing.assert_equal(late[4], sync[4])  # the random states put back to before the step
    plan = max(late[5]["plans"], key=lambda p: p["captured_steps"] + p["eager_steps"])
    # A replayed step's guard is read late: step bad_step+1 did run (and skipped its updates). A
    # warm-up step runs uncaptured, its guard raising at its launch: nothing is launched after it.
    ran = plan["captured_steps"] + plan["eager_steps"]
    assert ran == (bad_step + 1 if bad_step > 3 else bad_step - 1), plan
    assert _metrics(tmp_path / "late") == _metrics(tmp_path / "sync")


FP16 = """\
version: 1
name: late16
devices: [gpu:0]
model:
  layers:
    - {name: tokens, type: input, shape: [5], dtype: int32, classes: 30}
    - {name: embedding, type: embedding, vocab: 30, dim: 6}
    - {name: dropout_0, type: dropout, rate: 0.5}
    - {name: lstm_1, type: lstm, units: 6}
    - {name: softmax, type: dense, units: 30}
    - {name: targets, type: input, shape: [5], dtype: int32, classes: 30}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
data: {source: synthetic, seed: 0}
training:
  precision: fp16
  optimizer: {type: momentum, momentum: 0.9}
  loss_scale: {initial: 524288.0, growth_interval: 2}
  batch_size: 3
  steps: 9
checkpoint: {every_steps: 100}
"""


def test_fp16_skipped_steps_are_read_late_and_counted_as_the_synchronous_run_counts_them(tmp_path):
    spec = _spec(tmp_path, text=FP16)
    values = {}
    for late in (False, True):
        with override_array_module("gpu", Ledger()):
            t = _train(spec, tmp_path / f"late-{late}", late, Ledger())
            t.train()
            values[late] = t.session.variable_values()
            t.close()
    got, want = _metrics(tmp_path / "late-True"), _metrics(tmp_path / "late-False")
    assert got == want and len(got) == 9
    skipped = [m["skipped"] for m in got]
    assert skipped[0] >= 1 and skipped[-1] < 9  # a scale of 2**19 overflows float16 at first
    _same(values[True], values[False])


def test_session_launch_reads_a_replayed_step_without_a_synchronisation(rng):
    g = fc.Graph(seed=3)
    with g.as_default():
        x = fc.placeholder("float32", (None, 4), name="x")
        w = fc.variable(fc.truncated_normal((4, 3), stddev=0.5), name="w")
        loss = fc.reduce_mean(fc.square(fc.matmul(x, w)), name="loss")
        guard = fc.check_numerics(loss, message="the step's loss", name="loss_guard")
        train = fc.assign_sub(w, fc.gradients(loss, [w])[0] * 0.1)
        g.nodes[train.op.name].control_inputs.append(guard.node)
        init = fc.global_variables_initializer()
    data = [rng.standard_normal((5, 4)).astype(np.float32) for _ in range(6)]
    ledger = Ledger()
    with override_array_module("gpu", ledger):
        ref = fc.Session(g, device="gpu:0", store=fc.ContainerStore())
        ref.run(init)
        want = [float(ref.run([loss, train], {x: a})[0]) for a in data]
        sess = fc.Session(g, device="gpu:0", store=fc.ContainerStore())
        sess.run(init)
        got, counts = [], []
        pending = None
        for a in data:
            ledger.reset_counts()
            nxt = sess.launch([loss, train], {x: a})  # launched before the last step's loss is read
            if pending is not None:
                got.append(float(pending.result()[0]))
            counts.append(dict(ledger.counts))
            pending = nxt
        got.append(float(pending.result()[0]))
        with pytest.raises(CaptureError, match="asynchronous read"):
            with ledger.capture():
                ledger.capture_backend().read_async([ledger.ones(1)])
    assert got == want
    for c in counts[4:]:  # replays: the graph, the feed copied in; the loss, w and the guard copied out
        assert (c["graph_launches"], c["syncs"], c["d2h_async"], c["h2d"]) == (1, 0, 3, 1), c
