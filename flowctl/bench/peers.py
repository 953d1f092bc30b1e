"""`flowctl bench peers`: seconds per training (or inference) step, flowctl beside PyTorch, in one
sitting.

Each row builds a spec's model twice, as flowctl runs it (the `single` strategy's step: forward,
gradients, the spec's clipping and optimizer update, batch-norm moving averages) and as a PyTorch
twin read off the same spec (flowctl.bench.torch_twin: same shapes, same parameter count), feeds
both the same synthetic batch, and times them in rounds that take turns (the order flips each
round, so the machine's drift and the other's cache footprint fall on both alike). The learning
rate is 0 on both sides: every update runs, and the weights stay put.

On the CPU each framework runs in a process of its own (spawned, driven over a pipe, one at a time:
`_Apart`). In one process the two share malloc's heap, and what one leaves there decides where the
other's large buffers come from: measured on Inception-v3 at batch 32 (2 threads, AMD EPYC), after
PyTorch's steps flowctl's 124-177 MB buffers no longer fitted in the heap's free space and came
from fresh mappings, ~2,000-3,000 huge-page faults and 0.6-1.2 s of system time a step that
flowctl alone does not have (16 faults), while PyTorch took flowctl's malloc settings
(engine/allocator.py) that it does not ship with. PyTorch's process gets those settings too by
default (`peer_malloc="flowctl"`: the same allocator policy on both sides, so what differs is the
frameworks); `peer_malloc="stock"` runs it as shipped, glibc's defaults (at batch 32 ~1 million
page faults a step). `in_process=True` is the old one-process sitting; a GPU row is always one
process (its captures and device memory are read there).

Figures per row: each framework's median step with a 95% bootstrap interval, and the ratio
flowctl / PyTorch of the medians with its own bootstrap interval (< 1: flowctl is faster).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from flowctl.engine.errors import FlowctlError
from flowctl.spec.model import build_model
from flowctl.training.program import build_step, step_config

SPECS = Path(__file__).resolve().parents[2] / "specs"
INSTALL = 'pip install -e ".[peers]"'


class PeersUnavailable(FlowctlError):
    """PyTorch is not installed, so there is no peer to measure against."""

    exit_code = 2


@dataclass(frozen=True)
class Row:
    """One line of the table: a spec (a file name under specs/, a path, or YAML text) run at
    `batch` for a training step (`train`) or a forward pass in inference mode."""

    name: str
    spec: str
    batch: int
    train: bool = True


ROWS: dict[str, Row] = {r.name: r for r in (
    Row("lstm_lm", "lstm_lm.yaml", 20),
    Row("inception_v3_b8", "inception_v3.yaml", 8),
    Row("inception_v3_b32", "inception_v3.yaml", 32),
    Row("inception_v3_infer_b8", "inception_v3.yaml", 8, train=False),
    Row("transformer_small", "transformer_small.yaml", 16),
)}
DEFAULT_ROWS = ("lstm_lm", "inception_v3_b8", "inception_v3_infer_b8")


def import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise PeersUnavailable(f"flowctl bench peers measures against PyTorch, which is not installed; "
                               f"install it with: {INSTALL}") from None
    return torch


PRECISIONS = ("fp32", "fp16", "bf16")


def _load(row: Row, overrides: Sequence[str] = ()) -> Any:
    from flowctl.spec import load_spec, load_text

    if "\n" in row.spec:
        return load_text(row.spec, f"<{row.name}>", overrides=overrides)
    path = Path(row.spec)
    return load_spec(path if path.exists() else SPECS / path, overrides)


def _batch(loaded: Any, batch: int) -> dict[str, np.ndarray]:
    from flowctl.data import InputSpec, make_source

    inputs = [InputSpec(i.name, tuple(i.output.shape[1:]), i.output.dtype, getattr(i.layer, "classes", None))
              for i in loaded.inputs()]
    return make_source(loaded.spec.data.model_dump(), inputs, batch, base_dir=loaded.base_dir).next_batch()


def _logits(loaded: Any) -> str:
    if loaded.loss is None:
        raise FlowctlError("bench peers: the spec names no loss layer, so its output layer is unknown")
    return loaded.layers[loaded.loss].inputs[0]


class FlowctlStep:
    """One flowctl step on fixed arrays, callable; `profile` says where a step's time goes."""

    def __init__(self, session: Any, fetch: Any, feeds: dict[Any, Any], reference: bool = False) -> None:
        self.session, self.fetch, self.feeds, self.reference = session, fetch, feeds, reference

    def __call__(self) -> Any:
        if self.reference:  # the plan is bound at the first run: its kernels are the reference ones
            from flowctl.kernels.registry import reference_kernels

            with reference_kernels():
                return self.session.run(self.fetch, self.feeds)
        return self.session.run(self.fetch, self.feeds)

    def profile(self, steps: int = 2) -> dict[str, Any]:
        """Milliseconds per step by op type, from the executor's own start and finish times (the
        dataflow executor records them; the straight-line one that the timed steps use does not,
        and costs ~0.5 us less per node)."""
        import flowctl as fc

        # the plan's nodes: its CPU passes make nodes the graph lacks (FusedConv2D, PackPanels)
        ops = {node.name: node.op for node in self.session.plan_for(self.fetch, self.feeds).nodes}
        before = self.session.executor
        self.session.executor = "dataflow"
        by_op: dict[str, list[float]] = {}
        wall = 0.0
        try:
            for _ in range(steps):
                stats = fc.RunStats()
                self.session.run(self.fetch, self.feeds, stats=stats)
                wall += stats.wall_s
                for name, t0, t1 in stats.runs():
                    entry = by_op.setdefault(ops[name], [0.0, 0])
                    entry[0] += t1 - t0
                    entry[1] += 1
        finally:
            self.session.executor = before
        return _ranked({op: (t / steps, n // steps) for op, (t, n) in by_op.items()}, wall / steps)


def _ranked(table: dict[str, tuple[float, int]], step_s: float, top: int = 12) -> dict[str, Any]:
    ops = sorted(table.items(), key=lambda kv: -kv[1][0])
    rest = sum(t for _, (t, _n) in ops[top:])
    out = [{"op": op, "ms": t * 1e3, "calls": n} for op, (t, n) in ops[:top]]
    if rest:
        out.append({"op": f"{len(ops) - top} other ops", "ms": rest * 1e3, "calls": 0})
    return {"step_ms": step_s * 1e3, "ops": out}


def flowctl_step(loaded: Any, arrays: dict[str, np.ndarray], train: bool, device: str = "cpu:0",
                 capture: bool | None = None, reference: bool = False) -> FlowctlStep:
    """A callable that runs one flowctl step on `arrays`, every node on `device`. A step fetches
    its loss (or logits) to the host, so it has finished on a GPU when the call returns. On a GPU
    its steps are captured as one CUDA graph unless `capture` is False."""
    import flowctl as fc
    from flowctl.engine.container import ContainerStore

    if train:
        step = build_step(build_model(loaded, training=True), step_config(loaded))
        assert step.train is not None
        model, fetch = step.model, [step.train.loss, step.train.train_op]
        feeds: dict[Any, Any] = {step.lr: np.asarray(0.0, dtype=step.lr.dtype)}
    else:
        model = build_model(loaded, training=False)
        fetch, feeds = [model.outputs[_logits(loaded)]], {}
    feeds.update({model.inputs[k]: v for k, v in arrays.items() if k in model.inputs})
    session = fc.Session(model.graph, device=device, store=ContainerStore(), capture=capture)
    session.run(model.initializer())
    return FlowctlStep(session, fetch, feeds, reference)


def torch_profile(torch: Any, step: Callable[[], Any], steps: int = 2, gpu: bool = False) -> dict[str, Any]:
    """Milliseconds per step by ATen op (self time: an op's children counted once, where they run;
    `gpu`: the time its kernels took on the device)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) / steps

    def self_us(e: Any) -> float:
        if not gpu:
            return float(e.self_cpu_time_total)
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0))

    table = {e.key: (self_us(e) / 1e6 / steps, e.count // steps) for e in prof.key_averages() if self_us(e) > 0}
    return _ranked(table, wall)


def torch_step(loaded: Any, arrays: dict[str, np.ndarray], train: bool,
               device: str = "cpu:0", precision: str = "fp32",
               captured: bool = False) -> tuple[Callable[[], Any], int]:
    """A callable that runs one step of the PyTorch twin on the same arrays (on `device`: a step
    on a GPU ends with a synchronize, so it has finished when the call returns, as flowctl's), and
    the twin's parameter count. `precision` bf16/fp16: the step under autocast to that type.
    `captured` (a GPU): the whole step captured as one CUDA graph after three warm-up steps on a
    side stream (torch.cuda.graph), each call a replay -- PyTorch's own best on the card."""
    torch = import_torch()
    from flowctl.bench.torch_twin import Twin, torch_feeds

    where = torch_device(device)
    twin = Twin(loaded).to(where)
    if any(len(i.output.shape) == 4 for i in loaded.layers.values()):
        twin = twin.to(memory_format=torch.channels_last)
    feeds = {k: v.to(where) for k, v in torch_feeds(loaded, arrays).items()}
    count = twin.param_count()
    run, count = _torch_run(torch, loaded, twin, feeds, count, train)
    if precision != "fp32":
        plain, kind = run, ("cuda" if where.startswith("cuda") else "cpu")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16

        def run() -> Any:
            with torch.autocast(device_type=kind, dtype=dtype):
                return plain()
    if captured and where.startswith("cuda"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()

        def replay() -> Any:
            graph.replay()
            torch.cuda.synchronize()
            return out
        return replay, count
    if where.startswith("cuda"):
        def synced() -> Any:
            out = run()
            torch.cuda.synchronize()
            return out
        return synced, count
    return run, count


def torch_device(device: str) -> str:
    """PyTorch's name for a flowctl device: cpu:0 -> cpu, gpu:N -> cuda:N."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return "cpu"
    if kind == "gpu" and (index or "0").isdigit():
        return f"cuda:{index or 0}"
    raise FlowctlError(f"bench peers: cannot run on device '{device}'; write cpu:0 or gpu:N")


def _torch_run(torch: Any, loaded: Any, twin: Any, feeds: dict[str, Any], count: int,
               train: bool) -> tuple[Callable[[], Any], int]:
    from flowctl.bench.torch_twin import TwinError

    if not train:
        twin.eval()
        out = _logits(loaded)

        def infer() -> Any:
            with torch.inference_mode():
                return twin(feeds, upto=out)[out]
        return infer, count
    t = loaded.spec.training
    params = [p for p in twin.parameters() if p.requires_grad]
    o = t.optimizer
    if o.type == "sgd":
        opt: Any = torch.optim.SGD(params, lr=0.0)
    elif o.type == "momentum":
        opt = torch.optim.SGD(params, lr=0.0, momentum=o.momentum)
    elif o.type == "adam":
        opt = torch.optim.Adam(params, lr=0.0, betas=(o.beta1, o.beta2), eps=o.epsilon)
    elif o.type == "adamw":  # a timing twin: every parameter decays (the exclusions change no cost)
        opt = torch.optim.AdamW(params, lr=0.0, betas=(o.beta1, o.beta2), eps=o.epsilon, weight_decay=o.weight_decay)
    else:
        raise TwinError(f"optimizer {o.type} has no PyTorch twin here")
    twin.train()
    loss_name = loaded.loss

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        loss = twin(feeds)[loss_name]
        loss.backward()
        if t.clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, t.clip_value)
        if t.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, t.clip_norm)
        opt.step()
        return loss
    return step, count


def _boot_median(samples: np.ndarray, rng: np.random.Generator, n: int = 2000) -> np.ndarray:
    idx = rng.integers(0, len(samples), size=(n, len(samples)))
    return np.median(samples[idx], axis=1)


def summarize(f: list[float], t: list[float], seed: int = 0) -> dict[str, Any]:
    """Medians with 95% bootstrap intervals, and the ratio flowctl / PyTorch of the medians (and of
    the fastest steps)."""
    rng = np.random.default_rng(seed)
    fa, ta = np.asarray(f), np.asarray(t)
    bf, bt = _boot_median(fa, rng), _boot_median(ta, rng)
    ratio = bf / bt

    def figure(a: np.ndarray, boot: np.ndarray) -> dict[str, Any]:
        # The fastest step too: on a shared machine, the one least disturbed by others.
        return {"median_s": float(np.median(a)), "ci95_s": [float(np.percentile(boot, 2.5)),
                                                            float(np.percentile(boot, 97.5))],
                "min_s": float(a.min()), "samples": len(a)}

    return {"flowctl": figure(fa, bf), "pytorch": figure(ta, bt),
            "ratio": float(np.median(fa) / np.median(ta)), "ratio_of_fastest": float(fa.min() / ta.min()),
            "ratio_ci95": [float(np.percentile(ratio, 2.5)), float(np.percentile(ratio, 97.5))]}


def paired_ratios(f: list[float], t: list[float], rounds: int) -> dict[str, Any]:
    """Round by round: each round's flowctl / PyTorch ratio of medians (the two blocks of a round run
    back to back), and their median. Their spread is the sitting's own: the bootstrap interval of
    the pooled medians treats every step as independent, which a shared host whose speed moves by a
    fifth between minutes is not. `rounds` blocks of equal length in each list."""
    fa, ta = np.asarray(f).reshape(rounds, -1), np.asarray(t).reshape(rounds, -1)
    per = [float(np.median(a) / np.median(b)) for a, b in zip(fa, ta)]
    return {"round_ratios": per, "ratio_paired": float(np.median(per))}


def blas_peak(torch: Any, n: int = 2048, repeat: int = 5) -> dict[str, float]:
    """GFLOP/s of an n x n float32 product through numpy and through PyTorch (best of `repeat`)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    ta = torch.from_numpy(a)
    out = {}
    for name, fn in (("numpy", lambda: a @ a), ("pytorch", lambda: ta @ ta)):
        fn()
        best = min(_timed(fn) for _ in range(repeat))
        out[name] = 2.0 * n ** 3 / best / 1e9
    return out


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _status_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in KiB (0 where /proc is missing).
    VmHWM is the peak of this address space: unlike ru_maxrss it does not carry over the peak of
    the parent a spawned process was forked from."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _peak_in_child(row: Row, framework: str, threads: int, device: str = "cpu:0") -> dict[str, float]:
    """Run in a fresh process: resident memory after building `framework`'s step for `row`, and
    the peak over three steps of it, in MiB; on a GPU, `gpu_peak_mib` too: PyTorch's peak
    allocation, or what cupy's memory pool holds after the steps (it keeps what it once held)."""
    torch = import_torch()
    torch.set_num_threads(threads)
    loaded = _load(row)
    arrays = _batch(loaded, row.batch)
    t0 = time.perf_counter()
    run = flowctl_step(loaded, arrays, row.train, device) if framework == "flowctl" else \
        torch_step(loaded, arrays, row.train, device)[0]
    built = _status_kib("VmRSS")
    run()
    first = time.perf_counter() - t0
    for _ in range(2):
        run()
    peak = _status_kib("VmHWM")
    out = {"built_mib": built / 1024, "peak_mib": peak / 1024, "step_mib": (peak - built) / 1024,
           "first_step_s": first}
    if device.startswith("gpu"):
        if framework == "pytorch":
            out["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        else:
            import cupy

            out["gpu_peak_mib"] = cupy.get_default_memory_pool().total_bytes() / 2**20
    return out


def peak_memory(row: Row, threads: int, device: str = "cpu:0") -> dict[str, dict[str, float]]:
    """Each framework's resident memory for `row`, each measured alone in a fresh process (one
    process's peak cannot be split between two frameworks that share its heap). flowctl's child
    runs twice over one new numba cache folder: its first step (building the step included) with
    an empty JIT cache, then with the cache the first left (`jit`); the second gives the memory."""
    import multiprocessing
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    out: dict[str, dict[str, float]] = {}
    for framework in ("flowctl", "pytorch"):
        if framework != "flowctl":
            with ctx.Pool(1) as pool:
                out[framework] = pool.apply(_peak_in_child, (row, framework, threads, device))
            continue
        saved = os.environ.get("NUMBA_CACHE_DIR")
        with tempfile.TemporaryDirectory(prefix="flowctl-jit-") as cache:
            os.environ["NUMBA_CACHE_DIR"] = cache  # a spawned child reads it before numba loads
            try:
                firsts = []
                for _ in range(2):
                    with ctx.Pool(1) as pool:
                        out[framework] = pool.apply(_peak_in_child, (row, framework, threads, device))
                    firsts.append(out[framework]["first_step_s"])
            finally:
                if saved is None:
                    os.environ.pop("NUMBA_CACHE_DIR", None)
                else:
                    os.environ["NUMBA_CACHE_DIR"] = saved
        out["jit"] = {"first_step_s_empty_cache": firsts[0], "first_step_s_warm_cache": firsts[1]}
    return out


PEER_MALLOC = ("flowctl", "stock")


def _spec_sets(overrides: Sequence[str], precision: str) -> tuple[str, ...]:
    """The `--set` changes a row's spec is loaded with: the user's, then the precision's."""
    return tuple(overrides) + ((f"training.precision={precision}",) if precision != "fp32" else ())


def _build_runner(row: Row, framework: str, device: str, precision: str, overrides: Sequence[str]) -> tuple[Any, int]:
    """`framework`'s step for `row` ("flowctl", "flowctl_reference" or "pytorch") and its parameter
    count, built as `run_row` builds them."""
    sets = _spec_sets(overrides, precision)
    loaded = _load(row, sets)
    arrays = _batch(loaded, row.batch)
    if framework == "pytorch":
        return torch_step(loaded, arrays, row.train, device, precision)
    if framework not in ("flowctl", "flowctl_reference"):
        raise FlowctlError(f"no runner named '{framework}'")
    return flowctl_step(loaded, arrays, row.train, device, reference=framework == "flowctl_reference"), \
        sum(loaded.params())


def _serve(conn: Any, row: Row, framework: str, threads: int, precision: str, overrides: Sequence[str],
           malloc: str) -> None:
    """A spawned process's life under `_Apart`: build one framework's step, warm it up, then run
    what the pipe asks -- ("steps", n): one untimed step and n timed ones, their seconds;
    ("profile",): where a step goes by op; ("stop",). Errors go back as ("error", message)."""
    try:
        from threadpoolctl import threadpool_limits

        if framework == "pytorch":
            torch = import_torch()
            torch.set_num_threads(threads)
            if malloc == "flowctl":  # the settings a flowctl Session makes (engine/allocator.py)
                from flowctl.engine import allocator

                allocator.tune()
        threadpool_limits(threads)  # for the process's life
        run, params = _build_runner(row, framework, "cpu:0", precision, overrides)
        run()
        run()  # warm-up: plans, allocators, thread pools
        conn.send(("ready", params))
    except Exception as e:  # noqa: BLE001 -- reported by the parent as one error
        conn.send(("error", f"{row.name}: {framework}: {e}"))
        return
    while True:
        ask = conn.recv()
        try:
            if ask[0] == "steps":
                run()  # after the other framework ran, caches and threads are its
                conn.send(("ok", [_timed(run) for _ in range(ask[1])]))
            elif ask[0] == "profile":
                conn.send(("ok", torch_profile(torch, run) if framework == "pytorch" else run.profile()))
            else:
                return
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{row.name}: {framework}: {e}"))


class _Apart:
    """One framework's step in a spawned process of its own, driven over a pipe (module doc)."""

    def __init__(self, ctx: Any, row: Row, framework: str, threads: int, precision: str,
                 overrides: Sequence[str], malloc: str) -> None:
        self.framework = framework
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(theirs, row, framework, threads, precision, tuple(overrides),
                                                     malloc), daemon=True)
        self.proc.start()
        theirs.close()
        self.params = self._answer()

    def _answer(self) -> Any:
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise FlowctlError(f"bench peers: {self.framework}'s process ended (exit code "
                               f"{self.proc.exitcode})") from None
        if kind == "error":
            raise FlowctlError(f"bench peers: {value}")
        return value

    def steps(self, n: int) -> list[float]:
        self.conn.send(("steps", n))
        return self._answer()

    def profile(self) -> dict[str, Any]:
        self.conn.send(("profile",))
        return self._answer()

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()


def _run_row_apart(row: Row, steps: int, rounds: int, say: Callable[[str], None], profile: bool, precision: str,
                   overrides: Sequence[str], reference: bool, threads: int, malloc: str) -> dict[str, Any]:
    """`run_row` on the CPU with each framework in its own process (module doc)."""
    import multiprocessing

    spec = _load(row, overrides).spec  # a spec's errors come from here, as in one process
    ctx = multiprocessing.get_context("spawn")
    names = ["flowctl", "pytorch"] + (["flowctl_reference"] if reference else [])
    runners: dict[str, _Apart] = {}
    try:
        for name in names:
            say(f"{row.name}: building {name}'s step in a process of its own")
            runners[name] = _Apart(ctx, row, name, threads, precision, overrides, malloc)
        times: dict[str, list[float]] = {k: [] for k in runners}
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                say(f"{row.name}: round {r + 1}/{rounds}, {name}")
                times[name] += runners[name].steps(steps)
        out = summarize(times["flowctl"], times["pytorch"]) | paired_ratios(times["flowctl"], times["pytorch"], rounds)
        if reference:
            out["flowctl_reference"] = summarize(times["flowctl_reference"], times["pytorch"])["flowctl"]
            out["kernels_ratio"] = float(np.median(times["flowctl"]) / np.median(times["flowctl_reference"]))
        if profile:
            say(f"{row.name}: profiling a step of each")
            out["profile"] = {"flowctl": runners["flowctl"].profile(), "pytorch": runners["pytorch"].profile()}
        params = {"spec": runners["flowctl"].params, "pytorch": runners["pytorch"].params}
    finally:
        for runner in runners.values():
            runner.close()
    out.update({"spec": spec.name or spec.model.name, "batch": row.batch, "mode": "train" if row.train else "inference",
                "params": params, "processes": "one per framework", "peer_malloc": malloc})
    return out


def run_row(row: Row, steps: int, rounds: int, say: Callable[[str], None], profile: bool = False,
            device: str = "cpu:0", precision: str = "fp32", overrides: Sequence[str] = (),
            reference: bool = False, in_process: bool = False, threads: int = 1,
            peer_malloc: str = "flowctl") -> dict[str, Any]:
    """One row. On the CPU each framework in a process of its own (`_run_row_apart`) unless
    `in_process`. On a GPU, four runners take turns in this process: flowctl's step captured as a
    CUDA graph (the `flowctl` figure) and eager, PyTorch's eager (the `pytorch` figure: the ratio is
    against it) and its captured step; GPU memory is each allocator's, read in this process."""
    gpu = device != "cpu:0"
    if not gpu and not in_process:
        return _run_row_apart(row, steps, rounds, say, profile, precision, overrides, reference, threads, peer_malloc)
    sets = _spec_sets(overrides, precision)
    if gpu:  # the step is built for the device it runs on (fp16's skip without a cond, on one GPU)
        sets += (f"devices=[{device}]",)
    loaded = _load(row, sets)
    arrays = _batch(loaded, row.batch)
    say(f"{row.name}: building flowctl's step and PyTorch's")
    runners: dict[str, Any] = {"flowctl": flowctl_step(loaded, arrays, row.train, device)}
    memory: dict[str, Any] = {}
    if gpu:
        torch = import_torch()
        runners["flowctl"]()
        runners["flowctl"]()  # warm-up, then the capture: its private pool holds the whole step
        memory["flowctl"] = {"gpu_peak_mib": flowctl_gpu_bytes(runners["flowctl"].session) / 2**20}
        eager_rows = os.environ.get("FLOWCTL_PEERS_EAGER")  # rows whose eager flowctl step is timed too
        if eager_rows is None or row.name in eager_rows.split(","):
            runners["flowctl_eager"] = flowctl_step(loaded, arrays, row.train, device, capture=False)
        runners["pytorch"], twin_params = torch_step(loaded, arrays, row.train, device, precision)
        torch.cuda.reset_peak_memory_stats()
        runners["pytorch"]()
        memory["pytorch"] = {"gpu_peak_mib": torch.cuda.max_memory_allocated() / 2**20}
        try:
            runners["pytorch_captured"], _ = torch_step(loaded, arrays, row.train, device, precision, captured=True)
        except Exception as e:  # noqa: BLE001 -- PyTorch's capture of this twin failed: say so, go on
            say(f"{row.name}: PyTorch's step could not be captured: {e}")
    else:
        runners["pytorch"], twin_params = torch_step(loaded, arrays, row.train, device, precision)
        if reference:  # flowctl's step with the reference kernels alone, in the same rounds
            runners["flowctl_reference"] = flowctl_step(loaded, arrays, row.train, device, reference=True)
    for run in runners.values():  # warm-up: plans, allocators, thread pools; a GPU's captures
        run()
        run()
    times: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for name in order:
            say(f"{row.name}: round {r + 1}/{rounds}, {name}")
            runners[name]()  # after the other framework ran, caches and threads are its
            times[name] += [_timed(runners[name]) for _ in range(steps)]
    out = summarize(times["flowctl"], times["pytorch"]) | paired_ratios(times["flowctl"], times["pytorch"], rounds)
    if "flowctl_reference" in times:
        out["flowctl_reference"] = summarize(times["flowctl_reference"], times["pytorch"])["flowctl"]
        out["kernels_ratio"] = float(np.median(times["flowctl"]) / np.median(times["flowctl_reference"]))
    if gpu:
        out["memory"] = memory
        out["capture"] = runners["flowctl"].session.capture_report()
        if "flowctl_eager" in times:
            out["flowctl_eager"] = summarize(times["flowctl_eager"], times["pytorch"])["flowctl"]
            out["capture_speedup"] = float(np.median(times["flowctl_eager"]) / np.median(times["flowctl"]))
        if "pytorch_captured" in times:
            cap = summarize(times["flowctl"], times["pytorch_captured"])
            out["pytorch_captured"] = cap["pytorch"]
            out["ratio_captured"], out["ratio_captured_ci95"] = cap["ratio"], cap["ratio_ci95"]
        out["precision"] = precision
    if profile:  # after the timed steps, so the profilers cost them nothing
        say(f"{row.name}: profiling a step of each")
        out["profile"] = {"flowctl": runners["flowctl"].profile(),  # type: ignore[attr-defined]
                          "pytorch": torch_profile(import_torch(), runners["pytorch"], gpu=device != "cpu:0")}
    out.update({"spec": loaded.spec.name or loaded.spec.model.name, "batch": row.batch,
                "mode": "train" if row.train else "inference",
                "params": {"spec": sum(loaded.params()), "pytorch": twin_params}, "processes": "one"})
    return out


def flowctl_gpu_bytes(session: Any) -> int:
    """GPU memory flowctl's step holds: what cupy's default pool has in use (variables, the static
    feeds) and every captured step's private pool (the graph's buffers, all held)."""
    import cupy

    return int(cupy.get_default_memory_pool().used_bytes()) + int(session.device_bytes())


def run_peers(rows: Sequence[str | Row] | None = None, steps: int = 3, rounds: int = 3,
              progress: Callable[[str], None] | None = None, blas_n: int = 2048,
              threads: int | None = None, memory: bool = True, profile: bool = False,
              device: str = "cpu:0", precision: str = "fp32", overrides: Sequence[str] = (),
              reference: bool = False, in_process: bool = False, peer_malloc: str = "flowctl") -> dict[str, Any]:
    """Measure each row (names from ROWS, or Row objects); raise PeersUnavailable without torch.
    `blas_n`: the size of the square product that measures the BLAS peak. `threads`: the thread
    count both frameworks compute with (default: every CPU). `memory`: also each framework's
    resident memory, from a fresh process per framework and row. `profile`: also where each
    framework's step time goes, by op (one profiled step pair after the timed ones). `device`:
    where both run, cpu:0 or gpu:N (TF32 allowed on both sides there, as issue 19's table).
    `precision`: fp32, or fp16/bf16 (flowctl's `training.precision`, PyTorch's autocast).
    `overrides`: KEY=VALUE spec overrides for flowctl's side (`--set`). `reference`: on a CPU, also
    time flowctl's step with its reference kernels only (`flowctl_reference`, `kernels_ratio`).
    `in_process`: on a CPU, both frameworks in this process (by default each has one of its own);
    `peer_malloc`: PyTorch's process with flowctl's malloc settings ("flowctl") or glibc's
    ("stock") -- the module doc says why."""
    if precision not in PRECISIONS:
        raise FlowctlError(f"bench peers: precision is one of {', '.join(PRECISIONS)}, not '{precision}'")
    if peer_malloc not in PEER_MALLOC:
        raise FlowctlError(f"bench peers: peer_malloc is one of {', '.join(PEER_MALLOC)}, not '{peer_malloc}'")
    if torch_device(device).startswith("cuda"):
        # Read when cupy first makes its cuBLAS handle: set before any kernel runs.
        os.environ.setdefault("CUPY_TF32", "1")
    torch = import_torch()
    from threadpoolctl import threadpool_limits

    n = threads or os.cpu_count() or 1
    if n < 1:
        raise FlowctlError(f"bench peers: threads must be >= 1, got {n}")
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with threadpool_limits(n):
            return _run(torch, rows, steps, rounds, progress or (lambda _m: None), blas_n, memory, profile, device,
                        precision, overrides, reference, in_process, peer_malloc)
    finally:
        torch.set_num_threads(previous)


def _run(torch: Any, rows: Sequence[str | Row] | None, steps: int, rounds: int, say: Callable[[str], None],
         blas_n: int, memory: bool, profile: bool = False, device: str = "cpu:0", precision: str = "fp32",
         overrides: Sequence[str] = (), reference: bool = False, in_process: bool = False,
         peer_malloc: str = "flowctl") -> dict[str, Any]:
    picked: list[Row] = []
    for r in rows if rows is not None else DEFAULT_ROWS:
        if isinstance(r, Row):
            picked.append(r)
        elif r in ROWS:
            picked.append(ROWS[r])
        else:
            raise FlowctlError(f"bench peers: no row named '{r}'; rows: {', '.join(ROWS)}")
    if steps < 1 or rounds < 1:
        raise FlowctlError(f"bench peers: steps and rounds must be >= 1, got {steps} and {rounds}")
    say("measuring the BLAS peak")
    from flowctl.bench.host import describe

    machine = {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
               "numpy": np.__version__, "blas_gflops": blas_peak(torch, blas_n), "device": device,
               "host": describe()}
    if device != "cpu:0":
        machine.update(gpu_machine(torch, device))
    results: dict[str, Any] = {"machine": machine, "steps": steps, "rounds": rounds, "rows": {}}
    for row in picked:
        results["rows"][row.name] = run_row(row, steps, rounds, say, profile, device, precision, overrides, reference,
                                            in_process, torch.get_num_threads(), peer_malloc)
        if memory and device == "cpu:0":  # a GPU row measured its devices' memory in this process
            say(f"{row.name}: resident memory, each framework in a fresh process")
            results["rows"][row.name]["memory"] = peak_memory(row, torch.get_num_threads(), device)
    return results


def gpu_machine(torch: Any, device: str, n: int = 8192) -> dict[str, Any]:
    """What a GPU row is measured on -- the device, driver, CUDA, cupy, cuDNN and PyTorch versions
    -- and its limit beside it: the TF32 and bf16 tensor-core rate of an n x n product through
    PyTorch (best of five). Raises where cupy or PyTorch cannot reach the device."""
    where = torch_device(device)
    try:
        import cupy
    except ImportError:
        raise PeersUnavailable("bench peers on a GPU runs flowctl's kernels on cupy, which is not installed; "
                               'install it with: pip install -e ".[gpu]"') from None
    if not torch.cuda.is_available():
        raise PeersUnavailable(f"bench peers: PyTorch sees no CUDA device for {device} (torch {torch.__version__})")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    index = int(where.split(":")[1])
    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(index), "cuda_torch": torch.version.cuda,
        "cudnn_torch": torch.backends.cudnn.version(), "cupy": cupy.__version__,
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(), "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "tf32": {"pytorch": True, "cupy": os.environ.get("CUPY_TF32") == "1"}}
    for name, dtype in (("tf32_tflops", torch.float32), ("bf16_tflops", torch.bfloat16)):
        a = torch.randn(n, n, device=where, dtype=dtype)
        a @ a
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            a @ a
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[name] = 2.0 * n ** 3 / best / 1e12
    return out
