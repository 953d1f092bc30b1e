"""Optimizers as graph builders (whitepaper §4.1, §7): an update is just more graph.

`minimize` differentiates the loss (§4.1), optionally clips the gradients by their global norm, and
emits one update subgraph per variable, grouped into a single target the trainer runs each step.
Slots (momentum accumulators, Adam's moments) and Adam's beta powers are ordinary Variables with
`<slot>/init` initializers, so `global_variables_initializer` sets them up and checkpoints hold
them like any other variable (§4.7). Slots are named `<var>/<Optimizer>/<slot>` and colocated with
their variable (§4.3), as in TensorFlow.

Each update reads every variable's value once, from the Variable node the forward pass also reads:
a slot's new value is the output of its Assign, never a second read. A parameter's update is an
AssignSub, or for SGD the fused ApplyGradientDescent (both subtract from the value the slot holds
when they run, so concurrent replicas' updates add up, §7 asynchronous training), with a control
edge from the Variable node, so the read the gradients used always happens before the write.
"""
from __future__ import annotations

import contextlib
import copy
import fnmatch
from typing import Any, Sequence

import numpy as np

from flowctl.engine.autodiff import gradients
from flowctl.engine.dtypes import is_float, np_dtype
from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Graph, Tensor
from flowctl.engine.ops.api import constant
from flowctl.engine.ops.control import group
from flowctl.engine.ops.elementwise import add_n, cast, maximum, sqrt
from flowctl.engine.ops.state import assign, assign_add, assign_sub, trainable_variables, variable
from flowctl.engine.ops.training import (
    apply_adam, apply_gradient_descent, apply_momentum, gather_grad_rows, l2_loss, sparse_apply_gradient_descent,
)

__all__ = ["Optimizer", "SGD", "Momentum", "Adam", "AdamW", "DECAY_EXCLUDE", "clip_by_global_norm"]

GradsAndVars = list[tuple[Tensor | None, Tensor]]


def _scalar(value: Any, dtype: str, name: str) -> Tensor:
    """A hyperparameter as a scalar of `dtype`: a float becomes a Const, a Tensor (a placeholder, or
    a Variable holding a schedule's value) is used as is, cast where its dtype differs."""
    if isinstance(value, Tensor):
        if value.shape != ():
            raise GraphError(f"{name} must be a scalar tensor, got '{value.name}' of shape {value.shape}")
        return value if value.dtype == dtype else cast(value, dtype, name=f"{name}_cast")
    return constant(float(value), dtype=dtype, name=name)


