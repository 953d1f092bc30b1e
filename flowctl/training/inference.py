"""A trained run used without training it: `flowctl evaluate`, `predict` and `export`.

Each opens the run's spec as `resume` does (with its recorded overrides), builds the model forward
only (dropout off, batch norm on its moving statistics), and loads a checkpoint's weights: the
newest valid one, one by step, or `best` (checkpoint.keep_best). Optimizer slots and other state a
forward pass never reads stay behind.

An export (flowctl.engine.saved_model) is self-contained: `flowctl.load_model(DIR)` runs it
without the spec, and its outputs are the run's bit for bit on the same device.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import flowctl as fc
from flowctl.data import InputSpec, make_source
from flowctl.data.arrays import READ_ERRORS, cannot_read
from flowctl.data.tables import FORMATS, read_table, table_columns
from flowctl.data.text import UNK, Vocabulary, read_words
from flowctl.engine import checkpoint as ckpt
from flowctl.engine.errors import CheckpointError, SpecError
from flowctl.engine.executor import needed_nodes
from flowctl.engine.saved_model import EXPORT_FORMAT, EXPORT_VERSION
from flowctl.spec.check import LoadedSpec
from flowctl.training.evaluate import Evaluator
from flowctl.training.inputs import TOKENIZER, model_inputs, run_table, run_tokenizer
from flowctl.training.onnx_export import to_onnx, write_onnx
from flowctl.training.rundir import RunDir, write_atomic
from flowctl.training.runs import load_run_spec, override_data
from flowctl.training.trainer import BEST, RANKING



@dataclass
class RunModel:
    """A run's model forward only, with a checkpoint's weights loaded."""

    loaded: LoadedSpec
    evaluator: Evaluator
    checkpoint: ckpt.Checkpoint
    split: str = "validation"  # what evaluation reads: the held-out data, or the file given instead

    @property
    def graph(self) -> fc.Graph:
        return self.evaluator.graph

    @property
    def session(self) -> fc.Session:
        return self.evaluator.session


def open_run(run_dir: Path, checkpoint: str | None = None, data: str | None = None,
             precision: str | None = None) -> RunModel:
    """The run in `run_dir` forward only, on the host, with the weights of `checkpoint` (a step
    number, `best`, or None for the newest valid one). `data`: another file to read instead of the
    spec's (arrays or a text corpus); `precision`: the graph in another than the spec's
    `training.precision` (its variables are float32 in every one)."""
    run = RunDir(run_dir)
    loaded, _ = load_run_spec(run)
    split = override_data(loaded, data, held=True) if data else "validation"
    evaluator = Evaluator(loaded, fc.ContainerStore(), "cpu:0", tokenizer=run_tokenizer(loaded, run),
                          table=run_table(loaded, run), precision=precision)
    found = _checkpoint(run, checkpoint)
    wanted = {n.name for n in evaluator.graph.nodes.values() if n.op == "Variable"}
    missing = sorted(wanted - set(found.tensors))
    if missing:
        raise CheckpointError(f"{found.path}: no tensor for variable {missing[0]!r} of the model")
    ckpt.apply(evaluator.session, {k: v for k, v in found.tensors.items() if k in wanted}, {"rng": {}},
               strict=False, origin=found.path)
    return RunModel(loaded, evaluator, found, split)


def _ranked_steps(path: Path) -> list[int]:
    """The steps checkpoints/best/ranking.json lists, best first; none when it is missing or damaged."""
    try:
        ranking = json.loads(path.read_text())["ranking"]
        return [int(r["step"]) for r in ranking]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _checkpoint(run: RunDir, which: str | None) -> ckpt.Checkpoint:
    if which == BEST:
        best = ckpt.CheckpointDir(run.checkpoints / BEST)
        if not best.list():
            raise CheckpointError(f"{run.path}: no best checkpoint (the spec sets no checkpoint.keep_best, or "
                                  f"no evaluation has run yet)")
        for step in _ranked_steps(best.directory / RANKING):
            try:
                return best.restore(step, allow_spec_change=True)
            except CheckpointError as e:  # damaged or gone: the next in the ranking
                warnings.warn(f"skipping best checkpoint {step}: {e}", ckpt.CheckpointWarning, stacklevel=2)
        return best.restore_latest(allow_spec_change=True)  # a run from before ranking.json: its one best
    store = ckpt.CheckpointDir(run.checkpoints)
    if which is None:
        return store.restore_latest(allow_spec_change=True)
    try:
        step = int(which)
    except ValueError:
        raise CheckpointError(f"--checkpoint {which}: give a step number or 'best'") from None
    steps = [int(p.name.split("-")[1]) for p in store.list()]
    if step not in steps:
        raise CheckpointError(f"{run.path}: no checkpoint at step {step} (checkpoints: "
                              f"{', '.join(map(str, steps)) or 'none'})")
    return store.restore(step, allow_spec_change=True)


# ---------------------------------------------------------------------------- evaluate
def evaluate_run(run_dir: Path, data: str | None = None, checkpoint: str | None = None) -> dict[str, Any]:
    """The spec's metrics on the run's held-out data (or all of `data`, another file)."""
    m = open_run(run_dir, checkpoint, data)
    batch = m.loaded.global_batch
    source = m.evaluator.source(batch, split=m.split)
    scores = m.evaluator.run(source)
    return {"run_dir": str(run_dir), "checkpoint": str(m.checkpoint.path), "step": m.checkpoint.step,
            "data": data or "validation", **scores.to_dict()}


# ---------------------------------------------------------------------------- predict
def predict_run(run_dir: Path, input_path: str, checkpoint: str | None = None, top: int = 5) -> dict[str, Any]:
    """The model on new inputs: an .npz of the model's inputs (the top classes of each example;
    with the labels there too, the accuracy), a table with a table run's columns (likewise, with the
    class names), or a text file for a language model (the most likely next words after its last
    tokens)."""
    m = open_run(run_dir, checkpoint)
    path = Path(input_path)
    if not path.exists():
        raise SpecError(f"{input_path}: no such input file")
    if path.suffix == ".npz":
        return {"checkpoint": str(m.checkpoint.path), **_predict_arrays(m, path, top)}
    if m.evaluator.table is not None:
        return {"checkpoint": str(m.checkpoint.path), **_predict_table(m, path, top)}
    if m.loaded.spec.data.model_dump().get("source") == "parallel_text":
        return {"checkpoint": str(m.checkpoint.path), **_translate(m, path)}
    return {"checkpoint": str(m.checkpoint.path), **_predict_text(m, path, top)}


def _logits_of(m: RunModel) -> fc.Tensor:
    if m.evaluator.logits is None:
        raise SpecError("predict needs a model whose loss is softmax_cross_entropy over logits")
    return m.evaluator.logits


def _predict_arrays(m: RunModel, path: Path, top: int) -> dict[str, Any]:
    logits_t = _logits_of(m)
    labels = m.evaluator.labels
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except READ_ERRORS as e:
        raise cannot_read(path, e) from None
    needed = _forward_inputs(m, logits_t)
    absent = [k for k in needed if k not in arrays]
    if absent:
        raise SpecError(f"{path}: no array for input '{absent[0]}' (arrays: {', '.join(arrays)})")
    dtypes = {i.name: i.dtype for i in model_inputs(m.loaded)}
    truth = arrays[labels].reshape(-1) if labels is not None and labels in arrays else None
    return _classify(m, {k: arrays[k].astype(dtypes[k], copy=False) for k in needed}, top, truth)


def _predict_table(m: RunModel, path: Path, top: int) -> dict[str, Any]:
    """The top classes of each row of a table (CSV or Parquet) with the run's columns, encoded as
    the run learned (RUN/table.json); with the label column there too, the accuracy."""
    table = m.evaluator.table
    assert table is not None
    fmt = m.loaded.spec.data.model_dump().get("format")
    if Path(path).suffix.lower() not in FORMATS and not fmt:
        raise SpecError(f"{path}: a table run predicts on a .csv or .parquet file with its columns, or on .npz arrays")
    names = table_columns(path, fmt)
    absent = [c for c in table.features if c not in names]
    if absent:
        raise SpecError(f"{path}: no column '{absent[0]}' (the run reads {', '.join(table.features)}; "
                        f"the file has {', '.join(names)})")
    has_label = table.label in names
    columns = read_table(path, [*table.features] + ([table.label] if has_label else []), fmt)
    (name,) = _forward_inputs(m, _logits_of(m))
    out = _classify(m, {name: table.features_of(columns, path)}, top,
                    table.labels_of(columns, path) if has_label else None)
    out["names"] = [[table.classes[i].item() for i in row] for row in out["classes"]]
    return out


def _classify(m: RunModel, arrays: dict[str, np.ndarray], top: int, truth: np.ndarray | None) -> dict[str, Any]:
    """The `top` classes of each example, by probability; with `truth`, accuracy and top-k."""
    logits_t = _logits_of(m)
    feeds = {m.evaluator.model.inputs[k]: v for k, v in arrays.items()}
    logits = np.asarray(m.session.run(logits_t, feeds))
    probs = _softmax(logits.reshape(-1, logits.shape[-1]))
    k = min(top, probs.shape[1])
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    out: dict[str, Any] = {"examples": int(logits.shape[0]), "classes": order.tolist(),
                           "probabilities": np.take_along_axis(probs, order, axis=1).tolist()}
    if truth is not None:
        out["accuracy"] = float((order[:, 0] == truth).mean())
        out[f"top{k}"] = float((order == truth[:, None]).any(axis=1).mean())
    return out


def _forward_inputs(m: RunModel, target: fc.Tensor) -> list[str]:
    """The model inputs `target` depends on (a classifier's logits do not need its labels)."""
    need = needed_nodes(m.graph, [target.node], set())
    return [name for name, t in m.evaluator.model.inputs.items() if t.node in need]


def _predict_text(m: RunModel, path: Path, top: int) -> dict[str, Any]:
    """A language model's next word after the text in `path`. Trained on a token stream, the model
    reads the last `unroll` words (left-padded with <unk>); trained on sentences with their lengths,
    it reads the text as one sentence (its last `unroll` words) and predicts after its last word."""
    logits_t = _logits_of(m)
    if m.evaluator.tokenizer is not None:
        return _predict_bpe(m, path, top)
    vocab = _vocabulary(m.loaded)
    ids = vocab.encode(read_words(path)[:-1])  # the words as written, without the line's end marker
    inputs = m.evaluator.model.inputs
    lengths = m.loaded.spec.data.model_dump().get("lengths")
    (name,) = [k for k in _forward_inputs(m, logits_t) if k != lengths]
    unroll = int(inputs[name].shape[1])
    batch = m.loaded.global_batch
    if lengths:
        if not len(ids):
            raise SpecError(f"{path}: no words to continue")
        tail = ids[-unroll:]
        window = np.zeros(unroll, np.int64)
        window[:len(tail)] = tail
        feeds = {inputs[name]: np.tile(window, (batch, 1)).astype(inputs[name].dtype),
                 inputs[lengths]: np.full(batch, len(tail), inputs[lengths].dtype)}
        position, context = len(tail) - 1, vocab.decode(tail)
    else:
        window = np.full(unroll, vocab.ids[UNK], np.int64)
        tail = ids[-unroll:]
        window[unroll - len(tail):] = tail
        feeds = {inputs[name]: np.tile(window, (batch, 1)).astype(inputs[name].dtype)}
        position, context = unroll - 1, vocab.decode(window)
    logits = np.asarray(m.session.run(logits_t, feeds))
    last = _softmax(logits.reshape(batch, unroll, -1)[0, position][None, :])[0]
    # Classes past the vocabulary (a corpus with fewer words than the input's classes) are no word.
    order = [i for i in np.argsort(-last, kind="stable") if i < len(vocab.words)][:top]
    return {"context": context, "next": [{"word": vocab.words[i], "probability": float(last[i])} for i in order]}


def _predict_bpe(m: RunModel, path: Path, top: int) -> dict[str, Any]:
    """The next token after the text in `path`, encoded with the run's byte-level BPE; the model
    reads its last `unroll` tokens, left-padded with token 0 where the text is shorter."""
    from flowctl.data.bpe import read_text

    bpe = m.evaluator.tokenizer
    assert bpe is not None
    logits_t = _logits_of(m)
    ids = bpe.encode(read_text(path).rstrip("\n"))  # the text as written, without the file's last line end
    if not len(ids):
        raise SpecError(f"{path}: no text to continue")
    (name,) = _forward_inputs(m, logits_t)
    inputs = m.evaluator.model.inputs
    unroll, batch = int(inputs[name].shape[1]), m.loaded.global_batch
    window = np.zeros(unroll, np.int64)
    tail = ids[-unroll:]
    window[unroll - len(tail):] = tail
    logits = np.asarray(m.session.run(logits_t, {inputs[name]: np.tile(window, (batch, 1)).astype(inputs[name].dtype)}))
    last = _softmax(logits.reshape(batch, unroll, -1)[0, -1][None, :])[0]
    order = [i for i in np.argsort(-last, kind="stable") if i < len(bpe)][:top]
    return {"context": bpe.decode(tail), "next": [{"word": bpe.token(int(i)), "token": int(i),
                                                   "probability": float(last[i])} for i in order]}


def _translate(m: RunModel, path: Path) -> dict[str, Any]:
    """Greedy decoding for a model trained on sentence pairs: each line of `path` is a source
    sentence; the decoder starts from `<eos>` and is run once per target position, each time fed
    the words chosen so far (the argmax at the previous position), until every sentence has
    produced `<eos>` or the target input is full."""
    from flowctl.data.parallel import vocabularies
    from flowctl.data.text import read_lines

    data = m.loaded.spec.data.model_dump()
    lines = [words for words in read_lines(path) if words]
    if not lines:
        raise SpecError(f"{path}: no sentence to translate")
    base, feeds = m.loaded.base_dir, data["feeds"]
    src_vocab, tgt_vocab = vocabularies(base / data["path"], base / data["target_path"],
                                        (data.get("vocab_size"), data.get("target_vocab_size")))
    inputs = m.evaluator.model.inputs
    ts, tt = int(inputs[feeds["source"]].shape[1]), int(inputs[feeds["target_in"]].shape[1])
    n, eos = len(lines), tgt_vocab.ids["<eos>"]
    source, source_len = np.zeros((n, ts), np.int64), np.zeros(n, np.int64)
    for i, words in enumerate(lines):
        ids = src_vocab.encode(words)[:ts]
        source[i, :len(ids)], source_len[i] = ids, len(ids)
    target_in = np.zeros((n, tt), np.int64)
    target_in[:, 0] = eos
    chosen = np.zeros((n, tt), np.int64)
    done = np.zeros(n, bool)
    logits_t = _logits_of(m)
    dtype = {k: inputs[v].dtype for k, v in feeds.items()}
    need = needed_nodes(m.graph, [logits_t.node], set())
    for t in range(tt):
        fed = {"source": source, "source_lengths": source_len, "target_in": target_in,
               "target_lengths": np.full(n, t + 1)}
        logits = np.asarray(m.session.run(logits_t, {inputs[feeds[k]]: v.astype(dtype[k]) for k, v in fed.items()
                                                      if inputs[feeds[k]].node in need}))
        chosen[:, t] = logits[:, t].argmax(axis=-1)
        done |= chosen[:, t] == eos
        if done.all():
            break
        if t + 1 < tt:
            target_in[:, t + 1] = chosen[:, t]
    out = []
    for i, words in enumerate(lines):
        row = list(chosen[i])
        cut = row.index(eos) if eos in row else len(row)
        out.append({"source": " ".join(words), "translation": " ".join(tgt_vocab.decode(np.array(row[:cut])))})
    return {"examples": n, "translations": out}


def _vocabulary(loaded: LoadedSpec) -> Vocabulary:
    data = loaded.spec.data.model_dump()
    if data.get("source") != "text":
        raise SpecError("predicting from text needs a model trained on a text corpus (data.source text)")
    return Vocabulary.build(read_words(loaded.base_dir / data["path"]), data.get("vocab_size"))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------------------- export
def export_run(run_dir: Path, out: Path, checkpoint: str | None = None, fmt: str = "flowctl") -> dict[str, Any]:
    """Write the run's inference graph, weights and signature to `out` (`fmt` "onnx": the graph
    from the inputs to the logits as `out/model.onnx`, checked by onnx.checker). An ONNX file is
    the float32 graph whatever the run's `training.precision`: its variables are float32 masters,
    and runtimes' CPU providers lack most bfloat16 and float16 kernels (onnxruntime has no
    bfloat16 Relu), so a mixed-precision graph would often not run; the flowctl format keeps the
    run's own precision."""
    from safetensors.numpy import save

    if fmt == "onnx":
        return _export_onnx(open_run(run_dir, checkpoint, precision="fp32"), out)
    m = open_run(run_dir, checkpoint)
    model = m.evaluator.model
    logits = _logits_of(m) if m.evaluator.logits is not None else None
    outputs = {"logits": logits.name} if logits is not None else {}
    assert model.loss is not None
    outputs["loss"] = model.loss.name
    signature: dict[str, Any] = {
        "format": EXPORT_FORMAT, "version": EXPORT_VERSION, "model": m.loaded.spec.model.name,
        "step": m.checkpoint.step, "inputs": {name: {"tensor": t.name, "dtype": t.dtype, "shape": list(t.shape)}
                                               for name, t in model.inputs.items()},
        "outputs": outputs, "labels": m.evaluator.labels,
    }
    out.mkdir(parents=True, exist_ok=True)
    if m.evaluator.tokenizer is not None:  # the ids mean what the run's own tokenizer says
        write_atomic(out / TOKENIZER, m.evaluator.tokenizer.to_json())
        signature["tokenizer"] = TOKENIZER
    elif m.loaded.spec.data.model_dump().get("source") == "text":
        signature["vocabulary"] = _vocabulary(m.loaded).words
    weights = {k: np.ascontiguousarray(v) for k, v in m.session.variable_values().items()}
    write_atomic(out / "weights.safetensors", save(weights))  # atomic, and readable as model.json is
    write_atomic(out / "model.json", m.graph.to_json())
    write_atomic(out / "signature.json", json.dumps(signature, indent=1) + "\n")
    return {"out": str(out), "checkpoint": str(m.checkpoint.path), "step": m.checkpoint.step,
            "nodes": len(m.graph), "weights": len(weights),
            "bytes": int(sum(v.nbytes for v in weights.values()))}


def _export_onnx(m: RunModel, out: Path) -> dict[str, Any]:
    logits = _logits_of(m)
    model = m.evaluator.model
    weights = m.session.variable_values()
    proto = to_onnx(m.graph, {k: t.name for k, t in model.inputs.items()}, {"logits": logits.name}, weights,
                    name=m.loaded.spec.model.name)
    out.mkdir(parents=True, exist_ok=True)
    path = write_onnx(proto, out / "model.onnx")
    return {"out": str(out), "file": str(path), "format": "onnx", "checkpoint": str(m.checkpoint.path),
            "step": m.checkpoint.step, "nodes": len(proto.graph.node), "weights": len(proto.graph.initializer),
            "bytes": path.stat().st_size}


def validation_arrays(run_dir: Path, path: Path) -> Path:
    """The run's held-out data written as an .npz of its inputs (what `predict` reads)."""
    run = RunDir(run_dir)
    loaded, _ = load_run_spec(run)
    inputs: list[InputSpec] = model_inputs(loaded)
    src = make_source(loaded.spec.data.model_dump(), inputs, loaded.global_batch, base_dir=loaded.base_dir,
                      split="validation", tokenizer=run_tokenizer(loaded, run), table=run_table(loaded, run))
    n = int(getattr(src, "batches_per_epoch", 0) or loaded.spec.data.model_dump().get("validation_batches", 16))
    batches = [src.next_batch() for _ in range(n)]
    np.savez(path, **{k: np.concatenate([b[k] for b in batches]) for k in batches[0]})
    return path


__all__ = ["RunModel", "evaluate_run", "export_run", "open_run", "predict_run", "validation_arrays"]
