"""The FusedElementwise GPU body (flowctl/kernels/cuda/fused.py): one generated numba-cuda kernel per
program, run here in numba's CUDA simulator (conftest turns it on where there is no GPU) against the
generic body (kernels/fused.py, a launch per step: the reference), and on the launch ledger, where
a fused chain is ONE launch, captured and replayed. The gpu-marked test runs the same programs on
cupy.

Tolerances: the exactly rounded operations (+ - * /, sqrt, max/min, comparisons, casts, floor, ...)
give the generic body's bits, each product rounded on its own as numpy rounds it. The
transcendentals (exp, log, tanh -- so Sigmoid --, sin, cos, pow, erf) are CUDA's libdevice functions
on a GPU and numpy's float64 ones rounded in the simulator, while the generic body uses numpy's own
float32 loops and an erf series: they differ in the last ulp or two, so programs with one agree to
1e-6 relative in float32 and 1e-12 in float64, not bit for bit. A step that cancels (1 - y*y near
y = 1, x - y of close values) turns that ulp into a larger relative error of a small result; the
comparison's absolute floor is therefore the same tolerance times the size of the values the
program computes with (`_close`)."""
from __future__ import annotations

import contextlib
import json
import zlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("numba")

import flowctl as fc  # noqa: E402
import flowctl.kernels  # noqa: E402,F401
from flowctl.engine.graph import Graph  # noqa: E402
from flowctl.engine.ops.fused import parse_program  # noqa: E402
from flowctl.kernels.cuda import fused as gpu_fused  # noqa: E402
from flowctl.kernels import registry  # noqa: E402
from flowctl.kernels.cuda import jit  # noqa: E402
from flowctl.kernels.fused import fused_elementwise  # noqa: E402
from flowctl.kernels.ledger import Ledger  # noqa: E402
from flowctl.kernels.registry import KERNELS, bind, bind_into, chosen, override_array_module, reference_kernels  # noqa: E402

SIM = jit.simulated_module()
# Log of 0, 1 / sqrt(0), pow overflowing: numpy warns (in the generic body and in the simulator's
# scalar arithmetic), CUDA does not; the values are compared all the same.
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")]
RTOL = {"float32": 1e-6, "float64": 1e-12}
TRANSCENDENTAL = {"Exp", "Log", "Tanh", "Sigmoid", "Sin", "Cos", "Pow", "Erf"}


@pytest.fixture(autouse=True)
def _simulator(request):
    if "gpu" not in request.keywords and not jit.simulated():
        pytest.skip("numba's CUDA simulator is not enabled in this process")


def gpu_body(program: str, xp: Any = SIM):
    return KERNELS[("FusedElementwise", "gpu")](xp, {"program": program})


def generic(program: str):
    return KERNELS[("FusedElementwise", "cpu")](np, {"program": program})


# ------------------------------------------------------------------------------ programs
class Builder:
    """A random, well-typed program over inputs that broadcast against each other."""

    SHAPES = [(3, 4, 5), (4, 5), (5,), (), (3, 1, 5), (1, 4, 1), (3, 4, 1)]

    def __init__(self, rng: np.random.Generator, dtype: str) -> None:
        self.rng, self.dtype = rng, dtype
        self.inputs: list[tuple[str, tuple[int, ...]]] = []
        self.steps: list[dict[str, Any]] = []
        self.vals: list[str] = []  # dtype of every value so far: inputs first, then steps
        self.shapes: list[tuple[int, ...]] = []

    def input(self, dtype: str | None = None, shape: tuple[int, ...] | None = None) -> int:
        if self.steps:
            raise RuntimeError("inputs first")
        dt = dtype or self.dtype
        shape = shape if shape is not None else self.SHAPES[self.rng.integers(len(self.SHAPES))]
        self.inputs.append((dt, shape))
        self.vals.append(dt)
        self.shapes.append(shape)
        return len(self.vals) - 1

    def step(self, op: str, *args: int, dtype: str | None = None, attrs: dict | None = None) -> int:
        out = dtype or self.vals[args[0]]
        self.steps.append({"op": op, "attrs": attrs or {}, "args": list(args), "dtype": out,
                           "name": f"s{len(self.steps)}/{op}"})
        self.vals.append(out)
        self.shapes.append(np.broadcast_shapes(*(self.shapes[a] for a in args)))
        return len(self.vals) - 1

    def program(self) -> str:
        text = json.dumps({"inputs": [d for d, _ in self.inputs], "steps": self.steps})
        parse_program(text)  # the engine's own check: known ops, operands that exist
        return text

    def arrays(self, rng: np.random.Generator) -> list[np.ndarray]:
        out = []
        for dt, shape in self.inputs:
            if dt == "bool":
                out.append(rng.random(shape) < 0.5)
            elif dt.startswith("int"):
                out.append(rng.integers(-9, 10, size=shape).astype(dt))
            else:
                out.append((rng.standard_normal(shape) * 1.5).astype(dt))
        return out


