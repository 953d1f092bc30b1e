"""Gradient accumulation (`training.accumulate: K`, strategy single): K session runs of one
micro-batch each, ONE update, equal to one step on the whole batch of a mean loss; one graph (no
copies); exact resume; the spec's errors."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flowctl.engine.errors import SpecError
from flowctl.spec.loader import load_spec
from flowctl.spec.model import build_model
from flowctl.training.program import build_step, step_config
from flowctl.training.trainer import Trainer

SPEC = """\
version: 1
name: accumulate
model:
  dtype: {dtype}
  layers:
    - {{name: x, type: input, shape: [6]}}
    - {{name: h, type: dense, units: 16, activation: tanh}}
    - {{name: drop, type: dropout, rate: {dropout}}}
    - {{name: logits, type: dense, units: 3}}
    - {{name: y, type: input, shape: [], dtype: int32, classes: 3}}
    - {{name: loss, type: softmax_cross_entropy, inputs: [logits, y]}}
data: {{source: arrays, path: data.npz, shuffle: true, seed: 5}}
training:
  optimizer: {{type: {optimizer}}}
  learning_rate: 0.05
  batch_size: 12
  accumulate: {k}
  steps: 20
  seed: 3
checkpoint: {{every_steps: 100, keep: 3}}
"""


def spec_file(tmp_path: Path, name: str = "acc.yaml", k: int = 1, dtype: str = "float32",
              optimizer: str = "sgd", dropout: float = 0.0) -> Path:
    rng = np.random.default_rng(0)
    if not (tmp_path / "data.npz").exists():
        x = rng.standard_normal((48, 6)).astype(np.float32)
        np.savez(tmp_path / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32))
    text = SPEC.format(dtype=dtype, k=k, optimizer=optimizer, dropout=dropout)
    p = tmp_path / name
    p.write_text(text)
    return p


def trained(spec: Path, run: Path, steps: int) -> Trainer:
    t = Trainer(load_spec(spec), run, steps=steps, prefetch=0)
    t.start_fresh(spec.read_text(), str(spec))
    t.train()
    return t


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-6), ("float64", 1e-12)])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_k_micro_batches_equal_one_whole_batch_step(tmp_path, k, dtype, rtol, optimizer):
    whole = trained(spec_file(tmp_path, "whole.yaml", 1, dtype, optimizer), tmp_path / "whole", 3)
    acc = trained(spec_file(tmp_path, "acc.yaml", k, dtype, optimizer), tmp_path / "acc", 3)
    a, b = whole.session.variable_values(), acc.session.variable_values()
    start = Trainer(load_spec(tmp_path / "whole.yaml"), tmp_path / "start", steps=0, prefetch=0)
    start.start_fresh("", "")
    init = start.session.variable_values()
    for name in ("h/kernel", "h/bias", "logits/kernel", "logits/bias"):
        moved = np.linalg.norm(a[name] - init[name])
        assert moved > 1e-3  # the steps did something, so agreeing below means something
        # relative to the parameter itself: float32 rounding of the two summation orders
        assert np.linalg.norm(b[name] - a[name]) <= rtol * np.linalg.norm(a[name]), name
    # the accumulators are back at zero after every step, and the logged loss is the whole batch's
    for name, value in b.items():
        if name.endswith("/accumulated"):
            assert not value.any(), name
    assert sum(1 for n in b if n.endswith("/accumulated")) == 4
    np.testing.assert_allclose(losses(tmp_path / "acc"), losses(tmp_path / "whole"), rtol=max(rtol, 1e-6))
    whole.close(), acc.close(), start.close()


def test_one_graph_not_k_copies(tmp_path):
    loaded = load_spec(spec_file(tmp_path, k=4))
    assert loaded.per_replica_batch == 3 and loaded.global_batch == 12  # the cost model sees a micro-batch
    step = build_step(build_model(loaded, training=True), step_config(loaded))
    one = build_step(build_model(load_spec(spec_file(tmp_path, "one.yaml")), training=True),
                     step_config(load_spec(tmp_path / "one.yaml")))
    matmuls = [n for n in step.graph.nodes.values() if n.op == "MatMul"]
    assert len(matmuls) == len([n for n in one.graph.nodes.values() if n.op == "MatMul"])
    assert not any(n.startswith(("micro_", "replica_")) for n in step.graph.nodes)
    assert step.train is not None and step.train.micro_batches == 4
    runs = step.train.runs({"x": np.zeros((12, 6), np.float32), "y": np.zeros(12, np.int32)})
    assert [t.node for t, _ in runs] == ["accumulate_step"] * 3 + ["train_step"]
    assert all(len(f[step.train.inputs[0]["x"]]) == 3 for _, f in runs)


def test_resume_is_exact_with_accumulation(tmp_path):
    spec = spec_file(tmp_path, k=2, optimizer="adam", dropout=0.25)  # dropout: the random states matter too
    full = trained(spec, tmp_path / "full", 20)
    trained(spec, tmp_path / "split", 10).close()
    again = Trainer(load_spec(spec), tmp_path / "split", steps=20, prefetch=0)
    again.restore()
    again.train()
    assert losses(tmp_path / "full") == losses(tmp_path / "split")  # bitwise, step by step
    va, vb = full.session.variable_values(), again.session.variable_values()
    assert sorted(va) == sorted(vb)
    for k in va:
        np.testing.assert_array_equal(va[k], vb[k], err_msg=k)
    full.close(), again.close()


def test_examples_per_second_count_whole_steps(tmp_path):
    seen = []
    spec = spec_file(tmp_path, k=3)
    t = Trainer(load_spec(spec), tmp_path / "run", steps=2, prefetch=0, on_step=seen.append)
    t.start_fresh(spec.read_text(), str(spec))
    t.train()
    t.close()
    assert [e.step for e in seen] == [1, 2] and all(e.batch == 12 for e in seen)


@pytest.mark.parametrize("edit, says, where", [
    (("batch_size: 12", "batch_size: 10"), "a batch of 10 does not split into accumulate 4 equal micro-batches",
     "acc.yaml:17"),
    (("training:", "parallelism: {strategy: pipeline, concurrent_steps: 2, groups: [{layers: ['*'], device: cpu:0}]}"
                   "\ntraining:"), "accumulate is the single strategy's, not pipeline's", "acc.yaml:"),
])
def test_spec_errors(tmp_path, edit, says, where):
    p = spec_file(tmp_path, k=4)
    p.write_text(p.read_text().replace(*edit))
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert says in str(e.value) and where in str(e.value), str(e.value)
