"""Whole training steps of spec-built models captured on the launch ledger (a CUDA graph's stand-in
over numpy whose replays run the recorded kernels, no Python): a captured run computes what the
same run uncaptured computes, bit for bit, does nothing on the host inside the step, and resumes
exactly. The GPU kernels of our own run in numba's CUDA simulator."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import flowctl as fc
from flowctl.bench.peers import Row, _batch, _load
from flowctl.engine.container import ContainerStore
from flowctl.kernels.ledger import Ledger
from flowctl.kernels.registry import override_array_module
from flowctl.spec.model import build_model
from flowctl.training.program import build_step, step_config

pytest.importorskip("numba")

LM = """
version: 1
model:
  layers:
    - {name: tokens, type: input, shape: [5], dtype: int32, classes: 30}
    - {name: embedding, type: embedding, vocab: 30, dim: 6}
    - {name: dropout_0, type: dropout, rate: 0.5}
    - {name: lstm_1, type: lstm, units: 6}
    - {name: dropout_1, type: dropout, rate: 0.3}
    - {name: softmax, type: dense, units: 30}
    - {name: targets, type: input, shape: [5], dtype: int32, classes: 30}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
training: {clip_norm: 1.0, optimizer: {type: sgd}}
"""

# The same without clipping (its L2Loss reductions are the slowest kernels in numba's simulator):
# for the tests of resuming, which the global norm changes nothing about.
LM_PLAIN = LM.replace("clip_norm: 1.0, ", "")

CONV = """
version: 1
model:
  defaults:
    conv2d: {batch_norm: true, bn_scale: false, activation: relu, padding: same}
  layers:
    - {name: image, type: input, shape: [7, 7, 2]}
    - {name: c1, type: conv2d, filters: 3, kernel: 3, strides: 2}
    - {name: p, type: max_pool, pool: 2, strides: 1, padding: same}
    - {name: flat, type: flatten}
    - {name: fc, type: dense, units: 4}
    - {name: label, type: input, shape: [], dtype: int32, classes: 4}
    - {name: loss, type: softmax_cross_entropy, inputs: [fc, label]}
training: {optimizer: {type: momentum, momentum: 0.9}}
"""


class Run:
    """A spec's training step in a GPU session on a ledger: `step()` runs one on a fresh batch."""

    def __init__(self, spec: str, batch: int, capture: bool, ledger: Ledger, store: Any = None) -> None:
        loaded = _load(Row("t", spec, batch))
        self.step_def = build_step(build_model(loaded, training=True), step_config(loaded))
        self.source = loaded
        self.batch = batch
        model = self.step_def.model
        self.inputs = model.inputs
        self.ledger = ledger
        with override_array_module("gpu", ledger):
            self.sess = fc.Session(model.graph, device="gpu:0", store=store or ContainerStore(), capture=capture)
            if store is None:
                self.sess.run(model.initializer())
        self.fetch = [self.step_def.train.loss, self.step_def.train.train_op]
        self.rng = np.random.default_rng(7)
        self.n = 0

    def feeds(self, n: int) -> dict[Any, Any]:
        arrays = _batch(self.source, self.batch)  # synthetic: the same each call; perturb by step
        out: dict[Any, Any] = {self.step_def.lr: np.asarray(0.3, dtype=self.step_def.lr.dtype)}
        for k, v in arrays.items():
            if k in self.inputs:
                if v.dtype.kind == "f":
                    v = v + np.float32(0.01 * n)
                else:
                    v = (v + n) % int(v.max() + 1)
                out[self.inputs[k]] = v
        return out

    def step(self) -> float:
        with override_array_module("gpu", self.ledger):
            loss = self.sess.run(self.fetch, self.feeds(self.n))[0]
        self.n += 1
        return float(loss)

    def variables(self) -> dict[str, np.ndarray]:
        with override_array_module("gpu", self.ledger):
            return {k: np.asarray(v).copy() for k, v in self.sess.variable_values().items()}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("spec,batch", [pytest.param(LM, 3, marks=pytest.mark.slow), (CONV, 2)],
                         ids=["lstm_lm", "conv_bn"])  # lstm_lm: 50 s on 2 cores (the slow set)
def test_a_captured_run_is_the_uncaptured_run_bit_for_bit(spec, batch):
    eager = Run(spec, batch, capture=False, ledger=Ledger())
    captured_ledger = Ledger()
    captured = Run(spec, batch, capture=True, ledger=captured_ledger)
    losses_e = [eager.step() for _ in range(5)]
    counts = []
    losses_c = []
    for _ in range(5):
        captured_ledger.reset_counts()
        losses_c.append(captured.step())
        counts.append(dict(captured_ledger.counts))
    assert losses_c == losses_e
    _same(captured.variables(), eager.variables())
    report = captured.sess.capture_report()
    plan = max(report["plans"], key=lambda p: p["captured_steps"])
    assert plan["captured"], report
    assert (plan["eager_steps"], plan["captured_steps"]) == (2, 3)
    replays = counts[3:]
    for c in replays:  # a replay: one graph launch; the feeds copied in; the loss (and guard) read
        assert c["launches"] == 0 and c["allocations"] == 0 and c["graph_launches"] == 1, c