UNARY = ["Neg", "Abs", "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Tanh", "Sigmoid", "Relu", "Sin", "Cos", "Floor",
         "Ceil", "Round", "Erf", "Sign"]
BINARY = ["Add", "Sub", "Mul", "Div", "Maximum", "Minimum", "Pow", "ReluGrad", "SigmoidGrad", "TanhGrad"]
COMPARE = ["Greater", "Less", "Equal", "GreaterEqual", "LessEqual"]
EXACT_UNARY = [u for u in UNARY if u not in TRANSCENDENTAL]
EXACT_BINARY = [b for b in BINARY if b not in TRANSCENDENTAL]


def random_program(rng: np.random.Generator, dtype: str, exact: bool, n_steps: int) -> Builder:
    b = Builder(rng, dtype)
    for _ in range(int(rng.integers(1, 4))):
        b.input()
    inputs = list(range(len(b.vals)))
    floats = list(inputs)  # what a step may read: an input (any number of times) or a step's result
    unary, binary = (EXACT_UNARY, EXACT_BINARY) if exact else (UNARY, BINARY)

    def take() -> int:
        # A tree, as the fusion pass makes: a step's result is read by one later step only (the
        # generic body reuses an intermediate's buffer for the step that reads it).
        v = floats[int(rng.integers(len(floats)))]
        if v not in inputs:
            floats.remove(v)
        return v

    while len(b.steps) < n_steps:
        pick = rng.random()
        x, y = take(), take()
        if pick < 0.45:
            op = unary[int(rng.integers(len(unary)))]
            if op in ("Sqrt", "Rsqrt", "Log"):  # keep to the domain: a NaN hides everything after it
                x = b.step("Abs", x)
            if op in ("Exp", "Sin", "Cos"):
                x = b.step("Tanh" if not exact else "Relu", x)
            v = b.step(op, x)
        elif pick < 0.8:
            op = binary[int(rng.integers(len(binary)))]
            if op == "Pow":
                x = b.step("Abs", x)
            v = b.step(op, x, y)
        elif pick < 0.9:  # through a bool: a comparison selecting between two values
            c = b.step(COMPARE[int(rng.integers(len(COMPARE)))], x, y)
            v = b.step("Select", c, take(), take())
        else:  # a round trip through the other float dtype, or AddN
            if rng.random() < 0.5:
                other = "float64" if dtype == "float32" else "float32"
                v = b.step("Cast", b.step("Cast", x, dtype=other, attrs={"dtype": other}), dtype=dtype,
                           attrs={"dtype": dtype})
            else:  # AddN's operands share a shape
                alike = [f for f in inputs if b.shapes[f] == b.shapes[x]]
                v = b.step("AddN", x, *(alike[int(i)] for i in rng.integers(len(alike), size=2)))
                floats.append(y)  # not read after all
        floats.append(v)
    # Everything reaches the output, as in the fusion pass's trees: what no step read is added in.
    read = {a for s in b.steps for a in s["args"]}
    rest = [f for f in floats if f not in read]
    while len(rest) > 1:
        rest = [b.step("Add", rest[0], rest[1])] + rest[2:]
    return b


def _close(got: np.ndarray, want: np.ndarray, dtype: str, scale: float) -> None:
    rtol = RTOL[dtype]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, equal_nan=True)


def _scale(b: Builder, arrays: list[np.ndarray]) -> float:
    """The size of the values a program computes with: the largest finite magnitude of every step's
    result (the generic body, step by step)."""
    vals = list(arrays)
    big = max([float(np.max(np.abs(a[np.isfinite(a)]), initial=0)) for a in arrays if a.dtype.kind == "f"] + [1.0])
    for s in b.steps:
        one = json.dumps({"inputs": [str(vals[a].dtype) for a in s["args"]],
                          "steps": [{**s, "args": list(range(len(s["args"])))}]})
        r = np.asarray(generic(one)(*(vals[a] for a in s["args"])))
        vals.append(r)
        if r.dtype.kind == "f" and np.isfinite(r).any():
            big = max(big, float(np.max(np.abs(r[np.isfinite(r)]))))
    return big


def _check(b: Builder, arrays: list[np.ndarray], xp: Any = SIM, to_host=lambda a: a) -> None:
    text = b.program()
    with np.errstate(all="ignore"):
        want = np.asarray(generic(text)(*arrays))
    got = np.asarray(to_host(gpu_body(text, xp)(*(xp.asarray(a) for a in arrays))))
    assert got.shape == want.shape and got.dtype == want.dtype
    ops = {s["op"] for s in b.steps}
    dtype = b.dtype
    if ops & TRANSCENDENTAL and dtype in RTOL:
        _close(got, want, dtype, _scale(b, arrays))
    else:
        np.testing.assert_array_equal(got, want)  # exactly rounded steps only: the generic body's bits


