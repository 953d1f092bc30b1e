"""AdamW (decoupled weight decay, Loshchilov & Hutter; torch.optim.AdamW's order): steps of the
graph optimizer against a float64 numpy transcription of PyTorch's documented algorithm, the
exclusion rule, wd = 0 giving Adam bit for bit, the spec keys and their errors, and an exact
resume of a spec trained with it."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.optimizers import DECAY_EXCLUDE, Adam, AdamW
from flowctl.spec.loader import load_spec
from tests.test_optimizers import build, grads_np, problem


def adamw_torch_np(params, names, grads, state, lr, beta1, beta2, eps, wd, exclude):
    """PyTorch's AdamW as its documentation writes it, in float64, with PyTorch's eps taken as
    this codebase's epsilon / sqrt(1 - beta2^t) (TensorFlow's form adds epsilon to sqrt(v)):
        theta <- theta - lr * wd * theta                      (decoupled decay, before the step)
        m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
        m_hat = m / (1 - b1^t);  v_hat = v / (1 - b2^t)
        theta <- theta - lr * m_hat / (sqrt(v_hat) + eps)"""
    import fnmatch

    t = state["t"] = state.get("t", 0) + 1
    m = state.setdefault("m", [np.zeros_like(p) for p in params])
    v = state.setdefault("v", [np.zeros_like(p) for p in params])
    torch_eps = eps / math.sqrt(1.0 - beta2 ** t)
    out = []
    for i, (p, name, g) in enumerate(zip(params, names, grads)):
        if not any(fnmatch.fnmatchcase(name, pat) for pat in exclude):
            p = p - lr * wd * p
        m[i] = beta1 * m[i] + (1.0 - beta1) * g
        v[i] = beta2 * v[i] + (1.0 - beta2) * g * g
        m_hat = m[i] / (1.0 - beta1 ** t)
        v_hat = v[i] / (1.0 - beta2 ** t)
        out.append(p - lr * m_hat / (np.sqrt(v_hat) + torch_eps))
    return out


@pytest.mark.parametrize("exclude", [(), ("*/b",)])
def test_adamw_matches_pytorch_algorithm_in_float64(exclude):
    p = problem(3)
    lrs = [0.05, 0.02, 0.03, 0.01]
    kw = dict(beta1=0.85, beta2=0.99, epsilon=1e-6)
    g, sess, t = build(p, lambda lr: AdamW(lr, weight_decay=0.3, exclude=exclude, **kw), "placeholder")
    params, state = [p["w"].copy(), p["b"].copy()], {}
    for lr in lrs:
        sess.run(t["train"], {t["x"]: p["x"], t["y"]: p["y"], t["lr"]: lr})
        grads = list(grads_np(p, *params))  # the gradient at the parameters before the decay
        params = adamw_torch_np(params, ["dense/w", "dense/b"], grads, state, lr, 0.85, 0.99, 1e-6, 0.3, exclude)
    values = sess.variable_values()
    np.testing.assert_allclose(values["dense/w"], params[0], rtol=1e-12, atol=0)
    np.testing.assert_allclose(values["dense/b"], params[1], rtol=1e-12, atol=0)
    np.testing.assert_allclose(values["dense/w/AdamW/m"], state["m"][0], rtol=1e-12)
    np.testing.assert_allclose(values["dense/b/AdamW/v"], state["v"][1], rtol=1e-12)
    assert values["AdamW/t"] == len(lrs)
    # The decay mattered: the reference without it is far from what ran.
    plain, s2 = [p["w"].copy(), p["b"].copy()], {}
    for lr in lrs:
        plain = adamw_torch_np(plain, ["dense/w", "dense/b"], list(grads_np(p, *plain)), s2, lr, 0.85, 0.99,
                               1e-6, 0.0, ())
    assert np.abs(values["dense/w"] - plain[0]).max() > 1e-3
    if exclude:  # b took Adam's step alone, so it follows the undecayed trajectory's rule, not w's
        assert np.abs(values["dense/b"] - plain[1]).max() > 0  # (its gradient saw a decayed w)


def test_adamw_agrees_with_torch_at_zero_epsilon():
    """With epsilon 0 the TensorFlow and PyTorch forms are the same update: torch.optim.AdamW
    itself, in float64, agrees to 1e-12."""
    torch = pytest.importorskip("torch")
    p = problem(5)
    g, sess, t = build(p, lambda lr: AdamW(lr, epsilon=0.0, weight_decay=0.1, exclude=("*/b",)), "placeholder")
    w = torch.tensor(p["w"], requires_grad=True)
    b = torch.tensor(p["b"], requires_grad=True)
    opt = torch.optim.AdamW([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=0.1, eps=0.0,
                            weight_decay=0.1)
    x, y = torch.tensor(p["x"]), torch.tensor(p["y"])
    for lr in (0.1, 0.04, 0.07):
        sess.run(t["train"], {t["x"]: p["x"], t["y"]: p["y"], t["lr"]: lr})
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        ((x @ w + b - y) ** 2).sum().backward()
        opt.step()
    values = sess.variable_values()
    np.testing.assert_allclose(values["dense/w"], w.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(values["dense/b"], b.detach().numpy(), rtol=1e-12)


def test_zero_weight_decay_is_adam_bit_for_bit():
    p = problem(1)
    out = []
    for make in (lambda lr: Adam(lr, epsilon=1e-7), lambda lr: AdamW(lr, epsilon=1e-7, weight_decay=0.0)):
        g, sess, t = build(p, make, "placeholder")
        for lr in (0.1, 0.05):
            sess.run(t["train"], {t["x"]: p["x"], t["y"]: p["y"], t["lr"]: lr})
        out.append(sess.variable_values())
    np.testing.assert_array_equal(out[0]["dense/w"], out[1]["dense/w"])
    np.testing.assert_array_equal(out[0]["dense/b"], out[1]["dense/b"])


def test_default_exclusions_spare_biases_and_norms():
    g = fc.Graph()
    with g.as_default():
        names = ["h/kernel", "h/bias", "ln/gamma", "ln/beta", "conv/bn/gamma", "emb/table", "block1/attn/bias"]
        vs = [fc.variable(np.ones(2), name=n) for n in names]
    opt = AdamW(0.1)
    assert opt.exclude == DECAY_EXCLUDE
    assert [n for n, v in zip(names, vs) if opt.decays(v)] == ["h/kernel", "emb/table"]


SPEC = """
version: 1
model:
  layers:
    - {name: x, type: input, shape: [6]}
    - {name: y, type: input, shape: [], dtype: int32, classes: 3}
    - {name: hidden, type: dense, units: 8, activation: tanh, inputs: [x]}
    - {name: ln, type: layer_norm, inputs: [hidden]}
    - {name: logits, type: dense, units: 3, inputs: [ln]}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: synthetic, seed: 1, task: learnable}
