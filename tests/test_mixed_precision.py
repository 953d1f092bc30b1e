"""Mixed precision (`training.precision: fp16`, engine/mixed_precision.py, spec/model.py): float16
layers on float32 master variables, dynamic loss scaling (skipped steps leave every variable and
slot bitwise alone), exact resume with the scale, the Cast gradient, spec errors, and on a GPU."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.errors import SpecError
from flowctl.engine.gradcheck import check_gradients
from flowctl.spec.loader import load_spec, load_text
from flowctl.spec.model import build_model
from flowctl.training.program import build_step, step_config
from flowctl.training.trainer import Trainer
from tiny_specs import SHRINK_LM, TINY_CONV

ROOT = Path(__file__).resolve().parent.parent
# Overflow is what loss scaling provokes on purpose; numpy warns from the device threads of the
# multi-device runs, where the trainer's errstate does not reach.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

MLP = """\
version: 1
name: mlp
model:
  layers:
    - {name: x, type: input, shape: [6]}
    - {name: h, type: dense, units: 16, activation: relu}
    - {name: logits, type: dense, units: 3}
    - {name: y, type: input, shape: [], dtype: int32, classes: 3}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: synthetic, seed: 1}
training:
  optimizer: {type: adam}
  learning_rate: 0.01
  batch_size: 8
  steps: 6
  seed: 3
