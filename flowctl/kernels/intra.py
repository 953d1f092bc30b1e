"""Intra-op parallelism on the CPU: one kernel's independent pieces on several cores.

TensorFlow runs a kernel's pieces on an intra-op thread pool (Eigen's, sized by
`intra_op_parallelism_threads`) beside the inter-op pool that runs ready nodes. Here numpy's BLAS
already splits a large GEMM over its own threads, but everything else a convolution, a batch norm
or a pool does (gathering windows, col2im additions, normalising, masking) is a numpy pass on one
core. These kernels already work in pieces so each piece stays in cache; `run` hands the pieces to
a small pool of threads (numpy releases the GIL inside its loops and BLAS calls), and while they
run, BLAS is one thread per caller so the cores are not asked for twice.

Measured on a 2-core VM, batch 8, one thread against two: the large passes (Inception-v3's
147x147 and 73x73 layers, 20-85 pieces each) run 1.1-1.35x faster with two one-thread GEMMs on two
runs of pieces than with OpenBLAS's two threads on each piece, batch norm's gradient at
147x147x64 1.36x. A pass of one piece stays on the calling thread with BLAS's own threads (`least`
in `for_chunks`); passes of 2-16 pieces, first measured at 0.6x here, go to the threads too since
OpenBLAS's idle threads no longer spin beside them (flowctl/__init__.py): Inception-v3's
convolutions at batch 8 then ran 1.09-1.35x faster per pass (kernels/conv.py, PARALLEL_PIECES).
With another process on the machine the difference grows: OpenBLAS's
threads spin waiting for each other, and one such run took 612 ms for the 147x147 convolution
that the pieces on two threads did in 83.

The thread count is the BLAS pool's (one knob for a device's `threads`: `runtime.blas_limits`,
the profiler and the Ray workers already set it per device). Results never depend on it: a
kernel's pieces are fixed by the shapes alone, and whatever the pieces sum into is combined in
piece order (or in fixed groups) on the calling thread, so one thread and four give the same
bits. Tasks inside tasks run in line.

Waking a pool thread costs 60-90 us on the VMs measured: a kernel of a few hundred microseconds
(the packed recurrent product) shares its pieces with kernels/cpu/team.py's helpers instead, which
spin in compiled code between such kernels.

Only OpenBLAS (numpy's wheels) can be asked for one thread per caller cheaply; with another BLAS
every kernel runs its pieces on the calling thread, as before.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")

_local = threading.local()  # .inside: this thread is running a task of `run`
_lock = threading.Lock()
_state: dict[str, Any] = {"pool": None, "workers": 0, "blas": None, "active": 0, "saved": 0}


class _OpenBLAS:
    """openblas_{get,set}_num_threads of the OpenBLAS numpy loaded, called directly: threadpoolctl's
    setter ignores every thread but the one that first took control, and the runtime's device
    threads are not that thread."""

    def __init__(self, dynlib: Any, prefix: str, suffix: str) -> None:
        self._get = getattr(dynlib, f"{prefix}_get_num_threads{suffix}")
        self._set = getattr(dynlib, f"{prefix}_set_num_threads{suffix}")

    def get(self) -> int:
        return int(self._get())

    def set(self, n: int) -> None:
        self._set(int(n))


def _find_blas() -> _OpenBLAS | bool:
    """numpy's OpenBLAS. Another can be loaded beside it: numba imports scipy, whose wheels carry
    their own OpenBLAS, and threadpoolctl may list that one first. Asking scipy's for one thread
    left numpy's at two under each of two pieces: Inception-v3's convolutions ran 3-4x their time
    (a training step at batch 8 9.7 s against 2.9), depending on which library loaded first."""
    try:
        import numpy
        from threadpoolctl import ThreadpoolController

        libs = [lib for lib in ThreadpoolController().select(user_api="blas").lib_controllers
                if lib.internal_api == "openblas"]
        home = os.path.realpath(os.path.dirname(numpy.__file__))  # numpy/, and a wheel's numpy.libs/
        libs.sort(key=lambda lib: not os.path.realpath(lib.filepath or "").startswith(home))
        for lib in libs:
            for prefix in ("scipy_openblas", "openblas"):
                for suffix in ("64_", ""):
                    if hasattr(lib.dynlib, f"{prefix}_set_num_threads{suffix}"):
                        return _OpenBLAS(lib.dynlib, prefix, suffix)
    except Exception:  # noqa: BLE001 -- no threadpoolctl or an odd BLAS: pieces run in line
        pass
    return False


def _blas() -> _OpenBLAS | None:
    if _state["blas"] is None:
        _state["blas"] = _find_blas()
    return _state["blas"] or None


def threads() -> int:
    """How many threads a kernel's pieces may use now: `fixed(n)` or `FLOWCTL_INTRA_OP=n` if set
    (1 turns intra-op parallelism off), else the BLAS pool's size; 1 inside a task or without
    OpenBLAS."""
    if getattr(_local, "inside", False):
        return 1
    forced = _state.get("fixed") or _from_environment()
    if forced:
        return max(1, forced) if _blas() is not None else 1
    blas = _blas()
    if blas is None:
        return 1
    with _lock:
        if _state["active"]:  # another kernel's tasks hold BLAS at one thread: it had this many
            return _state["saved"]
    return blas.get()


def _from_environment() -> int | None:
    text = os.environ.get("FLOWCTL_INTRA_OP", "").strip()
    return int(text) if text.isdigit() else None  # anything but a count: as if unset


@contextmanager
def fixed(n: int) -> Iterator[None]:
    """Kernels use exactly `n` intra-op threads while the context is open (tests, benchmarks)."""
    before = _state.get("fixed")
    _state["fixed"] = n
    try:
        yield
    finally:
        _state["fixed"] = before


def _forget_pool_in_child() -> None:
    """A forked child has the pool object but none of its threads: it makes its own."""
    _state.update(pool=None, workers=0, active=0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def _pool(workers: int) -> ThreadPoolExecutor:
    with _lock:
        if _state["workers"] < workers:
            old = _state["pool"]
            _state["pool"] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flowctl-intra")
            _state["workers"] = workers
            if old is not None:
                old.shutdown(wait=False)
        return _state["pool"]


def _enter() -> None:
    """BLAS to one thread per caller while any kernel's tasks run (counted: two device threads may
    both be inside `run`; the last one out restores the size)."""
    blas = _blas()
    assert blas is not None
    with _lock:
        if _state["active"] == 0:
            _state["saved"] = blas.get()
            blas.set(1)
        _state["active"] += 1


def _leave() -> None:
    blas = _blas()
    assert blas is not None
    with _lock:
        _state["active"] -= 1
        if _state["active"] == 0:
            blas.set(_state["saved"])


def run(tasks: Sequence[Callable[[], T]], workers: int | None = None) -> list[T]:
    """Each task's result, in order. With more than one thread (see `threads`) the tasks are taken
    in turn by the calling thread and up to threads-1 pool threads, whichever is free; otherwise
    they run in order on the calling thread. A task's exception is raised here once every task
    has finished or been skipped."""
    n = min(threads() if workers is None else workers, len(tasks))
    if n <= 1:
        return [fn() for fn in tasks]
    results: list[Any] = [None] * len(tasks)
    errors: list[BaseException] = []
    taken = iter(range(len(tasks)))
    take = threading.Lock()

    def drain() -> None:
        _local.inside = True
        try:
            while not errors:
                with take:
                    i = next(taken, None)
                if i is None:
                    return
                try:
                    results[i] = tasks[i]()
                except BaseException as e:  # noqa: BLE001 -- raised on the calling thread
                    errors.append(e)
        finally:
            _local.inside = False

    pool = _pool(n - 1)
    _enter()
    try:
        helpers = [pool.submit(drain) for _ in range(n - 1)]
        drain()
        for f in helpers:
            f.result()
    finally:
        _leave()
    if errors:
        raise errors[0]
    return results


def chunks(n: int, parts: int) -> list[range]:
    """range(n) cut into at most `parts` consecutive runs of near-equal length."""
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i + 1] > bounds[i]]


def for_chunks(n: int, body: Callable[[range], T], parts: int | None = None, xp: Any = None,
               least: int = 1) -> list[T]:
    """body(run) over range(n) cut into one run per thread (or into `parts` runs, whatever the
    thread count), results in order. The runs go to the intra-op threads when there are at least
    `least` items (below it the threads cost more than they give: see the callers' measurements);
    for another array module than numpy (a GPU's, whose work is queued on the calling thread's
    stream) the runs are made the same way but run in line."""
    runs = chunks(n, parts or threads())
    if n < least or (xp is not None and getattr(xp, "__name__", "numpy") != "numpy"):
        return [body(r) for r in runs]
    return run([(lambda r=r: body(r)) for r in runs])
