"""OpenBLAS's idle threads, put to sleep at once where numpy loaded OpenBLAS before flowctl.

OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when it is loaded, and its idle threads spin that long after
every threaded product (2**28 cycles, ~0.1 s, by default) on the cores flowctl's intra-op threads
are about to use (flowctl/__init__.py). Importing flowctl first sets it in time. Where numpy came
first, `sleep_at_once` asks the loaded library to read its environment again (`openblas_read_env`)
and stops its threads (`blas_thread_shutdown_`, what its own fork handler calls); the next threaded
product starts them again (`exec_blas` calls `blas_thread_init` while none run), which takes the
timeout it now reads. Both are exported by OpenBLAS builds, numpy's scipy-openblas wheels included.
Called once, at import, before flowctl runs any kernel: stopping the threads under another thread's
product would break that product.
"""
from __future__ import annotations

from typing import Any

SPINS = False  # set by flowctl/__init__.py where numpy came first and `sleep_at_once` failed


def _libraries() -> list[Any]:
    from threadpoolctl import ThreadpoolController

    return [lib.dynlib for lib in ThreadpoolController().select(internal_api="openblas").lib_controllers]


def sleep_at_once() -> bool:
    """Make every loaded OpenBLAS take OPENBLAS_THREAD_TIMEOUT from the environment as it is now.
    True if each did (False: no threadpoolctl, or a build without the two entry points)."""
    try:
        libs = _libraries()
        for lib in libs:
            read_env, shutdown = lib.openblas_read_env, lib.blas_thread_shutdown_
            read_env.restype = None
            read_env()
            shutdown()
        return bool(libs)
    except Exception:  # noqa: BLE001 -- any failure: OpenBLAS keeps spinning, and intra.py says so
        return False
