"""The FusedElementwise GPU body (issue 30, item 3): ONE generated numba-cuda kernel per program.

The generic body (kernels/fused.py) runs a program's steps one by one with the unfused ops'
kernels: on a GPU that is a launch per step (and Erf's generic kernel alone is some 300). Here the
program (format: engine/ops/fused.py) becomes the Python source of one `@cuda.jit` kernel, a
thread per output element, one scalar expression per step, the intermediates in registers:

    def fused_elementwise(out, x0, x1, x2, n, d1, s0_0, s0_1, s1_0, s1_1, s2_0, s2_1):
        t = cuda.grid(1)
        if t >= n:
            return
        q = t
        i1 = q % d1
        i0 = q // d1
        a0 = x0[i0 * s0_0 + i1 * s0_1]
        ...
        v3 = T_float32(mul_float32(a0, a1))
        v4 = T_float32((v3 + a2))
        v5 = (v4 if (v4 >= K0 or v4 != v4) else K0)
        out[t] = v5

Broadcasting (numpy's rules): every input is read through its own strides, in elements, over the
output's flat index -- 0 along an axis it is broadcast on. The strides and dimensions are kernel
scalar arguments worked out on the host from the shapes at each call (host integers, no device
array, nothing read back: a captured graph bakes them into its kernel node), after dropping the
output's axes of length 1 and merging neighbouring axes that every input walks alike -- so same-shape
operands index by `t` itself (rank 1) and a bias against (N, C) is rank 2. The source is built and
compiled once per (program, rank) and cached; numba specialises it once (its arguments' types follow
from the program).

Numerics: each step is the generic kernel's arithmetic in its order and dtype -- constants typed in
the step's dtype (a bare Python float would make numba compute in float64), each result rounded to
its dtype as numpy rounds it (0.5 * (1 + tanh(0.5 x)) for Sigmoid, dy * y * (1 - y) for SigmoidGrad,
1 / sqrt(x) for Rsqrt, erf in float64 then cast, ...), and on a GPU every product through libdevice's
fmul_rn / dmul_rn, which NVVM never contracts into a fused multiply-add with a neighbouring sum (numpy
rounds twice). So the exactly rounded operations (+ - * /, sqrt, comparisons, max/min, casts) give the
generic body's bits; the transcendentals (exp, log, tanh, sin, cos, pow, erf) are CUDA's libdevice
functions (within 1-2 ulp), not numpy's, and may differ from them in the last ulp.

Which programs: every step's op must have an entry in `OPS` for its dtypes (float32, float64, and
int32 / int64 / bool where the op allows them); anything else -- an op without an entry, float16 (the
simulator cannot type it as CUDA does), numba-cuda missing -- makes the whole node take the generic
body, decided once when the kernel is built. At a call, inputs whose dtypes are not the program's
(never, in a checked graph) also take the generic body.

Single ops: an element-wise node the fusion pass leaves alone runs its generic kernel, a launch per
operation of its formula (Erf's some 350, Sigmoid's 4, the *Grad ops' 2-3). The ops where that is
more than one launch (`SINGLE_LAUNCHES`, counted on the ledger) have a GPU variant (registry.variant,
"generated"): the node runs as the one-step program of its op, one launch, and forwards a buffer
through the same kernel writing into it. The variant's rule is on the node's input specs, decided at
bind: one dtype the op's entry covers (float16 and ops without an entry keep the generic kernel), and
AddN of 3 inputs or more. Erf is the one that computes differently from its generic kernel (libdevice's
float64 erf against the generic series: see SINGLE_LAUNCHES).

In numba's CUDA simulator (a CPU, the tests) the same source runs on numpy scalars; the math
functions there are numpy's float64 ones with IEEE results (Python's `math` raises on log(0) or an
overflowing exp where CUDA gives -inf or inf)."""
from __future__ import annotations

import functools
import json
import linecache
import math
import operator
from typing import Any, Callable, Sequence

import numpy as np

from flowctl.kernels.cuda.jit import blocks, numba_cuda, simulated
from flowctl.kernels.cuda.kernels import THREADS
from flowctl.kernels.fused import fused_elementwise
from flowctl.kernels.registry import KERNELS, KernelFactory, kernel, variant

Fn = Callable[..., Any]

FLOATS = ("float32", "float64")
INTS = ("int32", "int64")
DTYPES = FLOATS + INTS + ("bool",)
NUMERIC = FLOATS + INTS