checkpoint: {every_steps: 100, keep: 3}
"""

CONV = TINY_CONV

SMALL_LM = SHRINK_LM + ["training.optimizer.type=adam", "training.learning_rate=0.01"]


def _load(which: str, precision: str, extra: list[str] = ()):  # type: ignore[assignment]
    over = [f"training.precision={precision}", *extra]
    if which == "lstm_lm":
        return load_spec(ROOT / "specs" / "lstm_lm.yaml", SMALL_LM + over)
    return load_text(MLP if which == "mlp" else CONV, filename=f"{which}.yaml", overrides=over)


def _train(loaded, run_dir: Path, steps: int, resume: bool = False) -> Trainer:
    t = Trainer(loaded, run_dir, steps=steps)
    try:
        if resume:
            t.restore()
        else:
            t.start_fresh("spec", "spec.yaml")
        t.train()
    finally:
        t.close()
    return t


def _records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


# ---------------------------------------------------------------------------- the model in float16
@pytest.mark.parametrize("which", ["mlp", "conv", "lstm_lm"])
def test_fp16_training_follows_fp32_on_float32_variables(which, tmp_path):
    """Four steps in fp16 stay within 1% of the fp32 losses (float16 has an 11-bit significand:
    ~5e-4 relative per rounding, a few hundred roundings deep); the scale of 1024 overflows
    nothing here, so no step is skipped and the two runs take the same updates."""
    runs = {}
    for p in ("fp32", "fp16"):
        t = _train(_load(which, p, ["training.loss_scale.initial=1024"]), tmp_path / p, 4)
        runs[p] = (_records(tmp_path / p), t.session.variable_values(), t)
    (r32, v32, _), (r16, v16, t16) = runs["fp32"], runs["fp16"]
    np.testing.assert_allclose([r["loss"] for r in r16], [r["loss"] for r in r32], rtol=1e-2)
    assert [r["skipped"] for r in r16] == [0, 0, 0, 0] and r16[-1]["loss_scale"] == 1024.0
    assert "loss_scale" not in r32[0]
    assert all(v.dtype == np.float32 for v in v16.values() if v.dtype.kind == "f")
    assert {k for k in v16 if not k.startswith("loss_scale/")} == set(v32)
    g = t16.program.step.graph
    computed = [n for n in g.nodes.values() if n.op in ("MatMul", "Conv2D", "BlockLSTM", "LSTMBlockCell")]
    assert computed and all(g.tensor(f"{n.name}:0").dtype == "float16" for n in computed if not
                            n.name.startswith(("gradients", "loss_scale")))


@pytest.mark.parametrize("which", ["mlp", "conv", "lstm_lm"])
def test_every_master_variable_gets_a_float32_gradient(which):
    model = build_model(_load(which, "fp16"))
    assert model.loss is not None and model.loss.dtype == "float32"
    variables = model.trainable_variables()
    with model.graph.as_default():
        grads = fc.gradients(model.loss, variables)
    assert all(v.dtype == "float32" for v in model.all_variables())
    assert all(gr is not None and gr.dtype == "float32" for gr in grads)
    users = model.graph.consumers()
    reads = {model.graph.nodes[c].op for v in variables for c in users[v.node]}
    assert "Cast" in reads


def test_fp16_nmt_with_masked_attention_and_dynamic_lstms(tmp_path):
    """Variable-length pairs: dynamic LSTMs (while loops), attention kept off the padding (whose
    -1e9 would be inf in float16, and 0 * inf a NaN) and a loss over real tokens, all in fp16."""
    from test_nmt_sentences import _corpus

    spec = _corpus(tmp_path)
    runs = {}
    for p in ("fp32", "fp16"):
        loaded = load_spec(spec, [f"training.precision={p}", "training.loss_scale.initial=1024",
                                  "training.eval_every_steps=4"])
        _train(loaded, tmp_path / p, 4)
        runs[p] = _records(tmp_path / p)
    assert all(np.isfinite(r["loss"]) for r in runs["fp16"]) and "val/loss" in runs["fp16"][-1]
    np.testing.assert_allclose([r["loss"] for r in runs["fp16"]], [r["loss"] for r in runs["fp32"]], rtol=1e-2)
    np.testing.assert_allclose(runs["fp16"][-1]["val/loss"], runs["fp32"][-1]["val/loss"], rtol=1e-2)


# ---------------------------------------------------------------------------- loss scaling
def _session(initial: float, growth: int, optimizer: str = "adam"):
    loaded = _load("mlp", "fp16", [f"training.loss_scale.initial={initial}",
                                   f"training.loss_scale.growth_interval={growth}",
                                   f"training.optimizer.type={optimizer}"])
    step = build_step(build_model(loaded), step_config(loaded))
    sess = fc.Session(step.graph, store=fc.ContainerStore())
    sess.run(step.init)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((8, 6)).astype(np.float32), "y": rng.integers(0, 3, 8).astype(np.int32)}
    assert step.train is not None and step.loss_scale is not None
    feeds = {**step.train.feeds(batch), step.lr: np.float32(0.01)}
    return step, sess, feeds


def _state(sess) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in sess.variable_values().items()}


def test_an_overflowing_step_is_skipped_and_halves_the_scale():
    """2^40 times the loss overflows float16 in the backward pass: nothing but the scaling state
    changes -- parameters, Adam's moments, its beta powers and step count stay bitwise."""
    step, sess, feeds = _session(2.0 ** 40, 2000)
    before = _state(sess)
    with np.errstate(over="ignore", invalid="ignore"):
        sess.run(step.train.train_op, feeds)
    after = _state(sess)
    for k, v in before.items():
        if not k.startswith("loss_scale/"):
            assert np.array_equal(v, after[k]), k
    assert any("/Adam/" in k for k in before) and after["Adam/t"] == 0
    assert after["loss_scale/scale"] == 2.0 ** 39 and after["loss_scale/skipped"] == 1
    assert after["loss_scale/good_steps"] == 0


@pytest.mark.parametrize("optimizer", ["adam", "momentum", "sgd"])
def test_finite_steps_update_and_double_the_scale_after_the_interval(optimizer):
    step, sess, feeds = _session(8.0, 3, optimizer)
    scales, good = [], []
    prev = _state(sess)
    for _ in range(7):
        new_scale, skipped = sess.run([step.loss_scale.new_scale, step.loss_scale.new_skipped, step.train.train_op],
                                      feeds)[:2]
        now = _state(sess)
        assert not np.array_equal(prev["h/kernel"], now["h/kernel"])  # applied
        assert skipped == 0
        scales.append(float(new_scale))
        good.append(int(now["loss_scale/good_steps"]))
        prev = now
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]
    assert good == [1, 2, 0, 1, 2, 0, 1]