# ------------------------------------------------------------------------------ every op in the table
def _one_op(op: str, dtype: str, rng: np.random.Generator) -> Builder:
    """A program around `op` whose inputs broadcast: (3, 4, 5) against (4, 5), (5,) and ()."""
    b = Builder(rng, dtype)
    x, y, z = b.input(shape=(3, 4, 5)), b.input(shape=(4, 5)), b.input(shape=())
    if op in ("Select",):
        c = b.step("Greater", x, y)
        v = b.step(op, c, x, y)
    elif op in COMPARE:
        c = b.step(op, x, b.step("Round", y) if dtype in RTOL else y)  # some ties for Equal / *Equal
        v = b.step("Select", c, x, z)
    elif op in ("IsNaN", "IsInf"):
        c = b.step(op, b.step("Log", b.step("Sub", x, y)))  # log of negatives: NaN, of 0: -inf
        v = b.step("Select", c, y, x)
    elif op == "Cast":
        other = "float64" if dtype == "float32" else "float32"
        wide = b.step("Cast", b.step("Cast", x, dtype=other, attrs={"dtype": other}), dtype=dtype,
                      attrs={"dtype": dtype})
        ints = b.step("Cast", b.step("Mul", y, z), dtype="int32", attrs={"dtype": "int32"})
        back = b.step("Cast", b.step("Cast", ints, dtype="bool", attrs={"dtype": "bool"}), dtype=dtype,
                      attrs={"dtype": dtype})
        v = b.step("Add", wide, back)
    elif op == "AddN":
        v = b.step(op, x, b.step("Neg", x), b.step("Square", x))
    elif op in ("ZerosLike", "OnesLike"):
        v = b.step("Add", b.step(op, y), x)
    elif op in ("Sqrt", "Rsqrt", "Log"):
        v = b.step(op, b.step("Abs", b.step("Mul", x, y)))
    elif op in ("ReluGrad", "SigmoidGrad", "TanhGrad"):
        act = {"ReluGrad": "Relu", "SigmoidGrad": "Sigmoid", "TanhGrad": "Tanh"}[op]
        v = b.step(op, x, b.step(act, y))
    elif op == "Pow":
        v = b.step(op, b.step("Abs", x), y)
    elif op in BINARY:
        v = b.step(op, b.step("Mul", x, z), y)
    else:
        v = b.step(op, b.step("Mul", x, y) if dtype in RTOL else x)
    if b.vals[v] != dtype:
        raise AssertionError(f"{op}: the program ends in {b.vals[v]}")
    return b


INT_OPS = ["Add", "Sub", "Mul", "Maximum", "Minimum", "Neg", "Abs", "Square", "Sign", "Select", "AddN", "ZerosLike",
           "OnesLike"] + COMPARE


