"""Compile every numba-cuda kernel a GPU plan launches to PTX, on a machine without a GPU.

A bench row's training step runs in a GPU session on the launch ledger (kernels/ledger.py), with
numba's simulator off; each launch of one of our kernels is compiled for the types of its arguments
(`numba.cuda.compile_ptx`, sm_90 unless --cc says otherwise) instead of being run. A kernel that
would not compile on the card -- a type the simulator takes and NVVM does not, a bfloat16 array
reaching a kernel -- shows here, before a GPU session spends its minutes on it. The values are not
the model's (the kernels do not run), so a step may stop early on them; what was launched before
that is checked.

Needs NVRTC and NVVM, not a driver: where pip reaches an index,

    pip install --target /tmp/nvrtc nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
    env -u NUMBA_ENABLE_CUDASIM PYTHONPATH=/tmp/nvrtc:$PWD \\
        LD_LIBRARY_PATH=/tmp/nvrtc/nvidia/cuda_nvrtc/lib:/tmp/nvrtc/nvidia/cuda_nvcc/nvvm/lib64 \\
        CUDA_HOME=/tmp/nvrtc/nvidia/cuda_nvcc python benchmarks/gpu/compile_check.py lstm_lm fp32,bf16

It prints, per row and precision, the kernel signatures compiled so far and any that failed, and
exits 1 if one did. Run on 2026-12-06: lstm_lm and Inception-v3 at fp32 and bf16, 31 signatures,
none failing (after a bfloat16 Dropout reaching its kernel raw was found and mended this way).
"""
from __future__ import annotations

import argparse
import sys
import types
from dataclasses import replace
from typing import Any


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", help="bench rows, comma-separated (lstm_lm, inception_v3_b32, ...)")
    # fp16 works too, slowly: the ledger's float16 products are numpy's, without BLAS (minutes for lstm_lm)
    ap.add_argument("precisions", nargs="?", default="fp32,bf16")
    ap.add_argument("--cc", default="9.0", help="compute capability to compile for")
    args = ap.parse_args(argv)
    cc = tuple(int(x) for x in args.cc.split("."))

    import numba
    import numba.cuda.dispatcher as dispatcher
    import numpy as np

    # The compile of a device function a kernel calls asks the driver for the card's capability.
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)

    from flowctl.bench.launches import BATCH
    from flowctl.bench.peers import ROWS, _batch, _load, flowctl_step
    from flowctl.kernels import ledger as L
    from flowctl.kernels.cuda import jit
    from flowctl.kernels.registry import override_array_module

    if jit.simulated():
        print("numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1): run with it unset", file=sys.stderr)
        return 2
    seen: dict[tuple[str, str], str] = {}

    def typeof(a: Any) -> Any:
        if isinstance(a, np.ndarray):
            return numba.typeof(np.asarray(a).view(np.ndarray))
        if type(a) is tuple:
            ts = [typeof(b) for b in a]
            return numba.types.UniTuple(ts[0], len(ts)) if len(set(ts)) == 1 else numba.types.Tuple(ts)
        return numba.typeof(a)

    def launch(self: Any, kernel: Any, grid: Any, block: Any, *kargs: Any) -> None:
        plain = tuple(tuple(self.plain(b) if isinstance(b, L.LedgerArray) else b for b in a) if type(a) is tuple
                      else self.plain(a) if isinstance(a, L.LedgerArray) else a for a in kargs)
        sig = tuple(typeof(a) for a in plain)
        key = (getattr(kernel, "__name__", "?"), str(sig))
        if key not in seen:
            try:
                numba.cuda.compile_ptx(kernel.py_func, sig, cc=cc)
                seen[key] = ""
            except Exception as e:  # noqa: BLE001 -- reported, the next launch goes on
                seen[key] = f"{type(e).__name__}: {str(e)[:400]}"
        self.counts["custom"] += 1
        self._launch(key[0], lambda: None)

    L.Ledger._x_launch = launch
    for name in args.rows.split(","):
        for precision in args.precisions.split(","):
            row = ROWS[name]
            row = replace(row, batch=BATCH.get(name, row.batch))  # bench launches' batches
            loaded = _load(row, () if precision == "fp32" else (f"training.precision={precision}",))
            with override_array_module("gpu", L.Ledger(run_kernels=False)):
                step = flowctl_step(loaded, _batch(loaded, row.batch), row.train, "gpu:0", capture=True)
                for _ in range(4):
                    try:
                        step()
                    except Exception as e:  # noqa: BLE001 -- the kernels did not run: values are not the model's
                        print(f"  {name} {precision}: the step stopped ({type(e).__name__}: {str(e)[:200]})")
                        break
            failed = [k for k, v in seen.items() if v]
            print(f"{name} {precision}: {len(seen) - len(failed)} kernel signatures compiled, {len(failed)} failed")
    for (kname, sig), why in seen.items():
        if why:
            print(f"FAILED {kname}{sig}: {why}")
    return 1 if any(seen.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
