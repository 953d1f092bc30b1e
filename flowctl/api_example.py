"""The embedded default job: a two-layer network built with the Python API, trained on a
generated, learnable classification task (labels from a fixed random 'teacher' network, with the
points nearest its decision boundaries left out so the task is separable)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import flowctl as fc
from flowctl.engine.optimizers import Adam


@dataclass
class DemoResult:
    losses: list[float] = field(default_factory=list)
    accuracy: float = 0.0
    steps: int = 0


def make_dataset(n: int, dim: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((dim, 32))
    w2 = rng.standard_normal((32, classes))
    x = rng.standard_normal((4 * n, dim))
    logits = np.tanh(x @ w1) @ w2
    top2 = np.sort(logits, axis=1)[:, -2:]
    keep = np.argsort(top2[:, 1] - top2[:, 0])[-n:]  # the n points with the widest margin
    return x[keep].astype(np.float32), logits[keep].argmax(axis=1).astype(np.int32)


def build(dim: int, hidden: int, classes: int, lr: float, seed: int) -> tuple[fc.Graph, dict[str, fc.Tensor]]:
    g = fc.Graph(seed=seed)
    with g.as_default():
        x = fc.placeholder("float32", (None, dim), name="x")
        y = fc.placeholder("int32", (None,), name="labels")
        with g.name_scope("hidden"):
            w1 = fc.variable(fc.truncated_normal((dim, hidden), stddev=(2.0 / dim) ** 0.5), name="w")
            b1 = fc.variable(np.zeros(hidden, np.float32), name="b")
            h = fc.relu(fc.bias_add(fc.matmul(x, w1), b1))
        with g.name_scope("logits"):
            w2 = fc.variable(fc.truncated_normal((hidden, classes), stddev=(1.0 / hidden) ** 0.5), name="w")
            b2 = fc.variable(np.zeros(classes, np.float32), name="b")
            logits = fc.bias_add(fc.matmul(h, w2), b2)
        loss = fc.reduce_mean(fc.sparse_softmax_cross_entropy(logits, y), name="loss")
        correct = fc.equal(fc.argmax(logits, axis=1, output_type="int32"), y)
        accuracy = fc.reduce_mean(fc.cast(correct, "float32"), name="accuracy")
        train = Adam(lr).minimize(loss)
        init = fc.global_variables_initializer()
    return g, {"x": x, "y": y, "loss": loss, "accuracy": accuracy, "train": train, "init": init}


def train_demo(steps: int = 300, batch: int = 64, seed: int = 0, lr: float = 0.01,
               on_step: Callable[[int, float], None] | None = None) -> DemoResult:
    dim, hidden, classes = 10, 64, 3
    x_all, y_all = make_dataset(2048, dim, classes, seed=1000 + seed)
    g, t = build(dim, hidden, classes, lr, seed)
    sess = fc.Session(g, store=fc.ContainerStore())
    sess.run(t["init"])
    order = np.random.default_rng(seed)
    result = DemoResult(steps=steps)
    for step in range(steps):
        idx = order.integers(0, len(x_all), size=batch)
        loss, _ = sess.run([t["loss"], t["train"]], {t["x"]: x_all[idx], t["y"]: y_all[idx]})
        result.losses.append(float(loss))
        if on_step is not None:
            on_step(step, float(loss))
    result.accuracy = float(sess.run(t["accuracy"], {t["x"]: x_all, t["y"]: y_all}))
    return result
