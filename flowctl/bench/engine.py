"""The built-in `engine` benchmark suite (`flowctl bench engine`).

Every figure is a ratio or a difference taken in the same run, so a noisy machine moves both sides:
dispatch overhead is the step time minus the same numpy calls made in a bare Python loop; Conv2D and
LSTM are timed against plain matmuls of the same FLOPs, and each Conv2D kernel (forward, input
gradient, filter gradient) of Inception-v3's heaviest shapes against the matmul of its own FLOPs.
"""
from __future__ import annotations

import platform
import time
from typing import Any, Callable

import numpy as np

import flowctl as fc


def _best(fn: Callable[[], Any], repeat: int, min_time: float = 0.0) -> float:
    """Best-of-`repeat` wall time of fn() in seconds (the minimum is the least noisy estimate)."""
    fn()  # warm-up: plan compilation, BLAS thread start, allocator
    best = float("inf")
    t_start = time.perf_counter()
    n = 0
    while n < repeat or time.perf_counter() - t_start < min_time:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def dispatch_chain(n: int = 10_000, repeat: int = 7) -> dict[str, Any]:
    """A chain of n scalar Adds: per-node cost above the numpy call itself."""
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (), name="x")
        one = fc.constant(np.float64(1.0), name="one")
        h = x
        for i in range(n):
            h = fc.add(h, one, name=f"add{i}")
    s = fc.Session(g, store=fc.ContainerStore())
    feeds = {x: np.float64(0.0)}
    assert float(s.run(h, feeds)) == n
    step = _best(lambda: s.run(h, feeds), repeat)

    c = np.float64(1.0)
    add = np.add

    def raw() -> None:
        v = np.float64(0.0)
        for _ in range(n):
            v = add(v, c)

    kernel = _best(raw, repeat)
    return {"nodes": n, "step_s": step, "kernels_s": kernel,
            "overhead_us_per_node": (step - kernel) / n * 1e6, "step_us_per_node": step / n * 1e6}


def dispatch_wide(n: int = 10_000, repeat: int = 7) -> dict[str, Any]:
    """n independent Adds on one input, all feeding one Group: per-node cost above numpy."""
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (), name="x")
        one = fc.constant(np.float64(1.0), name="one")
        outs = [fc.add(x, one, name=f"add{i}") for i in range(n)]
        target = fc.group(outs, name="all")
    s = fc.Session(g, store=fc.ContainerStore())
    feeds = {x: np.float64(0.0)}
    step = _best(lambda: s.run(target, feeds), repeat)
    c = np.float64(1.0)
    add = np.add

    def raw() -> None:
        v = np.float64(0.0)
        out = []
        for _ in range(n):
            out.append(add(v, c))

    kernel = _best(raw, repeat)
    return {"nodes": n, "step_s": step, "kernels_s": kernel,
            "overhead_us_per_node": (step - kernel) / n * 1e6, "step_us_per_node": step / n * 1e6}


CONV_SHAPES = [  # Inception-v3 layers: (H, W, Cin, Cout, kh, kw)
    ("35x35x288->64 3x3", 35, 35, 288, 64, 3, 3),
    ("17x17x768->192 1x7", 17, 17, 768, 192, 1, 7),
    ("8x8x1280->320 1x1", 8, 8, 1280, 320, 1, 1),
]


