"""model.dtype reaches the model's float inputs (issue 31, item 3): a float input that names no dtype
of its own takes the model's, in its placeholder and in the batches fed to it (synthetic draws,
arrays cast), so a float64 model builds and trains; integer inputs (labels, token ids) stay
integers. Before, every spec with a float input failed under float64 ("dtypes differ: float32,
float64 (insert a Cast)"), which a spec author could not mend."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.engine.dtypes import is_float
from flowctl.spec import load_spec
from flowctl.spec.model import build_model
from flowctl.training.inputs import make_sources, model_inputs
from flowctl.training.program import build_step, step_config
from flowctl.training.trainer import Trainer
from test_train_runs import SPEC, assert_same_state, losses, resumed, straight

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
F64 = ["model.dtype=float64"]


@pytest.mark.parametrize("spec", sorted(p.name for p in SPECS.glob("*.yaml")))
def test_every_shipped_spec_validates_and_builds_its_training_step_in_float64(spec):
    r = CliRunner().invoke(cli, ["validate", "--no-build", str(SPECS / spec), "--set", F64[0]])
    assert r.exit_code == 0, r.output
    loaded = load_spec(SPECS / spec, F64)
    step = build_step(build_model(loaded, training=True), step_config(loaded))
    declared = {i.name: i.layer.dtype for i in loaded.inputs()}
    for name, ph in step.model.inputs.items():
        assert ph.dtype == (declared[name] or "float64"), name  # unset: the model's; integers as declared
    assert {v.dtype for v in step.model.trainable_variables()} == {"float64"}
    assert step.model.loss is not None and step.model.loss.dtype == "float64"
    for i in model_inputs(loaded):  # what the data source feeds
        assert i.dtype == ("float64" if declared[i.name] is None else declared[i.name])


def test_the_demo_trains_in_float64_as_in_float32(tmp_path):
    sets = ["training.steps=20", "training.log_every_steps=1", "training.eval_every_steps=20"]
    runs = {}
    for dtype in ("float32", "float64"):
        loaded = load_spec(SPECS / "demo.yaml", [*sets, f"model.dtype={dtype}"])
        batch = make_sources(loaded, 1, 8)[0].next_batch()
        assert batch["features"].dtype == np.dtype(dtype) and batch["label"].dtype == np.int32
        t = Trainer(loaded, tmp_path / dtype, steps=20)
        t.start_fresh((SPECS / "demo.yaml").read_text(), str(SPECS / "demo.yaml"))
        t.train()
        values = t.session.variable_values()
        assert {a.dtype for k, a in values.items() if is_float(a.dtype.name)} == {np.dtype(dtype)}
        runs[dtype] = losses(tmp_path / dtype)
    assert len(runs["float64"]) == 20
    assert runs["float64"] != runs["float32"]  # computed in float64, not float32 widened
    np.testing.assert_allclose(runs["float64"], runs["float32"], rtol=1e-4)


def test_a_float64_run_resumes_exactly(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 6)).astype(np.float32)  # float32 arrays, cast to the model's float64
    np.savez(tmp_path / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32))
    spec = tmp_path / "exact.yaml"
    spec.write_text(SPEC.replace("model:\n", "model:\n  dtype: float64\n", 1))
    full = straight(spec, tmp_path / "full", 12)
    straight(spec, tmp_path / "split", 5)
    again = resumed(spec, tmp_path / "split", 12)
    assert losses(tmp_path / "full") == losses(tmp_path / "split")  # bitwise, step by step
    assert_same_state(full, again)
    assert {a.dtype for a in again.session.variable_values().values() if is_float(a.dtype.name)} == {np.dtype("float64")}


def test_a_float_input_that_names_its_dtype_keeps_it(tmp_path):
    """Only an input that names no dtype takes the model's: one that names float32 under a float64
    model stays float32 (a float64 input fed straight to a loss needs this), and where it then meets
    a float64 weight the error is one spec error at that layer's line."""
    spec = tmp_path / "s.yaml"
    spec.write_text("""\
version: 1
model:
  dtype: float64
  layers:
    - {name: x, type: input, shape: [4], dtype: float32}
    - {name: logits, type: dense, units: 3}
""")
    r = CliRunner().invoke(cli, ["validate", str(spec)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert f"{spec}:6:" in r.output and "'x:0' (None, 4) float32" in r.output