def test_a_non_finite_gradient_from_the_data_is_skipped_too():
    """An input of 1e30 is +inf in float16: every gradient is NaN, whatever the scale."""
    step, sess, feeds = _session(4.0, 2000, "momentum")
    x = next(t for t in feeds if getattr(t, "node", "") == "x")
    bad = dict(feeds)
    bad[x] = np.full((8, 6), 1e30, np.float32)
    before = _state(sess)
    with np.errstate(over="ignore", invalid="ignore"):
        sess.run(step.train.train_op, bad)
    after = _state(sess)
    assert all(np.array_equal(before[k], after[k]) for k in before if not k.startswith("loss_scale/"))
    assert after["loss_scale/scale"] == 2.0 and after["loss_scale/skipped"] == 1


def test_exact_resume_carries_the_scale_and_the_skipped_count(tmp_path):
    """N steps == k steps + resume + N-k steps, bitwise, through skipped steps and a growth: the
    first steps at 2^20.. overflow, the scale then grows every 2 finite steps."""
    over = ["training.loss_scale.initial=1048576", "training.loss_scale.growth_interval=2"]
    full = _train(_load("conv", "fp16", over), tmp_path / "full", 8)
    _train(_load("conv", "fp16", over), tmp_path / "split", 3)
    again = _train(_load("conv", "fp16", over), tmp_path / "split", 8, resume=True)
    a, b = _records(tmp_path / "full"), _records(tmp_path / "split")
    assert [(r["loss"], r["loss_scale"], r["skipped"]) for r in a] == \
        [(r["loss"], r["loss_scale"], r["skipped"]) for r in b]
    assert 0 < a[-1]["skipped"] < 8 and len({r["loss_scale"] for r in a}) > 2
    va, vb = full.session.variable_values(), again.session.variable_values()
    assert sorted(va) == sorted(vb) and "loss_scale/scale" in va
    assert all(np.array_equal(va[k], vb[k]) for k in va)


def test_model_parallel_fp16_is_the_single_device_step_across_a_partition(tmp_path):
    """The skipped update is a cond, and the scale's update Selects: placed over two devices (the
    hidden layer on cpu:0, the rest on cpu:1; Send/Recv between) the numbers, skips included, are
    the one-device run's, bitwise."""
    over = ["training.loss_scale.initial=1048576", "training.loss_scale.growth_interval=2"]
    split = ['devices=[cpu:0, cpu:1]', 'parallelism={strategy: model_parallel, groups: ['
             '{layers: [x, h], device: "cpu:0"}, {layers: [logits, y, loss], device: "cpu:1"}]}']
    one = _train(_load("mlp", "fp16", over), tmp_path / "one", 6)
    two = _train(_load("mlp", "fp16", over + split), tmp_path / "two", 6)
    assert len(two.program.devices) == 2
    a, b = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert [(r["loss"], r["loss_scale"], r["skipped"]) for r in a] == \
        [(r["loss"], r["loss_scale"], r["skipped"]) for r in b]
    assert 0 < a[-1]["skipped"] < 6
    va, vb = one.session.variable_values(), two.session.variable_values()
    assert all(np.array_equal(va[k], vb[k]) for k in va)


