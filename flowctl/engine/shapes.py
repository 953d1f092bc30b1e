"""Static shapes with unknown dimensions (None), and the inference helpers ops share."""
from __future__ import annotations

from typing import NamedTuple, Sequence

Shape = tuple  # tuple[int | None, ...]


class TensorSpec(NamedTuple):
    shape: Shape
    dtype: str


class InferError(Exception):
    """Raised by an op's shape function; the graph adds the node and input names."""


def dims_equal(a: int | None, b: int | None) -> bool:
    return a is None or b is None or a == b


def merge_dim(a: int | None, b: int | None) -> int | None:
    return b if a is None else a


def broadcast(*shapes: Shape) -> Shape:
    """numpy broadcasting over static shapes; an unknown dim broadcasts with anything."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[int | None] = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        known = {d for d in dims if d is not None and d != 1}
        if len(known) > 1:
            raise InferError(f"shapes {', '.join(map(str, shapes))} do not broadcast")
        if known:
            out.append(known.pop())
        elif any(d is None for d in dims):
            out.append(None)
        else:
            out.append(1)
    return tuple(out)


def num_elements(shape: Shape) -> int | None:
    n = 1
    for d in shape:
        if d is None:
            return None
        n *= d
    return n


def normalize_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise InferError(f"axis {axis} out of range for rank {rank}")
    return axis % rank if rank else 0


def normalize_axes(axes: Sequence[int] | None, rank: int) -> tuple[int, ...]:
    if axes is None:
        return tuple(range(rank))
    return tuple(sorted({normalize_axis(a, rank) for a in axes}))


def concrete(shape: Shape, batch: int = 1) -> tuple[int, ...]:
    """A shape with unknown dims replaced by `batch`, for cost estimates."""
    return tuple(batch if d is None else d for d in shape)
