"""`flowctl evaluate`, `predict` and `export` on a trained demo run and a tiny language model:
evaluate reports the spec's metrics, predict on the held-out data agrees with evaluate, an export
loaded without its spec gives the run's outputs bit for bit, and bad input is one line and the
documented exit code."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import flowctl as fc
from flowctl.cli.main import cli
from flowctl.training.inference import open_run, validation_arrays

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("demo") / "run"
    r = CliRunner().invoke(cli, ["train", str(ROOT / "specs" / "demo.yaml"), "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    return run


def _json(args: list[str]) -> dict:
    r = CliRunner().invoke(cli, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_evaluate_reports_the_demo_above_its_target(demo_run):
    r = _json(["evaluate", str(demo_run)])
    assert r["step"] == 600 and r["examples"] == 16 * 64
    assert r["val/accuracy"] > 0.95 and r["val/loss"] < 0.15
    # The same figures the run logged at its last evaluation.
    last = json.loads((demo_run / "metrics.jsonl").read_text().splitlines()[-1])
    assert r["val/accuracy"] == last["val/accuracy"]
    assert r["val/loss"] == pytest.approx(last["val/loss"], rel=1e-6)
    best = _json(["evaluate", str(demo_run), "--checkpoint", "best"])
    assert best["val/accuracy"] == max(json.loads(x).get("val/accuracy", 0.0)
                                       for x in (demo_run / "metrics.jsonl").read_text().splitlines())
    early = _json(["evaluate", str(demo_run), "--checkpoint", "400"])
    assert early["step"] == 400 and early["val/loss"] > r["val/loss"]


def test_predict_on_the_validation_file_matches_evaluate(demo_run, tmp_path):
    data = validation_arrays(demo_run, tmp_path / "val.npz")
    p = _json(["predict", str(demo_run), str(data)])
    e = _json(["evaluate", str(demo_run)])
    assert p["examples"] == e["examples"]
    assert p["accuracy"] == e["val/accuracy"]
    with np.load(data) as z:
        assert len(p["classes"]) == len(z["label"])
    probs = np.asarray(p["probabilities"])
    assert np.all(np.diff(probs, axis=1) <= 0) and np.all(probs.sum(axis=1) <= 1 + 1e-6)
    # An evaluate on that same file (all of it, no held-out part) agrees as well.
    again = _json(["evaluate", str(demo_run), "--data", str(data)])
    assert again["val/accuracy"] == e["val/accuracy"]


def test_an_export_gives_the_runs_outputs_bitwise(demo_run, tmp_path):
    out = tmp_path / "export"
    r = _json(["export", str(demo_run), "--out", str(out)])
    assert r["step"] == 600 and (out / "model.json").exists() and (out / "weights.safetensors").exists()
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert len(set(modes.values())) == 1, modes  # the weights as readable as model.json (they were 0600)
    model = fc.load_model(out)
    x = np.random.default_rng(3).standard_normal((32, 16)).astype(np.float32)
    got = model.predict({"features": x})["logits"]
    run = open_run(demo_run)
    want = run.session.run(run.evaluator.logits, {run.evaluator.model.inputs["features"]: x})
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("args, code, text", [
    (["evaluate", "no/such/run"], 6, "no run here"),
    (["evaluate", "{run}", "--checkpoint", "7"], 6, "no checkpoint at step 7 (checkpoints: 400, 600)"),
    (["evaluate", "{run}", "--checkpoint", "latest"], 6, "give a step number or 'best'"),
    (["predict", "{run}", "no/such.npz"], 2, "no such input file"),
    (["export", "no/such/run", "--out", "x"], 6, "no run here"),
])
def test_bad_input_is_one_line_and_its_exit_code(demo_run, args, code, text):
    r = CliRunner().invoke(cli, [a.replace("{run}", str(demo_run)) for a in args])
    assert r.exit_code == code, r.output
    assert text in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_an_empty_or_damaged_npz_is_one_line_naming_the_file(demo_run, tmp_path):
    """An empty .npz made numpy raise EOFError, which click printed as "Aborted!" (exit 1)."""
    whole = validation_arrays(demo_run, tmp_path / "val.npz").read_bytes()
    for name, data, why in [("empty.npz", b"", "the file is empty"),
                            ("text.npz", b"not arrays\n", "not an .npy or .npz file"),
                            ("cut.npz", whole[: len(whole) // 2], "damaged or cut short")]:
        path = tmp_path / name
        path.write_bytes(data)
        for args in (["predict", str(demo_run), str(path)], ["evaluate", str(demo_run), "--data", str(path)]):
            r = CliRunner().invoke(cli, args)
            assert r.exit_code == 2, (args, r.output)
            assert "Aborted" not in r.output and "Traceback" not in r.output
            assert len(r.output.strip().splitlines()) == 1, r.output
            assert f"{name}: cannot read arrays: {why}" in r.output, r.output


def test_a_language_model_predicts_next_words_and_reports_perplexity(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
    corpus.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(200)))
    spec = tmp_path / "lm.yaml"
    spec.write_text("""\