def conv2d_vs_matmul(batch: int = 8, repeat: int = 5) -> list[dict[str, Any]]:
    """Conv2D forward + input gradient + filter gradient (SAME, stride 1, float32), against one
    float32 matmul of the same total FLOPs (3 x the forward GEMM)."""
    rng = np.random.default_rng(0)
    results = []
    for label, h, w, cin, cout, kh, kw in CONV_SHAPES:
        g = fc.Graph()
        with g.as_default():
            x = fc.placeholder("float32", (batch, h, w, cin), name="x")
            f = fc.placeholder("float32", (kh, kw, cin, cout), name="f")
            dy = fc.placeholder("float32", (batch, h, w, cout), name="dy")
            y = fc.conv2d(x, f, strides=(1, 1), padding="SAME", name="conv")
            gx, gf = fc.gradients(y, [x, f], grad_ys=[dy])
        s = fc.Session(g, store=fc.ContainerStore())
        feeds = {x: rng.standard_normal((batch, h, w, cin), dtype=np.float32),
                 f: rng.standard_normal((kh, kw, cin, cout), dtype=np.float32) * 0.05,
                 dy: rng.standard_normal((batch, h, w, cout), dtype=np.float32)}
        t_conv = _best(lambda: s.run([y, gx, gf], feeds), repeat)
        m, k = batch * h * w, kh * kw * cin
        a = rng.standard_normal((3 * m, k), dtype=np.float32)
        b = rng.standard_normal((k, cout), dtype=np.float32)
        t_mm = _best(lambda: a @ b, repeat)
        flops = 3 * 2 * m * k * cout
        results.append({"shape": label, "batch": batch, "fwd_bwd_s": t_conv, "matmul_same_flops_s": t_mm,
                        "ratio_to_matmul": t_conv / t_mm, "gflops_per_s": flops / t_conv / 1e9})
    return results


# Inception-v3's heaviest convolutions at batch 8 (and a few of each other kind): (label, H, W,
# Cin, Cout, kh, kw, stride, padding).
PASS_SHAPES = [
    ("147x147x32->64 3x3", 147, 147, 32, 64, 3, 3, 1, "SAME"),
    ("149x149x32->32 3x3 valid", 149, 149, 32, 32, 3, 3, 1, "VALID"),
    ("73x73x80->192 3x3 valid", 73, 73, 80, 192, 3, 3, 1, "VALID"),
    ("35x35x64->96 3x3", 35, 35, 64, 96, 3, 3, 1, "SAME"),
    ("35x35x48->64 5x5", 35, 35, 48, 64, 5, 5, 1, "SAME"),
    ("35x35x288->384 3x3/2 valid", 35, 35, 288, 384, 3, 3, 2, "VALID"),
    ("17x17x160->160 1x7", 17, 17, 160, 160, 1, 7, 1, "SAME"),
    ("17x17x160->160 7x1", 17, 17, 160, 160, 7, 1, 1, "SAME"),
    ("17x17x768->192 1x1", 17, 17, 768, 192, 1, 1, 1, "SAME"),
    ("8x8x448->384 3x3", 8, 8, 448, 384, 3, 3, 1, "SAME"),
]


def conv2d_passes_vs_matmul(batch: int = 8, repeat: int = 5, shapes: list | None = None) -> list[dict[str, Any]]:
    """Each convolution kernel on its own (forward, input gradient, filter gradient), float32,
    against the matmul its FLOPs make: (N*Ho*Wo, kh*kw*Cin) @ (kh*kw*Cin, Cout), the GEMM an
    im2col of the whole batch would run. The passes and the matmul are timed in turns."""
    rng = np.random.default_rng(0)
    results = []
    for label, h, w, cin, cout, kh, kw, stride, padding in shapes or PASS_SHAPES:
        g = fc.Graph()
        with g.as_default():
            x = fc.placeholder("float32", (batch, h, w, cin), name="x")
            f = fc.placeholder("float32", (kh, kw, cin, cout), name="f")
            y = fc.conv2d(x, f, strides=stride, padding=padding, name="conv")
            dy = fc.placeholder("float32", y.shape, name="dy")
            gx, gf = fc.gradients(y, [x, f], grad_ys=[dy])
        s = fc.Session(g, store=fc.ContainerStore())
        feeds = {x: rng.standard_normal(x.shape, dtype=np.float32),
                 f: rng.standard_normal(f.shape, dtype=np.float32) * 0.05,
                 dy: rng.standard_normal(y.shape, dtype=np.float32)}
        m, k = int(np.prod(y.shape[:3])), kh * kw * cin
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, cout), dtype=np.float32)
        runs = {"matmul": lambda: a @ b, "forward": lambda: s.run(y, feeds),
                "input_grad": lambda: s.run(gx, feeds), "filter_grad": lambda: s.run(gf, feeds)}
        for fn in runs.values():
            fn()  # warm-up: plans, allocator
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(repeat):  # in turns, so drift on a shared machine falls on all four
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        row: dict[str, Any] = {"shape": label, "batch": batch, "matmul_same_flops_s": best["matmul"],
                               "gflops": 2.0 * m * k * cout / 1e9}
        for name in ("forward", "input_grad", "filter_grad"):
            row[name] = {"s": best[name], "ratio_to_matmul": best[name] / best["matmul"]}
        results.append(row)
    return results


