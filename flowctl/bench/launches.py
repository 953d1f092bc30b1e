"""`flowctl bench launches`: what a GPU training step asks of the host, counted on any machine.

Each row's training step runs in a GPU session whose array module is the launch ledger
(`kernels/ledger.py`: numpy standing in for cupy, counting what the GPU module would do), with its
steps captured as on a GPU: two eager warm-up steps, the capture, then replays. Per step: kernel
launches from Python (numba kernels of ours among them), host synchronisations, host-to-device
copies and new device allocations (the pool modelled block by block), and the captured graph's
kernel count. Our numba kernels are counted but not run (numba's simulator would take hours at
full size), so the values are not the model's; the counts are, as none of the step's kernels
branches on data. cuDNN is not modelled: its convolutions count as the generic kernels' launches.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

from flowctl.bench.peers import ROWS, Row, _batch, _load, flowctl_step
from flowctl.engine.errors import FlowctlError

# Launch counts do not depend on the batch (a GPU kernel covers the whole batch): a small one keeps
# the CPU's numpy work short.
BATCH = {"inception_v3_b32": 2, "inception_v3_b8": 2}
PHASES = ("warm-up", "rehearsal", "capture", "replay")


def count_step(row: Row, steps: int = 5, precision: str = "fp32") -> dict[str, Any]:
    """Counts per phase of `row`'s training step on the ledger, at `training.precision`."""
    from flowctl.kernels.ledger import Ledger
    from flowctl.kernels.registry import override_array_module

    ledger = Ledger(run_kernels=False)
    loaded = _load(row, () if precision == "fp32" else (f"training.precision={precision}",))
    arrays = _batch(loaded, row.batch)
    counts = []
    with override_array_module("gpu", ledger):
        step = flowctl_step(loaded, arrays, row.train, "gpu:0", capture=True)
        for _ in range(max(steps, 4)):
            ledger.reset_counts()
            step()
            counts.append(dict(ledger.counts))
        report = step.session.capture_report()
    plan = max(report["plans"], key=lambda p: p["captured_steps"] + p["eager_steps"])
    keys = ("launches", "custom", "syncs", "h2d", "allocations", "graph_launches")
    phases = {name: {k: counts[i].get(k, 0) for k in keys} for i, name in enumerate(PHASES)}
    return {"batch": row.batch, "precision": precision,
            "nodes": len(step.session.plan_for(step.fetch, step.feeds).nodes),
            "captured": plan["captured"], "reason": plan["reason"], "graph_nodes": plan["graph_nodes"],
            "phases": phases}


def launches_suite(rows: Sequence[str] | None = None, progress: Callable[[str], None] | None = None,
                   precision: str = "fp32") -> dict[str, Any]:
    """`precision`: the rows' `training.precision` (bf16 and fp16 count the casts and, for a
    bfloat16 op whose kernel does not take bfloat16 as it is, the widening and rounding around it)."""
    say = progress or (lambda _m: None)
    out: dict[str, Any] = {"rows": {}}
    for name in rows or ("lstm_lm", "inception_v3_b32"):
        if name not in ROWS:
            raise FlowctlError(f"bench launches: no row named '{name}'; rows: {', '.join(ROWS)}")
        row = ROWS[name]
        row = replace(row, batch=BATCH.get(name, row.batch))
        say(f"{name}: counting a captured step's launches on the ledger")
        out["rows"][name] = count_step(row, precision=precision)
    return out
