"""The spec schema (pydantic v2): every section of a run, unknown keys rejected.

A spec says everything about a run: the model, the data, the devices and their links, placement
constraints and colocation groups (§3.2.1, §4.3), the parallelism strategy (§7), training and
checkpoint settings (§3.3) and the cluster. The layer types live in `flowctl.spec.layers`; this
module assembles them into one discriminated union keyed by `type`. Checks that need more than one
section (batch arithmetic, device references, layer shapes) are in `flowctl.spec.check`.
"""
from __future__ import annotations

import math

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from flowctl.engine.devices import canonical
from flowctl.engine.errors import PlacementError
from flowctl.spec.layers import LAYERS, Layer, Strict

_SIZE = re.compile(r"^\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
          "ti": 1024**4, "tib": 1024**4}


def parse_bytes(v: Any) -> int:
    """`16GiB`, `80GB`, `512MiB` or a plain number of bytes."""
    if isinstance(v, bool):
        raise ValueError("a size must be a number of bytes or a string such as '16GiB'")
    if isinstance(v, (int, float)):
        return int(v)
    m = _SIZE.match(str(v))
    if not m:
        raise ValueError(f"cannot read size {v!r}: write e.g. 16GiB, 80GB or 1073741824")
    return int(float(m[1]) * _UNITS[(m[2] or "").lower()])


def canonical_device(v: str) -> str:
    try:
        return canonical(v)
    except PlacementError as e:
        raise ValueError(str(e)) from None


# ---------------------------------------------------------------------------- model
class BlockDef(Strict):
    """A parameterised group of layers, written once and instantiated many times (§10's proposed
    "function mechanism", at the spec level). `${name}` in any field is replaced by a parameter."""

    params: dict[str, Any] = Field(default_factory=dict,
                                   description="parameter -> default value; null means required")
    layers: list[dict[str, Any]] = Field(min_length=1)
    output: str | None = Field(None, description="the layer whose output is the block's (default: the last)")


class BlockUse(Strict):
    """An instantiation of a block: `repeat` copies chained one after the other."""

    name: str = Field(description="instance name; with repeat, instances are <name>_1, <name>_2, ... unless `names`")
    block: str = Field(description="a block defined under model.blocks")
    inputs: list[str] | None = Field(None, description="the layer feeding $input (default: the previous layer)")
    repeat: int = Field(1, ge=1, description="copies, each fed by the previous one's output")
    names: list[str] | None = Field(None, description="one name per copy")
    params: dict[str, Any] = Field(default_factory=dict, description="parameter values shared by all copies")
    each: list[dict[str, Any]] | None = Field(None, description="per-copy parameter values, one mapping per copy")


def _layer_tag(v: Any) -> str | None:
    if isinstance(v, dict):
        if "block" in v and "type" not in v:
            return "block"
        t = v.get("type")
        return t if isinstance(t, str) else None
    return getattr(v, "type", None)


if TYPE_CHECKING:  # the union is built from the registry at import time, which mypy cannot follow
    LayerEntry = Layer | BlockUse
else:
    LayerEntry = Annotated[
        Union[tuple(Annotated[cls, Tag(name)] for name, cls in LAYERS.items())
              + (Annotated[BlockUse, Tag("block")],)],
        Discriminator(_layer_tag),
    ]


class ModelSpec(Strict):
    name: str = "model"
    dtype: Literal["float32", "float64", "float16"] = Field("float32", description="dtype of weights, activations and float inputs")
    defaults: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="layer type -> field defaults applied to every layer of that type")
    blocks: dict[str, BlockDef] = Field(default_factory=dict)
    layers: list[LayerEntry] = Field(min_length=1, description="layers in order (a layer reads earlier layers only); an entry with `block:` instantiates a block")
    loss: str | None = Field(None, description="the layer whose output is the training loss "
                                                "(default: the last loss layer)")


