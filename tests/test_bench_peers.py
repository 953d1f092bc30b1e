"""`flowctl bench peers`: without PyTorch one clear message and exit 2; with it, a small row runs
both frameworks and the twins have the specs' parameter counts (skipped where torch is missing:
CI does not install it)."""
from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from flowctl.bench.peers import PeersUnavailable, Row, run_peers
from flowctl.cli.main import cli

TINY = """
version: 1
model:
  layers:
    - {name: tokens, type: input, shape: [6], dtype: int32, classes: 50}
    - {name: embedding, type: embedding, vocab: 50, dim: 8}
    - {name: dropout_0, type: dropout, rate: 0.5}
    - {name: lstm_1, type: lstm, units: 8}
    - {name: lstm_2, type: lstm, units: 8, forget_bias: 1.0}
    - {name: softmax, type: dense, units: 50}
    - {name: targets, type: input, shape: [6], dtype: int32, classes: 50}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
training: {clip_norm: 5.0}
"""

TINY_CONV = """
version: 1
model:
  defaults:
    conv2d: {batch_norm: true, bn_scale: false, activation: relu, padding: same}
  layers:
    - {name: image, type: input, shape: [9, 9, 3]}
    - {name: c1, type: conv2d, filters: 4, kernel: 3, strides: 2}
    - {name: c2, type: conv2d, filters: 4, kernel: [1, 3]}
    - {name: p, type: avg_pool, pool: 3, strides: 1, padding: same, inputs: [c1]}
    - {name: cat, type: concat, inputs: [c2, p]}
    - {name: m, type: max_pool, pool: 2}
    - {name: g, type: global_avg_pool}
    - {name: logits, type: dense, units: 5}
    - {name: label, type: input, shape: [], dtype: int32, classes: 5}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, label]}
training: {optimizer: {type: momentum, momentum: 0.9}}
"""


