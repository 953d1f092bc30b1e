"""Checks that need more than one key: the layer graph (names, inputs, shapes through the layer
library), the loss, devices referenced by placement and parallelism, batch arithmetic, and the data
source against the model's inputs. Every message carries the numbers involved."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from flowctl.data.tables import pyarrow_module, table_columns
from flowctl.engine.devices import device_matches, parse_constraint
from flowctl.engine.errors import PlacementError, SpecError, did_you_mean
from flowctl.engine.shapes import TensorSpec
from flowctl.spec.blocks import Expansion, Instance
from flowctl.spec.layers import Layer, LayerError, Weight, count
from flowctl.spec.layers.base import elements, fmt
from flowctl.spec.schema import ArrayData, ImageData, ParallelTextData, Spec, TableData, TextData
from flowctl.spec.source import LocDict, Mark, Problems, locate

DEFAULT_BATCH = 32
# Sizes a spec may ask for. 2^31 elements is where int32 indexing ends (cuBLAS, cuDNN, TensorFlow's
# kernels); a model of 2^31 float32 parameters holds 8 GiB, 32 GiB with its gradients and Adam's
# slots. Beyond these a spec is a typo (`units: 1000000000`), and numpy would fail building it.
MAX_PARAMETERS = 2**31
MAX_ELEMENTS = 2**31  # one layer's output, per example


@dataclass
class LayerInfo:
    """A layer after static inference: resolved inputs, output, weights, where it was written."""

    layer: Layer
    index: int  # position in model.layers after block expansion
    inputs: list[str]
    output: TensorSpec
    weights: list[Weight]
    mark: Mark | None
    via: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def params(self) -> tuple[int, int]:
        return count(self.weights)


@dataclass
class LoadedSpec:
    """A validated spec: the pydantic model plus everything derived from it."""

    spec: Spec
    root: LocDict  # the YAML tree with marks (after block expansion)
    layers: dict[str, LayerInfo]
    instances: list[Instance]
    aliases: dict[str, str]
    loss: str | None
    global_batch: int
    per_replica_batch: int
    base_dir: Path = field(default_factory=lambda: Path("."))

    def resolve(self, name: str) -> str:
        return self.aliases.get(name, name)

    def layer_names(self) -> list[str]:
        return list(self.layers)

    def params(self) -> tuple[int, int]:
        t = sum(i.params[0] for i in self.layers.values())
        return t, sum(i.params[1] for i in self.layers.values())

    def inputs(self) -> list[LayerInfo]:
        return [i for i in self.layers.values() if i.layer.type == "input"]

    def where(self, loc: Sequence[Any]) -> str:
        mark, _ = locate(self.root, loc)
        return str(mark) if mark else ""


def check(spec: Spec, root: LocDict, expansion: Expansion, problems: Problems, base_dir: Path) -> LoadedSpec:
    layers = _check_layers(spec, root, expansion, problems)
    loss = _check_loss(spec, root, layers, problems)
    gb, rb = _check_batch(spec, root, problems)
    rb = _check_accumulate(spec, root, gb, rb, problems)
    _check_precision(spec, root, problems)
    _check_optimizer(spec, root, layers, problems)
    loaded = LoadedSpec(spec, root, layers, expansion.instances, expansion.aliases, loss, gb, rb, base_dir)
    _check_devices(spec, root, loaded, problems)
    _check_data(spec, root, loaded, problems, base_dir)
    return loaded


def _check_layers(spec: Spec, root: LocDict, expansion: Expansion, problems: Problems) -> dict[str, LayerInfo]:
    out: dict[str, LayerInfo] = {}
    failed: set[str] = set()
    marks: dict[str, Mark | None] = {}
    for i, entry in enumerate(spec.model.layers):
        loc = ("model", "layers", i)
        assert isinstance(entry, Layer), "block uses are expanded before validation"
        layer = entry
        mark, via = locate(root, loc)
        name = layer.name
        if name in marks or name in expansion.aliases:
            first = marks.get(name) or "a block instance"
            problems.at(root, loc + ("name",), f"duplicate layer name '{name}' (first defined at {first})")
            continue
        marks[name] = mark
        layer._dtype = spec.model.dtype
        refs = [expansion.aliases.get(r, r) for r in (layer.inputs or [])]
        lo, hi = layer.arity
        if not lo <= len(refs) <= (hi if hi is not None else len(refs)):
            want = (f"{lo}" if lo == hi else f"at least {lo}" if hi is None
                    else f"{lo} or {hi}" if hi == lo + 1 else f"{lo} to {hi}")
            problems.at(root, loc + ("inputs",) if layer.inputs else loc,
                        f"{layer.type} layer '{name}' takes {want} input(s), got {len(refs)}"
                        + (f": {', '.join(refs)}" if refs else ""))
            failed.add(name)
            continue
        ins: list[TensorSpec] = []
        ok = True
        for n, ref in enumerate(refs):
            if ref in out:
                ins.append(out[ref].output)
            elif ref in failed:
                ok = False
            else:
                later = any(x.name == ref for x in spec.model.layers[i + 1:])
                why = " (layers may only read earlier layers)" if later else ""
                problems.at(root, loc + ("inputs", n), f"unknown layer '{ref}'{why}"
                            + ("" if later else did_you_mean(ref, list(out) + list(expansion.aliases))))
                ok = False
        if not ok or not _resolve_tie(root, loc, layer, out, expansion, failed, problems):
            failed.add(name)
            continue
        try:
            spec_out = layer.infer(ins)
            ws = layer.weights(ins)
        except LayerError as e:
            where = loc + (e.field,) if e.field and e.field in root_layer(root, i) else loc
            shapes = "; ".join(f"{r} {fmt(s.shape)}" for r, s in zip(refs, ins))
            shown = all(fmt(x.shape) in str(e) for x in ins)
            problems.at(root, where, f"{layer.type} layer '{name}': {e}"
                        + (f" [inputs: {shapes}]" if shapes and not shown else ""))
            failed.add(name)
            continue
        too_big = _too_big(layer, spec_out, ws)
        if too_big:
            problems.at(root, loc, too_big)
            failed.add(name)
            continue
        out[name] = LayerInfo(layer, i, refs, spec_out, ws, mark, via)
    total = sum(sum(w.size for w in info.weights) for info in out.values())
    if total > MAX_PARAMETERS:
        biggest = sorted(out.values(), key=lambda info: -sum(w.size for w in info.weights))[:3]
        problems.at(root, ("model", "layers"), f"the model has {total:,} parameters, more than the "
                    f"{MAX_PARAMETERS:,} (2^31) a model may hold (largest: "
                    + ", ".join(f"{info.name} {sum(w.size for w in info.weights):,}" for info in biggest) + ")")
    return out


def _resolve_tie(root: LocDict, loc: tuple, layer: Layer, out: dict[str, LayerInfo], expansion: Expansion,
                 failed: set[str], problems: Problems) -> bool:
    """A layer with `tie: <embedding>` reads that earlier embedding's table: check it is one, and
    hand the layer the table's shape (its own inference needs it). False when it cannot be tied."""
    tie = getattr(layer, "tie", None)
    if tie is None:
        return True
    ref = expansion.aliases.get(tie, tie)
    if ref in failed:
        return False
    if ref not in out:
        problems.at(root, loc + ("tie",), f"unknown layer '{tie}' to tie to (an earlier embedding layer)"
                    + did_you_mean(tie, [n for n, i in out.items() if i.layer.type == "embedding"]))
        return False
    target = out[ref].layer
    if target.type != "embedding":
        problems.at(root, loc + ("tie",), f"'{tie}' is a {target.type} layer: `tie` takes an embedding layer, "
                    f"whose table becomes the kernel")
        return False
    layer.tie = ref
    layer._tied = (int(getattr(target, "vocab")), int(getattr(target, "dim")))  # type: ignore[attr-defined]
    return True


