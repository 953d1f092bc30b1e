"""The training loop (whitepaper §3.3): steps, metrics, checkpoints every N steps or seconds, on
Ctrl-C and at the end, and an exact resume.

Exactness: a checkpoint holds every Variable (optimizer slots and batch-norm statistics are
Variables), every random op's generator state, the data cursor and the step; the learning rate is
a function of the step. So k steps + resume + (N - k) steps equals N steps straight, bit for bit.
"""
from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import numpy as np

import flowctl as fc
from flowctl.data import InputSpec, make_source
from flowctl.engine import checkpoint as ckpt
from flowctl.engine.errors import ExecutionError, NonFiniteError, SpecError
from flowctl.engine.optimizers import SGD, Adam, Momentum, Optimizer, clip_by_global_norm
from flowctl.spec.check import LoadedSpec
from flowctl.spec.model import BuiltModel, build_model
from flowctl.training.rundir import RunDir, resolved, spec_hash
from flowctl.training.schedule import learning_rate

EXIT_INTERRUPTED = 130  # Ctrl-C: a checkpoint was written, `flowctl resume` continues


@dataclass
class StepEvent:
    step: int  # steps completed
    total: int
    loss: float
    lr: float
    examples_per_s: float
    elapsed: float


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

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Interrupt:
    """First Ctrl-C: finish the step, checkpoint, stop. Second: stop at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> "Interrupt":
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: Ctrl-C stays Python's default
            self._previous = None
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def make_optimizer(spec: Any, lr: fc.Tensor) -> Optimizer:
    o = spec.training.optimizer
    if o.type == "sgd":
        return SGD(lr)
    if o.type == "momentum":
        return Momentum(lr, momentum=o.momentum)
    if o.type == "adam":
        return Adam(lr, beta1=o.beta1, beta2=o.beta2, epsilon=o.epsilon)
    raise SpecError(f"unknown optimizer {o.type!r}")


class Trainer:
    def __init__(self, loaded: LoadedSpec, run_dir: Path, steps: int | None = None,
                 on_step: Callable[[StepEvent], None] | None = None,
                 on_warning: Callable[[str], None] | None = None, histograms_every: int = 0,
                 allow_spec_change: bool = False) -> None:
        spec = loaded.spec
        if spec.parallelism.strategy != "single":
            raise SpecError(f"parallelism.strategy '{spec.parallelism.strategy}' cannot be trained by this "
                            f"version yet; use strategy: single")
        if loaded.loss is None:
            raise SpecError("the spec names no loss layer (model.loss), so there is nothing to train")
        self.loaded = loaded
        self.spec = spec
        self.run = RunDir(run_dir)
        self.total_steps = spec.training.steps if steps is None else steps
        self.on_step = on_step or (lambda e: None)
        self.on_warning = on_warning or (lambda m: None)
        self.histograms_every = histograms_every
        self.allow_spec_change = allow_spec_change
        self.resolved = resolved(spec)
        self.hash = spec_hash(self.resolved)
        self.batch = loaded.per_replica_batch
        self._build()

    # ------------------------------------------------------------------ graph and session
    def _build(self) -> None:
        self.model: BuiltModel = build_model(self.loaded, training=True)
        g = self.model.graph
        spec = self.spec
        assert self.model.loss is not None
        with g.as_default():
            self.lr = fc.placeholder(self.model.loss.dtype, (), name="learning_rate")
            opt = self.optimizer = make_optimizer(spec, self.lr)
            loss = self.model.loss
            if loss.shape != ():
                loss = fc.reduce_mean(loss, name="mean_loss")
            self.loss = loss
            gv = opt.compute_gradients(loss, self.model.trainable_variables())
            grads = [g_ for g_, _ in gv]
            if spec.training.clip_value is not None:
                c = spec.training.clip_value
                grads = [None if g_ is None else fc.maximum(fc.minimum(g_, c), -c) for g_ in grads]
            if spec.training.clip_norm is not None:
                grads, self.grad_norm = clip_by_global_norm(grads, spec.training.clip_norm)
            apply = opt.apply_gradients(list(zip(grads, [v for _, v in gv])))
            self.train_op = fc.group([apply] + list(self.model.updates), name="train_step")
            self.init = fc.global_variables_initializer(g)
        self.session = fc.Session(g, store=fc.ContainerStore())
        self.inputs = [InputSpec(i.name, tuple(i.output.shape[1:]), i.output.dtype, getattr(i.layer, "classes", None))
                       for i in self.loaded.inputs()]
        data_cfg = spec.data.model_dump()
        self.data = make_source(data_cfg, self.inputs, self.batch, base_dir=self.loaded.base_dir)
        self.placeholders = {name: self.model.inputs[name] for name in self.model.inputs}
        ck = spec.checkpoint
        self.ckpt_every_steps = ck.every_steps if ck else None
        self.ckpt_every_seconds = ck.every_seconds if ck else None
        self.manager = ckpt.CheckpointManager(self.run.checkpoints, keep=ck.keep if ck else 3,
                                              spec_hash=self.hash, on_warning=self.on_warning)
        self.step = 0

    # ------------------------------------------------------------------ state
    def start_fresh(self, spec_text: str, spec_path: str) -> None:
        self.session.run(self.init)
        self.step = 0
        self.run.path.mkdir(parents=True, exist_ok=True)
        self.run.write_text("spec.yaml", spec_text)
        self.run.write_json("spec.resolved.json", {"sha256": self.hash, "spec": self.resolved})
        self.run.write_json("devices.json", [d if isinstance(d, str) else d.model_dump(mode="json")
                                             for d in self.spec.devices])
        self.run.write_text("graph.json", self.model.graph.to_json())
        self.run.write_info({"status": "running", "spec_path": spec_path, "step": 0, "flowctl": fc.__version__,
                             "spec_sha256": self.hash})
        self.run.truncate_metrics(-1)

    def restore(self) -> str:
        """Load the newest valid checkpoint; returns its path."""
        c = self.manager.restore_latest(allow_spec_change=self.allow_spec_change)
        for w in c.warnings:
            self.on_warning(w)
        ckpt.apply(self.session, c.tensors, c.state, origin=c.path)
        self.data.restore(c.state["data"])
        self.step = int(c.state["step"])
        self.run.truncate_metrics(self.step)
        info = self.run.read_info()
        info.update(status="running", step=self.step)
        self.run.write_info(info)
        return str(c.path)

    def save(self) -> str:
        tensors, state = ckpt.capture(self.session, self.optimizer)
        state.update(step=self.step, data=self.data.state(), lr=learning_rate(self.spec.training.learning_rate,
                                                                                self.step))
        path = self.manager.save(self.step, tensors, state)
        return str(path)

    # ------------------------------------------------------------------ the loop
    def train(self) -> Summary:
        from flowctl.training.events import EventWriter

        first = self.step
        t0 = time.perf_counter()
        last_save = t0
        last_path: str | None = None
        loss_v = float("nan")
        rates: list[float] = []
        writer = EventWriter(self.run.events, purge_step=first + 1, histograms_every=self.histograms_every)
        interrupted = False
        fetches = [self.loss, self.train_op]
        try:
            with Interrupt() as stop, open(self.run.metrics, "a") as metrics:
                while self.step < self.total_steps:
                    if stop.requested:
                        interrupted = True
                        break
                    batch = self.data.next_batch()
                    feeds: dict[Any, Any] = {self.placeholders[k]: v for k, v in batch.items()}
                    lr = learning_rate(self.spec.training.learning_rate, self.step)
                    feeds[self.lr] = np.asarray(lr, dtype=self.lr.dtype)
                    snapshot = self.session.variable_values(), self.session.rng_states()
                    ts = time.perf_counter()
                    loss_arr, _ = self.session.run(fetches, feeds)
                    dt = time.perf_counter() - ts
                    loss_v = float(loss_arr)
                    if not math.isfinite(loss_v):
                        self._explain_non_finite(snapshot, fetches, feeds)
                    self.step += 1
                    eps = self.batch / dt if dt > 0 else float("inf")
                    rates.append(eps)
                    metrics.write(f'{{"step": {self.step}, "loss": {loss_v!r}, "lr": {lr!r}, '
                                  f'"examples_per_s": {eps:.1f}, "time": {time.time():.3f}}}\n')
                    writer.scalars(self.step, {"loss": loss_v, "learning_rate": lr, "examples_per_s": eps})
                    if self.histograms_every and self.step % self.histograms_every == 0:
                        writer.histograms(self.step, self.session.variable_values())
                    self.on_step(StepEvent(self.step, self.total_steps, loss_v, lr, eps, time.perf_counter() - t0))
                    now = time.perf_counter()
                    due = (self.ckpt_every_steps and self.step % self.ckpt_every_steps == 0) or \
                          (self.ckpt_every_seconds and now - last_save >= self.ckpt_every_seconds)
                    if due and self.step < self.total_steps:
                        metrics.flush()
                        last_path = self.save()
                        last_save = now
                metrics.flush()
            if self.step > first or interrupted or last_path is None:
                last_path = self.save()
        finally:
            writer.close()
        info = self.run.read_info()
        info.update(status="interrupted" if interrupted else "finished", step=self.step)
        self.run.write_info(info)
        elapsed = time.perf_counter() - t0
        return Summary(str(self.run.path), first, self.step, self.step - first, loss_v,
                       float(np.mean(rates)) if rates else 0.0, elapsed, last_path, interrupted)

    def _explain_non_finite(self, snapshot: tuple[dict[str, Any], dict[str, Any]], fetches: list[Any],
                            feeds: dict[Any, Any]) -> None:
        """The loss went NaN/Inf: put back the state from before the step, replay it with every
        output checked, and stop with the first node that produced a non-finite value (§6)."""
        values, rng = snapshot
        self.session.load_variables(values)
        self.session.set_rng_states(rng)
        checker = fc.Session(self.session.graph, store=self.session.store, check_numerics=True)
        checker.set_rng_states(rng)
        try:
            checker.run(fetches, feeds)
        except NonFiniteError as e:
            self.session.load_variables(values)
            raise NonFiniteError(f"step {self.step + 1}: the loss is not finite; {e}", node=e.node, op=e.op,
                                 device=e.device) from None
        raise ExecutionError(f"step {self.step + 1}: the loss is not finite, but replaying the step with every "
                             f"output checked found no non-finite value")