def test_without_torch_one_message_and_exit_2(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(PeersUnavailable, match=r'pip install -e "\.\[peers\]"') as e:
        run_peers(["lstm_lm"])
    assert e.value.exit_code == 2
    r = CliRunner().invoke(cli, ["bench", "peers", "--rows", "lstm_lm"])
    assert r.exit_code == 2
    assert 'pip install -e ".[peers]"' in r.output and "Traceback" not in r.output


def test_a_small_run_measures_both_and_the_counts_agree():
    pytest.importorskip("torch")
    r = run_peers([Row("tiny_lm", TINY, 4), Row("tiny_conv", TINY_CONV, 2),
                   Row("tiny_conv_infer", TINY_CONV, 2, train=False)], steps=1, rounds=2, blas_n=256,
                  memory=False)
    assert r["machine"]["blas_gflops"]["numpy"] > 0
    from rich.console import Console

    from flowctl.cli.bench import _render_peers

    console = Console(record=True, width=200)
    _render_peers(console, r)
    host = r["machine"]["host"]  # the CPU the ratios came from, printed beside the BLAS peak
    assert f"{host['cpu']}, {host['vector_isa']}" in console.export_text()
    for name, row in r["rows"].items():
        assert row["params"]["spec"] == row["params"]["pytorch"], name
        assert row["flowctl"]["samples"] == row["pytorch"]["samples"] == 2
        lo, hi = row["ratio_ci95"]
        assert row["ratio"] > 0 and lo <= hi
        assert len(row["round_ratios"]) == 2 and min(row["round_ratios"]) <= row["ratio_paired"] <= max(row["round_ratios"])
    json.dumps(r)  # plain data all the way down


def test_flowctl_profile_accounts_for_the_step_by_op():
    from flowctl.bench.peers import _batch, _load, flowctl_step

    row = Row("tiny_lm", TINY, 4)
    loaded = _load(row)
    step = flowctl_step(loaded, _batch(loaded, 4), train=True)
    before = step.session.executor
    prof = step.profile(steps=2)
    assert step.session.executor == before  # the timed steps keep their executor
    ops = {e["op"]: e for e in prof["ops"]}
    assert {"MatMul", "LSTMBlockCell", "LSTMBlockCellGrad"} <= set(ops)
    assert ops["LSTMBlockCell"]["calls"] == 2 * 6  # two layers, six steps: calls per step, not in all
    total = sum(e["ms"] for e in prof["ops"])
    assert 0 < total <= prof["step_ms"]  # kernels inside the step they were timed in


def test_a_reference_kernels_step_binds_no_compiled_variant(monkeypatch):
    """`--reference-kernels`' runner binds its plan with the variants off (a conv net with batch norm
    and pooling, which has compiled kernels), the ordinary runner with them on; both compute the
    same loss to float32 rounding."""
    import numpy as np

    import flowctl.kernels.registry as registry
    from flowctl.bench.peers import _batch, _load, flowctl_step

    picked: list[tuple[str, bool]] = []
    chosen = registry.chosen
    monkeypatch.setattr(registry, "chosen", lambda *a: picked.append((a[0], (v := chosen(*a)) is not None)) or v)
    row = Row("tiny_conv", TINY_CONV, 2)
    loaded = _load(row)
    arrays = _batch(loaded, 2)
    fast = flowctl_step(loaded, arrays, train=True)
    loss_fast = fast()[0]
    assert any(ok for op, ok in picked if op == "FusedBatchNorm")
    picked.clear()
    ref = flowctl_step(loaded, arrays, train=True, reference=True)
    loss_ref = ref()[0]
    assert picked and not any(ok for _, ok in picked)
    np.testing.assert_allclose(loss_fast, loss_ref, rtol=1e-5)
    if "torch" in sys.modules or __import__("importlib").util.find_spec("torch"):
        r = run_peers([row], steps=1, rounds=1, blas_n=128, memory=False, reference=True)
        assert r["rows"]["tiny_conv"]["kernels_ratio"] > 0


def test_peers_profile_lists_both_frameworks_ops():
    pytest.importorskip("torch")
    r = run_peers([Row("tiny_lm", TINY, 4)], steps=1, rounds=1, blas_n=128, memory=False, profile=True)
    prof = r["rows"]["tiny_lm"]["profile"]
    assert prof["flowctl"]["ops"] and prof["pytorch"]["ops"]
    assert any(e["op"].startswith("aten::") for e in prof["pytorch"]["ops"])
    r = CliRunner().invoke(cli, ["bench", "peers", "--rows", "lstm_lm", "--profile", "--help"])
    assert r.exit_code == 0 and "--profile" in r.output


def test_the_inception_and_lstm_twins_have_the_specs_parameter_counts():
    pytest.importorskip("torch")
    from flowctl.bench.peers import ROWS, _load
    from flowctl.bench.torch_twin import Twin

    inception = _load(ROWS["inception_v3_b8"])
    twin = Twin(inception)
    assert twin.param_count() == sum(inception.params()) == 23_851_784
    assert not any("aux" in n for n, _ in twin.named_parameters())
    lm = _load(ROWS["lstm_lm"])
    assert Twin(lm).param_count() == sum(lm.params()) == 19_775_200


@pytest.mark.slow
def test_peak_memory_comes_from_a_fresh_process_per_framework():
    pytest.importorskip("torch")
    from flowctl.bench.peers import peak_memory

    mem = peak_memory(Row("tiny_lm", TINY, 4), threads=1)
    for framework in ("flowctl", "pytorch"):
        m = mem[framework]
        assert 0 < m["built_mib"] <= m["peak_mib"] and m["step_mib"] >= 0 and m["first_step_s"] > 0
    assert mem["jit"]["first_step_s_empty_cache"] > 0 and mem["jit"]["first_step_s_warm_cache"] > 0


def test_unknown_row_is_one_clear_error():
    pytest.importorskip("torch")
    from flowctl.engine.errors import FlowctlError

    with pytest.raises(FlowctlError, match="no row named 'nope'"):
        run_peers(["nope"])


def test_the_peers_device_names_map_to_pytorchs_and_bad_ones_are_one_error():
    from flowctl.bench.peers import torch_device
    from flowctl.engine.errors import FlowctlError

    assert torch_device("cpu:0") == "cpu" and torch_device("gpu:0") == "cuda:0" and torch_device("gpu:3") == "cuda:3"
    with pytest.raises(FlowctlError, match="cannot run on device 'tpu:0'"):
        torch_device("tpu:0")
    r = CliRunner().invoke(cli, ["bench", "peers", "--device", "cpu:0,cpu:1"])
    assert r.exit_code != 0 and "one device" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli, ["bench", "engine", "--device", "gpu:0"])
    assert r.exit_code != 0 and "built-in suite" in r.output


def test_a_run_on_cpu_0_named_is_the_default_run():
    pytest.importorskip("torch")
    r = run_peers([Row("tiny_lm", TINY, 4)], steps=1, rounds=1, blas_n=128, memory=False, device="cpu:0")
    assert r["machine"]["device"] == "cpu:0" and "gpu" not in r["machine"]


@pytest.mark.gpu
def test_peers_on_a_gpu_record_the_device_and_its_memory():
    pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    from flowctl.bench.peers import peak_memory

    r = run_peers([Row("tiny_conv", TINY_CONV, 2)], steps=1, rounds=2, blas_n=128, memory=False,
                  device="gpu:0", profile=True)
    m = r["machine"]
    assert m["device"] == "gpu:0" and m["tf32_tflops"] > 0 and m["cuda_driver"] > 0
    row = r["rows"]["tiny_conv"]
    assert row["params"]["spec"] == row["params"]["pytorch"] and row["flowctl"]["samples"] == 2
    mem = peak_memory(Row("tiny_conv", TINY_CONV, 2), threads=1, device="gpu:0")
    assert all(mem[k]["gpu_peak_mib"] > 0 for k in ("flowctl", "pytorch"))


