"""`flowctl bench placement`: every placer on the placement benchmarks of Mirhoseini et al. 2017
and Baechi (placement-notes.md), predicted by the simulator: Inception-v3, lstm_lm, NMT with its
own constraints and without them (the expert: one LSTM layer per GPU), and a 4-layer LSTM, over
2, 4 and 8 GPUs of the K40, V100 and H100 profiles, each also with every device's memory capped
at 60% of what the model needs on one device.

The default run is the issue's table (4 x K40, uncapped and capped) with a short learned budget;
`full=True` runs the whole grid. Each row records, per placer, the predicted step (exact
schedule), the seconds it took to place, or why it failed; the learned placer's row also holds
its learning curve (best step so far against seconds).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from flowctl.engine.errors import FlowctlError
from flowctl.engine.placement import StaticCostModel, place, prepare
from flowctl.engine.placement.learned import LearnedOptions
from flowctl.engine.placement.pinned import RULES_OVERFLOW
from flowctl.spec.check import LoadedSpec
from flowctl.spec.model import build_model
from flowctl.training.program import build_step, cluster_for, step_config
from flowctl.spec.loader import load_text

SPECS = Path(__file__).resolve().parents[2] / "specs"
PLACERS = ("single", "expert", "greedy", "heft", "mincut", "learned")
CAP = 0.6  # a capped row gives each device this share of the model's single-device peak


def _layers_per_gpu(stages: list[list[str]], gpus: int) -> list[dict[str, Any]]:
    """The expert of the literature: consecutive layer stages on consecutive GPUs (wrapping)."""
    return [{"layers": layers, "device": f"gpu:{k % gpus}"} for k, layers in enumerate(stages)]


EXPERT_STAGES = {
    "nmt_free": [["source", "encoder/embedding", "encoder/lstm_1"], ["encoder/lstm_2"],
                 ["target_in", "decoder/embedding", "decoder/lstm_1"],
                 ["decoder/lstm_2", "attention", "projection", "target_out", "loss"]],
    "lstm4": [["tokens", "embedding", "lstm_1"], ["lstm_2"], ["lstm_3"], ["lstm_4", "softmax", "targets", "loss"]],
    # GPT-2 small: three blocks per stage, the embeddings with the first, the head with the last
    "transformer_lm": [["tokens", "wte", "wpe", "h_1/block", "h_2/block", "h_3/block"],
                       ["h_4/block", "h_5/block", "h_6/block"], ["h_7/block", "h_8/block", "h_9/block"],
                       ["h_10/block", "h_11/block", "h_12/block", "ln_f", "logits", "targets", "loss"]],
}

# (row name, spec file, batch, variant)
MODELS = [
    ("inception_v3", "inception_v3.yaml", 32, "own"),
    ("lstm_lm", "lstm_lm.yaml", 20, "own"),
    ("nmt", "nmt.yaml", 64, "own"),
    ("nmt_free", "nmt.yaml", 64, "nmt_free"),
    ("lstm4", "lstm4.yaml", 20, "lstm4"),
    ("transformer_lm", "transformer_lm.yaml", 8, "transformer_lm"),
]
DEFAULT_ROWS = [("inception_v3", 4, "k40"), ("nmt", 4, "k40"), ("nmt_free", 4, "k40"), ("lstm4", 4, "k40")]


def _variant(spec_file: str, variant: str, gpus: int, free: bool = False, optimizer: str | None = None) -> LoadedSpec:
    """The spec on `gpus` GPUs; `free`: without any placement constraint or expert stages;
    `optimizer`: another optimizer type than the spec's."""
    d = yaml.safe_load((SPECS / spec_file).read_text())
    if optimizer:
        d["training"]["optimizer"] = {"type": optimizer}
    d["devices"] = ["cpu:0"] + [f"gpu:{i}" for i in range(max(gpus, 2))]
    if free:
        d["placement"] = {"algorithm": "greedy"}
        d.pop("parallelism", None)
    elif variant in EXPERT_STAGES:
        d["placement"] = {"algorithm": "greedy"}  # no constraints: every placer is free
        d["parallelism"] = {"strategy": "model_parallel", "groups": _layers_per_gpu(EXPERT_STAGES[variant], gpus)}
    return load_text(yaml.safe_dump(d, sort_keys=False), filename=f"<bench placement: {spec_file}>")


