"""A finite-difference gradient checker (whitepaper §4.1): the analytic gradients `gradients()`
builds, compared with central differences of the same graph, in float64."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from flowctl.engine.autodiff import gradients
from flowctl.engine.container import ContainerStore
from flowctl.engine.graph import Graph, Tensor
from flowctl.engine.ops.api import constant
from flowctl.engine.ops.state import placeholder
from flowctl.engine.session import Session


def check_gradients(build: Callable[..., Tensor | Sequence[Tensor]], inputs: Mapping[str, np.ndarray],
                    wrt: Sequence[str] | None = None, eps: float = 1e-6, rtol: float = 1e-5,
                    atol: float = 1e-7, max_elements: int = 60, seed: int = 0,
                    graph_seed: int = 0, shapes: Mapping[str, tuple] | None = None) -> float:
    """Build `build(**placeholders)` for float64 (or integer) `inputs`, then check d(sum r*y)/dx for
    random weights r against central differences on up to `max_elements` entries of each x in
    `wrt` (default: every float input). Raises AssertionError naming the input and element;
    returns the largest absolute error seen. `shapes` overrides placeholder shapes (e.g. an unknown
    batch dimension, None) so run-time-shape code paths are checked too."""
    rng = np.random.default_rng(seed)
    g = Graph(seed=graph_seed)
    with g.as_default():
        shapes = shapes or {}
        phs = {k: placeholder(v.dtype.name, shapes.get(k, v.shape), name=k) for k, v in inputs.items()}
        outs = build(**phs)
        ys = [outs] if isinstance(outs, Tensor) else list(outs)
        ys = [y for y in ys if y.dtype in ("float32", "float64")]
        weights = []
        sess_probe = Session(g, store=ContainerStore())
        probe = sess_probe.run(ys, dict(zip(phs.values(), inputs.values())))
        for y, v in zip(ys, probe):
            weights.append(rng.standard_normal(np.shape(v)))
        names = list(wrt) if wrt is not None else [k for k, v in inputs.items() if v.dtype.kind == "f"]
        grads = gradients(ys, [phs[n] for n in names],
                          grad_ys=[constant(w, dtype=y.dtype) for w, y in zip(weights, ys)])
    sess = Session(g, store=ContainerStore())
    feeds: dict[Any, Any] = {phs[k]: v for k, v in inputs.items()}
    missing = [n for n, gr in zip(names, grads) if gr is None]
    if missing:
        raise AssertionError(f"no gradient path to input(s) {missing}")
    analytic = sess.run(grads, feeds)

    def objective(fd: dict[Any, Any]) -> float:
        vals = sess.run(ys, fd)
        return float(sum(np.sum(w * v) for w, v in zip(weights, vals)))

    worst = 0.0
    for name, an in zip(names, analytic):
        x = np.array(inputs[name], dtype=np.float64)
        if np.shape(an) != x.shape:
            raise AssertionError(f"gradient for '{name}' has shape {np.shape(an)}, input has {x.shape}")
        flat = x.reshape(-1)
        idx = np.arange(flat.size)
        if flat.size > max_elements:
            idx = rng.choice(flat.size, size=max_elements, replace=False)
        for i in idx:
            old = flat[i]
            flat[i] = old + eps
            up = objective({**feeds, phs[name]: x})
            flat[i] = old - eps
            down = objective({**feeds, phs[name]: x})
            flat[i] = old
            numeric = (up - down) / (2 * eps)
            a = float(np.asarray(an).reshape(-1)[i])
            err = abs(a - numeric)
            worst = max(worst, err)
            if err > atol + rtol * max(abs(numeric), abs(a)):
                raise AssertionError(f"gradient of '{name}' at flat index {i}: analytic {a:.10g}, "
                                     f"numeric {numeric:.10g} (error {err:.3g})")
    return worst


def run_graph(build: Callable[..., Any], **inputs: np.ndarray) -> Any:
    """Evaluate `build(**placeholders)` on `inputs` in a fresh graph and private session."""
    g = Graph()
    with g.as_default():
        phs = {k: placeholder(v.dtype.name, v.shape, name=k) for k, v in inputs.items()}
        out = build(**phs)
    return Session(g, store=ContainerStore()).run(out, {phs[k]: v for k, v in inputs.items()})