@pytest.mark.parametrize("strategy", ["sync_data_parallel", "pipeline"])
def test_fp16_replicas_scale_and_unscale_each_copy(strategy, tmp_path):
    """Sync data parallelism (two replicas on two CPUs) and a two-micro-batch pipeline in fp16:
    each copy's gradients are of S * its loss, unscaled before the average. At a scale that
    overflows nothing the losses follow the same strategy in fp32 (1e-2, as one device); from a
    scale that does, every skip halves it and the run goes on."""
    if strategy == "sync_data_parallel":
        par = ["devices=[cpu:0, cpu:1]", "parallelism.strategy=sync_data_parallel", "parallelism.replicas=2"]
    else:
        par = ['devices=[cpu:0, cpu:1]', 'parallelism={strategy: pipeline, concurrent_steps: 2, groups: ['
               '{layers: [x, h], device: "cpu:0"}, {layers: [logits, y, loss], device: "cpu:1"}]}']
    _train(_load("mlp", "fp32", par), tmp_path / "fp32", 4)
    t = _train(_load("mlp", "fp16", par + ["training.loss_scale.initial=1024"]), tmp_path / "fp16", 4)
    assert t.program.step.loss_scale is not None and len(t.program.devices) == 2
    a, b = _records(tmp_path / "fp32"), _records(tmp_path / "fp16")
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-2)
    assert [r["skipped"] for r in b] == [0, 0, 0, 0]
    _train(_load("mlp", "fp16", par + ["training.loss_scale.initial=1048576"]), tmp_path / "big", 6)
    c = [{"loss_scale": 1048576.0, "skipped": 0}] + _records(tmp_path / "big")
    assert 0 < c[-1]["skipped"] < 6
    for prev, now in zip(c, c[1:]):
        skipped = now["skipped"] - prev["skipped"]
        assert skipped in (0, 1) and (now["loss_scale"] == prev["loss_scale"] / 2) == (skipped == 1)


# ---------------------------------------------------------------------------- the Cast gradient
def test_the_gradient_of_cast_casts_back(rng):
    x = rng.standard_normal((3, 4))
    check_gradients(lambda x: fc.cast(fc.cast(x, "float32"), "float64") * fc.cast(x, "float64"), {"x": x},
                    eps=1e-3, rtol=1e-4, atol=1e-5)
    g = fc.Graph()
    with g.as_default():
        w = fc.placeholder("float64", (3, 4), name="w")
        xs = fc.placeholder("float64", (3, 4), name="x")
        y = fc.reduce_sum(fc.cast(fc.cast(xs, "float16") * fc.cast(w, "float16"), "float32"))
        (gx,) = fc.gradients(y, [xs])
    assert gx.dtype == "float64"
    wv = rng.standard_normal((3, 4))
    got = fc.Session(g).run(gx, {w: wv, xs: x})
    # d/dx = w rounded to float16 (the product's other factor), carried back to float64 exactly
    np.testing.assert_array_equal(got, wv.astype(np.float16).astype(np.float64))


# ---------------------------------------------------------------------------- bf16, emulated
def test_round_bf16_is_round_to_nearest_even_on_the_upper_half(rng):
    ulp = 2.0 ** -7  # bfloat16 keeps 7 of float32's 23 fraction bits
    cases = {1.0: 1.0, 1 + ulp / 2: 1.0, 1 + 1.5 * ulp: 1 + 2 * ulp, 1 + ulp / 2 + 2 ** -20: 1 + ulp,
             -(1 + 1.5 * ulp): -(1 + 2 * ulp), 3.4e38: np.inf, 0.0: 0.0, np.inf: np.inf}
    x = np.array(list(cases), np.float32)
    got = _rounded(x)
    np.testing.assert_array_equal(got, np.array(list(cases.values()), np.float32))
    assert np.isnan(_rounded(np.array([np.nan], np.float32)))[0]
    # float64 reference on random values of every magnitude: the nearest of the two bfloat16
    # neighbours (truncation, and truncation plus one unit), ties to the even one
    v = (rng.standard_normal(5000) * 10.0 ** rng.integers(-30, 30, 5000)).astype(np.float32)
    lo = (v.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)
    hi = ((v.view(np.uint32) & 0xFFFF0000) + 0x10000).astype(np.uint32).view(np.float32).astype(np.float64)
    d_lo, d_hi = np.abs(v - lo), np.abs(hi - v)
    even_lo = ((v.view(np.uint32) >> 16) & 1) == 0
    want = np.where((d_lo < d_hi) | ((d_lo == d_hi) & even_lo), lo, hi).astype(np.float32)
    np.testing.assert_array_equal(_rounded(v), want)


