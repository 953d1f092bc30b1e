"""1x1 convolutions of one input made one wider convolution and a Split on the CPU
(engine/conv_siblings.py): the rewrite and where it stays away, results against the separate
convolutions and a float64 reference, inference (FusedConv2D groups) and training (gradients
untouched), and Inception-v3's groups."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import flowctl as fc  # noqa: E402
from flowctl.engine import conv_siblings  # noqa: E402
from flowctl.kernels.registry import reference_kernels  # noqa: E402


def _net(dtype: str = "float32", training: bool | None = None, fetch_member: bool = False,
         relus: tuple[str, ...] = ("relu", "relu", "relu")):
    """x -> three 1x1 convolutions (3, 5 and 4 channels), a 1x1 of stride 2 and a 3x3 (not
    siblings), read by a Concat, an Add and a Mean. With `training` set, each 1x1 has a batch norm
    (inference: ChannelAffine, made FusedConv2D by conv_affine)."""
    rng = np.random.default_rng(7)
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder(dtype, (None, 9, 9, 6), name="x")
        outs = []
        for k, co in enumerate((3, 5, 4)):
            f = fc.variable(rng.standard_normal((1, 1, 6, co)).astype(dtype) * 0.4, name=f"f{k}")
            y = fc.conv2d(x, f, name=f"c{k}")
            if training is not None:
                mm = fc.variable(np.full(co, 0.1, dtype), name=f"mm{k}")
                mv = fc.variable(np.full(co, 2.0, dtype), name=f"mv{k}")
                scale, offset = fc.constant(np.full(co, 1.5, dtype)), fc.constant(np.full(co, -0.2, dtype))
                y, _ = fc.batch_norm(y, scale, offset, mm, mv, training=training, activation=relus[k])
            outs.append(y)
        strided = fc.conv2d(x, fc.variable(rng.standard_normal((1, 1, 6, 2)).astype(dtype), name="fs"),
                            strides=(2, 2), name="strided")
        wide = fc.conv2d(x, fc.variable(rng.standard_normal((3, 3, 6, 2)).astype(dtype), name="fw"), name="wide")
        joined = fc.concat(outs, 3)
        loss = fc.reduce_mean(joined) + fc.reduce_mean(outs[1] * 2.0) + fc.reduce_mean(strided) + fc.reduce_mean(wide)
        fetches = [joined, loss] + ([outs[0]] if fetch_member else [])
    return g, x, fetches, loss


def _run(g, x, fetches, xv, enabled: bool, monkeypatch, store=None):
    monkeypatch.setattr(conv_siblings, "ENABLED", enabled)
    s = fc.Session(g, store=store or fc.ContainerStore())
    if store is None:
        s.run(fc.global_variables_initializer(g))
    plan = s.plan_for(fetches, {x: xv})
    return [np.asarray(v) for v in s.run(fetches, {x: xv})], plan, s.store


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("training", [None, False])
def test_sibling_1x1_convolutions_become_one_and_agree_with_the_separate_ones(dtype, training, monkeypatch):
    g, x, fetches, _ = _net(dtype, training)
    xv = np.random.default_rng(1).standard_normal((2, 9, 9, 6)).astype(dtype)
    got, plan, store = _run(g, x, fetches, xv, True, monkeypatch)
    want, plain, _ = _run(g, x, fetches, xv, False, monkeypatch, store)
    names = {n.name: n for n in plan.nodes}
    merged = [n for n in plan.nodes if n.name.endswith("/siblings")]
    assert len(merged) == 1
    op = "Conv2D" if training is None else "FusedConv2D"
    assert merged[0].op == op and merged[0].outputs[0].shape[3] == 12
    split = names[merged[0].name + "/split"]
    assert split.op == "Split" and tuple(split.attrs["sizes"]) == (3, 5, 4)
    members = {"c0", "c1", "c2"} if training is None else {n.name for n in plain.nodes if n.op == "FusedConv2D"}
    assert len(members) == 3 and not members & set(names)  # the members are gone ...
    assert {"strided", "wide"} <= set(names)  # ... and the convolutions that are not siblings stay
    tol = 1e-5 if dtype == "float32" else 1e-12
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.abs(b).max()))
    with reference_kernels():  # and the float64 reference of the whole
        ref, _, _ = _run(g, x, fetches, xv.astype("float64") if dtype == "float64" else xv, False, monkeypatch, store)
    np.testing.assert_allclose(got[0], ref[0], rtol=tol, atol=tol * float(np.abs(ref[0]).max()))


@pytest.mark.parametrize("case", ["fetched", "activations"])
def test_the_pass_leaves_a_member_that_is_fetched_or_differs(case, monkeypatch):
    relus = ("relu", "none", "none") if case == "activations" else ("relu",) * 3
    g, x, fetches, _ = _net("float32", False, fetch_member=case == "fetched", relus=relus)
    xv = np.zeros((2, 9, 9, 6), "float32")
    _, plan, _ = _run(g, x, fetches, xv, True, monkeypatch)
    merged = [n for n in plan.nodes if n.name.endswith("/siblings")]
    assert len(merged) == 1 and plan.nodes  # the two that still match merge, the other is its own
    split = next(n for n in plan.nodes if n.name == merged[0].name + "/split")
    assert len(split.attrs["sizes"]) == 2


def test_training_through_merged_siblings_gives_the_separate_gradients(monkeypatch):
    """The forward convolutions merge; the backward nodes read x, the filters and dy, so the
    variables after two SGD steps agree with the unmerged graph's to float32 rounding."""
    from flowctl.engine.optimizers import SGD

    results = []
    for enabled in (True, False):
        g, x, _, loss = _net("float32", training=True)
        with g.as_default():
            train = SGD(0.5).minimize(loss)
        monkeypatch.setattr(conv_siblings, "ENABLED", enabled)
        s = fc.Session(g, store=fc.ContainerStore())
        s.run(fc.global_variables_initializer(g))
        start = s.variable_values()
        rng = np.random.default_rng(3)
        for _ in range(2):
            s.run([loss, train], {x: rng.standard_normal((4, 9, 9, 6)).astype("float32")})
        plan = s.plan_for([loss, train], {x: np.zeros((4, 9, 9, 6), "float32")})
        results.append((start, s.variable_values(), [n.name for n in plan.nodes if n.name.endswith("/siblings")]))
    (start, merged_vars, merged), (_, plain_vars, plain) = results
    assert len(merged) == 1 and not plain
    for name in ("f0", "f1", "f2", "fs", "fw"):
        a, b = merged_vars[name], plain_vars[name]
        assert not np.allclose(a, start[name], rtol=1e-3, atol=1e-4), name  # the steps moved it
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_inception_v3_inference_merges_its_blocks_1x1_convolutions(monkeypatch):
    """Every block whose input feeds two or more 1x1 convolutions: 35x35 (three blocks), 17x17
    (five, the reduction block's two 1x1s included) and 8x8 (two): 10 groups."""
    from flowctl.bench.peers import ROWS, _load, build_model

    loaded = _load(ROWS["inception_v3_infer_b8"])
    model = build_model(loaded, training=False)
    out = model.outputs[loaded.layers[loaded.loss].inputs[0]]
    s = fc.Session(model.graph, store=fc.ContainerStore())
    plan = s.plan_for([out], {model.inputs[k]: np.zeros((1, 299, 299, 3), "float32") for k in model.inputs})
    merged = [n for n in plan.nodes if n.name.endswith("/siblings")]
    assert len(merged) == 10 and all(n.op == "FusedConv2D" for n in merged)
    widths = sorted(n.outputs[0].shape[3] for n in merged)
    assert widths[0] >= 2 * 48 and widths[-1] == 320 + 384 + 448


