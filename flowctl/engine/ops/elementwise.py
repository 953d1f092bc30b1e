"""Element-wise ops (whitepaper Table 1): arithmetic with numpy broadcasting, comparisons, Select,
Cast, AddN, the activation functions, rounding, the remainders, Erf, Sin/Cos, IsNaN/IsInf, and the
fused gradient ops they use.

Division comes in TensorFlow's two pairs, each keeping x == div(x, y) * y + mod(x, y) for integers:
`Div` (true division of floats; integers truncate toward zero, as TensorFlow's Div, ONNX's Div and
C do: -7 / 2 = -3) with `TruncateMod` (the sign of x), and `FloorDiv` (Python's `//`: -7 // 2 = -4)
with `FloorMod` (Python's `%`: the sign of y). An integer division or remainder by zero gives 0
(numpy's and cupy's answer)."""
from __future__ import annotations

from typing import Any, Sequence

from flowctl.engine.dtypes import as_dtype, is_float
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import graph_of, make1
from flowctl.engine.opdef import ELEMENTWISE, elementwise_cost, movement_cost, register_op
from flowctl.engine.shapes import InferError, TensorSpec, broadcast, dims_equal

UNARY = ("Neg", "Exp", "Log", "Sqrt", "Rsqrt", "Square", "Relu", "Sigmoid", "Tanh", "Abs", "Sign")
BINARY = ("Add", "Sub", "Mul", "Div", "Pow", "Maximum", "Minimum")
COMPARE = ("Greater", "Less", "Equal", "GreaterEqual", "LessEqual")
ROUNDING = ("Floor", "Ceil", "Round")  # piecewise constant: a zero gradient, as Sign has
FLOAT_TESTS = ("IsNaN", "IsInf")


def _same_dtype(ins: list[TensorSpec]) -> str:
    dts = {s.dtype for s in ins}
    if len(dts) != 1:
        raise InferError(f"dtypes differ: {', '.join(s.dtype for s in ins)} (insert a Cast)")
    return ins[0].dtype


def _unary_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    return [ins[0]]


def _numeric_unary_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if ins[0].dtype == "bool":
        raise InferError("needs a numeric input, got bool (cast it first)")
    return [ins[0]]


def _float_unary_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if not is_float(ins[0].dtype):
        raise InferError(f"needs a float input, got {ins[0].dtype}")
    return [ins[0]]


def _binary_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    return [TensorSpec(broadcast(ins[0].shape, ins[1].shape), _same_dtype(ins))]


def _arith_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    # numpy turns bool arithmetic into logic (True + True is True) or refuses it; TensorFlow refuses.
    if ins[0].dtype == "bool" or ins[1].dtype == "bool":
        raise InferError("arithmetic needs numeric inputs, got bool (cast them first)")
    return _binary_infer(ins, attrs)


def _compare_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    _same_dtype(ins)
    return [TensorSpec(broadcast(ins[0].shape, ins[1].shape), "bool")]


def _select_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if ins[0].dtype != "bool":
        raise InferError(f"Select's condition must be bool, got {ins[0].dtype}")
    dt = _same_dtype(ins[1:])
    return [TensorSpec(broadcast(ins[0].shape, ins[1].shape, ins[2].shape), dt)]


def _addn_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    dt = _same_dtype(ins)
    if dt == "bool":
        raise InferError("AddN needs numeric inputs, got bool (cast them first)")
    shape = ins[0].shape
    for s in ins[1:]:
        if len(s.shape) != len(shape) or not all(dims_equal(a, b) for a, b in zip(s.shape, shape)):
            raise InferError(f"AddN inputs must share a shape: {', '.join(str(i.shape) for i in ins)}")
        shape = tuple(a if a is not None else b for a, b in zip(shape, s.shape))
    return [TensorSpec(shape, dt)]


def _float_test_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if not is_float(ins[0].dtype):
        raise InferError(f"needs a float input, got {ins[0].dtype}")
    return [TensorSpec(ins[0].shape, "bool")]


def _cast_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    return [TensorSpec(ins[0].shape, attrs["dtype"])]


def _reduce_to_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    return [TensorSpec(ins[1].shape, ins[0].dtype)]


