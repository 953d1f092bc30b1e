"""FusedElementwise: a tree of element-wise ops run as one node (the fusion pass, engine/fusion.py).

The node's one attribute, `program`, is a JSON string, kept deliberately small so that a backend can
generate one kernel from it (a cupy ElementwiseKernel on the GPU):

    {"inputs": ["float32", "float32", "float32"],          # dtypes of the node's inputs, in order
     "steps": [{"op": "Mul",  "attrs": {}, "args": [0, 1], "dtype": "float32", "name": "dense/mul"},
               {"op": "Add",  "attrs": {}, "args": [3, 2], "dtype": "float32", "name": "dense/add"},
               {"op": "Relu", "attrs": {}, "args": [4],    "dtype": "float32", "name": "dense/relu"}]}

Values are numbered like registers: 0 .. n-1 are the node's n inputs, n + j is the result of step
j. A step's `args` name earlier values only, its `attrs` are the op's attributes as a GraphDef
writes them (OpDef.encode_attrs), `dtype` is its inferred result dtype and `name` the node it was
(for messages and traces). The node's output is the last step's result. Every step's op is an
ordinary registered element-wise op, so inference, cost and the CPU kernel are those of the steps.

No gradient: the pass runs on the finished training step, after autodiff (§4.1), so a gradient of
a fused node is always a mistake in the order of passes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from flowctl.engine.errors import GraphError
from flowctl.engine.opdef import ELEMENTWISE, REQUIRED, get_op, memory_bytes, register_op
from flowctl.engine.shapes import InferError, TensorSpec

FUSED_OP = "FusedElementwise"


@dataclass(frozen=True)
class FusedStep:
    op: str
    attrs: dict[str, Any]  # resolved (decoded) attributes
    args: tuple[int, ...]  # value numbers: < num_inputs an input, else num_inputs + an earlier step
    dtype: str
    name: str


@dataclass(frozen=True)
class FusedProgram:
    inputs: tuple[str, ...]
    steps: tuple[FusedStep, ...]

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    def to_json(self) -> str:
        return json.dumps({"inputs": list(self.inputs), "steps": [
            {"op": s.op, "attrs": get_op(s.op).encode_attrs(s.attrs), "args": list(s.args), "dtype": s.dtype,
             "name": s.name} for s in self.steps]}, sort_keys=True, separators=(",", ":"))


@lru_cache(maxsize=4096)
def parse_program(text: str) -> FusedProgram:
    """The program of a FusedElementwise node, checked: known element-wise ops, operands that name
    an input or an earlier step. Cached: inference, cost and kernel binding all read it."""
    try:
        d = json.loads(text)
        inputs = tuple(str(t) for t in d["inputs"])
        steps = []
        for j, s in enumerate(d["steps"]):
            opdef = get_op(s["op"])
            if opdef.group != ELEMENTWISE or s["op"] == FUSED_OP:
                raise GraphError(f"step {j}: {s['op']} is not an element-wise op")
            args = tuple(int(a) for a in s["args"])
            if any(a < 0 or a >= len(inputs) + j for a in args):
                raise GraphError(f"step {j} ({s['op']}): operands {list(args)} must name one of the "
                                 f"{len(inputs)} inputs or an earlier step")
            steps.append(FusedStep(s["op"], opdef.decode_attrs(s.get("attrs", {}), s.get("name", f"step{j}")),
                                   args, str(s["dtype"]), str(s.get("name", f"step{j}"))))
    except (KeyError, TypeError, ValueError) as e:
        raise GraphError(f"{FUSED_OP}: malformed program ({type(e).__name__}: {e})") from None
    if not steps:
        raise GraphError(f"{FUSED_OP}: a program needs at least one step")
    return FusedProgram(inputs, tuple(steps))


def step_specs(program: FusedProgram, ins: list[TensorSpec]) -> list[TensorSpec]:
    """Every value of the program (inputs, then each step's result) by each step's own inference."""
    vals = list(ins)
    for s in program.steps:
        try:
            out = get_op(s.op).infer([vals[a] for a in s.args], s.attrs)
        except InferError as e:
            raise InferError(f"step '{s.name}' ({s.op}): {e}") from None
        vals.append(TensorSpec(tuple(out[0].shape), out[0].dtype))
    return vals


def _infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    program = parse_program(attrs["program"])
    if len(ins) != program.num_inputs:
        raise InferError(f"the program reads {program.num_inputs} input(s), the node has {len(ins)}")
    return [step_specs(program, ins)[-1]]


def _cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
          attrs: dict[str, Any]) -> tuple[float, float]:
    """FLOPs: the steps' own, summed. Bytes: the inputs read once and the output written once --
    the intermediates stay in registers, which is what fusion buys."""
    program = parse_program(attrs["program"])
    vals = step_specs(program, [TensorSpec(tuple(s), t) for s, t in zip(ins, program.inputs)])
    flops = 0.0
    for j, s in enumerate(program.steps):
        out = vals[program.num_inputs + j]
        f, _ = get_op(s.op).cost([tuple(vals[a].shape) for a in s.args], [tuple(out.shape)], [out.dtype], s.attrs)
        flops += f
    return flops, memory_bytes(ins, outs, dtypes)


def _no_gradient(op: Any, dy: list[Any]) -> list[Any]:
    raise GraphError(f"node '{op.name}' ({FUSED_OP}) has no gradient: fusion runs on the finished step, after "
                     f"autodiff; take gradients of the unfused graph (training.fuse: false) instead")


register_op(FUSED_OP, _infer, min_inputs=1, attrs={"program": ("str", REQUIRED)}, group=ELEMENTWISE,
            grad=_no_gradient, cost=_cost)
