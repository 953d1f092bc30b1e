"""Building a validated spec into an engine Graph.

Each layer emits its nodes under its own name scope (`mixed_5b/branch3x3/conv`), with
`Node.source` set to the spec line that wrote it, so a kernel error or a placement explanation can
speak in layer names and spec lines. The builder records which nodes each layer made: placement
constraints written over layer names select exactly those nodes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import flowctl as fc
from flowctl.engine.dtypes import is_float
from flowctl.engine.errors import GraphError, SpecError
from flowctl.engine.graph import Graph, Tensor
from flowctl.spec.check import LoadedSpec
from flowctl.spec.layers import Weight
from flowctl.spec.layers.base import fmt


@dataclass
class BuiltModel:
    """The graph a spec describes, and where each layer's pieces are in it."""

    graph: Graph
    loaded: LoadedSpec
    training: bool
    inputs: dict[str, Tensor] = field(default_factory=dict)  # input layer -> Placeholder
    outputs: dict[str, Tensor] = field(default_factory=dict)  # layer -> its output
    loss: Tensor | None = None
    updates: list[Tensor] = field(default_factory=list)  # batch-norm moving averages: run with each step
    layer_nodes: dict[str, list[str]] = field(default_factory=dict)
    variables: dict[str, list[Tensor]] = field(default_factory=dict)  # layer -> its Variables

    def trainable_variables(self) -> list[Tensor]:
        return [v for vs in self.variables.values() for v in vs if self.graph.nodes[v.node].attrs["trainable"]]

    def all_variables(self) -> list[Tensor]:
        return [v for vs in self.variables.values() for v in vs]

    def params(self) -> tuple[int, int]:
        """(trainable, non-trainable) counted from the Variable nodes of the graph itself."""
        t = n = 0
        for v in self.all_variables():
            size = math.prod(v.shape)
            if self.graph.nodes[v.node].attrs["trainable"]:
                t += size
            else:
                n += size
        return t, n

    def layer_of(self) -> dict[str, str]:
        """node name -> the layer that made it."""
        return {node: layer for layer, nodes in self.layer_nodes.items() for node in nodes}

    def initializer(self) -> Tensor:
        return fc.global_variables_initializer(self.graph)


# training.precision -> the dtype the layers compute in (the variables keep the model's dtype).
# bfloat16 arrays are ml_dtypes' (numpy and cupy); each op on them computes in float32 and rounds
# what it stores (kernels/bf16.py), as a GPU's bfloat16 products do.
COMPUTE_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


class _Builder:
    """What layers see while building (flowctl.spec.layers.base.Builder).

    Mixed precision: `dtype` is the compute dtype, `var_dtype` the master variables'. A trainable
    weight a layer asks for comes back lowered (`lower`): a Cast of its float32 Variable to float16
    or bfloat16 (the Cast's gradient casts back, so the Variable gets a float32 gradient); batch
    norm runs in float32 on float32 statistics, its output lowered."""

    def __init__(self, graph: Graph, training: bool, dtype: str, precision: str = "fp32",
                 split_layers: bool = False) -> None:
        self.graph = graph
        self.split_layers = split_layers
        self.training = training
        self.precision = precision
        self.var_dtype = dtype
        self.compute = COMPUTE_DTYPES.get(precision, dtype)
        self.dtype = self.compute
        self.made: list[Tensor] = []
        self.updates: list[Tensor] = []
        self.steps: dict[str, list[Tensor]] = {}
        self.masters: dict[str, Tensor] = {}  # the Cast a layer got -> its Variable
        self.layer = ""  # the layer being built
        self.given: dict[str, dict[str, Tensor]] = {}  # layer -> weight name -> the tensor it read

    def shared(self, layer: str, weight: str) -> Tensor:
        return self.given[layer][weight]

    def _give(self, w: Weight, t: Tensor) -> Tensor:
        self.given.setdefault(self.layer, {})[w.name] = t
        return t

    def variable(self, w: Weight) -> Tensor:
        with self.graph.name_scope(w.name):
            init = _initial_value(w, self.var_dtype)
        v = fc.variable(init, name=w.name, trainable=w.trainable)
        self.made.append(v)
        if self.precision == "fp32" or not w.trainable:
            return self._give(w, v)  # batch norm's moving statistics stay float32 and are read as such
        c = self.lower(v, w.name)
        self.masters[c.name] = v
        return self._give(w, c)

    def lower(self, t: Tensor, name: str) -> Tensor:
        """`t` as the layers compute with it: cast to float16 or bfloat16."""
        return fc.cast(t, self.compute, name=f"{name}/{self.compute}")

    def master(self, t: Tensor) -> Tensor:
        return self.masters.get(t.name, t)

    def batch_norm(self, x: Tensor, gamma: Tensor | None, beta: Tensor, mean: Tensor, var: Tensor,
                   epsilon: float, momentum: float, activation: str = "none") -> Tensor:
        low = self.precision != "fp32"
        # A bfloat16 x goes into training's batch norm as it is, beside float32 parameters and
        # statistics (its kernel widens x and rounds y: the bits of a Cast up, a float32 batch
        # norm and a Cast down, with neither Cast's pass over x); float16 and inference's
        # ChannelAffine take a float32 copy.
        direct = self.precision == "bf16" and self.training
        if low:  # batch statistics and their moving averages in float32
            if x.dtype != self.var_dtype and not direct:
                x = fc.cast(x, self.var_dtype, name="bn/to_master")
            gamma = None if gamma is None else self.master(gamma)
            beta = self.master(beta)
        # Keras' Inception-v3 uses BatchNormalization(scale=False): a constant 1, not a variable,
        # which is why its parameter count has no gammas.
        scale = gamma if gamma is not None else fc.ones((x.shape[-1],), self.var_dtype, name="bn/unit_scale")
        y, updates = fc.batch_norm(x, scale, beta, mean, var, training=self.training, momentum=momentum,
                                   epsilon=epsilon, activation=activation, name="bn")
        self.updates.extend(updates)
        return self.lower(y, "bn/output") if low and not direct else y


