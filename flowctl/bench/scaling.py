"""`flowctl bench scaling`: data-parallel training past this machine, on paper (issue 33).

Weak scaling: each of N workers keeps the spec's batch, so a step of N workers trains N x batch
examples. One worker's step is the simulator's (placement/simulator.py over the StaticCostModel
roofline of one device profile: seconds even for Inception-v3), read as a `StepProfile`: the
forward pass F, the backward pass B, the update U, and, for each variable, its gradient's bytes
and the time into the backward pass at which it is made. The two schemes add their transfers:

- `parameter_device` (whitepaper Figure 7, top): the variables live on one parameter device,
  which is also worker 0's (so N-1 workers use its link). Each step every other worker pulls all
  P bytes of parameters before it can start (one message per variable), and pushes each gradient
  back as soon as its backward pass makes it; the pushes of all N-1 workers queue on the
  parameter device's link, which carries 2(N-1)P bytes per step.
- `allreduce` (ring): every worker holds a replica. Gradients are grouped in the order the
  backward pass makes them into buckets of about 25 MiB; a bucket is ring-all-reduced (reduce-
  scatter, then all-gather: 2(N-1) messages of 1/N of the bucket per worker) as soon as its last
  gradient is made, on the worker's link, while the rest of the backward pass runs.

Either way the update runs once every gradient has arrived, and a step of N > 1 workers may pay a
fixed overhead (the distributed runtime's calls), which only a measurement can tell.

`calibrate` fits what the simulation cannot know from this machine's measured points (lstm_lm, one
process and 2 Ray workers per scheme, each at one thread; the file CALIBRATION, format in
`read_measured`): the CPU's real speed, the per-step overhead of the distributed runtime and the
effective rate of each scheme's transport between Ray workers. Those rows are this machine's; the
big table (one GPU per worker, 10 and 100 Gb/s links) takes nothing from them: its transports and
runtime are not the ones measured here. Without the file the output says "uncalibrated".

A model is one entry of MODELS (lstm_lm, Inception-v3, GPT-2 small).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flowctl.engine.cluster import LINKS, Cluster, Link
from flowctl.engine.dtypes import itemsize
from flowctl.engine.errors import FlowctlError
from flowctl.engine.graph import Graph, Node, parse_ref
from flowctl.engine.placement import StaticCostModel, step_nodes
from flowctl.spec.check import LoadedSpec
from flowctl.spec.loader import load_spec
from flowctl.spec.model import build_model
from flowctl.training.program import build_step, place_step, step_config

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "benchmarks" / "results" / "dataparallel-cpu.json"
MiB = 1 << 20
BUCKET_BYTES = 25 * MiB  # PyTorch DDP's default bucket cap (bucket_cap_mb=25)
WORKERS = (1, 2, 4, 8, 16, 32, 64)
SCHEME_NAMES = ("parameter_device", "allreduce")
TABLE_LINKS = ("ethernet10g", "ethernet100g")
GPU = "gpu:h100"  # one GPU per worker in the big table
CPU = "cpu"  # this machine's CPU worker at one thread: the calibration rows


@dataclass(frozen=True)
class ScalingModel:
    name: str
    spec: Path


# One line per model of the table.
MODELS = (
    ScalingModel("lstm_lm", ROOT / "specs" / "lstm_lm.yaml"),
    ScalingModel("inception_v3", ROOT / "specs" / "inception_v3.yaml"),
    ScalingModel("transformer_lm", ROOT / "specs" / "transformer_lm.yaml"),
)
CALIBRATION_MODEL = "lstm_lm"


# ---------------------------------------------------------------------------- one worker's step
@dataclass(frozen=True)
class Gradient:
    variable: str
    nbytes: int
    made_s: float  # seconds into the backward pass when the backward makes it


@dataclass(frozen=True)
class StepProfile:
    """One worker's step on one device: F, B, U and the gradients in the order they are made."""

    model: str
    device: str
    batch: int
    forward_s: float
    backward_s: float
    update_s: float
    gradients: tuple[Gradient, ...]

    @property
    def compute_s(self) -> float:
        """F + B + U: the one-worker step."""
        return self.forward_s + self.backward_s + self.update_s

    @property
    def param_bytes(self) -> int:
        """P: the bytes of every variable that gets a gradient (a gradient has its variable's bytes)."""
        return sum(g.nbytes for g in self.gradients)

    def scaled(self, k: float) -> "StepProfile":
        """Every compute time times k (a device k times slower), the bytes as they are."""
        return dataclasses.replace(
            self, forward_s=self.forward_s * k, backward_s=self.backward_s * k, update_s=self.update_s * k,
            gradients=tuple(dataclasses.replace(g, made_s=g.made_s * k) for g in self.gradients))


