"""The launch ledger: the GPU array module over numpy, counting and capturing (issue 30, item 5).

A GPU step is captured as one CUDA graph and replayed. Most machines that build flowctl have no
GPU, so this module stands in for the device module (`kernels/cuda/xp.py`, cupy's names plus
`matmul`, `dot`, `gemm`, `launch`, `is_capturing`, `host`) on numpy data:

    ledger = Ledger()
    with override_array_module("gpu", ledger):
        sess = Session(graph, device="gpu:0")   # every "gpu" kernel is bound with xp = ledger
        sess.run(...)                          # warm-up
        ledger.reset_counts(); sess.run(...)   # ledger.counts: what one step did

What it models of cupy and CUDA:

- Arrays live "on the device": `ledger.ndarray` is `LedgerArray`, an `np.ndarray` subclass. Every
  operation on one -- a ledger function, a ufunc or numpy function reached through `np.` or a
  method (`__array_ufunc__`, `__array_function__`), the methods that do not dispatch (astype, copy,
  fill, take, sort, ..., `__getitem__` with an index array, `__setitem__`) -- runs numpy on the
  plain data and counts ONE kernel launch when it writes data (`counts["launches"]`). A view
  (reshape of a contiguous array, transpose, basic indexing, broadcast_to, ...) launches nothing.
  Like cupy, reductions and integer indexing give 0-d device arrays, not host scalars.
- Host synchronisations (`counts["syncs"]`): reading a device value on the host -- `float`, `int`,
  `bool`, `__index__`, `item`, `tolist`, `get()`, `host(x)`, a repr -- and the operations whose
  output shape depends on the data, which cupy computes by reading a count back (boolean-mask
  indexing, `nonzero`, `flatnonzero`, `argwhere`, `unique`, `compress`, `extract`, one-argument
  `where`, `repeat` by an array).
- Asynchronous reads (`counts["d2h_async"]`, `counts["waits"]`): a captured step's backend queues
  copies of device arrays to host buffers behind the step (`LedgerCapture.read_async`, cupy's
  `get(stream=, out=pinned, blocking=False)` and an event); each array copied counts one
  `d2h_async`, the host's wait for them one `waits`, and neither is a synchronisation: the device
  is not drained, the host only waits, later, for work it queued before the next step. The copy
  is taken when it is queued (the ledger runs in order), so a later step's writes never reach it.
- Host-to-device copies (`counts["h2d"]`, `counts["h2d_bytes"]`): `asarray`/`array`/
  `ascontiguousarray` of anything not already on the device (a numpy array, a list, a Python or
  numpy scalar) and a host array assigned into a device array or used as an index. A Python or
  numpy scalar operand of a ufunc is no copy (cupy passes it by value). A numpy array operand of
  a ufunc or function raises TypeError, as cupy does ("Unsupported type <class 'numpy.ndarray'>").
- The caching memory pool (`counts["allocations"]`, `counts["bytes_allocated"]`): every
  LedgerArray that owns its buffer takes a block of its size rounded up to 512 bytes from the
  ledger's free list (exact size), or counts a new device allocation (a cudaMalloc); the block
  returns to the free list when the array is collected. A second identical step allocates nothing.
- Matrix products: `xp.matmul`, `xp.dot` (up to 2-D), `xp.gemm` are ours (cuBLAS through ctypes,
  capture-safe) and count one launch per GEMM (`counts["gemms"]`; a batched matmul is one GEMM per
  batch entry, as `blas.matmul` does). `a @ b`, `np.matmul`, `np.dot`, `einsum`, `tensordot`,
  `inner`, `vdot` and `linalg` on device arrays are cupy's own cuBLAS/cuSOLVER calls: counted, and
  refused while capturing.
- Custom kernels: `xp.launch(kernel, grid, block, *args)` runs numba's CUDA simulator
  (`cuda/jit.launch_simulated`; needs NUMBA_ENABLE_CUDASIM=1) and counts `launches` and `custom`.
- CUDA-graph capture: `with ledger.capture() as cap: ...` (or `begin_capture()`/`end_capture()`),
  then `cap.graph`, a `LedgerGraph`. While capturing, a sync, an h2d copy or a cupy cuBLAS call
  raises `CaptureError`, and every launch is also recorded on a tape as a closure that recomputes
  it from the same input buffers into the same output buffer (a Python or numpy scalar operand is
  baked in by value, as a kernel argument is in a graph node). `graph.launch()` replays the tape:
  the recorded kernels on the same buffers, no Python of the step, so a kernel that keeps state on
  the host (a counter incremented in Python, a mask drawn by a host generator) visibly misbehaves.
  The tape holds plain views of the pool blocks, never the device arrays themselves (a graph node
  holds an address: a tape that held arrays would count as a holder, and the engine's in-place
  update and buffer-forwarding checks, which count references, would decide differently under
  capture); the blocks it touches are pinned at the end of the capture -- the graph's static
  buffers, never handed out again, as a graph's private pool is not.
  Unlike a real capture, the captured step also really computes once, on numpy, so the Python
  driving it sees plausible values (a real capture executes nothing until the first replay).

What it does not model: streams, events and asynchrony (everything is synchronous; `Ready`
copies are not used: `cupy_or_none()` is None here); timing; the pool's block splitting and its
per-stream free lists (an exact-size free list stands in); cupy's dtype rules where they differ
from numpy's; `np.asarray(device_array)` by code outside the ledger (numpy takes a subclass's data
without asking it, so that implicit copy to the host is neither counted nor refused, where cupy
raises); work a kernel does on plain numpy arrays it made on the host (invisible until it is
copied in, which counts as h2d); numba launches record their arguments by reference, so a host
array passed to one is not refused.
"""
from __future__ import annotations