def _too_big(layer: Layer, output: TensorSpec, weights: list[Weight]) -> str:
    """Why a layer is beyond the sizes a spec may ask for, or ''."""
    size = sum(w.size for w in weights)
    if size > MAX_PARAMETERS:
        shapes = ", ".join(f"{w.name} {list(w.shape)}" for w in weights if w.size)
        return (f"{layer.type} layer '{layer.name}' has {size:,} parameters ({shapes}), more than the "
                f"{MAX_PARAMETERS:,} (2^31) a model may hold")
    per_example = elements(output)
    if per_example is not None and per_example > MAX_ELEMENTS:
        return (f"{layer.type} layer '{layer.name}' outputs {per_example:,} elements per example "
                f"(shape {fmt(output.shape)}), more than the {MAX_ELEMENTS:,} (2^31) a tensor may hold")
    return ""


def root_layer(root: LocDict, i: int) -> dict:
    try:
        return root["model"]["layers"][i]
    except (KeyError, IndexError, TypeError):
        return {}


def _check_loss(spec: Spec, root: LocDict, layers: dict[str, LayerInfo], problems: Problems) -> str | None:
    for info in layers.values():
        if info.layer.type == "softmax_cross_entropy":
            _check_classes(root, info, layers, problems)
    losses = [n for n, i in layers.items() if i.layer.is_loss]
    want = spec.model.loss
    if want is None:
        return losses[-1] if losses else None
    if want not in layers or not layers[want].layer.is_loss:
        problems.at(root, ("model", "loss"), f"'{want}' is not a loss layer" + did_you_mean(want, losses)
                    + (f" (loss layers: {', '.join(losses)})" if losses else " (the model has no loss layer)"))
        return None
    return want