def test_a_captured_run_resumed_from_its_state_continues_exactly():
    straight = Run(LM_PLAIN, 3, capture=True, ledger=Ledger())
    for _ in range(7):
        straight.step()
    first = Run(LM_PLAIN, 3, capture=True, ledger=Ledger())
    for _ in range(4):
        first.step()
    values, rng = first.variables(), first.sess.rng_states()
    assert any("device_draws" in s for s in rng.values())  # the device generators' counts, read on the host
    second_ledger = Ledger()
    second = Run(LM_PLAIN, 3, capture=True, ledger=second_ledger)  # a fresh process's session
    with override_array_module("gpu", second_ledger):
        second.sess.load_variables(values)
        second.sess.set_rng_states(rng)
    second.n = 4
    for _ in range(3):
        second.step()
    _same(second.variables(), straight.variables())


def test_a_restored_variable_reaches_the_captured_graph():
    run = Run(LM_PLAIN, 3, capture=True, ledger=Ledger())
    for _ in range(4):
        run.step()  # captured by now
    other = Run(LM_PLAIN, 3, capture=False, ledger=Ledger())
    other.step()
    values = other.variables()
    with override_array_module("gpu", run.ledger):
        run.sess.load_variables(values)
        run.sess.set_rng_states(other.sess.rng_states())
    run.n = other.n
    other.step()
    run.step()  # a replay, after the restored arrays were copied into the graph's own
    _same(run.variables(), other.variables())


def test_bench_launches_counts_a_captured_step_of_a_spec():
    """`flowctl bench launches` (our kernels counted, not run): a replay launches nothing from Python
    and allocates nothing; its one graph holds the captured step's kernels."""
    from flowctl.bench.launches import count_step

    r = count_step(Row("lm", LM, 3))
    assert r["captured"] and r["reason"] is None
    capture, replay = r["phases"]["capture"], r["phases"]["replay"]
    assert r["graph_nodes"] == capture["launches"] > 0 and capture["custom"] > 0
    assert (replay["launches"], replay["allocations"], replay["graph_launches"]) == (0, 0, 1)
    assert replay["h2d"] == 3  # tokens, targets and the learning rate, into the graph's static buffers
    assert replay["syncs"] == 2  # the fetched loss, and the guard's flag
    # At bf16 the step is still captured; its graph also holds the casts and the widening and
    # rounding around the ops whose kernels do not take bfloat16 as it is (the LSTM cell's).
    low = count_step(Row("lm", LM, 3), precision="bf16")
    assert low["precision"] == "bf16" and low["captured"]
    assert low["graph_nodes"] > r["graph_nodes"] and low["phases"]["replay"]["launches"] == 0


LM_FP16 = LM.replace("training: {clip_norm: 1.0, optimizer: {type: sgd}}", """devices: [gpu:0]
training:
  precision: fp16
  optimizer: {type: momentum, momentum: 0.9}
  loss_scale: {initial: 524288.0, growth_interval: 2}""")


def _scale(run: Run) -> tuple[float, int]:
    st = run.step_def.loss_scale
    with override_array_module("gpu", run.ledger):
        scale, skipped = run.sess.run([st.scale, st.skipped])
    return float(scale), int(skipped)


def test_fp16_on_a_gpu_skips_a_step_without_a_cond_and_is_captured():
    """On one GPU fp16's loss scaling skips a non-finite step through the device's guard flag, not a
    cond: the step is captured, skipped steps (a scale of 2**19 overflows float16 at first) leave
    every variable as it was, and the captured run is the uncaptured run bit for bit."""
    eager = Run(LM_FP16, 3, capture=False, ledger=Ledger())
    captured = Run(LM_FP16, 3, capture=True, ledger=Ledger())
    assert not any(n.op in ("Switch", "Merge") for n in eager.sess.graph.nodes.values())  # no cond
    trail_e, trail_c = [], []
    for _ in range(10):
        before = eager.variables()
        trail_e.append((eager.step(), *_scale(eager)))
        trail_c.append((captured.step(), *_scale(captured)))
        if trail_e[-1][2] > (trail_e[-2][2] if len(trail_e) > 1 else 0):  # this step was skipped
            after = eager.variables()
            for k in before:
                if not k.startswith("loss_scale/"):
                    np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    skipped = [t[2] for t in trail_e]
    assert skipped[0] >= 1 and skipped[-1] < 10  # some steps skipped, later ones applied
    assert trail_c == trail_e
    _same(captured.variables(), eager.variables())
    report = captured.sess.capture_report()
    assert max(report["plans"], key=lambda p: p["captured_steps"])["captured"], report