class Optimizer:
    """Base class: subclasses define `_apply_dense(grad, var)` (and optionally `_prepare` and
    `_finish` for state shared by all variables)."""

    slot_names: tuple[str, ...] = ()  # the per-variable slots `_apply_dense` makes

    def __init__(self, learning_rate: float | Tensor, name: str) -> None:
        self.learning_rate = learning_rate
        self.name = name
        self._slots: dict[tuple[int, str, str], Tensor] = {}  # (graph id, var, slot) -> Variable
        self._state: dict[tuple[int, str], Tensor] = {}  # (graph id, key) -> non-slot Variable
        self.state_prefix = ""  # before the shared state's names: a replica's own copy (allreduce.py)

    # ------------------------------------------------------------------ public API
    def compute_gradients(self, loss: Tensor, var_list: Sequence[Tensor] | None = None) -> GradsAndVars:
        """(gradient, variable) pairs; a variable the loss does not depend on gets None."""
        var_list = list(var_list) if var_list is not None else trainable_variables(loss.graph)
        if not var_list:
            raise GraphError(f"{self.name}: no trainable variables to optimize '{loss.name}' over")
        for v in var_list:
            if v.op.op != "Variable":
                raise GraphError(f"{self.name}: '{v.name}' ({v.op.op}) is not a Variable")
        return list(zip(gradients(loss, var_list), var_list))

    def gradients_of(self, loss: Tensor, var_list: Sequence[Tensor], name: str = "gradients") -> list[Tensor | None]:
        """d loss / d var for each var, as this optimizer wants them (a strategy's replicas call it;
        loss scaling overrides it)."""
        return gradients(loss, list(var_list), name=name)

    def apply_gradients(self, grads_and_vars: Sequence[tuple[Tensor | None, Tensor]],
                        name: str | None = None) -> Tensor:
        """One Group target that applies every (gradient, variable) pair, in the given order except
        that an embedding table's comes last. Pairs whose gradient is None are skipped; all of them
        None is an error.

        Why the table last: its update writes a whole new table wherever it cannot write in place
        (on a GPU always, on the CPU while anyone holds the old array, as the trainer's pre-step
        snapshot does), and updates that become ready together (after clip_by_global_norm) run in
        graph order. Applied first, that copy stood beside every other gradient still waiting for
        its update: lstm_lm's training step on the CPU held 100.2 MiB beyond its parameters, 86.5
        with the table last (tracemalloc), and on two GPUs capped at 97 MiB its placements fit."""
        pairs = [(g, v) for g, v in grads_and_vars]
        live = [(g, v) for g, v in pairs if g is not None]
        live.sort(key=lambda gv: _embedding_gradient(gv[0]))  # stable: the rest keep their order
        if not live:
            raise GraphError(f"{self.name}: no gradients for any of the variables "
                             f"{[v.node for _, v in pairs]}; does the loss depend on them?")
        graph = live[0][1].graph
        with graph.as_default(), graph.absolute_scope():
            self._prepare(graph, [v for _, v in live])
            updates: list[Tensor] = []
            for grad, var in live:
                if not is_float(var.dtype):
                    raise GraphError(f"{self.name}: cannot update non-float variable '{var.node}' ({var.dtype})")
                with graph.name_scope(f"{var.node}/{self.name}"), graph.colocate_with(var):
                    updates.append(self._apply_dense(grad, var))
            with graph.name_scope(self.name):
                updates += self._finish(graph, updates)
            return group(updates, name=name or self.name, graph=graph)

    def minimize(self, loss: Tensor, var_list: Sequence[Tensor] | None = None,
                 clip_norm: float | Tensor | None = None, name: str | None = None) -> Tensor:
        """compute_gradients, clip_by_global_norm when `clip_norm` is given, apply_gradients."""
        gv = self.compute_gradients(loss, var_list)
        if clip_norm is not None:
            with loss.graph.as_default():
                clipped, _ = clip_by_global_norm([g for g, _ in gv], clip_norm)
            gv = list(zip(clipped, [v for _, v in gv]))
        return self.apply_gradients(gv, name=name)

    def make_slots(self, graph: Graph, var_list: list[Tensor]) -> None:
        """Create the slots and shared state now (they are otherwise made lazily by the update):
        for an update built inside a cond, whose branch must not own Variables."""
        with graph.as_default(), graph.absolute_scope():
            self._prepare(graph, var_list)
            for v in var_list:
                for slot in self.slot_names:
                    self._slot(v, slot)

    def replica(self, prefix: str) -> "Optimizer":
        """The same optimizer with slots and shared state of its own, the shared state's names
        under `prefix` (a replica's `replica_1/Adam/t` beside `Adam/t`): an all-reduce replica's
        update of its own copy of the variables (allreduce.py)."""
        other = copy.copy(self)
        other._slots, other._state, other.state_prefix = {}, {}, prefix
        return other

    def slots(self) -> list[Tensor]:
        """The per-variable slot Variables, in creation order."""
        return list(self._slots.values())

    def variables(self) -> list[Tensor]:
        """Every Variable this optimizer created: slots, then shared state (Adam's beta powers)."""
        return self.slots() + list(self._state.values())

    # ------------------------------------------------------------------ for subclasses
    def _slot(self, var: Tensor, slot: str) -> Tensor:
        key = (id(var.graph), var.node, slot)
        if key not in self._slots:
            zeros = np.zeros(var.shape, dtype=np_dtype(var.dtype))
            with var.graph.absolute_scope(), var.graph.colocate_with(var):
                self._slots[key] = variable(zeros, name=f"{var.node}/{self.name}/{slot}", trainable=False)
        return self._slots[key]

    def _state_variable(self, graph: Graph, key: str, value: Any) -> Tensor:
        k = (id(graph), key)
        if k not in self._state:
            with graph.absolute_scope():
                self._state[k] = variable(value, name=f"{self.state_prefix}{self.name}/{key}", trainable=False)
        return self._state[k]

    def _lr(self, dtype: str) -> Tensor:
        return _scalar(self.learning_rate, dtype, "learning_rate")

    def _update_var(self, var: Tensor, delta: Tensor) -> Tensor:
        # The control edge orders this write after the Variable node's read (an AssignSub reads the
        # slot itself, and its ref input is not waited for).
        with var.graph.control_dependencies([var]):
            return assign_sub(var, delta, name="update")

    def _prepare(self, graph: Graph, var_list: list[Tensor]) -> None:
        pass

    def _apply_dense(self, grad: Tensor, var: Tensor) -> Tensor:
        raise NotImplementedError

    def _finish(self, graph: Graph, updates: list[Tensor]) -> list[Tensor]:
        return []