import contextlib
import threading
import types
import weakref
from typing import Any, Callable, Iterator

import numpy as np

from flowctl.kernels.cuda import jit
from flowctl.kernels.ledger_array import (BLOCK, JOIN_TABLE, CaptureError, LedgerArray, _Block, _BLAS,
                                            _DATA_SHAPED, _JOINS, _NO_DATA, _NO_LAUNCH, _Ufunc, _block_of,
                                            _plain, _ptr, _root)


COUNTS = ("launches", "syncs", "h2d", "h2d_bytes", "allocations", "bytes_allocated", "gemms", "custom",
          "graph_launches", "graph_nodes", "d2h_async", "waits")


class LedgerGraph:
    """A captured step: `launch()` replays the recorded kernels, in order, on the same buffers."""

    def __init__(self, ledger: "Ledger", tape: list[tuple[str, Callable[[], Any]]], keep: list[Any]) -> None:
        self.ledger = ledger
        self.tape = tape
        self.keep = keep  # the graph's static buffers: alive as long as the graph

    @property
    def nodes(self) -> int:
        return len(self.tape)

    def names(self) -> list[str]:
        """What each node is (the kernel's name), in order."""
        return [w for w, _ in self.tape]

    def launch(self, stream: Any = None) -> None:
        led = self.ledger
        if led._tape is not None:
            raise CaptureError("a graph launched inside a capture")
        for _, fn in self.tape:
            fn()
        led.counts["graph_launches"] += 1
        led.counts["graph_nodes"] += len(self.tape)


class _Capture:
    graph: LedgerGraph | None = None


class LedgerCapture:
    """The capture backend the engine's captured step asks for (`cuda/graphs.py` `CupyCapture`'s
    methods) over the ledger: its graph is a LedgerGraph. The captured step also computes while it
    is recorded (`ran_during_capture`), so the engine does not launch the graph for that step."""

    ran_during_capture = True

    def __init__(self, ledger: "Ledger") -> None:
        self.ledger = ledger

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        yield  # one stream, one pool: nothing to make current

    def begin(self) -> None:
        self.ledger.begin_capture()

    def end(self, rerun: Any = None) -> LedgerGraph:
        return self.ledger.end_capture()

    def abandon(self) -> None:
        self.ledger.abandon_capture()

    def launch(self, graph: LedgerGraph) -> None:
        graph.launch()

    def upload(self, graph: LedgerGraph) -> None:
        pass

    def copy_in(self, dst: Any, value: Any) -> None:
        """A value into a static buffer: a device copy (one launch) or a host-to-device copy."""
        self.ledger._copy_in(dst, value)

    def read_async(self, arrays: Any) -> "LedgerRead":
        """Copies of device arrays to the host queued behind the step (see the module doc)."""
        return self.ledger._read_async(arrays)

    def synchronize(self) -> None:
        self.ledger._sync("stream synchronize")

    def held_bytes(self) -> int:
        led = self.ledger
        return led.in_use + sum(size * n for size, n in led._free.items())