# ---------------------------------------------------------------------------- data
class SyntheticData(Strict):
    source: Literal["synthetic"] = "synthetic"
    seed: int = Field(0, description="seeds the data stream (independent of training.seed)")
    task: Literal["random", "learnable"] = Field(
        "random", description="learnable: labels come from a fixed random linear teacher, so loss can fall")
    validation_batches: int = Field(16, ge=1, description="batches of a held-out stream (same teacher) to evaluate on")


class HeldOut(Strict):
    """Validation data for a file source: a second file, or the file's last fraction (which
    training then never reads)."""

    validation: str | None = Field(None, description="a validation file of the same kind as `path`")
    validation_fraction: float | None = Field(None, gt=0, lt=1, description="hold out this last fraction of `path`")

    @model_validator(mode="after")
    def _one(self) -> "HeldOut":
        if self.validation is not None and self.validation_fraction is not None:
            raise ValueError("give validation (a file) or validation_fraction, not both")
        return self


class ArrayData(HeldOut):
    source: Literal["arrays"]
    path: str = Field(description=".npz file, or a .npy file when the model has one input")
    features: dict[str, str] = Field(default_factory=dict,
                                     description="model input -> array name in the .npz (default: same name)")
    shuffle: bool = True
    seed: int = 0


class TableData(HeldOut):
    """A CSV or Parquet table (needs pip install 'flowctl[tables]'): one example per row. What the
    encoding learns (label classes, categorical vocabularies, numeric means and stds) comes from
    the training split and is kept as RUN/table.json."""

    source: Literal["table"]
    path: str = Field(description=".csv or .parquet file (or say which with format)")
    format: Literal["csv", "parquet"] | None = Field(None, description="the table's format (default: from the suffix)")
    features: list[str] = Field(min_length=1, description="columns feeding the model's float input, in order; "
                                "numeric ones standardised, categorical ones one-hot")
    label: str = Field(description="column feeding the model's integer input: its sorted values are classes 0, 1, ...")
    categorical: list[str] = Field(default_factory=list, description="feature columns whose values are categories: "
                                   "each a one-hot block as wide as its training split's distinct values")
    shuffle: bool = True
    seed: int = 0


class TextData(HeldOut):
    source: Literal["text"]
    path: str
    tokenizer: Literal["words", "bpe"] = Field(
        "words", description="words: split on whitespace, <eos> at line ends; bpe: byte-level BPE learned on "
        "path at the run's first start and kept as RUN/tokenizer.json (needs pip install 'flowctl[text]')")
    vocab_size: int | None = Field(None, ge=2, description="words: keep the most frequent words, others become "
                                   "<unk>; bpe: the BPE vocabulary (256 bytes and the merges; required)")
    input: str | None = Field(None, description="model input fed with token ids (default: first int input)")
    target: str | None = Field(None, description="model input fed with next-token ids (default: second int input)")
    lengths: str | None = Field(None, description="model input fed with each line's length: one line per "
                                "example, padded to the input's length (for lstm unroll: dynamic)")
    bucket: bool = Field(False, description="with lengths: batch lines of similar length together")
    seed: int = 0

    @model_validator(mode="after")
    def _bpe(self) -> "TextData":
        if self.tokenizer == "bpe":
            if self.vocab_size is None or self.vocab_size < 256:
                raise ValueError(f"tokenizer bpe needs vocab_size of at least 256 (the bytes, then the merges), "
                                 f"not {self.vocab_size}")
            if self.lengths is not None:
                raise ValueError("tokenizer bpe feeds a token stream; lengths (one line per example) reads words")
        return self


class ParallelFeeds(Strict):
    """Which model input each part of a sentence pair feeds."""

    source: str = Field(description="source ids, shape [steps]")
    source_lengths: str = Field(description="source length, shape []")
    target_in: str = Field(description="decoder input ids (<eos> first), shape [steps]")
    target_out: str = Field(description="decoder target ids (<eos> last), shape [steps]")
    target_lengths: str = Field(description="target length (words + 1), shape []")