class SGD(Optimizer):
    """var -= lr * g, one ApplyGradientDescent node per variable. A gradient that is a product
    with a scalar (clip_by_global_norm's g * scale) has the scalar moved into the step size,
    lr * scale, so the update reads g itself: one pass over the parameter fewer. An embedding
    table's gradient (a GatherGrad) is applied sparsely, to the rows the batch read."""

    def __init__(self, learning_rate: float | Tensor, name: str = "SGD") -> None:
        super().__init__(learning_rate, name)

    def _apply_dense(self, grad: Tensor, var: Tensor) -> Tensor:
        alpha = self._lr(var.dtype)
        delta, scale = _scaled(grad)
        if scale is not None:
            alpha = alpha * scale
        sparse = gather_grad_rows(delta)
        with var.graph.control_dependencies([var]):  # as _update_var: after the read the gradients used
            if sparse is not None:
                return sparse_apply_gradient_descent(var, alpha, *sparse, name="update")
            return apply_gradient_descent(var, alpha, delta, name="update")


def _embedding_gradient(grad: Tensor) -> bool:
    """Is `grad` an embedding table's (a GatherGrad, under clip_by_global_norm's scaling or not)?"""
    return _scaled(grad)[0].op.op == "GatherGrad"


def _scaled(grad: Tensor) -> tuple[Tensor, Tensor | None]:
    """(g, s) where `grad` is Mul(g, s) with s a scalar of g's dtype, else (grad, None)."""
    node = grad.op
    if node.op != "Mul" or grad.port != 0:
        return grad, None
    a, b = (grad.graph.tensor(r) for r in node.inputs)
    for g, s in ((a, b), (b, a)):
        if s.shape == () and s.dtype == g.dtype and g.shape == grad.shape:
            return g, s
    return grad, None


class Momentum(Optimizer):
    """TensorFlow's momentum: accum = momentum * accum + g; var -= lr * accum, or with Nesterov
    var -= lr * (g + momentum * accum)."""

    slot_names = ("momentum",)

    def __init__(self, learning_rate: float | Tensor, momentum: float = 0.9, nesterov: bool = False,
                 name: str = "Momentum") -> None:
        super().__init__(learning_rate, name)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)

    def _apply_dense(self, grad: Tensor, var: Tensor) -> Tensor:
        accum = self._slot(var, "momentum")
        with var.graph.control_dependencies([var]):  # as _update_var: after the read the gradients used
            return apply_momentum(var, accum, self._lr(var.dtype), grad, self.momentum, self.nesterov,
                                  name="update")