class _Source:
    """The names a generated kernel's expressions use (typed constants, casts, math functions),
    collected as the globals of the module it is compiled in."""

    def __init__(self) -> None:
        self.globals: dict[str, Any] = {}
        self._consts: dict[tuple[str, str], str] = {}

    def const(self, value: Any, dtype: str) -> str:
        key = (dtype, repr(value))
        name = self._consts.get(key)
        if name is None:
            name = self._consts[key] = f"K{len(self._consts)}"
            self.globals[name] = np.dtype(dtype).type(value)
        return name

    def cast(self, expr: str, dtype: str) -> str:
        """expr rounded to dtype (bool results are already bool)."""
        if dtype == "bool":
            return expr
        name = f"T_{dtype}"
        self.globals[name] = np.dtype(dtype).type
        return f"{name}({expr})"

    def mul(self, a: str, b: str, dtype: str) -> str:
        name = f"mul_{dtype}"
        self.globals[name] = _multiply(dtype)
        return f"{name}({a}, {b})"

    def fn(self, what: str, dtype: str, *args: str) -> str:
        name = f"{what}_{dtype}"
        self.globals[name] = _function(what, dtype)
        return f"{name}({', '.join(args)})"


# ------------------------------------------------------------------------------ math functions
def _ieee(f: Callable[..., Any]) -> Callable[..., Any]:
    """A math function for the simulator: numpy's float64 one, IEEE results, no warnings."""
    def run(*xs: Any) -> Any:
        with np.errstate(all="ignore"):
            return f(*(np.float64(x) for x in xs))

    return run


_SIMULATED = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt, "sin": np.sin, "cos": np.cos,
              "pow": np.power, "erf": math.erf, "floor": np.floor, "ceil": np.ceil, "rint": np.rint,
              "isnan": np.isnan, "isinf": np.isinf}
_MATH = {"exp", "log", "tanh", "sqrt", "sin", "cos", "pow", "erf", "isnan", "isinf"}  # numba-cuda's math.*


def _function(what: str, dtype: str) -> Any:
    if simulated():
        f = _SIMULATED[what]
        return f if what in ("isnan", "isinf") else _ieee(f)
    if what in _MATH:
        return getattr(math, what)  # libdevice's f-suffixed function for a float32 argument
    from numba.cuda import libdevice  # type: ignore[import-not-found]

    return getattr(libdevice, what + ("f" if dtype == "float32" else ""))  # floor / ceil / rint: a float back


def _multiply(dtype: str) -> Any:
    """A product rounded on its own: NVVM contracts a*b + c into a fused multiply-add by default,
    which rounds once where numpy rounds twice; libdevice's fmul_rn / dmul_rn never are."""
    if simulated() or dtype not in FLOATS:
        return operator.mul
    from numba.cuda import libdevice  # type: ignore[import-not-found]

    return libdevice.fmul_rn if dtype == "float32" else libdevice.dmul_rn


# ------------------------------------------------------------------------------ the op table
# OPS[op](src, args, in_dtypes, out_dtype) -> the step's expression (already rounded to out_dtype),
# or None where this dtype is not covered. `args` are names of locals (safe to repeat). Each entry
# is the generic kernel's formula (kernels/elementwise.py), operation for operation.
Entry = Callable[[_Source, list[str], list[str], str], "str | None"]
OPS: dict[str, Entry] = {}


def _op(*names: str) -> Callable[[Entry], Entry]:
    def deco(f: Entry) -> Entry:
        for n in names:
            OPS[n] = f
        return f

    return deco