def _initial_value(w: Weight, dtype: str) -> Tensor:
    if w.init == "zeros":
        return fc.zeros(w.shape, dtype, name="initial_value")
    if w.init == "ones":
        return fc.ones(w.shape, dtype, name="initial_value")
    if w.init == "uniform":
        return fc.random_uniform(w.shape, -w.scale, w.scale, dtype, name="initial_value")
    if w.init == "truncated_normal":
        return fc.truncated_normal(w.shape, 0.0, w.scale, dtype, name="initial_value")
    if w.init == "glorot_uniform":
        fan_in, fan_out = w.fan or (w.shape[0] if len(w.shape) > 1 else 1, w.shape[-1])
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        return fc.random_uniform(w.shape, -limit, limit, dtype, name="initial_value")
    raise GraphError(f"unknown initializer {w.init!r} for weight {w.name}")


def layers_may_split(loaded: LoadedSpec, devices: int | None = None) -> bool:
    """Whether a placement may put the spec's layers on different devices: more than one device
    (the spec's, or `devices` of a what-if cluster) and no data-parallel strategy (whose replicas
    each hold the whole model on one device)."""
    n = len(loaded.spec.devices) if devices is None else devices
    return n > 1 and loaded.spec.parallelism.strategy not in ("sync_data_parallel", "async_data_parallel")


def build_model(loaded: LoadedSpec, training: bool = True, graph: Graph | None = None,
                precision: str | None = None, devices: int | None = None) -> BuiltModel:
    """Emit the spec's layers into `graph` (a fresh one seeded with `training.seed` by default).
    The built shapes and variables are checked against the layer library's static answers.
    `precision` (default: the spec's `training.precision`): fp16 computes the layers in float16
    on float32 variables, and the loss in float32; bf16 the same in bfloat16 (without loss scaling:
    bfloat16 has float32's range). `devices`: how many devices the step will be placed on, where
    not the spec's (a what-if cluster): layers that may land on different devices are built to
    overlap (`layers_may_split`)."""
    g = graph if graph is not None else Graph(seed=loaded.spec.training.seed)
    model = BuiltModel(g, loaded, training)
    precision = loaded.spec.training.precision if precision is None else precision
    b = _Builder(g, training, loaded.spec.model.dtype, precision, layers_may_split(loaded, devices))
    mixed = precision != "fp32"
    compute = b.compute
    with g.as_default():
        for name, info in loaded.layers.items():
            before = set(g.nodes)
            b.made = []
            b.layer = name
            where = f"{info.mark} layer {name}" if info.mark else f"layer {name}"
            ins = [model.outputs[r] for r in info.inputs]
            try:
                with g.source(where):
                    if info.layer.type == "input":  # a Placeholder named as the layer, to feed by name
                        out = model.inputs[name] = info.layer.build(b, ins)
                        if mixed and is_float(out.dtype):
                            with g.name_scope(name):
                                out = b.lower(out, "value")
                    elif mixed and info.layer.is_loss:  # the loss from float32 logits
                        with g.name_scope(name):
                            ins = [fc.cast(t, b.var_dtype, name=f"input_{i}/{b.var_dtype}")
                                   if t.dtype == compute != b.var_dtype else t for i, t in enumerate(ins)]
                            b.dtype = b.var_dtype
                            try:
                                out = info.layer.build(b, ins)
                            finally:
                                b.dtype = compute
                    else:
                        with g.name_scope(name):
                            out = info.layer.build(b, ins)
            except GraphError as e:
                # The static checks passed but the engine refused: still the spec's problem, so
                # say which layer and line made the node.
                raise SpecError(f"{info.mark or '<spec>'}: model.layers[{name}]: {e}") from None
            model.outputs[name] = out
            model.layer_nodes[name] = [n for n in g.nodes if n not in before]
            model.variables[name] = list(b.made)
            want = info.output.dtype
            if mixed and is_float(want) and not info.layer.is_loss:
                want = compute
            if tuple(out.shape) != tuple(info.output.shape) or out.dtype != want:
                raise GraphError(f"layer '{name}' built {fmt(out.shape)} {out.dtype} but the layer library "
                                 f"inferred {fmt(info.output.shape)} {want} (a bug in the "
                                 f"{info.layer.type} layer)")
            built = sorted(tuple(v.shape) for v in b.made)
            static = sorted(tuple(w.shape) for w in info.weights)
            if built != static:
                raise GraphError(f"layer '{name}' built variables {built} but declares {static}")
    model.updates = b.updates
    if loaded.loss is not None:
        model.loss = model.outputs[loaded.loss]
    return model


__all__ = ["BuiltModel", "build_model"]