def _rounded(x: np.ndarray) -> np.ndarray:
    g = fc.Graph()
    with g.as_default():
        y = fc.round_bf16(fc.constant(x))
    return fc.Session(g).run(y)


def test_the_gradient_of_round_bf16_is_the_gradient_rounded(rng):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (50,), name="x")
        w = fc.placeholder("float32", (50,), name="w")
        (gx,) = fc.gradients(fc.reduce_sum(fc.round_bf16(x) * w), [x])
    wv = rng.standard_normal(50).astype(np.float32)
    got = fc.Session(g).run(gx, {x: rng.standard_normal(50).astype(np.float32), w: wv})
    assert gx.dtype == "float32"
    np.testing.assert_array_equal(got, _rounded(wv))


@pytest.mark.parametrize("which", ["mlp", "conv", "lstm_lm"])
def test_bf16_training_follows_fp32_in_bfloat16_arrays(which, tmp_path):
    """bfloat16 keeps 8 significant bits (~4e-3 relative per rounding): four steps stay within 3%
    of fp32. Every trainable variable is read through a Cast to bfloat16, the layers' products
    are bfloat16 arrays, nothing is float16, and the master variables stay float32."""
    runs = {}
    for p in ("fp32", "bf16"):
        t = _train(_load(which, p), tmp_path / p, 4)
        runs[p] = ([r["loss"] for r in _records(tmp_path / p)], t)
    np.testing.assert_allclose(runs["bf16"][0], runs["fp32"][0], rtol=3e-2)
    assert runs["bf16"][0] != runs["fp32"][0]  # the rounding is there
    t = runs["bf16"][1]
    g = t.program.step.graph
    users = g.consumers()
    for v in t.program.step.model.trainable_variables():
        assert {(g.nodes[c].op, g.nodes[c].attrs.get("dtype")) for c in users[v.node]} >= {("Cast", "bfloat16")}, v.node
    products = [n for n in g.nodes.values() if n.op in ("MatMul", "Conv2D", "LSTMBlock")]
    assert products and all(n.outputs[0].dtype == "bfloat16" for n in products)
    norms = [n for n in g.nodes.values() if n.op == "FusedBatchNorm"]
    assert bool(norms) == (which == "conv")  # batch norm reads bfloat16 x, float32 parameters
    assert all([g.tensor(r).dtype for r in n.inputs] == ["bfloat16", "float32", "float32"] for n in norms)
    assert not any(n.op == "Cast" and n.attrs["dtype"] == "float16" for n in g.nodes.values())
    assert t.program.step.loss_scale is None
    assert all(v.dtype == np.float32 for v in t.session.variable_values().values() if v.dtype.kind == "f")


def test_bf16_is_the_same_with_the_fusion_pass_on(tmp_path):
    """The fusion pass leaves nodes on bfloat16 alone (a fused program would keep its
    intermediates in float32, not round them as the ops do): fused and unfused runs agree bitwise."""
    plain = _train(_load("lstm_lm", "bf16"), tmp_path / "plain", 3)
    fused = _train(_load("lstm_lm", "bf16", ["training.fuse=true"]), tmp_path / "fused", 3)
    g = fused.program.step.graph
    assert any(n.op == "FusedElementwise" for n in g.nodes.values())  # the float32 parts still fuse
    assert not any(n.op == "FusedElementwise" and "bfloat16" in n.attrs["program"] for n in g.nodes.values())
    assert [r["loss"] for r in _records(tmp_path / "plain")] == [r["loss"] for r in _records(tmp_path / "fused")]
    va, vb = plain.session.variable_values(), fused.session.variable_values()
    assert all(va[k].tobytes() == vb[k].tobytes() for k in va)