def _arith(symbol: str) -> Entry:
    def entry(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
        return s.cast(f"({a[0]} {symbol} {a[1]})", out) if out in NUMERIC else None

    return entry


OPS["Add"] = _arith("+")
OPS["Sub"] = _arith("-")


@_op("Mul")
def _mul(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
    return s.cast(s.mul(a[0], a[1], out), out) if out in NUMERIC else None


@_op("Div")
def _div(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
    # floats only: integer Div truncates and gives 0 for x / 0 (the generic kernel's rules)
    return s.cast(f"({a[0]} / {a[1]})", out) if out in FLOATS else None


def _extremum(symbol: str) -> Entry:
    # numpy's maximum / minimum: a NaN in either operand wins; of equals, the first
    def entry(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
        x, y = a
        return f"({x} if ({x} {symbol} {y} or {x} != {x}) else {y})" if out in DTYPES else None

    return entry


OPS["Maximum"] = _extremum(">=")
OPS["Minimum"] = _extremum("<=")


@_op("Neg")
def _neg(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
    return s.cast(f"(-{a[0]})", out) if out in NUMERIC else None


@_op("Abs")
def _abs(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
    return s.cast(f"abs({a[0]})", out) if out in NUMERIC else None


@_op("Square")
def _square(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
    return s.cast(s.mul(a[0], a[0], out), out) if out in NUMERIC else None


@_op("Sign")
def _sign(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
    if out not in NUMERIC:
        return None
    x, one, zero, minus = a[0], s.const(1, out), s.const(0, out), s.const(-1, out)
    nan = f" if {x} == {zero} else {x}" if out in FLOATS else ""  # sign(nan) is nan
    return f"({one} if {x} > {zero} else ({minus} if {x} < {zero} else ({zero}{nan})))"


def _unary(what: str) -> Entry:
    def entry(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
        return s.cast(s.fn(what, out, a[0]), out) if out in FLOATS else None

    return entry


for _name, _what in (("Exp", "exp"), ("Log", "log"), ("Sqrt", "sqrt"), ("Tanh", "tanh"), ("Sin", "sin"),
                     ("Cos", "cos"), ("Floor", "floor"), ("Ceil", "ceil"), ("Round", "rint")):
    OPS[_name] = _unary(_what)


@_op("Pow")
def _pow(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
    return s.cast(s.fn("pow", out, a[0], a[1]), out) if out in FLOATS else None


@_op("Rsqrt")
def _rsqrt(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:  # 1.0 / sqrt(x)
    if out not in FLOATS:
        return None
    return s.cast(f"({s.const(1, out)} / {s.cast(s.fn('sqrt', out, a[0]), out)})", out)


@_op("Erf")
def _erf(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:  # in float64, then cast
    if out not in FLOATS:
        return None
    return s.cast(s.fn("erf", "float64", s.cast(a[0], "float64")), out)


@_op("Relu")
def _relu(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:  # maximum(x, 0)
    if out not in FLOATS:
        return None
    x, zero = a[0], s.const(0, out)
    return f"({x} if ({x} >= {zero} or {x} != {x}) else {zero})"


@_op("Sigmoid")
def _sigmoid(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:  # 0.5 (1 + tanh(0.5 x))
    if out not in FLOATS:
        return None
    half, one = s.const(0.5, out), s.const(1, out)
    t = s.cast(s.fn("tanh", out, s.cast(s.mul(half, a[0], out), out)), out)
    return s.cast(s.mul(half, s.cast(f"({one} + {t})", out), out), out)


@_op("ReluGrad")
def _relu_grad(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:  # dy * (y > 0)
    if out not in FLOATS:
        return None
    one, zero = s.const(1, out), s.const(0, out)
    return s.cast(s.mul(a[0], f"({one} if {a[1]} > {zero} else {zero})", out), out)


@_op("SigmoidGrad")
def _sigmoid_grad(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:  # dy * y * (1 - y)
    if out not in FLOATS:
        return None
    dy, y, one = a[0], a[1], s.const(1, out)
    return s.cast(s.mul(s.cast(s.mul(dy, y, out), out), s.cast(f"({one} - {y})", out), out), out)


@_op("TanhGrad")
def _tanh_grad(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:  # dy * (1 - y * y)
    if out not in FLOATS:
        return None
    dy, y, one = a[0], a[1], s.const(1, out)
    return s.cast(s.mul(dy, s.cast(f"({one} - {s.cast(s.mul(y, y, out), out)})", out), out), out)


def _compare(symbol: str) -> Entry:
    def entry(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
        return f"({a[0]} {symbol} {a[1]})" if ins[0] in DTYPES else None

    return entry


for _name, _symbol in (("Greater", ">"), ("Less", "<"), ("Equal", "=="), ("GreaterEqual", ">="),
                       ("LessEqual", "<=")):
    OPS[_name] = _compare(_symbol)


def _float_test(what: str) -> Entry:
    def entry(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
        return s.fn(what, ins[0], a[0]) if ins[0] in FLOATS else None

    return entry


OPS["IsNaN"] = _float_test("isnan")
OPS["IsInf"] = _float_test("isinf")


@_op("Select")
def _select(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:  # where(c, a, b)
    return f"({a[1]} if {a[0]} else {a[2]})" if out in DTYPES else None


@_op("Cast")
def _cast(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
    src = ins[0]
    if src not in DTYPES or out not in DTYPES:
        return None
    if out == "bool":
        return f"({a[0]} != {s.const(0, src)})"
    if src == "bool":
        return f"({s.const(1, out)} if {a[0]} else {s.const(0, out)})"
    return s.cast(a[0], out)  # float -> int truncates toward zero, as numpy's astype does


# An AddN is one nested expression, ((x0 + x1) + x2) + ...: Python's parser refuses nesting much
# past 200 parentheses (clip_norm's AddN over Inception-v3's 190 gradients), so a longer one keeps
# the generic kernel.
MAX_ADD_N = 64


@_op("AddN")
def _add_n(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:  # ((x0 + x1) + x2) + ...
    if out not in NUMERIC or len(a) > MAX_ADD_N:
        return None
    acc = a[0]
    for x in a[1:]:
        acc = s.cast(f"({acc} + {x})", out)
    return acc


def _fill_like(value: int) -> Entry:
    def entry(s: _Source, a: list[str], ins: list[str], out: str) -> str | None:
        return s.const(value, out) if out in DTYPES else None

    return entry


OPS["ZerosLike"] = _fill_like(0)
OPS["OnesLike"] = _fill_like(1)


# ------------------------------------------------------------------------------ the source
def unsupported(program_text: str) -> str | None:
    """Why a program takes the generic body (an op or dtype outside the table), or None."""
    try:
        _generate(program_text, 1)
    except _Unsupported as e:
        return str(e)
    return None


class _Unsupported(Exception):
    pass


def _generate(program_text: str, rank: int) -> tuple[str, dict[str, Any]]:
    """The kernel's source for outputs of `rank` (merged) dimensions, and its globals."""
    program = json.loads(program_text)
    dtypes = [str(t) for t in program["inputs"]]
    n = len(dtypes)
    for t in dtypes:
        if t not in DTYPES:
            raise _Unsupported(f"an input of {t}")
    s = _Source()
    live = _live(program)
    reads = [k for k in range(n) if k in live]
    idx = [f"i{j}" for j in range(rank)]
    xs = [f"x{k}" for k in reads]
    dims = [f"d{j}" for j in range(1, rank)]
    strides = [f"s{k}_{j}" for k in reads for j in range(rank)]
    lines = [f"def fused_elementwise(out, {', '.join(xs)}, n{''.join(', ' + a for a in dims + strides)}):",
             "    t = cuda.grid(1)",
             "    if t >= n:",
             "        return"]
    if rank == 1:
        lines.append("    i0 = t")
    else:
        lines.append("    q = t")
        for j in range(rank - 1, 0, -1):
            lines += [f"    i{j} = q % d{j}", f"    q = q // d{j}"]
        lines.append("    i0 = q")
    for k in reads:
        offset = " + ".join(f"{idx[j]} * s{k}_{j}" for j in range(rank))
        lines.append(f"    a{k} = x{k}[{offset}]")
    names = [f"a{k}" for k in range(n)]
    for j, st in enumerate(program["steps"]):
        out = str(st["dtype"])
        ins = [dtypes[a] for a in st["args"]]
        names.append(f"v{j}")
        dtypes.append(out)
        if n + j not in live:
            continue
        if out not in DTYPES:
            raise _Unsupported(f"step '{st['name']}' ({st['op']}) gives {out}")
        entry = OPS.get(st["op"])
        expr = None if entry is None else entry(s, [names[a] for a in st["args"]], ins, out)
        if expr is None:
            raise _Unsupported(f"step '{st['name']}': {st['op']} of {', '.join(ins)} has no GPU expression")
        lines.append(f"    v{j} = {expr}  # {st['op']} ({st['name']})")
    lines.append(f"    out[t] = {names[-1]}")
    return "\n".join(lines) + "\n", s.globals


def _live(program: dict[str, Any]) -> set[int]:
    """The values the output depends on. The fusion pass makes trees, where that is every value;
    a program may still hold a step no later step reads (the generic body runs it, uselessly): the
    kernel computes only what reaches the output, and its index space is the output's."""
    n, steps = len(program["inputs"]), program["steps"]
    live = {n + len(steps) - 1}
    for j in range(len(steps) - 1, -1, -1):
        if n + j in live:
            live.update(int(a) for a in steps[j]["args"])
    return live


@functools.lru_cache(maxsize=1024)
def _compiled(program_text: str, rank: int) -> Any:
    """The numba kernel of a program at a rank: generated, compiled once, cached."""
    cuda = numba_cuda()
    source, names = _generate(program_text, rank)
    filename = f"<flowctl FusedElementwise {_compiled.cache_info().currsize} rank {rank}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # readable tracebacks
    # `cuda` a global of the generated module: the simulator swaps its fake module in for it.
    module: dict[str, Any] = {"cuda": cuda, "__name__": "flowctl_fused_kernel", **names}
    exec(compile(source, filename, "exec"), module)
    return cuda.jit(module["fused_elementwise"])


def source(program_text: str, rank: int = 1) -> str:
    """The generated kernel's source (for tests and for reading)."""
    return _generate(program_text, rank)[0]


# ------------------------------------------------------------------------------ broadcasting
def layout(shapes: list[tuple[int, ...]], out_shape: tuple[int, ...]) -> tuple[list[int], list[list[int]]]:
    """(dims, strides[k]) of the output as the kernel walks it: the output's axes of length 1
    dropped and neighbouring axes merged where every input steps through them alike, each input's
    stride in elements over its C-contiguous data (0 along an axis it is broadcast on). At least
    one dimension (a scalar output is one element)."""
    r = len(out_shape)
    full = []
    for shp in shapes:
        padded = (1,) * (r - len(shp)) + tuple(int(d) for d in shp)
        st, acc = [0] * r, 1
        for j in range(r - 1, -1, -1):
            if padded[j] != 1:
                st[j] = acc
            acc *= padded[j]
        full.append(st)
    dims: list[int] = []
    cols: list[list[int]] = [[] for _ in shapes]
    for j in range(r):
        d = int(out_shape[j])
        if d == 1:
            continue
        if dims and all(c[-1] == st[j] * d for c, st in zip(cols, full)):
            dims[-1] *= d
            for c, st in zip(cols, full):
                c[-1] = st[j]
        else:
            dims.append(d)
            for c, st in zip(cols, full):
                c.append(st[j])
    if not dims:
        return [1], [[0] for _ in shapes]
    return dims, cols


# ------------------------------------------------------------------------------ the kernel
@kernel("FusedElementwise", ["gpu"])
def fused_elementwise_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    generic = fused_elementwise(xp, attrs)
    body = _generated(xp, attrs["program"], generic)
    return generic if body is None else (lambda *xs: body(None, *xs))


def _generated(xp: Any, text: str, generic: Fn) -> Callable[..., Any] | None:
    """`body(buf, *xs)`: the program's kernel over xs, written into `buf` where that is given and is
    a whole C-contiguous array of the output's shape and dtype (an input's buffer the executor
    forwards: a thread reads its element of it before it writes it), else into a new array. None
    where the program takes the generic body: decided here, once."""
    if numba_cuda() is None or unsupported(text) is not None:
        return None
    program = json.loads(text)
    want = [np.dtype(t) for t in program["inputs"]]
    live = _live(program)
    reads = [k for k in range(len(want)) if k in live]  # the inputs the output depends on
    out_dtype = np.dtype(program["steps"][-1]["dtype"])
    sim = bool(getattr(xp, "simulated", False))
    into = numba_cuda().In if sim else None
    plain = getattr(xp, "plain", None)  # the ledger's view of a device array's block (a captured graph's address)

    def arg(x: Any) -> Any:
        flat = xp.ascontiguousarray(x).reshape(-1)
        if into is None:
            return flat
        # The simulator copies every array argument back after a launch unless told it is only read
        # (a read-only Const would fail; one array passed twice would put a stale copy back).
        return into(plain(flat) if plain is not None else flat.view(np.ndarray))

    def run(buf: Any, *xs: Any) -> Any:
        if any(x.dtype != w for x, w in zip(xs, want)):
            return generic(*xs)
        xs = tuple(xs[k] for k in reads)
        shapes = [tuple(x.shape) for x in xs]
        out_shape = np.broadcast_shapes(*shapes)  # the last step's: its operands' broadcast, step by step
        if (buf is not None and tuple(buf.shape) == out_shape and buf.dtype == out_dtype
                and buf.flags.c_contiguous):
            out = buf
        else:
            out = xp.empty(out_shape, dtype=out_dtype)
        size = int(out.size)
        if size == 0:
            return out
        dims, strides = layout(shapes, out_shape)
        k = _compiled(text, len(dims))
        threads = max(1, min(THREADS, size)) if sim else THREADS
        grid, block = blocks(size, threads)
        xp.launch(k, grid, block, out.reshape(-1), *(arg(x) for x in xs), size, *dims[1:],
                  *(s for st in strides for s in st))
        return out

    return run


# ------------------------------------------------------------------------------ single ops
# An element-wise op the fusion pass leaves alone (fusion off, or a node it cannot join) runs its
# generic kernel (kernels/elementwise.py) on a GPU: one cupy call per operation of its formula. Where
# that is more than one launch, the op's node runs instead as the one-step program [op](inputs): its
# table entry, the generic formula operation for operation (see Numerics above), in ONE launch.
# The generic kernels' launches per node, counted on the launch ledger (tests/test_fused_gpu.py
# measures every op in OPS and checks this list against them: every op of more than one launch is
# here, with its count; the others are a single cupy call -- a ufunc, where, astype -- and gain nothing):
SINGLE_LAUNCHES = {
    "Erf": 357,         # float32 (355 in float64 and the 2 casts): the 60-term series and the 80-term fraction
    "Sigmoid": 4,       # 0.5 * x, tanh, 1 + t, 0.5 * (...)
    "SigmoidGrad": 3,   # dy * y, 1 - y, the product
    "TanhGrad": 3,      # y * y, 1 - y*y, dy * (...)
    "Rsqrt": 2,         # sqrt, 1 / s
    "ReluGrad": 2,      # y > 0, dy * mask
    "AddN": 2,          # of 3 inputs: n - 1 sums (of 2 inputs one, of 1 none: those keep the generic kernel)
}
# Erf computes differently: libdevice's erf (math.erf in the simulator) in float64, then the cast,
# where the generic kernel sums its float64 series / continued fraction; both are within a few ulp
# of erf in float64 (so within the 1e-12 the tests allow there, and the same float32 after the cast
# but for the rare value within an ulp of a rounding boundary: 1e-6 relative). The others are the
# generic formula's operations in its order and dtype; Sigmoid's tanh is libdevice's.


def single_program(op: str, dtypes: Sequence[str]) -> str:
    """The one-step program of a node of `op` over inputs of `dtypes` (every op in SINGLE_LAUNCHES
    gives its first input's dtype and reads no attribute)."""
    return json.dumps({"inputs": list(dtypes),
                       "steps": [{"op": op, "attrs": {}, "args": list(range(len(dtypes))), "dtype": dtypes[0],
                                  "name": op}]})


def _single_applies(op: str) -> Callable[[dict[str, Any], Sequence[Any]], bool]:
    """The rule, on the node's input specs: numba-cuda present, inputs of one dtype that the op's
    table entry covers (not float16: that keeps the generic kernel), AddN of 3 inputs or more."""
    def applies(attrs: dict[str, Any], ins: Sequence[Any]) -> bool:
        dtypes = [str(s.dtype) for s in ins]
        if not dtypes or len(set(dtypes)) != 1 or (op == "AddN" and len(dtypes) < 3):
            return False
        return numba_cuda() is not None and unsupported(single_program(op, dtypes)) is None

    return applies


def _single(op: str, in_place: bool) -> KernelFactory:
    """The node's kernel (or its in-place kernel, INTO's `fn(k, *xs)`): the one-step program's,
    compiled for the dtypes its inputs come in (one entry, in a checked graph; the generic kernel
    for any the table does not cover)."""
    def factory(xp: Any, attrs: dict[str, Any]) -> Fn:
        reference = KERNELS[(op, "gpu")](xp, attrs)
        bodies: dict[tuple[Any, ...], Callable[..., Any]] = {}

        def body(xs: tuple[Any, ...]) -> Callable[..., Any]:
            key = tuple(x.dtype for x in xs)
            b = bodies.get(key)
            if b is None:
                text = single_program(op, [str(t) for t in key])
                b = _generated(xp, text, reference) if unsupported(text) is None else None
                b = bodies[key] = b if b is not None else (lambda buf, *ys: reference(*ys))
            return b

        if in_place:
            return lambda k, *xs: body(xs)(xs[k], *xs)
        return lambda *xs: body(xs)(None, *xs)

    return factory


for _name in SINGLE_LAUNCHES:
    variant(_name, "gpu", "generated", _single_applies(_name), into=_single(_name, True))(_single(_name, False))