class ParallelTextData(HeldOut):
    """Sentence pairs for translation: two files aligned line by line."""

    source: Literal["parallel_text"]
    path: str = Field(description="source-language sentences, one per line")
    target_path: str = Field(description="target-language sentences, line i translating line i of path")
    validation_target: str | None = Field(None, description="with validation: its target-language file")
    feeds: ParallelFeeds
    vocab_size: int | None = Field(None, ge=2, description="source vocabulary: the most frequent words")
    target_vocab_size: int | None = Field(None, ge=2, description="target vocabulary: the most frequent words")
    bucket: bool = Field(False, description="batch pairs of similar source length together")
    seed: int = 0

    @model_validator(mode="after")
    def _pair(self) -> "ParallelTextData":
        if (self.validation is None) != (self.validation_target is None):
            raise ValueError("held-out pairs need both validation (source) and validation_target")
        return self


class ImageData(HeldOut):
    """A folder of images, one sub-folder per class (ImageNet's layout); decoded with Pillow
    (pip install 'flowctl[images]') on worker processes."""

    source: Literal["images"]
    path: str = Field(description="a folder with one sub-folder of images per class; the classes are the sorted "
                      "sub-folder names, as many as the label input's classes (validation: a folder of the same layout)")
    input: str | None = Field(None, description="model input fed with images (default: the first float input [H, W, C])")
    label: str | None = Field(None, description="model input fed with class ids (default: the first int input)")
    resize: int | None = Field(None, ge=1, description="resize so the shorter side is this many pixels, then crop "
                               "to the input's H x W (default: the input's larger side)")
    crop: Literal["center", "random"] = Field("center", description="random: a random offset while training "
                                              "(validation is always centre-cropped)")
    flip: bool = Field(False, description="flip left to right with probability 1/2 while training")
    mean: list[float] = Field(default_factory=lambda: [0.0], min_length=1, max_length=3,
                              description="per channel (or one for all), subtracted from pixels scaled to [0, 1]")
    std: list[float] = Field(default_factory=lambda: [1.0], min_length=1, max_length=3,
                             description="per channel (or one for all), dividing after the mean")
    on_corrupt: Literal["error", "skip"] = Field("error", description="a file Pillow cannot read: error (one "
                                                 "error naming it), or skip (a warning naming it; left out)")
    workers: int | None = Field(None, ge=0, le=256, description="decoding processes (default: min(2, cores); "
                                "0: in the training process)")
    shuffle: bool = True
    seed: int = Field(0, description="the epochs' orders, and each example's crop and flip")

    @field_validator("std")
    @classmethod
    def _positive_std(cls, v: list[float]) -> list[float]:
        if not all(math.isfinite(x) and x > 0 for x in v):
            raise ValueError(f"std must be finite and > 0, got {v}")
        return v


DataSpec = Annotated[Union[SyntheticData, ArrayData, TableData, TextData, ParallelTextData, ImageData],
                     Field(discriminator="source")]


