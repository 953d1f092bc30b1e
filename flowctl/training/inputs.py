"""The data a training program reads: one source of the step's batch, or one per replica for
`async_data_parallel` (§7, Figure 7 bottom: each replica reads its own stream)."""
from __future__ import annotations

import numpy as np

from flowctl.data import DataSource, InputSpec, make_source
from flowctl.spec.check import LoadedSpec


def model_inputs(loaded: LoadedSpec) -> list[InputSpec]:
    return [InputSpec(i.name, tuple(i.output.shape[1:]), i.output.dtype, getattr(i.layer, "classes", None))
            for i in loaded.inputs()]


def make_sources(loaded: LoadedSpec, replicas: int, batch: int) -> list[DataSource]:
    """One source of `batch` examples per replica (one for the synchronous strategies). Replica
    k > 0 reads its own stream, seeded by its index: synthetic data draws from the generator
    [seed, k] (the learnable task's teacher stays the spec's), shuffled arrays use seed + k, and
    ordered arrays and text start k/N of the way into the epoch."""
    cfg = loaded.spec.data.model_dump()
    inputs = model_inputs(loaded)
    out = []
    for k in range(replicas):
        c = dict(cfg)
        kind = c.get("source", "synthetic")
        if k and kind == "arrays" and c.get("shuffle", True):
            c["seed"] = int(c.get("seed", 0)) + k
        src = make_source(c, inputs, batch, base_dir=loaded.base_dir)
        if k and kind == "synthetic":
            src.rng = np.random.default_rng([int(c.get("seed", 0)), k])
        elif k and hasattr(src, "batches_per_epoch") and not (kind == "arrays" and c.get("shuffle", True)):
            src.position = k * int(src.batches_per_epoch) // replicas  # type: ignore[attr-defined]
        out.append(src)
    return out


__all__ = ["make_sources", "model_inputs"]