class LedgerRead:
    """Host copies queued behind a step: `wait()` hands them over (counted once as a wait)."""

    def __init__(self, ledger: "Ledger", values: list[Any]) -> None:
        self.ledger, self.values, self.waited = ledger, values, False

    def wait(self) -> list[Any]:
        if not self.waited:
            self.waited = True
            self.ledger.counts["waits"] += 1
            self.ledger._event("wait", f"{len(self.values)} asynchronous read(s)")
        return self.values


class Ledger(types.ModuleType):
    """The array module over numpy that counts and captures (see the module doc)."""

    def __init__(self, name: str = "flowctl_ledger_xp", run_kernels: bool = True) -> None:
        """`run_kernels` False: count our own (numba) kernels' launches without running them in the
        simulator, and hand out zeroed blocks -- for counting a full-size model's step (`flowctl
        bench launches`), where the simulator would take hours; the values are then not the step's."""
        super().__init__(name, __doc__)
        self.run_kernels = run_kernels
        self.ndarray = type("LedgerArray", (LedgerArray,), {"_ledger": self, "__module__": __name__})
        self.counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self.events: list[tuple[str, str | None, str]] = []  # (kind, tag, what): syncs, h2d, allocations
        self.tag: str | None = None  # who is running (a node name: `instrument`)
        self.device_kind = "gpu"
        self.simulated = True
        self.numpy = np
        self._free: dict[int, int] = {}
        self.in_use = 0  # bytes of live blocks
        self._lock = threading.RLock()
        self._tape: list[tuple[str, Callable[[], Any]]] | None = None
        self._touched: dict[int, Any] = {}  # blocks a capture's tape reads or writes
        self._pinned: set[int] = set()  # blocks held by captured graphs: never handed out again
        self._untracked: list[str] = []
        self._populate()

    # ------------------------------------------------------------------ the module's names
    def _populate(self) -> None:
        d = self.__dict__
        for k, v in vars(np).items():
            if k.startswith("_") or k in d:
                continue
            if isinstance(v, np.ufunc):
                d[k] = _Ufunc(self, v)
            elif isinstance(v, type) or isinstance(v, types.ModuleType) or not callable(v) or k in _NO_DATA:
                d[k] = v
            else:
                d[k] = self._function(v, k)
        d["ndarray"] = self.ndarray
        d["linalg"] = self._submodule(np.linalg, "linalg", blas=True)
        d["fft"] = self._submodule(np.fft, "fft", blas=False)
        lib = types.ModuleType(f"{self.__name__}.lib")  # stride tricks: views (cupy has the same)
        lib.stride_tricks = self._submodule(np.lib.stride_tricks, "lib.stride_tricks", blas=False)
        d["lib"] = lib
        for k in ("asarray", "asanyarray", "array", "ascontiguousarray", "asfortranarray", "copy", "matmul",
                  "dot", "gemm", "launch", "is_capturing", "host", "get_array_module"):
            d[k] = getattr(self, "_x_" + k)

    def _function(self, f: Any, name: str) -> Callable[..., Any]:
        def fn(*args: Any, **kwargs: Any) -> Any:
            return self._call(f, args, kwargs, name)

        fn.__name__ = name
        fn.__doc__ = getattr(f, "__doc__", None)
        return fn

    def _submodule(self, mod: types.ModuleType, name: str, blas: bool) -> types.ModuleType:
        sub = types.ModuleType(f"{self.__name__}.{name}")
        for k, v in vars(mod).items():
            if k.startswith("_"):
                continue
            if callable(v) and not isinstance(v, type):
                sub.__dict__[k] = self._function(v, f"{name}.{k}" if blas else k)
            else:
                sub.__dict__[k] = v
        return sub

    # ------------------------------------------------------------------ counts
    def reset_counts(self) -> None:
        for k in self.counts:
            self.counts[k] = 0
        self.events.clear()

    def step_counts(self) -> dict[str, int]:
        """A copy of the counts."""
        return dict(self.counts)

    @contextlib.contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        before, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = before

    def _event(self, kind: str, what: str) -> None:
        self.events.append((kind, self.tag, what))

    def _sync(self, what: str, refuse: bool = True) -> None:
        if refuse and self._tape is not None:
            raise CaptureError(f"host synchronisation ({what}) during a CUDA-graph capture"
                               + (f" in {self.tag}" if self.tag else ""))
        self.counts["syncs"] += 1
        self._event("sync", what)

    def _pointer_table(self, name: str, n: int) -> None:
        """cupy joins many arrays in one kernel that reads a table of their pointers, copied from
        the host first (seen on an H200: the capture of lstm_lm's step failed in a Concat of 35
        arrays with "the current stream is capturing, so H2D transfers are disallowed")."""
        if self._tape is not None:
            raise CaptureError(f"host-to-device copy (the pointer table of {name} over {n} arrays) during a "
                               f"CUDA-graph capture" + (f" in {self.tag}" if self.tag else ""))
        self.counts["h2d"] += 1
        self._event("h2d", f"{name}: a table of {n} pointers")

    def _h2d(self, host: Any, what: str) -> Any:
        """A copy of host data onto the device: a new owning LedgerArray."""
        if self._tape is not None:
            raise CaptureError(f"host-to-device copy ({what}) during a CUDA-graph capture"
                               + (f" in {self.tag}" if self.tag else ""))
        h = np.asarray(host)
        self.counts["h2d"] += 1
        self.counts["h2d_bytes"] += h.nbytes
        self._event("h2d", what)
        return self._own(h)

    def _launch(self, what: str, replay: Callable[[], Any] | None) -> None:
        self.counts["launches"] += 1
        if self._tape is not None and replay is not None:
            self._tape.append((what, replay))

    def _blas(self, what: str) -> None:
        if self._tape is not None:
            raise CaptureError(f"{what}: cupy's own cuBLAS/cuSOLVER call during a CUDA-graph capture (cupy "
                               f"refuses it); call xp.matmul / xp.gemm" + (f" in {self.tag}" if self.tag else ""))
        self.counts["gemms"] += 1

    # ------------------------------------------------------------------ the pool
    def _allocate(self, arr: np.ndarray) -> None:
        """A LedgerArray numpy made with a buffer of its own (not laid over a block): counted as a
        new allocation; while capturing, a gap (the ledger put no launch for it on the tape)."""
        if self._tape is not None:
            self._untracked.append(f"{arr.dtype}{arr.shape}")
        size = -(-arr.nbytes // BLOCK) * BLOCK
        if size:
            self.counts["allocations"] += 1
            self.counts["bytes_allocated"] += size
            self._event("allocation", f"{size} bytes (numpy's own)")

    def _block(self, nbytes: int) -> _Block:
        size = -(-nbytes // BLOCK) * BLOCK
        with self._lock:
            free = self._free.get(size)
            if free:
                b = free.pop()
            else:
                b = np.ndarray.__new__(_Block, (size,), np.uint8)
                if not self.run_kernels:
                    b.fill(0)  # our kernels do not run: their outputs must hold finite values
                if size:
                    self.counts["allocations"] += 1
                    self.counts["bytes_allocated"] += size
                    self._event("allocation", f"{size} bytes")
            self.in_use += size
        return b

    def _release(self, block: _Block) -> None:
        with self._lock:
            self.in_use -= block.nbytes
            if id(block) not in self._pinned:
                self._free.setdefault(block.nbytes, []).append(block)

    def free_blocks(self) -> int:
        return sum(len(v) for v in self._free.values())

    def _new(self, shape: Any, dtype: Any) -> LedgerArray:
        """A new device array on a pool block (uninitialised, C-ordered)."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        b = self._block(nbytes)
        a = np.ndarray.__new__(self.ndarray, shape, dtype, buffer=b, offset=0)
        weakref.finalize(a, self._release, b)
        return a

    def plain(self, x: LedgerArray) -> np.ndarray:
        """A plain numpy view of `x`'s memory that holds its block, not `x` (a kernel node of a
        CUDA graph holds an address, not the array: a tape must not count as a holder)."""
        b = _block_of(x)
        if b is None:
            return np.ndarray.view(x, np.ndarray)
        if self._tape is not None:
            self._touched[id(b)] = b
        if x.size == 0:
            return np.ndarray(x.shape, x.dtype, buffer=b, offset=0)
        return np.ndarray(x.shape, x.dtype, buffer=b, offset=_ptr(x) - _ptr(b), strides=x.strides)

    def _own(self, r: Any) -> LedgerArray:
        """A new device array (a pool block) holding `r`'s values."""
        r = np.asarray(r)
        a = self._new(r.shape, r.dtype)
        np.copyto(np.ndarray.view(a, np.ndarray), r, casting="unsafe")
        return a

    def _view_of(self, root: LedgerArray, r: np.ndarray) -> LedgerArray:
        """`r` (a plain view into `root`'s buffer) as a LedgerArray whose base is `root`."""
        try:
            off = r.__array_interface__["data"][0] - root.__array_interface__["data"][0]
            return np.ndarray.__new__(self.ndarray, r.shape, r.dtype, buffer=root, offset=off, strides=r.strides)
        except (TypeError, ValueError, BufferError):
            return r.view(self.ndarray)

    # ------------------------------------------------------------------ operands and results
    def _operand(self, x: Any, what: str) -> Any:
        if isinstance(x, LedgerArray):
            return self.plain(x)
        if isinstance(x, np.ndarray):
            raise TypeError(f"{what}: a host numpy array operand ({x.dtype}{x.shape}); cupy refuses implicit "
                            f"host->device conversion (copy it with xp.asarray)")
        if isinstance(x, list):
            return [self._operand(i, what) for i in x]
        if type(x) is tuple:
            return tuple(self._operand(i, what) for i in x)
        return x

    def _roots(self, args: Any, out: dict[int, LedgerArray]) -> dict[int, LedgerArray]:
        """The owning arrays of the device arrays among `args`, by the id of their block."""
        for x in args:
            if isinstance(x, LedgerArray):
                out[id(_block_of(x))] = _root(x)
            elif isinstance(x, (list, tuple)):
                self._roots(x, out)
            elif isinstance(x, dict):
                self._roots(list(x.values()), out)
        return out

    def _results(self, r: Any, roots: dict[int, LedgerArray], dsts: list[tuple[int, LedgerArray]],
                 scalars: bool) -> tuple[Any, bool]:
        """Wrap numpy's result: views of an input stay views; new data becomes new device arrays,
        listed in `dsts` as (leaf position, array). Returns (result, any new data)."""
        if isinstance(r, (list, tuple)) and not isinstance(r, np.ndarray):
            leaves, new = [], False
            for i, x in enumerate(r):
                w, n = self._leaf(x, roots, dsts, i, scalars)
                leaves.append(w)
                new = new or n
            return (type(r)(leaves) if type(r) in (list, tuple) else type(r)(*leaves)), new
        return self._leaf(r, roots, dsts, -1, scalars)

    def _leaf(self, x: Any, roots: dict[int, LedgerArray], dsts: list[tuple[int, LedgerArray]], i: int,
              scalars: bool) -> tuple[Any, bool]:
        if isinstance(x, LedgerArray):
            return x, False
        if isinstance(x, np.ndarray):
            b = _block_of(x)
            root = roots.get(id(b)) if b is not None else None
            if root is not None:
                return self._view_of(root, x), False
        elif isinstance(x, np.generic) or (scalars and isinstance(x, (bool, int, float, complex))):
            pass
        else:
            return x, False
        a = self._own(x)
        dsts.append((i, a))
        return a, True

    def _run(self, what: str, call: Callable[[], Any], roots: dict[int, LedgerArray], out: Any = None,
             scalars: bool = True, inplace: bool = False) -> Any:
        """Run numpy, wrap its result, count the launch and put it on the tape."""
        r = call()
        if out is not None:  # written into given arrays: the same call replays
            self._launch(what, call)
            return out
        dsts: list[tuple[int, LedgerArray]] = []
        res, new = self._results(r, roots, dsts, scalars)
        if res is None or inplace:
            self._launch(what, call)
        elif new:
            plains = [(i, self.plain(a)) for i, a in dsts] if self._tape is not None else []

            def replay() -> None:
                v = call()
                for i, p in plains:
                    np.copyto(p, v if i < 0 else v[i], casting="unsafe")

            self._launch(what, replay)
        return res

    # ------------------------------------------------------------------ ufuncs and functions
    def _ufunc(self, uf: np.ufunc, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        what = uf.__name__ if method == "__call__" else f"{uf.__name__}.{method}"
        if uf is np.matmul:
            self._blas("a @ b / np.matmul")
        ins = [self._operand(a, what) for a in args]
        kw = dict(kwargs)
        out = kw.get("out")
        given = None
        if out is not None:
            outs = out if isinstance(out, tuple) else (out,)
            kw["out"] = tuple(None if o is None else self._operand(o, what) for o in outs)
            given = outs[0] if len(outs) == 1 else outs
        if isinstance(kw.get("where"), np.ndarray):
            kw["where"] = self._operand(kw["where"], what)
        f = getattr(uf, method)
        roots = self._roots(args, {})
        res = self._run(what, lambda: f(*ins, **kw), roots, out=given, inplace=method == "at")
        return None if method == "at" else res

    def _call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
        short = name.rsplit(".", 1)[-1]
        if short in _NO_DATA:
            return func(*[_plain(a) for a in args], **{k: _plain(v) for k, v in kwargs.items()})
        if short in _BLAS or name.startswith("linalg."):
            self._blas(name)
        if short in _JOINS and args and isinstance(args[0], (list, tuple)) and len(args[0]) > JOIN_TABLE:
            self._pointer_table(name, len(args[0]))
        if short in _DATA_SHAPED or (short == "where" and len(args) + len(kwargs) == 1) or \
                (short == "repeat" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), np.ndarray)):
            self._sync(f"{name} (an output shape that depends on the data)")
        ins = self._operand(list(args), name)
        kw = {k: self._operand(v, name) for k, v in kwargs.items()}
        out = kwargs.get("out")
        roots = self._roots(list(args) + list(kwargs.values()), {})
        if short in _NO_LAUNCH:
            r = func(*ins, **kw)
            return self._new(r.shape, r.dtype)
        return self._run(name, lambda: func(*ins, **kw), roots, out=out if isinstance(out, LedgerArray) else None,
                         inplace=short in ("copyto", "put", "place", "putmask", "fill_diagonal", "put_along_axis",
                                           "fill", "sort", "partition"))

    # ------------------------------------------------------------------ indexing
    def _index(self, key: Any) -> tuple[Any, bool]:
        """The key with device arrays unwrapped (host index arrays are copies in); whether it masks."""
        mask = False
        parts = key if type(key) is tuple else (key,)
        out = []
        for k in parts:
            if isinstance(k, LedgerArray):
                mask = mask or k.dtype == bool
                out.append(self.plain(k))
            elif isinstance(k, (np.ndarray, list)):
                h = self._h2d(k, "host index array")
                mask = mask or h.dtype == bool
                out.append(self.plain(h))
            else:
                out.append(k)
        return (tuple(out) if type(key) is tuple else out[0]), mask

    def _getitem(self, a: LedgerArray, key: Any) -> Any:
        k, mask = self._index(key)
        if mask:
            self._sync("boolean-mask indexing (an output shape that depends on the data)")
        plain = self.plain(a)
        r = plain[k]
        if not isinstance(r, np.ndarray):  # an element: cupy gives a 0-d device array
            kk = (k if type(k) is tuple else (k,)) + (Ellipsis,)
            r = plain[kk]
            if _block_of(r) is None or _block_of(r) is not _block_of(a):
                return self._run("getitem", lambda: plain[kk], {})
            return self._view_of(_root(a), r)
        if _block_of(r) is not None and _block_of(r) is _block_of(a):
            return self._view_of(_root(a), r)
        return self._run("getitem", lambda: plain[k], {})

    def _setitem(self, a: LedgerArray, key: Any, value: Any) -> None:
        k, _ = self._index(key)
        if isinstance(value, LedgerArray):
            v = self.plain(value)
        elif isinstance(value, (np.ndarray, list)):
            v = self.plain(self._h2d(value, "host array assigned into a device array"))
        else:
            v = value
        plain = self.plain(a)

        def call() -> None:
            plain[k] = v

        self._run("setitem", call, {}, inplace=True)

    # ------------------------------------------------------------------ the device module's extras
    def _x_asarray(self, a: Any, dtype: Any = None, order: Any = None, **kw: Any) -> Any:
        if isinstance(a, LedgerArray):
            if (dtype is None or np.dtype(dtype) == a.dtype) and \
                    (order not in ("C", "F") or a.flags[order + "_CONTIGUOUS"]):
                return a
            return self._call(np.array, (a,), {"dtype": dtype, "order": order or "K"}, "asarray")
        return self._h2d(np.asarray(a, dtype=dtype, order=order), "asarray")

    _x_asanyarray = _x_asarray

    def _x_array(self, a: Any, dtype: Any = None, copy: bool | None = True, order: str = "K", ndmin: int = 0,
                 **kw: Any) -> Any:
        if isinstance(a, LedgerArray):
            if not copy and ndmin <= a.ndim:
                return self._x_asarray(a, dtype)
            return self._call(np.array, (a,), {"dtype": dtype, "copy": True, "order": order, "ndmin": ndmin},
                              "array")
        return self._h2d(np.array(a, dtype=dtype, order=order, ndmin=ndmin), "array")

    def _x_ascontiguousarray(self, a: Any, dtype: Any = None, **kw: Any) -> Any:
        return self._x_asarray(a, dtype, order="C")

    def _x_asfortranarray(self, a: Any, dtype: Any = None, **kw: Any) -> Any:
        return self._x_asarray(a, dtype, order="F")

    def _x_copy(self, a: Any, order: str = "K", **kw: Any) -> Any:
        return self._x_array(a, copy=True, order=order)

    def _x_gemm(self, a: Any, b: Any, out: Any = None, alpha: float = 1.0, beta: float = 0.0) -> Any:
        """out = alpha * (a @ b) + beta * out, one GEMM (capture-safe, as cuda/blas.py's)."""
        m, k = a.shape
        k2, n = b.shape
        if k != k2:
            raise ValueError(f"gemm: shapes {a.shape} and {b.shape} do not align")
        dtype = str(a.dtype)
        if str(b.dtype) != dtype or dtype not in ("float32", "float64", "float16", "bfloat16"):
            raise TypeError(f"gemm: operands of {a.dtype} and {b.dtype}")
        pa, pb = self._operand(a, "gemm"), self._operand(b, "gemm")
        if out is None:
            out = self._x_empty((m, n), a.dtype)
        po = self._operand(out, "gemm")
        wide = dtype == "bfloat16"  # cuBLAS computes bfloat16 in float32 and rounds once: so here
        al, be = (np.float32(alpha), np.float32(beta)) if wide else (po.dtype.type(alpha), po.dtype.type(beta))

        def call() -> None:
            r = np.matmul(pa.astype(np.float32), pb.astype(np.float32)) if wide else np.matmul(pa, pb)
            if alpha != 1.0:
                r *= al
            if beta != 0:
                r = r + (po.astype(np.float32) if wide else po) * be
            po[...] = r.astype(po.dtype) if wide else r

        call()
        self.counts["gemms"] += 1
        self._launch("gemm", call)
        return out

    def _x_empty(self, shape: Any, dtype: Any) -> LedgerArray:
        return self._new(shape, dtype)

    def _x_matmul(self, a: Any, b: Any, out: Any = None) -> Any:
        """np.matmul's semantics through `gemm` (one GEMM per batch entry), as cuda/blas.matmul."""
        from flowctl.kernels.cuda.blas import matmul_by

        r = matmul_by(self, a, b, self._x_gemm)
        if out is not None:
            out[...] = r
            return out
        return r

    def _x_dot(self, a: Any, b: Any, out: Any = None) -> Any:
        if a.ndim == 1 and b.ndim == 1:
            r = (a * b).sum()
        elif a.ndim <= 2 and b.ndim <= 2:
            r = self._x_matmul(a, b)
        else:
            return self._call(np.dot, (a, b), {} if out is None else {"out": out}, "dot")
        if out is not None:
            out[...] = r
            return out
        return r

    def _x_launch(self, kernel: Any, grid: Any, block: Any, *args: Any) -> None:
        """A numba-cuda kernel of ours, in numba's CUDA simulator."""
        _simulator_closures(kernel)
        # (a tuple of arrays -- a multi-tensor update's, cuda/state.py -- passes each as plain too)
        plain = tuple(tuple(self.plain(b) if isinstance(b, LedgerArray) else b for b in a) if type(a) is tuple
                      else self.plain(a) if isinstance(a, LedgerArray) else a for a in args)

        def call() -> None:
            if self.run_kernels:
                jit.launch_simulated(kernel, grid, block, plain)

        call()
        self.counts["custom"] += 1
        self._launch(getattr(kernel, "__name__", "numba kernel"), call)

    def _x_is_capturing(self) -> bool:
        return self._tape is not None

    def _x_host(self, x: Any) -> Any:
        return x.get() if isinstance(x, LedgerArray) else x

    def _x_get_array_module(self, *args: Any) -> Any:
        return self if any(isinstance(a, LedgerArray) for a in args) else np

    # ------------------------------------------------------------------ capture
    def begin_capture(self) -> None:
        if self._tape is not None:
            raise CaptureError("a capture is already under way")
        self._tape, self._touched, self._untracked = [], {}, []

    def abandon_capture(self) -> None:
        """Drop a capture that failed part way."""
        self._tape, self._touched, self._untracked = None, {}, []

    def capture_backend(self) -> LedgerCapture:
        """The engine's capture backend over this ledger (`cuda/graphs.capture_backend`)."""
        return LedgerCapture(self)

    def _copy_in(self, dst: Any, value: Any) -> None:
        if isinstance(value, LedgerArray):
            self._x_copyto(dst, value)
            return
        if self._tape is not None:
            raise CaptureError("host-to-device copy (copy into a static buffer) during a CUDA-graph capture")
        h = np.asarray(value)
        self.counts["h2d"] += 1
        self.counts["h2d_bytes"] += h.nbytes
        self._event("h2d", "copy into a static buffer")
        np.copyto(self._operand(dst, "copy_in"), h, casting="unsafe")

    def _read_async(self, arrays: Any) -> LedgerRead:
        if self._tape is not None:
            raise CaptureError("device-to-host copy (an asynchronous read) during a CUDA-graph capture: it "
                               "would read the capture's values, never a replay's")
        out = []
        for a in arrays:
            if isinstance(a, LedgerArray):
                a = np.array(np.ndarray.view(a, np.ndarray))
                self.counts["d2h_async"] += 1
                self._event("d2h_async", f"{a.dtype}{a.shape}")
            out.append(a)
        return LedgerRead(self, out)

    def _x_copyto(self, dst: Any, src: Any, **kw: Any) -> None:
        self._call(np.copyto, (dst, src), kw, "copyto")

    def end_capture(self) -> LedgerGraph:
        tape, touched, untracked = self._tape, self._touched, self._untracked
        self._tape, self._touched, self._untracked = None, {}, []
        if tape is None:
            raise CaptureError("no capture under way")
        if untracked:
            raise CaptureError(f"{len(untracked)} array(s) made during the capture by numpy itself, which the "
                               f"ledger cannot replay (a gap in the ledger): {untracked[:5]}")
        # The blocks the graph reads and writes are its own from now on: never handed out again
        # (a CUDA graph's private pool lives as long as the graph).
        with self._lock:
            self._pinned.update(touched)
            for size, free in self._free.items():
                self._free[size] = [b for b in free if id(b) not in touched]
        return LedgerGraph(self, tape, list(touched.values()))

    @contextlib.contextmanager
    def capture(self) -> Iterator[_Capture]:
        """Capture the block into `handle.graph` (a LedgerGraph). A failure abandons the capture."""
        handle = _Capture()
        self.begin_capture()
        try:
            yield handle
        except BaseException:
            self.abandon_capture()
            raise
        handle.graph = self.end_capture()


