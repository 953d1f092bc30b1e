"""The learned placer's policy, built and trained with flowctl's own engine (a Graph of ops,
`gradients` through `Adam.minimize`, a Session): the sequence-to-sequence placer of Mirhoseini et
al. 2017 (placement-notes.md) over placement units (grouping.py).

- Embedding of unit u: tanh(ops_u W_op + shape_u W_sh + sum_v adj_uv (ops_v W_op + shape_v W_sh) W_nb
  + b): its op types, output sizes and costs, and its neighbours weighted by the bytes between.
- Encoder: an LSTM over the units in topological order.
- Decoder: an LSTM started from the encoder's final state, reading encoder output u at step u,
  with content-based attention over all encoder outputs (a dot product of the query W_q h with
  each output); its output layer gives one logit per device slot (MAX_DEVICES, masked to the
  unit's feasible devices).

The decoder does not read the device it sampled for the previous unit (the paper's decoder does):
the devices of all units are then independent given the graph, so one forward run gives the
distribution of a whole batch of placements and one more run takes the gradient step. Ties
between units are learnt through the shared encoder state instead.

The loss is REINFORCE's: -sum_{u,d} W_ud log p(d | u) - beta * H(p), where the caller sets
W_ud = mean over samples of (advantage x [sample placed u on d]); with W a one-hot target it is
a cross-entropy (imitation of a given placement), and the entropy bonus beta each step.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from flowctl.engine.container import ContainerStore
from flowctl.engine.graph import Graph, Tensor
from flowctl.engine.ops.array import concat, slice_, split
from flowctl.engine.ops.elementwise import sigmoid, tanh
from flowctl.engine.ops.matrix import matmul
from flowctl.engine.ops.nn import log_softmax, softmax
from flowctl.engine.ops.reduction import reduce_sum
from flowctl.engine.ops.state import global_variables_initializer, placeholder, variable
from flowctl.engine.optimizers import Adam
from flowctl.engine.placement.grouping import MAX_DEVICES, OP_BUCKETS, SHAPE_FEATURES
from flowctl.engine.session import Session

DTYPE = "float64"  # tiny matrices: float64 costs nothing and keeps runs bit-reproducible
SCOPE = "policy"


class Policy:
    """The network for `units` placement units; `embed` and `hidden` sizes; weights drawn from a
    numpy generator seeded with `seed`. Variables are named `policy/...`, so a policy built for
    another graph (a different number of units) loads the same weights (`load(..., warm=True)`)."""

    def __init__(self, units: int, seed: int, embed: int = 32, hidden: int = 32, lr: float = 0.05) -> None:
        self.units, self.embed, self.hidden = units, embed, hidden
        rng = np.random.default_rng(seed)
        self.graph = Graph(seed=seed)
        U, E, H, D = units, embed, hidden, MAX_DEVICES

        def w(name: str, shape: tuple[int, ...], scale: float | None = None) -> Tensor:
            s = scale if scale is not None else 1.0 / np.sqrt(shape[0])
            return variable(rng.normal(0.0, s, size=shape), name=f"{SCOPE}/{name}")

        with self.graph.as_default():
            self.ops = placeholder(DTYPE, (U, OP_BUCKETS), name="ops")
            self.shape = placeholder(DTYPE, (U, SHAPE_FEATURES), name="shape")
            self.adj = placeholder(DTYPE, (U, U), name="adjacency")
            self.mask = placeholder(DTYPE, (U, D), name="mask")
            self.weights = placeholder(DTYPE, (U, D), name="weights")
            self.entropy_coef = placeholder(DTYPE, (), name="entropy_coef")
            w_op, w_sh, w_nb = w("embed/ops", (OP_BUCKETS, E)), w("embed/shape", (SHAPE_FEATURES, E)), w("embed/nb", (E, E))
            b_e = variable(np.zeros((1, E)), name=f"{SCOPE}/embed/b")
            own = matmul(self.ops, w_op) + matmul(self.shape, w_sh)
            emb = tanh(own + matmul(matmul(self.adj, own), w_nb) + b_e)
            enc_w, enc_b = w("encoder/w", (E + H, 4 * H)), variable(np.zeros((1, 4 * H)), name=f"{SCOPE}/encoder/b")
            dec_w, dec_b = w("decoder/w", (2 * H, 4 * H)), variable(np.zeros((1, 4 * H)), name=f"{SCOPE}/decoder/b")
            w_q, w_c = w("attention/q", (H, H)), w("attention/out", (2 * H, H))
            w_o = w("out/w", (H, D), scale=0.1)
            b_o = variable(np.zeros((1, D)), name=f"{SCOPE}/out/b")
            h: Any = np.zeros((1, H))
            c: Any = np.zeros((1, H))
            outs: list[Tensor] = []
            for u in range(U):
                h, c = _lstm(slice_(emb, [u, 0], [1, E]), h, c, enc_w, enc_b, H)
                outs.append(h)
            enc = concat(outs, 0) if U > 1 else outs[0]  # [U, H]
            logits: list[Tensor] = []
            for u in range(U):
                h, c = _lstm(outs[u], h, c, dec_w, dec_b, H)
                att = softmax(matmul(matmul(h, w_q), enc, transpose_b=True))  # [1, U]
                ctx = matmul(att, enc)
                logits.append(matmul(tanh(matmul(concat([h, ctx], 1), w_c)), w_o) + b_o)
            self.logits = (concat(logits, 0) if U > 1 else logits[0]) + self.mask
            logp = log_softmax(self.logits)
            self.probs = softmax(self.logits)
            self.entropy = -reduce_sum(self.probs * logp)
            self.loss = -reduce_sum(self.weights * logp) - self.entropy_coef * self.entropy
            self.optimizer = Adam(lr, name="PolicyAdam")
            self.train_op = self.optimizer.minimize(self.loss)
            init = global_variables_initializer()
        self.session = Session(self.graph, store=ContainerStore())
        self.session.run(init)

    def feeds(self, ops: np.ndarray, shape: np.ndarray, adj: np.ndarray, mask: np.ndarray) -> dict[Tensor, np.ndarray]:
        return {self.ops: ops, self.shape: shape, self.adj: adj, self.mask: mask}

    def distribution(self, feeds: Mapping[Tensor, np.ndarray]) -> np.ndarray:
        """p(device | unit), [units, MAX_DEVICES]."""
        return np.asarray(self.session.run(self.probs, dict(feeds)))

    def update(self, feeds: Mapping[Tensor, np.ndarray], weights: np.ndarray, entropy: float = 0.0) -> float:
        """One Adam step on the loss with these per-(unit, device) weights and entropy bonus;
        returns the loss."""
        f = dict(feeds)
        f[self.weights] = weights
        f[self.entropy_coef] = np.asarray(entropy, dtype=np.float64)
        loss, _ = self.session.run([self.loss, self.train_op], f)
        return float(loss)

    def state(self) -> dict[str, np.ndarray]:
        """Every variable: the policy's weights and the optimizer's slots and step count."""
        return {k: np.array(v) for k, v in self.session.variable_values().items()}

    def load(self, values: Mapping[str, np.ndarray], warm: bool = False) -> list[str]:
        """Restore `state()`. `warm`: only the policy's weights whose shapes match (a policy from
        another graph or cluster), leaving the optimizer fresh; returns the names loaded."""
        own = self.session.variable_values()
        chosen = {k: v for k, v in values.items()
                  if k in own and (not warm or (k.startswith(SCOPE + "/") and "PolicyAdam" not in k
                                                and np.shape(v) == np.shape(own[k])))}
        self.session.load_variables(chosen)
        return sorted(chosen)


def _lstm(x: Tensor, h: Tensor | np.ndarray, c: Tensor | np.ndarray, w: Tensor, b: Tensor,
          H: int) -> tuple[Tensor, Tensor]:
    z = matmul(concat([x, h], 1), w) + b
    i, f, o, g = split(z, 4, axis=1)
    c2 = sigmoid(f + 1.0) * c + sigmoid(i) * tanh(g)  # forget bias 1: remember by default
    return sigmoid(o) * tanh(c2), c2


__all__ = ["Policy"]
