"""Matrix ops (whitepaper Table 1 "Matrix operations"): MatMul, BatchMatMul, MatrixInverse,
MatrixDeterminant, MatrixDeterminantGrad (the fused gradient of the determinant, §4.1) and Einsum.

Transposes are attributes of the product, never separate nodes: BLAS multiplies a transposed view at
the speed of a contiguous one, so `A^T B` costs one node and no copy, and every MatMul gradient is
again a single MatMul with the transpose flags set (the four cases TensorFlow's MatMul gradient uses).
"""
from __future__ import annotations

from typing import Any

from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import convert, graph_of, make1
from flowctl.engine.opdef import MATRIX, memory_bytes, register_op
from flowctl.engine.shapes import InferError, TensorSpec, broadcast, dims_equal

__all__ = ["matmul", "batch_matmul", "matrix_inverse", "matrix_determinant", "einsum"]

_LINALG_DTYPES = ("float32", "float64")  # what LAPACK (numpy.linalg, cupy.linalg) accepts


# ---------------------------------------------------------------------------- shape functions
def _product_dtype(a: TensorSpec, b: TensorSpec) -> str:
    if a.dtype != b.dtype:
        raise InferError(f"dtypes differ: {a.dtype}, {b.dtype} (insert a Cast)")
    if a.dtype == "bool":
        raise InferError("matrix product of bool tensors (cast them to a number type first)")
    return a.dtype


def _inner(a: TensorSpec, b: TensorSpec, ta: bool, tb: bool, fa: str, fb: str) -> tuple:
    """(m, n) of op(a) @ op(b) over the last two dims, checking the shared dim k."""
    m, ka = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], b.shape[-2]) if tb else (b.shape[-2], b.shape[-1])
    if not dims_equal(ka, kb):
        raise InferError(f"inner dimensions differ: {ka} vs {kb} (a {a.shape} with {fa}={ta}, "
                         f"b {b.shape} with {fb}={tb})")
    return m, n


def _matmul_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    a, b = ins
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise InferError(f"MatMul needs two matrices, got ranks {len(a.shape)} and {len(b.shape)} "
                         f"(use batch_matmul for stacks of matrices)")
    dt = _product_dtype(a, b)
    return [TensorSpec(_inner(a, b, attrs["transpose_a"], attrs["transpose_b"], "transpose_a", "transpose_b"),
                       dt)]


