"""TensorBoard event files: tensorboardX's protocol buffers and record framing, written from the
training thread itself.

Why not tensorboardX's `SummaryWriter`: it writes from a background thread through a bounded
queue, and when a write fails (a full disk) that thread dies while the training thread blocks for
ever on the full queue, and again in `close()` and at interpreter exit (issue 21). Written here,
a failed write is an ordinary error in the step that made it (`write_failed`: one line, the file,
the free space), and the file is created new (O_EXCL) and never through a symlink.

The placed training graph goes in as a GraphDef event, which TensorBoard's Graphs tab draws
collapsed by name scope and coloured by device (§2's graph, §3.2.1's placement): every node with
its op, its inputs as TensorFlow writes them ("node" for output 0, "node:k", "^node" for a
control input), its assigned device, its attributes, and `_output_shapes` (which TensorBoard
writes on the edges) beside `_output_types` and the spec `_layer` it came from.
"""
from __future__ import annotations

import os
import socket
import struct
import sys
import time
import uuid
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from flowctl.engine.graph import Graph, Node, parse_ref
from flowctl.engine.shapes import TensorSpec
from flowctl.training.rundir import write_failed


@dataclass
class StepEvent:
    """What a training step reports to its listeners (the CLI's progress line, `Trainer.on_step`)."""

    step: int  # steps completed
    total: int
    loss: float
    lr: float
    examples_per_s: float
    elapsed: float
    batch: int = 0  # examples in the step (one replica's update under async data parallel)
    evaluation: dict[str, float] | None = None  # this step's evaluation, when one ran


# flowctl dtype -> TensorFlow's DataType number (tensorflow/core/framework/types.proto; tensorboardX's
# copy of the enum stops before DT_VARIANT = 21, which TensorBoard's own knows).
_DT = {"float32": 1, "float64": 2, "int32": 3, "uint8": 4, "int16": 5, "int8": 6, "int64": 9, "bool": 10,
       "bfloat16": 14, "uint16": 17, "float16": 19, "variant": 21}
_CONTENT_LIMIT = 1024  # constants up to this many bytes carry their values; larger ones their shape only