def one_worker(device: str) -> Cluster:
    """One worker's device: `cpu` is this machine's CPU at one thread (a virtual device of one
    core: the roofline of `cpu_core`), anything else a profile as `--devices` reads it (gpu:h100)."""
    cluster = Cluster.local(1, threads=1) if device == CPU else Cluster.from_spec(device)
    if len(cluster.devices) != 1:
        raise FlowctlError(f"a scaling worker is one device; '{device}' names {len(cluster.devices)}")
    return cluster


def _is_backward(name: str) -> bool:
    return name.startswith("gradients/") or "/gradients/" in name  # autodiff's scope (replica_k/gradients/)


def raw_gradients(graph: Graph, update: Node, shape: Sequence[int | None]) -> list[str]:
    """The nodes autodiff made for the gradient that `update` (a state write of a variable of
    `shape`) applies: its data inputs under a `gradients/` scope, reached through whatever sits
    between them and the update with the variable's shape (clipping's product by the scale, loss
    scaling's unscale, casts). The scale itself (a scalar) is not followed: it depends on every
    gradient."""
    found: list[str] = []
    seen: set[str] = set()
    frontier = [r for k, r in enumerate(update.inputs) if k not in update.opdef.ref_inputs]
    while frontier:
        src = parse_ref(frontier.pop())[0]
        if src in seen:
            continue
        seen.add(src)
        node = graph.nodes[src]
        if _is_backward(src):
            found.append(src)
        elif node.outputs and tuple(node.outputs[0].shape) == tuple(shape):
            frontier += [r for k, r in enumerate(node.inputs) if k not in node.opdef.ref_inputs]
    return found


def step_profile(loaded: LoadedSpec, device: str, name: str | None = None) -> StepProfile:
    """The spec's single-device training step on `device` (`one_worker`), simulated with the static
    cost model, as a StepProfile. On one device the simulator runs one op at a time, so the step
    is the sum of its nodes' costs, split three ways: the forward pass (what the loss needs), the
    backward pass (what the variables' gradients need beyond that), and the update (the rest:
    clipping, the optimizer, side updates). A gradient is made when the last of its autodiff
    nodes finishes in the simulated schedule; its `made_s` counts backward nodes only."""
    config = dataclasses.replace(step_config(loaded), strategy="single")
    step = build_step(build_model(loaded, training=True), config)
    assert step.train is not None
    cluster = one_worker(device)
    chosen = place_step(step, config, cluster, StaticCostModel(cluster, batch=step.batch), "single").chosen
    table, sim, g = chosen.table, chosen.simulation, step.graph
    assert table is not None
    cost = {n: row[0] for n, row in zip(table.names, table.times)}
    forward = set(step_nodes(g, [step.train.loss.node]))
    variables = {v.node: v for v in step.model.trainable_variables()}
    made_by: dict[str, list[str]] = {}
    for i, j in enumerate(table.writes):
        var = table.names[j] if j >= 0 else None
        if var in variables:
            found = raw_gradients(g, g.nodes[table.names[i]], variables[var].shape)
            if not found:
                raise FlowctlError(f"scaling: no gradient found for '{var}' behind its update "
                                   f"'{table.names[i]}' (no input under a gradients/ scope)")
            made_by.setdefault(var, []).extend(found)
    backward = set(step_nodes(g, [n for ns in made_by.values() for n in ns])) - forward
    clock, at = 0.0, {}
    for n in sorted(cost, key=lambda n: (sim.finish.get(n, 0.0), table.index[n])):
        if n in backward:
            clock += cost[n]
            at[n] = clock
    grads = []
    for var, nodes in made_by.items():
        v = variables[var]
        nbytes = int(np.prod([d or 0 for d in v.shape], dtype=np.int64)) * itemsize(v.dtype)
        grads.append(Gradient(var, nbytes, max(at[n] for n in nodes)))
    grads.sort(key=lambda gr: gr.made_s)
    f = sum(c for n, c in cost.items() if n in forward)
    b = sum(c for n, c in cost.items() if n in backward)
    u = sum(cost.values()) - f - b
    return StepProfile(name or loaded.spec.name or "model", cluster.devices[0].profile.name, step.batch,
                       f, b, u, tuple(grads))


