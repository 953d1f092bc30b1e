"""Array (movement) ops (whitepaper Table 1, "Array operations"): Shape, Rank, Reshape, Transpose,
Concat, Split, Slice, Pad, Tile, ExpandDims, Squeeze, Stack, Unstack, Gather, OneHot, Fill, and the
fused gradient ops they use (ReshapeLike, SplitLike, SliceGrad, PadGrad, TileGrad, GatherGrad).

Everything an op needs to know about shapes is a static attribute (a target shape, a perm, paddings),
so a mismatch is caught when the node is added. Gradients must survive unknown dimensions (the
batch): where a static shape would hold None, the gradient either reads the size off `dy` at run
time (PadGrad, TileGrad) or takes the forward tensor as a `like` input and copies its runtime shape
(ReshapeLike, SplitLike, SliceGrad, GatherGrad) -- only when no static form exists, because a
`like` input keeps the forward tensor alive until the backward pass runs (§3.1's reference counts).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from flowctl.engine.dtypes import INTS, as_dtype
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import constant, graph_of, make, make1
from flowctl.engine.opdef import (
    MOVEMENT, REQUIRED, SOURCE, elementwise_cost, memory_bytes, movement_cost, register_op, view_leading,
    view_reshape, view_same,
)
from flowctl.engine.shapes import InferError, TensorSpec, dims_equal, normalize_axis, num_elements

__all__ = [
    "concat", "expand_dims", "fill", "gather", "one_hot", "ones", "pad", "rank", "reshape", "shape",
    "slice_", "split", "squeeze", "stack", "tile", "transpose", "unstack", "zeros",
]


# ---------------------------------------------------------------------------- costs
def _free(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
          attrs: dict[str, Any]) -> tuple[float, float]:
    """Views and metadata (Reshape, ExpandDims, Squeeze, Shape): no data moves."""
    return 0.0, 0.0


def _copy_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
               attrs: dict[str, Any]) -> tuple[float, float]:
    """Ops that read only what they write (Slice, PadGrad): twice the output bytes."""
    return 0.0, 2.0 * memory_bytes([], outs, dtypes)


def _gather_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                 attrs: dict[str, Any]) -> tuple[float, float]:
    # The gathered rows are read and written once each; the indices (int64 at most) are read once.
    return 0.0, 2.0 * memory_bytes([], outs, dtypes) + 8.0 * float(np.prod(ins[1]))


def _scatter_add_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                      attrs: dict[str, Any]) -> tuple[float, float]:
    """One add per element of the incoming gradient (GatherGrad, TileGrad)."""
    flops = float(np.prod(ins[0]))
    return flops, memory_bytes(ins[:1], outs, dtypes)


def _fill_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
               attrs: dict[str, Any]) -> tuple[float, float]:
    return 0.0, memory_bytes([], outs, dtypes)


# ---------------------------------------------------------------------------- shape helpers
def _fmt(shape: Sequence[int | None]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _merge_shapes(specs: Sequence[TensorSpec], what: str, skip_axis: int | None = None) -> list[int | None]:
    """The common shape of `specs` (same rank, dims agree where known), unknown where all are."""
    shape: list[int | None] = list(specs[0].shape)
    for s in specs[1:]:
        if len(s.shape) != len(shape):
            raise InferError(f"{what} needs inputs of one rank, got ranks "
                             f"{', '.join(str(len(t.shape)) for t in specs)} "
                             f"(shapes {', '.join(_fmt(t.shape) for t in specs)})")
        for i, (a, b) in enumerate(zip(shape, s.shape)):
            if i == skip_axis:
                continue
            if not dims_equal(a, b):
                raise InferError(f"{what} inputs disagree on dim {i}: "
                                 f"{', '.join(_fmt(t.shape) for t in specs)}")
            shape[i] = a if a is not None else b
    return shape


def _one_dtype(specs: Sequence[TensorSpec], what: str) -> str:
    dts = {s.dtype for s in specs}
    if len(dts) != 1:
        raise InferError(f"{what} inputs must share a dtype, got {', '.join(s.dtype for s in specs)}")
    return specs[0].dtype


def _resolve_sizes(sizes: Sequence[int], dim: int | None, what: str) -> list[int | None]:
    """A list of sizes with at most one -1 (the rest of `dim`), resolved where `dim` is known."""
    if sum(1 for s in sizes if s == -1) > 1 or any(s < -1 for s in sizes):
        raise InferError(f"{what} sizes {list(sizes)}: at most one -1 and no other negative size")
    known = sum(s for s in sizes if s != -1)
    if -1 not in sizes:
        if dim is not None and known != dim:
            raise InferError(f"{what} sizes {list(sizes)} sum to {known}, but the dim is {dim}")
        return list(sizes)
    if dim is None:
        return [None if s == -1 else s for s in sizes]
    if known > dim:
        raise InferError(f"{what} sizes {list(sizes)} sum to {known}, more than the dim {dim}")
    return [dim - known if s == -1 else s for s in sizes]


# ---------------------------------------------------------------------------- shape functions
def _shape_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if attrs["out_type"] not in ("int32", "int64"):
        raise InferError(f"Shape's out_type must be int32 or int64, got {attrs['out_type']}")
    return [TensorSpec((len(ins[0].shape),), attrs["out_type"])]


def _reshape_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    src, target = ins[0].shape, list(attrs["shape"])
    if sum(1 for d in target if d == -1) > 1 or any(d < -1 for d in target):
        raise InferError(f"reshape target {_fmt(target)}: at most one -1 and no other negative dim")
    n_in = num_elements(src)
    known = int(np.prod([d for d in target if d != -1], dtype=np.int64))
    if -1 in target:
        if known == 0:
            raise InferError(f"reshape target {_fmt(target)}: -1 is ambiguous beside a zero dim")
        if n_in is None:
            return [TensorSpec(tuple(None if d == -1 else d for d in target), ins[0].dtype)]
        if n_in % known:
            raise InferError(f"cannot reshape {n_in} elements (shape {_fmt(src)}) to {_fmt(target)}: "
                             f"{n_in} is not a multiple of {known}")
        return [TensorSpec(tuple(n_in // known if d == -1 else d for d in target), ins[0].dtype)]
    if n_in is not None and n_in != known:
        raise InferError(f"cannot reshape {n_in} elements (shape {_fmt(src)}) to {_fmt(target)} "
                         f"({known} elements)")
    part = int(np.prod([d for d in src if d is not None], dtype=np.int64))
    if n_in is None and part and known % part:
        raise InferError(f"cannot reshape shape {_fmt(src)} (a multiple of {part} elements) to "
                         f"{_fmt(target)} ({known} elements)")
    return [TensorSpec(tuple(target), ins[0].dtype)]


def _reshape_like_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    n, m = num_elements(ins[0].shape), num_elements(ins[1].shape)
    if n is not None and m is not None and n != m:
        raise InferError(f"cannot reshape {n} elements {_fmt(ins[0].shape)} like {_fmt(ins[1].shape)}")
    return [TensorSpec(ins[1].shape, ins[0].dtype)]


def _perm(attrs: dict[str, Any], rank: int) -> tuple[int, ...]:
    perm = attrs["perm"]
    if perm is None:
        return tuple(reversed(range(rank)))
    if sorted(perm) != list(range(rank)):
        raise InferError(f"perm {list(perm)} is not a permutation of 0..{rank - 1} (input rank {rank})")
    return tuple(perm)


def _transpose_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    shape = ins[0].shape
    return [TensorSpec(tuple(shape[p] for p in _perm(attrs, len(shape))), ins[0].dtype)]


def _concat_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    dt = _one_dtype(ins, "Concat")
    rank = len(ins[0].shape)
    if rank == 0:
        raise InferError("cannot concatenate scalars (use stack)")
    axis = normalize_axis(attrs["axis"], rank)
    shape = _merge_shapes(ins, "Concat", skip_axis=axis)
    dims = [s.shape[axis] for s in ins]
    shape[axis] = None if None in dims else sum(dims)
    return [TensorSpec(tuple(shape), dt)]


def _split_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    shape = ins[0].shape
    axis = normalize_axis(attrs["axis"], len(shape))
    dim = shape[axis]
    num, sizes = attrs["num"], attrs["sizes"]
    if (num > 0) == (sizes is not None):
        raise InferError(f"Split takes exactly one of num (> 0) and sizes, got num={num}, sizes={sizes}")
    if sizes is None:
        if dim is not None and dim % num:
            raise InferError(f"cannot split dim {axis} of size {dim} into {num} equal parts")
        parts: list[int | None] = [None if dim is None else dim // num] * num
    else:
        parts = _resolve_sizes(sizes, dim, "Split")
    return [TensorSpec(shape[:axis] + (p,) + shape[axis + 1:], ins[0].dtype) for p in parts]


def _split_like_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    axis = normalize_axis(attrs["axis"], len(ins[0].shape))
    outs = []
    for like in ins[1:]:
        merged = _merge_shapes([ins[0], like], "SplitLike", skip_axis=axis)
        merged[axis] = like.shape[axis]
        outs.append(TensorSpec(tuple(merged), ins[0].dtype))
    return outs


def _slice_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    shape, begin, size = ins[0].shape, attrs["begin"], attrs["size"]
    if len(begin) != len(shape) or len(size) != len(shape):
        raise InferError(f"slice begin {list(begin)} and size {list(size)} need one entry per dim "
                         f"of shape {_fmt(shape)}")
    out: list[int | None] = []
    for i, (d, b, s) in enumerate(zip(shape, begin, size)):
        if b < 0 or s < -1:
            raise InferError(f"slice dim {i}: begin {b} must be >= 0 and size {s} >= -1")
        if d is not None and (b > d or (s != -1 and b + s > d)):
            raise InferError(f"slice dim {i}: begin {b} size {s} runs past the dim's size {d}")
        out.append((None if d is None else d - b) if s == -1 else s)
    return [TensorSpec(tuple(out), ins[0].dtype)]


def _slice_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    return [TensorSpec(ins[1].shape, ins[0].dtype)]


def _pairs(attrs: dict[str, Any], rank: int) -> list[tuple[int, int]]:
    flat = attrs["paddings"]
    if len(flat) != 2 * rank or any(p < 0 for p in flat):
        raise InferError(f"paddings {list(flat)} need a non-negative (before, after) pair per dim, "
                         f"{2 * rank} numbers for rank {rank}")
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(rank)]


def _pad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    pairs = _pairs(attrs, len(ins[0].shape))
    return [TensorSpec(tuple(None if d is None else d + b + a for d, (b, a) in zip(ins[0].shape, pairs)),
                       ins[0].dtype)]


def _pad_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    pairs = _pairs(attrs, len(ins[0].shape))
    out = []
    for i, (d, (b, a)) in enumerate(zip(ins[0].shape, pairs)):
        if d is not None and d < b + a:
            raise InferError(f"dim {i} of size {d} is smaller than its padding {b} + {a}")
        out.append(None if d is None else d - b - a)
    return [TensorSpec(tuple(out), ins[0].dtype)]


def _multiples(attrs: dict[str, Any], rank: int) -> tuple[int, ...]:
    mult = attrs["multiples"]
    if len(mult) != rank or any(m < 0 for m in mult):
        raise InferError(f"multiples {list(mult)} need one non-negative entry per dim (rank {rank})")
    return tuple(mult)


def _tile_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    mult = _multiples(attrs, len(ins[0].shape))
    return [TensorSpec(tuple(None if d is None else d * m for d, m in zip(ins[0].shape, mult)), ins[0].dtype)]


def _tile_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    mult = _multiples(attrs, len(ins[0].shape))
    out = []
    for i, (d, m) in enumerate(zip(ins[0].shape, mult)):
        if m == 0 or (d is not None and d % m):
            raise InferError(f"TileGrad: dim {i} of size {d} is not a positive multiple of {m}")
        out.append(None if d is None else d // m)
    return [TensorSpec(tuple(out), ins[0].dtype)]


def _expand_dims_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    shape = ins[0].shape
    axis = normalize_axis(attrs["axis"], len(shape) + 1)
    return [TensorSpec(shape[:axis] + (1,) + shape[axis:], ins[0].dtype)]


def _squeeze_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    shape = ins[0].shape
    axes = {normalize_axis(a, len(shape)) for a in attrs["axis"]}
    for a in sorted(axes):
        if shape[a] not in (1, None):
            raise InferError(f"cannot squeeze dim {a} of size {shape[a]} (shape {_fmt(shape)})")
    return [TensorSpec(tuple(d for i, d in enumerate(shape) if i not in axes), ins[0].dtype)]


def _stack_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    dt = _one_dtype(ins, "Stack")
    shape = _merge_shapes(ins, "Stack")
    axis = normalize_axis(attrs["axis"], len(shape) + 1)
    return [TensorSpec(tuple(shape[:axis]) + (len(ins),) + tuple(shape[axis:]), dt)]


def _unstack_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    shape = ins[0].shape
    if not shape:
        raise InferError("cannot unstack a scalar")
    axis = normalize_axis(attrs["axis"], len(shape))
    if shape[axis] is None:
        raise InferError(f"Unstack needs a known size along axis {axis}, got shape {_fmt(shape)}")
    return [TensorSpec(shape[:axis] + shape[axis + 1:], ins[0].dtype)] * shape[axis]


def _gather_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    params, indices = ins
    if indices.dtype not in ("int32", "int64"):
        raise InferError(f"Gather indices must be int32 or int64, got {indices.dtype}")
    if not params.shape:
        raise InferError("cannot gather from a scalar")
    axis = normalize_axis(attrs["axis"], len(params.shape))
    return [TensorSpec(params.shape[:axis] + indices.shape + params.shape[axis + 1:], params.dtype)]


def _gather_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    dy, indices, like = ins
    expect = _gather_infer([like, indices], attrs)[0].shape
    if len(dy.shape) != len(expect) or not all(dims_equal(a, b) for a, b in zip(dy.shape, expect)):
        raise InferError(f"GatherGrad: gradient shape {_fmt(dy.shape)} is not the gather's output "
                         f"shape {_fmt(expect)}")
    return [TensorSpec(like.shape, dy.dtype)]


def _one_hot_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if ins[0].dtype not in INTS:
        raise InferError(f"OneHot indices must be integers, got {ins[0].dtype}")
    if attrs["depth"] < 0:
        raise InferError(f"OneHot depth must be >= 0, got {attrs['depth']}")
    shape = ins[0].shape
    axis = normalize_axis(attrs["axis"], len(shape) + 1)
    return [TensorSpec(shape[:axis] + (attrs["depth"],) + shape[axis:], attrs["dtype"])]


def _fill_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    shape = attrs["shape"]
    if any(d is None or d < 0 for d in shape):
        raise InferError(f"Fill needs a fully known, non-negative shape, got {_fmt(shape)}")
    return [TensorSpec(shape, attrs["dtype"])]


# ---------------------------------------------------------------------------- gradient functions
def _reshape_to(dy: Tensor, x: Tensor) -> Tensor:
    """dy reshaped to x's shape: a static Reshape when at most one dim is unknown (it becomes -1),
    else ReshapeLike, which reads x's shape at run time."""
    shape = x.shape
    unknown = sum(1 for d in shape if d is None)
    if unknown == 0 or (unknown == 1 and 0 not in shape):
        if tuple(dy.shape) == tuple(shape) and unknown == 0:
            return dy
        return reshape(dy, [-1 if d is None else d for d in shape])
    return make1("ReshapeLike", [dy, x], name="reshape_like")