training:
  batch_size: 8
  steps: 4
  learning_rate: 0.05
  optimizer: {type: adamw, weight_decay: 0.2%s}
"""


def write(tmp_path: Path, extra: str = "", name: str = "adamw.yaml") -> Path:
    p = tmp_path / name
    p.write_text(SPEC % extra)
    return p


def test_spec_adamw_builds_and_decays_only_kernels(tmp_path):
    from flowctl.spec.model import build_model
    from flowctl.training.program import build_step, step_config

    loaded = load_spec(write(tmp_path))
    step = build_step(build_model(loaded, training=True), step_config(loaded))
    assert isinstance(step.optimizer, AdamW) and step.optimizer.weight_decay == 0.2
    decays = sorted(n.name.split("/AdamW")[0] for n in step.graph.nodes.values() if n.name.endswith("/AdamW/decay"))
    assert decays == ["hidden/kernel", "logits/kernel"]


@pytest.mark.parametrize("extra, where, says", [
    (", decay_exclude: ['*/bias', 'hiden/*']", "16:", "decay_exclude 'hiden/*' matches no trainable variable"),
])
def test_spec_errors_are_located(tmp_path, extra, where, says):
    from flowctl.engine.errors import SpecError

    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, extra))
    assert says in str(e.value) and f"adamw.yaml:{where}" in str(e.value)


def test_weight_decay_on_another_optimizer_is_an_error(tmp_path):
    from flowctl.engine.errors import SpecError

    p = tmp_path / "adam.yaml"
    p.write_text((SPEC % "").replace("type: adamw", "type: adam"))
    with pytest.raises(SpecError, match="weight_decay is AdamW's"):
        load_spec(p)


def test_adamw_resume_is_exact(tmp_path: Path):
    from flowctl.training.trainer import Trainer

    spec = write(tmp_path)
    loaded = load_spec(spec)
    straight = Trainer(loaded, tmp_path / "a", steps=4)
    straight.start_fresh(spec.read_text(), str(spec))
    straight.train()
    want = straight.session.variable_values()
    straight.close()
    first = Trainer(loaded, tmp_path / "b", steps=2)
    first.start_fresh(spec.read_text(), str(spec))
    first.train()
    first.close()
    second = Trainer(loaded, tmp_path / "b", steps=4)
    second.restore()
    second.train()
    got = second.session.variable_values()
    second.close()
    assert set(got) == set(want) and "hidden/kernel/AdamW/m" in got
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
