"""The Python half of benchmarks/gpu/run.sh: what the machine is, the train/resume check, and the
merged results. Standard library only at import (numpy/safetensors/cupy/torch are imported inside
try blocks), so a broken package there costs one field, never the run.

    python3 benchmarks/gpu/collect.py env WORK          versions and the card -> WORK/env.json
    python3 benchmarks/gpu/collect.py train WORK OUT    runs WORK/a and WORK/b -> OUT/train.json
    python3 benchmarks/gpu/collect.py finish WORK OUT [SECONDS]
        WORK/peers-<precision>-<row>.json -> OUT/peers.json; everything -> OUT/results.json and
        OUT/summary.txt (printed with --print)

run.sh calls `finish` after every step, so whatever a kill leaves under OUT is already merged.
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import re
import subprocess
import sys
import traceback
from typing import Any


def _load(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write(path: str, data: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def _r(x: Any, n: int = 3) -> Any:
    return round(x, n) if isinstance(x, float) else x


# ---------------------------------------------------------------- env
def env(work: str) -> None:
    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}

    def probe(name: str, fn: Any) -> None:
        try:
            info[name] = fn()
        except BaseException as e:  # noqa: BLE001 -- one field, never the run
            info[name] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(f"{name}: {info[name]}", flush=True)

    smi = os.path.join(work, "smi.csv")
    if os.path.exists(smi):
        keys = ["name", "memory_total_mib", "memory_used_mib", "driver", "clock_sm_mhz", "clock_max_sm_mhz",
                "clock_max_mem_mhz", "power_limit_w"]
        with open(smi) as f:
            rows = [[c.strip() for c in line.split(",")] for line in f if line.strip()]
        if rows and len(rows[0]) == len(keys):
            info["smi"] = dict(zip(keys, rows[0]))
            info["gpus"] = len(rows)

    def _numpy() -> str:
        import numpy
        return numpy.__version__

    def _cupy() -> dict[str, Any]:
        import cupy
        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(0)
        name = props["name"]
        return {"version": cupy.__version__, "runtime": rt.runtimeGetVersion(), "driver": rt.driverGetVersion(),
                "devices": rt.getDeviceCount(), "device0": name.decode() if isinstance(name, bytes) else name,
                "cc": f"{props['major']}.{props['minor']}", "memory_mib": props["totalGlobalMem"] // 2**20}

    def _torch() -> dict[str, Any]:
        import torch
        d: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                             "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                             "cuda_available": torch.cuda.is_available()}
        if d["cuda_available"]:
            d["device0"] = torch.cuda.get_device_name(0)
        return d

    def _numba() -> dict[str, Any]:
        import numpy as np
        if not hasattr(np, "row_stack"):
            np.row_stack = np.vstack  # numba-cuda 0.30.x still names it; numpy 2.5 removed it
        import numba
        d: dict[str, Any] = {"version": numba.__version__}
        try:
            import numba_cuda  # type: ignore[import-not-found]
            d["numba_cuda"] = getattr(numba_cuda, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            d["numba_cuda"] = f"unavailable: {type(e).__name__}: {e}"
        try:
            from numba import cuda
            d["cuda_available"] = bool(cuda.is_available())
        except Exception as e:  # noqa: BLE001
            d["cuda_available"] = f"unavailable: {type(e).__name__}: {e}"
        return d

    def _cudnn_frontend() -> dict[str, Any]:
        import cudnn  # type: ignore[import-not-found]  # nvidia-cudnn-frontend
        d: dict[str, Any] = {"version": getattr(cudnn, "__version__", "?")}
        try:
            d["backend"] = cudnn.backend_version()
        except Exception as e:  # noqa: BLE001
            d["backend"] = f"unavailable: {type(e).__name__}: {e}"
        return d

    def _dist(name: str) -> Any:
        import importlib.metadata as m
        return lambda: m.version(name)

    def _flowctl() -> str:
        from flowctl.version import __version__
        return __version__

    def _commit() -> str:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or "unknown (no .git)"

    probe("numpy", _numpy)
    probe("cupy", _cupy)
    probe("torch", _torch)
    probe("numba", _numba)
    probe("cudnn_frontend", _cudnn_frontend)
    for d in ("pydantic", "pydantic-core", "typing-extensions", "tensorboardX", "pymetis", "protobuf",
              "safetensors", "pytest", "pytest-timeout"):
        probe(d, _dist(d))
    probe("flowctl", _flowctl)
    probe("commit", _commit)
    _write(os.path.join(work, "env.json"), info)


# ---------------------------------------------------------------- train / resume
def _metrics(run: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(os.path.join(run, "metrics.jsonl")) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out


def _find_captured(obj: Any, where: str, found: dict[str, Any]) -> None:
    """Every key naming a capture (captured, cuda_graph, graph_capture...) anywhere in obj."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if re.search(r"captur|cuda_?graph", str(k), re.I):
                found[f"{where}.{k}"] = v
            _find_captured(v, f"{where}.{k}", found)
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3] + obj[-1:] if len(obj) > 4 else obj):
            _find_captured(v, f"{where}[]", found)