def _check_classes(root: LocDict, info: LayerInfo, layers: dict[str, LayerInfo], problems: Problems) -> None:
    logits, labels = (layers[r] for r in info.inputs[:2])
    n = logits.output.shape[-1]
    classes = getattr(labels.layer, "classes", None)
    if labels.layer.type == "input" and classes is not None and n is not None and classes != n:
        problems.at(root, ("model", "layers", info.index, "inputs"),
                    f"labels '{labels.name}' take {classes} classes but logits '{logits.name}' have {n}")


def _check_batch(spec: Spec, root: LocDict, problems: Problems) -> tuple[int, int]:
    """Global batch = per-replica batch × replicas (§7: sync data parallelism is one step on the
    whole batch); whichever is missing is computed."""
    t, r = spec.training, spec.parallelism.replicas
    if t.batch_size is not None and t.per_replica_batch_size is not None:
        if t.batch_size != t.per_replica_batch_size * r:
            problems.at(root, ("training", "batch_size"),
                        f"batch_size {t.batch_size} is not per_replica_batch_size {t.per_replica_batch_size} "
                        f"× replicas {r} = {t.per_replica_batch_size * r}")
        return t.batch_size, t.per_replica_batch_size
    if t.per_replica_batch_size is not None:
        return t.per_replica_batch_size * r, t.per_replica_batch_size
    gb = t.batch_size if t.batch_size is not None else DEFAULT_BATCH * r
    if gb % r:
        problems.at(root, ("training", "batch_size"),
                    f"batch_size {gb} does not split evenly over {r} replicas ({gb} / {r} = {gb / r:.2f})")
    return gb, max(gb // r, 1)


def _check_accumulate(spec: Spec, root: LocDict, gb: int, rb: int, problems: Problems) -> int:
    """training.accumulate K: the single strategy's step as K micro-batches of gb / K; returns the
    batch one graph run takes (the micro-batch: what memory and the cost model see)."""
    k, strategy = spec.training.accumulate, spec.parallelism.strategy
    if k == 1:
        return rb
    loc = ("training", "accumulate")
    if strategy != "single":
        why = ("pipeline accumulates over its concurrent_steps micro-batches already" if strategy == "pipeline"
               else "its replicas split the batch instead" if strategy.endswith("data_parallel")
               else "its step is one run of every layer group")
        problems.at(root, loc, f"accumulate is the single strategy's, not {strategy}'s ({why}); "
                    f"use strategy: single or drop accumulate")
        return rb
    if gb % k:
        problems.at(root, loc, f"a batch of {gb} does not split into accumulate {k} equal micro-batches "
                    f"({gb} / {k} = {gb / k:.2f})")
        return rb
    if spec.training.precision == "fp16":
        problems.at(root, loc, "accumulate is not built for fp16's loss scaling yet (its finite check and "
                    "skipped step are one update's): use precision fp32 or bf16")
    return gb // k


def _check_optimizer(spec: Spec, root: LocDict, layers: dict[str, LayerInfo], problems: Problems) -> None:
    """AdamW's keys on another optimizer say nothing; its decay_exclude globs must each select a
    trainable variable (a typo would otherwise decay what it meant to spare)."""
    o = spec.training.optimizer
    given = [k for k in ("weight_decay", "decay_exclude") if k in o.model_fields_set]
    if o.type != "adamw":
        for key in given:
            problems.at(root, ("training", "optimizer", key), f"{key} is AdamW's (type: adamw), not {o.type}'s")
        return
    if "decay_exclude" not in given:
        return
    names = [f"{info.name}/{w.name}" for info in layers.values() for w in info.weights if w.trainable]
    for i, pattern in enumerate(o.decay_exclude):
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            problems.at(root, ("training", "optimizer", "decay_exclude", i),
                        f"decay_exclude '{pattern}' matches no trainable variable" + did_you_mean(pattern, names)
                        + f" (variables: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''})")


def _check_precision(spec: Spec, root: LocDict, problems: Problems) -> None:
    """fp16 and bf16 keep float32 master variables: the model's own dtype must be float32."""
    t = spec.training
    if t.precision != "fp32" and spec.model.dtype != "float32":
        problems.at(root, ("training", "precision"), f"{t.precision} keeps float32 master variables, so model.dtype "
                    f"must be float32, not {spec.model.dtype}")
    if t.precision == "fp16":
        if spec.parallelism.strategy == "async_data_parallel":
            problems.at(root, ("training", "precision"), "fp16's loss scaling is not built for "
                        "async_data_parallel yet (its replicas' gradients are fed to the update one at a time)")
        if spec.parallelism.reduce == "allreduce":
            problems.at(root, ("parallelism", "reduce"), "fp16's loss scaling is built for one update, not one per "
                        "all-reduce replica yet: use reduce: parameter_device (or auto, which picks it)")


def _device_ok(root: LocDict, loc: tuple, dev: str, listed: list[str], problems: Problems) -> bool:
    try:
        parse_constraint(dev)
    except PlacementError as e:
        problems.at(root, loc, str(e))
        return False
    if not any(device_matches(dev, d) for d in listed):
        short = [d.replace("/job:localhost/task:0/device:", "") for d in listed]
        problems.at(root, loc, f"unknown device '{dev}': no listed device matches"
                    + did_you_mean(dev, short) + f" (devices: {', '.join(short)})")
        return False
    return True


def matches(pattern: str, names: Sequence[str]) -> list[str]:
    """Names a constraint glob selects: a layer name, or any node under it (`mixed_5b` also
    selects `mixed_5b/branch1x1/conv`)."""
    # Node names are known only once the graph is built, so a pattern that reaches inside a layer
    # ('hidden/*', 'hidden/matmul') is accepted when its layer part names a layer.
    return [n for n in names if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n, pattern + "/*")
            or fnmatch.fnmatchcase(n + "/\0", pattern) or pattern.startswith(n + "/")]