def test_a_captured_training_run_resumes_exactly_and_records_its_capture(tmp_path):
    """`flowctl train` on gpu:0 with the launch ledger standing in for the GPU: 8 steps straight
    equal 4 + resume + 4 bit for bit (losses and every variable), both runs' steps captured after
    their two warm-up steps, and run.json says so."""
    import json

    from flowctl.spec.loader import load_text
    from flowctl.training.trainer import Trainer

    spec = LM_PLAIN.replace("training: {optimizer: {type: sgd}}", """devices: [gpu:0]
data: {source: synthetic, seed: 0}
training: {optimizer: {type: adam}, batch_size: 3}""")
    (tmp_path / "lm.yaml").write_text(spec)

    def trainer(run: str, steps: int, fresh: bool) -> Trainer:
        t = Trainer(load_text(spec, str(tmp_path / "lm.yaml")), tmp_path / run, steps=steps)
        if fresh:
            t.start_fresh(spec, str(tmp_path / "lm.yaml"))
        else:
            t.restore()
        return t

    def losses(run: str) -> list[float]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["loss"] for x in lines if "loss" in json.loads(x)]

    with override_array_module("gpu", Ledger()):
        full = trainer("full", 8, True)
        done = full.train()
        trainer("split", 4, True).train()
        again = trainer("split", 8, False)
        resumed = again.train()
        va, vb = full.session.variable_values(), again.session.variable_values()
    assert losses("full") == losses("split") and len(losses("full")) == 8
    assert sorted(va) == sorted(vb) and any("/Adam/" in k for k in va)
    for k in va:
        np.testing.assert_array_equal(va[k], vb[k], err_msg=k)
    assert done.capture == {"captured": True, "reason": None, "captured_steps": 6, "eager_steps": 2}
    assert resumed.capture["captured"] and resumed.capture["captured_steps"] == 2
    assert json.loads((tmp_path / "full" / "run.json").read_text())["capture"]["captured"] is True


CONV_BF16 = CONV.replace("training: {", "training: {precision: bf16, ")


def test_bf16_on_a_gpu_is_captured_in_bfloat16_arrays():
    """bf16 on a GPU: the layers' products are bfloat16 arrays (the ledger's GEMM takes them as
    cuBLAS does: float32 accumulation, one rounding), the step is captured with nothing on the
    host, and the captured run is the uncaptured run bit for bit."""
    eager = Run(CONV_BF16, 2, capture=False, ledger=Ledger())
    captured_ledger = Ledger()
    captured = Run(CONV_BF16, 2, capture=True, ledger=captured_ledger)
    products = [n for n in eager.sess.graph.nodes.values() if n.op in ("MatMul", "Conv2D")]
    assert products and all(n.outputs[0].dtype == "bfloat16" for n in products)
    losses_e = [eager.step() for _ in range(5)]
    losses_c, counts = [], []
    for _ in range(5):
        captured_ledger.reset_counts()
        losses_c.append(captured.step())
        counts.append(dict(captured_ledger.counts))
    assert losses_c == losses_e and len(set(losses_e)) > 1
    _same(captured.variables(), eager.variables())
    assert counts[0]["gemms"] > 0  # the products went through the GEMM, in bfloat16
    for c in counts[3:]:
        assert c["launches"] == 0 and c["allocations"] == 0 and c["graph_launches"] == 1, c


def test_a_bf16_lstm_step_runs_its_cells_on_bfloat16_and_is_captured():
    """bf16 lstm: the LSTM cell kernels of ours take the bfloat16 arrays (as bit patterns, in numba's
    simulator here), the step is captured, and the captured run is the uncaptured run bit for bit."""
    spec = LM_PLAIN.replace("training: {", "training: {precision: bf16, ")
    eager = Run(spec, 3, capture=False, ledger=Ledger())
    led = Ledger()
    captured = Run(spec, 3, capture=True, ledger=led)
    cells = {(n.op, n.outputs[0].dtype) for n in eager.sess.graph.nodes.values() if n.op.startswith("LSTMBlockCell")}
    assert cells == {("LSTMBlockCell", "bfloat16"), ("LSTMBlockCellGrad", "bfloat16")}
    losses_e = [eager.step() for _ in range(4)]
    losses_c = []
    for _ in range(4):
        led.reset_counts()
        losses_c.append(captured.step())
    assert losses_c == losses_e and len(set(losses_e)) > 1
    _same(captured.variables(), eager.variables())
    assert (led.counts["launches"], led.counts["allocations"], led.counts["graph_launches"]) == (0, 0, 1)
