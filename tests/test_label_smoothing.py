"""Label smoothing on the softmax_cross_entropy layer (PyTorch's CrossEntropyLoss label_smoothing):
the loss against a float64 numpy reference for class ids, distributions and masked sequences, its
gradient by finite differences, and that evaluation reports the plain cross-entropy."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from flowctl.engine.gradcheck import check_gradients
from flowctl.engine.gradcheck import run_graph as run
from flowctl.spec.layers.core import SoftmaxCrossEntropy


def layer(eps: float, training: bool = True) -> tuple[SoftmaxCrossEntropy, SimpleNamespace]:
    sce = SoftmaxCrossEntropy(name="loss", type="softmax_cross_entropy", label_smoothing=eps)
    return sce, SimpleNamespace(training=training, dtype="float64", steps={})


def log_softmax_np(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def smoothed_np(logits: np.ndarray, target: np.ndarray, eps: float, mask: np.ndarray | None = None) -> float:
    """PyTorch's definition written out: CE against the target (1-eps)*target + eps/C, per example,
    then the mean (over the real tokens, with a mask)."""
    c = logits.shape[-1]
    q = (1.0 - eps) * target + eps / c
    per = -(q * log_softmax_np(logits)).sum(axis=-1)
    if mask is None:
        return float(per.mean())
    return float((per * mask).sum() / max(mask.sum(), 1.0))


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.35, 1.0])
def test_class_ids_match_numpy(eps, rng):
    logits = rng.normal(size=(7, 5)) * 3
    labels = rng.integers(0, 5, size=7).astype(np.int64)
    sce, b = layer(eps)
    got = run(lambda z, y: sce.build(b, [z, y]), z=logits, y=labels)
    want = smoothed_np(logits, np.eye(5)[labels], eps)
    np.testing.assert_allclose(got, want, rtol=1e-13)
    # the mixture form the docs give: (1-eps) CE + eps * mean_c(-log p)
    lp = log_softmax_np(logits)
    mix = (1 - eps) * -lp[np.arange(7), labels] + eps * -lp.mean(axis=-1)
    np.testing.assert_allclose(got, mix.mean(), rtol=1e-13)
    if eps:
        plain = run(lambda z, y: layer(0.0)[0].build(b, [z, y]), z=logits, y=labels)
        assert abs(float(got) - float(plain)) > 1e-3


def test_distributions_and_torch_agree(rng):
    torch = pytest.importorskip("torch")
    logits = rng.normal(size=(6, 4))
    target = rng.dirichlet(np.ones(4), size=6)
    sce, b = layer(0.2)
    got = run(lambda z, y: sce.build(b, [z, y]), z=logits, y=target)
    np.testing.assert_allclose(got, smoothed_np(logits, target, 0.2), rtol=1e-13)
    ref = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(target), label_smoothing=0.2)
    np.testing.assert_allclose(got, ref.item(), rtol=1e-12)
    ids = rng.integers(0, 4, size=6)
    got = run(lambda z, y: sce.build(b, [z, y]), z=logits, y=ids.astype(np.int64))
    ref = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(ids), label_smoothing=0.2)
    np.testing.assert_allclose(got, ref.item(), rtol=1e-12)


def test_masked_sequences_smooth_real_tokens_only(rng):
    logits = rng.normal(size=(3, 4, 6))
    labels = rng.integers(0, 6, size=(3, 4)).astype(np.int64)
    lengths = np.array([4, 1, 2], np.int64)
    sce, b = layer(0.15)
    sce = SoftmaxCrossEntropy(name="loss", type="softmax_cross_entropy", label_smoothing=0.15,
                              inputs=["logits", "labels", "lengths"])
    got = run(lambda z, y, n: sce.build(b, [z, y, n]), z=logits, y=labels, n=lengths)
    mask = (np.arange(4)[None, :] < lengths[:, None]).astype(np.float64)
    want = smoothed_np(logits.reshape(-1, 6), np.eye(6)[labels.reshape(-1)], 0.15, mask.reshape(-1))
    np.testing.assert_allclose(got, want, rtol=1e-13)


@pytest.mark.parametrize("sparse", [True, False])
def test_gradient_by_finite_differences(sparse, rng):
    logits = rng.normal(size=(5, 4)) * 2
    labels = rng.integers(0, 4, size=5).astype(np.int64) if sparse else rng.dirichlet(np.ones(4), size=5)
    sce, b = layer(0.3)
    check_gradients(lambda z, y: sce.build(b, [z, y]), {"z": logits, "y": labels}, wrt=["z"])


def test_not_applied_outside_training(rng):
    logits = rng.normal(size=(4, 3))
    labels = rng.integers(0, 3, size=4).astype(np.int64)
    evaluating, b = layer(0.4, training=False)
    got = run(lambda z, y: evaluating.build(b, [z, y]), z=logits, y=labels)
    np.testing.assert_allclose(got, smoothed_np(logits, np.eye(3)[labels], 0.0), rtol=1e-13)


def test_spec_key_is_range_checked(tmp_path):
    from flowctl.engine.errors import SpecError
    from flowctl.spec.loader import load_spec

    p = tmp_path / "s.yaml"
    p.write_text("""version: 1
model:
  layers:
    - {name: x, type: input, shape: [4]}
    - {name: y, type: input, shape: [], dtype: int32, classes: 3}
    - {name: logits, type: dense, units: 3, inputs: [x]}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y], label_smoothing: 1.5}
""")
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert "s.yaml:7" in str(e.value) and "label_smoothing" in str(e.value)