def _latest(run: str) -> str | None:
    try:
        with open(os.path.join(run, "checkpoints", "latest")) as f:
            return os.path.join(run, "checkpoints", f.read().strip())
    except OSError:
        return None


def train(work: str, out: str) -> None:
    a, b = os.path.join(work, "a"), os.path.join(work, "b")
    res: dict[str, Any] = {"device": os.environ.get("FLOWCTL_GPU_DEVICE", "?")}
    for key, path in (("train_20", "train-a.json"), ("train_10", "train-b.json"), ("resume_20", "resume-b.json")):
        d = _load(os.path.join(work, path))
        res[key] = ({k: _r(d.get(k), 6) for k in ("first_step", "last_step", "final_loss", "mean_examples_per_s",
                                                    "seconds", "checkpoint", "restored_from", "exit_code")}
                    if isinstance(d, dict) else None)
    ma, mb = _metrics(a), _metrics(b)
    res["losses_a"] = [m.get("loss") for m in ma]
    res["losses_b_resumed"] = [m.get("loss") for m in mb]
    res["losses_equal"] = bool(ma) and res["losses_a"] == res["losses_b_resumed"]
    res["examples_per_s_a"] = [m.get("examples_per_s") for m in ma]
    ca, cb = _latest(a), _latest(b)
    res["checkpoints"] = [ca, cb]
    res["bitwise_equal"] = None
    if ca and cb:
        try:
            fa, fb = _load(os.path.join(ca, "manifest.json")) or {}, _load(os.path.join(cb, "manifest.json")) or {}
            res["manifest_steps"] = [fa.get("step"), fb.get("step")]
            res["manifest_tensor_sha_equal"] = fa.get("tensors") == fb.get("tensors")
            rest = lambda m: {k: v for k, v in m.items() if k not in ("created_unix", "tensors", "tensor_file")}
            res["manifest_rest_equal"] = rest(fa) == rest(fb)
            if not res["manifest_rest_equal"]:
                res["manifest_rest_differs"] = sorted(k for k in set(rest(fa)) | set(rest(fb))
                                                      if rest(fa).get(k) != rest(fb).get(k))
        except Exception as e:  # noqa: BLE001
            res["manifest_error"] = f"{type(e).__name__}: {e}"
        try:
            import numpy as np
            from safetensors.numpy import load_file
            ta = load_file(os.path.join(ca, "tensors.safetensors"))
            tb = load_file(os.path.join(cb, "tensors.safetensors"))
            differ = sorted(k for k in set(ta) | set(tb)
                            if k not in ta or k not in tb or ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape
                            or ta[k].tobytes() != tb[k].tobytes())
            res["tensors"] = len(ta)
            res["bitwise_equal"] = not differ
            if differ:
                res["tensors_differing"] = differ[:20]
                diffs = {}
                for k in differ[:20]:
                    if k in ta and k in tb and ta[k].shape == tb[k].shape:
                        x, y = ta[k].astype(np.float64), tb[k].astype(np.float64)
                        diffs[k] = float(np.max(np.abs(x - y)) / (np.max(np.abs(x)) + 1e-30))
                res["max_rel_diff"] = diffs
        except Exception as e:  # noqa: BLE001
            res["tensor_error"] = f"{type(e).__name__}: {e}"
    found: dict[str, Any] = {}
    for name, run in (("a", a), ("b", b)):
        _find_captured(_load(os.path.join(run, "run.json")), f"{name}/run.json", found)
        m = _metrics(run)
        if m:
            _find_captured(m[-1], f"{name}/metrics[-1]", found)
    for path in ("train-a.json", "train-b.json", "resume-b.json"):
        _find_captured(_load(os.path.join(work, path)), path, found)
    log = os.path.join(out, "train.log")
    lines = []
    try:
        with open(log, errors="replace") as f:
            for ln in f:
                if re.search(r"captur|cuda graph", ln, re.I):
                    lines.append(ln.strip())
                if ln.startswith("restored "):
                    res["resume_restored"] = ln.strip()
    except OSError:
        pass
    res["captured"] = found if found else "unknown"
    res["run_json"] = {n: _load(os.path.join(r, "run.json")) for n, r in (("a", a), ("b", b))}
    if lines:
        res["captured_log_lines"] = lines[:10]
    _write(os.path.join(out, "train.json"), res)
    print(_train_line(res))


