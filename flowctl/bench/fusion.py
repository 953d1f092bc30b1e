"""`flowctl bench fusion`: a training step with element-wise fusion (training.fuse) against the same
step without it, on this process's CPU, and how many nodes fusion removes.

The two steps take turns in one process, round by round (the machine is shared and noisy, so the
figure is the ratio of medians taken side by side). Steps run at learning rate 0, so the variables
stay where they are and every timed step does the same work.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable

import flowctl as fc
from flowctl.engine.fusion import fused_nodes
from flowctl.spec.loader import load_spec, load_text
from flowctl.spec.model import build_model
from flowctl.training.measure import step_feeds, timed_block
from flowctl.training.program import build_step, step_config

ROOT = Path(__file__).resolve().parents[2]

# A small convnet: conv + batch norm + ReLU twice, a dense head; momentum and gradient clipping add
# the optimizer's element-wise chains.
CONVNET = """\
version: 1
name: convnet
model:
  layers:
    - {name: x, type: input, shape: [32, 32, 3]}
    - {name: c1, type: conv2d, filters: 16, kernel: 3, padding: same, batch_norm: true, activation: relu}
    - {name: p1, type: max_pool, pool: 2}
    - {name: c2, type: conv2d, filters: 32, kernel: 3, padding: same, batch_norm: true, activation: relu}
    - {name: flat, type: flatten}
    - {name: h, type: dense, units: 64, activation: relu}
    - {name: logits, type: dense, units: 10}
    - {name: y, type: input, shape: [], dtype: int32, classes: 10}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: synthetic, seed: 0}
training:
  optimizer: {type: momentum}
  batch_size: 32
  clip_norm: 5.0
"""


def _load(name: str, fuse: bool) -> Any:
    flag = [f"training.fuse={'true' if fuse else 'false'}"]
    if name == "convnet":
        return load_text(CONVNET, filename="convnet.yaml", overrides=flag)
    return load_spec(ROOT / "specs" / f"{name}.yaml", flag)


def _opened(loaded: Any) -> tuple[Any, fc.Session, dict[Any, Any]]:
    step = build_step(build_model(loaded, training=True), step_config(loaded))
    session = fc.Session(step.graph, store=fc.ContainerStore())
    session.run(step.init)
    return step, session, step_feeds(step, loaded)


def compare_step(name: str, steps: int, rounds: int) -> dict[str, Any]:
    """Median step time of the fused and the unfused step, measured in alternation."""
    runs = {on: _opened(_load(name, on)) for on in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            step, session, feeds = runs[on]
            times[on] += timed_block(session, step, feeds, steps)
    plain, fused = (statistics.median(times[on]) for on in (False, True))
    g0, g1 = runs[False][0].graph, runs[True][0].graph
    return {"nodes_unfused": len(g0.nodes), "nodes_fused": len(g1.nodes), "fused_nodes": len(fused_nodes(g1)),
            "step_ms_unfused": plain * 1e3, "step_ms_fused": fused * 1e3, "fused_over_unfused": fused / plain,
            "steps_each": steps * rounds}


def count_nodes(name: str) -> dict[str, Any]:
    """Nodes of a spec's training step graph without and with fusion (built, not run)."""
    graphs = {on: build_step(build_model(loaded, training=True), step_config(loaded)).graph
              for on in (False, True) for loaded in [_load(name, on)]}
    ops: dict[str, int] = {}
    for node in graphs[False].nodes.values():
        ops[node.opdef.group] = ops.get(node.opdef.group, 0) + 1
    return {"nodes_unfused": len(graphs[False].nodes), "nodes_fused": len(graphs[True].nodes),
            "fused_nodes": len(fused_nodes(graphs[True])), "elementwise_unfused": ops.get("elementwise", 0)}


def fusion_benchmark(steps: int = 5, rounds: int = 4, quick: bool = False,
                     progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("lstm_lm", "convnet"):
        progress(f"{name}: fused and unfused steps, alternating")
        out[name] = compare_step(name, 1 if quick else steps, 1 if quick else rounds)
    progress("inception_v3: node counts")
    out["inception_v3"] = count_nodes("inception_v3")
    return out