@pytest.mark.parametrize("op", sorted(gpu_fused.OPS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_op_in_the_table_matches_the_generic_body(op, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{op} {dtype}".encode()))
    b = _one_op(op, dtype, rng)
    assert gpu_fused.unsupported(b.program()) is None
    arrays = b.arrays(rng)
    arrays[0].flat[:3] = [0.0, -0.0, 2.5]  # signed zeros and a tie for the rounding ops
    _check(b, arrays)


@pytest.mark.parametrize("op", INT_OPS)
def test_integer_programs_match_bit_for_bit(op):
    rng = np.random.default_rng(7)
    for dtype in ("int32", "int64"):
        if op in ("Sign", "Abs", "Neg", "Square"):
            b = Builder(rng, dtype)
            x, y = b.input(shape=(3, 4, 5)), b.input(shape=(5,))
            b.step("Add", b.step(op, x), y)
        else:
            b = _one_op(op, dtype, rng)
        assert gpu_fused.unsupported(b.program()) is None, op
        _check(b, b.arrays(rng))


def test_the_table_covers_the_element_wise_ops_a_training_step_fuses():
    for op in ("Add", "Sub", "Mul", "Div", "Maximum", "Minimum", "Relu", "ReluGrad", "Sigmoid", "SigmoidGrad", "Tanh",
               "TanhGrad", "Exp", "Log", "Sqrt", "Rsqrt", "Square", "Neg", "Cast", "Select", "Erf", "AddN", "Greater",
               "Pow", "Abs", "Sign"):
        assert op in gpu_fused.OPS, op


# ------------------------------------------------------------------------------ random programs
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "transcendental"])
def test_random_programs_match_the_generic_body(dtype, exact):
    for seed in range(12):
        rng = np.random.default_rng(seed)
        b = random_program(rng, dtype, exact, 8)
        _check(b, b.arrays(rng))


def test_broadcast_layout_merges_axes_that_every_input_walks_alike():
    # same shapes: one flat axis; a bias against (N, C): two; a scalar: stride 0 everywhere
    assert gpu_fused.layout([(6, 4), (6, 4)], (6, 4)) == ([24], [[1], [1]])
    assert gpu_fused.layout([(6, 4), (4,), ()], (6, 4)) == ([6, 4], [[4, 1], [0, 1], [0, 0]])
    assert gpu_fused.layout([(2, 3, 4), (2, 1, 4)], (2, 3, 4)) == ([2, 3, 4], [[12, 4, 1], [4, 0, 1]])
    assert gpu_fused.layout([(2, 3, 4), (3, 4)], (2, 3, 4)) == ([2, 12], [[12, 1], [0, 1]])
    assert gpu_fused.layout([(1, 5, 1), (1, 1, 1)], (1, 5, 1)) == ([5], [[1], [0]])
    assert gpu_fused.layout([(), ()], ()) == ([1], [[0], [0]])


def test_a_program_compiles_once_and_its_source_is_one_expression_per_step():
    b = Builder(np.random.default_rng(0), "float32")
    x, bias, c = b.input(shape=(6, 4)), b.input(shape=(4,)), b.input(shape=())
    b.step("Relu", b.step("Add", b.step("Mul", x, bias), c))
    text = b.program()
    src = gpu_fused.source(text, rank=2)
    assert src.count("  # ") == 3 and "i1 = q % d1" in src and "out[t] = v2" in src
    fn = gpu_body(text)
    rng = np.random.default_rng(1)
    arrays = b.arrays(rng)
    before = gpu_fused._compiled.cache_info()
    for _ in range(3):
        fn(*arrays)
    after = gpu_fused._compiled.cache_info()
    assert after.currsize - before.currsize <= 1 and after.hits - before.hits >= 2


def test_dead_steps_are_not_computed_and_do_not_shape_the_output():
    b = Builder(np.random.default_rng(0), "float32")
    x, big = b.input(shape=(5,)), b.input(shape=(3, 5))
    b.step("Exp", big)  # read by nothing
    b.step("Neg", b.step("Square", x))
    text = b.program()
    assert "Exp" not in gpu_fused.source(text) and "x1" not in gpu_fused.source(text)
    _check(b, b.arrays(np.random.default_rng(2)))


# ------------------------------------------------------------------------------ the generic body instead
@pytest.mark.parametrize("program", [
    {"inputs": ["float32", "float32"], "steps": [{"op": "Mul", "args": [0, 1], "dtype": "float32", "name": "m"},
                                                 {"op": "FloorMod", "args": [2, 1], "dtype": "float32", "name": "f"}]},
    {"inputs": ["int32", "int32"], "steps": [{"op": "Div", "args": [0, 1], "dtype": "int32", "name": "d"},
                                             {"op": "Neg", "args": [2], "dtype": "int32", "name": "n"}]},
    {"inputs": ["float16", "float16"], "steps": [{"op": "Mul", "args": [0, 1], "dtype": "float16", "name": "m"},
                                                 {"op": "Relu", "args": [2], "dtype": "float16", "name": "r"}]},
    {"inputs": ["float32"], "steps": [{"op": "RoundBF16", "args": [0], "dtype": "float32", "name": "r"},
                                      {"op": "Neg", "args": [1], "dtype": "float32", "name": "n"}]},
], ids=["FloorMod", "integer Div", "float16", "RoundBF16"])
def test_a_step_outside_the_table_makes_the_node_take_the_generic_body(program):
    text = json.dumps({**program, "steps": [{"attrs": {}, **s} for s in program["steps"]]})
    parse_program(text)
    assert gpu_fused.unsupported(text) is not None
    led = Ledger()
    fn = gpu_body(text, led)
    dtype = program["inputs"][0]
    a = led.asarray((np.arange(1, 7) * 1.7).astype(dtype).reshape(2, 3))
    b = led.asarray(np.full(3, 2, dtype=dtype))
    led.reset_counts()
    got = fn(a, b)[...] if len(program["inputs"]) == 2 else fn(a)
    assert led.counts["custom"] == 0 and led.counts["launches"] >= 2  # a launch per step
    want = generic(text)(*(np.asarray(v) for v in ((a, b) if len(program["inputs"]) == 2 else (a,))))
    np.testing.assert_array_equal(np.asarray(got), want)


# ------------------------------------------------------------------------------ on the launch ledger
def _chain_program() -> tuple[Builder, str]:
    """bias + ReLU, then a gelu_tanh-like tail: six steps, inputs (N, C), (C,) and a scalar."""
    b = Builder(np.random.default_rng(0), "float32")
    x, bias, c = b.input(shape=(8, 6)), b.input(shape=(6,)), b.input(shape=())
    v = b.step("Relu", b.step("Add", x, bias))
    v = b.step("Mul", b.step("Tanh", b.step("Mul", v, c)), b.step("Sigmoid", x))
    return b, b.program()


def test_a_fused_chain_is_one_launch_on_the_ledger_and_captures():
    b, text = _chain_program()
    assert len(b.steps) == 6
    led = Ledger()
    arrays = b.arrays(np.random.default_rng(3))
    dev = [led.asarray(a) for a in arrays]
    fused, unfused = gpu_body(text, led), fused_elementwise(led, {"program": text})
    fused(*dev), unfused(*dev)  # warm-up: the pool has the blocks
    led.reset_counts()
    want = unfused(*dev)
    # the generic body: a launch per step, Sigmoid's four (0.5 x, tanh, 1 + t, 0.5 (...))
    assert led.counts["launches"] == 9 and led.counts["custom"] == 0
    led.reset_counts()
    got = fused(*dev)
    assert (led.counts["launches"], led.counts["custom"]) == (1, 1)
    assert (led.counts["syncs"], led.counts["h2d"], led.counts["allocations"]) == (0, 0, 0)
    _close(np.asarray(got), np.asarray(want), "float32", _scale(b, arrays))

    with led.capture() as cap:  # inside a capture: no sync, no host copy, one graph node
        out = fused(*dev)
    assert cap.graph.nodes == 1 and cap.graph.names() == ["fused_elementwise"]
    first = np.asarray(out).copy()
    new = np.random.default_rng(4).standard_normal(arrays[0].shape).astype("float32")
    dev[0][...] = led.asarray(new)  # new values in the captured input buffer
    cap.graph.launch()  # the replay recomputes from the same buffers
    assert not np.array_equal(np.asarray(out), first)
    _close(np.asarray(out), generic(text)(new, *arrays[1:]), "float32", _scale(b, [new, *arrays[1:]]))


def test_a_fused_graph_node_on_a_gpu_session_is_one_launch():
    """The fusion pass on a graph, run in a GPU session on the ledger: the chain's 5 ops (8 generic
    launches) are one launch."""
    from flowctl.engine.fusion import fuse, fused_nodes

    def build() -> Graph:
        g = Graph()
        with g.as_default():
            a = fc.placeholder("float32", (None, 5), name="a")
            bias = fc.constant(np.linspace(-1, 1, 5, dtype=np.float32), name="b")
            h = fc.relu(fc.add(fc.mul(a, bias), 0.25), name="h")
            fc.reduce_sum(fc.sigmoid(fc.square(h)), name="z")
        return g

    x = np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32)
    counts, results = [], []
    for fused, reference in ((False, True), (False, False), (True, False)):
        g = build()
        if fused:
            fuse(g, keep={"a", "z"})
            assert len(fused_nodes(g)) == 1
        led = Ledger()
        with override_array_module("gpu", led), reference_kernels(reference):
            sess = fc.Session(g, device="gpu:0", capture=False)
            sess.run("z:0", {"a:0": x})
            led.reset_counts()
            results.append(float(sess.run("z:0", {"a:0": x})))
        counts.append(led.counts["launches"])
    # Mul, Add, Relu, Square and Sigmoid (four launches of its generic kernel) then the sum: 9
    # launches; with Sigmoid's GPU variant (one generated launch) 6; fused, 2
    assert counts == [9, 6, 2]
    assert results[1] == pytest.approx(results[0], rel=1e-6)
    assert results[2] == pytest.approx(results[0], rel=1e-6)


