"""tracking.mlflow (issue 35): a run logged to a real local MLflow store -- the resolved spec as
params, metrics.jsonl's values per step, the final checkpoint as an artifact -- continued by a
resume; a failing MLflow never fails training; no mlflow package is one clear error up front."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.engine.errors import SpecError
from flowctl.training.runs import resume_run, start_run
from flowctl.training.tracking import PARAM_VALUE_LIMIT, flat_params

SPEC = """\
version: 1
name: tracked
model:
  layers:
    - {name: x, type: input, shape: [6]}
    - {name: h, type: dense, units: 8, activation: relu}
    - {name: logits, type: dense, units: 3}
    - {name: y, type: input, shape: [], dtype: int32, classes: 3}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: arrays, path: data.npz, seed: 1}
training:
  batch_size: 10
  steps: 10
  log_every_steps: 4
  learning_rate: {schedule: exponential, initial: 0.05, decay_rate: 0.5, decay_steps: 4}
checkpoint: {every_steps: 5}
tracking: {mlflow: TRACKING}
"""


@pytest.fixture(scope="module")
def mlflow() -> Any:
    """mlflow imported once for the module (about 1.5 s); skipped cleanly where it is not installed."""
    return pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def store(mlflow: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the module: creating one runs MLflow's schema migrations (seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'store.db'}"


def write_spec(tmp_path: Path, tracking: str) -> Path:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 6)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32))
    p = tmp_path / "tracked.yaml"
    p.write_text(SPEC.replace("TRACKING", tracking))
    return p


def train(spec: Path, run_dir: Path, warnings: list[str] | None = None) -> None:
    t = start_run(str(spec), run_dir, on_warning=(warnings.append if warnings is not None else None))
    try:
        t.train()
    finally:
        t.close()


def resume(run_dir: Path, steps: int) -> None:
    t = resume_run(run_dir, steps=steps).trainer
    try:
        t.train()
    finally:
        t.close()


def metrics_by_step(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {metric: {step: value}}: what MLflow must hold."""
    out: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec.items():
            if k not in ("step", "time"):
                out.setdefault(k, {})[rec["step"]] = float(v)
    return out


def mlflow_run_of(mlflow: Any, run_dir: Path) -> tuple[Any, Any]:
    rec = json.loads((run_dir / "run.json").read_text())["mlflow"]
    client = mlflow.MlflowClient(tracking_uri=rec["tracking_uri"])
    return client, client.get_run(rec["run_id"])


