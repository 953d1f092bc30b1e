"""The data a training program reads: one source of the step's batch, or one per replica for
`async_data_parallel` (§7, Figure 7 bottom: each replica reads its own stream); and what a run
learns from its data at its first start and keeps in the run directory: a text source's byte-level
BPE, a table's encoding (classes, vocabularies, means and stds)."""
from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np

from flowctl.data import ByteBPE, DataSource, InputSpec, TableEncoding, learn_table, learn_tokenizer, make_source
from flowctl.engine.errors import CheckpointError, SpecError
from flowctl.spec.check import LoadedSpec
from flowctl.training.rundir import RunDir

TOKENIZER = "tokenizer.json"
TABLE = "table.json"


def model_inputs(loaded: LoadedSpec) -> list[InputSpec]:
    return [InputSpec(i.name, tuple(i.output.shape[1:]), i.output.dtype, getattr(i.layer, "classes", None))
            for i in loaded.inputs()]


T = TypeVar("T")


def _kept(run: RunDir, name: str, what: str, learn: Callable[[], T], load: Callable[[str], T]) -> T:
    """What a run learns from its data at its first start and keeps as RUN/`name`: a run being
    started (no run.json yet) learns it and writes the file atomically; a started run (resume,
    evaluate, predict, export) reads the file and never learns again, so ids and features keep
    their meaning even if the data changes. Missing or damaged: a CheckpointError naming `what`."""
    path = run.path / name
    if not run.exists():
        value = learn()
        run.write_text(name, value.to_json())  # type: ignore[attr-defined]
        return value
    try:
        text = run.inside(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the run's {what} is kept there from its first start, "
                              f"and learning it again from the data could give it another meaning") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})") from None
    try:
        return load(text)
    except ValueError as e:
        raise CheckpointError(f"{path}: damaged, not a {what} ({e})") from None


def run_tokenizer(loaded: LoadedSpec, run: RunDir) -> ByteBPE | None:
    """The byte-level BPE of a run whose spec asks for one (`data.tokenizer: bpe`), else None,
    kept as RUN/tokenizer.json (`_kept`)."""
    cfg = loaded.spec.data.model_dump()
    if cfg.get("source") != "text" or cfg.get("tokenizer") != "bpe":
        return None
    return _kept(run, TOKENIZER, "byte-level BPE", lambda: learn_tokenizer(cfg, loaded.base_dir), ByteBPE.from_json)


def run_table(loaded: LoadedSpec, run: RunDir) -> TableEncoding | None:
    """The encoding of a run whose spec reads a table, else None: learned from the training split
    and kept as RUN/table.json (`_kept`). A width the model's input cannot take is a located spec
    error at data.features."""
    cfg = loaded.spec.data.model_dump()
    if cfg.get("source") != "table":
        return None
    def learn() -> TableEncoding:
        return _check_fits(loaded, learn_table(cfg, loaded.base_dir))  # before it is written

    return _check_fits(loaded, _kept(run, TABLE, "table encoding", learn, TableEncoding.from_json))


def _check_fits(loaded: LoadedSpec, table: TableEncoding) -> TableEncoding:
    problem = table.problem(model_inputs(loaded))
    if problem:
        where = loaded.where(("data", "features"))
        raise SpecError(f"{where + ': ' if where else ''}data.features: {problem}")
    return table


def make_sources(loaded: LoadedSpec, replicas: int, batch: int, tokenizer: ByteBPE | None = None,
                 table: TableEncoding | None = None,
                 on_warning: Callable[[str], None] | None = None) -> list[DataSource]:
    """One source of `batch` examples per replica (one for the synchronous strategies). Replica
    k > 0 reads its own stream, seeded by its index: synthetic data draws from the generator
    [seed, k] (the learnable task's teacher stays the spec's), shuffled arrays and images use seed + k, and
    ordered arrays and text start k/N of the way into the epoch. `tokenizer`: a bpe text source's
    (`run_tokenizer`); without it each source learns its own from the corpus. `table`: a table
    source's encoding (`run_table`), likewise. `on_warning`: where an images source reports a file
    it leaves out (default: Python's warnings)."""
    cfg = loaded.spec.data.model_dump()
    inputs = model_inputs(loaded)
    out = []
    for k in range(replicas):
        c = dict(cfg)
        kind = c.get("source", "synthetic")
        shuffled = kind in ("arrays", "table", "images") and c.get("shuffle", True)
        if k and shuffled:
            c["seed"] = int(c.get("seed", 0)) + k
        src = make_source(c, inputs, batch, base_dir=loaded.base_dir, tokenizer=tokenizer, table=table,
                          on_warning=on_warning)
        if k and kind == "synthetic":
            src.rng = np.random.default_rng([int(c.get("seed", 0)), k])
        elif k and hasattr(src, "batches_per_epoch") and not shuffled:
            src.position = k * int(src.batches_per_epoch) // replicas  # type: ignore[attr-defined]
        out.append(src)
    return out


__all__ = ["TABLE", "TOKENIZER", "make_sources", "model_inputs", "run_table", "run_tokenizer"]
