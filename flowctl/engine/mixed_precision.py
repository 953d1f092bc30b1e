"""Dynamic loss scaling for float16 training, as more graph (whitepaper §4.1: gradients are graph;
§4.4: the skipped update is a cond; §4.7: the scale is a Variable, so checkpoints carry it).

float16 has a narrow range: small gradients flowing back through float16 activations round to
zero. The loss is multiplied by a scale S before differentiation (the backward pass starts from S
instead of 1), and every gradient is multiplied by 1/S afterwards, in float32 (the master variables'
dtype; a Cast's gradient casts back). S is a power of two, so the unscaling is exact. If any
gradient is not finite the step is skipped -- the optimizer's update sits in the true branch of a
`cond` on "all finite", so variables, slots and Adam's step count are untouched -- and S halves;
after `growth_interval` finite steps in a row S doubles. S, the finite-steps-in-a-row count and
the skipped-step count are Variables updated with Select, so exact resume holds.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from flowctl.engine.autodiff import gradients
from flowctl.engine.control_flow import cond
from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Graph, Tensor
from flowctl.engine.ops.api import constant
from flowctl.engine.ops.control import group, guard_flag, identity
from flowctl.engine.ops.elementwise import add_n, cast, equal, greater, maximum, select
from flowctl.engine.ops.reduction import reduce_sum
from flowctl.engine.ops.state import assign, trainable_variables, variable
from flowctl.engine.optimizers import GradsAndVars, Optimizer

__all__ = ["LossScale", "LossScaleOptimizer", "all_finite"]

# The scale never falls below 1: a smaller one only makes float16 underflow worse.
MIN_SCALE = 1.0


@dataclass
class LossScale:
    """The loss-scaling state: Variables, and the values a step assigns them (fetch those)."""

    scale: Tensor  # float32 Variable
    good_steps: Tensor  # int64 Variable: finite steps in a row since the last change of the scale
    skipped: Tensor  # int64 Variable: steps skipped so far
    new_scale: Tensor | None = None  # the Assigns' outputs, set once the update is built
    new_skipped: Tensor | None = None


def all_finite(grads: Sequence[Tensor | None], name: str = "all_finite") -> Tensor:
    """A bool scalar: every element of every gradient is finite. sum(g * 0) is 0 for finite g and
    NaN as soon as one element is Inf or NaN, so one pass per gradient decides it exactly (a plain
    sum could overflow on finite values)."""
    present = [g for g in grads if g is not None]
    if not present:
        raise GraphError("all_finite: every gradient is None")
    graph = present[0].graph
    with graph.as_default(), graph.name_scope(name):
        sums = []
        for g in present:
            fwd = graph.nodes[g.node].follows
            with graph.following(fwd) if fwd else contextlib.nullcontext():
                s = reduce_sum(g * np.asarray(0.0, g.dtype))
            sums.append(s if s.dtype == "float32" else cast(s, "float32"))
        total = sums[0] if len(sums) == 1 else add_n(sums)
        return equal(total, constant(0.0, dtype="float32"), name="finite")


class LossScaleOptimizer(Optimizer):
    """Wraps an optimizer: gradients of S * loss, unscaled; the inner update under a cond on their
    being finite; S, the run of good steps and the skipped count updated after it."""

    def __init__(self, inner: Optimizer, initial_scale: float = 65536.0, growth_interval: int = 2000,
                 name: str = "loss_scale", predicated: bool = False) -> None:
        """`predicated`: skip a non-finite step without a `cond` -- the update's state writes wait
        for a GuardFlag of "all finite" and, on a GPU, leave their variables as they were where it
        is false -- so the step has no host branch and can be captured as one CUDA graph. Only a
        GPU's state writes read the flag: a CPU step uses the cond."""
        super().__init__(inner.learning_rate, inner.name)
        self.predicated = predicated
        if initial_scale <= 0 or growth_interval < 1:
            raise GraphError(f"loss scale: initial must be > 0 and growth_interval >= 1, got {initial_scale}, "
                             f"{growth_interval}")
        self.inner = inner
        self.initial_scale = float(initial_scale)
        self.growth_interval = int(growth_interval)
        self.scope = name
        self.state: LossScale | None = None
        self._inverse: Tensor | None = None  # 1/S, shared by every replica's unscaling

    def _make_state(self, graph: Graph) -> LossScale:
        if self.state is None:
            with graph.as_default(), graph.absolute_scope(self.scope):
                self.state = LossScale(
                    variable(np.asarray(self.initial_scale, np.float32), name="scale", trainable=False),
                    variable(np.asarray(0, np.int64), name="good_steps", trainable=False),
                    variable(np.asarray(0, np.int64), name="skipped", trainable=False))
        return self.state

    def compute_gradients(self, loss: Tensor, var_list: Sequence[Tensor] | None = None) -> GradsAndVars:
        var_list = list(var_list) if var_list is not None else trainable_variables(loss.graph)
        return list(zip(self.gradients_of(loss, var_list), var_list))

    def gradients_of(self, loss: Tensor, var_list: Sequence[Tensor], name: str = "gradients") -> list[Tensor | None]:
        """The gradients of S * loss (S starts the backward pass), each times 1/S where it is made."""
        var_list = list(var_list)
        if loss.shape != ():
            raise GraphError(f"loss scaling needs a scalar loss, got '{loss.name}' of shape {loss.shape}")
        graph = loss.graph
        st = self._make_state(graph)
        with graph.as_default(), graph.absolute_scope():
            s = st.scale if st.scale.dtype == loss.dtype else cast(st.scale, loss.dtype)
            raw = gradients(loss, var_list, grad_ys=[s], name=name)
            if self._inverse is None:
                with graph.name_scope(self.scope):
                    self._inverse = constant(1.0, dtype="float32", name="one") / st.scale
            inv = self._inverse
            out: list[Tensor | None] = []
            for g in raw:
                if g is None:
                    out.append(None)
                    continue
                with graph.following(g.node):
                    k = inv if g.dtype == "float32" else cast(inv, g.dtype)
                    out.append(g * k)
        return out

    def apply_gradients(self, grads_and_vars: Sequence[tuple[Tensor | None, Tensor]],
                        name: str | None = None) -> Tensor:
        pairs = list(grads_and_vars)
        live = [(g, v) for g, v in pairs if g is not None]
        if not live:
            raise GraphError(f"{self.name}: no gradients for any of the variables")
        graph = live[0][1].graph
        st = self._make_state(graph)
        with graph.as_default(), graph.absolute_scope():
            # Slots and shared state are made outside the cond: a Variable born in a branch would
            # be dead (uninitialised) whenever the branch is not taken.
            self.inner.make_slots(graph, [v for _, v in live])
            finite = all_finite([g for g, _ in live], name=f"{self.scope}/all_finite")

            def apply() -> Tensor:
                op = self.inner.apply_gradients(live)
                with graph.control_dependencies([op]):
                    return identity(constant(1, dtype="int64"), name="applied")

            def skip() -> Tensor:
                return identity(constant(0, dtype="int64"), name="skipped")

            with graph.name_scope(self.scope):
                if self.predicated:
                    flag = guard_flag(finite, name="guard")
                    with graph.control_dependencies([flag]):
                        op = self.inner.apply_gradients(live)
                    with graph.control_dependencies([op]):
                        done = cast(finite, "int64", name="applied")
                else:
                    done = cond(finite, apply, skip, name="maybe_apply")
                with graph.control_dependencies([done]):
                    st.new_scale, st.new_skipped, good = self._update_state(st, finite)
            return group([done, st.new_scale, st.new_skipped, good], name=name or self.name, graph=graph)

    def _update_state(self, st: LossScale, finite: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        one = constant(1, dtype="int64", name="one_step")
        good1 = st.good_steps + one
        grow = greater(good1, constant(self.growth_interval - 1, dtype="int64"), name="grow")
        two = constant(2.0, dtype="float32", name="two")
        half = constant(0.5, dtype="float32", name="half")
        shrunk = maximum(st.scale * half, constant(MIN_SCALE, dtype="float32"), name="shrunk")
        scale = select(finite, select(grow, st.scale * two, st.scale), shrunk, name="next_scale")
        zero = constant(0, dtype="int64", name="zero")
        good = select(finite, select(grow, zero, good1), zero, name="next_good_steps")
        skipped = select(finite, st.skipped, st.skipped + one, name="next_skipped")
        return (assign(st.scale, scale, name="update_scale"), assign(st.skipped, skipped, name="update_skipped"),
                assign(st.good_steps, good, name="update_good_steps"))

    def slots(self) -> list[Tensor]:
        return self.inner.slots()

    def variables(self) -> list[Tensor]:
        own = [] if self.state is None else [self.state.scale, self.state.good_steps, self.state.skipped]
        return self.inner.variables() + own
