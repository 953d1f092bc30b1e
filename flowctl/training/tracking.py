"""Experiment tracking: the run logged to MLflow beside its own run directory (`tracking.mlflow`).

What an MLflow run gets, created at the run's first start:
  params     the resolved spec flattened to dotted keys (`model.layers.0.units`), and
             `flowctl.run_dir`; values past MLflow's 6,000 characters are cut, ending in "..."
  metrics    every metrics.jsonl line's numbers at its step (loss, lr, examples_per_s, val/...),
             its `time` as the timestamp: the same values as the file, sent in batches of
             `training.log_every_steps` lines and at each checkpoint
  artifacts  the checkpoint each `train()` ends with (its tensors and manifest), under
             checkpoints/ckpt-<step>/
The MLflow run's id, experiment and tracking URI (resolved: MLflow 3's default sqlite:///mlflow.db
is relative to the current directory) go into RUN/run.json under `mlflow`, so `flowctl resume`,
from any directory, continues the same MLflow run in the same store. MLflow keeps every value
logged at a step: the steps a process logged past its last checkpoint before it stopped are logged
again by the resume, and their history holds both (the resumed value is the later one).

MLflow never fails a step: the first failed call is one warning, and this process sends nothing
more (metrics.jsonl holds every step; a later resume logs again). It stops rather than retries
because a call to an unreachable server already retries with backoff for minutes. Only a missing
mlflow package is an error, raised before the run starts.

MlflowClient rather than mlflow.start_run: the client names its run on every call, so a run in a
program that has its own active MLflow run (the Python API) neither takes nor ends that one.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

from flowctl.engine.errors import SpecError
from flowctl.spec.schema import MLflowTracking
from flowctl.training.rundir import RunDir

__all__ = ["NEEDS", "MLflowRun", "flat_params", "mlflow_run"]

NEEDS = "tracking.mlflow needs the mlflow package: pip install 'flowctl[mlflow]'"
PARAM_VALUE_LIMIT = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
KEY_LIMIT = 250  # MAX_ENTITY_KEY_LENGTH
_NOT_IN_KEYS = re.compile(r"[^\w./\- ]")  # what MLflow accepts in a key (less ':', refused on Windows)
_NOT_METRICS = {"step", "time", "replica", "event"}  # a line's index, timestamp and labels
Warn = Callable[[str], None]


def _mlflow() -> Any:
    try:
        import mlflow
    except ImportError:
        raise SpecError(NEEDS) from None
    return mlflow


def _key(key: str) -> str:
    key = _NOT_IN_KEYS.sub("_", key)
    if len(key) > KEY_LIMIT:  # cut, with a digest of the whole so two long keys stay apart
        key = key[:KEY_LIMIT - 9] + "~" + hashlib.sha256(key.encode()).hexdigest()[:8]
    return key


def flat_params(resolved: Any, prefix: str = "") -> dict[str, str]:
    """A resolved spec as MLflow params: nested mappings and lists of mappings by dotted keys
    (list items by index), every other value as JSON (a string as itself)."""
    out: dict[str, str] = {}
    if isinstance(resolved, dict) and resolved:
        for k, v in resolved.items():
            out.update(flat_params(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(resolved, list) and resolved and all(isinstance(v, dict) for v in resolved):
        for i, v in enumerate(resolved):
            out.update(flat_params(v, f"{prefix}.{i}"))
        return out
    text = resolved if isinstance(resolved, str) else json.dumps(resolved)
    if len(text) > PARAM_VALUE_LIMIT:
        text = text[:PARAM_VALUE_LIMIT - 3] + "..."
    return {_key(prefix): text}


def mlflow_run(settings: MLflowTracking | None, experiment: str, params: dict[str, str],
               on_warning: Warn) -> "MLflowRun | None":
    """The MLflow logger a spec asks for, or None; a missing mlflow package is a `SpecError` here,
    before the run starts."""
    if settings is None:
        return None
    return MLflowRun(settings, experiment, params, on_warning)


class MLflowRun:
    """One flowctl run's MLflow run: `open` at the start of each `train()`, `line`/`flush` as the
    metrics file's mirror (rundir.Mirror), `close` at its end."""

    def __init__(self, settings: MLflowTracking, experiment: str, params: dict[str, str], on_warning: Warn) -> None:
        self.mlflow = _mlflow()
        self.settings = settings
        self.experiment = settings.experiment or experiment
        self.params = params
        self.on_warning = on_warning
        self.client: Any = None  # None: not open, or off after a failure
        self.run_id: str | None = None
        self.every = 10
        self._pending: list[Any] = []  # mlflow Metric entities not yet sent
        self._lines = 0
        self._lock = threading.Lock()  # async_data_parallel's replicas write lines from their own threads

    # ------------------------------------------------------------------ the MLflow run
    def open(self, run: RunDir, every: int) -> None:
        """Continue the MLflow run that run.json names, else create one (logging the params, and
        the metrics of any steps the run already has: tracking added to a run on resume)."""
        self.every = max(1, every)
        try:
            self._open(run)
        except Exception as e:  # noqa: BLE001 -- MLflow's own errors are many; none stops training
            self._failed("starting the MLflow run", e)

    def _open(self, run: RunDir) -> None:
        from mlflow.tracking import MlflowClient

        recorded = run.info_or_empty().get("mlflow")
        if isinstance(recorded, dict) and isinstance(recorded.get("run_id"), str):
            uri = str(recorded.get("tracking_uri") or self.mlflow.get_tracking_uri())
            wanted = self.settings.tracking_uri
            if wanted and wanted != uri:
                self.on_warning(f"tracking.mlflow.tracking_uri is {wanted}, but this run's MLflow run "
                                f"{recorded['run_id']} is in {uri}: continuing it there")
            client = MlflowClient(tracking_uri=uri)
            try:
                client.get_run(recorded["run_id"])
            except Exception as e:  # noqa: BLE001
                self.on_warning(f"MLflow run {recorded['run_id']} not found in {uri} ({_first_line(e)}): "
                                f"starting a new one")
            else:
                client.update_run(recorded["run_id"], status="RUNNING")
                self.client, self.run_id = client, recorded["run_id"]
                return
        uri = self.settings.tracking_uri or self.mlflow.get_tracking_uri()
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        created = client.create_run(experiment_id, run_name=self.settings.run_name or run.path.name)
        run_id = created.info.run_id
        from mlflow.entities import Param

        params = {**self.params, "flowctl.run_dir": str(run.path.resolve())}
        client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
        self.client, self.run_id = client, run_id
        for rec in run.read_metrics():  # steps logged before tracking was on (or before a lost store)
            self._record(rec)
        self.flush()
        run.update_info(mlflow={"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": uri})

    def close(self, status: str, checkpoint: str | None) -> None:
        """Send what is pending, the checkpoint the run ends with, and the run's status (FINISHED,
        KILLED for an interrupted run, FAILED)."""
        self.flush()
        if self.client is None:
            return
        try:
            if checkpoint is not None:
                path = Path(checkpoint)
                self.client.log_artifacts(self.run_id, str(path), artifact_path=f"checkpoints/{path.name}")
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:  # noqa: BLE001
            self._failed("logging the checkpoint" if checkpoint is not None else "ending the MLflow run", e)

    # ------------------------------------------------------------------ the metrics file's mirror
    def line(self, text: str) -> None:
        if self.client is None:
            return
        try:
            rec = json.loads(text)
        except ValueError:  # the file's own readers say so: a tracker adds nothing
            return
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and "event" not in rec:
            with self._lock:
                self._record(rec)
                self._lines += 1
                due = self._lines >= self.every
            if due:
                self.flush()

    def _record(self, rec: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        stamp = rec.get("time")
        ms = int(stamp * 1000) if isinstance(stamp, (int, float)) else int(time.time() * 1000)
        for k, v in rec.items():
            if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._pending.append(Metric(_key(k), float(v), ms, int(rec["step"])))

    def flush(self) -> None:
        with self._lock:
            self._lines = 0
            pending, self._pending = self._pending, []
        if self.client is None or not pending:
            return
        try:
            self.client.log_batch(self.run_id, metrics=pending)
        except Exception as e:  # noqa: BLE001
            self._failed(f"logging the metrics of steps {pending[0].step}-{pending[-1].step}", e)

    def _failed(self, what: str, e: BaseException) -> None:
        self.client = None
        self._pending.clear()
        self.on_warning(f"MLflow: {what} failed ({type(e).__name__}: {_first_line(e)}); nothing more is sent to "
                        f"MLflow by this process, training goes on (metrics.jsonl has every step)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else "no message"
