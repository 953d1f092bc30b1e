"""What the engine's captured step (`engine/capture.py`) asks of a device: a stream of its own, a
memory pool private to the captured graph, stream capture, graph launch, copies into static
buffers and asynchronous copies back (`read_async`). `CupyCapture` does it with cupy on a GPU; the launch ledger (`kernels/ledger.py`) gives a
stand-in with the same methods over numpy (its "graph" is a tape of the recorded launches, replayed
on the same buffers), so the engine's side is tested on a CPU.

Facts this rests on (shared/GPU-NOTES.md, measured on an H200 in shared/gpu-measurements): cupy
refuses capture on the legacy default stream, so the step runs on a non-blocking stream of its own,
ordered against the default stream by events; cupy's pool has no capture mode, so a pool private
to the graph (`cupy.cuda.using_allocator`) serves the capture, warmed by an uncaptured step first so
the capture allocates nothing new, and lives as long as the graph: nothing else ever allocates from
it, so the blocks the graph's kernels read and write are never handed out again.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


class CupyCapture:
    """One captured plan's stream, pool and graph on the current GPU."""

    ran_during_capture = False  # a CUDA capture records; nothing runs until the graph is launched

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.pool = cp.cuda.MemoryPool()
        self._rings: dict[tuple[Any, ...], list[_Buffers]] = {}  # read_async's pinned buffers

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The plan's stream and private pool current; the stream first waits for what the default
        stream queued (a restored variable, say), and the default stream then waits for the step,
        so a later `.get()` there reads its results (events only: no host wait)."""
        cp = self.cp
        self.stream.wait_event(cp.cuda.Stream.null.record())
        try:
            with self.stream, cp.cuda.using_allocator(self.pool.malloc):
                yield
        finally:
            cp.cuda.Stream.null.wait_event(self.stream.record())

    def begin(self) -> None:
        self.stream.begin_capture()

    def end(self, rerun: Any = None) -> "Captured":
        """The captured graph. (`rerun`, the step's Python, is for stand-ins that cannot record
        launches; a CUDA capture has recorded them.)"""
        graph = self.stream.end_capture()
        return Captured(graph, graph_nodes(graph))

    def abandon(self) -> None:
        """End a capture that failed part way (its graph is dropped)."""
        try:
            if self.stream.is_capturing():
                self.stream.end_capture()
        except Exception:  # noqa: BLE001 -- an invalidated capture may refuse to end cleanly
            pass

    def launch(self, graph: "Captured") -> None:
        graph.graph.launch(self.stream)

    def upload(self, graph: "Captured") -> None:
        graph.graph.upload(self.stream)

    def copy_in(self, dst: Any, value: Any) -> None:
        """Write a host (numpy) or device value into a static buffer, on the plan's stream."""
        cp = self.cp
        if isinstance(value, cp.ndarray):
            cp.copyto(dst, value)  # under `running`: the plan's stream
        else:
            dst.set(value, stream=self.stream)

    def read_async(self, arrays: Any) -> "PinnedRead":
        """Copies of device arrays (the step's outputs and guard flags) to pinned host buffers,
        queued on the plan's stream behind what it has launched, and an event after them: no host
        wait here. Two sets of buffers per signature take turns, so the copies of the next step
        never overwrite those of a step whose values the host has not read yet; a third read
        while two are unread first takes the oldest's values out of its buffers."""
        cp = self.cp
        key = tuple((tuple(a.shape), a.dtype.str) if isinstance(a, cp.ndarray) else None for a in arrays)
        ring = self._rings.get(key)
        if ring is None:
            import cupyx  # type: ignore[import-not-found]

            ring = self._rings[key] = [_Buffers([None if k is None else cupyx.empty_pinned(k[0], dtype=k[1])
                                                 for k in key]) for _ in range(2)]
        bufs = ring[0]
        ring.append(ring.pop(0))
        if bufs.owner is not None:
            bufs.owner.wait()
        for a, host in zip(arrays, bufs.host):
            if host is not None:
                try:
                    a.get(stream=self.stream, out=host, blocking=False)
                except TypeError:  # cupy < 13: a copy given a stream is asynchronous
                    a.get(stream=self.stream, out=host)
        event = cp.cuda.Event(block=True, disable_timing=True)
        event.record(self.stream)
        # The device arrays are not held (a fetched variable's array held here would keep its next
        # update from writing in place); the stream orders their reuse after the copies.
        read = bufs.owner = PinnedRead(bufs, [None if h is not None else a for a, h in zip(arrays, bufs.host)], event)
        return read

    def synchronize(self) -> None:
        self.stream.synchronize()

    def held_bytes(self) -> int:
        return int(self.pool.total_bytes())


class _Buffers:
    """One set of pinned host buffers of `read_async`, and the read whose copies they hold."""

    __slots__ = ("host", "owner")

    def __init__(self, host: list[Any]) -> None:
        self.host = host
        self.owner: PinnedRead | None = None


class PinnedRead:
    """Copies to pinned buffers in flight: `wait()` waits for the event after them (the host
    only: the device goes on with the steps queued since) and hands over the values, copied out
    of the buffers, which go back to their ring."""

    __slots__ = ("bufs", "arrays", "event", "values")

    def __init__(self, bufs: _Buffers, arrays: list[Any], event: Any) -> None:
        self.bufs, self.arrays, self.event = bufs, arrays, event  # arrays: the values not on the device
        self.values: list[Any] | None = None

    def wait(self) -> list[Any]:
        if self.values is None:
            self.event.synchronize()
            self.values = [a if h is None else h.copy() for a, h in zip(self.arrays, self.bufs.host)]
            if self.bufs.owner is self:
                self.bufs.owner = None
        return self.values


class Captured:
    """A captured graph and how many nodes (kernels, copies, memsets) it holds."""

    __slots__ = ("graph", "nodes")

    def __init__(self, graph: Any, nodes: int) -> None:
        self.graph, self.nodes = graph, nodes


def graph_nodes(graph: Any) -> int:
    """The nodes of a cupy Graph, counted in its Graphviz description (0 where it has none)."""
    try:
        dot = graph.debug_dot_str()
    except Exception:  # noqa: BLE001 -- an older cupy: the count is a nicety
        return 0
    if isinstance(dot, bytes):
        dot = dot.decode(errors="replace")
    return sum(1 for line in dot.splitlines() if "[" in line and "->" not in line and "label" in line)


def capture_backend(xp: Any) -> Any:
    """A capture backend for the array module `xp`, or None where steps are not captured (numpy)."""
    if getattr(xp, "device_kind", None) != "gpu":
        return None
    make = getattr(xp, "capture_backend", None)
    if make is not None:  # the launch ledger's stand-in
        return make()
    cp = getattr(xp, "cupy", None)
    return None if cp is None else CupyCapture(cp)
