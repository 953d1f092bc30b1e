"""One path from a spec to a placed training step (whitepaper §3.2.1, §4.3, §7).

    config = step_config(loaded)                    # the spec, read once, as plain data
    step = build_step(build_model(loaded), config)  # the strategy applied: replicas, stages, update
    placed = place_step(step, config, cluster_for(config), cost_model)   # every node on a device

`flowctl train` opens a session over `placed` (`open_program`), `flowctl place` renders it,
`flowctl bench` measures it, and a remote runtime ships its partitions. Nothing past
`step_config` reads the pydantic spec.

Placement follows the strategy. `single` leaves the choice to the placer (the spec's, or
`--algorithm`); the other strategies decide every node's device themselves (replica k on its
device, a layer group on its device, gradients with their forward node, optimizer state with its
variable), so their placement is checked and simulated but not searched. The spec's
`placement.constraints` and `colocate:` groups bind in both cases (§4.3): a strategy that breaks
one is a PlacementError naming the node.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import flowctl as fc
from flowctl.engine import strategies as st
from flowctl.engine.cluster import Cluster, Device, Link, bus_link, gpu_profile_for
from flowctl.engine.devices import canonical, parse_device, spec_name
from flowctl.engine.distributed import RaySession, task_resources, worker_cluster
from flowctl.engine.distributed.session import WorkerEvent
from flowctl.engine.errors import PlacementError, SpecError
from flowctl.engine.executor import needed_nodes
from flowctl.engine.fusion import fuse
from flowctl.engine.graph import Graph, Tensor
from flowctl.engine.mixed_precision import LossScale, LossScaleOptimizer
from flowctl.engine.optimizers import DECAY_EXCLUDE, SGD, Adam, AdamW, Momentum, Optimizer, clip_by_global_norm
from flowctl.engine.placement import ALGORITHMS, CostModel, Placement, evaluate, place, rule_matches
from flowctl.engine.placement.cost import StaticCostModel
from flowctl.engine.runtime import DistributedSession
from flowctl.engine.session import require_device
from flowctl.kernels.registry import set_fp32_products
from flowctl.spec.check import LoadedSpec
from flowctl.spec.model import BuiltModel, build_model

STRATEGIES = ("single", "sync_data_parallel", "async_data_parallel", "model_parallel", "pipeline")
DATA_PARALLEL = ("sync_data_parallel", "async_data_parallel")


# ---------------------------------------------------------------------------- the spec, read once
@dataclass(frozen=True)
class DeviceConfig:
    """A listed device and what the spec says of its hardware (None: as this machine has it)."""

    name: str
    peak_flops: float | None = None
    memory_bandwidth: float | None = None
    memory: int | None = None
    links: tuple[tuple[str, float, float], ...] = ()  # (peer, bytes/s, seconds)


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "sgd"
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    weight_decay: float = 0.01  # adamw
    decay_exclude: tuple[str, ...] = DECAY_EXCLUDE  # adamw: variables the decay leaves alone


@dataclass(frozen=True)
class ClusterConfig:
    """Where the devices live: this process (`local`), or Ray worker tasks (`ray`)."""

    type: str = "local"
    address: str | None = None
    max_failures: int = 3
    resources: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()  # task name -> Ray resources


@dataclass(frozen=True)
class StepConfig:
    """What building and placing a training step needs from a spec."""

    strategy: str
    devices: tuple[DeviceConfig, ...]
    optimizer: OptimizerConfig
    global_batch: int
    per_replica_batch: int
    replica_devices: tuple[str, ...] = ()  # data parallel: replica k on replica_devices[k]
    groups: tuple[tuple[tuple[str, ...], str], ...] = ()  # model parallel / pipeline: (layer globs, device)
    concurrent_steps: int = 1
    clip_value: float | None = None
    clip_norm: float | None = None
    algorithm: str = "greedy"
    constraints: tuple[tuple[str, str], ...] = ()  # (glob over layer or node names, device)
    colocate: tuple[tuple[str, ...], ...] = ()
    time_budget_s: float = 60.0
    compress: bool = False  # §5.5: float32 crosses devices as bfloat16
    receive: str = "asap"  # §5.2: when a Recv may start
    cluster: ClusterConfig = ClusterConfig()
    fuse: bool = False  # element-wise fusion of the finished step (engine/fusion.py)
    precision: str = "fp32"  # fp16: float16 layers on float32 variables, with dynamic loss scaling
    loss_scale: tuple[float, int] = (65536.0, 2000)  # fp16: (initial scale, growth interval)
    allow_tf32: bool = True  # a GPU's float32 products: TF32 tensor cores, else IEEE float32
    reduce: str = "parameter_device"  # sync_data_parallel: allreduce or parameter_device (resolved from auto)
    bucket_bytes: int = 25 << 20  # allreduce: the gradient buckets' size
    accumulate: int = 1  # single: micro-batches of global_batch / accumulate per step, one update

    @property
    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    def expert_rules(self) -> list[tuple[str, str]]:
        """The spec's own placement: its constraints, then its layer groups."""
        return list(self.constraints) + [(pattern, dev) for patterns, dev in self.groups for pattern in patterns]