@pytest.mark.parametrize("activation", ["none", "relu"])
def test_bf16_batch_norm_reads_bfloat16_with_the_bits_of_casts_around_a_float32_one(activation):
    """Batch norm on a bfloat16 x with float32 parameters: y, the statistics and every gradient
    are bitwise those of Cast(x, float32) -> the float32 batch norm -> Cast(y, bfloat16)."""
    import ml_dtypes

    rng = np.random.default_rng(3)
    xv = rng.standard_normal((4, 3, 3, 5)).astype(ml_dtypes.bfloat16)
    sv, ov = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    wv = rng.standard_normal((4, 3, 3, 5)).astype(ml_dtypes.bfloat16)
    outs = {}
    for direct in (True, False):
        g = fc.Graph()
        with g.as_default():
            x, scale, offset = fc.constant(xv), fc.constant(sv), fc.constant(ov)
            w = fc.constant(wv)
            x_in = x if direct else fc.cast(x, "float32")
            y, mean, var = fc.fused_batch_norm(x_in, scale, offset, activation=activation)
            if not direct:
                y = fc.cast(y, "bfloat16")
            assert (y.dtype, mean.dtype, var.dtype) == ("bfloat16", "float32", "float32")
            loss = fc.reduce_sum(fc.cast(y * w, "float32"))
            grads = fc.gradients(loss, [x, scale, offset])
            outs[direct] = fc.Session(g).run([y, mean, var, *grads])
    for a, b, what in zip(outs[True], outs[False], ["y", "mean", "var", "dx", "dscale", "doffset"]):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), what
    assert outs[True][3].dtype.name == "bfloat16" and outs[True][4].dtype == np.float32


def test_bf16_resume_is_exact(tmp_path):
    """4 steps straight equal 2 + resume + 2, bitwise, with bfloat16 arrays in the step."""
    straight = _train(_load("conv", "bf16"), tmp_path / "a", 4).session.variable_values()
    _train(_load("conv", "bf16"), tmp_path / "b", 2)
    resumed = _train(_load("conv", "bf16"), tmp_path / "b", 4, resume=True).session.variable_values()
    assert [r["loss"] for r in _records(tmp_path / "a")] == [r["loss"] for r in _records(tmp_path / "b")]
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert straight[k].tobytes() == resumed[k].tobytes(), k


# ---------------------------------------------------------------------------- the spec
def _error(text: str, overrides: list[str] = ()) -> str:  # type: ignore[assignment]
    with pytest.raises(SpecError) as e:
        load_text(text, filename="bad.yaml", overrides=list(overrides))
    return str(e.value)


def test_a_bad_precision_is_a_located_spec_error():
    text = MLP.replace("  steps: 6\n", "  steps: 6\n  precision: fp61\n")
    line = text.splitlines().index("  precision: fp61") + 1
    msg = _error(text)
    assert f"bad.yaml:{line}:" in msg and "training.precision" in msg and "did you mean 'fp16'?" in msg


def test_mixed_precision_needs_float32_variables_and_fp16_a_built_strategy():
    for p in ("fp16", "bf16"):
        msg = _error(MLP, [f"training.precision={p}", "model.dtype=float64"])
        assert f"{p} keeps float32 master variables, so model.dtype must be float32" in msg
    msg = _error(MLP + "devices: [cpu:0, cpu:1]\n", ["training.precision=fp16",
                                                     "parallelism.strategy=async_data_parallel",
                                                     "parallelism.replicas=2"])
    assert "not built for async_data_parallel yet" in msg


def test_a_bad_loss_scale_is_a_spec_error():
    assert "training.loss_scale.initial" in _error(MLP, ["training.precision=fp16", "training.loss_scale.initial=0"])
    assert "training.loss_scale.growth" in _error(MLP, ["training.loss_scale.growth_intervl=3"])


