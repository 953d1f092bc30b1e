"""`flowctl export --format onnx`: a run's forward graph (inputs to logits) as an ONNX model, for the
ops ONNX has a form of here: matrix products, bias adds and element-wise arithmetic, the usual
activations, comparisons, casts, selects and ranges, mean and sum reductions, concat/split/stack/unstack,
reshape, transpose, slice, gather and constants (dense, embedding, layer norm, unrolled LSTM and GRU,
and Transformer layers). Anything else is refused naming the node, never exported approximately:
integer Div truncates in both, and TruncateMod is Mod(fmod=1), but a floor quotient and a float
floor remainder have no exact ONNX form.
Weights travel as initializers; a dimension the graph leaves open (the batch) is symbolic.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from flowctl.engine.dtypes import is_float
from flowctl.engine.errors import SpecError
from flowctl.engine.executor import needed_nodes
from flowctl.engine.graph import Graph, Node, parse_ref

OPSET = 17
SAME_NAME = {"Relu": "Relu", "Sigmoid": "Sigmoid", "Tanh": "Tanh", "Exp": "Exp", "Log": "Log", "Sqrt": "Sqrt",
             "Neg": "Neg", "Abs": "Abs", "Add": "Add", "Sub": "Sub", "Mul": "Mul", "Div": "Div",
             "Maximum": "Max", "Minimum": "Min", "Identity": "Identity", "Floor": "Floor", "Ceil": "Ceil",
             "Erf": "Erf", "Sin": "Sin", "Cos": "Cos", "Less": "Less", "Greater": "Greater", "Equal": "Equal"}


def onnx_module() -> Any:
    try:
        import onnx
    except ImportError:
        raise SpecError('ONNX export needs the onnx package: pip install -e ".[onnx]"') from None
    return onnx


class _Builder:
    def __init__(self, onnx: Any, graph: Graph) -> None:
        self.onnx, self.h, self.graph = onnx, onnx.helper, graph
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.count = 0

    def name(self, ref: str) -> str:
        node, port = parse_ref(ref)
        return f"{node}:{port}"

    def const(self, value: np.ndarray, hint: str) -> str:
        self.count += 1
        name = f"{hint}/const{self.count}"
        self.initializers.append(self.onnx.numpy_helper.from_array(np.asarray(value), name))
        return name

    def add(self, op: str, inputs: list[str], outputs: list[str], **attrs: Any) -> None:
        self.nodes.append(self.h.make_node(op, inputs, outputs, **attrs))


def _emit(b: _Builder, node: Node) -> None:
    ins = [b.name(r) for r in node.inputs]
    outs = [f"{node.name}:{p}" for p in range(len(node.outputs))]
    a = node.attrs
    if node.op in SAME_NAME:
        b.add(SAME_NAME[node.op], ins, outs)
    elif node.op == "Const":
        b.add("Constant", [], outs, value=b.onnx.numpy_helper.from_array(np.asarray(a["value"]), outs[0]))
    elif node.op == "Range":
        dt = np.dtype(a["dtype"])
        b.add("Range", [b.const(np.asarray(a[k], dt), node.name) for k in ("start", "limit", "delta")], outs)
    elif node.op == "Square":
        b.add("Mul", [ins[0], ins[0]], outs)
    elif node.op == "Rsqrt":
        b.add("Sqrt", ins, [outs[0] + "/sqrt"])
        b.add("Reciprocal", [outs[0] + "/sqrt"], outs)
    elif node.op == "Select":  # Where broadcasts its three operands as Select does
        b.add("Where", ins, outs)
    elif node.op == "Cast":
        b.add("Cast", ins, outs, to=b.onnx.helper.np_dtype_to_tensor_dtype(np.dtype(a["dtype"])))
    elif node.op == "Transpose":
        perm = a.get("perm")
        b.add("Transpose", ins, outs, **({} if perm is None else {"perm": [int(p) for p in perm]}))
    elif node.op in ("Mean", "Sum"):  # opset 17: ReduceMean's axes an attribute, ReduceSum's an input
        axes = None if a.get("axis") is None else [int(x) for x in a["axis"]]
        keep = int(bool(a.get("keepdims")))
        if node.op == "Mean":
            b.add("ReduceMean", ins, outs, keepdims=keep, **({} if axes is None else {"axes": axes}))
        else:
            extra = [] if axes is None else [b.const(np.asarray(axes, np.int64), node.name)]
            b.add("ReduceSum", ins + extra, outs, keepdims=keep)
    elif node.op == "BiasAdd":
        b.add("Add", ins, outs)
    elif node.op == "TruncateMod":  # C's fmod and %, as Div's integer quotient truncates too
        b.add("Mod", ins, outs, fmod=1)
    elif node.op == "FloorMod" and not is_float(node.outputs[0].dtype):  # ONNX takes fmod=0 on integers only
        b.add("Mod", ins, outs, fmod=0)
    elif node.op == "MatMul":
        x, w = ins
        if a.get("transpose_a"):
            b.add("Transpose", [x], [x + "/T"], perm=[1, 0])
            x += "/T"
        if a.get("transpose_b"):
            b.add("Transpose", [w], [w + "/T"], perm=[1, 0])
            w += "/T"
        b.add("MatMul", [x, w], outs)
    elif node.op in ("Softmax", "LogSoftmax"):  # opset 13 on: along one axis, as ours
        b.add(node.op, ins, outs, axis=int(a["axis"]))
    elif node.op == "BatchMatMul":  # adj_x / adj_y: the last two axes of that operand swapped
        operands = []
        for ref, spec, adj in zip(ins, b.graph.input_specs(node), (a.get("adj_x"), a.get("adj_y"))):
            if adj:
                r = len(spec.shape)
                b.add("Transpose", [ref], [ref + "/adj"], perm=[*range(r - 2), r - 1, r - 2])
                ref += "/adj"
            operands.append(ref)
        b.add("MatMul", operands, outs)
    elif node.op == "Concat":
        b.add("Concat", ins, outs, axis=int(a["axis"]))
    elif node.op == "Split":
        axis = int(a["axis"])
        if any(s.shape[axis] is None for s in node.outputs):  # equal parts of an open dimension (the
            b.add("Split", [ins[0]], outs, axis=axis)  # batch of an LSTM's steps): as many as outputs
        else:
            sizes = [int(s.shape[axis]) for s in node.outputs]
            b.add("Split", [ins[0], b.const(np.asarray(sizes, np.int64), node.name)], outs, axis=axis)
    elif node.op == "Stack":
        axis = int(a["axis"])
        axes = b.const(np.asarray([axis], np.int64), node.name)
        parts = [f"{i}/unsq" for i in ins]
        for i, p in zip(ins, parts):
            b.add("Unsqueeze", [i, axes], [p])
        b.add("Concat", parts, outs, axis=axis)
    elif node.op == "Unstack":
        axis = int(a["axis"])
        parts = [o + "/split" for o in outs]
        b.add("Split", [ins[0], b.const(np.ones(len(outs), np.int64), node.name)], parts, axis=axis)
        axes = b.const(np.asarray([axis], np.int64), node.name)
        for p, o in zip(parts, outs):
            b.add("Squeeze", [p, axes], [o])
    elif node.op == "Reshape":
        b.add("Reshape", [ins[0], b.const(np.asarray(a["shape"], np.int64), node.name)], outs)
    elif node.op == "Slice":
        begin = np.asarray(a["begin"], np.int64)
        size = np.asarray(a["size"], np.int64)
        ends = np.where(size < 0, np.iinfo(np.int64).max, begin + size)
        b.add("Slice", [ins[0], b.const(begin, node.name), b.const(ends, node.name),
                        b.const(np.arange(len(begin), dtype=np.int64), node.name)], outs)
    elif node.op == "Gather":
        b.add("Gather", ins, outs, axis=int(a["axis"]))
    elif node.op == "TransposeCopy":
        b.add("Transpose", ins, outs, perm=[1, 0])
    elif node.op == "RecurrentMatMul":  # h @ w (a third input, w's transpose, serves the gradient)
        b.add("MatMul", ins[:2], outs)
    elif node.op == "LSTMBlockCell":
        _lstm_cell(b, node, ins, outs)
    else:
        raise SpecError(f"ONNX export: node '{node.name}' ({node.op}) has no ONNX form in this exporter; export "
                        f"the flowctl format instead (flowctl export without --format)")


def _lstm_cell(b: _Builder, node: Node, ins: list[str], outs: list[str]) -> None:
    """The fused cell spelled out: z = xw (+ hw); gates i, f, g, o; c = s(f + bias) c_prev +
    s(i) tanh(g); h = s(o) tanh(c). Its third output (the activations a gradient reads) is not
    made: nothing in a forward graph reads it."""
    p = node.name + "/"
    z = ins[0]
    if len(ins) == 3:
        b.add("Add", ins[:2], [p + "z"])
        z = p + "z"
    units = int(node.outputs[0].shape[-1])
    i, f, g, o = (p + k for k in "ifgo")
    b.add("Split", [z, b.const(np.full(4, units, np.int64), node.name)], [i, f, g, o], axis=1)
    bias = float(node.attrs.get("forget_bias", 0.0))
    if bias:
        b.add("Add", [f, b.const(np.asarray(bias, np.dtype(node.outputs[0].dtype)), node.name)], [p + "f_biased"])
        f = p + "f_biased"
    for name, fn in ((i, "Sigmoid"), (f, "Sigmoid"), (g, "Tanh"), (o, "Sigmoid")):
        b.add(fn, [name], [name + "_act"])
    b.add("Mul", [i + "_act", g + "_act"], [p + "ig"])
    if len(ins) == 3:
        b.add("Mul", [f + "_act", ins[2]], [p + "fc"])
        b.add("Add", [p + "fc", p + "ig"], [outs[1]])
    else:
        b.add("Identity", [p + "ig"], [outs[1]])
    b.add("Tanh", [outs[1]], [p + "tanh_c"])
    b.add("Mul", [o + "_act", p + "tanh_c"], [outs[0]])


def to_onnx(graph: Graph, inputs: Mapping[str, str], outputs: Mapping[str, str], weights: Mapping[str, np.ndarray],
            name: str = "flowctl") -> Any:
    """The subgraph computing `outputs` (name -> ref) from `inputs` (name -> Placeholder ref), with
    each Variable it reads an initializer from `weights`."""
    onnx = onnx_module()
    b = _Builder(onnx, graph)
    needed = needed_nodes(graph, [parse_ref(r)[0] for r in outputs.values()], set())
    fed = {parse_ref(r)[0] for r in inputs.values()}
    for n in graph.topo_order(needed):
        node = graph.nodes[n]
        if node.op == "Variable":
            b.initializers.append(onnx.numpy_helper.from_array(np.asarray(weights[n]), f"{n}:0"))
        elif node.op == "Placeholder":
            if n not in fed:
                raise SpecError(f"ONNX export: the outputs need placeholder '{n}', which is not an input")
        else:
            _emit(b, node)

    def value_info(io_name: str, ref: str) -> Any:
        spec = graph.tensor(ref).spec
        dims: list[Any] = ["N" if d is None else int(d) for d in spec.shape]
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype))
        return onnx.helper.make_tensor_value_info(io_name, elem, dims)

    # The model's inputs and outputs carry the spec's names (`tokens`, `logits`), not tensor refs
    # (`tokens:0`): an Identity joins each to the tensor the nodes inside use.
    used = [(k, r) for k, r in inputs.items() if parse_ref(r)[0] in needed]
    b.nodes[:0] = [b.h.make_node("Identity", [k], [b.name(r)]) for k, r in used]
    for k, r in outputs.items():
        b.add("Identity", [b.name(r)], [k])
    g = onnx.helper.make_graph(b.nodes, name, [value_info(k, r) for k, r in used],
                               [value_info(k, r) for k, r in outputs.items()], initializer=b.initializers)
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", OPSET)],
                                   producer_name="flowctl")
    onnx.checker.check_model(model, full_check=True)
    return model


def write_onnx(model: Any, path: Path, write: Callable[[Path, bytes], None] | None = None) -> Path:
    data = model.SerializeToString()
    if write is not None:
        write(path, data)
    else:
        path.write_bytes(data)
    return path


__all__ = ["OPSET", "onnx_module", "to_onnx", "write_onnx"]