def _tensorboardx() -> None:
    """Import tensorboardX with PyTorch hidden from it, where PyTorch is installed but not imported:
    the package imports its SummaryWriter, which imports PyTorch for its type hints (4.9 s for
    `import torch` on a 2-core host, paid by every run), while flowctl uses its protocol buffers and
    record framing alone. Imported already, or PyTorch imported already: nothing to do."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError meanwhile
    try:
        import tensorboardX  # noqa: F401
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


def _tensorflow_bins() -> list[float]:
    # TensorFlow's default histogram buckets: +-1e-12 growing by 10% to 1e20, and zero.
    edges = []
    v = 1e-12
    while v < 1e20:
        edges.append(v)
        v *= 1.1
    return [-e for e in reversed(edges)] + [0.0] + edges


def _dtype(name: str) -> int:
    return _DT.get(name, 0)  # 0: DT_INVALID


def _shape(shape: tuple[int | None, ...] | None) -> Any:
    from tensorboardX.proto.tensor_shape_pb2 import TensorShapeProto

    if shape is None:
        return TensorShapeProto(unknown_rank=True)
    return TensorShapeProto(dim=[TensorShapeProto.Dim(size=-1 if d is None else int(d)) for d in shape])


def _attr(kind: str, v: Any) -> Any:
    """One flowctl attribute (its registry kind) as an AttrValue."""
    from tensorboardX.proto.attr_value_pb2 import AttrValue
    from tensorboardX.proto.tensor_pb2 import TensorProto

    if kind == "tensor":
        a = np.asarray(v)
        t = TensorProto(dtype=_dtype(a.dtype.name), tensor_shape=_shape(a.shape))
        if a.nbytes <= _CONTENT_LIMIT:
            t.tensor_content = np.ascontiguousarray(a).tobytes()
        return AttrValue(tensor=t)
    simple = {"int": lambda: AttrValue(i=int(v)), "float": lambda: AttrValue(f=float(v)),
              "bool": lambda: AttrValue(b=bool(v)), "str": lambda: AttrValue(s=str(v).encode()),
              "dtype": lambda: AttrValue(type=_dtype(str(v))), "shape": lambda: AttrValue(shape=_shape(v)),
              "ints": lambda: AttrValue(list=AttrValue.ListValue(i=[int(x) for x in v])),
              "floats": lambda: AttrValue(list=AttrValue.ListValue(f=[float(x) for x in v])),
              "strs": lambda: AttrValue(list=AttrValue.ListValue(s=[str(x).encode() for x in v]))}
    return simple[kind]()


def _outputs(specs: list[TensorSpec]) -> dict[str, Any]:
    from tensorboardX.proto.attr_value_pb2 import AttrValue

    return {"_output_shapes": AttrValue(list=AttrValue.ListValue(shape=[_shape(s.shape) for s in specs])),
            "_output_types": AttrValue(list=AttrValue.ListValue(type=[_dtype(s.dtype) for s in specs]))}


def node_def(node: Node, device: str, layer: str = "") -> Any:
    _tensorboardx()  # (the helpers below it run only after it: their imports find it loaded)
    from tensorboardX.proto.attr_value_pb2 import AttrValue
    from tensorboardX.proto.node_def_pb2 import NodeDef

    inputs = []
    for ref in node.inputs:
        name, port = parse_ref(ref)
        inputs.append(name if port == 0 else f"{name}:{port}")
    nd = NodeDef(name=node.name, op=node.op, input=inputs + ["^" + c for c in node.control_inputs], device=device)
    kinds = node.opdef.attrs
    for key, v in node.attrs.items():
        if v is not None and key in kinds:
            nd.attr[key].CopyFrom(_attr(kinds[key][0], v))
    for key, v in _outputs(node.outputs).items():
        nd.attr[key].CopyFrom(v)
    if layer:
        nd.attr["_layer"].CopyFrom(AttrValue(s=layer.encode()))
    return nd


def graph_def(graph: Graph, assignment: Mapping[str, str], layers: Mapping[str, str]) -> Any:
    """`graph` as a TensorFlow GraphDef proto, each node on its device in `assignment` (a node
    without one keeps its own requested device)."""
    _tensorboardx()
    from tensorboardX.proto.graph_pb2 import GraphDef
    from tensorboardX.proto.versions_pb2 import VersionDef

    nodes = [node_def(n, assignment.get(name) or n.assigned_device or n.device, layers.get(name, ""))
             for name, n in graph.nodes.items()]
    return GraphDef(node=nodes, versions=VersionDef(producer=22))


class EventWriter:
    """Scalars every step; weight histograms every `histograms_every` steps when asked.
    `purge_step` tells TensorBoard to drop events a crashed run wrote past its last checkpoint.
    The file is flushed every `flush_secs` and on `close()`."""

    def __init__(self, directory: Path, purge_step: int | None = None, histograms_every: int = 0,
                 flush_secs: float = 10.0) -> None:
        _tensorboardx()  # once here: the methods' imports below find it loaded
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self.histograms_every = histograms_every
        self.flush_secs = flush_secs
        # The pid and a random tag: a resume in the same second must not reopen (and truncate) the
        # file of the process before it.
        name = (f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}."
                f"{uuid.uuid4().hex[:6]}")
        self.path = directory / name
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            raise write_failed(self.path, e) from None
        self._file = os.fdopen(fd, "wb")
        self._last_flush = time.monotonic()
        self._bins: list[float] | None = None
        self._event(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            self._event(Event(step=purge_step, file_version="brain.Event:2"))
            self._event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def graph(self, graph: Any) -> None:
        """A GraphDef proto (graph_def()): TensorBoard shows the last one a run's files hold."""
        from tensorboardX.proto.event_pb2 import Event

        self._event(Event(graph_def=graph.SerializeToString(), wall_time=time.time()))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboardX.summary import scalar

        for tag, v in values.items():
            self._summary(scalar(tag, v), step)
        self._maybe_flush()

    def histograms(self, step: int, variables: Mapping[str, Any]) -> None:
        from tensorboardX.summary import histogram

        if self._bins is None:
            self._bins = _tensorflow_bins()
        for name, v in variables.items():
            self._summary(histogram(f"weights/{name}", np.asarray(v), self._bins), step)
        self._maybe_flush()

    def _summary(self, summary: Any, step: int) -> None:
        from tensorboardX.proto.event_pb2 import Event

        self._event(Event(summary=summary, wall_time=time.time(), step=int(step)))

    def _event(self, event: Any) -> None:
        # The TFRecord framing: length, its masked CRC32C, the data, its masked CRC32C.
        from tensorboardX.record_writer import masked_crc32c

        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        try:
            self._file.write(header + struct.pack("<I", masked_crc32c(header)) + data
                             + struct.pack("<I", masked_crc32c(data)))
        except OSError as e:
            raise write_failed(self.path, e) from None

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        if now - self._last_flush >= self.flush_secs:
            self._last_flush = now
            try:
                self._file.flush()
            except OSError as e:
                raise write_failed(self.path, e) from None

    def close(self, failing: bool = False) -> None:
        """Flush and close; when `failing` (another error is on its way out), a failure here is
        dropped so that the first one is reported."""
        try:
            self._file.close()
        except OSError as e:
            if not failing:
                raise write_failed(self.path, e) from None