version: 1
name: tiny_lm
model:
  layers:
    - {name: tokens, type: input, shape: [6], dtype: int32, classes: 16}
    - {name: embedding, type: embedding, vocab: 16, dim: 8}
    - {name: lstm, type: lstm, units: 16}
    - {name: softmax, type: dense, units: 16}
    - {name: targets, type: input, shape: [6], dtype: int32, classes: 16}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
data: {source: text, path: corpus.txt, vocab_size: 16, validation_fraction: 0.2}
training: {optimizer: {type: adam}, learning_rate: 0.02, batch_size: 4, steps: 30, eval_every_steps: 10,
           metrics: [loss, perplexity, accuracy, top5]}
""")
    run = tmp_path / "run"
    r = CliRunner().invoke(cli, ["train", str(spec), "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    e = _json(["evaluate", str(run)])
    assert e["val/perplexity"] == pytest.approx(np.exp(e["val/loss"]))
    assert 1.0 < e["val/perplexity"] < 16 and 0 <= e["val/accuracy"] <= e["val/top5"] <= 1
    text = tmp_path / "prompt.txt"
    text.write_text("the cat sat on the")
    p = _json(["predict", str(run), str(text), "--top", "3"])
    assert p["context"][-5:] == ["the", "cat", "sat", "on", "the"]
    assert len(p["next"]) == 3 and all(w["word"] in words + ["<eos>", "<unk>"] for w in p["next"])
    assert p["next"][0]["probability"] >= p["next"][1]["probability"]
    try:  # the unrolled LSTM in ONNX computes the same logits
        import onnx
        from onnx.reference import ReferenceEvaluator
    except ImportError:
        return
    o = _json(["export", str(run), "--out", str(tmp_path / "onnx"), "--format", "onnx"])
    model = onnx.load(o["file"])
    x = np.random.default_rng(1).integers(0, 16, (4, 6)).astype(np.int32)
    (got,) = ReferenceEvaluator(model).run(None, {model.graph.input[0].name: x})
    m = open_run(run)
    want = m.session.run(m.evaluator.logits, {m.evaluator.model.inputs["tokens"]: x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_early_stopping_ends_the_run_after_patience_evaluations_without_improvement(tmp_path):
    """min_delta 10 makes every evaluation after the first count as no improvement: with patience 2
    the run stops at the third evaluation, checkpointed, with the reason in run.json."""
    run = tmp_path / "run"
    r = CliRunner().invoke(cli, ["train", str(ROOT / "specs" / "demo.yaml"), "--run-dir", str(run), "--json",
                                 "--set", "training.eval_every_steps=50",
                                 "--set", "training.early_stopping={metric: val/loss, patience: 2, min_delta: 10}"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["early_stopped"] is True and summary["last_step"] == 150
    assert json.loads((run / "run.json").read_text())["status"] == "early_stopped"
    assert (run / "checkpoints" / "ckpt-00000150").is_dir()
    assert "stopped early" in r.output


def test_an_onnx_export_checks_and_computes_the_runs_logits(demo_run, tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx.reference import ReferenceEvaluator

    r = _json(["export", str(demo_run), "--out", str(tmp_path / "o"), "--format", "onnx"])
    model = onnx.load(r["file"])
    onnx.checker.check_model(model, full_check=True)
    x = np.random.default_rng(5).standard_normal((7, 16)).astype(np.float32)
    (got,) = ReferenceEvaluator(model).run(None, {model.graph.input[0].name: x})
    run = open_run(demo_run)
    want = run.session.run(run.evaluator.logits, {run.evaluator.model.inputs["features"]: x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_op_onnx_lacks_here_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("onnx")
    from flowctl.training import onnx_export

    monkeypatch.delitem(onnx_export.SAME_NAME, "Relu")
    run = tmp_path / "run"
    assert CliRunner().invoke(cli, ["train", str(ROOT / "specs" / "demo.yaml"), "--run-dir", str(run),
                                    "--steps", "2"]).exit_code == 0
    r = CliRunner().invoke(cli, ["export", str(run), "--out", str(tmp_path / "o"), "--format", "onnx"])
    assert r.exit_code == 2 and "(Relu) has no ONNX form" in r.output and len(r.output.strip().splitlines()) == 1


def test_a_resumed_run_that_did_not_evaluate_says_when_its_evaluation_ran(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("""\
version: 1
name: s
model:
  layers:
    - {name: x, type: input, shape: [4]}
    - {name: logits, type: dense, units: 3}
    - {name: y, type: input, shape: [], dtype: int32, classes: 3}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: synthetic, task: learnable, validation_batches: 2}
