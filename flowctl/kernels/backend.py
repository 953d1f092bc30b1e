"""Array modules per device type: numpy for `cpu`, cupy for `gpu`, imported only when asked for."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, Callable

import numpy as np

_cupy: ModuleType | None = None
_cupy_checked = False


def cupy_or_none() -> ModuleType | None:
    """cupy if it imports and sees a device, else None. Never raises: a CPU machine lists no GPU."""
    global _cupy, _cupy_checked
    if not _cupy_checked:
        _cupy_checked = True
        try:
            import cupy  # type: ignore[import-not-found]

            if cupy.cuda.runtime.getDeviceCount() > 0:
                _cupy = cupy
        except Exception:  # no cupy, no driver, or no device: all mean "no GPU here"
            _cupy = None
    return _cupy


def gpu_count() -> int:
    cp = cupy_or_none()
    return 0 if cp is None else int(cp.cuda.runtime.getDeviceCount())


def gpu_properties(index: int) -> dict[str, Any] | None:
    """What the driver says of GPU `index` (name, memory, multiprocessors, compute capability,
    clocks where the runtime still reports them), or None without such a GPU."""
    cp = cupy_or_none()
    if cp is None or index >= gpu_count():
        return None
    rt = cp.cuda.runtime
    props = rt.getDeviceProperties(index)
    name = props.get("name", b"gpu")
    out: dict[str, Any] = {"name": name.decode() if isinstance(name, bytes) else str(name),
                           "memory": int(props.get("totalGlobalMem", 0)),
                           "multiprocessors": int(props.get("multiProcessorCount", 0)),
                           "capability": (int(props.get("major", 0)), int(props.get("minor", 0)))}
    # Clocks left cudaDeviceProp in CUDA 13; the attribute queries remain (13: SM clock kHz,
    # 36: memory clock kHz, 37: bus width bits).
    for key, attr in (("clock_khz", 13), ("memory_clock_khz", 36), ("bus_bits", 37)):
        try:
            out[key] = int(rt.deviceGetAttribute(attr, index))
        except Exception:  # noqa: BLE001 -- an attribute this runtime no longer has
            out[key] = int(props.get({"clock_khz": "clockRate", "memory_clock_khz": "memoryClockRate",
                                      "bus_bits": "memoryBusWidth"}[key], 0))
    return out


def use_gpu(index: int) -> None:
    """Make CUDA device `index` the calling thread's current device (a DistributedSession's thread
    for gpu:<index>), so what its kernels allocate and launch lands on its own GPU. Nothing where
    there is no such GPU, or where a stand-in serves the `gpu` type (the launch ledger)."""
    cp = cupy_or_none()
    if cp is None or "gpu" in _override or not 0 <= index < gpu_count():
        return
    cp.cuda.Device(index).use()


def on_gpu(index: int) -> Any:
    """A context in which cupy allocates on CUDA device `index` (a feed for gpu:<index> moved by
    the session's own thread); a no-op where `use_gpu` would do nothing."""
    import contextlib

    cp = cupy_or_none()
    if cp is None or "gpu" in _override or not 0 <= index < gpu_count():
        return contextlib.nullcontext()
    return cp.cuda.Device(index)


# A stand-in array module per device type (`override_array_module`): the launch ledger runs a GPU
# plan's kernels on the CPU this way, through the same interface the device module gives them.
_override: dict[str, Any] = {}


def array_module(device_type: str) -> Any:
    """numpy for `cpu`; for `gpu` the device module (cupy's names, capture-safe products, our own
    kernels' launcher: `kernels/cuda/xp.py`), or the stand-in a test put there."""
    if device_type in _override:
        return _override[device_type]
    if device_type == "cpu":
        return np
    if device_type == "gpu":
        cp = cupy_or_none()
        if cp is None:
            raise RuntimeError("device type 'gpu' requested but cupy or a CUDA device is not available")
        from flowctl.kernels.cuda.xp import device_module

        return device_module(cp)
    raise ValueError(f"unknown device type {device_type!r}")


class override_array_module:
    """Within the block, `array_module(device_type)` is `module` (the launch ledger, say)."""

    def __init__(self, device_type: str, module: Any) -> None:
        self.device_type, self.module = device_type, module

    def __enter__(self) -> Any:
        self.before = _override.get(self.device_type)
        _override[self.device_type] = self.module
        return self.module

    def __exit__(self, *exc: Any) -> None:
        if self.before is None:
            _override.pop(self.device_type, None)
        else:
            _override[self.device_type] = self.before


def to_host(x: Any) -> Any:
    """A numpy array (or scalar) from a numpy or cupy array."""
    get = getattr(x, "get", None)
    if get is not None and (not isinstance(x, np.ndarray) or type(x).__module__ == "flowctl.kernels.ledger"):
        return get()  # a cupy array, or the launch ledger's stand-in for one (an ndarray subclass)
    return x


# ---------------------------------------------------------------------------- copies between devices
# A GPU's kernels run asynchronously on its stream. A plain copy off the device (`.get()`) or onto
# it (`cupy.asarray`) uses the legacy default stream, so it first waits for *everything* launched
# so far, and the thread making it stalls: a CPU reading one GPU tensor would wait for all the
# kernels the GPU launched after it, and a GPU receiving from the CPU would drain its own queue
# before every copy. As TensorFlow does, copies go on their own stream instead, ordered by events:
# a GPU tensor leaves its device with the event that marks it computed (`ready`), the copy to the
# host waits for that event alone on a copy thread, and a copy onto the GPU is made on the copy
# stream and the compute stream waits for it on the device, not on the host.


class Ready:
    """A GPU array on its way to another device, with the CUDA event recorded after its producer."""

    __slots__ = ("array", "event")

    def __init__(self, array: Any, event: Any) -> None:
        self.array = array
        self.event = event


_copies: dict[str, Any] = {}
_copies_lock = threading.Lock()


def _copy_stream() -> Any:
    with _copies_lock:
        if "stream" not in _copies:
            cp = cupy_or_none()
            assert cp is not None
            _copies["stream"] = cp.cuda.Stream(non_blocking=True)
            _copies["pool"] = ThreadPoolExecutor(max_workers=2, thread_name_prefix="flowctl-d2h")
            _copies["h2d"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowctl-h2d")
        return _copies["stream"]


def mark_ready(x: Any) -> Any:
    """What a Send hands over: a GPU array with its completion event; anything else as it is."""
    cp = cupy_or_none()
    if cp is None or not isinstance(x, cp.ndarray):
        return x
    event = cp.cuda.Event(block=False, disable_timing=True)
    event.record()
    return Ready(x, event)


def receive(value: Any, on_host: bool, xp: Any, done: Callable[[Any, "BaseException | None"], None]) -> None:
    """Deliver `value` (possibly `Ready`) to a Recv on a host (`on_host`) or GPU (`xp`) device by
    calling done(array, None), or done(None, error). Copies between host and GPU run on copy
    threads (one each way), so neither the sending nor the receiving device's thread waits for them."""
    if isinstance(value, Ready):
        if not on_host:  # the same GPU: the stream already orders the reader after the producer
            done(value.array, None)
            return
        stream = _copy_stream()

        def copy() -> None:
            try:
                value.event.synchronize()
                host = value.array.get(stream=stream)  # blocking: waits for this copy stream only
                done(host, None)
            except Exception as e:  # noqa: BLE001 -- reported as the Recv's failure
                done(None, e)

        _copies["pool"].submit(copy)
        return
    if on_host:
        done(to_host(value), None)
        return
    cp = cupy_or_none()
    if cp is None or xp is not cp or isinstance(value, cp.ndarray):
        done(xp.asarray(value), None)
        return
    stream = _copy_stream()

    def upload() -> None:
        try:
            with stream:
                arr = cp.asarray(value)  # host -> device on the copy stream: no wait for queued kernels
            cp.cuda.Stream.null.wait_event(stream.record())  # the compute stream reads it after the copy
            done(arr, None)
        except Exception as e:  # noqa: BLE001 -- reported as the Recv's failure
            done(None, e)

    # On a copy thread, like the copy off a GPU: the sender's thread (whoever delivered the value)
    # goes on at once; a pageable host -> device copy holds its calling thread until it is done.
    _copies["h2d"].submit(upload)


def check_finite(x: Any) -> None:
    """Raise FloatingPointError when a float array holds NaN or Inf (CheckNumerics, §6 lesson 5)."""
    xp = np if isinstance(x, np.ndarray) else (cupy_or_none() if type(x).__module__.startswith("cupy") else None)
    if xp is None or (x.dtype.kind != "f" and x.dtype.name != "bfloat16") or bool(xp.isfinite(x).all()):
        return
    n_nan = int(xp.isnan(x).sum())
    n_inf = int(xp.isinf(x).sum())
    raise FloatingPointError(f"non-finite output: {n_nan} NaN and {n_inf} Inf of {x.size} values")


class _Dead:
    """The value of an output on an untaken branch (§4.4): it flows through the graph as a token,
    never as data; the frame executor and the communication kernels recognise it by identity."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DEAD"


DEAD = _Dead()


class StepGuard:
    """A step's "every value finite" flag on the device (issue 30: no host branch inside a captured
    step). The step's CheckNumerics of its loss writes it -- on a GPU inside a capture by a kernel,
    elsewhere by raising as before -- and every state write that waits for that check reads it: an
    update on a device skips itself where the flag is 0, so a non-finite step changes nothing, and
    the host learns of it after the step (`ok()`). The loss's flag is sticky: the check only lowers
    it, and it stays 0 -- every later update skipping -- until the host resets it (`reset()`), so a
    host that reads it one step late (the next step already launched) finds the state from before
    the non-finite step. fp16's GuardFlag sets it every step. One flag array per array module."""

    __slots__ = ("name", "raises", "_flags")

    def __init__(self, name: str, raises: bool = True) -> None:
        """`raises`: a flag of 0 after a step is an error (the loss's CheckNumerics); False: a
        step the graph skips on purpose (fp16's GuardFlag, which sets the flag every step)."""
        self.name = name
        self.raises = raises
        self._flags: dict[int, Any] = {}

    def flag(self, xp: Any) -> Any:
        """The int32 flag array (shape (1,), 1 = finite) on `xp`'s device, made once (never inside
        a capture: the plan asks for it when it binds its kernels)."""
        f = self._flags.get(id(xp))
        if f is None:
            f = self._flags[id(xp)] = xp.ones(1, dtype="int32")
        return f

    def ok(self) -> bool:
        """Did the last step find its values finite? (A host read of each device's flag.)"""
        return all(int(to_host(f)[0]) == 1 for f in self._flags.values())

    def reset(self) -> None:
        for f in self._flags.values():
            f[...] = 1
