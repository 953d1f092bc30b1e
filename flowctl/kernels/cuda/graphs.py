"""What the engine's captured step (`engine/capture.py`) asks of a device: a stream of its own, a
memory pool private to the captured graph, stream capture, graph launch and copies into static
buffers. `CupyCapture` does it with cupy on a GPU; the launch ledger (`kernels/ledger.py`) gives a
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

    def synchronize(self) -> None:
        self.stream.synchronize()

    def held_bytes(self) -> int:
        return int(self.pool.total_bytes())


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