# ------------------------------------------------------------------------------ single ops
def _generic_launches(op: str, dtype: str, n_inputs: int) -> int:
    """Launches of the op's generic GPU kernel on the ledger (the reference the variant replaces)."""
    led = Ledger()
    attrs = {"dtype": "float64" if dtype == "float32" else "float32"} if op == "Cast" else {}
    fn = KERNELS[(op, "gpu")](led, attrs)
    rng = np.random.default_rng(0)
    xs = [led.asarray(np.abs(rng.standard_normal((4, 5))).astype(dtype)) for _ in range(n_inputs)]
    if op == "Select":
        xs[0] = led.asarray(np.arange(20).reshape(4, 5) % 2 == 0)
    fn(*xs)
    led.reset_counts()
    fn(*xs)
    return led.counts["launches"]


ARITY = {"Select": 3, "AddN": 3, **{op: 2 for op in BINARY + COMPARE}}


def test_the_single_op_list_is_every_op_whose_generic_kernel_is_more_than_one_launch():
    """Measured on the ledger for every op in the table: those of more than one launch are exactly
    SINGLE_LAUNCHES, with its counts (float32; Erf's series in float64 is 2 casts fewer)."""
    counts = {op: _generic_launches(op, "float32", ARITY.get(op, 1)) for op in gpu_fused.OPS}
    assert {op: n for op, n in counts.items() if n > 1} == gpu_fused.SINGLE_LAUNCHES
    assert _generic_launches("Erf", "float64", 1) == gpu_fused.SINGLE_LAUNCHES["Erf"] - 2
    assert _generic_launches("AddN", "float32", 2) == 1 and _generic_launches("AddN", "float32", 5) == 4


def _single_inputs(op: str, dtype: str, rng: np.random.Generator) -> list[np.ndarray]:
    """The node's inputs: binary ops broadcast (dy (3, 4, 5) against y (4, 5)); y in the range its
    activation gives; zeros, a negative zero and Erf's both regimes (|x| above and below 2.5)."""
    x = (rng.standard_normal((3, 4, 5)) * 2.5).astype(dtype)
    x.flat[:4] = [0.0, -0.0, 2.5, -3.75]
    if op == "Rsqrt":
        return [np.abs(x)]
    if op == "AddN":
        return [x, (rng.standard_normal(x.shape)).astype(dtype), (rng.standard_normal(x.shape) * 3).astype(dtype)]
    if op.endswith("Grad"):
        y = rng.standard_normal((4, 5)).astype(dtype)
        y = {"ReluGrad": np.maximum(y, 0), "SigmoidGrad": 1 / (1 + np.exp(-y)), "TanhGrad": np.tanh(y)}[op]
        return [x, y.astype(dtype)]
    return [x]