training: {batch_size: 8, steps: 4, eval_every_steps: 4, metrics: [loss, accuracy]}
""")
    run = tmp_path / "run"
    r = CliRunner().invoke(cli, ["train", str(spec), "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    assert "val/accuracy" in r.output and "evaluated at step" not in r.output
    r = CliRunner().invoke(cli, ["resume", str(run), "--steps", "6"])
    assert r.exit_code == 0, r.output
    assert "(evaluated at step 4)" in " ".join(r.output.split())


def test_an_lstm_model_exports_to_onnx_and_computes_the_runs_logits(tmp_path):
    """lstm_lm (shrunk) exports: its steps' equal splits of an open batch dimension are ONNX
    Splits without sizes; the model's input and output are named as the spec names them."""
    onnx = pytest.importorskip("onnx")
    from onnx.reference import ReferenceEvaluator

    from tiny_specs import SHRINK_LM

    run, out = tmp_path / "run", tmp_path / "o"
    sets = [x for s in SHRINK_LM for x in ("--set", s)]
    assert CliRunner().invoke(cli, ["train", str(ROOT / "specs" / "lstm_lm.yaml"), "--run-dir", str(run),
                                    "--steps", "2", *sets]).exit_code == 0
    r = _json(["export", str(run), "--out", str(out), "--format", "onnx"])
    model = onnx.load(r["file"])
    assert [i.name for i in model.graph.input] == ["tokens"] and [o.name for o in model.graph.output] == ["logits"]
    x = np.random.default_rng(2).integers(0, 40, (3, 5)).astype(np.int32)
    (got,) = ReferenceEvaluator(model).run(None, {"tokens": x})
    m = open_run(run)
    want = m.session.run(m.evaluator.logits, {m.evaluator.model.inputs["tokens"]: x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


SHRINK_NMT = ["training.batch_size=2", "devices=[cpu:0]", "placement.constraints=[]", "placement.colocate=[]",
              *(f"model.layers.{side}/{layer}.units=8" for side in ("encoder", "decoder") for layer in ("lstm_1", "lstm_2")),
              *(f"model.layers.{side}/embedding.{k}={v}" for side in ("encoder", "decoder") for k, v in (("dim", 6), ("vocab", 30))),
              *(f"model.layers.{i}.{k}={v}" for i in ("source", "target_in", "target_out") for k, v in (("classes", 30), ("shape", "[4]"))),
              "model.layers.projection.units=30"]


def test_nmt_with_attention_exports_to_onnx_and_computes_the_runs_logits(tmp_path):
    """NMT (shrunk): the attention's batched products (BatchMatMul with adj_y) and its softmax have
    ONNX forms; the exported model's logits are the run's on the same source and target."""
    onnx = pytest.importorskip("onnx")
    from onnx.reference import ReferenceEvaluator

    run, out = tmp_path / "run", tmp_path / "o"
    sets = [x for s in SHRINK_NMT for x in ("--set", s)]
    r = CliRunner().invoke(cli, ["train", str(ROOT / "specs" / "nmt.yaml"), "--run-dir", str(run), "--steps", "2", *sets])
    assert r.exit_code == 0, r.output
    r = _json(["export", str(run), "--out", str(out), "--format", "onnx"])
    model = onnx.load(r["file"])
    names = [i.name for i in model.graph.input]
    assert sorted(names) == ["source", "target_in"] and [o.name for o in model.graph.output] == ["logits"]
    rng = np.random.default_rng(4)
    feed = {k: rng.integers(0, 30, (3, 4)).astype(np.int32) for k in names}
    (got,) = ReferenceEvaluator(model).run(None, feed)
    m = open_run(run)
    want = m.session.run(m.evaluator.logits, {m.evaluator.model.inputs[k]: v for k, v in feed.items()})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_onnx_export_of_a_bf16_run_is_its_float32_graph_and_runs_in_onnxruntime(tmp_path):
    """A bf16 run's ONNX file computes in float32 on the run's float32 master weights (onnxruntime's
    CPU provider has no bfloat16 kernels): it runs there and gives flowctl's float32 logits."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")

    run = tmp_path / "run"
    r = CliRunner().invoke(cli, ["train", str(ROOT / "specs" / "demo.yaml"), "--run-dir", str(run), "--steps", "20",
                                 "--set", "training.precision=bf16"])
    assert r.exit_code == 0, r.output
    o = _json(["export", str(run), "--out", str(tmp_path / "o"), "--format", "onnx"])
    model = onnx.load(o["file"])
    assert not any(a.name == "to" and a.i == onnx.TensorProto.BFLOAT16 for n in model.graph.node for a in n.attribute)
    x = np.random.default_rng(5).standard_normal((7, 16)).astype(np.float32)
    (got,) = ort.InferenceSession(o["file"]).run(None, {model.graph.input[0].name: x})
    fp32 = open_run(run, precision="fp32")
    want = fp32.session.run(fp32.evaluator.logits, {fp32.evaluator.model.inputs["features"]: x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    bf16 = open_run(run)  # the run's own graph computes in bfloat16: close to, not equal to, float32
    low = bf16.session.run(bf16.evaluator.logits, {bf16.evaluator.model.inputs["features"]: x})
    assert not np.array_equal(np.asarray(low, np.float32), want)
    np.testing.assert_allclose(np.asarray(low, np.float32), want, rtol=0.1, atol=0.1)