def _grad_pair_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if not is_float(ins[1].dtype):
        raise InferError(f"needs float inputs, got {ins[1].dtype}")
    return [TensorSpec(broadcast(ins[0].shape, ins[1].shape), _same_dtype(ins))]


# ---------------------------------------------------------------------------- gradient functions
def _reduce(g: Tensor, like: Tensor) -> Tensor:
    """Sum a broadcast gradient back to the shape of the operand it flows to."""
    if g.shape == like.shape and None not in g.shape:
        return g
    return make1("ReduceTo", [g, like], name="reduce_to")


def _g_add(op: Any, dy: list[Tensor]) -> list[Tensor]:
    x, y = op.inputs
    return [_reduce(dy[0], x), _reduce(dy[0], y)]


def _g_sub(op: Any, dy: list[Tensor]) -> list[Tensor]:
    x, y = op.inputs
    return [_reduce(dy[0], x), _reduce(neg(dy[0]), y)]


def _g_mul(op: Any, dy: list[Tensor]) -> list[Tensor]:
    x, y = op.inputs
    return [_reduce(dy[0] * y, x), _reduce(dy[0] * x, y)]


def _g_div(op: Any, dy: list[Tensor]) -> list[Tensor]:
    x, y = op.inputs
    z = op.outputs[0]
    gx = dy[0] / y
    return [_reduce(gx, x), _reduce(neg(gx * z), y)]


def _g_pow(op: Any, dy: list[Tensor]) -> list[Tensor]:
    x, y = op.inputs
    z = op.outputs[0]
    gx = dy[0] * y * pow_(x, y - 1.0)
    # d/dy x^y = x^y log x, defined as 0 where x <= 0 (as TensorFlow does)
    safe_log = select(greater(x, zeros_like(x)), log(x), zeros_like(x))
    return [_reduce(gx, x), _reduce(dy[0] * z * safe_log, y)]


def _g_maximum(op: Any, dy: list[Tensor]) -> list[Tensor]:
    x, y = op.inputs
    zero = zeros_like(dy[0])
    x_wins = make1("GreaterEqual", [x, y])
    return [_reduce(select(x_wins, dy[0], zero), x), _reduce(select(x_wins, zero, dy[0]), y)]


def _g_minimum(op: Any, dy: list[Tensor]) -> list[Tensor]:
    x, y = op.inputs
    zero = zeros_like(dy[0])
    x_wins = make1("LessEqual", [x, y])
    return [_reduce(select(x_wins, dy[0], zero), x), _reduce(select(x_wins, zero, dy[0]), y)]