def _row(loaded: LoadedSpec, devices: str, batch: int, placers: tuple[str, ...], budget: float,
         seed: int, say: Callable[[str], None], learned_steps: int | None = None) -> dict[str, Any]:
    cluster = cluster_for(step_config(loaded), devices)
    sg = build_step(build_model(loaded, devices=len(cluster.devices)), step_config(loaded))
    cost = StaticCostModel(cluster, batch=batch)
    targets = sg.targets
    pb = prepare(sg.graph, cluster, cost, targets)
    rules = step_config(loaded).expert_rules() or None
    layers = sg.model.layer_of()
    out: dict[str, Any] = {}
    for alg in placers:
        if alg == "expert" and not rules:
            out[alg] = {"error": "no expert rules for this model"}
            continue
        say(f"{devices}: {alg}")
        started = time.perf_counter()
        try:
            opts = LearnedOptions(seed=seed, budget_s=budget, steps=learned_steps) if alg == "learned" else None
            pl = place(sg.graph, cluster, cost, alg, targets=targets, rules=rules, layers=layers, problem=pb,
                       learned=opts)
        except FlowctlError as e:
            kind = getattr(e, "details", {}).get("kind")
            out[alg] = {"error": str(e) if kind == RULES_OVERFLOW else str(e)[:300], "kind": kind,
                        "seconds": time.perf_counter() - started}
            continue
        r: dict[str, Any] = {"step_ms": pl.step_time * 1e3, "seconds": time.perf_counter() - started,
                             "peak_memory": [d.peak_memory for d in pl.devices]}
        if alg == "learned":
            curve = pl.alternatives.get("learned_curve", [])
            r["notes"] = list(pl.notes[:2])
            r["curve"] = [{"step": h["step"], "best_ms": h["best"] * 1e3, "mean_ms": h["mean"] * 1e3}
                          for h in curve[:: max(1, len(curve) // 50)]]
        out[alg] = r
    return out


def verdict(results: dict[str, dict[str, Any]]) -> str:
    """"fits", "does not fit (rules)" where every placer that ran failed because the spec's device
    constraints leave no placement that fits (pinned.py), else "placer failed" where one failed."""
    ran = {a: r for a, r in results.items() if "step_ms" in r or r.get("kind")}
    if ran and all(r.get("kind") == RULES_OVERFLOW for r in ran.values()):
        return "does not fit (rules)"
    return "fits" if all("step_ms" in r for r in ran.values()) else "placer failed"


def single_device_need(loaded: LoadedSpec, devices: str, batch: int) -> int:
    """The simulated peak memory of the whole step on one device (uncapped; give a spec without
    device constraints: what the model itself holds)."""
    cluster = cluster_for(step_config(loaded), devices)
    sg = build_step(build_model(loaded, devices=len(cluster.devices)), step_config(loaded))
    pl = place(sg.graph, cluster, StaticCostModel(cluster, batch=batch), "single", targets=sg.targets)
    return max(d.peak_memory for d in pl.devices)


def cap_mib(need: int) -> str:
    """The capped rows' memory per device, CAP of the one-device need, in MiB to 0.01 (rounded
    down): whole MiB took up to 1 MiB more off a small model (lstm4's 18.0 MiB cap was 17)."""
    return f"{max(0.01, math.floor(need * CAP / (1 << 20) * 100) / 100):.2f}"


def select_rows(grid: list[tuple[str, int, str]], rows: str) -> list[tuple[str, int, str]]:
    """`rows`: comma-separated models (`lstm4`: its rows of `grid`) or rows (`lstm4/2xk40`: that one,
    in the grid or not)."""
    models = {m for m, *_ in MODELS}
    out: list[tuple[str, int, str]] = []
    for token in (t.strip() for t in rows.split(",") if t.strip()):
        model, _, where = token.partition("/")
        if model not in models:
            raise FlowctlError(f"no placement benchmark '{model}' (known: {', '.join(sorted(models))})")
        if not where:
            out += [r for r in grid if r[0] == model]
            continue
        n, _, prof = where.partition("x")
        if not n.isdigit() or prof not in ("k40", "v100", "h100"):
            raise FlowctlError(f"row '{token}': write MODEL/NxPROFILE, e.g. lstm4/2xk40 (profiles: k40, v100, h100)")
        out.append((model, int(n), prof))
    return list(dict.fromkeys(out))


def placement_suite(full: bool = False, placers: tuple[str, ...] = PLACERS, learned_budget: float = 20.0,
                    seed: int = 0, capped: bool = True, rows: str | None = None,
                    progress: Callable[[str], None] | None = None, learned_steps: int | None = None) -> dict[str, Any]:
    """`rows`: a selection (select_rows) of the grid (`full`) or of the default rows. `learned_steps`:
    the learned placer's policy updates per row instead of `learned_budget` seconds."""
    say = progress or (lambda _m: None)
    grid = [(m, g, p) for m, *_ in MODELS for g in (2, 4, 8) for p in ("k40", "v100", "h100")] if full \
        else DEFAULT_ROWS
    if rows:
        grid = select_rows(grid, rows)
    models = {m: (f, b, v) for m, f, b, v in MODELS}
    out_rows = []
    for model, gpus, prof in grid:
        spec_file, batch, variant = models[model]
        loaded = _variant(spec_file, variant, gpus)
        devices = f"{gpus}xgpu:{prof}"
        for cap in ((None, "capped") if capped else (None,)):
            dev = devices
            need = None
            if cap:
                need = single_device_need(_variant(spec_file, variant, gpus, free=True), devices, batch)
                dev = f"{devices}:{cap_mib(need)}MiB"
            say(f"{model} on {dev}")
            results = _row(loaded, dev, batch, placers, learned_budget, seed, say, learned_steps)
            steps = {a: r["step_ms"] for a, r in results.items() if "step_ms" in r}
            others = [v for a, v in steps.items() if a != "learned"]
            row = {"model": model, "devices": dev, "batch": batch, "capped": bool(cap), "results": results,
                   "best_other": min(others) if others else None,
                   "best_other_placer": min((v, a) for a, v in steps.items() if a != "learned")[1] if others else None}
            if need is not None:
                row["single_device_need"] = need
            row["verdict"] = verdict(results)
            if "learned" in steps and others:
                row["learned_vs_best_other"] = steps["learned"] / min(others)
            out_rows.append(row)
    return {"suite": "placement", "full": full, "learned_budget_s": None if learned_steps else learned_budget,
            "learned_steps": learned_steps, "seed": seed, "cap_share": CAP, "rows": out_rows}


__all__ = ["placement_suite", "select_rows", "single_device_need", "verdict"]
