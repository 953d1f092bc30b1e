"""All-reduce data parallelism as a graph transform (issue 33): replicated variables, gradients
ring-all-reduced in buckets over the graph's own Send/Recv, one identical update per replica.

Beside the whitepaper's parameter device (§7, Figure 7 top: `strategies.sync_data_parallel`), this
is how data-parallel training on many machines is done today (Horovod, PyTorch DDP, TF's
MultiWorkerMirroredStrategy):

- **Replicas own their state.** The forward graph is copied under `replica_<k>/` as for the
  parameter device, but copy k >= 1 reads variables of its own: a *mirror* `replica_<k>/<v>` of
  every Variable the forward reads, initialised from the primary `<v>` (the primary's initializer
  first, then a copy: one transfer at initialisation, none per step). Replica 0 keeps the primary
  names, so a checkpoint holds the primaries only (`checkpoint.capture` drops a Variable whose
  `mirror_of` attr names another; `checkpoint.apply` fills mirrors from their primary) and moves
  between strategies unchanged. Each replica applies the update to its own variables with an
  optimizer of its own (`Optimizer.replica`: slots `replica_<k>/<v>/<Opt>/<slot>`, shared state
  `replica_<k>/<Opt>/...`, all mirrors too).
- **Buckets.** Gradients are taken in the order the backward pass makes them (autodiff adds a
  later layer's gradient first) and grouped into buckets of about `bucket_bytes`; a bucket is
  flattened into one vector (a lone gradient: a reshape, no copy) so that its all-reduce can start
  as soon as its last gradient exists, while the backward pass goes on with earlier layers.
- **The ring.** A bucket of L elements is cut into N chunks. Reduce-scatter: chunk c starts on
  replica c+1, which sends its piece to c+2, which adds its own and passes the sum on, ..., until
  replica c adds the last piece: the whole sum of chunk c. All-gather: every replica concatenates
  the N sums (each replica sends its chunk's sum to every other). Every replica sends and receives
  2(N-1)/N of the bucket; the adds are ordinary Add nodes on the replica that makes them and every
  crossing is the partitioner's Send/Recv, so the simulator and `place` see the transfers and
  their overlap exactly as they run, and the executor overlaps them with whatever is ready.
- **Embedding tables travel sparse.** A table's gradient (a GatherGrad along axis 0) is mostly
  zeros: lstm_lm's is 26 MB dense for 700 rows read (1.8 MB). As TensorFlow's all-reduce does with
  IndexedSlices and Horovod with its allgather, each replica sends only its rows -- the sorted
  distinct ids and each id's summed rows (`GatherGradRows`) -- to every other, and each replica
  makes the whole gradient as a GatherGrad of all replicas' rows concatenated in replica order.
  For two replicas that is r0 + r1 per id (one addition, GatherGrad's sorted runs keep replica 0's
  row first), the parameter device's dense sum to the bit; SGD's update then stays sparse (its
  GatherGradRows of that GatherGrad), and dense optimizers read the GatherGrad as before.
- **Identical updates.** Each chunk is summed once, on one replica, in a fixed order, and the
  result copied to all: every replica applies bitwise the same gradient (the sum times 1/N, as the
  parameter device's AddN then 1/N), so the replicas stay bitwise identical and a resumed run is
  exact. For N = 2 the ring's sum is the parameter device's bit for bit (a + b == b + a); for
  N > 2 it differs in the order of the additions, i.e. in float rounding.

Side updates (batch norm's moving averages) run on replica 0 only, as with the parameter device;
a replica's mirrors of non-trainable state are never written and never checkpointed.

**The collective transport.** Where every replica is a GPU of this process (a DistributedSession
over gpu:0..gpu:N-1), the ring above would carry every byte through the host (a GPU's Send/Recv
goes through host memory). There each bucket's reduction is instead N `CollectiveAllReduce` nodes
(ops/communication.py), one per replica, sharing a group key: their kernel is NCCL's all-reduce
over a clique of the replicas' GPUs (kernels/cuda/nccl.py), the transport the whitepaper's
successors use; the bucket's sum then goes through the same unbucketing. `FLOWCTL_COLLECTIVE`
chooses: `auto` (the default: GPUs of this process), `on` (also CPU devices of this process: the
collective's CPU kernel sums the ranks in rank order, which is how it is tested) or `off`. Ray
workers and CPU devices keep the ring by default (a collective meets in one process's
rendezvous). The collective's sum is rank 0 + rank 1 + ... on the CPU (two replicas: the
exchange's bits; more: rounding apart from the ring's order), NCCL's own order on GPUs; every
replica gets the same bits either way. Tables still travel as rows (their GatherGrads).
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np

from flowctl.engine.devices import DEFAULT_JOB, canonical, parse_device
from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Graph, Tensor, make_ref, parse_ref
from flowctl.engine.ops.api import make1
from flowctl.engine.ops.array import concat, reshape, split
from flowctl.engine.ops.communication import collective_all_reduce
from flowctl.engine.ops.control import group, identity
from flowctl.engine.ops.elementwise import add, mul
from flowctl.engine.ops.state import variable
from flowctl.engine.ops.training import gather_grad_rows
from flowctl.engine.optimizers import Optimizer

__all__ = ["BUCKET_BYTES", "COLLECTIVE_ENV", "buckets", "mark_mirrors", "mirror_state", "replica_updates",
           "ring_allreduce", "use_collective"]

OnDevice = Callable[[Tensor, int], Tensor]  # a node just made, and the replica whose device it goes on
Process = Callable[[list[Tensor | None]], list[Tensor | None]]  # strategies.GradientProcess

BUCKET_BYTES = 25 << 20  # PyTorch DDP's default bucket_cap_mb
COLLECTIVE_ENV = "FLOWCTL_COLLECTIVE"  # auto | on | off (the module doc)
_COLLECTIVE_MODES = {"auto": "auto", "": "auto", "on": "on", "1": "on", "true": "on", "off": "off", "0": "off",
                     "false": "off"}


def use_collective(devices: Sequence[str], mode: str | None = None) -> bool:
    """Do the replicas on `devices` reduce through CollectiveAllReduce nodes rather than the ring?
    Only devices of this process (a collective meets in one process's rendezvous), each replica on
    a device of its own; then `mode` (default: `FLOWCTL_COLLECTIVE`, else "auto") decides: "auto"
    where every device is a GPU, "on" for any, "off" never."""
    raw = (mode if mode is not None else os.environ.get(COLLECTIVE_ENV, "auto")).strip().lower()
    if raw not in _COLLECTIVE_MODES:
        raise GraphError(f"{COLLECTIVE_ENV}={raw!r}: use auto, on or off")
    chosen = _COLLECTIVE_MODES[raw]
    names = [parse_device(d) for d in devices]
    if chosen == "off" or len(names) < 2 or len(set(names)) != len(names):
        return False
    if any((d.job, d.task) != (DEFAULT_JOB, 0) for d in names):
        return False
    return chosen == "on" or all(d.type == "gpu" for d in names)


def mirror_state(graph: Graph, copies: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """For copy k >= 1 (`copies[k]`: original node -> its copy), a mirror of every Variable the
    copy reads, made under `replica_<k>/`, and the copy rewired to it. Returns per copy
    primary -> mirror ({} for copy 0, which reads the primaries)."""
    read: list[str] = []
    for c in copies[0].values():
        node = graph.nodes[c]
        for r in [*node.inputs, *node.control_inputs]:
            src = parse_ref(r)[0]
            if graph.nodes[src].op == "Variable" and src not in read:
                read.append(src)
    out: list[dict[str, str]] = [{}]
    for k in range(1, len(copies)):
        mirrors = {v: _mirror(graph, v, f"replica_{k}/{v}") for v in read}
        for c in copies[k].values():
            node = graph.nodes[c]
            node.inputs = [_swap(r, mirrors) for r in node.inputs]
            node.control_inputs = [mirrors.get(n, n) for n in node.control_inputs]
        out.append(mirrors)
    return out


def _mirror(graph: Graph, primary: str, name: str) -> str:
    """A Variable `name` like `primary`, initialised with a copy of what the primary's initializer wrote."""
    if name in graph.nodes:
        raise GraphError(f"cannot mirror '{primary}' as '{name}': the graph already has a node by that name")
    node = graph.nodes[primary]
    init = f"{primary}/init"  # its Assign's output is the value it wrote: read after the write
    source = Tensor(graph, init if init in graph.nodes else primary, 0)
    with graph.as_default(), graph.absolute_scope():
        first = identity(source, name=f"{name}/initial_value")
    graph.nodes[first.node].follows = primary  # its layer's, for place --explain and the graph page
    with graph.as_default(), graph.absolute_scope():
        v = variable(first, name=name, trainable=False)
    graph.nodes[v.node].attrs["mirror_of"] = primary
    graph.nodes[v.node].attrs["container"] = node.attrs["container"]
    return v.node


def mark_mirrors(graph: Graph, optimizer: Optimizer, prefix: str) -> None:
    """A replica optimizer's Variables (slots, shared state) mirror the primary optimizer's: the
    same name without `prefix`."""
    for v in optimizer.variables():
        primary = v.node.removeprefix(prefix)
        if primary == v.node or primary not in graph.nodes:
            raise GraphError(f"replica optimizer variable '{v.node}' has no primary '{primary}'")
        graph.nodes[v.node].attrs["mirror_of"] = primary


def _swap(ref: str, m: dict[str, str]) -> str:
    src, port = parse_ref(ref)
    return make_ref(m.get(src, src), port)


ALONE_BYTES = 1 << 20  # a gradient this big is all-reduced on its own: a bucket's concat would copy it


def buckets(graph: Graph, grads: Sequence[Tensor | None], bucket_bytes: int,
            alone_bytes: int = ALONE_BYTES) -> list[list[int]]:
    """Indices of `grads` (None skipped) grouped into buckets in the order the backward pass can
    make them: by depth, the longest chain of nodes from the graph's sources to the gradient (a
    later layer's gradient is fewer nodes past the loss than an earlier layer's; the node's place
    in the graph says when autodiff wrote it, not when it can run). Small gradients share a bucket
    (one transfer instead of many, at the price of a concat) until the next would take it past
    `bucket_bytes`; a gradient of `alone_bytes` or more is a bucket of its own (a reshape, no copy);
    a bucket holds one dtype."""
    live = [i for i, g in enumerate(grads) if g is not None]
    depth = _depths(graph, [grads[i].node for i in live])  # type: ignore[union-attr]
    live.sort(key=lambda i: (depth[grads[i].node], i))  # type: ignore[union-attr]
    out: list[list[int]] = []
    size = 0
    for i in live:
        g = grads[i]
        assert g is not None
        n = _nbytes(g)
        first = grads[out[-1][0]] if out else None
        if first is None or n >= alone_bytes or _nbytes(first) >= alone_bytes or size + n > bucket_bytes \
                or first.dtype != g.dtype:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def _depths(graph: Graph, targets: Sequence[str]) -> dict[str, int]:
    """Each of `targets`' longest path in nodes from a source, over the targets' ancestors."""
    order = graph.topo_order(_ancestors(graph, targets))
    depth: dict[str, int] = {}
    for name in order:
        node = graph.nodes[name]
        deps = [parse_ref(r)[0] for r in node.inputs] + list(node.control_inputs)
        depth[name] = 1 + max((depth.get(d, 0) for d in deps), default=0)
    return depth


def _ancestors(graph: Graph, targets: Sequence[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(targets)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = graph.nodes[name]
        stack.extend(parse_ref(r)[0] for r in node.inputs)
        stack.extend(node.control_inputs)
    return seen


def _nbytes(t: Tensor) -> int:
    if any(d is None for d in t.shape):
        raise GraphError(f"gradient '{t.name}' has unknown dimensions {t.shape}: all-reduce needs static shapes")
    return int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize


def ring_allreduce(graph: Graph, per_replica: Sequence[Sequence[Tensor | None]], devices: Sequence[str],
                   placement: dict[str, str], bucket_bytes: int = BUCKET_BYTES,
                   scope: str = "allreduce", collective: bool | None = None) -> list[list[Tensor | None]]:
    """Per replica, the mean over replicas of each gradient (None kept), every replica's bitwise
    the same: buckets ring-all-reduced as the module doc says, or each reduced by N
    CollectiveAllReduce nodes where `collective` (default: `use_collective(devices)`). Every node
    made is assigned its device in `placement`."""
    n = len(per_replica)
    if collective is None:
        collective = use_collective(devices)
    out: list[list[Tensor | None]] = [[None] * len(g) for g in per_replica]
    made: list[tuple[Tensor, str]] = []

    def on(t: Tensor, k: int) -> Tensor:
        made.append((t, devices[k]))
        return t

    tables = [i for i, g in enumerate(per_replica[0]) if g is not None and n > 1 and _table_gradient(g)]
    dense = [None if i in tables else g for i, g in enumerate(per_replica[0])]
    with graph.as_default(), graph.absolute_scope(scope):
        for j, i in enumerate(tables):
            with graph.name_scope(f"table_{j}"):
                for k, g in enumerate(_table_allgather(graph, [per_replica[r][i] for r in range(n)], on)):
                    out[k][i] = g
        for b, idx in enumerate(buckets(graph, dense, bucket_bytes)):
            with graph.name_scope(f"bucket_{b}"):
                sizes = [int(np.prod(per_replica[0][i].shape)) for i in idx]  # type: ignore[union-attr]
                total = sum(sizes)
                flat = []
                for k in range(n):
                    with graph.name_scope(f"replica_{k}"):
                        parts = [on(reshape(per_replica[k][i], (-1,), name="flat"), k) for i in idx]
                        flat.append(parts[0] if len(parts) == 1 else on(concat(parts, 0, name="bucket"), k))
                if collective and n > 1:  # one collective node per replica (the module doc)
                    wholes = _collective(graph, flat, devices, on)
                elif n == 2:  # each replica sums both itself: one crossing each way, no gather
                    wholes = [_exchange(graph, flat, k, on) for k in range(n)]
                else:
                    sums = _reduce_scatter(graph, flat, total, on) if n > 1 else [flat[0]]
                    wholes = [sums[0] if len(sums) == 1 else _gather(graph, sums, k, on) for k in range(n)]
                for k in range(n):
                    with graph.name_scope(f"replica_{k}"):
                        pieces = [wholes[k]] if len(idx) == 1 else \
                            [on(p, k) for p in split(wholes[k], sizes, 0, name="unbucket")]
                        for i, p in zip(idx, pieces):
                            g = per_replica[k][i]
                            assert g is not None
                            out[k][i] = on(reshape(p, g.shape, name="grad"), k)
    for t, dev in made:
        placement[t.node] = dev
    return out


def _table_gradient(g: Tensor) -> bool:
    """Is `g` an embedding table's gradient (sent sparse, see the module doc)?"""
    return g.port == 0 and g.op.op == "GatherGrad" and g.op.attrs["axis"] == 0


def _table_allgather(graph: Graph, grads: Sequence[Tensor | None], on: OnDevice) -> list[Tensor]:
    """Per replica, the sum of the replicas' table gradients `grads` (GatherGrads along axis 0), as
    a GatherGrad of every replica's (ids, rows) concatenated in replica order: each replica's rows
    cross to every other replica once."""
    sparse = []
    for k, g in enumerate(grads):
        assert g is not None
        ids, rows = gather_grad_rows(g)
        sparse.append((on(ids, k), rows))
    out = []
    for k, g in enumerate(grads):
        assert g is not None
        like = graph.tensor(g.op.inputs[2])
        with graph.name_scope(f"replica_{k}"):
            ids = on(concat([i for i, _ in sparse], 0, name="ids"), k)
            rows = on(concat([r for _, r in sparse], 0, name="rows"), k)
            out.append(on(make1("GatherGrad", [rows, ids, like], {"axis": 0}, name="grad"), k))
    return out


def _gather(graph: Graph, sums: Sequence[Tensor], k: int, on: OnDevice) -> Tensor:
    """The ring's all-gather on replica k: the chunks' means, in order, in one vector."""
    with graph.name_scope(f"replica_{k}"):
        return on(concat(list(sums), 0, name="gathered"), k)


def share(graph: Graph, loss: Tensor, n: int, name: str) -> Tensor:
    """A replica's loss divided by the replica count: what it differentiates, so that the sum of the
    replicas' gradients is their mean. For N a power of two every gradient is its unscaled value
    times 1/N exactly (a product with a power of two rounds as the unscaled one did), so two
    replicas' sum has the parameter device's bits (its AddN, then 1/N)."""
    if n == 1:
        return loss
    return mul(loss, np.asarray(1.0 / n, dtype=np.dtype(loss.dtype)), name=name)


def _exchange(graph: Graph, flat: Sequence[Tensor], k: int, on: OnDevice) -> Tensor:
    """Two replicas: replica k adds the other's whole bucket to its own, replica 0's first on both
    (so both hold the same bits). Each replica sends and receives the bucket once, as the ring's
    2(N-1)/N would, but in one crossing instead of two and with no concat after it: the ring pays
    off from three replicas."""
    with graph.name_scope(f"replica_{k}"):
        return on(add(flat[0], flat[1], name="sum"), k)


def _collective(graph: Graph, flat: Sequence[Tensor], devices: Sequence[str], on: OnDevice) -> list[Tensor]:
    """The bucket's sum on every replica, by one CollectiveAllReduce per replica; their group key
    is rank 0's node name (unique in the graph)."""
    n = len(flat)
    names = tuple(canonical(d) for d in devices)
    out = []
    for k in range(n):
        with graph.name_scope(f"replica_{k}"):
            out.append(on(collective_all_reduce(flat[k], "pending", n, k, names, name="all_reduce"), k))
    for t in out:
        graph.nodes[t.node].attrs["group_key"] = out[0].node
    return out


def _reduce_scatter(graph: Graph, flat: Sequence[Tensor], total: int, on: OnDevice) -> list[Tensor]:
    """The ring's reduce-scatter: chunk c summed from replica c+1 round to replica c; the chunks'
    sums in order (chunk c's on replica c)."""
    n = len(flat)
    m = min(n, total)  # fewer elements than replicas: fewer chunks
    sizes = [total // m + (1 if c < total % m else 0) for c in range(m)]
    pieces = []
    for k in range(n):
        with graph.name_scope(f"replica_{k}"):
            pieces.append([on(p, k) for p in split(flat[k], sizes, 0, name="chunks")] if m > 1 else [flat[k]])
    sums = []
    for c in range(m):
        ring = [(c + 1 + j) % n for j in range(n)]  # ends on replica c
        acc = pieces[ring[0]][c]
        for r in ring[1:]:
            acc = on(add(acc, pieces[r][c], name=f"chunk_{c}/sum_on_{r}"), r)
        sums.append(acc)
    return sums


def replica_updates(graph: Graph, optimizer: Optimizer, grads: Sequence[Sequence[Tensor | None]],
                    variables: Sequence[Tensor], mirrors: Sequence[dict[str, str]], devices: Sequence[str],
                    placement: dict[str, str], process: Process | None,
                    side: Sequence[Tensor]) -> Tensor:
    """Each replica's update of its own variables with its own optimizer (replica 0: `optimizer`
    itself, on the primaries), every node it makes on the replica's device; one Group of all of
    them and `side` (replica 0's side updates)."""
    applies = []
    for k, dev in enumerate(devices):
        before = set(graph.nodes)
        opt = optimizer if k == 0 else optimizer.replica(f"replica_{k}/")
        own = [Tensor(graph, mirrors[k].get(v.node, v.node), v.port) for v in variables]
        with graph.as_default(), graph.absolute_scope(f"replica_{k}"):
            gs = list(grads[k])
            if process is not None:
                gs = list(process(gs))
        with graph.as_default(), graph.absolute_scope():
            applies.append(opt.apply_gradients(list(zip(gs, own)), name=f"replica_{k}/apply"))
        if k:
            mark_mirrors(graph, opt, f"replica_{k}/")
        for name in set(graph.nodes) - before:
            if not graph.nodes[name].opdef.ref_inputs:
                placement[name] = dev
    return group(applies + list(side), name="train_step", graph=graph)
