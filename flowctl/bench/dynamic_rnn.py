"""lstm_lm with `unroll: dynamic` (a while loop over time, §4.4) beside the static unroll: graph
size and the time of one forward+backward step, measured in one process, the two alternating.

    .venv/bin/python -m flowctl.bench.dynamic_rnn [--reps 5] [--batch 20] [--steps 35]

Prints one JSON object (stdout). Times are medians of `reps` steps after one warm-up step each,
wall-clock and this process's CPU seconds.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import numpy as np

import flowctl as fc
from flowctl.spec.loader import load_text
from flowctl.spec.model import build_model

SPEC = Path(__file__).resolve().parents[2] / "specs" / "lstm_lm.yaml"


def build(unroll: str, steps: int, batch: int) -> tuple[fc.Session, list, dict, dict]:
    text = SPEC.read_text().replace("type: lstm,", f"type: lstm, unroll: {unroll},")
    text = re.sub(r"shape: \[35\]", f"shape: [{steps}]", text)
    model = build_model(load_text(text, str(SPEC), SPEC.parent))
    forward = len(model.graph)
    lstm_nodes = len(model.layer_nodes["lstm_1"])
    with model.graph.as_default():
        grads = fc.gradients(model.loss, model.trainable_variables())
    sess = fc.Session(model.graph)
    sess.run(model.initializer())
    rng = np.random.default_rng(0)
    feeds = {model.inputs[k]: rng.integers(0, 10000, (batch, steps)).astype(np.int32) for k in ("tokens", "targets")}
    sizes = {"forward_nodes": forward, "lstm_layer_nodes": lstm_nodes, "nodes_with_gradients": len(model.graph)}
    return sess, [model.loss] + grads, feeds, sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--steps", type=int, default=35)
    args = ap.parse_args()
    runs = {u: build(u, args.steps, args.batch) for u in ("static", "dynamic")}
    times: dict[str, list[float]] = {u: [] for u in runs}
    cpu: dict[str, list[float]] = {u: [] for u in runs}
    losses = {}
    for u, (sess, fetch, feeds, _) in runs.items():
        losses[u] = float(sess.run(fetch, feeds)[0])  # warm-up (plans compiled)
    for _ in range(args.reps):
        for u, (sess, fetch, feeds, _) in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            sess.run(fetch, feeds)
            times[u].append(time.perf_counter() - t0)
            cpu[u].append(time.process_time() - c0)
    out = {u: {**runs[u][3], "step_s_median": statistics.median(times[u]), "step_s_min": min(times[u]),
               "step_s_all": times[u],
               "cpu_s_median": statistics.median(cpu[u]), "first_loss": losses[u]} for u in runs}
    out["dynamic_over_static"] = out["dynamic"]["step_s_median"] / out["static"]["step_s_median"]
    # The fastest step of each: the one least disturbed by other work on a shared machine.
    out["dynamic_over_static_min"] = out["dynamic"]["step_s_min"] / out["static"]["step_s_min"]
    # CPU seconds of this process: steadier than wall time on a machine other work shares.
    out["dynamic_over_static_cpu"] = out["dynamic"]["cpu_s_median"] / out["static"]["cpu_s_median"]
    out["config"] = vars(args)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
