"""Every registered op, on every dtype its shape function accepts: the kernel's result has exactly
the dtype and shape inference declared, and the optimizer (constant folding, CSE) changes no bit.

How each op is reached: template programs (the finite-difference cases of
test_gradients_all_ops, with their gradients, plus the non-differentiable ops below) are built on
float64 placeholders and run once; the first node of each op gives a template (its attrs and the
values its inputs took). For every dtype, the op is rebuilt in a fresh graph on Consts of those
values, with each float64 input (and float64 dtype/tensor attribute) turned into that dtype. If
inference refuses, the op does not take that dtype; if it accepts, the node runs with the optimizer
off (the kernel) and on (folded into a Const by the same kernel), and both must agree with what was
declared and with each other, bit for bit.

An op registered later that no template reaches fails `test_every_op_is_covered_or_listed` until it
gets a template or a line in LEFT_OUT saying why it cannot have one.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.dtypes import DTYPES, FLOATS
from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Graph, make_ref
from flowctl.engine.ops.api import make1
from flowctl.engine.opdef import ATTR_TYPES, OPS
from test_gradients_all_ops import CASES

from flowctl.engine.frames import ROOT, assign_frames

R = np.random.default_rng(7)

LEFT_OUT = {
    "Placeholder": "a feed, not a computation: its value and dtype are whatever is fed",
    "Variable": "state in a Container (tests/test_session.py); not foldable, so on/off is moot",
    "Assign": "writes a Variable (tests/test_session.py)",
    "AssignAdd": "writes a Variable (tests/test_session.py)",
    "AssignSub": "writes a Variable (tests/test_session.py)",
    "ApplyGradientDescent": "writes a Variable (tests/test_optimizers.py)",
    "SparseApplyGradientDescent": "writes a Variable (tests/test_train_step_kernels.py)",
    "ApplyMomentum": "writes a Variable and its slot (tests/test_optimizers.py)",
    "ApplyAdam": "writes a Variable and its slots (tests/test_optimizers.py)",
    "MultiL2Loss": "L2Loss nodes and their AddN, made by a GPU plan's pass (tests/test_multi_l2.py)",
    "GatherGradRows": "made by the optimizer from a GatherGrad, not by a template (tests/test_train_step_kernels.py)",
    "GuardFlag": "a bool scalar passed through, raising a device flag (tests/test_capture_ledger.py)",
    "FIFOQueue": "a queue resource, no tensor output (tests/test_queues.py)",
    "RandomShuffleQueue": "a queue resource, no tensor output (tests/test_queues.py)",
    "Enqueue": "needs a queue resource (tests/test_queues.py)",
    "EnqueueMany": "needs a queue resource (tests/test_queues.py)",
    "Dequeue": "needs a filled queue resource (tests/test_queues.py)",
    "DequeueMany": "needs a filled queue resource (tests/test_queues.py)",
    "QueueClose": "needs a queue resource (tests/test_queues.py)",
    "QueueSize": "needs a queue resource (tests/test_queues.py)",
    "Send": "inserted by partitioning, needs a rendezvous and a peer Recv (tests/test_partition.py)",
    "Recv": "inserted by partitioning, needs a rendezvous and a peer Send (tests/test_partition.py)",
    "CollectiveAllReduce": "N ranks meeting in a step's rendezvous (tests/test_collective.py)",
    "MultiApplyGradientDescent": "made on a GPU plan from ApplyGradientDescent nodes, whose kernels it runs "
                                 "(tests/test_multi_apply.py)",
    "MultiApplyMomentum": "made on a GPU plan from ApplyMomentum nodes (tests/test_multi_apply.py)",
    "MultiApplyAdam": "made on a GPU plan from ApplyAdam nodes (tests/test_multi_apply.py)",
    "FusedConv2D": "made by a CPU plan's pass from a Conv2D and the inference ChannelAffine reading it, covered "
                   "here, whose kernels it runs (tests/test_conv_affine.py)",
    "PackPanels": "made by a CPU plan's pass from a recurrent weight, float32 only, its bits tested against "
                  "the weight (tests/test_recurrent_pack.py)",
    "PanelMatMul": "made by a CPU plan's pass from RecurrentMatMul and its gradient's MatMul, reading "
                   "PackPanels's form (tests/test_recurrent_pack.py)",
    "BiasSparseXent": "made by a CPU plan's pass from BiasAdd and the sparse softmax cross-entropy reading it, "
                      "covered here, whose kernels it runs (tests/test_xent_bias.py)",
    "XentGradBias": "made by a CPU plan's pass from XentGrad and the BiasAddGrad reading it, covered here "
                    "(tests/test_xent_bias.py)",
    "ConcatMatMul": "made by a CPU plan's pass from MatMuls that only a row Concat reads, covered here "
                    "(tests/test_concat_products.py)",
    "NoOp": "no outputs",
    "FusedElementwise": "made by the fusion pass from element-wise ops covered here, whose kernels it runs "
                        "(tests/test_fusion.py)",
    "Group": "no outputs",
    **{op: "control flow (§4.4): runs per frame and iteration or on one branch (tests/test_control_flow.py)"
       for op in ("Switch", "Merge", "Enter", "Exit", "NextIteration", "LoopSum")},
    **{op: "a loop gradient's per-iteration store, a variant handle (tests/test_control_flow.py)"
       for op in ("AccCreate", "AccPush", "AccRead", "AccStack")},
}


def _extra(x, y, p, m, i, v) -> list[fc.Tensor]:
    """Ops the gradient cases do not reach: comparisons, casts, sources, random draws, int inputs."""
    p = fc.unstack(p)
    return [
        fc.less(x, p[0]), fc.equal(x, y), make1("GreaterEqual", [x, p[1]]), make1("LessEqual", [x, y]),
        fc.cast(x, "int8"), fc.cast(x, "uint16"), fc.cast(x, "float16"), fc.cast(x, "bool"),
        fc.round_bf16(fc.cast(x, "float32")),
        fc.zeros_like(x), fc.ones_like(x), fc.stop_gradient(x), fc.argmax(x, axis=1),
        fc.shape(x), fc.rank(x), fc.fill([2, 3], 1.5, dtype="float64"), fc.constant(np.arange(6.0).reshape(2, 3)) * m,
        fc.one_hot(i, 4, dtype="float64"), fc.random_uniform([3, 2], dtype="float64", seed=3),
        fc.random_normal([3, 2], dtype="float64", seed=4), fc.truncated_normal([2, 2], dtype="float64", seed=5),
        fc.dropout(x, 0.5, seed=6), fc.reduce_min(x, axis=0), fc.reduce_prod(x, axis=[0, 1]),
        fc.div(v, fc.constant(np.array([2, -3, 0], np.int32))),
        fc.gather(p[2], i), fc.split(x, 3, axis=1)[1], fc.is_nan(fc.log(x)), fc.is_inf(fc.log(x) * 0.0),
        fc.range_(-1, 4.5, 1.5, dtype="float64"), fc.mod(v, fc.constant(np.array([2, -3, 0], np.int32))),
        fc.floordiv(x, y), fc.truncatemod(v, fc.constant(np.array([2, -3, 0], np.int32))),
    ]


def _templates_from(build: Callable[..., Any], inputs: dict[str, np.ndarray], shapes: dict[str, tuple],
                    grads: bool, found: dict[str, tuple]) -> None:
    g = Graph(seed=1)
    with g.as_default():
        phs = {k: fc.placeholder(a.dtype.name, shapes.get(k, a.shape), name=k) for k, a in inputs.items()}
        outs = build(**phs)
        ys = [outs] if isinstance(outs, fc.Tensor) else list(outs)
        floats = [t for t in ys if t.dtype == "float64"]
        if grads and floats:
            wrt = [t for t in phs.values() if t.dtype == "float64"]
            fc.gradients(floats, wrt, grad_ys=[fc.ones_like(t) * 0.7 for t in floats])
    # A node inside a loop runs once per iteration in its frame, and one in a branch of a cond may
    # not run at all: neither can be fetched on its own (tests/test_control_flow.py covers them).
    frame = assign_frames(g).exec_frame
    outside = {n for n in g.nodes if frame.get(n, ROOT) == ROOT} - _in_branches(g)
    new = [n for n in g.nodes.values() if n.op not in found and n.op not in LEFT_OUT and n.name in outside
           and all(r.split(":")[0] in outside for r in n.inputs)]
    refs = sorted({r for n in new for r in n.inputs})
    feeds = {phs[k]: a for k, a in inputs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the log of a negative, meant for IsNaN
        values = dict(zip(refs, fc.Session(g, store=fc.ContainerStore()).run(refs, feeds))) if refs else {}
    for n in new:
        if n.op not in found:
            ins = [(np.asarray(values[r]), g.nodes[r.split(":")[0]].outputs[int(r.split(":")[1])
                                                                     if ":" in r else 0].dtype)
                   for r in n.inputs]
            found[n.op] = (dict(n.attrs), ins)


def _in_branches(g: Graph) -> set[str]:
    """Nodes downstream of a Switch short of its Merge: they run only when their branch is taken."""
    consumers: dict[str, list[str]] = {}
    for n in g.nodes.values():
        for r in n.inputs:
            consumers.setdefault(r.split(":")[0], []).append(n.name)
    todo = [c for n in g.nodes.values() if n.op == "Switch" for c in consumers.get(n.name, [])]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or g.nodes[name].op == "Merge":
            continue
        seen.add(name)
        todo.extend(consumers.get(name, []))
    return seen


def _templates() -> dict[str, tuple[dict[str, Any], list[tuple[np.ndarray, str]]]]:
    found: dict[str, tuple] = {}
    for name in sorted(CASES):
        build, inputs, kw = CASES[name]
        _templates_from(build, inputs, kw.get("shapes", {}), True, found)
    extra = {"x": R.standard_normal((2, 3)), "y": np.round(R.standard_normal(3)), "p": R.standard_normal((3, 3)),
             "m": np.arange(6.0).reshape(2, 3), "i": np.array([2, 0, 1], np.int32),
             "v": np.array([7, -7, 5], np.int32)}
    _templates_from(_extra, extra, {}, False, found)
    return found


TEMPLATES = _templates()


# An integer raised to a negative integer power is an error (numpy's and TensorFlow's), so Pow's
# integer exponents are drawn non-negative.
NON_NEGATIVE = {("Pow", 1)}


def _as(value: np.ndarray, dtype: str) -> np.ndarray:
    """A float64 template value in `dtype`, keeping the integers varied and within range (a NaN
    becomes 0 outside the floats)."""
    if dtype not in FLOATS:
        value = np.nan_to_num(value, nan=0.0, posinf=100.0, neginf=-100.0)
    if dtype == "bool":
        return value > 0
    if dtype.startswith("uint"):
        return np.round(np.abs(value) * 3).astype(dtype)
    if dtype.startswith("int"):
        return np.round(value * 3).astype(dtype)
    return value.astype(dtype)


def _variant(op: str, dtype: str) -> tuple[Graph, Any] | None:
    """The op rebuilt on Consts with float64 turned into `dtype`, or None if inference refuses it."""
    attrs, ins = TEMPLATES[op]
    spec = OPS[op].attrs
    attrs = dict(attrs)
    for k, v in attrs.items():
        if spec[k][0] == "dtype" and v == "float64":
            attrs[k] = dtype
        elif spec[k][0] == "tensor" and v.dtype == np.float64:
            attrs[k] = _as(v, dtype)
    g = Graph(seed=1)
    try:
        with g.as_default():
            consts = [fc.constant(_as(np.abs(a) if (op, port) in NON_NEGATIVE else a, dtype) if dt == "float64"
                                  else a.astype(dt)) for port, (a, dt) in enumerate(ins)]
            node = g.add_node(op, consts, attrs, name="op")
    except GraphError:
        return None
    return g, node


def test_every_op_is_covered_or_listed():
    # Ops that other tests register for their own purposes (their shape functions live in tests) are
    # not flowctl's.
    ours = {n for n, d in OPS.items() if d.infer.__module__.startswith("flowctl.")}
    missing = sorted(ours - set(TEMPLATES) - set(LEFT_OUT))
    assert not missing, f"ops with neither a dtype template nor a reason in LEFT_OUT: {missing}"
    both = sorted(set(TEMPLATES) & set(LEFT_OUT))
    assert not both, f"ops both covered and listed as left out: {both}"


@pytest.mark.parametrize("op", sorted(TEMPLATES))
def test_dtypes_and_shapes_match_inference_with_optimizer_off_and_on(op):
    accepted = []
    for dtype in DTYPES:
        built = _variant(op, dtype)
        if built is None:
            continue
        g, node = built
        accepted.append(dtype)
        refs = [make_ref(node.name, p) for p in range(len(node.outputs))]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # log of a negative, int overflow, ...
            off = fc.Session(g, store=fc.ContainerStore()).run(refs)
            on = fc.Session(g, store=fc.ContainerStore(), optimize=True).run(refs)
        for port, (a, b, want) in enumerate(zip(off, on, node.outputs)):
            where = f"{op} on {dtype}, output {port}"
            # numpy hands back a 0-d result of a ufunc as a scalar (np.bool_, np.float32): a value with
            # the dtype and shape () all the same.
            assert isinstance(a, (np.ndarray, np.generic)), f"{where}: kernel returned {type(a).__name__}, not an array"
            assert a.dtype.name == want.dtype, f"{where}: kernel gave {a.dtype}, inference said {want.dtype}"
            assert a.shape == tuple(want.shape), f"{where}: kernel gave {a.shape}, inference said {want.shape}"
            assert b.dtype == a.dtype and b.shape == a.shape, f"{where}: optimizer changed {a.dtype}{a.shape}"
            assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), \
                f"{where}: optimizer changed values {a!r} -> {b!r}"
    assert accepted, f"{op} accepts no dtype at all, not even its template's"


BF16_OPS = sorted(op for op in TEMPLATES if _variant(op, "bfloat16") is not None)


def test_most_ops_take_bfloat16():
    # Everything float16 takes (the ops that refuse bfloat16 would have to say why here).
    refused = [op for op in TEMPLATES if _variant(op, "float16") is not None and op not in BF16_OPS]
    assert not refused, f"ops that take float16 but refuse bfloat16: {refused}"


@pytest.mark.parametrize("op", BF16_OPS)
def test_bfloat16_is_the_float32_kernel_rounded(op):
    """An op on bfloat16 gives what it gives on the same values in float32, its bfloat16 outputs
    rounded to nearest even (kernels/bf16.py): through the executor, with the optimizer on."""
    g16, n16 = _variant(op, "bfloat16")
    # The float32 twin: the bfloat16 graph's inputs, widened (exactly), and its attributes.
    attrs, ins = TEMPLATES[op]
    spec = OPS[op].attrs
    wide_attrs = {k: ("float32" if spec[k][0] == "dtype" and v == "bfloat16" else
                      v.astype(np.float32) if spec[k][0] == "tensor" and v.dtype.name == "bfloat16" else v)
                  for k, v in n16.attrs.items() if k in attrs}
    g32 = Graph(seed=1)
    with g32.as_default():
        consts = []
        for r in n16.inputs:
            v = g16.nodes[r.split(":")[0]].attrs["value"]
            consts.append(fc.constant(v.astype(np.float32) if v.dtype.name == "bfloat16" else v))
        n32 = g32.add_node(op, consts, wide_attrs, name="op")
    refs16 = [make_ref(n16.name, p) for p in range(len(n16.outputs))]
    refs32 = [make_ref(n32.name, p) for p in range(len(n32.outputs))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = fc.Session(g16, store=fc.ContainerStore(), optimize=True).run(refs16)
        want = fc.Session(g32, store=fc.ContainerStore()).run(refs32)
    for port, (a, b, spec16) in enumerate(zip(got, want, n16.outputs)):
        if spec16.dtype == "bfloat16":
            b = np.asarray(b).astype(ml_dtypes.bfloat16)
        assert a.dtype == b.dtype, f"{op} output {port}: {a.dtype} against {b.dtype}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), \
            f"{op} output {port}: {a!r} against the float32 kernel's {b!r} rounded"


BF16_NATIVE_CASES = ["Add", "Sub", "Mul", "Square", "Sqrt", "AddN", "Maximum", "Relu", "BiasAdd"]


@pytest.mark.parametrize("op", BF16_NATIVE_CASES)
def test_bfloat16_arithmetic_taken_as_it_is_rounds_as_the_rule_on_many_values(op, device="cpu:0"):
    """The kernels that take bfloat16 as it is (bf16.ROUNDED_ONCE, AddN's float32 sum, two of
    bf16.EXACT) against the rule itself (`reference_kernels()` turns them off): 200,000 values over
    60 binades, where a float32 result that is not a bfloat16 is common, bit for bit."""
    from flowctl.kernels.registry import reference_kernels

    rng = np.random.default_rng(11)

    def values() -> np.ndarray:
        v = rng.standard_normal(200_000) * np.exp2(rng.integers(-30, 30, 200_000))
        return (np.abs(v) if op == "Sqrt" else v).astype(ml_dtypes.bfloat16)

    a, b, c = values(), values(), values()
    g = Graph()
    with g.as_default():
        ca, cb, cc = fc.constant(a), fc.constant(b), fc.constant(c)
        y = {"Add": lambda: ca + cb, "Sub": lambda: ca - cb, "Mul": lambda: ca * cb,
             "Square": lambda: fc.square(ca), "Sqrt": lambda: fc.sqrt(ca),
             "AddN": lambda: fc.add_n([ca, cb, cc]), "Maximum": lambda: fc.maximum(ca, cb),
             "Relu": lambda: fc.relu(ca),
             "BiasAdd": lambda: fc.bias_add(fc.reshape(ca, [-1, 8]), fc.slice_(cb, [0], [8]))}[op]()
    assert g.nodes[y.node].op == op
    got = fc.Session(g, store=fc.ContainerStore(), device=device).run(y)
    with reference_kernels():
        want = fc.Session(g, store=fc.ContainerStore(), device=device).run(y)
    assert got.dtype == want.dtype == a.dtype
    assert got.tobytes() == want.tobytes()


def test_dropout_and_random_draws_on_bfloat16_follow_the_rule():
    """Ops whose resource is a random state compute, so bfloat16 runs them in float32 too: a dropout
    at rate 0.3 (scale 1/0.7, not exact in bfloat16) and a uniform draw equal the float32 graph's
    results rounded, bit for bit."""
    x = R.standard_normal((40, 30)).astype(ml_dtypes.bfloat16)
    outs = {}
    for dtype in ("bfloat16", "float32"):
        g = Graph(seed=3)
        with g.as_default():
            xs = fc.constant(x.astype(dtype))
            outs[dtype] = fc.Session(g, store=fc.ContainerStore()).run(
                [fc.dropout(xs, 0.3, seed=4), fc.random_uniform([50], dtype=dtype, seed=5)])
    for low, wide in zip(outs["bfloat16"], outs["float32"]):
        assert low.dtype == np.dtype(ml_dtypes.bfloat16)
        assert low.tobytes() == wide.astype(ml_dtypes.bfloat16).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("op", BF16_NATIVE_CASES)
def test_bfloat16_taken_as_it_is_on_the_gpu_rounds_as_the_rule(op):
    """The same on cupy's bfloat16 arrays (its loops compute in float32 and round once)."""
    test_bfloat16_arithmetic_taken_as_it_is_rounds_as_the_rule_on_many_values(op, device="gpu:0")


