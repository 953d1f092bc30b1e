"""flowctl: a declarative runner for dataflow machine learning (TensorFlow whitepaper, 2015).

The Python API (`import flowctl as fc`) builds the same `Graph` the YAML front end builds. Its names
live in `flowctl/api.py` and load on first use (`fc.constant`, `from flowctl import Session`), which
imports the engine and registers every op. Importing this package alone imports nothing heavy, so
the command line (`flowctl.cli.main`) does its importing inside its own Ctrl-C guard.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

# OpenBLAS's idle threads spin for 2**28 cycles (~0.1 s) after every threaded GEMM before they sleep.
# The CPU kernels' intra-op pieces (kernels/intra.py) run one-thread GEMMs on every core right after
# such GEMMs, so for that long one core ran two threads: measured, Inception-v3's 147x147 and
# 73x73 convolutions took 1.5x their time alone, the inference step at batch 8 685-853 ms against
# 588-618 with the threads asleep at once (2^4 cycles; lstm_lm's step the same either way). Read by
# OpenBLAS when numpy loads it, so it holds where flowctl is imported first (the command line, the
# Ray workers, which inherit it); a value set beforehand is kept. Where numpy came first with the
# variable unset, the loaded OpenBLAS is asked to read it again (flowctl/openblas.py: numpy first
# measured 2.4 s a step of Inception-v3 training at batch 8 against 1.7); should that fail, a
# RuntimeWarning says so.
_NUMPY_FIRST = "numpy" in sys.modules and "OPENBLAS_THREAD_TIMEOUT" not in os.environ
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
if _NUMPY_FIRST:
    from flowctl import openblas

    if not openblas.sleep_at_once():
        openblas.warn_spinning()

from flowctl.version import __version__

if TYPE_CHECKING:
    from flowctl.api import *  # noqa: F401,F403


def _api() -> dict[str, Any]:
    import flowctl.api as api  # (not `from flowctl import api`: that asks this __getattr__ first)

    return {k: v for k, v in vars(api).items() if not k.startswith("_")}


def __getattr__(name: str) -> Any:
    if name == "__all__":  # `from flowctl import *`
        return sorted(_api())
    if name.startswith("__"):
        raise AttributeError(f"module 'flowctl' has no attribute '{name}'")
    globals().update(_api())  # bound here once: later lookups never come back
    if name not in globals():
        raise AttributeError(f"module 'flowctl' has no attribute '{name}'")
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_api()))
