"""The layer registry: one table keyed by layer type (STYLE: one registry per concept).

A layer type is a pydantic model (its fields are the spec keys) with three methods that share one
source of truth: `infer` (output TensorSpec from input specs, no graph needed), `weights` (the
variables it owns, so parameter counts need no graph either) and `build` (emit engine nodes).
`build` creates exactly the variables `weights` lists, through `Builder.variable`; tests hold the
static count and the built graph to agreement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from flowctl.engine.graph import Graph, Tensor
from flowctl.engine.shapes import TensorSpec, num_elements

Activation = Literal["none", "relu", "tanh", "sigmoid", "gelu", "gelu_tanh"]


def _numeric(annotation: Any) -> bool:
    """A number field (int or float, maybe optional) that does not also take a bool."""
    args = get_args(annotation) or (annotation,)
    return bool(set(args) & {int, float}) and bool not in args


class Strict(BaseModel):
    """Every spec model rejects unknown keys (the loader turns that into a 'did you mean') and a
    YAML true/false where a number goes (pydantic would take `units: true` as 1)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                v = data.get(field.alias or name)
                if isinstance(v, bool) and _numeric(field.annotation):
                    raise ValueError(f"{field.alias or name}: a number, not {str(v).lower()}")
        return data


class LayerError(Exception):
    """A layer cannot take its inputs; `field` names the spec key to point at (else the layer)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Weight:
    """One variable a layer owns. `init`: glorot_uniform | uniform | truncated_normal | zeros | ones."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    init: str = "glorot_uniform"
    fan: tuple[int, int] | None = None  # (fan_in, fan_out) for glorot; default from the shape
    scale: float = 0.05  # for uniform (±scale) and truncated_normal (stddev)

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))


class Builder(Protocol):
    """What a layer's `build` gets besides its inputs (implemented in flowctl.spec.model)."""

    graph: Graph
    training: bool
    dtype: str
    # A sequence tensor [batch, time, ...] (by ref) -> its per-time-step tensors, where a layer made
    # it from them: the next recurrent layer reads step t directly instead of unstacking the whole
    # sequence, so layer l+1 can run step t while layer l runs t+1 (Figure 8's model parallelism).
    steps: dict[str, list[Tensor]]
    # Whether the layers may be placed on different devices (several devices, not one replica
    # each): only then does a layer gain from starting on part of the one below's steps.
    split_layers: bool

    def variable(self, w: Weight) -> Tensor: ...

    def shared(self, layer: str, weight: str) -> Tensor:
        """An earlier layer's weight as that layer read it (weight tying)."""
        ...

    def batch_norm(self, x: Tensor, gamma: Tensor | None, beta: Tensor, mean: Tensor, var: Tensor,
                   epsilon: float, momentum: float, activation: str = "none") -> Tensor: ...


class Layer(Strict):
    """Fields every layer has. `inputs` names earlier layers; the default is the previous layer."""

    name: str = Field(pattern=r"^[A-Za-z_][\w./-]*$")
    type: str
    inputs: list[str] | None = None

    arity: ClassVar[tuple[int, int | None]] = (1, 1)  # (min, max) inputs; max None = any
    # The model's float dtype, for layers that make floats from ints (embedding) and float inputs; set by
    # the spec check.
    _dtype: str = PrivateAttr("float32")

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        raise NotImplementedError

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        return []

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        raise NotImplementedError

    @property
    def is_loss(self) -> bool:
        return False


LAYERS: dict[str, type[Layer]] = {}


def register(cls: type[Layer]) -> type[Layer]:
    (name,) = get_args(cls.model_fields["type"].annotation)
    if name in LAYERS:
        raise ValueError(f"layer type {name} registered twice")
    LAYERS[name] = cls
    return cls


# ---------------------------------------------------------------------------- shape helpers
def pair(v: int | list[int] | tuple[int, ...], what: str) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    if len(v) != 2:
        raise LayerError(f"{what} must be an int or a pair [h, w], got {list(v)}", what)
    return int(v[0]), int(v[1])


def rank(spec: TensorSpec, want: int, layer: str, what: str = "input") -> None:
    if len(spec.shape) != want:
        shown = "x".join("?" if d is None else str(d) for d in spec.shape[1:]) or "scalar"
        raise LayerError(f"{layer} needs a rank-{want} {what} (batch included), got shape {fmt(spec.shape)} "
                         f"({shown} per example)")


def fmt(shape: tuple) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def known(d: int | None, what: str) -> int:
    if d is None:
        raise LayerError(f"{what} must be known when the spec is built, got an unknown dimension")
    return d


def out_size(n: int | None, k: int, s: int, padding: str) -> int | None:
    """Spatial output size of a window op (TensorFlow's SAME/VALID rules)."""
    if n is None:
        return None
    if padding == "same":
        return -(-n // s)
    return (n - k) // s + 1 if n >= k else 0


def count(ws: list[Weight]) -> tuple[int, int]:
    """(trainable, non-trainable) parameter counts."""
    t = sum(w.size for w in ws if w.trainable)
    return t, sum(w.size for w in ws) - t


def elements(spec: TensorSpec) -> int | None:
    return num_elements(spec.shape[1:])