def _check_devices(spec: Spec, root: LocDict, loaded: LoadedSpec, problems: Problems) -> None:
    listed = [d.name for d in spec.devices]
    seen: dict[str, int] = {}
    for i, d in enumerate(spec.devices):
        if d.name in seen:
            problems.at(root, ("devices", i), f"device {d.name} listed twice (also entry {seen[d.name]})")
        seen[d.name] = i
        for peer in d.links:
            if peer not in listed:
                problems.at(root, ("devices", i, "links"), f"link to unknown device {peer}")
        job = d.name.split("/")[1][len("job:"):]
        if job != "localhost" and spec.cluster.type == "local":
            problems.at(root, ("devices", i), f"device {d.name} is on job '{job}', which needs "
                        f"`cluster: {{type: ray}}` (the cluster is local)")
        task = int(d.name.split("/")[2][len("task:"):])
        if job == "worker" and spec.cluster.workers and task >= spec.cluster.workers:
            problems.at(root, ("devices", i), f"device {d.name} is on worker task {task}, but the cluster "
                        f"starts {spec.cluster.workers} worker(s) (tasks 0-{spec.cluster.workers - 1})")
    names = loaded.layer_names()
    for i, c in enumerate(spec.placement.constraints):
        _device_ok(root, ("placement", "constraints", i, "device"), c.device, listed, problems)
        if not matches(c.match, names):
            problems.at(root, ("placement", "constraints", i, "match"),
                        f"constraint '{c.match}' matches no layer" + did_you_mean(c.match, names))
    for i, group in enumerate(spec.placement.colocate):
        if len(group) < 2:
            problems.at(root, ("placement", "colocate", i), f"a colocation group needs 2 or more patterns, "
                        f"got {len(group)}")
        for j, pat in enumerate(group):
            if not matches(pat, names):
                problems.at(root, ("placement", "colocate", i, j), f"colocation pattern '{pat}' matches no layer"
                            + did_you_mean(pat, names))
    par = spec.parallelism
    for i, dev in enumerate(par.devices or []):
        _device_ok(root, ("parallelism", "devices", i), dev, listed, problems)
    for i, grp in enumerate(par.groups):
        _device_ok(root, ("parallelism", "groups", i, "device"), grp.device, listed, problems)
        for j, pat in enumerate(grp.layers):
            if not matches(pat, names):
                problems.at(root, ("parallelism", "groups", i, "layers", j),
                            f"pattern '{pat}' matches no layer" + did_you_mean(pat, names))