# ---------------------------------------------------------------------------- devices
class DeviceProfile(Strict):
    """Hardware that may not be present, for planning and simulation."""

    peak_flops: float | None = Field(None, gt=0, description="FLOP/s")
    memory_bandwidth: float | None = Field(None, gt=0, description="bytes/s")
    memory: int | None = Field(None, description="bytes, or a size such as 16GiB")

    @field_validator("memory", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return None if v is None else parse_bytes(v)


class Link(Strict):
    bandwidth: float = Field(gt=0, description="bytes/s")
    latency: float = Field(0.0, ge=0, description="seconds")


class DeviceSpec(Strict):
    name: str = Field(description="cpu:0, gpu:1, worker1/gpu:0 or a full /job:../task:../device:.. name")
    profile: DeviceProfile | None = Field(None, description="hardware figures for planning and simulation")
    links: dict[str, Link] = Field(default_factory=dict, description="peer device -> link")

    @field_validator("name")
    @classmethod
    def _canon(cls, v: str) -> str:
        return canonical_device(v)

    @field_validator("links")
    @classmethod
    def _canon_links(cls, v: dict[str, Link]) -> dict[str, Link]:
        return {canonical_device(k): link for k, link in v.items()}


def _device_entry(v: Any) -> Any:
    return {"name": v} if isinstance(v, str) else v


DeviceEntry = Annotated[DeviceSpec, Field(description="'cpu:0' or a mapping with name, profile, links")]


# ---------------------------------------------------------------------------- placement
class Constraint(Strict):
    """§4.3: nodes whose layer or node name matches `match` (a glob) go to `device`, which may be
    partial ('gpu' fixes the type only)."""

    match: str = Field(description="glob over layer names; a layer also matches the nodes under it")
    device: str = Field(description="a listed device, or a partial one such as 'gpu'")


class Transfers(Strict):
    """How tensors cross between devices (§5.2, §5.5)."""

    compress: Literal["none", "bf16"] = Field(
        "none", description="bf16: float32 tensors travel as their upper 16 bits, widened on arrival (§5.5, lossy)")
    receive: Literal["asap", "alap"] = Field(
        "asap", description="alap: a Recv starts as late as its consumers allow (§5.2), to hold less memory")


class PlacementSpec(Strict):
    algorithm: Literal["single", "expert", "greedy", "heft", "mincut", "learned", "auto"] = Field(
        "greedy", description="placer (§3.2.1 greedy; learned after Mirhoseini et al. 2017)")
    constraints: list[Constraint] = Field(default_factory=list)
    colocate: list[list[str]] = Field(default_factory=list,
                                      description="groups of globs whose nodes must share a device")
    time_budget_s: float = Field(60.0, gt=0, description="search budget for learned and auto")
    transfers: Transfers = Field(default_factory=lambda: Transfers.model_validate({}))


# ---------------------------------------------------------------------------- parallelism
class LayerGroup(Strict):
    layers: list[str] = Field(min_length=1, description="globs over layer names")
    device: str


class ParallelismSpec(Strict):
    strategy: Literal["single", "sync_data_parallel", "async_data_parallel", "model_parallel",
                      "pipeline"] = "single"
    replicas: int = Field(1, ge=1, description="data parallel: the replicas (default: one per listed device, "
                                                 "where they are of one kind)")
    devices: list[str] | None = Field(None, description="one device per replica")
    groups: list[LayerGroup] = Field(default_factory=list, description="model_parallel/pipeline stages")
    concurrent_steps: int = Field(1, ge=1, description="pipeline: steps in flight (Figure 9)")
    reduce: Literal["auto", "allreduce", "parameter_device"] = Field(
        "auto", description="sync_data_parallel: how the replicas' gradients meet. allreduce: every replica "
                            "holds the variables and the gradients are ring-all-reduced in buckets; "
                            "parameter_device: the variables live on the first replica's device, which "
                            "gathers the gradients (Figure 7); auto: allreduce where every replica can hold "
                            "the model and its optimizer state, and the precision is not fp16")
    bucket_mb: float = Field(25.0, gt=0, le=4096, allow_inf_nan=False,
                             description="allreduce: gradients are reduced in buckets of about this many MiB")

    @model_validator(mode="after")
    def _consistent(self) -> "ParallelismSpec":
        s = self.strategy
        if self.reduce != "auto" and s != "sync_data_parallel":
            raise ValueError(f"reduce: {self.reduce} is for strategy sync_data_parallel, not {s}")
        if s == "single" and self.replicas != 1:
            raise ValueError(f"strategy single runs 1 replica, but replicas is {self.replicas}")
        if s in ("sync_data_parallel", "async_data_parallel") and self.devices is not None \
                and len(self.devices) != self.replicas:
            raise ValueError(f"{s}: {len(self.devices)} device(s) listed for {self.replicas} replica(s)")
        if s in ("model_parallel", "pipeline") and not self.groups:
            raise ValueError(f"{s} needs `groups` assigning layers to devices")
        if s != "pipeline" and self.concurrent_steps != 1:
            raise ValueError(f"concurrent_steps {self.concurrent_steps} needs strategy pipeline, not {s}")
        return self


# ---------------------------------------------------------------------------- training
class Optimizer(Strict):
    type: Literal["sgd", "momentum", "adam", "adamw"] = Field(
        "sgd", description="optimizer; its slots are Variables and so checkpointed. adamw: Adam with decoupled "
                           "weight decay (torch.optim.AdamW): var -= lr * weight_decay * var, then Adam's step")
    momentum: float = Field(0.9, ge=0, lt=1)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    epsilon: float = Field(1e-8, gt=0, description="adam, adamw: added to sqrt(v) (TensorFlow's form; PyTorch's "
                                                    "eps is this over sqrt(1 - beta2^t))")
    weight_decay: float = Field(0.01, ge=0, allow_inf_nan=False,
                                description="adamw: the decoupled decay's rate, times the learning rate each step")
    decay_exclude: list[str] = Field(
        default_factory=lambda: ["*/bias", "*/gamma", "*/beta"],
        description="adamw: globs over variable names (layer/weight, e.g. hidden/kernel) that take no weight "
                    "decay; the default excludes biases and normalisation scales and offsets (names ending "
                    "/bias, /gamma, /beta). Each glob must match a trainable variable")


class Schedule(Strict):
    schedule: Literal["constant", "step", "exponential", "cosine", "piecewise"] = "constant"
    initial: float = Field(0.01, gt=0, allow_inf_nan=False)
    decay_rate: float | None = Field(None, gt=0, allow_inf_nan=False)
    decay_steps: int | None = Field(None, ge=1)
    boundaries: list[int] = Field(default_factory=list)
    values: list[float] = Field(default_factory=list)
    warmup_steps: int = Field(0, ge=0, description="linear warm-up: step s < warmup_steps runs at (s+1)/warmup_steps "
                                                   "of the schedule's rate at s (a ramp from ~0), with every schedule "
                                                   "kind; the schedule's own steps count from 0, not from the ramp's end")

    @model_validator(mode="after")
    def _consistent(self) -> "Schedule":
        if self.schedule in ("step", "exponential") and (self.decay_rate is None or self.decay_steps is None):
            raise ValueError(f"schedule {self.schedule} needs decay_rate and decay_steps")
        if self.schedule == "cosine" and self.decay_steps is None:
            raise ValueError("schedule cosine needs decay_steps")
        if self.schedule == "piecewise":
            bad = [v for v in self.values if not (math.isfinite(v) and v > 0)]
            if bad:
                raise ValueError(f"piecewise values must be finite and > 0, got {bad[0]}")
            if len(self.values) != len(self.boundaries) + 1:
                raise ValueError(f"piecewise needs one more value than boundaries: {len(self.boundaries)} "
                                 f"boundaries, {len(self.values)} values")
            if sorted(self.boundaries) != self.boundaries:
                raise ValueError(f"piecewise boundaries must increase: {self.boundaries}")
        return self


Metric = Literal["loss", "accuracy", "top5", "perplexity"]


class EarlyStopping(Strict):
    metric: str = Field("val/loss", description="an evaluated metric: val/loss, val/accuracy, val/top5, val/perplexity")
    mode: Literal["min", "max"] = "min"
    patience: int = Field(3, ge=1, description="evaluations without improvement before training stops")
    min_delta: float = Field(0.0, ge=0, description="an improvement smaller than this does not count")


class LossScale(Strict):
    """Dynamic loss scaling (fp16): the loss is multiplied by the scale before the gradients; a step
    with a non-finite gradient is skipped and halves the scale; `growth_interval` finite steps in a
    row double it."""

    initial: float = Field(65536.0, gt=0, description="the scale of the first step")
    growth_interval: int = Field(2000, ge=1, description="finite steps in a row before the scale doubles")


class TrainingSpec(Strict):
    optimizer: Optimizer = Field(default_factory=lambda: Optimizer.model_validate({}))
    learning_rate: float | Schedule = Field(0.01, description="a constant, or a schedule mapping")
    batch_size: int | None = Field(None, ge=1, description="global batch (all replicas together)")
    per_replica_batch_size: int | None = Field(None, ge=1)
    steps: int = Field(100, ge=0, description="training steps to run")
    accumulate: int = Field(1, ge=1, description="gradient accumulation (strategy single): each step runs K "
                                                 "micro-batches of batch_size / K examples one after another, "
                                                 "sums their gradients and applies one update, as one step on "
                                                 "the whole batch of a mean loss with one micro-batch's memory")
    clip_norm: float | None = Field(None, gt=0, description="clip gradients to this global norm")
    clip_value: float | None = Field(None, gt=0, description="clip each gradient element to ±value")
    seed: int = Field(0, description="graph seed: every random op's stream derives from it and its node name")
    log_every_steps: int = Field(10, ge=1)
    eval_every_steps: int | None = Field(None, ge=1, description="evaluate on the validation data every N steps")
    metrics: list[Metric] = Field(default_factory=lambda: list[Metric](["loss"]),
                                  description="what evaluation reports (accuracy, top5: classifiers; perplexity: "
                                              "language models)")
    early_stopping: EarlyStopping | None = None
    fuse: bool = Field(False, description="fuse chains of element-wise ops into one node each (bias+ReLU, gate "
                                          "math, optimizer updates): the same values, fewer kernels and bytes")
    precision: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32", description="compute precision: fp16 and bf16 keep float32 master variables; fp16 computes the "
                            "layers in float16 with dynamic loss scaling, bf16 in bfloat16 (each op computing in "
                            "float32 and rounding what it stores, as GPU tensor cores do)")
    loss_scale: LossScale = Field(default_factory=lambda: LossScale.model_validate({}),
                                  description="fp16's dynamic loss scaling")
    allow_tf32: bool = Field(True, description="float32 products on a GPU (matmuls, convolutions) as TF32 "
                                               "tensor-core products, as cuDNN computes them: 10 mantissa bits "
                                               "in the product inputs, float32 accumulation; false: IEEE "
                                               "float32 products. No effect on a CPU; a GPU run records it in "
                                               "run.json (fp32_products)")

    @field_validator("learning_rate")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        if isinstance(v, float) and not (math.isfinite(v) and v > 0):
            raise ValueError(f"learning_rate must be finite and > 0, got {v}")
        return v