def _concat_matmul_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    if len(ins) % 2 or len(ta) != len(ins) // 2 or len(tb) != len(ins) // 2:
        raise InferError(f"ConcatMatMul takes pairs (a, b) and a transpose flag of each: {len(ins)} inputs, "
                         f"{len(ta)} and {len(tb)} flags")
    outs = [_matmul_infer(ins[2 * i:2 * i + 2], {"transpose_a": bool(ta[i]), "transpose_b": bool(tb[i])})[0]
            for i in range(len(ins) // 2)]
    rows, n = 0, outs[0].shape[1]
    for i, o in enumerate(outs):
        if o.dtype != outs[0].dtype or not dims_equal(o.shape[1], n):
            raise InferError(f"product {i} is {o.dtype} {o.shape}: the products' columns and dtypes must agree "
                             f"({outs[0].dtype} {outs[0].shape})")
        rows = None if rows is None or o.shape[0] is None else rows + o.shape[0]
    return [TensorSpec((rows, n), outs[0].dtype)]


def _concat_matmul_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                        attrs: dict[str, Any]) -> tuple[float, float]:
    n = outs[0][1]
    flops = 0.0
    for i, ta in enumerate(attrs["transpose_a"]):
        m, k = (ins[2 * i][1], ins[2 * i][0]) if ta else ins[2 * i]
        flops += 2.0 * m * k * n
    return flops, memory_bytes(ins, outs, dtypes)


def _batch_matmul_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    a, b = ins
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise InferError(f"BatchMatMul needs inputs of rank >= 2, got ranks {len(a.shape)} and {len(b.shape)}")
    dt = _product_dtype(a, b)
    m, n = _inner(a, b, attrs["adj_x"], attrs["adj_y"], "adj_x", "adj_y")
    try:
        batch = broadcast(a.shape[:-2], b.shape[:-2])
    except InferError:
        raise InferError(f"batch dimensions {a.shape[:-2]} and {b.shape[:-2]} do not broadcast") from None
    return [TensorSpec(batch + (m, n), dt)]


def _square(x: TensorSpec, op: str) -> None:
    if len(x.shape) < 2 or not dims_equal(x.shape[-1], x.shape[-2]):
        raise InferError(f"{op} needs square matrices in the last two dims, got shape {x.shape}")
    if x.dtype not in _LINALG_DTYPES:
        raise InferError(f"{op} needs float32 or float64, got {x.dtype}")


def _inverse_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    _square(ins[0], "MatrixInverse")
    return [ins[0]]


def _determinant_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    _square(ins[0], "MatrixDeterminant")
    return [TensorSpec(ins[0].shape[:-2], ins[0].dtype)]


def _determinant_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    dy, det, x = ins
    _square(x, "MatrixDeterminantGrad")
    for what, s in (("incoming gradient", dy), ("determinant", det)):
        if len(s.shape) != len(x.shape) - 2 or not all(map(dims_equal, s.shape, x.shape[:-2])):
            raise InferError(f"{what} has shape {s.shape}, matrices {x.shape} need {x.shape[:-2]}")
    return [x]


# ---------------------------------------------------------------------------- cost functions
def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _product_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                  attrs: dict[str, Any]) -> tuple[float, float]:
    """2*m*n*k per output matrix: one multiply and one add per term of each dot product."""
    ta = attrs.get("transpose_a", attrs.get("adj_x", False))
    k = ins[0][-2] if ta else ins[0][-1]
    return float(2 * _prod(outs[0]) * k), memory_bytes(ins, outs, dtypes)


def _linalg_cost(factor: float) -> Any:
    """`factor` * n^3 per matrix: LU is 2/3 n^3; the inverse from it another 4/3 n^3."""
    def cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
             attrs: dict[str, Any]) -> tuple[float, float]:
        x = ins[-1]
        return float(factor * _prod(x[:-2]) * x[-1] ** 3), memory_bytes(ins, outs, dtypes)
    return cost


# ---------------------------------------------------------------------------- gradient functions
def _product_grads(a: Tensor, b: Tensor, dc: Tensor, ta: bool, tb: bool, mm: Any) -> tuple[Tensor, Tensor]:
    """The four transpose cases of C = op(A) op(B), each gradient one product (mm(x, y, tx, ty))."""
    if not ta and not tb:  # C = A B
        return mm(dc, b, False, True), mm(a, dc, True, False)
    if not ta and tb:  # C = A B^T
        return mm(dc, b, False, False), mm(dc, a, True, False)
    if ta and not tb:  # C = A^T B
        return mm(b, dc, False, True), mm(a, dc, False, False)
    return mm(b, dc, True, True), mm(dc, a, True, True)  # C = A^T B^T


def _g_matmul(op: Any, dy: list[Tensor]) -> list[Tensor]:
    a, b = op.inputs
    return list(_product_grads(a, b, dy[0], op.attrs["transpose_a"], op.attrs["transpose_b"],
                               lambda x, y, tx, ty: matmul(x, y, tx, ty, name="matmul_grad")))


def _g_batch_matmul(op: Any, dy: list[Tensor]) -> list[Tensor]:
    from flowctl.engine.ops.elementwise import _reduce

    a, b = op.inputs
    ga, gb = _product_grads(a, b, dy[0], op.attrs["adj_x"], op.attrs["adj_y"],
                            lambda x, y, tx, ty: batch_matmul(x, y, tx, ty, name="matmul_grad"))
    # Sum over the batch dims an operand was broadcast along; the matrix dims already match.
    return [_reduce(ga, a), _reduce(gb, b)]


def _g_inverse(op: Any, dy: list[Tensor]) -> list[Tensor]:
    # Y = A^-1: dA = -Y^T dY Y^T (from d(A A^-1) = 0). Two products with transpose flags, one Neg.
    y = op.outputs[0]
    mm = matmul if len(y.shape) == 2 else batch_matmul
    return [-mm(mm(y, dy[0], True, False, name="inv_grad"), y, False, True, name="inv_grad")]