def _check_data(spec: Spec, root: LocDict, loaded: LoadedSpec, problems: Problems, base_dir: Path) -> None:
    data = spec.data
    inputs = {i.name: i for i in loaded.inputs()}
    files = (ArrayData, TableData, TextData, ParallelTextData, ImageData)
    if isinstance(data, files):
        for key in ("path", "validation", "target_path", "validation_target"):
            name = getattr(data, key, None)
            if name and not (base_dir / name).exists():
                problems.at(root, ("data", key), f"no such {'folder' if isinstance(data, ImageData) else 'file'}: "
                            f"{base_dir / name}")
            elif name and isinstance(data, ImageData) and not (base_dir / name).is_dir():
                problems.at(root, ("data", key), f"{base_dir / name} is not a folder (one sub-folder per class)")
    t = spec.training
    wants_eval = t.eval_every_steps or t.early_stopping or (spec.checkpoint and spec.checkpoint.keep_best)
    if wants_eval and isinstance(data, files) and not (data.validation or data.validation_fraction):
        problems.at(root, ("data",), "evaluation (training.eval_every_steps, early_stopping or checkpoint.keep_best) "
                    "needs validation data: set data.validation (a file) or data.validation_fraction")
    if wants_eval and spec.parallelism.strategy == "async_data_parallel":
        # Its replicas update one at a time from threads of their own: there is no step at which
        # the trainer could evaluate, keep the best or stop (they were dropped without a word).
        key = ("training", "eval_every_steps") if t.eval_every_steps else (
            ("training", "early_stopping") if t.early_stopping else ("checkpoint", "keep_best"))
        problems.at(root, key, "async_data_parallel does not evaluate (eval_every_steps, early_stopping, "
                    "checkpoint.keep_best): drop them, or use sync_data_parallel")
    if (t.early_stopping or (spec.checkpoint and spec.checkpoint.keep_best)) and not t.eval_every_steps:
        problems.at(root, ("training",), "early_stopping and checkpoint.keep_best judge evaluations: set "
                    "training.eval_every_steps")
    for key, rule in (("early_stopping", t.early_stopping), ("keep_best", spec.checkpoint and spec.checkpoint.keep_best)):
        if rule and rule.metric.removeprefix("val/") not in t.metrics:
            loc = ("training", "early_stopping", "metric") if key == "early_stopping" else ("checkpoint", "keep_best", "metric")
            problems.at(root, loc, f"'{rule.metric}' is not evaluated: training.metrics is "
                        f"{t.metrics} (write val/<metric> for one of them)")
    loss_type = loaded.layers[loaded.loss].layer.type if loaded.loss in loaded.layers else None
    # A loss layer that failed has said why; the metrics are judged once it builds.
    loss_failed = loss_type is None and any(layer.is_loss and layer.name not in loaded.layers
                                            for layer in spec.model.layers if isinstance(layer, Layer))
    for i, m in enumerate(t.metrics):
        if m in ("accuracy", "top5", "perplexity") and loss_type != "softmax_cross_entropy" and not loss_failed:
            problems.at(root, ("training", "metrics", i), f"metric {m} needs a softmax_cross_entropy loss, "
                        f"the model's loss is {loss_type or 'not set'}")
    if isinstance(data, ArrayData):
        for key in data.features:
            if key not in inputs:
                problems.at(root, ("data", "features", key), f"'{key}' is not a model input"
                            + did_you_mean(key, inputs) + f" (inputs: {', '.join(inputs)})", key=True)
    if isinstance(data, TableData):
        _check_table(data, root, inputs, problems, base_dir)
    if isinstance(data, ParallelTextData):
        for key, name in data.feeds.model_dump().items():
            per_example = () if key.endswith("lengths") else None
            if name not in inputs:
                problems.at(root, ("data", "feeds", key), f"'{name}' is not a model input" + did_you_mean(name, inputs))
                continue
            out = inputs[name].output
            if not out.dtype.startswith(("int", "uint")) or (out.shape[1:] != () if per_example == () else len(out.shape) != 2):
                problems.at(root, ("data", "feeds", key), f"'{name}' must be an integer model input of shape "
                            + ("[]" if per_example == () else "[steps]") + f", got {list(out.shape[1:])} {out.dtype}")
    if isinstance(data, ImageData):
        _check_images(data, root, inputs, problems, base_dir)
    if isinstance(data, TextData):
        ints = [n for n, i in inputs.items() if i.output.dtype.startswith(("int", "uint")) and n != data.lengths]
        if data.lengths is not None and (data.lengths not in inputs or inputs[data.lengths].output.shape[1:] != ()
                                         or not inputs[data.lengths].output.dtype.startswith(("int", "uint"))):
            problems.at(root, ("data", "lengths"), f"'{data.lengths}' must be a scalar integer model input "
                        f"(shape [], dtype int32)" + did_you_mean(data.lengths, inputs))
        for key, default in (("input", 0), ("target", 1)):
            name = getattr(data, key) or (ints[default] if len(ints) > default else None)
            if name is None:
                problems.at(root, ("data",), f"a text source needs two integer model inputs (tokens and "
                            f"next tokens); the model has {len(ints)}: {', '.join(ints) or 'none'}")
                return
            if name not in inputs:
                problems.at(root, ("data", key), f"'{name}' is not a model input" + did_you_mean(name, inputs))
                continue
            shape = inputs[name].output.shape
            if len(shape) != 2 or shape[1] is None:
                problems.at(root, ("data", key), f"text input '{name}' must have shape [unroll], got "
                            f"{list(shape[1:])}")
            classes = getattr(inputs[name].layer, "classes", None)
            if data.vocab_size and classes and data.vocab_size > classes:
                problems.at(root, ("data", "vocab_size"), f"vocab_size {data.vocab_size} exceeds input "
                            f"'{name}' classes {classes}")