# ---------------------------------------------------------------------------- the step of N workers
@dataclass(frozen=True)
class Bucket:
    nbytes: int
    ready_s: float  # into the backward pass: when its last gradient is made
    gradients: int


def buckets(gradients: Sequence[Gradient], cap: int = BUCKET_BYTES) -> list[Bucket]:
    """Consecutive gradients in the order made, a bucket closed once it holds `cap` bytes or more
    (a gradient bigger than `cap` closes its bucket alone); ready when its last gradient is made."""
    out: list[Bucket] = []
    size, count, ready = 0, 0, 0.0
    for g in sorted(gradients, key=lambda g: g.made_s):
        size, count, ready = size + g.nbytes, count + 1, g.made_s
        if size >= cap:
            out.append(Bucket(size, ready, count))
            size, count = 0, 0
    if count:
        out.append(Bucket(size, ready, count))
    return out


def ring_bytes_per_worker(nbytes: float, n: int) -> float:
    """Bytes each worker sends (and receives) to ring-all-reduce `nbytes`: N-1 reduce-scatter
    steps and N-1 all-gather steps of nbytes/N each, 2(N-1)/N x nbytes."""
    return 2 * (n - 1) / n * nbytes


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds to ring-all-reduce `nbytes` over N workers, each with its own full-duplex `link`:
    2(N-1) steps, each one message of nbytes/N, 2(N-1) latency + 2(N-1)/N nbytes / bandwidth.
    Zero for one worker."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.latency + ring_bytes_per_worker(nbytes, n) / link.bandwidth


def link_done(jobs: Iterable[tuple[float, float]], free: float = 0.0) -> float:
    """When a FIFO link finishes `jobs`, (ready, seconds) in order: each starts at max(its ready
    time, when the link is free), as the simulator queues transfers on a link."""
    for ready, seconds in jobs:
        free = max(free, ready) + seconds
    return free


def allreduce_step_s(p: StepProfile, n: int, link: Link, overhead_s: float = 0.0,
                     bucket_bytes: int = BUCKET_BYTES) -> float:
    """One step of N workers, gradients ring-all-reduced in buckets while the backward runs:
    with bucket k ready at F + r_k and reduced in ring_k = ring_allreduce_s(b_k),
        reduced = link_done((F + r_k, ring_k) for each bucket k)
        step    = max(F + B, reduced) + U (+ overhead for N > 1).
    N = 1: F + B + U, the single step."""
    if n <= 1:
        return p.compute_s
    reduced = link_done((p.forward_s + b.ready_s, ring_allreduce_s(b.nbytes, n, link))
                        for b in buckets(p.gradients, bucket_bytes))
    return max(p.forward_s + p.backward_s, reduced) + p.update_s + overhead_s


def parameter_device_step_s(p: StepProfile, n: int, link: Link, overhead_s: float = 0.0,
                            bucket_bytes: int = BUCKET_BYTES) -> float:
    """One step of N workers around a parameter device that is also worker 0's (Figure 7, top),
    its link shared by the N-1 others, V variables of P bytes in all:
        pull   = (N-1) (V latency + P / bandwidth)        the parameters out, before the step
        pushed = link_done((pull + F + m_i, (N-1) (latency + p_i / bandwidth)) for each gradient i)
        step   = max(pull + F + B, pushed) + U (+ overhead for N > 1),
    gradient i (p_i bytes) made m_i into the backward pass. Pulls and pushes go opposite ways on
    a full-duplex link. `bucket_bytes` is unused (one message per gradient). N = 1: F + B + U."""
    if n <= 1:
        return p.compute_s
    others = n - 1
    pull = others * (len(p.gradients) * link.latency + p.param_bytes / link.bandwidth)
    start = pull + p.forward_s
    pushed = link_done((start + g.made_s, others * (link.latency + g.nbytes / link.bandwidth)) for g in p.gradients)
    return max(start + p.backward_s, pushed) + p.update_s + overhead_s