def _train_line(t: dict[str, Any]) -> str:
    ex = (t.get("train_20") or {}).get("mean_examples_per_s")
    la = (t.get("train_20") or {}).get("final_loss")
    lb = (t.get("resume_20") or {}).get("final_loss")
    cap = t.get("captured")
    cap = "unknown" if cap == "unknown" else json.dumps(cap)[:120]
    return (f"train 20 steps {_r(ex, 1)} ex/s loss {la}; 10+resume 10 loss {lb}; "
            f"bitwise_equal={t.get('bitwise_equal')} losses_equal={t.get('losses_equal')} captured={cap}")


# ---------------------------------------------------------------- finish
def _pytest(path: str) -> dict[str, Any] | None:
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    pat = re.compile(r"\b(passed|failed|error|errors|skipped|deselected|no tests ran)\b")
    summary = next((ln.strip("= ").strip() for ln in reversed(lines) if pat.search(ln) and " in " in ln), None)
    failed = [ln.split(" - ")[0].replace("FAILED ", "", 1) if ln.startswith("FAILED ") else ln.split(" - ")[0]
              for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    return {"summary": summary or (lines[-1] if lines else ""), "failed": failed}


def _peer_row(d: dict[str, Any]) -> dict[str, Any]:
    fw, pt = d.get("flowctl") or {}, d.get("pytorch") or {}
    mem = d.get("memory") or {}
    row = {"flowctl_ms": _r((fw.get("median_s") or 0) * 1e3, 3) if fw.get("median_s") else None,
           "pytorch_ms": _r((pt.get("median_s") or 0) * 1e3, 3) if pt.get("median_s") else None,
           "ratio": _r(d.get("ratio")), "ratio_ci95": [_r(x) for x in d.get("ratio_ci95") or []],
           "ratio_of_fastest": _r(d.get("ratio_of_fastest")), "batch": d.get("batch"), "mode": d.get("mode")}
    gpu_mem = {k: _r((v or {}).get("gpu_peak_mib"), 1) for k, v in mem.items() if isinstance(v, dict)}
    if any(v is not None for v in gpu_mem.values()):
        row["gpu_peak_mib"] = gpu_mem
    for k in ("precision", "capture_speedup", "ratio_captured"):
        if k in d:
            row[k] = _r(d[k])
    if d.get("ratio_captured_ci95"):
        row["ratio_captured_ci95"] = [_r(x) for x in d["ratio_captured_ci95"]]
    for k in ("flowctl_eager", "pytorch_captured"):
        if isinstance(d.get(k), dict) and d[k].get("median_s"):
            row[f"{k}_ms"] = _r(d[k]["median_s"] * 1e3)
    return row


def finish(work: str, out: str, seconds: str | None, show: bool) -> None:
    envd = _load(os.path.join(work, "env.json")) or {}
    # peers: every WORK/peers-<precision>-<row>.json into one OUT/peers.json
    peers: dict[str, dict[str, Any]] = {}
    for p in sorted(glob.glob(os.path.join(work, "peers-*-*.json"))):
        m = re.match(r"peers-([a-z0-9]+)-(.+)\.json$", os.path.basename(p))
        d = _load(p)
        if m and isinstance(d, dict):
            peers.setdefault(m.group(1), {})[m.group(2)] = d
    if peers:
        _write(os.path.join(out, "peers.json"), peers)
    figures: dict[str, Any] = {}
    machine = None
    for prec, rows in peers.items():
        for name, d in rows.items():
            machine = machine or d.get("machine")
            for rname, r in (d.get("rows") or {}).items():
                figures.setdefault(prec, {})[rname] = _peer_row(r)
    steps = []
    try:
        with open(os.path.join(work, "steps.tsv")) as f:
            for line in f:
                c = line.rstrip("\n").split("\t")
                if len(c) >= 4:
                    steps.append({"name": c[0], "rc": c[1], "seconds": _r(float(c[2]), 1) if c[2] else None,
                                  "limit_s": c[3], "last_stderr": c[4] if len(c) > 4 else ""})
    except OSError:
        pass
    tests = {k: _pytest(os.path.join(work, f"pytest-{k}.txt")) for k in ("gpu", "cpu")}
    trainj = _load(os.path.join(out, "train.json"))
    smi = envd.get("smi") or {}
    cupy = envd.get("cupy") if isinstance(envd.get("cupy"), dict) else {}
    card = smi.get("name") or cupy.get("device0") or (machine or {}).get("gpu") or "unknown"
    today = datetime.date.today().isoformat()
    slug = re.sub(r"[^a-z0-9]+", "-", card.lower().replace("nvidia", "")).strip("-") or "unknown"
    results = {
        "what": "flowctl on one lent GPU: benchmarks/gpu/run.sh",
        "date": today,
        "dry_run": os.environ.get("FLOWCTL_GPU_DRY") == "1",
        "device": os.environ.get("FLOWCTL_GPU_DEVICE", "gpu:0"),
        "card": card,
        "driver": smi.get("driver"),
        "memory_mib": smi.get("memory_total_mib") or cupy.get("memory_mib"),
        "clocks_max_mhz": {"sm": smi.get("clock_max_sm_mhz"), "mem": smi.get("clock_max_mem_mhz")},
        "versions": {k: envd.get(k) for k in ("python", "numpy", "cupy", "torch", "numba", "cudnn_frontend",
                                             "pydantic", "flowctl", "commit") if k in envd},
        "peers": figures,
        "peers_machine": {k: _r(v) for k, v in (machine or {}).items() if k not in ("blas_gflops",)},
        "pytest": tests,
        "train_resume": ({k: v for k, v in trainj.items() if k not in ("examples_per_s_a",)}
                         if isinstance(trainj, dict) else None),
        "steps": steps,
        "total_s": int(seconds) if seconds and seconds.isdigit() else None,
        "commit_as": f"benchmarks/results/gpu-{today}-{slug}.json",
    }
    _write(os.path.join(out, "results.json"), results)

    lines = [f"card {card} | driver {smi.get('driver')} | {results['memory_mib']} MiB | "
             f"cupy {cupy.get('version') or envd.get('cupy')} | torch {(envd.get('torch') or {}).get('version') if isinstance(envd.get('torch'), dict) else envd.get('torch')} | "
             f"numpy {envd.get('numpy')} | cudnn-frontend "
             f"{(envd.get('cudnn_frontend') or {}).get('version') if isinstance(envd.get('cudnn_frontend'), dict) else envd.get('cudnn_frontend')}"]
    for s in steps:
        name, key = s["name"], ""
        m = re.match(r"peers-([a-z0-9]+)-(.+)$", name)
        if name.startswith("pytest-"):
            t = tests.get(name.split("-", 1)[1]) or {}
            key = t.get("summary") or ""
            if t.get("failed"):
                key += " | " + ", ".join(x.split("::")[-1] for x in t["failed"][:8])
        elif m:
            r = (figures.get(m.group(1)) or {}).get(m.group(2))
            if r:
                ci = r.get("ratio_ci95") or []
                cc = r.get("ratio_captured_ci95") or []
                key = (f"flowctl {r['flowctl_ms']} ms, pytorch {r['pytorch_ms']} ms, ratio {r['ratio']}"
                       + (f" [{ci[0]}-{ci[1]}]" if len(ci) == 2 else "")
                       + (f"; flowctl eager {r['flowctl_eager_ms']} ms" if r.get("flowctl_eager_ms") else "")
                       + (f"; pytorch captured {r['pytorch_captured_ms']} ms, ratio {r.get('ratio_captured')}"
                          + (f" [{cc[0]}-{cc[1]}]" if len(cc) == 2 else "") if r.get("pytorch_captured_ms") else "")
                       + (f", gpu MiB {r['gpu_peak_mib']}" if r.get("gpu_peak_mib") else ""))
        elif name == "resume-20" and isinstance(trainj, dict):
            key = _train_line(trainj)
        elif name.startswith(("train-", "resume-")) and isinstance(trainj, dict):
            t = trainj.get({"train-20": "train_20", "train-10": "train_10"}.get(name, "")) or {}
            key = f"loss {t.get('final_loss')} ex/s {_r(t.get('mean_examples_per_s'), 1)}" if t else ""
        if not key and s["rc"] not in ("0",):
            key = s.get("last_stderr") or ""
        lines.append(f"{name} rc={s['rc']} {s['seconds']}s/{s['limit_s']}s {key}".rstrip())
    lines.append(f"total {results['total_s']} s; results -> OUT/results.json (commit as {results['commit_as']})")
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if show:
        print("\n".join(lines))


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "env":
        env(argv[1])
    elif len(argv) >= 3 and argv[0] == "train":
        train(argv[1], argv[2])
    elif len(argv) >= 3 and argv[0] == "finish":
        rest = [a for a in argv[3:] if a != "--print"]
        finish(argv[1], argv[2], rest[0] if rest else None, "--print" in argv)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception:  # noqa: BLE001 -- say what broke, and let run.sh go on
        traceback.print_exc()
        sys.exit(1)