def _check_table(data: TableData, root: LocDict, inputs: dict[str, LayerInfo], problems: Problems,
                 base_dir: Path) -> None:
    """Each named column in each file (its header or schema only: the data is read when the run
    starts), and the model's two inputs. The float input's width is checked here when every
    feature is numeric; one-hot blocks are as wide as the training split's vocabularies, known
    when the run learns them (`flowctl.training.inputs.run_table`)."""
    named = [(("data", "features", i), c) for i, c in enumerate(data.features)] + [(("data", "label"), data.label)]
    named += [(("data", "categorical", i), c) for i, c in enumerate(data.categorical)]
    pyarrow_module()  # without it, the one message naming the extra
    for key in ("path", "validation"):
        name = getattr(data, key)
        if not name or not (base_dir / name).exists():
            continue
        try:
            columns = table_columns(base_dir / name, data.format)
        except SpecError as e:
            problems.at(root, ("data", key), str(e))
            continue
        for loc, c in named:
            if c not in columns:
                problems.at(root, loc, f"no column '{c}' in {base_dir / name}" + did_you_mean(c, columns)
                            + f" (columns: {', '.join(columns)})")
    for i, c in enumerate(data.categorical):
        if c not in data.features:
            problems.at(root, ("data", "categorical", i), f"categorical column '{c}' is not one of data.features "
                        f"({', '.join(data.features)}): a categorical column is a feature, one-hot")
    seen: set[str] = set()
    for i, c in enumerate(data.features):
        if c in seen or c == data.label:
            problems.at(root, ("data", "features", i), f"column '{c}' is "
                        + ("listed twice" if c in seen else "the label: a model may not read its answer"))
        seen.add(c)
    floats = [i for i in inputs.values() if not i.output.dtype.startswith(("int", "uint"))]
    ints = [i for i in inputs.values() if i.output.dtype.startswith(("int", "uint"))]
    if len(floats) != 1 or len(floats[0].output.shape) != 2 or len(ints) != 1 or ints[0].output.shape[1:] != ():
        problems.at(root, ("data",), "a table source feeds two model inputs, a float input of shape [features] "
                    "and an integer label input of shape []; the model has "
                    + ", ".join(f"{i.name} {list(i.output.shape[1:])} {i.output.dtype}" for i in inputs.values()))
        return
    width = floats[0].output.shape[1]
    if not data.categorical and width != len(data.features):
        problems.at(root, ("data", "features"), f"{len(data.features)} feature columns feed input "
                    f"'{floats[0].name}' of shape [{width}]: make it [{len(data.features)}]")