def step_config(loaded: LoadedSpec) -> StepConfig:
    spec = loaded.spec
    par, tr, pl, o = spec.parallelism, spec.training, spec.placement, spec.training.optimizer
    devices = tuple(DeviceConfig(
        d.name, d.profile.peak_flops if d.profile else None, d.profile.memory_bandwidth if d.profile else None,
        d.profile.memory if d.profile else None,
        tuple((peer, link.bandwidth, link.latency) for peer, link in d.links.items())) for d in spec.devices)
    replicas: tuple[str, ...] = ()
    if par.strategy in DATA_PARALLEL:
        if par.devices is not None:
            replicas = tuple(canonical(d) for d in par.devices)
        elif len(devices) < par.replicas:
            raise SpecError(f"{par.strategy} with {par.replicas} replicas needs {par.replicas} devices, but the spec "
                            f"lists {len(devices)} ({', '.join(d.name for d in devices)}); list more under "
                            f"`devices:` or set parallelism.devices")
        else:
            replicas = tuple(d.name for d in devices[:par.replicas])
    return StepConfig(
        strategy=par.strategy, devices=devices,
        optimizer=OptimizerConfig(o.type, o.momentum, o.beta1, o.beta2, o.epsilon, o.weight_decay,
                                  tuple(o.decay_exclude)),
        global_batch=loaded.global_batch, per_replica_batch=loaded.per_replica_batch, replica_devices=replicas,
        groups=tuple((tuple(g.layers), canonical(g.device)) for g in par.groups),
        concurrent_steps=par.concurrent_steps, clip_value=tr.clip_value, clip_norm=tr.clip_norm,
        algorithm=pl.algorithm, constraints=tuple((c.match, c.device) for c in pl.constraints),
        colocate=tuple(tuple(group) for group in pl.colocate), time_budget_s=pl.time_budget_s,
        compress=pl.transfers.compress == "bf16", receive=pl.transfers.receive,
        cluster=ClusterConfig(spec.cluster.type, spec.cluster.address, spec.cluster.max_failures,
                              tuple((task, tuple(res.items())) for task, res in spec.cluster.resources.items())),
        fuse=tr.fuse, precision=tr.precision, loss_scale=(tr.loss_scale.initial, tr.loss_scale.growth_interval),
        allow_tf32=tr.allow_tf32, reduce=_reduce(loaded, replicas, devices),
        bucket_bytes=int(par.bucket_mb * (1 << 20)), accumulate=tr.accumulate)


_SLOTS = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


def _reduce(loaded: LoadedSpec, replicas: tuple[str, ...], devices: tuple[DeviceConfig, ...]) -> str:
    """sync_data_parallel's gradient reduction: the spec's, or for `auto` allreduce unless the
    precision is fp16 (its loss scaling is built for one update) or a replica's device declares less
    memory than the model's variables and optimizer slots need (then the parameter device, which
    holds them once)."""
    par, tr = loaded.spec.parallelism, loaded.spec.training
    if par.strategy != "sync_data_parallel":
        return "parameter_device"
    if par.reduce != "auto":
        return par.reduce
    if tr.precision == "fp16":
        return "parameter_device"
    trainable, fixed = loaded.params()
    width = 8 if loaded.spec.model.dtype == "float64" else 4
    need = (trainable * (1 + _SLOTS.get(tr.optimizer.type, 2)) + fixed) * width
    memory = {canonical(d.name): d.memory for d in devices}
    if any(memory.get(canonical(r)) is not None and need > memory[canonical(r)] for r in replicas):
        return "parameter_device"
    return "allreduce"