def _g_determinant(op: Any, dy: list[Tensor]) -> list[Tensor]:
    # d det(A) / dA = det(A) A^-T (Jacobi's formula), scaled per matrix by dy: one fused node.
    return [make1("MatrixDeterminantGrad", [dy[0], op.outputs[0], op.inputs[0]], name="det_grad")]


register_op("MatMul", _matmul_infer, num_inputs=2,
            attrs={"transpose_a": ("bool", False), "transpose_b": ("bool", False)},
            grad=_g_matmul, cost=_product_cost, group=MATRIX)
# ConcatMatMul(a_1, b_1, ..., a_k, b_k) = Concat([MatMul(a_i, b_i)], axis=0): made by the CPU plan's
# pass (engine/concat_products.py) of products that only a row Concat reads (a weight's gradient
# whose rows two products make: an LSTM kernel's input and recurrent rows), never by a model. Each
# product is written straight into its rows of the output; per-product transposes as 0/1 lists.
register_op("ConcatMatMul", _concat_matmul_infer, min_inputs=2,
            attrs={"transpose_a": ("ints", ()), "transpose_b": ("ints", ())},
            cost=_concat_matmul_cost, group=MATRIX, differentiable=False)
register_op("BatchMatMul", _batch_matmul_infer, num_inputs=2,
            attrs={"adj_x": ("bool", False), "adj_y": ("bool", False)},
            grad=_g_batch_matmul, cost=_product_cost, group=MATRIX)
register_op("MatrixInverse", _inverse_infer, num_inputs=1, grad=_g_inverse, cost=_linalg_cost(2.0),
            group=MATRIX)
register_op("MatrixDeterminant", _determinant_infer, num_inputs=1, grad=_g_determinant,
            cost=_linalg_cost(2.0 / 3.0), group=MATRIX)
# MatrixDeterminantGrad(dy, det, x) = (dy * det)[..., None, None] * inv(x)^T. No gradient of its own
# is registered, so a second derivative through a determinant fails loudly in `gradients` rather
# than coming out as a silent zero.
register_op("MatrixDeterminantGrad", _determinant_grad_infer, num_inputs=3, cost=_linalg_cost(2.0),
            group=MATRIX)


# ---------------------------------------------------------------------------- Python API
def matmul(a: Any, b: Any, transpose_a: bool = False, transpose_b: bool = False,
           name: str | None = None) -> Tensor:
    """op(a) @ op(b) for matrices, op = transpose where asked. As in TensorFlow, an operand of rank
    > 2 makes this a BatchMatMul (transpose_a/b become adj_x/adj_y)."""
    g = graph_of(a, b)
    dtype = next((t.dtype for t in (a, b) if isinstance(t, Tensor)), None)
    a, b = convert(a, g, dtype), convert(b, g, dtype)
    if len(a.shape) > 2 or len(b.shape) > 2:
        return batch_matmul(a, b, transpose_a, transpose_b, name=name)
    return make1("MatMul", [a, b], {"transpose_a": bool(transpose_a), "transpose_b": bool(transpose_b)},
                 name=name or "MatMul")


def batch_matmul(a: Any, b: Any, adj_x: bool = False, adj_y: bool = False, name: str | None = None) -> Tensor:
    """Products of the matrices in the last two dims; the leading (batch) dims broadcast."""
    return make1("BatchMatMul", [a, b], {"adj_x": bool(adj_x), "adj_y": bool(adj_y)},
                 name=name or "BatchMatMul")


def matrix_inverse(x: Any, name: str | None = None) -> Tensor:
    """Inverse of each square matrix in the last two dims (a singular one fails at run time)."""
    return make1("MatrixInverse", [x], name=name or "MatrixInverse")


def matrix_determinant(x: Any, name: str | None = None) -> Tensor:
    """Determinant of each square matrix in the last two dims; shape x.shape[:-2]."""
    return make1("MatrixDeterminant", [x], name=name or "MatrixDeterminant")