class Adam(Optimizer):
    """TensorFlow's Adam (Kingma & Ba, §2 with the efficient step size): with t the step count,
    lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t); m = beta1*m + (1-beta1)*g;
    v = beta2*v + (1-beta2)*g^2; var -= lr_t * m / (sqrt(v) + epsilon).
    beta1^t and beta2^t are Variables (`<name>/beta1_power`, `<name>/beta2_power`) multiplied by
    beta after each step, as TensorFlow keeps them; `<name>/t` counts the steps applied."""

    slot_names = ("m", "v")

    def __init__(self, learning_rate: float | Tensor = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, name: str = "Adam") -> None:
        super().__init__(learning_rate, name)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.epsilon = float(epsilon)
        self._lr_t: dict[str, Tensor] = {}

    def _prepare(self, graph: Graph, var_list: list[Tensor]) -> None:
        dtype = var_list[0].dtype
        self._b1p = self._state_variable(graph, "beta1_power", np.asarray(self.beta1, np_dtype(dtype)))
        self._b2p = self._state_variable(graph, "beta2_power", np.asarray(self.beta2, np_dtype(dtype)))
        self._t = self._state_variable(graph, "t", np.asarray(0, np.int64))
        self._lr_t = {}

    def _step_size(self, dtype: str) -> Tensor:
        """lr_t for one dtype, built once per apply and shared by every variable of that dtype."""
        if dtype not in self._lr_t:
            graph = self._b1p.graph
            with graph.absolute_scope(), graph.name_scope(self.name):
                b1p = self._b1p if self._b1p.dtype == dtype else cast(self._b1p, dtype)
                b2p = self._b2p if self._b2p.dtype == dtype else cast(self._b2p, dtype)
                lr = self._lr(dtype)
                self._lr_t[dtype] = lr * sqrt(1.0 - b2p) / (1.0 - b1p)
        return self._lr_t[dtype]

    def _apply_dense(self, grad: Tensor, var: Tensor) -> Tensor:
        lr_t = self._step_size(var.dtype)
        m, v = self._slot(var, "m"), self._slot(var, "v")
        with var.graph.control_dependencies([var]):  # as _update_var: after the read the gradients used
            return apply_adam(var, m, v, lr_t, grad, self.beta1, self.beta2, self.epsilon, name="update")

    def _finish(self, graph: Graph, updates: list[Tensor]) -> list[Tensor]:
        # The powers advance only after every variable's step has been taken (TF orders it the same
        # way); the step sizes above read the powers' values from before.
        with graph.control_dependencies(updates):
            return [assign(self._b1p, self._b1p * self.beta1, name="update_beta1_power"),
                    assign(self._b2p, self._b2p * self.beta2, name="update_beta2_power"),
                    assign_add(self._t, np.asarray(1, np.int64), name="update_t")]