# ---------------------------------------------------------------------------- checkpoint, cluster
class KeepBest(Strict):
    metric: str = Field("val/loss", description="an evaluated metric")
    mode: Literal["min", "max"] = "min"
    count: int = Field(1, ge=1, description="the K best evaluations' checkpoints kept, ranked "
                                            "(checkpoints/best/ranking.json); a tie keeps the earlier")


class CheckpointSpec(Strict):
    every_steps: int | None = Field(None, ge=1)
    every_seconds: float | None = Field(None, gt=0)
    keep: int = Field(3, ge=1, description="checkpoints kept; older ones are deleted")
    keep_best: KeepBest | None = Field(None, description="also keep the checkpoints with the best evaluated "
                                                         "metric (count of them), apart from the rolling ones")


_RAY_ADDRESS = re.compile(r"^(auto|ray://[\w.-]+:\d+|[\w.-]+:\d+)$")


class ClusterSpec(Strict):
    type: Literal["local", "ray"] = Field("local", description="local: one process; ray: a worker actor per task")
    address: str | None = Field(None, description="Ray: 'auto' or 'ray://host:10001' joins a running cluster; "
                                                  "none starts a local one")
    workers: int = Field(0, ge=0, description="Ray: worker tasks to start when address is local")
    max_failures: int = Field(3, ge=0, description="Ray: lost workers restarted (restoring the last checkpoint) "
                                                    "before the run ends")
    resources: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="Ray: extra resources a task's actor asks for, pinning it to nodes "
                                          "that have them (`worker1: {gpu_box: 1}`)")

    @field_validator("resources")
    @classmethod
    def _tasks(cls, v: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for key, res in v.items():
            if not re.fullmatch(r"worker\d+", key):
                raise ValueError(f"resources are keyed by worker task ('worker0', 'worker1', ...), not {key!r}")
            bad = [k for k, amount in res.items() if amount <= 0]
            if bad:
                raise ValueError(f"{key}: resource amounts must be > 0 ({bad[0]}: {res[bad[0]]})")
        return v

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not _RAY_ADDRESS.match(v):
            raise ValueError(f"cannot read Ray address {v!r}: write 'auto', 'ray://HOST:10001' or 'HOST:6379'")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterSpec":
        if self.type == "local" and (self.address is not None or self.workers or self.max_failures != 3
                                     or self.resources):
            raise ValueError("a local cluster takes no address, workers, max_failures or resources (set type: ray)")
        return self


# ---------------------------------------------------------------------------- tracking
class MLflowTracking(Strict):
    """Log the run to MLflow (flowctl.training.tracking; needs pip install 'flowctl[mlflow]')."""

    tracking_uri: str | None = Field(None, min_length=1, description="an MLflow tracking URI (sqlite:///PATH.db, "
                                     "http://HOST:5000, ...); default: MLflow's own (MLFLOW_TRACKING_URI, else "
                                     "MLflow 3's sqlite:///mlflow.db in the current directory, its artifacts in "
                                     "./mlruns)")
    experiment: str | None = Field(None, min_length=1, max_length=500,
                                   description="the MLflow experiment (default: the spec's name)")
    run_name: str | None = Field(None, min_length=1, description="the MLflow run's name (default: the run "
                                                                 "directory's name)")


class TrackingSpec(Strict):
    """Where else a run is recorded, beside its run directory. Never part of the spec's hash: it
    changes nothing a run computes, so adding it to a run, or changing it, is no spec change."""

    mlflow: MLflowTracking | None = Field(None, description="params, metrics per step and the final "
                                                            "checkpoint to an MLflow run ({} for the defaults)")


# ---------------------------------------------------------------------------- the whole spec
class Spec(Strict):
    version: Literal[1] = Field(description="spec format version; this flowctl reads 1")
    name: str | None = None
    description: str | None = None
    model: ModelSpec
    data: DataSpec = Field(default_factory=lambda: SyntheticData.model_validate({}))
    devices: list[DeviceEntry] = Field(default_factory=lambda: [DeviceSpec.model_validate({"name": "cpu:0"})])
    placement: PlacementSpec = Field(default_factory=lambda: PlacementSpec.model_validate({}))
    parallelism: ParallelismSpec = Field(default_factory=lambda: ParallelismSpec.model_validate({}))
    training: TrainingSpec = Field(default_factory=lambda: TrainingSpec.model_validate({}))
    checkpoint: CheckpointSpec | None = None
    cluster: ClusterSpec = Field(default_factory=lambda: ClusterSpec.model_validate({}))
    tracking: TrackingSpec | None = Field(None, description="experiment tracking (MLflow)")

    @field_validator("devices", mode="before")
    @classmethod
    def _short_devices(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [_device_entry(x) for x in v]
        return v

    @model_validator(mode="after")
    def _replicas_from_devices(self) -> "Spec":
        """Data parallel with neither `replicas` nor `parallelism.devices`: one replica per listed
        device, as data-parallel tools default, where they are all of one kind; with mixed kinds
        (a CPU beside GPUs) the spec must say which devices hold replicas."""
        par = self.parallelism
        if par.strategy not in ("sync_data_parallel", "async_data_parallel") or par.devices is not None \
                or "replicas" in par.model_fields_set or len(self.devices) < 2:
            return self
        kinds = {d.name.rsplit("device:", 1)[-1].split(":")[0] for d in self.devices}
        if len(kinds) > 1:
            raise ValueError(f"{par.strategy}: the devices are of {len(kinds)} kinds ({', '.join(sorted(kinds))}); "
                             f"say which hold replicas: parallelism.replicas, or parallelism.devices")
        par.replicas = len(self.devices)
        return self


def json_schema() -> dict[str, Any]:
    return Spec.model_json_schema()


__all__ = ["BlockDef", "BlockUse", "ModelSpec", "Spec", "json_schema", "parse_bytes"]
