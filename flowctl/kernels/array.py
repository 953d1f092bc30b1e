"""Array (movement) kernels, written once against the array module `xp` (numpy or cupy).

Reshape, Transpose, Slice, ExpandDims, Squeeze, Split and Unstack return views where the array
module gives one: no kernel writes into an input, so sharing the buffer is safe and saves a copy.
A multi-output kernel returns a tuple, except when the node has a single output (Split into one
part), where it returns the array itself, as every single-output kernel does.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.registry import kernel

Fn = Callable[..., Any]


def _outputs(parts: Sequence[Any]) -> Any:
    return parts[0] if len(parts) == 1 else tuple(parts)


def _split_points(sizes: Sequence[int]) -> list[int]:
    points, total = [], 0
    for s in sizes[:-1]:
        total += s
        points.append(total)
    return points


@kernel("Shape")
def shape(xp: Any, attrs: dict[str, Any]) -> Fn:
    dtype = attrs["out_type"]
    return lambda x: xp.asarray(x.shape, dtype=dtype)


@kernel("Rank")
def rank(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda x: xp.asarray(x.ndim, dtype="int32")


@kernel("Reshape")
def reshape(xp: Any, attrs: dict[str, Any]) -> Fn:
    target = tuple(attrs["shape"])
    return lambda x: x.reshape(target)


@kernel("ReshapeLike")
def reshape_like(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda x, like: x.reshape(like.shape)


@kernel("Transpose")
def transpose(xp: Any, attrs: dict[str, Any]) -> Fn:
    perm = attrs["perm"]
    if perm is None:
        return lambda x: x.transpose()
    perm = tuple(perm)
    return lambda x: x.transpose(perm)


def _joined(xp: Any, xs: tuple[Any, ...], axis: int) -> Any:
    """concatenate(xs, axis) as one copy per input into slices of the output: cupy's own
    concatenate of many arrays uploads a table of their pointers from the host, which a CUDA-graph
    capture refuses."""
    nd = xs[0].ndim
    ax = axis + nd if axis < 0 else axis
    shape = list(xs[0].shape)
    shape[ax] = sum(int(x.shape[ax]) for x in xs)
    out = xp.empty(tuple(shape), dtype=xp.result_type(*xs))
    at = 0
    index: list[Any] = [slice(None)] * nd
    for x in xs:
        n = int(x.shape[ax])
        index[ax] = slice(at, at + n)
        out[tuple(index)] = x
        at += n
    return out


# A numpy concatenation of at least this many bytes, along any axis but the first, is copied in runs
# of the first axis on the intra-op threads (a copy: the same bytes whatever the runs). Measured,
# Inception-v3's channel concatenations at batch 8, 2 threads: 35x35x(64+64+96+64) 1.69 -> 0.91 ms,
# 17x17x(384+384+288) 1.42 -> 0.61, 17x17x(320+768+192) 1.88 -> 1.04; 8x8 ones (4 MB) even.
CONCAT_PIECES_BYTES = 1 << 21


def _concatenated(xs: tuple[Any, ...], axis: int) -> Any:
    nd = xs[0].ndim
    ax = axis + nd if axis < 0 else axis
    rest = lambda x: x.shape[:ax] + x.shape[ax + 1:]  # noqa: E731
    if (not 0 < ax < nd or xs[0].shape[0] < 2 or sum(x.nbytes for x in xs) < CONCAT_PIECES_BYTES
            or any(x.ndim != nd or rest(x) != rest(xs[0]) for x in xs)):
        return np.concatenate(xs, axis=axis)  # (and its own message for shapes that do not fit)
    shape = list(xs[0].shape)
    shape[ax] = sum(int(x.shape[ax]) for x in xs)
    out = np.empty(tuple(shape), dtype=np.result_type(*xs))
    intra.for_chunks(shape[0], lambda run: np.concatenate([x[run.start:run.stop] for x in xs], axis=ax,
                                                          out=out[run.start:run.stop]), least=2)
    return out


@kernel("Concat")
def concat(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis = attrs["axis"]
    if xp is not np:
        return lambda *xs: _joined(xp, xs, axis)
    return lambda *xs: _concatenated(xs, axis)


@kernel("Split")
def split(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis, num, sizes = attrs["axis"], attrs["num"], attrs["sizes"]
    if sizes is None:
        return lambda x: _outputs(xp.split(x, num, axis=axis))
    if -1 not in sizes:
        points = _split_points(sizes)
        return lambda x: _outputs(xp.split(x, points, axis=axis))

    def run(x: Any) -> Any:  # the -1 part takes what the others leave of the runtime dim
        rest = x.shape[axis] - sum(s for s in sizes if s != -1)
        return _outputs(xp.split(x, _split_points([rest if s == -1 else s for s in sizes]), axis=axis))

    return run


@kernel("SplitLike")
def split_like(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis = attrs["axis"]

    def run(dy: Any, *likes: Any) -> Any:
        return _outputs(xp.split(dy, _split_points([like.shape[axis] for like in likes]), axis=axis))

    return run


@kernel("Slice")
def slice_(xp: Any, attrs: dict[str, Any]) -> Fn:
    region = tuple(slice(b, None if s == -1 else b + s) for b, s in zip(attrs["begin"], attrs["size"]))
    return lambda x: x[region]


@kernel("SliceGrad")
def slice_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    begin = attrs["begin"]

    def run(dy: Any, like: Any) -> Any:
        out = xp.zeros(like.shape, dtype=dy.dtype)
        out[tuple(slice(b, b + d) for b, d in zip(begin, dy.shape))] = dy
        return out

    return run


@kernel("Pad")
def pad(xp: Any, attrs: dict[str, Any]) -> Fn:
    flat, value = attrs["paddings"], attrs["constant_values"]
    pairs = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]

    # One full() and one strided write: cheaper than xp.pad's general machinery for a constant border.
    def run(x: Any) -> Any:
        out = xp.full(tuple(d + b + a for d, (b, a) in zip(x.shape, pairs)), value, dtype=x.dtype)
        out[tuple(slice(b, b + d) for d, (b, _) in zip(x.shape, pairs))] = x
        return out

    return run


@kernel("PadGrad")
def pad_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    flat = attrs["paddings"]
    pairs = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    return lambda dy: dy[tuple(slice(b, d - a) for d, (b, a) in zip(dy.shape, pairs))]


@kernel("Tile")
def tile(xp: Any, attrs: dict[str, Any]) -> Fn:
    multiples = tuple(attrs["multiples"])
    return lambda x: xp.tile(x, multiples)


@kernel("TileGrad")
def tile_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    multiples = tuple(attrs["multiples"])
    # Tile lays copy k of dim i at k*d_i + j, so (m_i, d_i) is the row-major split of that dim.
    even = tuple(range(0, 2 * len(multiples), 2))

    def run(dy: Any) -> Any:
        split_shape: list[int] = []
        for m, d in zip(multiples, dy.shape):
            split_shape += [m, d // m]
        return dy.reshape(split_shape).sum(axis=even, dtype=dy.dtype)

    return run


@kernel("ExpandDims")
def expand_dims(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis = attrs["axis"]
    return lambda x: xp.expand_dims(x, axis)


@kernel("Squeeze")
def squeeze(xp: Any, attrs: dict[str, Any]) -> Fn:
    axes = tuple(attrs["axis"])
    if not axes:
        return lambda x: x
    return lambda x: xp.squeeze(x, axis=axes)


@kernel("Stack")
def stack(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis = attrs["axis"]
    if xp is not np:  # as Concat: no table of pointers from the host
        return lambda *xs: _joined(xp, tuple(xp.expand_dims(x, axis) for x in xs), axis)
    return lambda *xs: xp.stack(xs, axis=axis)


@kernel("Unstack")
def unstack(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis = attrs["axis"]

    def run(x: Any) -> Any:
        moved = xp.moveaxis(x, axis, 0)
        return _outputs([moved[i] for i in range(moved.shape[0])])

    return run


@kernel("Gather")
def gather(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis = attrs["axis"]
    return lambda params, indices: xp.take(params, indices, axis=axis)


def _gather_grad_layout(dy: Any, indices: Any, like: Any, axis: int) -> tuple[Any, Any, int, int, int]:
    """dy as (outer, n, inner) with its n flat indices made non-negative, plus (outer, dim, inner)."""
    a = axis % like.ndim
    dim = like.shape[a]
    outer = inner = 1
    for d in like.shape[:a]:
        outer *= d
    for d in like.shape[a + 1:]:
        inner *= d
    idx = indices.reshape(-1)
    idx = idx + dim * (idx < 0)  # numpy's take counts negative indices from the end: so must the adjoint
    return dy.reshape(outer, idx.size, inner), idx, outer, dim, a


# cupy's add.at (and scatter_add) takes int32, int64, uint32, uint64 and the floats only. The
# narrower integers and bool scatter into a 32-bit integer and are cast back, exactly: a sum of
# integers modulo 2**8 or 2**16 is the low bits of their sum modulo 2**32, which is what numpy's
# add.at (wrapping) gives; numpy adds booleans as "or", i.e. a nonzero count.
_SCATTER_WIDE = {"int8": "int32", "int16": "int32", "uint8": "uint32", "uint16": "uint32", "bool": "int32"}


def add_at_into_zeros(xp: Any, add_at: Fn, shape: tuple[int, ...], index: Any, updates: Any) -> Any:
    """zeros(shape) of `updates`' dtype with `updates` added at `index` (repeated indices add up),
    for every dtype on cupy as well as numpy (numpy's add.at takes every dtype as it is)."""
    dtype = np.dtype(updates.dtype)
    wide = None if xp is np else _SCATTER_WIDE.get(dtype.name)
    out = xp.zeros(shape, dtype=wide or dtype)
    add_at(out, index, updates if wide is None else updates.astype(wide))
    if wide is None:
        return out
    return out != 0 if dtype.name == "bool" else out.astype(dtype)


@kernel("GatherGrad")
def gather_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis = attrs["axis"]
    add_at = getattr(xp.add, "at", None)
    if add_at is None:  # cupy before ufunc.at: cupyx.scatter_add is the same operation
        import cupyx  # type: ignore[import-not-found]

        add_at = cupyx.scatter_add

    def run(dy: Any, indices: Any, like: Any) -> Any:
        d3, idx, outer, dim, _ = _gather_grad_layout(dy, indices, like, axis)
        out = add_at_into_zeros(xp, add_at, (outer, dim, d3.shape[2]), (slice(None), idx), d3)
        return out.reshape(like.shape)

    return run


# A run of up to this many equal ids is summed by whole-batch passes (`run_sums`); a longer one
# (a padding id repeated through a batch) by add.reduceat on its own rows.
_SHORT_RUN = 8


def run_sums(x: np.ndarray, starts: np.ndarray, axis: int) -> np.ndarray:
    """np.add.reduceat(x, starts, axis) to the bit, for `starts` strictly increasing from 0 (the
    runs of a sorted index vector), without reduceat's cost per run (~5 us each: 7.4 ms for the
    1,309 runs of lstm_lm's two-replica embedding gradient, 0.6 ms here).

    reduceat sums a run as its first slice plus numpy's pairwise sum of the rest, which below
    eight terms is a plain left-to-right sum from the second slice. Runs of up to `_SHORT_RUN`
    are therefore summed together, one pass per position in the run: rest = x[s+1], rest +=
    x[s+2], ..., then first + rest. Longer runs (few in practice) go to reduceat one by one."""
    n = x.shape[axis]
    lengths = np.diff(np.append(starts, n))
    out = np.take(x, starts, axis=axis)
    multi = np.flatnonzero((lengths > 1) & (lengths <= _SHORT_RUN))
    if multi.size:
        at = starts[multi]
        rest = np.take(x, at + 1, axis=axis)
        for j in range(2, int(lengths[multi].max())):
            more = np.flatnonzero(lengths[multi] > j)
            pos = (slice(None),) * axis + (more,)
            rest[pos] += np.take(x, at[more] + j, axis=axis)
        pos = (slice(None),) * axis + (multi,)
        out[pos] += rest
    for i in np.flatnonzero(lengths > _SHORT_RUN):
        s = int(starts[i])
        seg = (slice(None),) * axis + (slice(s, s + int(lengths[i])),)
        out[(slice(None),) * axis + (slice(i, i + 1),)] = np.add.reduceat(x[seg], [0], axis=axis)
    return out


@kernel("GatherGrad", device_types=("cpu",))
def gather_grad_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    """Sort the indices and sum each run of equal ones as add.reduceat does (`run_sums`): 2-3x
    faster than numpy's add.at on embedding-sized problems (measured 3.1 ms against 7.8 ms for 4096
    rows of 128 into 10000, with reduceat itself), with the same sums up to float rounding order."""
    axis = attrs["axis"]

    def run(dy: Any, indices: Any, like: Any) -> Any:
        d3, idx, outer, dim, _ = _gather_grad_layout(dy, indices, like, axis)
        out = xp.zeros((outer, dim, d3.shape[2]), dtype=dy.dtype)
        if idx.size:
            order = xp.argsort(idx, kind="stable")
            ids = idx[order]
            starts = xp.flatnonzero(xp.concatenate(([True], ids[1:] != ids[:-1])))
            out[:, ids[starts]] = run_sums(d3[:, order], starts, axis=1)
        return out.reshape(like.shape)

    return run


@kernel("OneHot")
def one_hot(xp: Any, attrs: dict[str, Any]) -> Fn:
    depth, axis, dtype = attrs["depth"], attrs["axis"], attrs["dtype"]
    on = xp.asarray(attrs["on_value"], dtype=dtype)
    off = xp.asarray(attrs["off_value"], dtype=dtype)
    classes = xp.arange(depth)

    def run(indices: Any) -> Any:
        # An index outside [0, depth) matches no class and so gives a row of off_value.
        out = xp.where(indices[..., None] == classes, on, off)
        a = axis % out.ndim
        return out if a == out.ndim - 1 else xp.moveaxis(out, -1, a)

    return run


@kernel("Fill")
def fill(xp: Any, attrs: dict[str, Any]) -> Fn:
    # Like Const, the value belongs to the plan: made once, read-only where the module allows it.
    value = xp.full(tuple(attrs["shape"]), attrs["value"], dtype=attrs["dtype"])
    setflags = getattr(value, "setflags", None)
    if setflags is not None:
        setflags(write=False)
    return lambda: value
