"""The op registry: one `OpDef` per op name (whitepaper §2 "Operations and Kernels").

An OpDef holds everything the engine knows about an op apart from its kernels: arity, the attribute
schema, the shape/dtype function, the gradient function (§4.1), the cost function and flags. Kernels
live in `flowctl.kernels`, keyed by (op, device type).
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from flowctl.engine.dtypes import as_dtype, itemsize
from flowctl.engine.errors import GraphError, did_you_mean
from flowctl.engine.shapes import TensorSpec, concrete

# Op groups: passes branch on these named sets, never on name prefixes.
ELEMENTWISE = "elementwise"
REDUCTION = "reduction"
MOVEMENT = "movement"
MATRIX = "matrix"
NN = "nn"
RANDOM = "random"
STATE = "state"
SOURCE = "source"
COMMUNICATION = "communication"
# Collectives (CollectiveAllReduce): N nodes, one per device, meeting in the step's rendezvous;
# not Send/Recv, so the partitioner leaves them in place (their inputs and outputs are local).
COLLECTIVE = "collective"
CONTROL = "control"


class Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = Required()


def _shape(v: Any) -> tuple:
    return tuple(None if d is None else int(d) for d in v)


def _decode_tensor(v: Any) -> np.ndarray:
    raw = base64.b64decode(v["data"])
    return np.frombuffer(raw, dtype=v["dtype"]).reshape(v["shape"]).copy()


def _encode_tensor(a: np.ndarray) -> dict:
    a = np.asarray(a, order="C")  # (ascontiguousarray would turn a 0-d array into 1-d)
    return {"dtype": a.dtype.name, "shape": list(a.shape),
            "data": base64.b64encode(a.tobytes()).decode("ascii")}


def _norm_tensor(v: Any) -> np.ndarray:
    a = np.array(v)
    if a.dtype == np.float64 and not isinstance(v, (np.ndarray, np.generic)):
        a = a.astype(np.float32)  # Python floats become float32 constants, as in TensorFlow
    if a.dtype == np.int64 and not isinstance(v, (np.ndarray, np.generic)):
        a = a.astype(np.int32)
    as_dtype(a.dtype)
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class AttrType:
    """How one attribute type is normalised at construction and written to / read from JSON."""

    name: str
    normalize: Callable[[Any], Any]
    encode: Callable[[Any], Any] = lambda v: v
    decode: Callable[[Any], Any] | None = None

    def from_json(self, v: Any) -> Any:
        return self.normalize(v if self.decode is None else self.decode(v))


def _opt_shape(v: Any) -> tuple | None:
    return None if v is None else _shape(v)


def _opt_ints(v: Any) -> tuple | None:
    return None if v is None else tuple(int(x) for x in v)


ATTR_TYPES: dict[str, AttrType] = {
    "int": AttrType("int", int),
    "float": AttrType("float", float),
    "bool": AttrType("bool", bool),
    "str": AttrType("str", str),
    "dtype": AttrType("dtype", as_dtype),
    "shape": AttrType("shape", _opt_shape, lambda v: None if v is None else list(v)),
    "ints": AttrType("ints", _opt_ints, lambda v: None if v is None else list(v)),
    "floats": AttrType("floats", lambda v: tuple(float(x) for x in v), list),
    "strs": AttrType("strs", lambda v: tuple(str(x) for x in v), list),
    "tensor": AttrType("tensor", _norm_tensor, _encode_tensor, _decode_tensor),
}

GradFn = Callable[..., Sequence[Any]]
InferFn = Callable[[list[TensorSpec], dict[str, Any]], list[TensorSpec]]
CostFn = Callable[[list[tuple[int, ...]], list[tuple[int, ...]], list[str], dict[str, Any]],
                  tuple[float, float]]
# For an op whose kernel may hand back a view of input 0 (no new buffer): given its attributes,
# input 0's concrete shape and whether input 0 is C-contiguous, (are the outputs views of input 0's
# buffer, are the outputs C-contiguous). A view holds no bytes of its own but keeps its base's
# buffer alive while it lives; the simulator's memory counts it so (what a step really holds).
ViewFn = Callable[[dict[str, Any], tuple[int, ...], bool], tuple[bool, bool]]


def view_same(attrs: dict[str, Any], shape: tuple[int, ...], contiguous: bool) -> tuple[bool, bool]:
    """The kernel returns its input itself, or a view with the same layout (ExpandDims, Squeeze)."""
    return True, contiguous


def view_reshape(attrs: dict[str, Any], shape: tuple[int, ...], contiguous: bool) -> tuple[bool, bool]:
    """`x.reshape`: a view of a C-contiguous input, else (conservatively) a copy; contiguous either way."""
    return contiguous, True


def view_leading(axis: int, shape: tuple[int, ...], contiguous: bool) -> tuple[bool, bool]:
    """Views that take parts along `axis` (Split, Unstack): contiguous where every axis before it
    has extent 1 (a C-ordered block)."""
    axis = axis % len(shape) if shape else 0
    return True, contiguous and all(d == 1 for d in shape[:axis])


def elementwise_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                     attrs: dict[str, Any]) -> tuple[float, float]:
    """One FLOP per output element; bytes are everything read plus everything written."""
    flops = float(sum(int(np.prod(s)) for s in outs))
    return flops, memory_bytes(ins, outs, dtypes)


def memory_bytes(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str]) -> float:
    size = itemsize(dtypes[0]) if dtypes else 4
    return float(sum(int(np.prod(s)) for s in list(ins) + list(outs)) * size)


def movement_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                  attrs: dict[str, Any]) -> tuple[float, float]:
    return 0.0, memory_bytes(ins, outs, dtypes)


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: InferFn
    num_inputs: int | None = None  # None: variadic, at least `min_inputs`
    min_inputs: int = 0
    attrs: dict[str, tuple[str, Any]] = field(default_factory=dict)  # name -> (type, default)
    grad: GradFn | None = None
    cost: CostFn = elementwise_cost
    group: str = ELEMENTWISE
    stateful: bool = False  # never folded, merged or pruned by CSE; owns a Container resource
    is_async: bool = False  # §5.3: the kernel completes through a callback
    differentiable: bool = True
    # What the executor binds as `attrs["_resource"]` (§4.7): "variable" (the Container slot the node
    # names), "variable_input" (the slot of the Variable feeding input 0), "variable_inputs" (a tuple
    # of the slots of the Variables feeding the ref inputs), "variable_list" (a tuple of the slots of
    # the Variables named by the `variables` attribute: a multi-tensor update, engine/multi_apply.py),
    # "rng" (per-op random state).
    resource: str = ""
    # Inputs that name state rather than read it (a TensorFlow "ref" edge): the executor neither
    # waits for nor passes them, so Assign can initialise a Variable that holds nothing yet.
    ref_inputs: tuple[int, ...] = ()
    view: ViewFn | None = None  # the kernel may return a view of input 0 (ViewFn above)
    # Buffer forwarding (TensorFlow's forward_input_or_allocate_output): the inputs, in order of
    # preference, whose buffer output `forward_to` may take when the op is that buffer's last
    # reader and the two agree in shape and dtype; every device type's kernel has an in-place
    # variant (kernels.registry.INTO). The executors forward what they own outright; the
    # simulator counts it.
    forward: tuple[int, ...] = ()
    forward_to: int = 0  # the output that may take a `forward` input's buffer

    def normalize_attrs(self, attrs: dict[str, Any], node: str) -> dict[str, Any]:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise GraphError(f"node '{node}' ({self.name}): unknown attribute(s) "
                             f"{sorted(unknown)}; {self.name} takes {sorted(self.attrs) or 'none'}")
        out: dict[str, Any] = {}
        for key, (typ, default) in self.attrs.items():
            if key in attrs and attrs[key] is not None:
                try:
                    out[key] = ATTR_TYPES[typ].normalize(attrs[key])
                except (TypeError, ValueError) as e:
                    raise GraphError(f"node '{node}' ({self.name}): attribute {key}="
                                     f"{attrs[key]!r} is not a valid {typ}: {e}") from e
            elif default is REQUIRED:
                raise GraphError(f"node '{node}' ({self.name}): attribute '{key}' is required")
            else:
                out[key] = default
        return out

    def encode_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        return {k: (None if v is None else ATTR_TYPES[self.attrs[k][0]].encode(v))
                for k, v in attrs.items()}

    def decode_attrs(self, data: dict[str, Any], node: str) -> dict[str, Any]:
        out = {}
        for k, v in data.items():
            if k not in self.attrs:
                raise GraphError(f"node '{node}' ({self.name}): unknown attribute '{k}'")
            out[k] = None if v is None else ATTR_TYPES[self.attrs[k][0]].from_json(v)
        return out

    def estimate(self, ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict[str, Any],
                 batch: int = 1) -> tuple[float, float]:
        """(FLOPs, bytes moved) with unknown dimensions set to `batch`."""
        return self.cost([concrete(s.shape, batch) for s in ins],
                         [concrete(s.shape, batch) for s in outs],
                         [s.dtype for s in outs] or [s.dtype for s in ins], attrs)


OPS: dict[str, OpDef] = {}


def resident(opdef: OpDef) -> bool:
    """Do the op's outputs live across steps? Sources (Consts, Placeholders) and a Variable's value:
    state, counted as resident memory, never as a step's own (simulator, executors)."""
    return opdef.group == SOURCE or opdef.resource == "variable"


def register_op(name: str, infer: InferFn, **kw: Any) -> OpDef:
    if name in OPS:
        raise ValueError(f"op {name} registered twice")
    opdef = OpDef(name=name, infer=infer, **kw)
    OPS[name] = opdef
    return opdef


def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        if not OPS:  # the op library registers every op at once, when it is imported
            raise GraphError(f"unknown op '{name}': no op is registered yet; importing the op library "
                             f"registers them (`import flowctl.engine.ops`, or any name of "
                             f"`import flowctl as fc`)") from None
        raise GraphError(f"unknown op '{name}'{did_you_mean(name, OPS)}") from None


def ops_in_group(group: str) -> frozenset[str]:
    return frozenset(n for n, d in OPS.items() if d.group == group)