def _check_images(data: ImageData, root: LocDict, inputs: dict[str, LayerInfo], problems: Problems,
                  base_dir: Path) -> None:
    """The image and label inputs an images source feeds, and its class sub-folders against the
    label input's classes."""
    def dtype(n: str) -> str:
        return inputs[n].output.dtype

    floats = [n for n in inputs if not dtype(n).startswith(("int", "uint")) and len(inputs[n].output.shape) == 4]
    ints = [n for n in inputs if dtype(n).startswith(("int", "uint"))]
    image, label = data.input or (floats[0] if floats else None), data.label or (ints[0] if ints else None)
    for key, name, what in (("input", image, "a float image input [H, W, C]"), ("label", label, "an integer label input")):
        if name is None:
            problems.at(root, ("data",), f"an images source needs {what}; the model's inputs are "
                        f"{', '.join(inputs) or 'none'}")
        elif name not in inputs:
            problems.at(root, ("data", key), f"'{name}' is not a model input" + did_you_mean(name, inputs))
    if image in inputs:
        shape = inputs[image].output.shape[1:]
        if len(shape) != 3 or shape[2] not in (1, 3) or dtype(image).startswith(("int", "uint")):
            problems.at(root, ("data", "input") if data.input else ("data",),
                        f"image input '{image}' must be float [H, W, 1 or 3], got {list(shape)} {dtype(image)}")
        else:
            for key in ("mean", "std"):
                if len(getattr(data, key)) not in (1, shape[2]):
                    problems.at(root, ("data", key), f"{key} takes 1 or {shape[2]} values (the channels of "
                                f"'{image}'), got {len(getattr(data, key))}")
    if label not in inputs:
        return
    if inputs[label].output.shape[1:] != () or not dtype(label).startswith(("int", "uint")):
        problems.at(root, ("data", "label") if data.label else ("data",), f"label input '{label}' must be an "
                    f"integer scalar (shape []), got {list(inputs[label].output.shape[1:])} {dtype(label)}")
    folder = base_dir / data.path
    classes = getattr(inputs[label].layer, "classes", None)
    if folder.is_dir() and classes is not None:
        found = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        if len(found) != classes:
            problems.at(root, ("data", "path"), f"{folder} has {len(found)} class sub-folder(s) "
                        f"({', '.join(found[:5])}{', ...' if len(found) > 5 else ''}), but input '{label}' "
                        f"takes {classes} classes")