def _g_reshape(op: Any, dy: list[Tensor]) -> list[Tensor]:
    return [_reshape_to(dy[0], op.inputs[0])]


def _g_transpose(op: Any, dy: list[Tensor]) -> list[Tensor]:
    perm = _perm(op.attrs, len(op.inputs[0].shape))
    return [transpose(dy[0], [int(i) for i in np.argsort(perm)])]


def _g_concat(op: Any, dy: list[Tensor]) -> list[Tensor]:
    xs, axis = op.inputs, op.attrs["axis"]
    axis_n = axis % len(xs[0].shape)
    sizes = [x.shape[axis_n] for x in xs]
    if sum(1 for s in sizes if s is None) <= 1:
        # One unknown size is the rest of dy's runtime size: Split's -1 covers it statically.
        parts = split(dy[0], [-1 if s is None else s for s in sizes], axis=axis)
    else:
        parts = make("SplitLike", [dy[0], *xs], {"axis": axis}, name="split_like")
    return list(parts)


def _g_slice(op: Any, dy: list[Tensor]) -> list[Tensor]:
    x = op.inputs[0]
    begin, size = op.attrs["begin"], op.attrs["size"]
    pairs: list[int] = []
    for d, b, s in zip(x.shape, begin, size):
        if s == -1:
            after = 0
        elif d is None:  # the padding after depends on x's runtime size
            return [make1("SliceGrad", [dy[0], x], {"begin": begin, "size": size}, name="slice_grad")]
        else:
            after = d - b - s
        pairs += [b, after]
    return [pad(dy[0], pairs)]


