"""`flowctl bench strategies`: what each parallelism strategy (whitepaper §7) buys on this machine,
as examples/s ratios on 2 virtual CPU devices measured in one run."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

from flowctl.spec.check import LoadedSpec
from flowctl.spec.loader import load_text
from flowctl.training.inputs import make_sources
from flowctl.training.program import open_program

SPECS = Path(__file__).resolve().parent / "specs"


def _with(text: str, **sections: Any) -> LoadedSpec:
    """The spec `text` with top-level sections replaced (devices, parallelism, training keys)."""
    d = yaml.safe_load(text)
    for key, value in sections.items():
        if key == "training":
            d.setdefault("training", {}).update(value)
        else:
            d[key] = value
    return load_text(yaml.safe_dump(d, sort_keys=False), filename="<benchmark>")


def timed_block(p: Any, src: Any, steps: int, before: Callable[[int], None] | None = None) -> list[float]:
    """One block of a program's training steps: an untimed one, then `steps` timed ones; their
    seconds. `before(i)` is told each step's index first (progress)."""
    train = p.step.train
    assert train is not None
    out = []
    for i in range(steps + 1):
        if before is not None:
            before(i)
        feeds = train.feeds(src.next_batch())
        feeds[p.step.lr] = np.asarray(0.01, dtype=p.step.lr.dtype)
        t0 = time.perf_counter()
        p.session.run([train.loss, train.train_op], feeds)
        if i:
            out.append(time.perf_counter() - t0)
    return out


def _measure(programs: dict[str, LoadedSpec], steps: int, progress: Callable[[str], None],
             rounds: int = 2, limits: dict[str, int | None] | None = None,
             blocks: dict[str, tuple[Callable[[int], list[float]], int]] | None = None) -> dict[str, Any]:
    """Build each program, then time them in blocks, A B A B (`rounds` blocks each): one untimed
    step, then `steps` timed ones. Blocks rather than alternating single steps because a program
    that ran BLAS on all cores leaves OpenBLAS worker threads spinning for a while, which would slow
    whichever program runs right after it; blocks repeated in turn still share the machine's
    drift. examples/s from the median step time, and each round's. `limits`: a program's BLAS
    threads in this process (default: its devices' share of the cores, or all of them). `blocks`:
    rows timed by a function of their own, in turn after the programs: name -> (a function that
    runs one block of `steps` timed steps and returns their seconds, the examples of one step)."""
    from threadpoolctl import threadpool_limits

    built = {}
    times: dict[str, list[list[float]]] = {name: [] for name in programs}
    try:
        for name, loaded in programs.items():
            progress(f"{name}: building")
            p = open_program(loaded)
            built[name] = (p, make_sources(loaded, 1, p.step.batch)[0])
            p.session.run(p.step.init)
        for r in range(rounds):
            for name, (p, src) in built.items():
                # Distributed: each device thread's BLAS gets its share of the cores (runtime.blas_limits).
                limit = max(d.threads for d in p.cluster.devices) if p.cluster is not None else None
                with threadpool_limits(limits=(limits or {}).get(name, limit), user_api="blas"):
                    times[name].append(timed_block(p, src, steps, lambda i: progress(
                        f"{name}: round {r + 1}/{rounds}, step {i}/{steps}")))
            for name, (run_block, _) in (blocks or {}).items():
                progress(f"{name}: round {r + 1}/{rounds}")
                times.setdefault(name, []).append(run_block(steps))
    finally:
        for p, _ in built.values():
            p.close()

    def figure(name: str) -> dict[str, Any]:
        b = built[name][0].step.batch if name in built else (blocks or {})[name][1]
        every = [t for ts in times[name] for t in ts]
        return {"examples_per_s": b / statistics.median(every), "step_s": statistics.median(every), "batch": b,
                "rounds_examples_per_s": [b / statistics.median(ts) for ts in times[name]]}

    return {name: figure(name) for name in times}


def strategy_benchmarks(steps: int = 5, lstm_lm: str | Path | None = None,
                        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measured ratios on 2 virtual CPU devices (this machine's cores split between them, each
    device's BLAS limited to its share as the runtime prescribes; `single` keeps all the cores),
    each from one run that times the sides in turn (`_measure`) so they see the same machine load:
      sync_lstm_lm: examples/s of sync_data_parallel (2 replicas, global batch 20) over single
        (batch 20) on specs/lstm_lm.yaml;
      sync_conv: the same on a small CIFAR-sized conv net (batch 64);
      pipeline_lstm4: pipeline over model_parallel on a 4-layer LSTM (256 units, batch 32) with
        the embedding and layers 1-2 on cpu:0, layers 3-4 and the softmax on cpu:1: `ratio` with
        2 micro-batches, `ratio_4` with 4.
    `steps` timed steps per side per round, two rounds (examples/s from the median step)."""
    say = progress or (lambda m: None)
    path = Path(lstm_lm) if lstm_lm else Path(__file__).resolve().parents[2] / "specs" / "lstm_lm.yaml"
    conv = (SPECS / "small_conv.yaml").read_text()
    lstm4 = (Path(__file__).resolve().parents[2] / "specs" / "lstm4.yaml").read_text()
    lm = path.read_text()
    two = ["cpu:0", "cpu:1"]
    sync = {"strategy": "sync_data_parallel", "replicas": 2}
    out: dict[str, Any] = {"devices": 2, "cores": os.cpu_count(), "steps": steps}
    for key, text in (("sync_lstm_lm", lm), ("sync_conv", conv)):
        r = _measure({"single": _with(text, devices=two),
                      "sync_data_parallel": _with(text, devices=two, parallelism=sync)}, steps, say)
        out[key] = {**r, "ratio": r["sync_data_parallel"]["examples_per_s"] / r["single"]["examples_per_s"]}
    groups = [{"layers": ["embedding", "lstm_1", "lstm_2"], "device": "cpu:0"},
              {"layers": ["lstm_3", "lstm_4", "softmax", "loss"], "device": "cpu:1"}]

    def pipe(k: int) -> LoadedSpec:
        return _with(lstm4, devices=two, parallelism={"strategy": "pipeline", "groups": groups,
                                                           "concurrent_steps": k})

    r = _measure({"model_parallel": _with(lstm4, devices=two,
                                          parallelism={"strategy": "model_parallel", "groups": groups}),
                  "pipeline": pipe(2), "pipeline_4": pipe(4)}, steps, say)
    mp = r["model_parallel"]["examples_per_s"]
    out["pipeline_lstm4"] = {**r, "ratio": r["pipeline"]["examples_per_s"] / mp,
                             "ratio_4": r["pipeline_4"]["examples_per_s"] / mp}
    return out


__all__ = ["strategy_benchmarks"]
