"""The FusedElementwise kernel (program format: engine/ops/fused.py), written once against `xp`.

It evaluates the program step by step with the very kernels the unfused ops use, so on the CPU a
fused node's result is bitwise the unfused graph's. What it saves there is the executor's per-node
work and the allocations: a step whose kernel is a ufunc writes into the buffer of an operand this
kernel made itself (an intermediate no one else can see, and dead after this step since every
intermediate has one consumer), when that buffer already has the step's shape and dtype and every
operand has that dtype (so numpy picks the same inner loop as without `out=`). A chain like
a*b+c -> relu thus lives in one scratch buffer. A later GPU backend replaces this body with one
generated kernel over the same program.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from flowctl.kernels.registry import KERNELS, kernel

Fn = Callable[..., Any]


def _fresh(r: Any, operands: list[Any], xp: Any) -> bool:
    """Whether `r` is a buffer the step just allocated (not an operand handed back, not a view)."""
    return isinstance(r, xp.ndarray) and r.base is None and all(r is not o for o in operands)


@kernel("FusedElementwise")
def fused_elementwise(xp: Any, attrs: dict[str, Any]) -> Fn:
    # The graph checked the program when the node was made (engine/ops/fused.py); kernels read the
    # format, not the op module. Element-wise attributes are plain JSON values (Cast's dtype name).
    program = json.loads(attrs["program"])
    device_type = "cpu" if xp is np else "gpu"
    ufunc = type(xp.add)
    steps: list[tuple[Fn, tuple[int, ...], bool, Any]] = []
    for s in program["steps"]:
        factory = KERNELS.get((s["op"], device_type))
        if factory is None:
            raise KeyError(f"no {device_type} kernel for op {s['op']} (step '{s['name']}' of a FusedElementwise)")
        fn = factory(xp, {**s["attrs"], "_node": s["name"]})
        in_place = isinstance(fn, ufunc) and fn.nout == 1
        steps.append((fn, tuple(s["args"]), in_place, np.dtype(s["dtype"])))
    n = len(program["inputs"])

    def run(*xs: Any) -> Any:
        vals = list(xs)
        owned = [False] * n  # inputs belong to the caller: never written
        for fn, args, in_place, dtype in steps:
            operands = [vals[a] for a in args]
            buf = None
            if in_place and all(o.dtype == dtype for o in operands):
                shape = np.broadcast_shapes(*(o.shape for o in operands))
                buf = next((vals[a] for a in args if owned[a] and vals[a].shape == shape), None)
            if buf is not None:
                r = fn(*operands, out=buf)
                vals.append(r)
                owned.append(True)
            else:
                r = fn(*operands)
                vals.append(r)
                owned.append(_fresh(r, operands, xp))
        return vals[-1]

    return run