def test_params_metrics_checkpoint_and_resume_continue_one_run(mlflow: Any, store: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow puts a sqlite store's artifacts in ./mlruns
    spec = write_spec(tmp_path, f"{{tracking_uri: '{store}', experiment: flowctl-test, run_name: first}}")
    run_dir = tmp_path / "run"
    train(spec, run_dir)

    client, run = mlflow_run_of(mlflow, run_dir)
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "flowctl-test"
    params = run.data.params
    resolved = json.loads((run_dir / "spec.resolved.json").read_text())["spec"]
    assert params == {**flat_params(resolved), "flowctl.run_dir": str(run_dir.resolve())}
    assert params["model.layers.1.units"] == "8" and params["training.learning_rate.decay_rate"] == "0.5"
    assert params["tracking.mlflow.experiment"] == "flowctl-test"
    logged = metrics_by_step(run_dir)
    assert set(logged) == {"loss", "lr", "examples_per_s"}
    for key, by_step in logged.items():
        history = client.get_metric_history(run.info.run_id, key)
        assert {m.step: m.value for m in history} == by_step
        assert len(history) == 10  # one value per step: batches and checkpoints send each line once
    assert sorted(f.path for f in client.list_artifacts(run.info.run_id, "checkpoints/ckpt-00000010")) == [
        f"checkpoints/ckpt-00000010/{name}" for name in ("COMMIT", "manifest.json", "tensors.safetensors")]
    local = Path(client.download_artifacts(run.info.run_id, "checkpoints/ckpt-00000010/tensors.safetensors",
                                           str(tmp_path / "dl")))
    assert local.read_bytes() == (run_dir / "checkpoints/ckpt-00000010/tensors.safetensors").read_bytes()

    # A crash after step 12 (the checkpoint at 10 the newest): MLflow got steps 11-12 from the
    # crashed process; the resume trains 11-20 again and logs them again, in the same MLflow run.
    crashed = metrics_by_step(run_dir)
    client.update_run(run.info.run_id, status="RUNNING")
    client.log_batch(run.info.run_id, metrics=[mlflow.entities.Metric("loss", 99.0, 0, s) for s in (11, 12)])
    resume(run_dir, 20)
    client, again = mlflow_run_of(mlflow, run_dir)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run.info.run_id]
    final = metrics_by_step(run_dir)
    assert {k: {s: v for s, v in by.items() if s <= 10} for k, by in final.items()} == crashed
    for key, by_step in final.items():
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted({m.step for m in history}) == list(range(1, 21))
        # The latest value logged at each step is the resumed run's: metrics.jsonl's.
        latest: dict[int, Any] = {}
        for m in history:
            if m.step not in latest or m.timestamp >= latest[m.step].timestamp:
                latest[m.step] = m
        assert {s: m.value for s, m in latest.items()} == by_step
    loss_11 = [m.value for m in client.get_metric_history(run.info.run_id, "loss") if m.step == 11]
    assert sorted(loss_11) == sorted([99.0, final["loss"][11]])  # MLflow keeps both: history, not a table
    assert again.data.metrics["loss"] == final["loss"][20]
    names = {f.path for f in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert names == {"checkpoints/ckpt-00000010", "checkpoints/ckpt-00000020"}


def test_default_store_is_mlflows_own_in_the_current_directory(mlflow: Any, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = write_spec(tmp_path, "{}")
    expected = mlflow.get_tracking_uri()  # MLflow's own default, here: 3.x sqlite:///<cwd>/mlflow.db
    train(spec, tmp_path / "run")
    client, run = mlflow_run_of(mlflow, tmp_path / "run")
    assert client.tracking_uri == expected
    if expected.startswith("sqlite:"):
        assert (tmp_path / "mlflow.db").is_file()
    assert client.get_experiment(run.info.experiment_id).name == "tracked"  # the spec's name
    assert run.info.run_name == "run"  # the run directory's
    assert {m.step for m in client.get_metric_history(run.info.run_id, "loss")} == set(range(1, 11))


def test_a_failing_mlflow_is_one_warning_and_training_goes_on(mlflow: Any, store: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path, f"{{tracking_uri: '{store}', experiment: failing}}")
    calls = []

    def broken(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(kwargs)
        if kwargs.get("metrics"):
            raise mlflow.exceptions.MlflowException("disk I/O error")

    monkeypatch.setattr(mlflow.MlflowClient, "log_batch", broken)
    warnings: list[str] = []
    train(spec, tmp_path / "run", warnings)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["step"] == 10
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 10
    mentions = [w for w in warnings if "MLflow" in w]
    assert len(mentions) == 1 and "steps 1-4" in mentions[0] and "disk I/O error" in mentions[0], warnings
    assert sum(1 for c in calls if c.get("metrics")) == 1  # nothing more was tried


def test_without_mlflow_the_run_does_not_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError
    spec = write_spec(tmp_path, "{}")
    with pytest.raises(SpecError, match=r"pip install 'flowctl\[mlflow\]'"):
        start_run(str(spec), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # before any step: no run directory left behind
    result = CliRunner().invoke(cli, ["train", str(spec), "--run-dir", str(tmp_path / "run2")])
    assert result.exit_code == 2, result.output
    assert "tracking.mlflow needs the mlflow package: pip install 'flowctl[mlflow]'" in result.output
    assert "Traceback" not in result.output


def test_tracking_is_no_spec_change(tmp_path: Path) -> None:
    """Tracking changes nothing a run computes: not in the spec's hash, so a run resumes with it
    added, removed or pointed elsewhere."""
    from flowctl.spec.loader import load_text
    from flowctl.training.rundir import resolved, spec_changes, spec_hash

    text = write_spec(tmp_path, "{experiment: e}").read_text()
    tracked = load_text(text, base_dir=tmp_path).spec
    plain = load_text(text.replace("tracking: {mlflow: {experiment: e}}\n", ""), base_dir=tmp_path).spec
    assert plain.tracking is None and tracked.tracking is not None
    assert spec_hash(resolved(plain)) == spec_hash(resolved(tracked))
    assert spec_changes(resolved(plain), resolved(tracked)) == []


def test_bad_tracking_keys_are_located_spec_errors(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "{experimnt: x}")
    result = CliRunner().invoke(cli, ["validate", str(spec)])
    assert result.exit_code == 2
    assert "tracked.yaml:17:" in result.output and "did you mean 'experiment'" in result.output


def test_params_fit_mlflows_limits() -> None:
    params = flat_params({"a": {"b": "x" * 7000, "c": [{"d": 1}, {"e": None}], "f": [1, 2], "g:h": True}})
    assert params["a.b"] == "x" * (PARAM_VALUE_LIMIT - 3) + "..."
    assert params["a.c.0.d"] == "1" and params["a.c.1.e"] == "null" and params["a.f"] == "[1, 2]"
    assert params["a.g_h"] == "true"  # ':' is refused by MLflow on Windows
    long = flat_params({"k" * 300: 1, "k" * 299: 2})
    assert len(long) == 2 and all(len(k) <= 250 for k in long)


def test_async_data_parallel_updates_are_logged_per_step(mlflow: Any, store: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas write their lines from their own threads: every update reaches MLflow once."""
    monkeypatch.chdir(tmp_path)
    text = write_spec(tmp_path, f"{{tracking_uri: '{store}', experiment: async}}").read_text()
    spec = tmp_path / "async.yaml"
    spec.write_text(text + "devices: [cpu:0, cpu:1]\nparallelism: {strategy: async_data_parallel}\n")
    train(spec, tmp_path / "run")
    client, run = mlflow_run_of(mlflow, tmp_path / "run")
    logged = metrics_by_step(tmp_path / "run")
    assert set(logged) == {"loss", "lr", "examples_per_s", "staleness", "replica"}
    for key in ("loss", "lr", "staleness"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == list(range(1, 11))
        assert {m.step: m.value for m in history} == logged[key]
    assert client.get_metric_history(run.info.run_id, "replica") == []  # a label, not a metric