def _g_tile(op: Any, dy: list[Tensor]) -> list[Tensor]:
    mult = op.attrs["multiples"]
    if 0 in mult:  # an empty tile: x contributes to nothing
        return [make1("ZerosLike", [op.inputs[0]])]
    return [make1("TileGrad", [dy[0]], {"multiples": mult}, name="tile_grad")]


def _g_expand_dims(op: Any, dy: list[Tensor]) -> list[Tensor]:
    axis = op.attrs["axis"] % len(op.outputs[0].shape)
    return [squeeze(dy[0], [axis])]


def _g_gather(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    params, indices = op.inputs
    return [make1("GatherGrad", [dy[0], indices, params], {"axis": op.attrs["axis"]}, name="gather_grad"),
            None]


def _g_gather_grad(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    return [gather(dy[0], op.inputs[1], axis=op.attrs["axis"]), None, None]


def _g_split_like(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    return [concat(dy, op.attrs["axis"])] + [None] * (len(op.inputs) - 1)


# ---------------------------------------------------------------------------- views
# Which kernels hand back a view of their input (kernels/array.py), and when it is C-contiguous
# (a Reshape of a view that is not copies).
def _view_transpose(attrs: dict[str, Any], shape: tuple[int, ...], contiguous: bool) -> tuple[bool, bool]:
    perm = attrs["perm"]
    perm = tuple(reversed(range(len(shape)))) if perm is None else tuple(perm)
    moved = [a for a in perm if shape and shape[a] != 1]  # extent-1 axes may go anywhere
    return True, contiguous and moved == sorted(moved)


def _view_slice(attrs: dict[str, Any], shape: tuple[int, ...], contiguous: bool) -> tuple[bool, bool]:
    """x[region]: a C-ordered block where the axes after the first cut one are whole and those
    before it have extent 1 in the result."""
    extents = [d - b if s == -1 else s for b, s, d in zip(attrs["begin"], attrs["size"], shape)]
    cut = next((k for k, (e, d) in enumerate(zip(extents, shape)) if e != d), len(shape))
    whole_after = all(e == d for e, d in zip(extents[cut + 1:], shape[cut + 1:]))
    return True, contiguous and whole_after and all(e == 1 for e in extents[:cut])


def _view_split(attrs: dict[str, Any], shape: tuple[int, ...], contiguous: bool) -> tuple[bool, bool]:
    return view_leading(attrs["axis"], shape, contiguous)


# ---------------------------------------------------------------------------- registrations
_register = register_op
_register("Shape", _shape_infer, num_inputs=1, attrs={"out_type": ("dtype", "int32")}, group=MOVEMENT,
          cost=_free, differentiable=False)
_register("Rank", lambda ins, a: [TensorSpec((), "int32")], num_inputs=1, group=MOVEMENT, cost=_free,
          differentiable=False)
_register("Reshape", _reshape_infer, num_inputs=1, attrs={"shape": ("ints", REQUIRED)}, group=MOVEMENT,
          cost=_free, grad=_g_reshape, view=view_reshape)
# ReshapeLike(x, like): x with like's runtime shape, for gradients whose target holds unknown dims.
_register("ReshapeLike", _reshape_like_infer, num_inputs=2, group=MOVEMENT, cost=_free,
          grad=lambda op, dy: [_reshape_to(dy[0], op.inputs[0]), None], view=view_reshape)
_register("Transpose", _transpose_infer, num_inputs=1, attrs={"perm": ("ints", None)}, group=MOVEMENT,
          cost=movement_cost, grad=_g_transpose, view=_view_transpose)
_register("Concat", _concat_infer, min_inputs=1, attrs={"axis": ("int", REQUIRED)}, group=MOVEMENT,
          cost=movement_cost, grad=_g_concat)
_register("Split", _split_infer, num_inputs=1,
          attrs={"num": ("int", 0), "sizes": ("ints", None), "axis": ("int", 0)}, group=MOVEMENT,
          cost=movement_cost, grad=lambda op, dy: [concat(dy, op.attrs["axis"])], view=_view_split)
# SplitLike(dy, x0, x1, ...): dy cut along `axis` into pieces the runtime sizes of the xs (Concat's
# gradient when two or more of the concatenated sizes are unknown).
_register("SplitLike", _split_like_infer, min_inputs=2, attrs={"axis": ("int", REQUIRED)},
          group=MOVEMENT, cost=movement_cost, grad=_g_split_like, view=_view_split)
_register("Slice", _slice_infer, num_inputs=1, attrs={"begin": ("ints", REQUIRED), "size": ("ints", REQUIRED)},
          group=MOVEMENT, cost=_copy_cost, grad=_g_slice, view=_view_slice)
# SliceGrad(dy, x): zeros shaped like x at run time with dy written at `begin`.
_register("SliceGrad", _slice_grad_infer, num_inputs=2,
          attrs={"begin": ("ints", REQUIRED), "size": ("ints", REQUIRED)}, group=MOVEMENT, cost=movement_cost,
          grad=lambda op, dy: [slice_(dy[0], op.attrs["begin"], op.attrs["size"]), None])
# paddings is flattened [before0, after0, before1, after1, ...].
_register("Pad", _pad_infer, num_inputs=1,
          attrs={"paddings": ("ints", REQUIRED), "constant_values": ("float", 0.0)}, group=MOVEMENT, cost=movement_cost,
          grad=lambda op, dy: [make1("PadGrad", [dy[0]], {"paddings": op.attrs["paddings"]}, name="pad_grad")])
# PadGrad(dy): the interior of dy, found from dy's own runtime shape, so it needs no forward tensor.
_register("PadGrad", _pad_grad_infer, num_inputs=1, attrs={"paddings": ("ints", REQUIRED)}, group=MOVEMENT,
          cost=_copy_cost, grad=lambda op, dy: [pad(dy[0], op.attrs["paddings"])])
_register("Tile", _tile_infer, num_inputs=1, attrs={"multiples": ("ints", REQUIRED)}, group=MOVEMENT,
          cost=movement_cost, grad=_g_tile)
# TileGrad(dy): dy viewed as (m0, d0, m1, d1, ...) summed over the m axes, in one node.
_register("TileGrad", _tile_grad_infer, num_inputs=1, attrs={"multiples": ("ints", REQUIRED)}, group=MOVEMENT,
          cost=_scatter_add_cost, grad=lambda op, dy: [tile(dy[0], op.attrs["multiples"])])
_register("ExpandDims", _expand_dims_infer, num_inputs=1, attrs={"axis": ("int", REQUIRED)}, group=MOVEMENT,
          cost=_free, grad=_g_expand_dims, view=view_same)
# Squeeze's axes are always explicit in the graph: squeezing "every 1" at run time could drop an
# unknown batch dim that happens to be 1 and break the static shape the graph promised.
_register("Squeeze", _squeeze_infer, num_inputs=1, attrs={"axis": ("ints", REQUIRED)}, group=MOVEMENT,
          cost=_free, grad=_g_reshape, view=view_same)
_register("Stack", _stack_infer, min_inputs=1, attrs={"axis": ("int", 0)}, group=MOVEMENT,
          cost=movement_cost, grad=lambda op, dy: unstack(dy[0], op.attrs["axis"]))
_register("Unstack", _unstack_infer, num_inputs=1, attrs={"axis": ("int", 0)}, group=MOVEMENT,
          cost=movement_cost, grad=lambda op, dy: [stack(dy, op.attrs["axis"])], view=_view_split)
_register("Gather", _gather_infer, num_inputs=2, attrs={"axis": ("int", 0)}, group=MOVEMENT,
          cost=_gather_cost, grad=_g_gather)
# GatherGrad(dy, indices, params): the dense scatter-add of dy into zeros shaped like params.
_register("GatherGrad", _gather_grad_infer, num_inputs=3, attrs={"axis": ("int", 0)}, group=MOVEMENT,
          cost=_scatter_add_cost, grad=_g_gather_grad)
_register("OneHot", _one_hot_infer, num_inputs=1,
          attrs={"depth": ("int", REQUIRED), "on_value": ("float", 1.0), "off_value": ("float", 0.0),
                 "axis": ("int", -1), "dtype": ("dtype", "float32")},
          group=MOVEMENT, cost=elementwise_cost, differentiable=False)
_register("Fill", _fill_infer, num_inputs=0,
          attrs={"shape": ("shape", REQUIRED), "value": ("float", 0.0), "dtype": ("dtype", "float32")},
          group=SOURCE, cost=_fill_cost, differentiable=False)


# ---------------------------------------------------------------------------- Python API
def _int_tensor(x: Any, like: Any) -> Tensor:
    """Indices stay integers: a list or array becomes an int Const, never a Const of the params' dtype."""
    if isinstance(x, Tensor):
        return x
    arr = np.asarray(x)
    return constant(arr if arr.dtype.kind in "iu" else arr.astype(np.int32), graph=graph_of(like, x))


def shape(x: Any, out_type: Any = "int32", name: str | None = None) -> Tensor:
    """x's runtime shape as a 1-D integer tensor."""
    return make1("Shape", [x], {"out_type": as_dtype(out_type)}, name=name)


def rank(x: Any, name: str | None = None) -> Tensor:
    return make1("Rank", [x], name=name)


def reshape(x: Any, shape: Sequence[int], name: str | None = None) -> Tensor:
    """`shape` is static; one entry may be -1 (inferred from the element count)."""
    return make1("Reshape", [x], {"shape": tuple(int(d) for d in shape)}, name=name)


def transpose(x: Any, perm: Sequence[int] | None = None, name: str | None = None) -> Tensor:
    """perm=None reverses the dims; negative entries count from the end."""
    if perm is not None:
        x = x if isinstance(x, Tensor) else constant(x)
        r = len(x.shape)
        perm = [p % r if -r <= p < 0 else p for p in perm]
    return make1("Transpose", [x], {"perm": perm}, name=name)


def concat(values: Sequence[Any], axis: int, name: str | None = None) -> Tensor:
    return make1("Concat", list(values), {"axis": int(axis)}, name=name)


def split(x: Any, num_or_size_splits: int | Sequence[int], axis: int = 0,
          name: str | None = None) -> list[Tensor]:
    """An int splits into that many equal parts; a list gives the sizes (one may be -1)."""
    if isinstance(num_or_size_splits, (int, np.integer)):
        attrs: dict[str, Any] = {"num": int(num_or_size_splits), "axis": axis}
    else:
        attrs = {"sizes": tuple(int(s) for s in num_or_size_splits), "axis": axis}
    return make("Split", [x], attrs, name=name)


def slice_(x: Any, begin: Sequence[int], size: Sequence[int], name: str | None = None) -> Tensor:
    """x[begin[i] : begin[i] + size[i]] per dim; a size of -1 runs to the end of the dim."""
    return make1("Slice", [x], {"begin": tuple(begin), "size": tuple(size)}, name=name)


def pad(x: Any, paddings: Sequence[Any], constant_values: float = 0.0, name: str | None = None) -> Tensor:
    """`paddings` is one (before, after) pair per dim, given as [[b0, a0], [b1, a1], ...] or flat
    [b0, a0, b1, a1, ...] (the form the graph stores)."""
    flat: list[int] = []
    for p in paddings:
        flat.extend(int(v) for v in p) if isinstance(p, (list, tuple, np.ndarray)) else flat.append(int(p))
    return make1("Pad", [x], {"paddings": tuple(flat), "constant_values": float(constant_values)}, name=name)


def tile(x: Any, multiples: Sequence[int], name: str | None = None) -> Tensor:
    return make1("Tile", [x], {"multiples": tuple(multiples)}, name=name)


def expand_dims(x: Any, axis: int, name: str | None = None) -> Tensor:
    return make1("ExpandDims", [x], {"axis": int(axis)}, name=name)


def squeeze(x: Any, axis: int | Sequence[int] | None = None, name: str | None = None) -> Tensor:
    """axis=None removes every dim statically known to be 1 (unknown dims are kept)."""
    if axis is None:
        if not isinstance(x, Tensor):
            x = constant(x)
        axis = [i for i, d in enumerate(x.shape) if d == 1]
    elif isinstance(axis, (int, np.integer)):
        axis = [int(axis)]
    return make1("Squeeze", [x], {"axis": tuple(axis)}, name=name)


def stack(values: Sequence[Any], axis: int = 0, name: str | None = None) -> Tensor:
    return make1("Stack", list(values), {"axis": int(axis)}, name=name)


def unstack(x: Any, axis: int = 0, name: str | None = None) -> list[Tensor]:
    """One tensor per entry along `axis`, whose size must be known statically."""
    return make("Unstack", [x], {"axis": int(axis)}, name=name)


def gather(params: Any, indices: Any, axis: int = 0, name: str | None = None) -> Tensor:
    """params[..., indices, ...] along `axis`: shape params[:axis] + indices.shape + params[axis+1:]."""
    g = graph_of(params, indices)
    p = params if isinstance(params, Tensor) else constant(params, graph=g)
    return make1("Gather", [p, _int_tensor(indices, p)], {"axis": int(axis)}, name=name)


def one_hot(indices: Any, depth: int, on_value: float = 1.0, off_value: float = 0.0, axis: int = -1,
            dtype: Any = "float32", name: str | None = None) -> Tensor:
    """Out-of-range indices (negative ones included) give a row of off_value, as in TensorFlow."""
    return make1("OneHot", [_int_tensor(indices, indices)],
                 {"depth": int(depth), "on_value": float(on_value), "off_value": float(off_value),
                  "axis": int(axis), "dtype": as_dtype(dtype)}, name=name)


def fill(shape: Sequence[int], value: float, dtype: Any = "float32", name: str | None = None) -> Tensor:
    return make1("Fill", [], {"shape": tuple(shape), "value": float(value), "dtype": as_dtype(dtype)},
                 name=name, graph=graph_of())


def zeros(shape: Sequence[int], dtype: Any = "float32", name: str | None = None) -> Tensor:
    return fill(shape, 0.0, dtype, name=name or "zeros")


def ones(shape: Sequence[int], dtype: Any = "float32", name: str | None = None) -> Tensor:
    return fill(shape, 1.0, dtype, name=name or "ones")