def _specs(arrays: list[np.ndarray]) -> list[Any]:
    return [SimpleNamespace(dtype=str(a.dtype), shape=tuple(a.shape)) for a in arrays]


def _single_close(op: str, got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if op in TRANSCENDENTAL:  # Erf (libdevice's / math.erf against the series), Sigmoid's tanh
        _close(got, want, str(want.dtype), max(1.0, float(np.max(np.abs(want)))))
    else:
        np.testing.assert_array_equal(got, want)  # exactly rounded: the generic kernel's bits


@pytest.mark.parametrize("op", sorted(gpu_fused.SINGLE_LAUNCHES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_single_op_node_on_a_gpu_is_one_generated_launch_with_the_generic_values(op, dtype):
    rng = np.random.default_rng(zlib.crc32(f"single {op} {dtype}".encode()))
    arrays = _single_inputs(op, dtype, rng)
    specs = _specs(arrays)
    assert chosen(op, "gpu", {}, specs).name == "generated"
    with np.errstate(all="ignore"):
        want = np.asarray(KERNELS[(op, "gpu")](np, {})(*arrays))  # the generic kernel
    led = Ledger()
    dev = [led.asarray(a) for a in arrays]
    with override_array_module("gpu", led):
        fn = bind(op, "gpu", {}, specs)
        with reference_kernels():
            ref = bind(op, "gpu", {}, specs)
    fn(*dev), ref(*dev)
    led.reset_counts()
    got = fn(*dev)
    assert (led.counts["launches"], led.counts["custom"], led.counts["syncs"]) == (1, 1, 0)
    _single_close(op, np.asarray(got), want)
    led.reset_counts()
    ref(*dev)
    generic_launches = gpu_fused.SINGLE_LAUNCHES[op] - (2 if (op, dtype) == ("Erf", "float64") else 0)
    assert (led.counts["launches"], led.counts["custom"]) == (generic_launches, 0)
    with led.capture() as cap:  # capturable: one graph node
        fn(*dev)
    assert cap.graph.nodes == 1


@pytest.mark.parametrize("op", sorted(gpu_fused.SINGLE_LAUNCHES))
def test_a_single_op_forwards_its_buffer_through_the_same_generated_kernel(op):
    """The in-place kernel bound beside the variant writes the same values into input 0's buffer, in
    one launch; the reference's in-place kernel (several launches) is not used."""
    rng = np.random.default_rng(zlib.crc32(f"into {op}".encode()))
    arrays = _single_inputs(op, "float32", rng)
    specs = _specs(arrays)
    led = Ledger()
    with override_array_module("gpu", led):
        fn, fn_into = bind(op, "gpu", {}, specs), bind_into(op, "gpu", {}, specs)
    want = np.asarray(fn(*(led.asarray(a) for a in arrays))).copy()
    dev = [led.asarray(a) for a in arrays]
    led.reset_counts()
    got = fn_into(0, *dev)
    assert got is dev[0] and (led.counts["launches"], led.counts["custom"], led.counts["allocations"]) == (1, 1, 0)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("op", sorted(gpu_fused.SINGLE_LAUNCHES))
def test_float16_and_mixed_dtypes_keep_the_generic_kernel(op):
    arrays = [a.astype("float16") for a in _single_inputs(op, "float32", np.random.default_rng(0))]
    assert chosen(op, "gpu", {}, _specs(arrays)) is None
    if len(arrays) > 1:
        assert chosen(op, "gpu", {}, _specs([arrays[0].astype("float32"), *arrays[1:]])) is None
    led = Ledger()
    with override_array_module("gpu", led):
        fn = bind(op, "gpu", {}, _specs(arrays))
        fn_into = bind_into(op, "gpu", {}, _specs(arrays))
    dev = [led.asarray(a) for a in arrays]
    fn(*dev)
    led.reset_counts()
    got = fn(*dev)
    assert led.counts["custom"] == 0 and led.counts["launches"] == gpu_fused.SINGLE_LAUNCHES[op]
    np.testing.assert_array_equal(np.asarray(got), KERNELS[(op, "gpu")](np, {})(*arrays))
    if fn_into is not None:  # the reference's own in-place kernel
        led.reset_counts()
        fn_into(0, *dev)
        assert led.counts["custom"] == 0


def test_addn_of_two_inputs_and_ops_of_one_launch_keep_the_generic_kernel():
    two = _specs([np.zeros((3, 4), np.float32)] * 2)
    assert chosen("AddN", "gpu", {}, two) is None and chosen("AddN", "gpu", {}, two * 2).name == "generated"
    # clip_norm's AddN over Inception-v3's 190 gradient norms: one nested expression would be past
    # what Python's parser takes ("too many nested parentheses"): the generic kernel.
    many = _specs([np.zeros((), np.float32)] * 190)
    assert chosen("AddN", "gpu", {}, many) is None
    for op in ("Add", "Mul", "Relu", "Tanh", "Exp", "Div", "Cast"):
        assert chosen(op, "gpu", {}, two) is None
    with reference_kernels():
        assert chosen("Sigmoid", "gpu", {}, two[:1]) is None
    assert chosen("Sigmoid", "cpu", {}, two[:1]) is None  # the CPU keeps its kernels


# ------------------------------------------------------------------------------ a training step
MLP = """
version: 1
model:
  layers:
    - {name: x, type: input, shape: [6]}
    - {name: h1, type: dense, units: 8, activation: gelu_tanh}
    - {name: h2, type: dense, units: 8, activation: gelu}
    - {name: out, type: dense, units: 3}
    - {name: label, type: input, shape: [], dtype: int32, classes: 3}
    - {name: loss, type: softmax_cross_entropy, inputs: [out, label]}
training: {fuse: FUSE, optimizer: {type: momentum, momentum: 0.9}}
"""


def _train(fuse: bool, capture: bool, steps: int = 4, clip: bool = False, device: str = "gpu",
           graphs: list[Graph] | None = None) -> tuple[list[float], list[dict[str, int]], list[list[str]]]:
    """An MLP's training step (gelu activations, clipping: the fused trees of a real step) in a GPU
    session on the ledger (or a CPU session: no counts): each step's loss and counts, and the fused
    programs' ops. `graphs` gets the step's graph."""
    from flowctl.bench.peers import Row, _batch, _load
    from flowctl.engine.container import ContainerStore
    from flowctl.spec.model import build_model
    from flowctl.training.program import build_step, step_config

    spec = MLP.replace("FUSE", "true" if fuse else "false")
    if clip:  # the global norm's scale fuses too (Mul, Sqrt, Maximum, Div); L2Loss is slow in the simulator
        spec = spec.replace("training: {", "training: {clip_norm: 1.0, ")
    loaded = _load(Row("mlp", spec, 4))
    step = build_step(build_model(loaded, training=True), step_config(loaded))
    programs = [[s["op"] for s in json.loads(n.attrs["program"])["steps"]] for n in step.graph.nodes.values()
                if n.op == "FusedElementwise"]
    if graphs is not None:
        graphs.append(step.graph)
    led = Ledger()
    losses, counts = [], []
    with override_array_module("gpu", led) if device == "gpu" else contextlib.nullcontext():
        sess = fc.Session(step.graph, device=f"{device}:0", store=ContainerStore(), capture=capture)
        sess.run(step.model.initializer())
        arrays = _batch(loaded, 4)
        for n in range(steps):
            feeds = {step.lr: np.asarray(0.1, dtype=step.lr.dtype)}
            for k, v in arrays.items():
                if k in step.model.inputs:
                    feeds[step.model.inputs[k]] = v + np.float32(0.05 * n) if v.dtype.kind == "f" else v
            led.reset_counts()
            losses.append(float(sess.run([step.train.loss, step.train.train_op], feeds)[0]))
            counts.append(dict(led.counts))
    return losses, counts, programs


@pytest.mark.parametrize("clip", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "clip_norm"])
def test_a_fused_training_step_on_the_ledger_gives_the_unfused_loss_in_fewer_launches(monkeypatch, clip):
    # what the fusion pass saves, against the generic kernels (the single-op variants, below, off:
    # the nodes fusion absorbs would otherwise be launches of ours in the unfused step)
    monkeypatch.setattr(registry, "_reference_only", {"on": True})
    # ... and MultiL2Loss's pass off: the launches it saves are not fusion's (the fusion pass leaves
    # clip_norm's AddN of L2Loss terms to it: test_fusion_leaves_the_sum_of_l2_losses_to_multi_l2)
    from flowctl.engine import multi_l2

    monkeypatch.setattr(multi_l2, "ENABLED", False)
    unfused, c_unfused, none = _train(fuse=False, capture=False, clip=clip)
    fused, c_fused, programs = _train(fuse=True, capture=False, clip=clip)
    assert none == [] and len(programs) >= 2 + clip and max(len(p) for p in programs) >= 5, programs
    # float32, and the fused Exp / Tanh are not numpy's: the same loss to 1e-6 relative
    np.testing.assert_allclose(fused, unfused, rtol=1e-6)
    saved = sum(len(p) - 1 for p in programs)
    assert c_fused[-1]["launches"] <= c_unfused[-1]["launches"] - saved
    assert c_fused[-1]["custom"] - c_unfused[-1]["custom"] == len(programs)  # one kernel of ours per node

    # the same fused graph with the generic body: a launch per step again
    monkeypatch.setitem(KERNELS, ("FusedElementwise", "gpu"), fused_elementwise)
    generic_losses, c_generic, _ = _train(fuse=True, capture=False, clip=clip)
    assert c_generic[-1]["launches"] - c_fused[-1]["launches"] >= saved
    np.testing.assert_allclose(generic_losses, unfused, rtol=1e-6)


def test_an_unfused_gelu_step_runs_each_multi_launch_op_in_one_launch_with_the_cpu_loss():
    """The MLP's training step without the fusion pass, in a GPU session on the ledger: each node of
    an op in SINGLE_LAUNCHES (gelu's Erf, its gradient's ops, ...) is one generated launch instead of
    its generic kernel's, and the losses are the CPU session's to 1e-6."""
    cpu, _, _ = _train(fuse=False, capture=False, device="cpu")
    with reference_kernels():
        before, c_before, _ = _train(fuse=False, capture=False)
    graphs: list[Graph] = []
    after, c_after, _ = _train(fuse=False, capture=False, graphs=graphs)
    np.testing.assert_allclose(before, cpu, rtol=1e-6)
    np.testing.assert_allclose(after, cpu, rtol=1e-6)
    g = graphs[0]
    nodes = [(n.op, len(n.inputs)) for n in g.nodes.values()
             if chosen(n.op, "gpu", n.attrs, g.input_specs(n)) is not None]
    assert "Erf" in {op for op, _ in nodes}
    saved = sum((k - 1 if op == "AddN" else gpu_fused.SINGLE_LAUNCHES[op]) - 1 for op, k in nodes)
    assert c_before[-1]["launches"] - c_after[-1]["launches"] == saved
    assert c_after[-1]["custom"] - c_before[-1]["custom"] == len(nodes)

def test_a_fused_training_step_is_captured_and_replays_its_uncaptured_losses():
    eager, _, _ = _train(fuse=True, capture=False, steps=5)
    captured, counts, _ = _train(fuse=True, capture=True, steps=5)
    assert captured == eager  # the same kernels, replayed from the graph: bit for bit
    replay = counts[-1]
    assert (replay["launches"], replay["allocations"], replay["graph_launches"]) == (0, 0, 1), replay


# ------------------------------------------------------------------------------ on a real GPU
@pytest.mark.gpu
def test_on_a_gpu_every_op_and_random_programs_match_the_generic_body():
    """The same programs compiled by numba for the device and run on cupy arrays: libdevice's
    transcendentals within the tolerances above, the exactly rounded steps bit for bit (products
    through fmul_rn / dmul_rn: no contraction into an FMA)."""
    import cupy

    from flowctl.kernels.cuda.xp import device_module

    xp = device_module(cupy)
    for dtype in ("float32", "float64"):
        for op in sorted(gpu_fused.OPS):
            rng = np.random.default_rng(zlib.crc32(f"{op} {dtype}".encode()))
            b = _one_op(op, dtype, rng)
            arrays = b.arrays(rng)
            arrays[0].flat[:3] = [0.0, -0.0, 2.5]
            _check(b, arrays, xp, cupy.asnumpy)
        for exact in (True, False):
            for seed in range(12):
                rng = np.random.default_rng(seed)
                b = random_program(rng, dtype, exact, 8)
                _check(b, b.arrays(rng), xp, cupy.asnumpy)
    b, text = _chain_program()  # one launch, captured into a CUDA graph and replayed
    arrays = b.arrays(np.random.default_rng(3))
    dev = [cupy.asarray(a) for a in arrays]
    fn = gpu_body(text, xp)
    fn(*dev)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out = fn(*dev)
        graph = stream.end_capture()
    dev[0][...] = cupy.asarray(arrays[0] * 2)
    graph.launch(stream)
    stream.synchronize()
    _close(cupy.asnumpy(out), generic(text)(arrays[0] * 2, *arrays[1:]), "float32",
           _scale(b, [arrays[0] * 2, *arrays[1:]]))


@pytest.mark.gpu
def test_on_a_gpu_every_single_op_variant_matches_its_generic_kernel():
    """The single-op variants on cupy: one-step programs compiled for the device, out of place and
    into input 0's buffer, against the generic kernel on the same device."""
    import cupy

    from flowctl.kernels.cuda.xp import device_module

    xp = device_module(cupy)
    for dtype in ("float32", "float64"):
        for op in sorted(gpu_fused.SINGLE_LAUNCHES):
            arrays = _single_inputs(op, dtype, np.random.default_rng(zlib.crc32(f"gpu {op} {dtype}".encode())))
            specs = _specs(arrays)
            with override_array_module("gpu", xp):
                fn, fn_into = bind(op, "gpu", {}, specs), bind_into(op, "gpu", {}, specs)
            want = cupy.asnumpy(KERNELS[(op, "gpu")](xp, {})(*(cupy.asarray(a) for a in arrays)))
            _single_close(op, cupy.asnumpy(fn(*(cupy.asarray(a) for a in arrays))), want)
            dev = [cupy.asarray(a) for a in arrays]
            got = fn_into(0, *dev)
            assert got is dev[0]
            _single_close(op, cupy.asnumpy(got), want)