def lstm_cell_vs_matmul(batch: int = 20, hidden: int = 650, repeat: int = 20) -> dict[str, Any]:
    """One LSTM cell step (input = hidden = 650), forward + backward w.r.t. weights, bias, input and
    state, against its three raw matmuls (forward gates, weight gradient, input gradient)."""
    rng = np.random.default_rng(0)
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (batch, hidden), name="x")
        h = fc.placeholder("float32", (batch, hidden), name="h")
        c = fc.placeholder("float32", (batch, hidden), name="c")
        wmat = fc.placeholder("float32", (2 * hidden, 4 * hidden), name="w")
        bias = fc.placeholder("float32", (4 * hidden,), name="b")
        gates = fc.bias_add(fc.matmul(fc.concat([x, h], axis=1), wmat), bias)
        i, f, o, u = fc.split(gates, 4, axis=1)
        c_new = fc.sigmoid(f) * c + fc.sigmoid(i) * fc.tanh(u)
        h_new = fc.sigmoid(o) * fc.tanh(c_new)
        dh = fc.placeholder("float32", (batch, hidden), name="dh")
        dc = fc.placeholder("float32", (batch, hidden), name="dc")
        grads = fc.gradients([h_new, c_new], [x, h, c, wmat, bias], grad_ys=[dh, dc])
    s = fc.Session(g, store=fc.ContainerStore())
    feeds = {t: rng.standard_normal(t.shape, dtype=np.float32) * 0.1 for t in (x, h, c, wmat, bias, dh, dc)}
    fetches = [h_new, c_new] + grads
    t_step = _best(lambda: s.run(fetches, feeds), repeat)
    xh = rng.standard_normal((batch, 2 * hidden), dtype=np.float32)
    wv = feeds[wmat]
    dg = rng.standard_normal((batch, 4 * hidden), dtype=np.float32)

    def raw() -> None:
        xh @ wv
        xh.T @ dg
        dg @ wv.T

    t_raw = _best(raw, repeat)
    return {"batch": batch, "hidden": hidden, "nodes": len(s.plan_for(fetches, feeds).order),
            "fwd_bwd_s": t_step, "raw_matmuls_s": t_raw, "ratio_to_matmuls": t_step / t_raw}


def run_engine_suite(quick: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = progress or (lambda _msg: None)
    n = 2_000 if quick else 10_000
    rep = 3 if quick else 7
    out: dict[str, Any] = {
        "suite": "engine", "flowctl": fc.__version__, "numpy": np.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
    }
    say("dispatch: chain of scalar Adds")
    out["dispatch_chain"] = dispatch_chain(n, rep)
    say("dispatch: wide graph")
    out["dispatch_wide"] = dispatch_wide(n, rep)
    say("Conv2D forward+backward vs matmul")
    out["conv2d"] = conv2d_vs_matmul(batch=2 if quick else 8, repeat=2 if quick else 5)
    say("Conv2D kernels one by one vs matmul")
    out["conv2d_passes"] = conv2d_passes_vs_matmul(batch=2 if quick else 8, repeat=2 if quick else 5,
                                                   shapes=PASS_SHAPES[:3] if quick else None)
    say("LSTM cell forward+backward vs matmul")
    out["lstm_cell"] = lstm_cell_vs_matmul(repeat=5 if quick else 20)
    return out