def test_bfloat16_arithmetic_is_not_numpys_per_element_loops():
    """The rule above is not what ml_dtypes' loops give: a sum of bfloat16 values accumulated in
    bfloat16 loses the small terms that the float32 sum keeps (and np.matmul hands back float32)."""
    x = np.array([256.0] + [1.0] * 64, np.float32)
    g = Graph()
    with g.as_default():
        s = fc.reduce_sum(fc.constant(x.astype(ml_dtypes.bfloat16)))
    got = fc.Session(g, store=fc.ContainerStore()).run(s)
    assert got.dtype.name == "bfloat16" and float(got) == 320.0
    assert float(x.astype(ml_dtypes.bfloat16).sum()) == 256.0  # bfloat16 accumulation: 256 + 1 rounds to 256


def test_the_attribute_types_are_what_the_template_rewriting_knows():
    # _variant rewrites dtype and tensor attributes; a new attribute type carrying a dtype would need it too.
    assert set(ATTR_TYPES) == {"int", "float", "bool", "str", "dtype", "shape", "ints", "floats", "strs", "tensor"}


def test_folding_never_casts_a_kernel_result_it_disagrees_with():
    """A kernel at odds with its op's inference (a bug the test above would catch) is not folded:
    folding would cast its value to the declared dtype and change the answer."""
    from flowctl.engine.opdef import register_op
    from flowctl.kernels.registry import kernel

    if "DtypeLiarForTest" not in OPS:
        register_op("DtypeLiarForTest", lambda ins, a: [ins[0]], num_inputs=1)  # declares x's dtype
        kernel("DtypeLiarForTest")(lambda xp, attrs: lambda x: x / 2)  # but int / 2 is float64
    g = Graph()
    with g.as_default():
        y = make1("DtypeLiarForTest", [fc.constant(np.array([7, -7], np.int32))])
    off = fc.Session(g, store=fc.ContainerStore()).run(y)
    on = fc.Session(g, store=fc.ContainerStore(), optimize=True).run(y)
    assert off.dtype == on.dtype == np.float64
    np.testing.assert_array_equal(on, [3.5, -3.5])


@pytest.mark.gpu
def test_gpu_kernels_return_what_inference_declared():
    """The same sweep on the gpu (cupy can promote where numpy does not): dtype and shape only."""
    from flowctl.kernels.registry import has_kernel

    wrong = []
    for op in sorted(TEMPLATES):
        if not has_kernel(op, "gpu"):
            continue
        for dtype in DTYPES:
            built = _variant(op, dtype)
            if built is None:
                continue
            g, node = built
            refs = [make_ref(node.name, p) for p in range(len(node.outputs))]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                outs = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(refs)
            for port, (a, want) in enumerate(zip(outs, node.outputs)):
                if np.asarray(a).dtype.name != want.dtype or np.shape(a) != tuple(want.shape):
                    wrong.append(f"{op} on {dtype}, output {port}: {np.asarray(a).dtype}{np.shape(a)}, "
                                 f"declared {want.dtype}{want.shape}")
    assert not wrong, "\n".join(wrong)