SCHEMES: dict[str, Callable[..., float]] = {
    "parameter_device": parameter_device_step_s,
    "allreduce": allreduce_step_s,
}


def examples_per_s(p: StepProfile, n: int, step_s: float) -> float:
    """Weak scaling: N workers train N x batch examples per step."""
    return n * p.batch / step_s


# ---------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class Measured:
    """This machine's measured points (examples/s, each process at `threads` threads)."""

    model: str
    batch: int
    threads: int
    one_process: float
    two_workers: dict[str, float]  # scheme -> examples/s of 2 Ray workers
    links: dict[str, Link]  # scheme -> its transport's link between two workers, where measured
    source: str


def read_measured(path: Path) -> Measured | None:
    """The measured points in `path`, None where it does not exist. The file (JSON):

        {"model": "lstm_lm", "batch": 20, "threads": 1,
         "one_process": {"examples_per_s": 60.1},
         "two_workers": {"parameter_device": {"examples_per_s": 35.2},
                         "allreduce": {"examples_per_s": 110.4}},
         "links": {"parameter_device": {"bandwidth_Bps": 7.5e8, "latency_s": 1.2e-3},
                   "allreduce": {"bandwidth_Bps": 6.1e9, "latency_s": 0.4e-3}}}

    `batch` is each process's (the spec's batch_size), `threads` each process's intra-op and BLAS
    threads. Either scheme of `two_workers` may be missing; `links` is optional: each scheme's
    transport between the two workers as measured (64 MiB and 4-byte crossings, as
    `python -m flowctl.bench.ray` measures Send/Recv). Other keys (medians, intervals, the commit,
    the date) are kept in the file and ignored here."""
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        two_d, links_d = d.get("two_workers", {}), d.get("links", {})
        unknown = sorted((set(two_d) | set(links_d)) - set(SCHEME_NAMES))
        m = Measured(str(d["model"]), int(d["batch"]), int(d["threads"]), float(d["one_process"]["examples_per_s"]),
                     {s: float(two_d[s]["examples_per_s"]) for s in SCHEME_NAMES if s in two_d},
                     {s: Link(float(links_d[s]["bandwidth_Bps"]), float(links_d[s]["latency_s"]))
                      for s in SCHEME_NAMES if s in links_d}, str(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise FlowctlError(f"{path}: cannot read the measured scaling points ({what}); the format is in "
                           f"flowctl/bench/scaling.py read_measured") from None
    if unknown:
        raise FlowctlError(f"{path}: unknown scheme(s) {', '.join(unknown)} (known: {', '.join(SCHEME_NAMES)})")
    if m.model != CALIBRATION_MODEL:
        raise FlowctlError(f"{path}: the calibration points are {CALIBRATION_MODEL}'s, not '{m.model}'")
    if min([m.one_process, m.batch, *m.two_workers.values(), *(k.bandwidth for k in m.links.values())]) <= 0:
        raise FlowctlError(f"{path}: examples/s, the batch and link bandwidths must be positive")
    return m


@dataclass(frozen=True)
class Calibration:
    """What the measurements fixed: the compute's scale (measured one-process step over the
    simulated one), the per-step overhead of N > 1 workers and each scheme's link."""

    compute_scale: float
    overhead_s: float
    links: dict[str, Link]  # scheme -> link
    fitted: tuple[str, ...]  # what came from a fit: "overhead", "<scheme> link"


LOG_BW = (6.0, 12.0)  # a fitted link's bandwidth lies between 1 MB/s and 1 TB/s


def solve_bandwidth(p: StepProfile, scheme: str, step_s: float, latency: float, overhead_s: float = 0.0) -> float:
    """The bandwidth at which `scheme`'s 2-worker step (at `latency`, with `overhead_s`) takes
    `step_s`, by bisection on its logarithm (the step falls as the bandwidth grows), clipped to
    LOG_BW: the slowest link where even it is too fast, the fastest where the compute alone is
    already slower than measured."""
    lo, hi = LOG_BW

    def step(log_bw: float) -> float:
        return SCHEMES[scheme](p, 2, Link(10 ** log_bw, latency), overhead_s)

    if step(hi) >= step_s:
        return 10 ** hi
    if step(lo) <= step_s:
        return 10 ** lo
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) > step_s else (lo, mid)
    return 10 ** ((lo + hi) / 2)


def calibrate(p: StepProfile, measured: Measured,
              latency: float = LINKS["ray"].latency) -> tuple[StepProfile, Calibration]:
    """The profile scaled to the measured one-process step (batch / examples/s); then, from the
    2-worker steps (2 x batch / examples/s):
      - the per-step overhead: the mean residual (none below zero) of the schemes whose link was
        measured, the model at that link against the measured step; 0 where no link was;
      - each scheme's link where it was not measured: the bandwidth (at `latency`) at which the
        model with that overhead meets the measured step (`solve_bandwidth`);
      - a scheme with no 2-worker point takes the other's link, else LINKS["ray"].
    The two schemes may move bytes by different transports (the parameter device's Send/Recv
    through Ray's calls, the all-reduce through the object store), hence a link each."""
    scale = (measured.batch / measured.one_process) / p.compute_s
    scaled = p.scaled(scale)
    step = {s: 2 * measured.batch / eps for s, eps in measured.two_workers.items()}
    known = {s: k for s, k in measured.links.items() if s in step}
    residuals = [step[s] - SCHEMES[s](scaled, 2, k) for s, k in known.items()]
    overhead = max(0.0, sum(residuals) / len(residuals)) if residuals else 0.0
    links, fitted = dict(measured.links), ["overhead"] if residuals else []
    for s in step:
        if s not in links:
            links[s] = Link(solve_bandwidth(scaled, s, step[s], latency, overhead), latency)
            fitted.append(f"{s} link")
    for s in SCHEME_NAMES:
        if s not in links:
            links[s] = next(iter(links.values()), LINKS["ray"])
    return scaled, Calibration(scale, overhead, links, tuple(fitted))


# ---------------------------------------------------------------------------- the suite
def _gbit(link: Link) -> float:
    return link.bandwidth * 8 / 1e9


def table_rows(p: StepProfile, link_name: str, links: dict[str, Link], workers: Sequence[int] = WORKERS,
               overhead_s: float = 0.0, bucket_bytes: int = BUCKET_BYTES) -> list[dict[str, Any]]:
    """One row per (scheme, N) over each scheme's link: step seconds, examples/s, speed-up over
    one worker, efficiency (speed-up / N)."""
    rows = []
    for scheme, fn in SCHEMES.items():
        one = examples_per_s(p, 1, fn(p, 1, links[scheme], overhead_s, bucket_bytes))
        for n in workers:
            t = fn(p, n, links[scheme], overhead_s, bucket_bytes)
            eps = examples_per_s(p, n, t)
            rows.append({"model": p.model, "device": p.device, "link": link_name, "scheme": scheme, "workers": n,
                         "step_s": t, "examples_per_s": eps, "speedup": eps / one, "efficiency": eps / one / n})
    return rows


def _describe(p: StepProfile, bucket_bytes: int) -> dict[str, Any]:
    return {"device": p.device, "batch": p.batch, "forward_s": p.forward_s, "backward_s": p.backward_s,
            "update_s": p.update_s, "variables": len(p.gradients), "param_bytes": p.param_bytes,
            "buckets": len(buckets(p.gradients, bucket_bytes))}


def _load(model: ScalingModel, batch: int | None = None) -> LoadedSpec:
    if not model.spec.exists():
        raise FlowctlError(f"scaling: {model.name}'s spec {model.spec} does not exist")
    return load_spec(str(model.spec), (f"training.batch_size={batch}",) if batch else ())


def select_models(rows: str | None) -> list[ScalingModel]:
    """MODELS, or those named in `rows` (comma-separated)."""
    if not rows:
        return list(MODELS)
    known = {m.name: m for m in MODELS}
    picked = [r.strip() for r in rows.split(",") if r.strip()]
    bad = [r for r in picked if r not in known]
    if bad:
        raise FlowctlError(f"no scaling model {', '.join(bad)} (known: {', '.join(known)})")
    return [known[r] for r in picked]


def calibration_report(measured_path: Path, bucket_bytes: int = BUCKET_BYTES) -> dict[str, Any]:
    """lstm_lm on this machine's CPU worker at one thread over Ray: the 1- and 2-worker points
    predicted (calibrated where `measured_path` exists) beside the measured ones, and the same
    workers out to 64, predicted."""
    measured = read_measured(measured_path)
    model = next(m for m in MODELS if m.name == CALIBRATION_MODEL)
    p = step_profile(_load(model, measured.batch if measured else None), CPU, model.name)
    out: dict[str, Any] = {"file": str(measured_path), "model": model.name, "simulated": _describe(p, bucket_bytes)}
    if measured is None:
        out.update(status="uncalibrated", overhead_s=0.0, fitted=[])
        scaled, links, over = p, {s: LINKS["ray"] for s in SCHEME_NAMES}, 0.0
    else:
        scaled, cal = calibrate(p, measured)
        links, over = cal.links, cal.overhead_s
        out.update(status="calibrated", threads=measured.threads, compute_scale=cal.compute_scale,
                   overhead_s=over, fitted=list(cal.fitted), calibrated=_describe(scaled, bucket_bytes))
    out["links"] = {s: {"bandwidth_Bps": k.bandwidth, "latency_s": k.latency} for s, k in links.items()}
    points = []
    for scheme, fn in SCHEMES.items():
        for n in (1, 2):
            pred = examples_per_s(scaled, n, fn(scaled, n, links[scheme], over, bucket_bytes))
            meas = None if measured is None else measured.one_process if n == 1 else measured.two_workers.get(scheme)
            points.append({"scheme": scheme, "workers": n, "predicted_examples_per_s": pred,
                           "measured_examples_per_s": meas, "ratio": None if meas is None else pred / meas})
    out["points"] = points
    out["rows"] = table_rows(scaled, "ray", links, overhead_s=over, bucket_bytes=bucket_bytes)
    return out


def scaling_suite(models: Sequence[ScalingModel] = MODELS, device: str = GPU, calibration: Path = CALIBRATION,
                  links: Sequence[str] = TABLE_LINKS, workers: Sequence[int] = WORKERS,
                  bucket_bytes: int = BUCKET_BYTES, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The simulated table (each model on `device` per worker, each link, both schemes, each N)
    and the calibration rows (calibration_report)."""
    say = progress or (lambda _m: None)
    rows: list[dict[str, Any]] = []
    profiles = {}
    for m in models:
        say(f"{m.name}: simulating one worker's step on {device}")
        p = step_profile(_load(m), device, m.name)
        profiles[m.name] = _describe(p, bucket_bytes)
        for name in links:
            rows += table_rows(p, name, {s: LINKS[name] for s in SCHEME_NAMES}, workers, 0.0, bucket_bytes)
    say("calibration rows: lstm_lm on this machine's CPU worker")
    return {"suite": "scaling", "weak_scaling": True, "device": device, "bucket_mib": bucket_bytes / MiB,
            "workers": list(workers),
            "links": {n: {"bandwidth_Bps": LINKS[n].bandwidth, "gbit_s": _gbit(LINKS[n]),
                          "latency_s": LINKS[n].latency} for n in links},
            "models": profiles, "rows": rows, "calibration": calibration_report(calibration, bucket_bytes)}


__all__ = ["BUCKET_BYTES", "CALIBRATION", "MODELS", "SCHEMES", "Bucket", "Calibration", "Gradient", "Measured",
           "ScalingModel", "StepProfile", "allreduce_step_s", "buckets", "calibrate", "calibration_report",
           "examples_per_s", "link_done", "one_worker", "parameter_device_step_s", "raw_gradients", "read_measured",
           "ring_allreduce_s", "ring_bytes_per_worker", "scaling_suite", "select_models", "solve_bandwidth",
           "step_profile", "table_rows"]