@pytest.mark.parametrize("positions", ["none", "rotary"])
def test_the_transformer_twin_is_pytorchs_sdpa_block_with_the_weights_copied(positions):
    """transformer_small in PyTorch (nn.LayerNorm, F.scaled_dot_product_attention with is_causal,
    nn.GELU(tanh), the embedding's weight as the head) computes flowctl's logits from the same
    weights: the twin `bench peers` times is the same model, and flowctl's attention is PyTorch's."""
    torch = pytest.importorskip("torch")
    import flowctl as fc
    from flowctl.bench.peers import ROWS, _load
    from flowctl.bench.torch_twin import Twin
    from flowctl.training.program import build_model

    loaded = _load(ROWS["transformer_small"], [f"model.blocks.decoder.params.positions={positions}"])
    model = build_model(loaded, training=False)
    sess = fc.Session(model.graph, store=fc.ContainerStore())
    sess.run(model.initializer())
    import numpy as np

    rng = np.random.default_rng(3)
    values = {name: [rng.normal(0, 0.2, v.shape).astype(np.float32) for v in vs]
              for name, vs in model.variables.items() if vs}
    sess.load_variables({v.node: a for name, vs in model.variables.items() for v, a in zip(vs, values.get(name, []))})
    tokens = rng.integers(0, 512, (3, 64)).astype(np.int32)
    want = sess.run(model.outputs["logits"], {model.inputs["tokens"]: tokens})

    twin = Twin(loaded)
    assert twin.param_count() == sum(loaded.params()) == 136_960
    twin.load(values)
    twin.eval()
    with torch.no_grad():
        got = twin({"tokens": torch.from_numpy(tokens).long()}, upto="logits")["logits"].numpy()
    # Measured: 5.4e-7 and 6.0e-7 largest difference on logits of magnitude 1.7 (float32 rounding).
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_gpt2_small_twin_has_the_specs_parameter_count():
    pytest.importorskip("torch")
    from flowctl.bench.peers import _load
    from flowctl.bench.torch_twin import Twin

    from flowctl.bench.peers import Row

    loaded = _load(Row("transformer_lm", "transformer_lm.yaml", 1))
    assert Twin(loaded).param_count() == sum(loaded.params()) == 124_439_808


def test_round_by_round_ratios_are_each_rounds_medians():
    from flowctl.bench.peers import paired_ratios

    speed = [1.0, 2.0, 1.0, 3.0, 1.5]  # the host's speed, round by round
    ratio = [0.8, 0.9, 1.0, 1.1, 1.2]  # flowctl / PyTorch in each round
    t = [d * k for d in speed for k in (1.0, 1.02, 0.97)]
    f = [r * d * k for r, d in zip(ratio, speed) for k in (0.99, 1.0, 1.01)]
    r = paired_ratios(f, t, 5)
    assert r["round_ratios"] == pytest.approx(ratio) and r["ratio_paired"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        paired_ratios(f[:-1], t[:-1], 5)  # blocks of unequal length


def test_on_a_cpu_each_framework_runs_in_a_process_of_its_own_unless_asked():
    """The default sitting spawns one process per framework (flowctl's heap is not PyTorch's: the
    module doc says what sharing it did); `in_process` is the one-process sitting; both measure."""
    pytest.importorskip("torch")
    row = Row("tiny_lm", TINY, 4)
    apart = run_peers([row], steps=1, rounds=2, blas_n=128, memory=False, peer_malloc="stock")["rows"]["tiny_lm"]
    one = run_peers([row], steps=1, rounds=2, blas_n=128, memory=False, in_process=True)["rows"]["tiny_lm"]
    assert (apart["processes"], apart["peer_malloc"]) == ("one per framework", "stock")
    assert one["processes"] == "one" and "peer_malloc" not in one
    for r in (apart, one):
        assert r["params"]["spec"] == r["params"]["pytorch"] and r["flowctl"]["samples"] == 2 and r["ratio"] > 0
    from flowctl.engine.errors import FlowctlError

    with pytest.raises(FlowctlError, match="peer_malloc is one of flowctl, stock"):
        run_peers([row], peer_malloc="jemalloc")


def test_a_runner_that_fails_in_its_process_is_one_error():
    """A spec error comes from the parent, as in one process (file:line:col); a failure inside a
    framework's process comes back as one FlowctlError naming the row and the runner, and the
    process is gone."""
    pytest.importorskip("torch")
    import multiprocessing

    from flowctl.bench.peers import _Apart
    from flowctl.engine.errors import FlowctlError

    bad = Row("bad", TINY.replace("units: 50}", "units: 50, inputs: [nowhere]}"), 4)
    with pytest.raises(FlowctlError, match=r"<bad>:10:\d+: .*unknown layer 'nowhere'"):
        run_peers([bad], steps=1, rounds=1, blas_n=128, memory=False)
    with pytest.raises(FlowctlError, match=r"bench peers: tiny_lm: nope: no runner named 'nope'"):
        _Apart(multiprocessing.get_context("spawn"), Row("tiny_lm", TINY, 4), "nope", 1, "fp32", (), "flowctl")
    for child in multiprocessing.active_children():
        child.join(10)
    assert not multiprocessing.active_children()
