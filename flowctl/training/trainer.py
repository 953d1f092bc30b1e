"""The training loop (whitepaper §3.3): steps, metrics, checkpoints every N steps or seconds, on
Ctrl-C and at the end, and an exact resume.

Exactness: a checkpoint holds every Variable (optimizer slots and batch-norm statistics are
Variables), every random op's generator state, the data cursor and the step; the learning rate is
a function of the step. So k steps + resume + (N - k) steps equals N steps straight, bit for bit,
for every strategy whose step is one deterministic graph run (single, sync_data_parallel,
model_parallel, pipeline: §7 strategies are graph transforms, flowctl.engine.strategies).
async_data_parallel (§7, Figure 7 bottom) interleaves its replicas as the threads happen to run,
so its resume restores the parameters, optimizer state, step and each replica's data cursor, but
the updates that follow are not bit-reproducible.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

import flowctl as fc
from flowctl.data.prefetch import Prefetcher
from flowctl.engine import checkpoint as ckpt
from flowctl.engine.devices import CPU0
from flowctl.engine.errors import (
    CheckpointError,
    ExecutionError,
    NonFiniteError,
    SpecError,
    WorkerLostError,
)
from flowctl.engine.distributed import RaySession, Recovery
from flowctl.engine.executor import RunStats
from flowctl.engine.runtime import DistributedSession, blas_limits
from flowctl.spec.check import LoadedSpec
from flowctl.spec.model import BuiltModel
from flowctl.training.evaluate import Evaluator, improved, ranked
from flowctl.training.async_loop import AsyncRun
from flowctl.training.events import EventWriter, StepEvent, graph_def
from flowctl.training.faults import Stop, check_finite, checked_learning_rate
from flowctl.training.inputs import make_sources, run_table, run_tokenizer
from flowctl.training.program import Program, open_program
from flowctl.training.rundir import MetricsLog, RunDir, RunLock, resolved, spec_hash
from flowctl.training.schedule import learning_rate
from flowctl.training.trace import step_trace, write_trace
from flowctl.training.tracking import MLflowRun, flat_params, mlflow_run

__all__ = ["BEST", "EXIT_INTERRUPTED", "RANKING", "StepEvent", "Summary", "Trainer"]

EXIT_INTERRUPTED = 130  # Ctrl-C (SIGTERM: 143): a checkpoint was written, `flowctl resume` continues
BEST = "best"  # RUN/checkpoints/best/: the checkpoints of the best evaluations (checkpoint.keep_best)
RANKING = "ranking.json"  # RUN/checkpoints/best/ranking.json: those checkpoints, best first


@dataclass
class Summary:
    run_dir: str
    first_step: int
    last_step: int
    steps_run: int
    final_loss: float
    mean_examples_per_s: float
    seconds: float
    checkpoint: str | None
    interrupted: bool = False
    restored_from: str | None = None
    warnings: list[str] = field(default_factory=list)
    staleness: dict[str, Any] | None = None  # async_data_parallel: mean and max over the updates run
    evaluation: dict[str, float] | None = None  # the last evaluation's val/<metric> values
    evaluation_step: int | None = None  # the step it ran at (a resumed run may not have evaluated)
    best: dict[str, Any] | None = None  # the best evaluation so far: metric, value, step, checkpoint
    early_stopped: bool = False
    exit_code: int = 0  # interrupted: 128 + the signal that stopped it (130 Ctrl-C, 143 SIGTERM)
    # A one-GPU run: whether its steps ran as captured CUDA graphs (Session.capture_report), else None.
    capture: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Trainer:
    def __init__(self, loaded: LoadedSpec, run_dir: Path, steps: int | None = None,
                 on_step: Callable[[StepEvent], None] | None = None,
                 on_warning: Callable[[str], None] | None = None, histograms_every: int = 0,
                 allow_spec_change: bool = False, prefetch: int = 2, trace_step: int | None = None,
                 on_worker: Callable[[int, str, str], None] | None = None) -> None:
        """`prefetch`: batches each data source reads ahead on its own thread while the model
        computes (§4.5); 0 reads them in the step. The checkpointed cursor is exact either way.
        `trace_step`: write a timeline of that step (RUN/trace-<step>.json, flowctl.training.trace)."""
        self.trace_step = trace_step
        # One GPU, captured steps: launch each step before the last one's loss is read (`_loop`).
        self.late_reads = True
        self.on_worker = on_worker  # a remote run: (task, state, detail) as each worker starts or is lost
        spec = loaded.spec
        self.prefetch = prefetch
        if loaded.loss is None:
            raise SpecError("the spec names no loss layer (model.loss), so there is nothing to train")
        self.loaded = loaded
        self.spec = spec
        self.total_steps = spec.training.steps if steps is None else steps
        self.on_step = on_step or (lambda e: None)
        self.on_warning = on_warning or (lambda m: None)
        self.data_warning = on_warning  # None: a data source warns through `warnings`, never silently
        self.run = RunDir(run_dir, self.on_warning)
        self.histograms_every = histograms_every
        self.allow_spec_change = allow_spec_change
        self.resolved = resolved(spec)
        self.hash = spec_hash(self.resolved)
        self.lock: RunLock | None = None  # the run directory's writer lock, when a command holds it
        # tracking.mlflow: a missing mlflow package is an error now, before the run starts.
        tracking = spec.tracking.mlflow if spec.tracking else None
        self.mlflow: MLflowRun | None = mlflow_run(tracking, spec.name or spec.model.name,
                                                   flat_params(self.resolved) if tracking else {}, self.on_warning)
        self._build()

    # ------------------------------------------------------------------ graph and session
    def _build(self) -> None:
        self.program: Program = open_program(self.loaded, on_worker=self.on_worker, ray_log=self.run.ray_log)
        # §3.3: a remote run restarts lost workers and restores the last checkpoint.
        self.recovery = Recovery(self.program.session, self.spec.cluster.max_failures, self._restore_step) \
            if self.program.remote else None
        p = self.program
        step = p.step
        self.strategy = step.strategy
        self.model: BuiltModel = step.model
        self.optimizer = step.optimizer
        self.lr = step.lr
        self.init = step.init
        self.session = p.session
        self.batch = step.batch
        if step.train is not None:
            self.loss = step.train.loss
            self.train_op = step.train.train_op
        self.tokenizer = run_tokenizer(self.loaded, self.run)
        self.table = run_table(self.loaded, self.run)
        self.sources = make_sources(self.loaded, step.replicas, step.batch, self.tokenizer, self.table,
                                    on_warning=self.data_warning)
        if self.prefetch:
            self.sources = [Prefetcher(src, depth=self.prefetch) for src in self.sources]
        self.data = self.sources[0]
        ck = self.spec.checkpoint
        self.ckpt_every_steps = ck.every_steps if ck else None
        self.ckpt_every_seconds = ck.every_seconds if ck else None
        self.checkpoints = ckpt.CheckpointDir(self.run.checkpoints, keep=ck.keep if ck else 3,
                                              spec_hash=self.hash, on_warning=self.on_warning)
        # The ranking (tracking["ranking"]), not recency, says which of these stay: `_keep_ranked`.
        self.best_checkpoints = ckpt.CheckpointDir(self.run.checkpoints / BEST, keep=None, spec_hash=self.hash,
                                                   on_warning=self.on_warning)
        self.step = 0
        t = self.spec.training
        self.eval_every = t.eval_every_steps if self.program.step.async_step is None else None
        self.evaluator: Evaluator | None = None
        if self.eval_every:
            device = self.session.device if self.program.cluster is None else self.program.cluster.names[0]
            self.evaluator = Evaluator(self.loaded, self.session.store, device, tokenizer=self.tokenizer,
                                       table=self.table)
            self.eval_source = self.evaluator.source(self.batch)
            self.eval_start = self.eval_source.state()
        self.baselines = self._baselines()
        # What judging evaluations carries from step to step, checkpointed so a resumed run
        # stops early, and keeps the best, exactly as an uninterrupted one would.
        # "ranking": checkpoint.keep_best's [value, step] pairs, best first ("best", "best_step": the first).
        self.tracking: dict[str, Any] = {"best": None, "best_step": None, "ranking": [], "best_stop": None,
                                         "stale": 0, "last": None}
        self.early_stopped = False

    def close(self) -> None:
        """Stop the prefetch threads and a multi-device session's device threads."""
        for src in [*self.sources, getattr(self, "eval_source", None)]:
            stop = getattr(src, "close", None)
            if stop is not None:
                stop()
        self.program.close()
        if self.lock is not None:
            self.lock.release()

    # ------------------------------------------------------------------ state
    def start_fresh(self, spec_text: str, spec_path: str) -> None:
        self.session.run(self.init)
        self.step = 0
        self.run.create()
        self.run.write_text("spec.yaml", spec_text)
        self.run.write_json("spec.resolved.json", {"sha256": self.hash, "spec": self.resolved})
        self.run.write_json("devices.json", [d if isinstance(d, str) else d.model_dump(mode="json")
                                             for d in self.spec.devices])
        self.run.write_text("graph.json", self.model.graph.to_json())
        if self.program.placement is not None:
            self.run.write_json("placement.json", {"strategy": self.strategy, "devices": self.program.devices,
                                                   "assignment": self.program.placement})
        self.run.write_info({"status": "running", "spec_path": spec_path, "step": 0, "flowctl": fc.__version__,
                             "spec_sha256": self.hash, "strategy": self.strategy, **self._products()})
        self.run.truncate_metrics(-1)

    def restore(self, restart: bool = False) -> str:
        """Load the newest valid checkpoint; returns its path. A checkpoint whose files pass but
        whose state does not restore (a cursor or RNG state it cannot use) is skipped like a
        damaged one. A run stopped before its first checkpoint starts again from step 0. A run
        whose checkpoints were all lost (the metrics, the `latest` pointer or run.json say one was
        written) is refused, unless `restart`: then it starts again from step 0 and its metrics
        are set aside (metrics.<time>.jsonl), so the file never holds two runs' steps."""
        self.run.inside(self.run.checkpoints)
        if self.checkpoints.empty():
            self.checkpoints.remove_temporaries()
            logged = self.run.logged_steps()
            lost = self._lost_checkpoint(logged)
            if lost and not restart:
                raise CheckpointError(
                    f"{self.run.path}: metrics.jsonl records {logged} step(s) and {lost}, but no checkpoint is "
                    f"left in {self.run.checkpoints} (deleted?): resume has nothing to continue from. Pass "
                    f"--restart to train the run again from step 0 (metrics.jsonl is set aside as "
                    f"metrics.<time>.jsonl)")
            self.session.run(self.init)
            self.step = 0
            if restart:
                moved = self.run.set_metrics_aside()
                self.on_warning("starting the run again from step 0 (--restart)" + (
                    f"; its metrics of {logged} step(s) are now {moved.name}" if moved else ""))
            else:
                ran = f" at step {logged}" if logged else ""
                self.on_warning(f"the run stopped{ran} before its first checkpoint: starting it again from "
                                f"step 0" + (f" (the metrics of steps 1-{logged} are dropped)" if logged else ""))
            origin = "the initial state (no checkpoint was written)" if not lost else \
                "the initial state (--restart: the checkpoints were lost)"
        else:
            if restart:
                raise CheckpointError(f"{self.run.path}: --restart starts over a run whose checkpoints were "
                                      f"lost, but {self.checkpoints.latest() or self.run.checkpoints} is left: "
                                      f"resume continues from it (to start afresh, train into a new --run-dir)")
            c = self.checkpoints.restore_latest(allow_spec_change=self.allow_spec_change, accept=self._load)
            for w in c.warnings:
                self.on_warning(w)
            origin = str(c.path)
            self._keep_ranked()  # best checkpoints a crashed run saved after this one are not in its ranking
        self.run.truncate_metrics(self.step)
        self.run.update_info(status="running", step=self.step, **self._products())
        return origin

    def _lost_checkpoint(self, logged: int) -> str:
        """What says a checkpoint was written once, in a run that has none now; '' if nothing does
        (a run killed before its first checkpoint)."""
        latest = self.run.checkpoints / ckpt.LATEST
        if latest.exists():
            return f"{latest} names one"
        info = self.run.info_or_empty()
        status = info.get("status")
        if status in ("finished", "interrupted", "early_stopped") and info.get("saved", True):  # each ends with a save
            return f"run.json says it {status.replace('_', ' ')} (saving a checkpoint)"
        every = self.ckpt_every_steps
        if every and logged > every:
            return f"a checkpoint was due at step {every}"
        return ""

    def _products(self) -> dict[str, Any]:
        """A run on a GPU records how its float32 products ran (training.allow_tf32): "tf32" or
        "ieee"; a run on CPUs records nothing (its products are IEEE float32 either way)."""
        mode = self.program.fp32_products
        return {"fp32_products": mode} if mode is not None else {}

    def _load(self, c: ckpt.Checkpoint) -> None:
        ckpt.apply(self.session, c.tensors, c.state, origin=c.path)
        data = c.state["data"]
        # async_data_parallel saves one cursor per replica; the synchronous strategies one.
        cursors = data if isinstance(data, list) else [data]
        if len(cursors) != len(self.sources):
            raise CheckpointError(f"{c.path}: inconsistent ({len(cursors)} data cursor(s) saved, the run has "
                                  f"{len(self.sources)} replica(s))")
        for src, cur in zip(self.sources, cursors):
            src.restore(cur)
        self.step = int(c.state["step"])
        tracking = c.state.get("tracking")
        if isinstance(tracking, dict):
            self.tracking.update(tracking)
            if not self.tracking.get("ranking") and self.tracking.get("best_step") is not None:
                # a checkpoint from before keep_best.count: its one best is the ranking
                self.tracking["ranking"] = [[self.tracking["best"], self.tracking["best_step"]]]

    def _restore_step(self) -> int:
        self.restore()
        return self.step

    def save(self) -> str:
        self.run.inside(self.run.checkpoints)
        tensors, state = ckpt.capture(self.session, self.optimizer)
        check_finite(tensors, self.step)  # never a checkpoint of non-finite weights
        data: Any = [s.state() for s in self.sources] if self.program.step.async_step is not None else self.data.state()
        state.update(step=self.step, data=data, strategy=self.strategy,
                     lr=learning_rate(self.spec.training.learning_rate, self.step), tracking=dict(self.tracking))
        path = self.checkpoints.save(self.step, tensors, state)
        return str(path)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """The held-out data, forward only, from the same batches every time; beside a language
        model's perplexity, the unigram model's on the same stream (`_baselines`)."""
        assert self.evaluator is not None
        self.eval_source.restore(self.eval_start)
        return {**self.evaluator.run(self.eval_source).values, **self.baselines}

    def _baselines(self) -> dict[str, float]:
        """`val/unigram_perplexity` where a text corpus is evaluated by perplexity: the unigram
        model of the training stream (token counts, add-one smoothed) on the validation stream,
        the figure a language model's `val/perplexity` must beat to have learned anything beyond
        token frequencies. Computed once; the same number at every evaluation."""
        if self.evaluator is None or "perplexity" not in self.evaluator.metrics:
            return {}
        from flowctl.data.text import TextSource, unigram_perplexity

        train = getattr(self.data, "source", self.data)  # under a Prefetcher
        if not isinstance(train, TextSource) or not isinstance(self.eval_source, TextSource):
            return {}
        return {"val/unigram_perplexity": unigram_perplexity(train, self.eval_source)}

    def _judge(self, values: dict[str, float]) -> None:
        """After an evaluation: keep the best checkpoint (checkpoint.keep_best) and count
        evaluations without improvement (training.early_stopping)."""
        tr = self.tracking
        tr["last"], tr["last_step"] = values, self.step
        keep = self.spec.checkpoint.keep_best if self.spec.checkpoint else None
        ranking = ranked(tr["ranking"], values[keep.metric], self.step, keep.mode, keep.count) if keep else []
        if keep is not None and any(s == self.step for _, s in ranking):
            tr["ranking"] = ranking
            tr["best"], tr["best_step"] = ranking[0]
            tensors, state = ckpt.capture(self.session, self.optimizer)
            state.update(step=self.step, data=self.data.state(), strategy=self.strategy,
                         tracking={**tr, "ranking": [list(r) for r in ranking]},
                         lr=learning_rate(self.spec.training.learning_rate, self.step),
                         best={"metric": keep.metric, "value": values[keep.metric]})
            # The new one first, then the ranking file, then the one it pushed out: a crash in
            # between leaves one checkpoint too many, never one too few.
            self.best_checkpoints.save(self.step, tensors, state)
            self._keep_ranked()
        stop = self.spec.training.early_stopping
        if stop is not None:
            if improved(values[stop.metric], tr["best_stop"], stop.mode, stop.min_delta):
                tr["best_stop"], tr["stale"] = values[stop.metric], 0
            else:
                tr["stale"] += 1
            if tr["stale"] >= stop.patience:
                self.early_stopped = True
                self.on_warning(f"early stopping at step {self.step}: {stop.metric} has not improved on "
                                f"{tr['best_stop']:.6g} for {tr['stale']} evaluations")

    def _ranking(self) -> list[dict[str, Any]]:
        return [{"rank": i + 1, "step": int(s), "value": v, "checkpoint": str(self.best_checkpoints.path_for(int(s)))}
                for i, (v, s) in enumerate(self.tracking["ranking"])]

    def _keep_ranked(self) -> None:
        """checkpoints/best/ as the ranking says: its checkpoints and no other, and ranking.json
        listing them best first (what `--checkpoint best` loads is its first)."""
        keep = self.spec.checkpoint.keep_best if self.spec.checkpoint else None
        if keep is None:
            return
        tr = self.tracking
        tr["ranking"] = [list(r) for r in tr["ranking"][:keep.count]]  # a resume may lower the count
        if tr["ranking"]:
            tr["best"], tr["best_step"] = tr["ranking"][0]
        if not self.best_checkpoints.directory.is_dir():
            return
        self.best_checkpoints.retain({int(s) for _, s in tr["ranking"]})
        self.run.write_json(f"checkpoints/{BEST}/{RANKING}", {"metric": keep.metric, "mode": keep.mode,
                                                              "count": keep.count, "ranking": self._ranking()})

    def _due(self, now: float, last_save: float, step: int | None = None) -> bool:
        """Whether a checkpoint is due after `step` (the steps completed: self.step by default)."""
        step = self.step if step is None else step
        return bool((self.ckpt_every_steps and step % self.ckpt_every_steps == 0) or
                    (self.ckpt_every_seconds and now - last_save >= self.ckpt_every_seconds))

    # ------------------------------------------------------------------ the loop
    def train(self) -> Summary:
        """Train to `total_steps`. One client thread runs whole steps (single, sync_data_parallel,
        model_parallel, pipeline); async_data_parallel runs one client thread per replica."""
        first = self.step
        t0 = time.perf_counter()
        # What `flowctl runs` reads: the steps planned, and the wall time (earlier processes' seconds
        # plus this one's since `started`); the end writes status, seconds, and a signal or an error.
        info = {k: v for k, v in self.run.info_or_empty().items() if k not in ("error", "signal", "saved", "ended")}
        before = float(info["seconds"]) if isinstance(info.get("seconds"), (int, float)) else 0.0
        self.run.write_info({**info, "status": "running", "started": time.time(), "planned_steps": self.total_steps})
        writer = EventWriter(self.run.inside(self.run.events), purge_step=first + 1,
                             histograms_every=self.histograms_every)
        if first == 0:  # a resumed run's graph is in its first event file, which TensorBoard reads too
            placed = self.program.placed
            writer.graph(graph_def(placed.step.graph, placed.assignment, placed.step.layers))
        cluster = self.program.cluster
        # N device threads each calling BLAS: give each its share of the cores (runtime.blas_limits).
        limits = blas_limits(cluster) if cluster is not None else contextlib.nullcontext()
        if self.mlflow is not None:
            self.mlflow.open(self.run, self.spec.training.log_every_steps)
        try:
            with Stop() as stop, self.run.open_metrics(self.mlflow) as metrics, limits:
                if self.program.step.async_step is not None:
                    loss_v, rates, last_path, interrupted, stale = self._loop_async(stop, metrics, writer, t0)
                else:
                    loss_v, rates, last_path, interrupted = self._loop(stop, metrics, writer, t0)
                    stale = None
                metrics.flush()
                if self.step > first or interrupted or last_path is None:
                    last_path = self.save()
        except BaseException as e:
            writer.close(failing=True)  # the first error is the one to report
            self._record_end(e, before + time.perf_counter() - t0)
            if self.mlflow is not None:
                self.mlflow.close("FAILED" if isinstance(e, Exception) else "KILLED", None)
            raise
        writer.close()
        status = "interrupted" if interrupted else ("early_stopped" if self.early_stopped else "finished")
        if self.mlflow is not None:
            self.mlflow.close("KILLED" if interrupted else "FINISHED", last_path)
        capture = self._capture_report()
        elapsed = time.perf_counter() - t0
        self.run.update_info(status=status, step=self.step, seconds=before + elapsed, ended=time.time(),
                             **({"signal": stop.name} if interrupted else {}),
                             **({"capture": capture} if capture else {}))
        tr = self.tracking
        best = None
        if tr["best_step"] is not None and self.spec.checkpoint and self.spec.checkpoint.keep_best:
            best = {"metric": self.spec.checkpoint.keep_best.metric, "value": tr["best"], "step": tr["best_step"],
                    "checkpoint": str(self.best_checkpoints.path_for(tr["best_step"])), "ranking": self._ranking()}
        return Summary(str(self.run.path), first, self.step, self.step - first, loss_v,
                       float(np.mean(rates)) if rates else 0.0, elapsed, last_path, interrupted, staleness=stale,
                       evaluation=tr["last"], evaluation_step=tr.get("last_step"), best=best, early_stopped=self.early_stopped,
                       exit_code=stop.exit_code if interrupted else 0, capture=capture)

    def _record_end(self, error: BaseException, seconds: float) -> None:
        """run.json says how the run ended: `failed` with the error, or `interrupted` (a second
        Ctrl-C, which stops at once). Best effort: the error on its way out is the one to report."""
        if isinstance(error, Exception):
            end: dict[str, Any] = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
        else:
            # stopped at once: no checkpoint was written on the way out (`_lost_checkpoint`)
            end = {"status": "interrupted", "saved": False,
                   "signal": "SIGINT" if isinstance(error, KeyboardInterrupt) else type(error).__name__}
        try:
            self.run.update_info(**end, step=self.step, seconds=seconds, ended=time.time())
        except Exception:  # noqa: BLE001 -- a full disk must not hide the error that ended the run
            pass

    def _capture_report(self) -> dict[str, Any] | None:
        report = getattr(self.session, "capture_report", None)
        if report is None or not getattr(self.session, "capture", False):
            return None
        r = report()
        plans = r["plans"]
        train = max(plans, key=lambda p: p["captured_steps"] + p["eager_steps"], default=None)
        return {"captured": bool(train and train["captured"]), "reason": train and train["reason"],
                "captured_steps": train["captured_steps"] if train else 0,
                "eager_steps": train["eager_steps"] if train else 0}

    def _loop(self, stop: Stop, metrics: MetricsLog, writer: Any,
              t0: float) -> tuple[float, list[float], str | None, bool]:
        """Steps in order. On one GPU whose steps are captured (`_late`), step k+1 is launched
        before step k's loss is read (it comes back by an asynchronous copy), unless something
        after step k needs the host's state at step k: an evaluation, histograms, a checkpoint, a
        trace, the last step, a stop. A non-finite step k is then found one step late, and step
        k+1, launched meanwhile, changed nothing (the guard's flag is sticky: StepGuard), so the
        run stops and explains it as a step read at once does. The metrics are the same."""
        assert self.program.step.train is not None
        train = self.program.step.train
        last_save = t0
        last_path: str | None = None
        loss_v = float("nan")
        rates: list[float] = []
        fetches = [self.loss, self.train_op]
        scaling = self.program.step.loss_scale
        if scaling is not None:  # fp16: the scale and the skipped count after each step, for metrics
            assert scaling.new_scale is not None and scaling.new_skipped is not None
            fetches += [scaling.new_scale, scaling.new_skipped]
        late = self._late()
        ahead: _Step | Exception | None = None  # the next step, launched before this one is read
        while self.step < self.total_steps:
            if stop.requested and ahead is None:
                return loss_v, rates, last_path, True
            try:
                if isinstance(ahead, Exception):
                    raise ahead
                step = ahead or self._start(train, fetches, self.step, late)
                ahead = None
                if late and not stop.requested and self._overlaps(step, last_save):
                    try:
                        ahead = self._start(train, fetches, self.step + 1, late)
                    except Exception as e:  # noqa: BLE001 -- raised in its turn, after this step's metrics
                        ahead = e
                losses, scale, dt = self._finish(step)
            except WorkerLostError as e:
                self._recover(e, metrics)
                continue
            if step.stats is not None:
                self.write_trace(step.stats, fetches, step.runs[-1][1])
            loss_v = losses[0] if len(losses) == 1 else sum(losses) / len(losses)  # the whole batch's mean
            lr = step.lr
            self.step += 1
            eps = self.batch / dt if dt > 0 else float("inf")
            rates.append(eps)
            scores = self.evaluate() if self.eval_every and self.step % self.eval_every == 0 else {}
            extra = "".join(f', "{k}": {v!r}' for k, v in scores.items())
            if scale:
                extra += f', "loss_scale": {float(scale[0])!r}, "skipped": {int(scale[1])}'

            metrics.write(f'{{"step": {self.step}, "loss": {loss_v!r}, "lr": {lr!r}, '
                          f'"examples_per_s": {eps:.1f}, "time": {time.time():.3f}{extra}}}\n')
            scaling_now = {"loss_scale": float(scale[0]), "skipped_steps": int(scale[1])} if scale else {}
            writer.scalars(self.step, {"loss": loss_v, "learning_rate": lr, "examples_per_s": eps, **scaling_now,
                                       **scores})
            if scores:
                self._judge(scores)
            if self.histograms_every and self.step % self.histograms_every == 0:
                writer.histograms(self.step, self.session.variable_values())
            self.on_step(StepEvent(self.step, self.total_steps, loss_v, lr, eps, time.perf_counter() - t0, self.batch,
                                   scores or None))
            if self.early_stopped:
                return loss_v, rates, last_path, False
            now = time.perf_counter()
            # (With a step launched ahead, a save due by the clock waits for the next step, which
            # `_overlaps` then reads at once; one due by the step count never has a step ahead.)
            if ahead is None and self._due(now, last_save) and self.step < self.total_steps:
                metrics.flush()
                last_path = self.save()
                last_save = now
        assert ahead is None
        return loss_v, rates, last_path, False

    def _late(self) -> bool:
        """Whether this run's steps are read one step late: one GPU whose steps are captured
        (elsewhere a step's values are on the host when its run returns, or a device thread per
        device reads them), and `late_reads` not turned off."""
        return bool(self.late_reads and self.program.cluster is None and not self.program.remote
                    and getattr(self.session, "capture", False))

    def _overlaps(self, step: "_Step", last_save: float) -> bool:
        """Whether the next step may be launched before `step` is read: nothing after `step` (the
        step number it completes: n) needs the variables as they are at n, and the next step
        needs no host of its own. Never after a launch that raised (an uncaptured step's guard
        raises on the host, and lowers no device flag that would hold the next step back)."""
        n = self.step + 1
        assert step.last is not None
        return (len(step.runs) == 1 and step.last.error is None and step.stats is None and n < self.total_steps
                and self.trace_step != n + 1
                and not (self.eval_every and n % self.eval_every == 0)
                and not (self.histograms_every and n % self.histograms_every == 0)
                and not self._due(time.perf_counter(), last_save, n))

    def _start(self, train: Any, fetches: list[Any], done: int, late: bool) -> "_Step":
        """Launch the step after `done` steps: one session run, or with training.accumulate K, K
        runs of one micro-batch each (all but the last add their gradients up, the last applies
        the update: strategies.TrainStep.runs). Every run but the last is read at once; the last
        is read by `_finish` (`late`: launched with Session.launch, its values still on their way)."""
        step = _Step(train.runs(self.data.next_batch()), checked_learning_rate(self.spec.training.learning_rate, done),
                     RunStats() if self.trace_step == done + 1 else None)
        guard = self.program.step.guard
        for i, (target, feeds) in enumerate(step.runs):
            feeds[self.lr] = np.asarray(step.lr, dtype=self.lr.dtype)
            last = i == len(step.runs) - 1
            run_fetches = fetches if last else [self.loss, target]
            # What a replay of this run needs should its loss not be finite: the random states;
            # and the variables, unless the step's guard (program.guard_state) keeps a
            # non-finite step from writing any -- holding them would keep every update from
            # writing in place. A remote run would pull every variable across the network, so
            # it keeps none.
            snapshot = None if self.program.remote else (
                None if guard else self.session.variable_values(), self.session.rng_states())
            run = _Run(run_fetches, feeds, snapshot)
            ts = time.perf_counter()
            try:
                run.pending = self._run_step(run_fetches, feeds, step.stats if last else None,
                                             late=late and step.stats is None)
            except Exception as e:  # noqa: BLE001 -- raised where the run is read (`_read`)
                run.error = e
            run.seconds = time.perf_counter() - ts
            if last:
                step.last = run
            else:
                self._read(step, run)
        return step

    def _finish(self, step: "_Step") -> tuple[list[float], list[Any], float]:
        """Read the step's last run: the losses of its runs, fp16's scale and skipped count, and
        the runs' time (not the snapshots')."""
        assert step.last is not None
        step.scale = self._read(step, step.last)
        return step.losses, step.scale, step.dt

    def _read(self, step: "_Step", run: "_Run") -> list[Any]:
        """One run's values on the host; a non-finite loss stops the run with the node that made it."""
        guard = self.program.step.guard
        try:
            if run.error is not None:
                raise run.error
            ts = time.perf_counter()
            assert run.pending is not None
            loss_arr, _, *scale = run.pending.result()
            step.dt += run.seconds + time.perf_counter() - ts
        except NonFiniteError as e:
            if guard is None or e.node != guard:
                raise
            self._explain_non_finite(run.snapshot, run.fetches, run.feeds)
        step.losses.append(float(loss_arr))
        if not math.isfinite(step.losses[-1]):
            self._explain_non_finite(run.snapshot, run.fetches, run.feeds)
        return scale

    def _recover(self, error: WorkerLostError, metrics: MetricsLog) -> None:
        """§3.3: a worker was lost mid-step. Restart it, put the last checkpoint back, and carry on
        from there (the steps since it are run again); past cluster.max_failures, end the run with
        the last checkpoint as it is."""
        if self.recovery is None:
            raise error
        metrics.flush()
        r = self.recovery.handle(error, self.step + 1)
        metrics.reopen()  # the restore rewrote the metrics file up to the checkpoint
        metrics.write(json.dumps({"step": self.step, "event": "restart", **r.to_dict()}) + "\n")
        metrics.flush()
        self.on_warning(f"worker task {', '.join(map(str, r.tasks))} lost at step {r.failed_step} ({r.node or '?'}); "
                        f"restarted ({r.failure} of {self.recovery.max_failures}), {r.replayed} step(s) replayed "
                        f"from checkpoint {r.resumed_step}; Ray's account in {self.run.ray_log}")

    def _run_step(self, fetches: list[Any], feeds: dict[Any, Any], stats: RunStats | None, late: bool = False) -> Any:
        """One session run; its values, or (`late`) a Pending of them (Session.launch)."""
        if self.program.step.loss_scale is not None:
            # fp16 loss scaling overflows on purpose now and then (the step is skipped, the scale
            # halved): numpy's overflow warnings would only be noise.
            with np.errstate(over="ignore", invalid="ignore"):
                return self._run_step_plain(fetches, feeds, stats, late)
        return self._run_step_plain(fetches, feeds, stats, late)

    def _run_step_plain(self, fetches: list[Any], feeds: dict[Any, Any], stats: RunStats | None, late: bool) -> Any:
        if late:
            return self.session.launch(fetches, feeds)
        if stats is None or self.program.cluster is not None:
            return _Done(self.session.run(fetches, feeds, stats=stats))
        # One device: its straight-line plan keeps no timestamps, the dataflow executor does.
        executor, self.session.executor = self.session.executor, "dataflow"
        try:
            return _Done(self.session.run(fetches, feeds, stats=stats))
        finally:
            self.session.executor = executor

    def write_trace(self, stats: RunStats, fetches: list[Any], feeds: dict[Any, Any]) -> Path:
        """The timeline of the step just run, beside the simulator's prediction of it."""
        if isinstance(self.session, DistributedSession):
            graphs = self.session.step_plan(fetches, feeds).partitions
        elif isinstance(self.session, RaySession):  # its plans live on its workers; their graphs here
            graphs = self.session.partitions(fetches, feeds)
        else:  # the graph its plan ran: the CPU's passes make nodes (PackPanels) and change ops
            graphs = {self.session.device: self.session.plan_for(fetches, feeds).graph}
        trace = step_trace(stats, graphs, self.program.step.layers, self.program.placed.chosen.simulation,
                           title=f"{self.spec.name or self.spec.model.name} step {self.step + 1}")
        return write_trace(self.run.path / f"trace-{self.step + 1}.json", trace)

    def _loop_async(self, stop: Stop, metrics: MetricsLog, writer: Any,
                    t0: float) -> tuple[float, list[float], str | None, bool, dict[str, Any]]:
        return AsyncRun(self, metrics, writer, t0).run(stop)

    def _explain_non_finite(self, snapshot: tuple[dict[str, Any] | None, dict[str, Any]] | None, fetches: list[Any],
                            feeds: dict[Any, Any]) -> None:
        """The loss went NaN/Inf: put back the state from before the step, replay it with every
        output checked, and stop with the first node that produced a non-finite value (§6)."""
        if snapshot is None:
            raise NonFiniteError(f"step {self.step + 1}: the loss is not finite (resume the last checkpoint in a "
                                 f"local run to find the node that produced it)")
        values, rng = snapshot  # values None: the step's guard left every variable as it was
        if values is not None:
            self.session.load_variables(values)
        self.session.set_rng_states(rng)
        # One device replays it: the step's own where it has one, else the host (variables move to it).
        device = self.session.device if self.program.cluster is None else CPU0
        checker = fc.Session(self.session.graph, device=device, store=self.session.store, check_numerics=True)
        checker.set_rng_states(rng)
        try:
            checker.run(fetches, feeds)
        except NonFiniteError as e:
            if values is not None:
                self.session.load_variables(values)
            raise NonFiniteError(f"step {self.step + 1}: the loss is not finite; {e}", node=e.node, op=e.op,
                                 device=e.device) from None
        raise ExecutionError(f"step {self.step + 1}: the loss is not finite, but replaying the step with every "
                             f"output checked found no non-finite value")


@dataclass
class _Run:
    """One session run of a step, launched: what reading it needs, and what its loss not being
    finite would need to replay it (`_explain_non_finite`)."""

    fetches: list[Any]
    feeds: dict[Any, Any]
    snapshot: tuple[dict[str, Any] | None, dict[str, Any]] | None
    pending: Any = None  # Session.launch's Pending, or _Done
    error: Exception | None = None  # what launching it raised, raised when it is read
    seconds: float = 0.0  # the launch's time


@dataclass
class _Step:
    """One training step between its launch (Trainer._start) and its read (Trainer._finish)."""

    runs: list[tuple[Any, dict[Any, Any]]]
    lr: float
    stats: RunStats | None
    last: _Run | None = None
    losses: list[float] = field(default_factory=list)
    scale: list[Any] = field(default_factory=list)
    dt: float = 0.0


class _Done:
    """A run's values, read when it returned (a Pending that is already resolved)."""

    __slots__ = ("values",)

    def __init__(self, values: Any) -> None:
        self.values = values

    def result(self) -> Any:
        return self.values
