"""Element-wise fusion (engine/fusion.py, engine/ops/fused.py, kernels/fused.py): which trees the
pass fuses and which it must not, the fused step bitwise equal to the unfused one on the CPU
(training losses, variables, exact resume), the simulator's cost of a fused node, the spec option."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.errors import GraphError, SpecError
from flowctl.engine.fusion import fuse, fused_nodes
from flowctl.engine.graph import Graph
from flowctl.spec.loader import load_spec
from flowctl.training.trainer import Trainer
from tiny_specs import SHRINK_LM, TINY_CONV

ROOT = Path(__file__).resolve().parent.parent


def _chain() -> tuple[Graph, dict[str, fc.Tensor]]:
    g = Graph()
    with g.as_default():
        a = fc.placeholder("float32", (None, 5), name="a")
        b = fc.constant(np.linspace(-1, 1, 5, dtype=np.float32), name="b")
        c = fc.constant(np.float32(0.25), name="c")
        m = fc.mul(a, b, name="m")
        s = fc.add(m, c, name="s")
        y = fc.relu(s, name="y")
        z = fc.reduce_sum(y, name="z")
    return g, {"a": a, "m": m, "s": s, "y": y, "z": z}


def _run(g: Graph, fetches: list[str], x: np.ndarray) -> list[np.ndarray]:
    return fc.Session(g).run(fetches, {"a:0": x})


def _program(g: Graph, name: str) -> dict:
    assert g.nodes[name].op == "FusedElementwise"
    return json.loads(g.nodes[name].attrs["program"])


# ---------------------------------------------------------------------------- the pass
def test_a_mul_add_relu_chain_becomes_one_node_with_the_same_values(rng):
    g, t = _chain()
    x = rng.standard_normal((7, 5)).astype(np.float32)
    before = _run(g, ["y:0", "z:0"], x)
    fuse(g, keep={"a", "z"})
    assert fused_nodes(g) == ["y"] and "m" not in g.nodes and "s" not in g.nodes
    prog = _program(g, "y")
    assert [s["op"] for s in prog["steps"]] == ["Mul", "Add", "Relu"]
    assert g.nodes["y"].inputs == ["a:0", "b:0", "c:0"]
    assert [s["args"] for s in prog["steps"]] == [[0, 1], [3, 2], [4]]
    after = _run(g, ["y:0", "z:0"], x)
    for p, q in zip(before, after):
        assert np.array_equal(p, q)
    assert Graph.from_json(g.to_json()).nodes["y"].attrs == g.nodes["y"].attrs  # a GraphDef round trip


def test_a_value_read_twice_is_not_fused_across(rng):
    g = Graph()
    with g.as_default():
        a = fc.placeholder("float32", (4,), name="a")
        s = fc.add(fc.mul(a, a, name="m"), 1.0, name="s")
        y = fc.relu(s, name="y")
        w = fc.mul(s, 3.0, name="w")
    x = rng.standard_normal(4).astype(np.float32)
    before = _run(g, ["y:0", "w:0"], x)
    fuse(g, keep={"a", "y", "w"})
    assert fused_nodes(g) == ["s"]  # m folded into s; s itself has two readers
    assert g.nodes["y"].op == "Relu" and g.nodes["w"].op == "Mul"
    assert _program(g, "s")["steps"][0]["args"] == [0, 0]  # a*a reads the one input twice
    assert all(np.array_equal(p, q) for p, q in zip(before, _run(g, ["y:0", "w:0"], x)))


def test_a_kept_intermediate_stays_a_node():
    g, _ = _chain()
    fuse(g, keep={"a", "z", "s"})
    assert fused_nodes(g) == ["s"] and g.nodes["y"].op == "Relu"  # s ends a tree; y alone is no group
    assert [s["op"] for s in _program(g, "s")["steps"]] == ["Mul", "Add"]


def test_control_dependencies_are_respected():
    g = Graph()
    with g.as_default():
        a = fc.placeholder("float32", (3,), name="a")
        gate = fc.placeholder("float32", (), name="gate")
        with g.control_dependencies([gate]):
            m = fc.mul(a, 2.0, name="m")  # has a control input: cannot be absorbed
        s = fc.add(m, 1.0, name="s")
        y = fc.tanh(s, name="y")
        e = fc.exp(a, name="e")  # a control input of something: cannot be absorbed
        with g.control_dependencies([e]):
            fc.identity(a, name="after_e")
        fc.neg(e, name="ne")
    fuse(g, keep={"a", "gate", "y", "after_e", "ne"})
    assert g.nodes["m"].op == "Mul" and g.nodes["e"].op == "Exp" and g.nodes["ne"].op == "Neg"
    assert [s["op"] for s in _program(g, "y")["steps"]] == ["Add", "Tanh"]
    assert g.nodes["y"].inputs[0] == "m:0"


def test_a_root_keeps_its_control_inputs():
    g = Graph()
    with g.as_default():
        a = fc.placeholder("float32", (3,), name="a")
        gate = fc.placeholder("float32", (), name="gate")
        m = fc.mul(a, 2.0, name="m")
        with g.control_dependencies([gate]):
            fc.relu(m, name="y")
    fuse(g, keep={"a", "gate", "y"})
    assert fused_nodes(g) == ["y"] and g.nodes["y"].control_inputs == ["gate"]


def test_nodes_in_a_while_loop_frame_are_not_fused():
    g = Graph()
    with g.as_default():
        x0 = fc.placeholder("float32", (3,), name="x0")
        i0 = fc.constant(np.int32(0), name="i0")
        _, out = fc.while_loop(lambda i, x: fc.less(i, 4), lambda i, x: (i + 1, fc.tanh(x * 0.5 + 0.1)), [i0, x0])
        y = fc.relu(fc.mul(out, 2.0, name="after_m"), name="after")
    x = np.array([0.3, -1.0, 2.0], np.float32)
    before = fc.Session(g).run(y, {x0: x})
    n = len(g.nodes)
    fuse(g, keep={"x0", "after"})
    assert fused_nodes(g) == ["after"]  # outside the frame only
    assert len(g.nodes) == n - 1
    assert np.array_equal(before, fc.Session(g).run("after:0", {"x0:0": x}))


def test_nodes_in_a_conditional_branch_are_not_fused():
    g = Graph()
    with g.as_default():
        x = fc.placeholder("float32", (3,), name="x")
        p = fc.placeholder("bool", (), name="p")
        out = fc.cond(p, lambda: fc.relu(x * 2.0 + 1.0), lambda: fc.tanh(x - 1.0))
        fc.sigmoid(fc.neg(out, name="after_n"), name="after")
    v = np.array([0.3, -1.0, 2.0], np.float32)
    before = [fc.Session(g).run("after:0", {"x:0": v, "p:0": np.bool_(b)}) for b in (True, False)]
    n = len(g.nodes)
    fuse(g, keep={"x", "p", "after"})
    assert fused_nodes(g) == ["after"] and len(g.nodes) == n - 1  # after the Merge only
    for b, want in zip((True, False), before):
        assert np.array_equal(want, fc.Session(g).run("after:0", {"x:0": v, "p:0": np.bool_(b)}))


def test_members_on_different_devices_are_not_fused():
    g = Graph()
    with g.as_default():
        a = fc.placeholder("float32", (3,), name="a")
        with g.device("/cpu:0"):
            m = fc.mul(a, 2.0, name="m")
        with g.device("/cpu:1"):
            s = fc.add(m, 1.0, name="s")
            fc.relu(s, name="y")
    fuse(g, keep={"a", "y"})
    assert fused_nodes(g) == ["y"] and g.nodes["m"].op == "Mul"
    g2, _ = _chain()
    fuse(g2, keep={"a", "z"}, placement={"m": "/cpu:0", "s": "/cpu:1", "y": "/cpu:1"})
    assert fused_nodes(g2) == ["y"] and g2.nodes["m"].op == "Mul"  # a strategy's fixed devices count too


def test_the_kernel_never_writes_its_inputs(rng):
    from flowctl.kernels.registry import bind

    g = Graph()
    with g.as_default():
        a = fc.placeholder("float32", (4, 3), name="a")
        b = fc.placeholder("float32", (3,), name="b")
        c = fc.cast(a, "float32", name="c")  # hands its input back: must not become a scratch buffer
        s = fc.add(c, b, name="s")
        q = fc.exp(fc.neg(fc.square(s, name="sq"), name="n"), name="e")
        fc.greater(q, fc.add_n([q * 0.5], name="half"), name="gt")
    x, y = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    before = fc.Session(g).run(["e:0", "gt:0"], {a: x, b: y})
    fuse(g, keep={"a", "b", "gt", "e"})
    assert fused_nodes(g) == ["e", "gt"]
    xc, yc = x.copy(), y.copy()
    out = bind("FusedElementwise", "cpu", g.nodes["e"].attrs)(x, y)
    assert np.array_equal(x, xc) and np.array_equal(y, yc)
    assert np.array_equal(out, before[0])
    assert np.array_equal(fc.Session(g).run("gt:0", {"a:0": x, "b:0": y}), before[1])


def test_a_malformed_program_is_a_graph_error():
    g, _ = _chain()
    fuse(g, keep={"a", "z"})
    prog = _program(g, "y")
    prog["steps"][1]["args"] = [0, 9]
    g.nodes["y"].attrs = {"program": json.dumps(prog)}
    with pytest.raises(GraphError, match="must name one of the 3 inputs or an earlier step"):
        g.check()


def test_differentiating_a_fused_node_is_a_clear_error():
    g, _ = _chain()
    fuse(g, keep={"a", "z"})
    with g.as_default(), pytest.raises(GraphError, match="FusedElementwise.*no gradient.*after autodiff"):
        fc.gradients(g.tensor("z:0"), [g.tensor("a:0")])


def test_the_simulator_counts_a_fused_nodes_bytes_once():
    from flowctl.engine.cluster import Cluster
    from flowctl.engine.placement.cost import StaticCostModel

    cost = StaticCostModel(Cluster.local(1), batch=64)
    g, _ = _chain()
    parts = [cost.estimate(g, g.nodes[n]) for n in ("m", "s", "y")]
    fuse(g, keep={"a", "z"})
    flops, nbytes = cost.estimate(g, g.nodes["y"])
    assert flops == sum(f for f, _ in parts) == 3 * 64 * 5
    # a (64x5) and b (5) and c read, y (64x5) written, each once; no intermediate
    assert nbytes == 4 * (64 * 5 + 5 + 1 + 64 * 5) < sum(b for _, b in parts)


# ---------------------------------------------------------------------------- training
LM = ROOT / "specs" / "lstm_lm.yaml"
SMALL_LM = SHRINK_LM + ["training.optimizer.type=adam", "training.clip_value=0.5"]

CONV = TINY_CONV


def _train(loaded, run_dir: Path, steps: int, resume: bool = False) -> Trainer:
    t = Trainer(loaded, run_dir, steps=steps)
    if resume:
        t.restore()
    else:
        t.start_fresh("spec", "spec.yaml")
    t.train()
    t.close()
    return t


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _load(which: str, fuse_on: bool, tmp_path: Path):
    flag = f"training.fuse={'true' if fuse_on else 'false'}"
    if which == "lstm_lm":
        return load_spec(LM, SMALL_LM + [flag])
    if which == "sync_mlp":  # two replicas on two virtual CPUs: fused nodes placed and partitioned
        return load_spec(ROOT / "specs" / "demo.yaml", [
            flag, "devices=[cpu:0, cpu:1]", "training.eval_every_steps=2", "parallelism.strategy=sync_data_parallel",
            "parallelism.replicas=2"])
    p = tmp_path / "conv.yaml"
    p.write_text(CONV)
    wide = ["model.dtype=float64", "model.layers.x.dtype=float64"] if which == "conv64" else []
    return load_spec(p, [flag, *wide])


@pytest.mark.parametrize("which", ["lstm_lm", "conv", "conv64", "sync_mlp"])
def test_fused_training_is_bitwise_the_unfused_one(which, tmp_path):
    runs = {}
    for on in (False, True):
        t = _train(_load(which, on, tmp_path), tmp_path / f"run_{on}", 4)
        if on:
            assert fused_nodes(t.program.step.graph), "the step has element-wise trees to fuse"
        runs[on] = (_losses(tmp_path / f"run_{on}"), t.session.variable_values())
    (l0, v0), (l1, v1) = runs[False], runs[True]
    assert len(l0) == 4 and l0 == l1
    assert sorted(v0) == sorted(v1)
    for k in v0:
        assert np.array_equal(v0[k], v1[k]), k


def test_exact_resume_holds_with_fusion(tmp_path):
    full = _train(_load("conv", True, tmp_path), tmp_path / "full", 6)
    _train(_load("conv", True, tmp_path), tmp_path / "split", 2)
    again = _train(_load("conv", True, tmp_path), tmp_path / "split", 6, resume=True)
    assert _losses(tmp_path / "full") == _losses(tmp_path / "split")
    va, vb = full.session.variable_values(), again.session.variable_values()
    assert all(np.array_equal(va[k], vb[k]) for k in va)


def test_fuse_must_be_a_bool(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(CONV.replace("  steps: 6\n", "  steps: 6\n  fuse: maybe\n"))
    with pytest.raises(SpecError) as e:
        load_spec(p)
    line = CONV.splitlines().index("  steps: 6") + 2
    assert f"bad.yaml:{line}:9: training.fuse" in str(e.value)


# ---------------------------------------------------------------------------- the kernel on a GPU
@pytest.mark.gpu
def test_the_fused_kernel_on_cupy_matches_numpy(rng):
    from flowctl.kernels.registry import array_module, bind

    cp = array_module("gpu")
    g, t = _chain()
    with g.as_default():
        fc.sigmoid(fc.sub(fc.square(t["y"]), t["a"]), name="q")
    del g.nodes["z"]  # y feeds only the square now: one tree from a*b to the sigmoid
    fuse(g, keep={"a", "q"})
    assert len(_program(g, "q")["steps"]) == 6 and g.nodes["q"].inputs == ["a:0", "b:0", "c:0"]
    attrs = g.nodes["q"].attrs
    ins = [rng.standard_normal((64, 5)).astype(np.float32), np.linspace(-1, 1, 5, dtype=np.float32),
           np.float32(0.25).reshape(())]
    want = bind("FusedElementwise", "cpu", attrs)(*ins)
    got = bind("FusedElementwise", "gpu", attrs)(*[cp.asarray(x) for x in ins])
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-6, atol=1e-6)