def cluster_for(config: StepConfig, devices: str | None = None) -> Cluster:
    """The spec's devices as an engine Cluster, or a what-if cluster from profiles (`--devices
    4xgpu:k40`), which wins. CPU devices without a profile are virtual devices of this machine that
    split its cores evenly; a GPU without one is this machine's GPU of that index as the driver
    describes it (a K40, the learned-placement paper's GPU, where there is none)."""
    if devices:
        return Cluster.from_spec(devices)
    if config.cluster.type == "ray":
        # Worker tasks on one machine split its cores like virtual CPU devices; transfers between
        # tasks cost a trip through Ray (LINKS["ray"], measured by `python -m flowctl.bench.ray`).
        n_cpu = sum(1 for d in config.devices if parse_device(d.name).type == "cpu")
        return worker_cluster(config.device_names, threads=max(1, (os.cpu_count() or 1) // max(1, n_cpu)))
    cpus = [d for d in config.devices if parse_device(d.name).type == "cpu"]
    local = Cluster.local(max(1, len(cpus)))
    local_cpu = local.devices[0].profile
    out: list[Device] = []
    links: dict[tuple[str, str], Link] = {}
    for d in config.devices:
        is_gpu = parse_device(d.name).type == "gpu"
        base = gpu_profile_for(d.name) if is_gpu else local_cpu
        custom = (d.peak_flops, d.memory_bandwidth, d.memory) != (None, None, None)
        prof = base if not custom else dataclasses.replace(
            base, name=f"{base.name}*", peak_flops=d.peak_flops or base.peak_flops,
            mem_bandwidth=d.memory_bandwidth or base.mem_bandwidth, memory=d.memory or base.memory)
        out.append(Device(d.name, prof, threads=1 if is_gpu else local.devices[0].threads))
        for peer, bandwidth, latency in d.links:
            links[(d.name, peer)] = Link(bandwidth, latency)
    any_gpu = any(d.type == "gpu" for d in out)
    default = bus_link([d.profile for d in out]) if any_gpu else local.default_link
    return Cluster(out, default_link=default, links=links)


# ---------------------------------------------------------------------------- the step
@dataclass
class Step:
    """A training step as its strategy built it: the graph, what a step fetches and feeds, and the
    devices the strategy fixed (`fixed`; None when the placer chooses)."""

    strategy: str
    model: BuiltModel
    optimizer: Optimizer
    lr: Tensor
    init: Tensor
    devices: list[str]  # the devices the strategy names (replicas, or groups then the default)
    batch: int  # examples one step (sync kinds) or one replica's update (async) consumes
    train: st.TrainStep | None = None  # single, sync_data_parallel, model_parallel, pipeline
    async_step: st.AsyncStep | None = None
    fixed: dict[str, str] | None = None
    layers: dict[str, str] = field(default_factory=dict)  # node -> layer (backward nodes: their forward's)
    loss_scale: LossScale | None = None  # fp16: the scale and skipped-step Variables and their updates
    guard: str | None = None  # the loss's CheckNumerics that every state write of the step waits for
    reduce: str = ""  # sync_data_parallel: allreduce or parameter_device

    @property
    def graph(self) -> Graph:
        return self.model.graph

    @property
    def targets(self) -> list[str]:
        """The nodes one step runs: what the simulator times."""
        if self.train is not None:  # an accumulating step's other run: the same graph but the update
            extra = [self.train.accumulate_op.node] if self.train.accumulate_op is not None else []
            return [self.train.train_op.node, *extra]
        assert self.async_step is not None
        a = self.async_step
        side = [u.node for u in a.side_updates if u is not None]
        return [t.node for t in a.losses] + [a.apply.node, a.applied.node] + side

    @property
    def replicas(self) -> int:
        return len(self.async_step.losses) if self.async_step is not None else 1

    def describe(self, devices: list[str] | None = None) -> str:
        short = [spec_name(d) for d in (devices or self.devices)]  # worker1/cpu:0, not a second cpu:0
        if self.strategy == "single":
            return "single device" if len(short) == 1 else f"single, placed over {', '.join(short)}"
        if self.strategy in DATA_PARALLEL:
            how = f" ({self.reduce})" if self.reduce else ""
            return f"{self.strategy}{how}, {len(short)} replicas on {', '.join(short)}"
        if self.strategy == "pipeline":
            assert self.train is not None
            return f"pipeline, {len(self.train.inputs)} micro-batches over {', '.join(short)}"
        return f"model_parallel over {', '.join(short)}"


def make_optimizer(config: OptimizerConfig, lr: Tensor) -> Optimizer:
    if config.type == "sgd":
        return SGD(lr)
    if config.type == "momentum":
        return Momentum(lr, momentum=config.momentum)
    if config.type == "adam":
        return Adam(lr, beta1=config.beta1, beta2=config.beta2, epsilon=config.epsilon)
    if config.type == "adamw":
        return AdamW(lr, beta1=config.beta1, beta2=config.beta2, epsilon=config.epsilon,
                     weight_decay=config.weight_decay, exclude=config.decay_exclude)
    raise SpecError(f"unknown optimizer {config.type!r}")


def gradient_process(config: StepConfig) -> st.GradientProcess | None:
    """The spec's clipping, applied to the combined gradients (so sync clips the big-batch gradient,
    as one replica on the whole batch would)."""
    clip_value, clip_norm = config.clip_value, config.clip_norm
    if clip_value is None and clip_norm is None:
        return None

    def process(grads: list[Tensor | None]) -> list[Tensor | None]:
        if clip_value is not None:
            grads = [None if g is None else fc.maximum(fc.minimum(g, clip_value), -clip_value) for g in grads]
        if clip_norm is not None:
            grads, _ = clip_by_global_norm(grads, clip_norm)
        return grads

    return process


def _kind(device: str) -> str:
    """A device name's type: gpu for gpu:0, worker1/gpu:0 or /job:.../device:gpu:0."""
    return device.rsplit("device:", 1)[-1].rsplit("/", 1)[-1].split(":")[0]


def build_step(model: BuiltModel, config: StepConfig) -> Step:
    """Extend `model`'s graph with a learning-rate placeholder, the mean loss, the optimizer and the
    strategy's step (flowctl.engine.strategies), then the spec's placement constraints."""
    if model.loss is None:
        raise SpecError("the spec names no loss layer (model.loss), so there is nothing to train")
    g = model.graph
    strategy = config.strategy
    first = config.devices[0].name
    with g.as_default():
        lr = fc.placeholder(model.loss.dtype, (), name="learning_rate")
        loss = model.loss if model.loss.shape == () else fc.reduce_mean(model.loss, name="mean_loss")
        opt = make_optimizer(config.optimizer, lr)
        if config.precision == "fp16":  # (async_data_parallel is refused by the spec check)
            # On one GPU the skipped step needs no cond (its state writes read a device flag), so
            # the step can be captured as one CUDA graph; elsewhere the cond skips it.
            one_gpu = strategy == "single" and len(config.devices) == 1 and _kind(first) == "gpu"
            opt = LossScaleOptimizer(opt, *config.loss_scale, predicated=one_gpu)
        args = (g, loss, model.inputs, model.trainable_variables(), opt)
        kw: dict[str, Any] = {"updates": list(model.updates), "process": gradient_process(config)}
        train: st.TrainStep | None = None
        astep: st.AsyncStep | None = None
        if config.accumulate > 1 and strategy != "single":
            raise SpecError(f"training.accumulate is the single strategy's, not {strategy}'s")
        if strategy == "single":
            train = st.accumulated_step(*args, config.accumulate, **kw)
            devices = [first]
        elif strategy in DATA_PARALLEL:
            devices = list(config.replica_devices)
            if strategy == "sync_data_parallel":
                train = st.sync_data_parallel(*args, devices, reduce=config.reduce, bucket_bytes=config.bucket_bytes,
                                              **kw)
            else:
                astep = st.async_data_parallel(*args, devices, **kw)
        elif strategy in ("model_parallel", "pipeline"):
            assignment = st.assign_layers(model.layer_nodes, config.groups)
            devices = list(dict.fromkeys([d for _, d in config.groups] + [first]))
            if strategy == "model_parallel":
                train = st.model_parallel(*args, assignment, first, **kw)
            else:
                k = config.concurrent_steps
                if config.global_batch % k:
                    raise SpecError(f"pipeline: the batch of {config.global_batch} does not split into "
                                    f"concurrent_steps {k} equal micro-batches")
                train = st.pipeline(*args, k, assignment, first, **kw)
        else:
            raise SpecError(f"unknown parallelism.strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
        init = fc.global_variables_initializer(g)
        # fp16's loss scaling skips a non-finite step in the graph (mixed_precision): no guard there.
        guard = guard_state(g, train) if train is not None and config.precision != "fp16" else None
    fixed = astep.placement if astep is not None else (train.placement if train is not None else None)
    if fixed is not None:
        fixed = st.complete_placement(g, fixed, devices[0])  # the initializer, made after the step
    layers = layer_of(g, model)
    apply_constraints(config, g, layers)
    batch = config.per_replica_batch if astep is not None else config.global_batch
    scaling = opt.state if isinstance(opt, LossScaleOptimizer) else None
    step = Step(strategy, model, opt, lr, init, devices, batch, train, astep, fixed, layers, scaling, guard,
                config.reduce if strategy == "sync_data_parallel" else "")
    if config.fuse:
        fuse_step(step)
    return step


def guard_state(g: Graph, train: st.TrainStep) -> str:
    """Make every state write of the step (optimizer updates and slots, batch norm's moving
    statistics) wait for a CheckNumerics of the step's loss, so a step whose loss is not finite
    stops before it changes anything: the trainer can replay it to find the first non-finite
    node without holding a copy of every variable before every step (such a copy kept the CPU's
    updates from writing in place, and on a GPU moved every variable to the host each step).
    The writes come after the loss anyway (they need its gradient, or, for the moving statistics,
    nothing that is late): the guard costs one check of a scalar and a token per device."""
    runs = [train.train_op.node] + ([train.accumulate_op.node] if train.accumulate_op is not None else [])
    writers = [n for n in needed_nodes(g, runs, set())
               if g.nodes[n].opdef.resource in ("variable_input", "variable_inputs")]
    with g.as_default(), g.absolute_scope(), g.colocate_with(train.loss):
        guard = fc.check_numerics(train.loss, message="the step's loss", name="loss_guard")
    for n in writers:
        g.nodes[n].control_inputs.append(guard.node)
    return guard.node


def step_keep(step: Step) -> set[str]:
    """The nodes a trainer fetches, feeds or names from outside: what a pass must leave in place."""
    m = step.model
    refs: list[Tensor] = [step.lr, step.init, *m.inputs.values(), *m.outputs.values(), *m.updates]
    if m.loss is not None:
        refs.append(m.loss)
    if step.loss_scale is not None:
        refs += [t for t in (step.loss_scale.new_scale, step.loss_scale.new_skipped) if t is not None]
    if step.train is not None:
        t = step.train
        refs += [t.loss, t.train_op, *(p for copy in t.inputs for p in copy.values())]
        if t.accumulate_op is not None:
            refs.append(t.accumulate_op)
    if step.async_step is not None:
        a = step.async_step
        refs += [*a.losses, *(g for gs in a.grads for g in gs), *(p for copy in a.inputs for p in copy.values()),
                 *(u for u in a.side_updates if u is not None), *a.variables, *a.grad_inputs, a.version, a.applied,
                 a.apply]
    return {t.node for t in refs if t is not None}


def fuse_step(step: Step) -> None:
    """Element-wise fusion of the finished step (after autodiff and the strategy, before placement),
    in place: the fixed placement and the layer map lose the names fusion absorbed."""
    g = step.graph
    fuse(g, step_keep(step), placement=step.fixed)
    if step.fixed is not None:
        step.fixed = {n: d for n, d in step.fixed.items() if n in g.nodes}
    step.layers = {n: layer for n, layer in step.layers.items() if n in g.nodes}


def layer_of(graph: Graph, model: BuiltModel) -> dict[str, str]:
    """node -> the layer that made it; gradient and optimizer nodes take the layer of the forward
    node they follow (so a layer's constraint covers its backward pass too)."""
    base = model.layer_of()
    out: dict[str, str] = {}
    for name, node in graph.nodes.items():
        layer = base.get(name)
        follow, seen = node.follows, 0
        while layer is None and follow and seen < 64:
            layer = base.get(follow)
            follow = graph.nodes[follow].follows if follow in graph.nodes else ""
            seen += 1
        if layer is None and node.colocate_with:  # a slot, an update: its variable's (made before it)
            layer = base.get(node.colocate_with[0]) or out.get(node.colocate_with[0])
        if layer is None and node.attrs.get("mirror_of"):  # an all-reduce replica's copy of a variable
            layer = base.get(node.attrs["mirror_of"]) or out.get(node.attrs["mirror_of"])
        if layer is not None:
            out[name] = layer
    return out


def apply_constraints(config: StepConfig, graph: Graph, layers: dict[str, str]) -> None:
    """§4.3: the spec's `placement.constraints` become each matching node's device constraint and
    its `colocate:` groups colocation constraints -- binding on every placer, not hints."""
    for node in graph.nodes.values():
        layer = layers.get(node.name)
        for pattern, device in config.constraints:
            if rule_matches(pattern, node.name, layer):
                node.device = device
    for group in config.colocate:
        members = [n for n in graph.nodes.values()
                   if any(rule_matches(pattern, n.name, layers.get(n.name)) for pattern in group)]
        if len(members) > 1:
            anchor = next((m for m in members if m.op == "Variable"), members[0])
            for m in members:
                if m is not anchor and anchor.name not in m.colocate_with:
                    m.colocate_with.append(anchor.name)


# ---------------------------------------------------------------------------- placement
@dataclass
class PlacedStep:
    """A step with every node on a device of `cluster`, and the placements it was compared with
    (algorithm -> placement, or why that placer could not place it)."""

    step: Step
    cluster: Cluster
    cost: CostModel
    chosen: Placement
    compared: dict[str, Placement | str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def assignment(self) -> dict[str, str]:
        """node -> device for every node of the graph (the initializer's too)."""
        return st.complete_placement(self.step.graph, self.chosen.assignment, self.step.devices[0])

    def devices_used(self) -> list[str]:
        used = set(self.assignment.values())
        return [d for d in self.cluster.names if d in used]

    def layer_of(self) -> dict[str, str]:
        """node -> layer for every node, the optimizer's and other unlayered nodes under one name."""
        return {n: self.step.layers.get(n, "(optimizer and other)") for n in self.step.graph.nodes}

    def loops(self) -> list[dict[str, Any]]:
        """Each while loop of the step (§4.4) as placement sees it: its nodes (a nested loop's
        included), the devices they run on, the trip count the cost model assumes (the stated
        estimate; 0: unknown, costed as one iteration) and the modelled time of all iterations."""
        from flowctl.engine.frames import ROOT, assign_frames, has_control_flow

        graph = self.step.graph
        if not has_control_flow(graph.nodes.values()):
            return []
        frames = assign_frames(graph)
        reports = {r.name: r for r in self.chosen.node_reports()}
        out: dict[str, dict[str, Any]] = {}
        for name, frame in frames.exec_frame.items():
            while frame != ROOT:  # a node counts toward its loop and every loop around it
                a = out.setdefault(frame, {"loop": frame, "parent": frames.parent.get(frame, ROOT),
                                           "iterations": frames.expected.get(frame, 0), "nodes": 0,
                                           "devices": {}, "time": 0.0})
                a["nodes"] += 1
                r = reports.get(name)
                if r is not None:
                    a["devices"][r.device] = a["devices"].get(r.device, 0) + 1
                    a["time"] += r.time or 0.0
                frame = frames.parent.get(frame, ROOT)
        return sorted(out.values(), key=lambda a: a["loop"])


def place_step(step: Step, config: StepConfig, cluster: Cluster, cost: CostModel, algorithm: str | None = None,
               compare: tuple[str, ...] = (), time_budget: float | None = None, learned: Any = None) -> PlacedStep:
    """Place `step` on `cluster` with `algorithm` (default: the spec's) and simulate it; `compare`
    places it with other algorithms too, for `flowctl place`. A strategy that fixes every node is
    checked and simulated as it is: there is nothing for a placer to choose. `learned`: the learned
    placer's options (flowctl.engine.placement.learned.LearnedOptions: budget, seed, checkpoint)."""
    started = time.perf_counter()
    algorithm = algorithm or config.algorithm
    if algorithm not in ALGORITHMS:
        place(step.graph, cluster, cost, algorithm)  # raises the one PlacementError, with a did-you-mean
    g, targets = step.graph, step.targets
    if step.fixed is not None:
        missing = sorted({d for d in step.fixed.values()} - set(cluster.names))
        if missing:
            raise PlacementError(f"the {step.strategy} strategy puts nodes on {', '.join(missing)}, which the "
                                 f"cluster does not have (devices: {', '.join(cluster.names)})")
        chosen = evaluate(g, step.fixed, cluster, cost, targets=targets, algorithm=step.strategy)
        chosen.notes.append(f"{step.strategy} decides every node's device (its replicas or layer groups); "
                            f"placers have nothing left to choose")
        return PlacedStep(step, cluster, cost, chosen.check(), seconds=time.perf_counter() - started)
    rules = config.expert_rules()
    budget = config.time_budget_s if time_budget is None else time_budget

    def run(alg: str) -> Placement:
        if len(cluster.devices) == 1:
            alg = "single"  # one device: every placer gives the same answer
        return place(g, cluster, cost, alg, targets=targets, rules=rules or None, layers=step.model.layer_of(),
                     time_budget=budget, learned=learned)

    out = PlacedStep(step, cluster, cost, run(algorithm))
    for alg in compare:
        if alg == algorithm or alg not in ALGORITHMS:
            continue
        if alg == "expert" and not rules:
            out.compared[alg] = "no rules in the spec (placement.constraints or parallelism.groups)"
            continue
        try:
            out.compared[alg] = run(alg)
        except PlacementError as e:
            out.compared[alg] = str(e)
    out.seconds = time.perf_counter() - started
    return out


def plan(loaded: LoadedSpec, algorithm: str | None = None, devices: str | None = None,
         compare: tuple[str, ...] = ("single", "expert"), batch: int | None = None,
         cost: CostModel | None = None, time_budget: float | None = None, learned: Any = None) -> PlacedStep:
    """Where a spec's training step would run, and how fast (`flowctl place`): built, placed on the
    spec's devices (or `devices`, a what-if cluster) and compared with other placers."""
    config = step_config(loaded)
    cluster = cluster_for(config, devices)
    step = build_step(build_model(loaded, training=True, devices=len(cluster.devices)), config)
    cost = cost or StaticCostModel(cluster, batch=batch or config.per_replica_batch)
    if learned is not None and learned.reward == "measured" and learned.measure is None:
        from flowctl.training.measure import StepMeter

        if (algorithm or config.algorithm) != "learned":
            raise PlacementError("a measured reward is the learned placer's; use --algorithm learned")
        learned = dataclasses.replace(learned, measure=StepMeter(step, loaded, cluster))
    return place_step(step, config, cluster, cost, algorithm, compare, time_budget, learned)


def step_memory(loaded: LoadedSpec) -> dict[str, Any]:
    """What one training step holds with everything on the spec's first device, by the placement
    simulator (the figure `place` shows per device): the peak, and the resident part of it --
    parameters, optimizer slots, fed inputs -- the rest being activations kept for the backward
    pass, gradients and temporaries alive at the peak -- and of the resident part, the optimizer's
    slots (the state only the updates name: CostTable.referenced). `flowctl inspect` reports it."""
    config = step_config(loaded)
    step = build_step(build_model(loaded, training=True), config)
    cluster = cluster_for(config)
    dev = cluster.names[0]
    for n in step.graph.nodes.values():  # one device: the spec's device constraints do not apply
        n.device = ""
    pl = evaluate(step.graph, {n: dev for n in step.graph.nodes}, cluster,
                  StaticCostModel(cluster, batch=config.per_replica_batch), targets=step.targets)
    s = pl.simulation.device(dev)
    t = pl.table
    slots = sum(sum(t.out_bytes[i]) for i in t.referenced) if t is not None else 0
    return {"device": dev, "step_peak_bytes": s.peak_memory, "step_resident_bytes": s.resident,
            "step_slot_bytes": slots}


# ---------------------------------------------------------------------------- what a trainer runs
@dataclass
class Program:
    """A placed step with an open session: what the trainer runs."""

    step: Step
    placed: PlacedStep
    session: fc.Session
    config: StepConfig
    fp32_products: str | None = None  # on a GPU: "tf32" or "ieee" (`apply_fp32_products`); None on CPUs

    @property
    def strategy(self) -> str:
        return self.step.strategy

    @property
    def cluster(self) -> Cluster | None:
        """The devices of a multi-device session in this process (None for one device's Session,
        and for Ray workers, which set their own threads)."""
        return self.placed.cluster if isinstance(self.session, DistributedSession) else None

    @property
    def remote(self) -> bool:
        return isinstance(self.session, RaySession)

    @property
    def placement(self) -> dict[str, str] | None:
        return self.placed.assignment if isinstance(self.session, (DistributedSession, RaySession)) else None

    @property
    def devices(self) -> list[str]:
        return self.step.devices if self.step.fixed is not None else self.placed.devices_used()

    def describe(self) -> str:
        return self.step.describe(self.devices)

    def close(self) -> None:
        if isinstance(self.session, (DistributedSession, RaySession)):
            self.session.close()


def place_for_training(loaded: LoadedSpec, config: StepConfig | None = None) -> PlacedStep:
    """Everything `flowctl train` does before it opens a session: build the step and place it with
    the spec's placer over a static cost model on this process's devices. `flowctl validate` runs
    it too, so a spec it passes is one `train` starts. `config`: the spec's, when already read."""
    config = config or step_config(loaded)
    step = build_step(build_model(loaded, training=True), config)
    cluster = cluster_for(config)
    placed = place_step(step, config, cluster, StaticCostModel(cluster, batch=config.per_replica_batch))
    if config.cluster.type == "ray":
        return placed  # worker tasks: their devices are checked where they start
    for d in placed.devices_used():
        dev = parse_device(d)
        if (dev.job, dev.task) != ("localhost", 0):
            raise PlacementError(f"device {d} is not in this process: a local run trains on /job:localhost/task:0 "
                                 f"devices (cluster.type ray runs other tasks)")
        require_device(d)
    return placed


def open_program(loaded: LoadedSpec, on_worker: WorkerEvent | None = None, ray_log: Path | None = None) -> Program:
    """Build, place and open a session: one device's `Session`, a `DistributedSession` with a
    thread per device and Send/Recv between them, or for `cluster.type: ray` a `RaySession` with a
    worker actor per task (`on_worker(task, state, detail)` hears each worker start; Ray's own
    text goes to `ray_log`, when given, not to the terminal)."""
    config = step_config(loaded)
    placed = place_for_training(loaded, config)
    step, cluster = placed.step, placed.cluster
    durations = {n: placed.chosen.simulation.finish[n] - placed.chosen.simulation.start[n]
                 for n in placed.chosen.simulation.start} if config.receive == "alap" else None
    transfers: dict[str, Any] = {"compress": config.compress, "recv_schedule": config.receive, "durations": durations}
    session: fc.Session
    on_gpu = any(parse_device(d).type == "gpu" for d in placed.devices_used())
    fp32 = apply_fp32_products(config) if on_gpu else None  # before the session makes any handle
    if config.cluster.type == "ray":
        resources = task_resources({task: dict(res) for task, res in config.cluster.resources})
        session = RaySession(step.graph, cluster, placed.assignment, store=fc.ContainerStore(),
                             address=config.cluster.address, resources=resources, on_worker=on_worker, log=ray_log,
                             **transfers)
    elif step.fixed is None and len(cluster.devices) == 1:
        session = fc.Session(step.graph, device=cluster.names[0], store=fc.ContainerStore())
    else:
        session = DistributedSession(step.graph, cluster, placed.assignment, store=fc.ContainerStore(), **transfers)
    return Program(step, placed, session, config, fp32)


def apply_fp32_products(config: StepConfig) -> str:
    """Make this process's float32 products on a GPU what the spec says (`training.allow_tf32`):
    "tf32" (TF32 tensor cores, 10 mantissa bits in the inputs, float32 accumulation: as cuDNN's
    convolutions and `flowctl bench peers` on both sides) or "ieee" (full float32). It sets
    flowctl's own cuBLAS products (`set_fp32_products`) and cupy's: CUPY_TF32, which cupy reads the
    first time it needs a float32 product's compute type, and that compute type itself where cupy
    has already settled it (its private `set_compute_type`; skipped where that is missing).
    Process-wide: the last program opened on a GPU decides. Ray workers are other processes and
    keep their own (the default, TF32). Returns the mode."""
    mode = "tf32" if config.allow_tf32 else "ieee"
    os.environ["CUPY_TF32"] = "1" if config.allow_tf32 else "0"
    set_fp32_products(mode)
    if "cupy" in sys.modules:
        try:
            from cupy._core import _routines_linalg as linalg  # type: ignore[import-not-found]

            linalg.set_compute_type("float32", getattr(linalg, "COMPUTE_TYPE_TF32", 7) if config.allow_tf32
                                    else getattr(linalg, "COMPUTE_TYPE_DEFAULT", 1))
        except Exception:  # noqa: BLE001 -- a private API of cupy's: CUPY_TF32 above still holds for a fresh one
            pass
    return mode


__all__ = ["DATA_PARALLEL", "STRATEGIES", "ClusterConfig", "DeviceConfig", "OptimizerConfig", "PlacedStep", "Program", "Step",
           "StepConfig", "apply_constraints", "apply_fp32_products", "build_step", "cluster_for", "fuse_step",
           "gradient_process", "layer_of", "make_optimizer", "open_program", "place_for_training", "place_step", "plan",
           "step_config", "step_keep", "step_memory"]
