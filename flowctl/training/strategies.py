"""The spec's `parallelism:` section made into a training program (whitepaper §7, Figures 7-9).

`build_program(loaded)` builds the model, the optimizer and the learning-rate placeholder, then
applies the strategy's graph transform from `flowctl.engine.strategies` and opens the session:
a plain `Session` for `single` (as before this issue), a `DistributedSession` over the spec's
devices for the others. `make_sources` gives the data: one source of the global batch for the
synchronous strategies (split evenly across replicas or micro-batches), one source per replica for
`async_data_parallel`.

Devices. sync/async: replica k on `parallelism.devices[k]` (default: the first `replicas` listed
devices); the Variables, the gradient average and the update on replica 0's device (the parameter
device). model_parallel/pipeline: each group's layers on its device (an explicit assignment; it is
also what the placers will take as a constraint), gradients with their forward node, optimizer
state with its variable, everything else on the first listed device.

`strategy_benchmarks()` measures examples/s ratios for `flowctl bench` (see its docstring).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

import flowctl as fc
from flowctl.data import DataSource, InputSpec, make_source
from flowctl.engine import strategies as st
from flowctl.engine.cluster import PROFILES, Cluster, Device, DeviceProfile, gpu_profile_for
from flowctl.engine.devices import canonical, parse_device
from flowctl.engine.errors import SpecError
from flowctl.engine.optimizers import (
    SGD,
    Adam,
    Momentum,
    Optimizer,
    clip_by_global_norm,
)
from flowctl.engine.runtime import DistributedSession
from flowctl.spec.check import LoadedSpec
from flowctl.spec.model import BuiltModel, build_model

STRATEGIES = ("single", "sync_data_parallel", "async_data_parallel", "model_parallel", "pipeline")


def make_optimizer(spec: Any, lr: fc.Tensor) -> Optimizer:
    o = spec.training.optimizer
    if o.type == "sgd":
        return SGD(lr)
    if o.type == "momentum":
        return Momentum(lr, momentum=o.momentum)
    if o.type == "adam":
        return Adam(lr, beta1=o.beta1, beta2=o.beta2, epsilon=o.epsilon)
    raise SpecError(f"unknown optimizer {o.type!r}")


def gradient_process(spec: Any) -> st.GradientProcess | None:
    """The spec's clipping, applied to the combined gradients (so sync clips the big-batch gradient,
    as one replica on the whole batch would)."""
    t = spec.training
    if t.clip_value is None and t.clip_norm is None:
        return None

    def process(grads: list[fc.Tensor | None]) -> list[fc.Tensor | None]:
        if t.clip_value is not None:
            c = t.clip_value
            grads = [None if g is None else fc.maximum(fc.minimum(g, c), -c) for g in grads]
        if t.clip_norm is not None:
            grads, _ = clip_by_global_norm(grads, t.clip_norm)
        return grads

    return process


def local_cluster(devices: Sequence[str]) -> Cluster:
    """This process's devices named by the spec: CPUs split the machine's cores evenly (as
    `Cluster.local`), GPUs as the driver describes them (a K40 where it describes none). Remote
    jobs need the Ray engine, which is not here yet."""
    names = list(dict.fromkeys(canonical(d) for d in devices))
    cpus = [d for d in names if parse_device(d).type == "cpu"]
    per = max(1, (os.cpu_count() or 1) // max(1, len(cpus)))
    core = PROFILES["cpu_core"]
    out = []
    for name in names:
        d = parse_device(name)
        if (d.job, d.task) != ("localhost", 0):
            raise SpecError(f"device {name} is not in this process: strategies run on /job:localhost/task:0 "
                            f"devices until the Ray engine lands")
        if d.type == "cpu":
            prof = DeviceProfile(f"cpu_x{per}", "cpu", core.peak_flops * per, core.mem_bandwidth, core.memory,
                                 core.op_overhead)
            out.append(Device(name, prof, threads=per))
        else:
            out.append(Device(name, gpu_profile_for(name)))
    return Cluster(out)


@dataclass
class Program:
    """Everything a trainer runs: the transformed graph, its session and where its nodes are."""

    strategy: str
    model: BuiltModel
    optimizer: Optimizer
    lr: fc.Tensor
    init: fc.Tensor
    session: fc.Session
    devices: list[str]  # the devices the strategy uses (replicas, or groups and the default)
    batch: int  # examples one step (sync kinds) or one replica's update (async) consumes
    step: st.TrainStep | None = None  # single, sync_data_parallel, model_parallel, pipeline
    async_step: st.AsyncStep | None = None
    cluster: Cluster | None = None
    placement: dict[str, str] | None = None

    @property
    def graph(self) -> fc.Graph:
        return self.model.graph

    @property
    def replicas(self) -> int:
        return len(self.async_step.losses) if self.async_step is not None else 1

    def describe(self) -> str:
        short = [d.rsplit("device:", 1)[-1] for d in self.devices]
        if self.strategy == "single":
            return "single device"
        if self.strategy in ("sync_data_parallel", "async_data_parallel"):
            return f"{self.strategy}, {len(short)} replicas on {', '.join(short)}"
        if self.strategy == "pipeline":
            assert self.step is not None
            return f"pipeline, {len(self.step.inputs)} micro-batches over {', '.join(short)}"
        return f"model_parallel over {', '.join(short)}"

    def close(self) -> None:
        if isinstance(self.session, DistributedSession):
            self.session.close()


def replica_devices(loaded: LoadedSpec) -> list[str]:
    spec = loaded.spec
    par = spec.parallelism
    if par.devices is not None:
        return [canonical(d) for d in par.devices]
    listed = [d.name for d in spec.devices]
    if len(listed) < par.replicas:
        raise SpecError(f"{par.strategy} with {par.replicas} replicas needs {par.replicas} devices, but the spec "
                        f"lists {len(listed)} ({', '.join(listed)}); list more under `devices:` or set "
                        f"parallelism.devices")
    return listed[:par.replicas]


def forward(loaded: LoadedSpec) -> tuple[BuiltModel, fc.Tensor, Optimizer, fc.Tensor]:
    """The built model, a learning-rate placeholder, the spec's optimizer and the mean loss: what
    every strategy (and the planner) starts from."""
    if loaded.loss is None:
        raise SpecError("the spec names no loss layer (model.loss), so there is nothing to train")
    model = build_model(loaded, training=True)
    assert model.loss is not None
    with model.graph.as_default():
        lr = fc.placeholder(model.loss.dtype, (), name="learning_rate")
        loss = model.loss if model.loss.shape == () else fc.reduce_mean(model.loss, name="mean_loss")
    return model, lr, make_optimizer(loaded.spec, lr), loss


def build_program(loaded: LoadedSpec) -> Program:
    """The model, optimizer and training step for the spec's strategy, with an open session."""
    spec = loaded.spec
    strategy = spec.parallelism.strategy
    model, lr, opt, loss = forward(loaded)
    g = model.graph
    with g.as_default():
        args = (g, loss, model.inputs, model.trainable_variables(), opt)
        kw: dict[str, Any] = {"updates": list(model.updates), "process": gradient_process(spec)}
        first = canonical(spec.devices[0].name)
        step: st.TrainStep | None = None
        astep: st.AsyncStep | None = None
        if strategy == "single":
            step = st.single_step(*args, **kw)
            devices = [first]
            if len(spec.devices) > 1:  # §3.2.1: the spec's placer spreads the one step over its devices
                devices = _place_single(loaded, model, step)
        elif strategy in ("sync_data_parallel", "async_data_parallel"):
            devices = replica_devices(loaded)
            if strategy == "sync_data_parallel":
                step = st.sync_data_parallel(*args, devices, **kw)
            else:
                astep = st.async_data_parallel(*args, devices, **kw)
        elif strategy in ("model_parallel", "pipeline"):
            groups = [(grp.layers, grp.device) for grp in spec.parallelism.groups]
            assignment = st.assign_layers(model.layer_nodes, groups)
            devices = list(dict.fromkeys([canonical(d) for _, d in groups] + [first]))
            if strategy == "model_parallel":
                step = st.model_parallel(*args, assignment, first, **kw)
            else:
                k = spec.parallelism.concurrent_steps
                if loaded.global_batch % k:
                    raise SpecError(f"pipeline: the batch of {loaded.global_batch} does not split into "
                                    f"concurrent_steps {k} equal micro-batches")
                step = st.pipeline(*args, k, assignment, first, **kw)
        else:
            raise SpecError(f"unknown parallelism.strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
        init = fc.global_variables_initializer(g)
    placement = astep.placement if astep is not None else (step.placement if step is not None else None)
    cluster: Cluster | None = None
    session: fc.Session
    if placement is None:
        session = fc.Session(g, device=devices[0], store=fc.ContainerStore())  # the spec's one device
    else:
        placement = st.complete_placement(g, placement, devices[0])  # the initializer, made after the step
        cluster = local_cluster([d.name for d in spec.devices] + devices)
        session = DistributedSession(g, cluster, placement, store=fc.ContainerStore())
    batch = loaded.per_replica_batch if astep is not None else loaded.global_batch
    return Program(strategy, model, opt, lr, init, session, devices, batch, step, astep, cluster, placement)


def _place_single(loaded: LoadedSpec, model: BuiltModel, step: st.TrainStep) -> list[str]:
    """Put the spec's constraints on the nodes and run its placer; records the placement on `step`
    and returns the devices it uses."""
    from flowctl.engine.placement import StaticCostModel, place
    from flowctl.spec.cluster import cluster_for
    from flowctl.training.planning import apply_constraints, expert_rules, layer_of

    spec = loaded.spec
    if spec.placement.algorithm == "learned":
        raise SpecError("placement.algorithm 'learned' is not in this version; use single, expert, greedy, "
                        "heft, mincut or auto")
    g = model.graph
    apply_constraints(loaded, g, layer_of(g, model))
    cluster = cluster_for(spec)
    pl = place(g, cluster, StaticCostModel(cluster, batch=loaded.per_replica_batch), spec.placement.algorithm,
               targets=[step.train_op.node], rules=expert_rules(loaded) or None, layers=model.layer_of(),
               time_budget=spec.placement.time_budget_s)
    step.placement = dict(pl.assignment)
    return sorted(set(pl.assignment.values()), key=cluster.names.index)


def model_inputs(loaded: LoadedSpec) -> list[InputSpec]:
    return [InputSpec(i.name, tuple(i.output.shape[1:]), i.output.dtype, getattr(i.layer, "classes", None))
            for i in loaded.inputs()]


def make_sources(loaded: LoadedSpec, program: Program) -> list[DataSource]:
    """One source of `program.batch` examples per replica (one for the synchronous strategies).
    Replica k > 0 of async_data_parallel reads its own stream, seeded by its index: synthetic data
    draws from the generator [seed, k] (the learnable task's teacher stays the spec's), shuffled
    arrays use seed + k, and ordered arrays and text start k/N of the way into the epoch."""
    cfg = loaded.spec.data.model_dump()
    inputs = model_inputs(loaded)
    n = program.replicas
    out = []
    for k in range(n):
        c = dict(cfg)
        kind = c.get("source", "synthetic")
        if k and kind == "arrays" and c.get("shuffle", True):
            c["seed"] = int(c.get("seed", 0)) + k
        src = make_source(c, inputs, program.batch, base_dir=loaded.base_dir)
        if k and kind == "synthetic":
            src.rng = np.random.default_rng([int(c.get("seed", 0)), k])
        elif k and hasattr(src, "batches_per_epoch") and not (kind == "arrays" and c.get("shuffle", True)):
            src.position = k * int(src.batches_per_epoch) // n  # type: ignore[attr-defined]
        out.append(src)
    return out


# ---------------------------------------------------------------------------- benchmarks
CONV_SPEC = """\
version: 1
name: small_conv
model:
  layers:
    - {name: image, type: input, shape: [32, 32, 3]}
    - {name: conv_1, type: conv2d, filters: 32, kernel: 3, padding: same, activation: relu}
    - {name: pool_1, type: max_pool, pool: 2}
    - {name: conv_2, type: conv2d, filters: 64, kernel: 3, padding: same, activation: relu}
    - {name: pool_2, type: max_pool, pool: 2}
    - {name: flat, type: flatten}
    - {name: hidden, type: dense, units: 128, activation: relu}
    - {name: logits, type: dense, units: 10}
    - {name: label, type: input, shape: [], dtype: int32, classes: 10}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, label]}
training: {optimizer: {type: momentum}, learning_rate: 0.01, batch_size: 64}
"""

LSTM4_SPEC = """\
version: 1
name: lstm4
model:
  layers:
    - {name: tokens, type: input, shape: [20], dtype: int32, classes: 2000}
    - {name: embedding, type: embedding, vocab: 2000, dim: 256}
    - {name: lstm_1, type: lstm, units: 256}
    - {name: lstm_2, type: lstm, units: 256}
    - {name: lstm_3, type: lstm, units: 256}
    - {name: lstm_4, type: lstm, units: 256}
    - {name: softmax, type: dense, units: 2000}
    - {name: targets, type: input, shape: [20], dtype: int32, classes: 2000}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
training: {optimizer: {type: sgd}, learning_rate: 0.5, batch_size: 32, clip_norm: 5.0}
"""


def _with(text: str, **sections: Any) -> LoadedSpec:
    """The spec `text` with top-level sections replaced (devices, parallelism, training keys)."""
    import yaml

    from flowctl.spec.loader import load_text

    d = yaml.safe_load(text)
    for key, value in sections.items():
        if key == "training":
            d.setdefault("training", {}).update(value)
        else:
            d[key] = value
    return load_text(yaml.safe_dump(d, sort_keys=False), filename="<benchmark>")


def _measure(programs: dict[str, LoadedSpec], steps: int, progress: Callable[[str], None],
             rounds: int = 2) -> dict[str, Any]:
    """Build each program, then time them in blocks, A B A B (`rounds` blocks each): one untimed
    step, then `steps` timed ones. Blocks rather than alternating single steps because a program
    that ran BLAS on all cores leaves OpenBLAS worker threads spinning for a while, which would slow
    whichever program runs right after it; blocks repeated in turn still share the machine's
    drift. examples/s from the median step time."""
    from threadpoolctl import threadpool_limits

    built = {}
    for name, loaded in programs.items():
        p = build_program(loaded)
        p.session.run(p.init)
        built[name] = (p, make_sources(loaded, p)[0])
    times: dict[str, list[float]] = {name: [] for name in built}
    try:
        for r in range(rounds):
            for name, (p, src) in built.items():
                assert p.step is not None
                # Distributed: each device thread's BLAS gets its share of the cores (runtime.blas_limits).
                limit = max(d.threads for d in p.cluster.devices) if p.cluster is not None else None
                with threadpool_limits(limits=limit, user_api="blas"):
                    for i in range(steps + 1):
                        progress(f"{name}: round {r + 1}/{rounds}, step {i}/{steps}")
                        feeds = p.step.feeds(src.next_batch())
                        feeds[p.lr] = np.asarray(0.01, dtype=p.lr.dtype)
                        t0 = time.perf_counter()
                        p.session.run([p.step.loss, p.step.train_op], feeds)
                        if i:
                            times[name].append(time.perf_counter() - t0)
    finally:
        for p, _ in built.values():
            p.close()
    return {name: {"examples_per_s": built[name][0].batch / statistics.median(ts),
                   "step_s": statistics.median(ts), "batch": built[name][0].batch} for name, ts in times.items()}


def strategy_benchmarks(steps: int = 5, lstm_lm: str | Path | None = None,
                        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measured ratios on 2 virtual CPU devices (this machine's cores split between them, each
    device's BLAS limited to its share as the runtime prescribes; `single` keeps all the cores),
    each from one run that times the sides in turn (`_measure`) so they see the same machine load:
      sync_lstm_lm: examples/s of sync_data_parallel (2 replicas, global batch 20) over single
        (batch 20) on specs/lstm_lm.yaml;
      sync_conv: the same on a small CIFAR-sized conv net (batch 64);
      pipeline_lstm4: pipeline over model_parallel on a 4-layer LSTM (256 units, batch 32) with
        the embedding and layers 1-2 on cpu:0, layers 3-4 and the softmax on cpu:1: `ratio` with
        2 micro-batches, `ratio_4` with 4.
    `steps` timed steps per side per round, two rounds (examples/s from the median step)."""
    say = progress or (lambda m: None)
    path = Path(lstm_lm) if lstm_lm else Path(__file__).resolve().parents[2] / "specs" / "lstm_lm.yaml"
    lm = path.read_text()
    two = ["cpu:0", "cpu:1"]
    sync = {"strategy": "sync_data_parallel", "replicas": 2}
    out: dict[str, Any] = {"devices": 2, "cores": os.cpu_count(), "steps": steps}
    for key, text in (("sync_lstm_lm", lm), ("sync_conv", CONV_SPEC)):
        r = _measure({"single": _with(text, devices=two),
                      "sync_data_parallel": _with(text, devices=two, parallelism=sync)}, steps, say)
        out[key] = {**r, "ratio": r["sync_data_parallel"]["examples_per_s"] / r["single"]["examples_per_s"]}
    groups = [{"layers": ["embedding", "lstm_1", "lstm_2"], "device": "cpu:0"},
              {"layers": ["lstm_3", "lstm_4", "softmax", "loss"], "device": "cpu:1"}]

    def pipe(k: int) -> LoadedSpec:
        return _with(LSTM4_SPEC, devices=two, parallelism={"strategy": "pipeline", "groups": groups,
                                                           "concurrent_steps": k})

    r = _measure({"model_parallel": _with(LSTM4_SPEC, devices=two,
                                          parallelism={"strategy": "model_parallel", "groups": groups}),
                  "pipeline": pipe(2), "pipeline_4": pipe(4)}, steps, say)
    mp = r["model_parallel"]["examples_per_s"]
    out["pipeline_lstm4"] = {**r, "ratio": r["pipeline"]["examples_per_s"] / mp,
                             "ratio_4": r["pipeline_4"]["examples_per_s"] / mp}
    return out


__all__ = ["STRATEGIES", "Program", "build_program", "gradient_process", "local_cluster", "make_optimizer",
           "make_sources", "model_inputs", "replica_devices", "strategy_benchmarks"]