# Biases and normalisation scales and offsets: the variables decoupled weight decay leaves alone
# (as GPT-2's and BERT's recipes do; decaying a layer norm's gain pulls it toward zero, not toward
# a simpler function).
DECAY_EXCLUDE = ("*/bias", "*/gamma", "*/beta")


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter, ICLR 2019, Algorithm 2, as
    torch.optim.AdamW): each step first var <- var - lr * weight_decay * var, with lr this step's
    scheduled rate (not the bias-corrected lr_t), then Adam's step above on the decayed value.
    Variables whose name matches a glob of `exclude` (by default biases and normalisation scales
    and offsets, DECAY_EXCLUDE) take Adam's step alone.

    The Adam step is this codebase's, TensorFlow's efficient form: epsilon is added to sqrt(v),
    where PyTorch adds it to sqrt(v / (1 - beta2^t)); PyTorch's update with
    eps = epsilon / sqrt(1 - beta2^t) is this one exactly (the two agree as epsilon -> 0), and
    with weight_decay 0 AdamW is Adam, bit for bit. The decay is ApplyGradientDescent(var, lr*wd,
    var) and the step the fused ApplyAdam after it: two existing fused updates, so every device
    with kernels for those (the CPU, a GPU) runs AdamW with no kernel of its own, at one more pass
    over each decayed parameter."""

    def __init__(self, learning_rate: float | Tensor = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, weight_decay: float = 0.01, exclude: Sequence[str] = DECAY_EXCLUDE,
                 name: str = "AdamW") -> None:
        super().__init__(learning_rate, beta1, beta2, epsilon, name)
        if weight_decay < 0:
            raise GraphError(f"{name}: weight_decay must be >= 0, got {weight_decay}")
        self.weight_decay = float(weight_decay)
        self.exclude = tuple(exclude)
        self._decay_rate: dict[str, Tensor] = {}

    def decays(self, var: Tensor) -> bool:
        """Does `var` take the weight decay? By its own name, or for an all-reduce replica's copy
        (`replica_1/dense/kernel`) the name of the variable it mirrors."""
        name = var.graph.nodes[var.node].attrs.get("mirror_of") or var.node
        return self.weight_decay > 0 and not any(fnmatch.fnmatchcase(name, g) for g in self.exclude)

    def _prepare(self, graph: Graph, var_list: list[Tensor]) -> None:
        super()._prepare(graph, var_list)
        self._decay_rate = {}

    def _apply_dense(self, grad: Tensor, var: Tensor) -> Tensor:
        if not self.decays(var):
            return super()._apply_dense(grad, var)
        dtype = var.dtype
        if dtype not in self._decay_rate:
            with var.graph.absolute_scope(), var.graph.name_scope(self.name):
                self._decay_rate[dtype] = self._lr(dtype) * self.weight_decay
        with var.graph.control_dependencies([var]):  # as _update_var: after the read the gradients used
            decayed = apply_gradient_descent(var, self._decay_rate[dtype], var, name="decay")
        lr_t = self._step_size(dtype)
        m, v = self._slot(var, "m"), self._slot(var, "v")
        with var.graph.control_dependencies([decayed]):  # Adam's step on the decayed value
            return apply_adam(var, m, v, lr_t, grad, self.beta1, self.beta2, self.epsilon, name="update")


def clip_by_global_norm(grads: Sequence[Tensor | None], clip_norm: float | Tensor,
                        name: str = "clip_by_global_norm") -> tuple[list[Tensor | None], Tensor]:
    """TensorFlow's clip_by_global_norm: global_norm = sqrt(sum of every |t|^2) (as TensorFlow, from
    one L2Loss per tensor: 2 * sum of the halves), and each t becomes
    t * clip_norm / max(global_norm, clip_norm), so nothing changes unless the norm exceeds
    clip_norm. None entries pass through. Returns (clipped, global_norm)."""
    present = [g for g in grads if g is not None]
    if not present:
        raise GraphError("clip_by_global_norm: every gradient is None")
    graph = present[0].graph
    dtype = present[0].dtype
    with graph.as_default(), graph.name_scope(name):
        sums = []
        for t in present:
            # A gradient's norm is taken where the gradient is (it follows the same forward node):
            # a scalar crosses devices, not the tensor.
            fwd = graph.nodes[t.node].follows
            with graph.following(fwd) if fwd else contextlib.nullcontext():
                sparse = gather_grad_rows(t)  # an embedding's gradient: the rows it touches hold its norm
                s = l2_loss(t if sparse is None else sparse[1])
            sums.append(s if s.dtype == dtype else cast(s, dtype))
        global_norm = sqrt((sums[0] if len(sums) == 1 else add_n(sums)) * 2.0, name="global_norm")
        limit = _scalar(clip_norm, dtype, "clip_norm")
        scale = limit / maximum(global_norm, limit)
        scales = {dtype: scale}
        clipped: list[Tensor | None] = []
        for g in grads:
            if g is None:
                clipped.append(None)
                continue
            if g.dtype not in scales:
                scales[g.dtype] = cast(scale, g.dtype)
            clipped.append(g * scales[g.dtype])
    return clipped, global_norm
