"""A timeline of one step in the Chrome trace format (chrome://tracing, ui.perfetto.dev).

Process 1 is the step as measured: a track per device thread with each kernel it ran (its name,
op, layer, output shapes, duration), and a track per device for its asynchronous kernels (a Recv
waits for its tensor without holding the device's thread, §5.3). Each Send/Recv pair is joined by a
flow arrow from the Send's end to the Recv's. Process 2 is the same step as the simulator predicted
it for the same placement, so the two can be read one above the other.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from flowctl.engine.devices import spec_name
from flowctl.engine.executor import RunStats
from flowctl.engine.graph import Graph, Node
from flowctl.engine.placement import SimResult
from flowctl.training.rundir import write_atomic

MEASURED, PREDICTED = 1, 2


def _short(device: str) -> str:
    return spec_name(device)  # worker1/cpu:0: two workers' cpu:0 are two lanes


def _shapes(node: Node) -> list[list[Any]]:
    return [["?" if d is None else d for d in s.shape] for s in node.outputs]


def step_trace(stats: RunStats, graphs: Mapping[str, Graph], layers: Mapping[str, str],
               predicted: SimResult | None = None, title: str = "step") -> dict[str, Any]:
    """The trace of one measured step. `stats`: the step's RunStats from the dataflow executor
    (per device, or one device's); `graphs`: device -> the graph it ran (a partition, or the whole
    graph for one device); `layers`: node -> the spec layer that made it."""
    per_device = stats.devices or {next(iter(graphs)): stats}
    t0 = min((t for s in per_device.values() for _, t in s.starts), default=0.0)
    events: list[dict[str, Any]] = [_meta("process_name", MEASURED, 0, f"{title}: measured")]
    tids: dict[tuple[str, bool], int] = {}
    ends: dict[tuple[str, str, str], tuple[int, float]] = {}  # (tensor, src, dst) -> (tid, Send's end)
    arrivals: dict[tuple[str, str, str], tuple[int, float]] = {}
    for device, s in per_device.items():
        graph = graphs[device]
        for name, started, finished in s.runs():
            node = graph.nodes.get(name)
            if node is None:
                continue
            lane = node.opdef.is_async
            key = (device, lane)
            if key not in tids:
                tids[key] = len(tids) + 1
                label = f"{_short(device)} {'async (Recv, queues)' if lane else 'compute'}"
                events.append(_meta("thread_name", MEASURED, tids[key], label))
            tid = tids[key]
            start_us, end_us = (started - t0) * 1e6, (finished - t0) * 1e6
            events.append({"ph": "X", "pid": MEASURED, "tid": tid, "ts": start_us, "dur": end_us - start_us,
                           "name": name, "cat": node.op,
                           "args": {"op": node.op, "layer": layers.get(name, ""), "device": device,
                                    "shapes": _shapes(node)}})
            if node.op in ("Send", "Recv"):
                link = (str(node.attrs["tensor_name"]), str(node.attrs["send_device"]), str(node.attrs["recv_device"]))
                (ends if node.op == "Send" else arrivals)[link] = (tid, end_us)
    for k, (link, (tid, ts)) in enumerate(sorted(ends.items())):
        if link in arrivals:
            rtid, rts = arrivals[link]
            flow = {"name": f"{link[0]} -> {_short(link[2])}", "cat": "transfer", "id": k, "pid": MEASURED}
            events.append({**flow, "ph": "s", "tid": tid, "ts": ts})
            events.append({**flow, "ph": "f", "bp": "e", "tid": rtid, "ts": rts})
    if predicted is not None:
        events += _predicted(predicted, graphs, layers)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"measured_step_ms": (max((t for s in per_device.values() for _, t in s.finishes),
                                                   default=t0) - t0) * 1e3,
                          "predicted_step_ms": predicted.step_time * 1e3 if predicted is not None else None,
                          "executor": {_short(d): _executor_times(s) for d, s in per_device.items()}}}


def _executor_times(s: RunStats) -> dict[str, float]:
    """What the device's executor thread counted around the step, apart from its per-op times: a
    reader checks the ops against it (their sum on the compute track is the busy time less the
    executor's own bookkeeping)."""
    return {"busy_ms": s.busy_s * 1e3, "wall_ms": s.wall_s * 1e3, "idle_ms": s.idle_s * 1e3,
            "thread_cpu_ms": s.cpu_s * 1e3}


def _predicted(sim: SimResult, graphs: Mapping[str, Graph], layers: Mapping[str, str]) -> list[dict[str, Any]]:
    events = [_meta("process_name", PREDICTED, 0, "predicted (simulator)")]
    devices = sorted(set(sim.device_of.values()))
    for i, d in enumerate(devices):
        events.append(_meta("thread_name", PREDICTED, i + 1, f"{_short(d)} predicted"))
    for name, start in sim.start.items():
        on = sim.device_of.get(name)
        if on is None:
            continue
        events.append({"ph": "X", "pid": PREDICTED, "tid": devices.index(on) + 1, "ts": start * 1e6,
                       "dur": (sim.finish[name] - start) * 1e6, "name": name, "cat": "predicted",
                       "args": {"layer": layers.get(name, "")}})
    return events


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def busy_ms(trace: dict[str, Any]) -> dict[str, float]:
    """Per measured track, the milliseconds its kernels took (the sum of its events' durations)."""
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == MEASURED}
    out: dict[str, float] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == MEASURED:
            out[names[e["tid"]]] = out.get(names[e["tid"]], 0.0) + e["dur"] / 1e3
    return out


def write_trace(path: Path, trace: dict[str, Any]) -> Path:
    write_atomic(path, json.dumps(trace))
    return path


__all__ = ["busy_ms", "step_trace", "write_trace"]