class _SimulatedCuda:
    """Stands in for `numba.cuda` in a kernel's closure cell: inside a simulated launch, numba's
    per-launch fake module (cuda.grid, threadIdx, shared arrays); outside one, numba.cuda itself."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        from numba.cuda.simulator.kernel import _get_kernel_context  # type: ignore[import-not-found]

        ctx = _get_kernel_context()
        return getattr(self._real if ctx is None else ctx, name)


_patched: set[int] = set()


def _simulator_closures(kernel: Any) -> None:
    """numba's simulator swaps `numba.cuda` for its fake module in a kernel's *globals* only; a
    kernel built inside a function (`cuda/kernels.py`'s `_kernels()`) reaches `cuda` through a
    closure cell and would see the real module (AttributeError: no `cuda.grid`). Point such cells,
    in the kernel and the device functions it closes over, at a `_SimulatedCuda` once."""
    fn = getattr(kernel, "fn", None)
    if fn is None or id(kernel) in _patched:
        return
    _patched.add(id(kernel))
    cuda = jit.numba_cuda()
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if v is cuda:
            cell.cell_contents = _SimulatedCuda(cuda)
        elif hasattr(v, "fn") and hasattr(v, "_device"):
            _simulator_closures(v)


def instrument(plan: Any, ledger: Ledger) -> None:
    """Tag the ledger's events with node names while `plan` (an engine Plan) runs: each bound
    kernel (and in-place variant) is wrapped to set `ledger.tag`. For tests and reports only."""
    for i, node in enumerate(plan.nodes):
        k = plan.kernels[i]
        name = f"{node.name} ({node.op})"
        if getattr(node.opdef, "is_async", False):
            continue
        plan.kernels[i] = _tagging(ledger, name, k)
        if plan.into[i] is not None:
            plan.into[i] = _tagging(ledger, name, plan.into[i])
    plan._compiled.clear()


def _tagging(ledger: Ledger, name: str, k: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        before, ledger.tag = ledger.tag, name
        try:
            return k(*args)
        finally:
            ledger.tag = before

    return run