# ---------------------------------------------------------------------------- Einsum
def parse_equation(equation: str, n_inputs: int) -> tuple[list[str], str]:
    """(input subscripts, output subscripts) of an einsum equation. Letters only (no ellipsis);
    without '->' the output is the letters used exactly once, sorted (numpy's implicit form)."""
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    subs = lhs.split(",")
    if len(subs) != n_inputs:
        raise InferError(f"equation {equation!r} names {len(subs)} operand(s), the node has {n_inputs}")
    letters = "".join(subs)
    if not all(c.isalpha() for c in letters + out):
        raise InferError(f"equation {equation!r}: subscripts must be letters (no '...')")
    if not arrow:
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    if len(set(out)) != len(out) or not set(out) <= set(letters):
        raise InferError(f"equation {equation!r}: each output letter must appear once, and in an input")
    return subs, out


def _einsum_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    subs, out = parse_equation(attrs["equation"], len(ins))
    if len({s.dtype for s in ins}) != 1:
        raise InferError(f"dtypes differ: {', '.join(s.dtype for s in ins)} (insert a Cast)")
    if ins[0].dtype == "bool":
        raise InferError("Einsum of bool tensors (cast them to a number type first)")
    sizes: dict[str, int | None] = {}
    for sub, spec in zip(subs, ins):
        if len(sub) != len(spec.shape):
            raise InferError(f"subscripts {sub!r} name {len(sub)} axes, the operand has shape {spec.shape}")
        for c, d in zip(sub, spec.shape):
            if not dims_equal(sizes.get(c), d):
                raise InferError(f"letter {c!r} is {sizes[c]} in one place and {d} in another")
            sizes[c] = d if d is not None else sizes.get(c)
    return [TensorSpec(tuple(sizes[c] for c in out), ins[0].dtype)]


def _einsum_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                 attrs: dict[str, Any]) -> tuple[float, float]:
    """A multiply-add per point of the full index space (what the naive loop visits)."""
    subs, _ = parse_equation(attrs["equation"], len(ins))
    sizes = {c: d for sub, shape in zip(subs, ins) for c, d in zip(sub, shape)}
    return 2.0 * _prod(tuple(sizes.values())), memory_bytes(ins, outs, dtypes)


def _g_einsum(op: Any, dy: list[Tensor]) -> list[Tensor]:
    """d/dx_i: dy contracted with the other operands onto x_i's subscripts. Letters x_i alone sums
    over are broadcast back (ExpandDims + BroadcastLike); a repeated letter (a diagonal) has no
    gradient here."""
    from flowctl.engine.ops.array import expand_dims
    from flowctl.engine.errors import GraphError

    xs = list(op.inputs)
    subs, out = parse_equation(op.attrs["equation"], len(xs))
    grads = []
    for i, (x, sub) in enumerate(zip(xs, subs)):
        if len(set(sub)) != len(sub):
            raise GraphError(f"Einsum {op.attrs['equation']!r}: no gradient through a repeated letter ({sub!r})")
        others = [s for j, s in enumerate(subs) if j != i]
        seen = set(out).union(*others)
        kept = "".join(c for c in sub if c in seen)
        eq = ",".join([out] + others) + "->" + kept
        g = make1("Einsum", [dy[0]] + [t for j, t in enumerate(xs) if j != i], {"equation": eq})
        if kept != sub:
            for pos, c in enumerate(sub):
                if c not in seen:
                    g = expand_dims(g, pos)
            g = make1("BroadcastLike", [g, x])
        grads.append(g)
    return grads


register_op("Einsum", _einsum_infer, min_inputs=1, attrs={"equation": ("str", "")}, grad=_g_einsum,
            cost=_einsum_cost, group=MATRIX)


def einsum(equation: str, *operands: Any, name: str | None = None) -> Tensor:
    """Einstein summation over letter subscripts, as numpy.einsum ('ij,jk->ik'; no '...')."""
    g = graph_of(*operands)
    dtype = next((t.dtype for t in operands if isinstance(t, Tensor)), None)
    return make1("Einsum", [convert(x, g, dtype) for x in operands], {"equation": equation}, name=name)
