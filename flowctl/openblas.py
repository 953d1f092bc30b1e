"""OpenBLAS's idle threads, put to sleep at once where numpy loaded OpenBLAS before flowctl.

OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when it is loaded, and its idle threads spin that long after
every threaded product (2**28 cycles, ~0.1 s, by default) on the cores flowctl's intra-op threads
are about to use (flowctl/__init__.py). Importing flowctl first sets it in time. Where numpy came
first, `sleep_at_once` asks the loaded library to read its environment again (`openblas_read_env`)
and stops its threads (`blas_thread_shutdown_`, what its own fork handler calls); the next threaded
product starts them again (`exec_blas` calls `blas_thread_init` while none run), which takes the
timeout it now reads. Both are exported by OpenBLAS builds, numpy's scipy-openblas wheels included.
Called once, at import, before flowctl runs any kernel: stopping the threads under another thread's
product would break that product. Where it cannot (a build without those entry points), `warn_spinning`
says so once, with the two remedies.
"""
from __future__ import annotations

from typing import Any


def _libraries() -> list[Any]:
    from threadpoolctl import ThreadpoolController

    return [lib.dynlib for lib in ThreadpoolController().select(internal_api="openblas").lib_controllers]


def sleep_at_once() -> bool:
    """Make every loaded OpenBLAS take OPENBLAS_THREAD_TIMEOUT from the environment as it is now.
    True if each did, or none is loaded (nothing spins); False: no threadpoolctl, or a build without
    the two entry points."""
    try:
        for lib in _libraries():
            read_env, shutdown = lib.openblas_read_env, lib.blas_thread_shutdown_
            read_env.restype = None
            read_env()
            shutdown()
        return True
    except Exception:  # noqa: BLE001 -- any failure: OpenBLAS keeps spinning (warn_spinning)
        return False


def warn_spinning() -> None:
    import warnings

    warnings.warn(
        "numpy was imported before flowctl and its OpenBLAS could not be made to read "
        "OPENBLAS_THREAD_TIMEOUT again, so its idle threads spin for ~0.1 s after each threaded "
        "product, on the cores flowctl's CPU kernels split their work over: measured on 2 cores, "
        "Inception-v3's training step at batch 8 took 2.4 s against 1.7 s. Import flowctl before "
        "numpy, or set OPENBLAS_THREAD_TIMEOUT=4 in the environment.", RuntimeWarning, stacklevel=3)