def test_precision_is_a_spec_change_and_fp32_hashes_as_before_it_existed():
    from flowctl.training.rundir import resolved, spec_changes, spec_hash

    base = resolved(load_text(MLP, filename="m.yaml").spec)
    older = {**base, "training": {k: v for k, v in base["training"].items() if k not in ("precision", "loss_scale")}}
    assert spec_hash(older) == spec_hash(base) and spec_changes(older, base) == []
    fp16 = resolved(load_text(MLP, filename="m.yaml", overrides=["training.precision=fp16"]).spec)
    assert spec_hash(fp16) != spec_hash(base)
    assert any(c.startswith("training.precision") for c in spec_changes(base, fp16))
    scaled = resolved(load_text(MLP, filename="m.yaml", overrides=["training.loss_scale.initial=8"]).spec)
    assert spec_hash(scaled) == spec_hash(base)  # fp32 does not scale: inert
    big16 = resolved(load_text(MLP, filename="m.yaml", overrides=["training.precision=fp16",
                                                                  "training.loss_scale.initial=8"]).spec)
    assert spec_changes(fp16, big16) == ["training.loss_scale.initial: 65536.0 -> 8.0"]


def test_allow_tf32_is_a_spec_change_on_a_gpu_and_inert_at_its_default_and_on_cpus():
    """training.allow_tf32 changes a GPU run's numerics (TF32 or IEEE float32 products): switching
    it is a spec change there; at its default (true) a spec hashes as before the key existed, and
    on CPUs (IEEE either way) it computes nothing. The step config carries it."""
    from flowctl.training.program import step_config
    from flowctl.training.rundir import resolved, spec_changes, spec_hash

    def spec(dev, *sets):
        return resolved(load_text(MLP + f"devices: [{dev}]\n", filename="m.yaml", overrides=list(sets)).spec)

    base, ieee = spec("gpu:0"), spec("gpu:0", "training.allow_tf32=false")
    assert base["training"]["allow_tf32"] is True and ieee["training"]["allow_tf32"] is False
    assert spec_hash(ieee) != spec_hash(base)
    assert any(c.startswith("training.allow_tf32") for c in spec_changes(base, ieee))
    older = {**base, "training": {k: v for k, v in base["training"].items() if k != "allow_tf32"}}
    assert spec_hash(older) == spec_hash(base) and spec_changes(older, base) == []
    assert spec_hash(spec("cpu:0")) == spec_hash(spec("cpu:0", "training.allow_tf32=false"))
    assert step_config(load_text(MLP, filename="m.yaml", overrides=["training.allow_tf32=false"])).allow_tf32 is False
    assert step_config(load_text(MLP, filename="m.yaml")).allow_tf32 is True


# ---------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_fp16_trains_on_cupy_as_on_numpy(tmp_path):
    losses = {}
    for dev in ("cpu:0", "gpu:0"):
        text = MLP + f"devices: [{dev}]\n"
        loaded = load_text(text, filename="mlp.yaml", overrides=["training.precision=fp16",
                                                                 "training.loss_scale.initial=1024"])
        t = _train(loaded, tmp_path / dev.replace(":", ""), 6)
        assert t.session.variable_values()["h/kernel"].dtype == np.float32
        losses[dev] = [(r["loss"], r["skipped"]) for r in _records(tmp_path / dev.replace(":", ""))]
    assert [s for _, s in losses["gpu:0"]] == [s for _, s in losses["cpu:0"]]
    np.testing.assert_allclose([v for v, _ in losses["gpu:0"]], [v for v, _ in losses["cpu:0"]], rtol=5e-3)


@pytest.mark.gpu
def test_bf16_trains_on_cupy_in_bfloat16_arrays_as_on_numpy(tmp_path):
    """bf16 on a GPU: cupy holds the bfloat16 arrays, cuBLAS takes them as they are; the losses
    follow the CPU's (both round each op's output to bfloat16; the sums differ in order)."""
    losses = {}
    for dev in ("cpu:0", "gpu:0"):
        loaded = load_text(MLP + f"devices: [{dev}]\n", filename="mlp.yaml", overrides=["training.precision=bf16"])
        t = _train(loaded, tmp_path / dev.replace(":", ""), 6)
        assert t.session.variable_values()["h/kernel"].dtype == np.float32
        losses[dev] = [r["loss"] for r in _records(tmp_path / dev.replace(":", ""))]
    np.testing.assert_allclose(losses["gpu:0"], losses["cpu:0"], rtol=2e-2)