def _g_select(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    c, a, b = op.inputs
    zero = zeros_like(dy[0])
    return [None, _reduce(select(c, dy[0], zero), a), _reduce(select(c, zero, dy[0]), b)]


def _g_cast(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    x = op.inputs[0]
    if is_float(x.dtype) and is_float(op.outputs[0].dtype):
        return [cast(dy[0], x.dtype)]
    return [None]


def _g_floormod(op: Any, dy: list[Tensor]) -> list[Tensor]:
    # mod(x, y) = x - floor(x / y) * y: d/dx = 1, d/dy = -floor(x / y) (away from the jumps).
    x, y = op.inputs
    return [_reduce(dy[0], x), _reduce(neg(dy[0] * floor(x / y)), y)]


def _g_truncatemod(op: Any, dy: list[Tensor]) -> list[Tensor]:
    # mod(x, y) = x - trunc(x / y) * y: d/dx = 1, d/dy = -trunc(x / y), the whole number
    # (x - mod) / y (rounded: the division may miss it by an ulp).
    x, y = op.inputs
    return [_reduce(dy[0], x), _reduce(neg(dy[0] * round_((x - op.outputs[0]) / y)), y)]


_UNARY_GRADS = {
    "Neg": lambda op, dy: [neg(dy[0])],
    "Exp": lambda op, dy: [dy[0] * op.outputs[0]],
    "Log": lambda op, dy: [dy[0] / op.inputs[0]],
    "Sqrt": lambda op, dy: [dy[0] * 0.5 / op.outputs[0]],
    "Rsqrt": lambda op, dy: [dy[0] * -0.5 * op.outputs[0] * op.outputs[0] * op.outputs[0]],
    "Square": lambda op, dy: [dy[0] * 2.0 * op.inputs[0]],
    "Relu": lambda op, dy: [make1("ReluGrad", [dy[0], op.outputs[0]])],
    "Sigmoid": lambda op, dy: [make1("SigmoidGrad", [dy[0], op.outputs[0]])],
    "Tanh": lambda op, dy: [make1("TanhGrad", [dy[0], op.outputs[0]])],
    "Abs": lambda op, dy: [dy[0] * sign(op.inputs[0])],
    "Sign": lambda op, dy: [zeros_like(op.inputs[0])],
    # d erf(x) = 2/sqrt(pi) exp(-x^2)
    "Erf": lambda op, dy: [dy[0] * 1.1283791670955126 * exp(neg(square(op.inputs[0])))],
    "Sin": lambda op, dy: [dy[0] * cos(op.inputs[0])],
    "Cos": lambda op, dy: [neg(dy[0] * sin(op.inputs[0]))],
    **{_r: (lambda op, dy: [zeros_like(op.inputs[0])]) for _r in ROUNDING},
}


def _erf_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
              attrs: dict[str, Any]) -> tuple[float, float]:
    """The kernel (kernels/elementwise.py `erf`) evaluates a 60-term series and an 80-term continued
    fraction for every element: about 3 * 60 + 2 * 80 + 10 operations."""
    flops, nbytes = elementwise_cost(ins, outs, dtypes, attrs)
    return 350.0 * flops, nbytes


for _name in ("Erf", "Sin", "Cos") + ROUNDING:
    register_op(_name, _float_unary_infer, num_inputs=1, group=ELEMENTWISE, grad=_UNARY_GRADS[_name],
                cost=_erf_cost if _name == "Erf" else elementwise_cost)
for _name in FLOAT_TESTS:
    register_op(_name, _float_test_infer, num_inputs=1, group=ELEMENTWISE, differentiable=False)

# Element-wise ops whose output may take an input's buffer (OpDef.forward): exactly rounded ones.
_FORWARD_UNARY = ("Neg", "Square", "Abs", "Relu")
_FORWARD_BINARY = ("Add", "Sub", "Mul", "Div", "Maximum", "Minimum")

for _name in UNARY:
    register_op(_name, _float_unary_infer if _name not in ("Neg", "Abs", "Sign", "Square") else _numeric_unary_infer,
                num_inputs=1, group=ELEMENTWISE, grad=_UNARY_GRADS[_name],
                forward=(0,) if _name in _FORWARD_UNARY else ())

for _name, _g in zip(BINARY + ("FloorMod", "TruncateMod"),
                     (_g_add, _g_sub, _g_mul, _g_div, _g_pow, _g_maximum, _g_minimum, _g_floormod, _g_truncatemod)):
    # Maximum / Minimum of bools are or / and, as numpy gives them; the rest is arithmetic.
    register_op(_name, _binary_infer if _name in ("Maximum", "Minimum") else _arith_infer, num_inputs=2,
                group=ELEMENTWISE, grad=_g, forward=(0, 1) if _name in _FORWARD_BINARY else ())
# A step function of its inputs: no gradient passes through it (TensorFlow's FloorDiv has none either).
register_op("FloorDiv", _arith_infer, num_inputs=2, group=ELEMENTWISE, differentiable=False)

for _name in COMPARE:
    register_op(_name, _compare_infer, num_inputs=2, group=ELEMENTWISE, differentiable=False)

# Second derivatives: each fused gradient op is linear in dy, and its derivative in y is elementwise.
_SECOND_ORDER = {
    "ReluGrad": lambda op, g: [make1("ReluGrad", [g[0], op.inputs[1]]), zeros_like(op.inputs[1])],
    "SigmoidGrad": lambda op, g: [make1("SigmoidGrad", [g[0], op.inputs[1]]),
                                  g[0] * op.inputs[0] * (1.0 - 2.0 * op.inputs[1])],
    "TanhGrad": lambda op, g: [make1("TanhGrad", [g[0], op.inputs[1]]),
                               g[0] * op.inputs[0] * op.inputs[1] * -2.0],
}
for _name, _g2 in _SECOND_ORDER.items():
    register_op(_name, _grad_pair_infer, num_inputs=2, group=ELEMENTWISE, grad=_g2, forward=(0, 1))

register_op("Select", _select_infer, num_inputs=3, group=ELEMENTWISE, grad=_g_select)
register_op("Cast", _cast_infer, num_inputs=1, attrs={"dtype": ("dtype", "float32")}, group=ELEMENTWISE,
            grad=_g_cast)


def _bf16_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if ins[0].dtype != "float32":
        raise InferError(f"RoundBF16 rounds float32 values, got {ins[0].dtype}")
    return [ins[0]]


# bfloat16 emulated in float32 (training.precision bf16 on a backend without a bfloat16 array
# type): the value a cast to bfloat16 and back would give. Its gradient is what a bfloat16 Cast's
# would be, the incoming gradient rounded the same way (a straight-through rounding).
register_op("RoundBF16", _bf16_infer, num_inputs=1, group=ELEMENTWISE,
            grad=lambda op, dy: [make1("RoundBF16", [dy[0]])])
register_op("AddN", _addn_infer, min_inputs=1, group=ELEMENTWISE,
            grad=lambda op, dy: [dy[0]] * len(op.inputs), forward=(0, 1))
register_op("ZerosLike", _unary_infer, num_inputs=1, group=ELEMENTWISE, cost=movement_cost,
            differentiable=False)
register_op("OnesLike", _unary_infer, num_inputs=1, group=ELEMENTWISE, cost=movement_cost,
            differentiable=False)
# ReduceTo(x, like): x summed over the axes along which it was broadcast to reach like's shape.
register_op("ReduceTo", _reduce_to_infer, num_inputs=2, group=ELEMENTWISE,
            grad=lambda op, dy: [make1("BroadcastLike", [dy[0], op.inputs[0]]), None])
register_op("BroadcastLike", lambda ins, a: [TensorSpec(ins[1].shape, ins[0].dtype)], num_inputs=2,
            group=ELEMENTWISE, grad=lambda op, dy: [_reduce(dy[0], op.inputs[0]), None])


# ---------------------------------------------------------------------------- Python API
def add(x: Any, y: Any, name: str | None = None) -> Tensor: return make1("Add", [x, y], name=name)
def sub(x: Any, y: Any, name: str | None = None) -> Tensor: return make1("Sub", [x, y], name=name)
def mul(x: Any, y: Any, name: str | None = None) -> Tensor: return make1("Mul", [x, y], name=name)
def div(x: Any, y: Any, name: str | None = None) -> Tensor:
    """x / y. Floats divide exactly; integers truncate toward zero (TensorFlow's and ONNX's Div:
    -7 / 2 = -3), keeping the integer dtype, so div(x, y) * y + truncatemod(x, y) == x; an integer
    division by zero gives 0."""
    return make1("Div", [x, y], name=name)


def floordiv(x: Any, y: Any, name: str | None = None) -> Tensor:
    """x // y, rounded toward minus infinity (Python's `//`, TensorFlow's FloorDiv: -7 // 2 = -4)
    for integers and floats alike, so floordiv(x, y) * y + mod(x, y) == x. It passes no gradient."""
    return make1("FloorDiv", [x, y], name=name)

def pow_(x: Any, y: Any, name: str | None = None) -> Tensor: return make1("Pow", [x, y], name=name)
def maximum(x: Any, y: Any, name: str | None = None) -> Tensor: return make1("Maximum", [x, y], name=name)
def minimum(x: Any, y: Any, name: str | None = None) -> Tensor: return make1("Minimum", [x, y], name=name)
def greater(x: Any, y: Any, name: str | None = None) -> Tensor: return make1("Greater", [x, y], name=name)
def less(x: Any, y: Any, name: str | None = None) -> Tensor: return make1("Less", [x, y], name=name)
def equal(x: Any, y: Any, name: str | None = None) -> Tensor: return make1("Equal", [x, y], name=name)
def neg(x: Any, name: str | None = None) -> Tensor: return make1("Neg", [x], name=name)
def exp(x: Any, name: str | None = None) -> Tensor: return make1("Exp", [x], name=name)
def log(x: Any, name: str | None = None) -> Tensor: return make1("Log", [x], name=name)
def sqrt(x: Any, name: str | None = None) -> Tensor: return make1("Sqrt", [x], name=name)
def rsqrt(x: Any, name: str | None = None) -> Tensor: return make1("Rsqrt", [x], name=name)
def square(x: Any, name: str | None = None) -> Tensor: return make1("Square", [x], name=name)
def relu(x: Any, name: str | None = None) -> Tensor: return make1("Relu", [x], name=name)
def sigmoid(x: Any, name: str | None = None) -> Tensor: return make1("Sigmoid", [x], name=name)
def tanh(x: Any, name: str | None = None) -> Tensor: return make1("Tanh", [x], name=name)
def abs_(x: Any, name: str | None = None) -> Tensor: return make1("Abs", [x], name=name)
def sign(x: Any, name: str | None = None) -> Tensor: return make1("Sign", [x], name=name)
def floor(x: Any, name: str | None = None) -> Tensor: return make1("Floor", [x], name=name)
def ceil(x: Any, name: str | None = None) -> Tensor: return make1("Ceil", [x], name=name)
def erf(x: Any, name: str | None = None) -> Tensor: return make1("Erf", [x], name=name)
def sin(x: Any, name: str | None = None) -> Tensor: return make1("Sin", [x], name=name)
def cos(x: Any, name: str | None = None) -> Tensor: return make1("Cos", [x], name=name)
def is_nan(x: Any, name: str | None = None) -> Tensor: return make1("IsNaN", [x], name=name)
def is_inf(x: Any, name: str | None = None) -> Tensor: return make1("IsInf", [x], name=name)


def round_(x: Any, name: str | None = None) -> Tensor:
    """Round to the nearest integer, halves to even (TensorFlow's and numpy's rule: 2.5 -> 2)."""
    return make1("Round", [x], name=name)


def mod(x: Any, y: Any, name: str | None = None) -> Tensor:
    """Floor modulo (TensorFlow's FloorMod, Python's %): the result takes the sign of y, and
    floordiv(x, y) * y + mod(x, y) == x. An integer remainder by zero gives 0."""
    return make1("FloorMod", [x, y], name=name)


floormod = mod


def truncatemod(x: Any, y: Any, name: str | None = None) -> Tensor:
    """Truncating remainder (TensorFlow's TruncateMod, C's % and fmod): the result takes the sign
    of x, and div(x, y) * y + truncatemod(x, y) == x for integers. An integer remainder by zero
    gives 0."""
    return make1("TruncateMod", [x, y], name=name)


def gelu(x: Any, name: str | None = None) -> Tensor:
    """x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2))), the exact (not tanh-approximated) GELU."""
    return make1("Mul", [make1("Mul", [x, 0.5]), 1.0 + erf(x * 0.7071067811865476)], name=name)


def gelu_tanh(x: Any, name: str | None = None) -> Tensor:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the tanh-approximated GELU (GPT-2's, and
    PyTorch's gelu(approximate="tanh")). A composite of element-wise ops, so its gradient and its
    ONNX form are theirs."""
    inner = (x + x * x * x * 0.044715) * 0.7978845608028654
    return make1("Mul", [make1("Mul", [x, 0.5]), 1.0 + tanh(inner)], name=name)


def zeros_like(x: Any, name: str | None = None) -> Tensor: return make1("ZerosLike", [x], name=name)
def ones_like(x: Any, name: str | None = None) -> Tensor: return make1("OnesLike", [x], name=name)


def select(cond: Any, a: Any, b: Any, name: str | None = None) -> Tensor:
    dtype = next((t.dtype for t in (a, b) if isinstance(t, Tensor)), None)
    from flowctl.engine.ops.api import convert

    g = graph_of(cond, a, b)
    return make1("Select", [cond, convert(a, g, dtype), convert(b, g, dtype)], name=name)


def round_bf16(x: Any, name: str | None = None) -> Tensor:
    """float32 rounded to the nearest bfloat16 (ties to even), kept as float32."""
    return make1("RoundBF16", [x], name=name)


def cast(x: Any, dtype: Any, name: str | None = None) -> Tensor:
    return make1("Cast", [x], {"dtype": as_dtype(dtype)}, name=name)


def add_n(xs: Sequence[Any], name: str | None = None) -> Tensor:
    return make1("AddN", list(xs), name=name)