def test_a_cpu_partition_of_a_placed_step_merges_its_siblings_too(monkeypatch):
    """Each CPU partition goes through the CPU's plan passes (runtime.compile_partition), as one
    device's step does: the siblings on cpu:0 become one node, their Split's views cross to cpu:1,
    and the results are the one-device step's."""
    from flowctl.engine.cluster import Cluster
    from flowctl.engine.devices import canonical
    from flowctl.engine.runtime import DistributedSession

    g, x, fetches, _ = _net("float32", False)
    xv = np.random.default_rng(2).standard_normal((2, 9, 9, 6)).astype("float32")
    want, _, store = _run(g, x, fetches, xv, True, monkeypatch)
    first = {n for n in g.nodes if n == "x" or n.startswith(("c", "f", "mm", "mv", "Const", "batch_norm"))}
    pl = {n: canonical("cpu:0" if n in first else "cpu:1") for n in g.nodes}
    with DistributedSession(g, Cluster.local(2), pl, store=store) as s:
        got = s.run(fetches, {x: xv})
        parts = s.step_plan(fetches, {x: xv}).partitions
    on0, on1 = parts[canonical("cpu:0")], parts[canonical("cpu:1")]
    assert [n for n in on0.nodes if n.endswith("/siblings")] and not [n for n in on1.nodes if n.endswith("/siblings")]
    assert any(n.op == "Send" for n in on0.nodes.values())
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), b)
