"""Parallelism strategies as graph transforms over a built forward graph (whitepaper §7, Figures 7-9).

Each strategy takes a forward graph (inputs -> loss over shared Variables), an `Optimizer` and
devices, and adds what a training step runs: gradients, their combination, one update. It returns
the step's fetches and a placement (node -> device) for `DistributedSession`. Nothing here knows
about specs: layer names arrive as plain `layer -> [node names]` mappings.

- `single_step`: gradients, optional processing (clipping), one update. `model_parallel` is the
  same graph with a placement from layer groups (Figure 8): gradient nodes follow their forward node
  (`Node.follows`), optimizer slots and updates their variable, everything else the default device.
- `sync_data_parallel` (Figure 7 top): the forward subgraph (every non-Variable node the loss
  depends on, input placeholders included) is copied under `replica_<k>/`, sharing the Variables;
  each replica differentiates its own loss; per variable the N gradients are combined by one AddN
  and scaled by 1/N on the variable's (parameter) device -- a gather to the parameter device, not
  an all-reduce -- and ONE update is applied. For a loss that is a mean over examples this is one
  step on the concatenated batch (up to float32 rounding).
- `pipeline` (Figure 9): the same copies under `micro_<k>/`, K micro-batches of one global batch,
  each copy placed where the node it copies is (the model-parallel placement), and on each device
  micro-batch k's forward (and gradient) nodes wait for k-1's there, so while one device works on
  micro-batch k the next works on k-1 (`_order_micro_batches`), and in the 1F1B order: stage s of
  S runs micro-batch k's forward only after k - (S - s)'s backward (`_limit_in_flight`), so a
  stage holds at most S - s micro-batches' activations instead of all K.
  Update rule: w <- update(w, (1/K) sum_k grad L_k(w)), applied once per step: gradient
  accumulation over K micro-batches, equal to one step on the whole batch for a mean loss.
- `async_data_parallel` (Figure 7 bottom): the same replicas, but each replica's step is two runs
  issued by its own client thread: its gradients (and the update counter's value, read with the
  parameters), then the shared update fed with them, which also increments the counter. Staleness
  of an update = counter after it - 1 - counter when its gradients read the parameters.

Why copies share Variables and not values: §7 "many replicas of the portion of the graph that does
the bulk of the model computation" over one set of parameters; the Variable lives on the parameter
device and each replica's read of it is one Send/Recv per step (§3.2.2).

Caveats stated where they bite: batch normalisation computes statistics per copy (replica 0's
moving averages are the ones updated in sync/pipeline), so with BN sync is not the big-batch step;
random ops are seeded from their node name, so copies draw different dropout masks (unless an op
has an explicit `seed` attr, when every copy draws the same numbers).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from flowctl.engine.devices import canonical
from flowctl.engine.errors import ExecutionError, GraphError, PlacementError
from flowctl.engine.graph import Graph, Tensor, make_ref, parse_ref
from flowctl.engine.ops.control import group
from flowctl.engine.ops.elementwise import add_n, zeros_like
from flowctl.engine.ops.state import assign, assign_add, placeholder, variable
from flowctl.engine.optimizers import Optimizer

__all__ = [
    "AsyncStep", "GradientProcess", "TrainStep", "accumulated_step", "assign_layers", "async_data_parallel", "complete_placement",
    "forward_nodes", "model_parallel", "pipeline", "replicate", "single_step", "split_batch", "split_rows",
    "sync_data_parallel",
]

# Applied to the combined gradients before the update (clipping): same length, None kept.
GradientProcess = Callable[[list[Tensor | None]], list[Tensor | None]]


@dataclass
class TrainStep:
    """One synchronous step: run `train_op`, fetch `loss` (the mean over every example of the step),
    feed each copy's inputs with its slice of the global batch (`split_batch`)."""

    graph: Graph
    loss: Tensor
    train_op: Tensor
    inputs: list[dict[str, Tensor]]  # per copy (one for single/model_parallel): input name -> placeholder
    placement: dict[str, str] | None  # None: one device, a plain Session
    copies: list[dict[str, str]] = field(default_factory=list)  # per copy: original node -> copy
    # Gradient accumulation (`accumulated_step`): a step is `micro_batches` runs, each fed one
    # micro-batch; every run but the last runs `accumulate_op`, the last `train_op`.
    accumulate_op: Tensor | None = None
    micro_batches: int = 1

    def feeds(self, batch: Mapping[str, np.ndarray]) -> dict[Tensor, np.ndarray]:
        return split_batch(batch, self.inputs)

    def runs(self, batch: Mapping[str, np.ndarray]) -> list[tuple[Tensor, dict[Tensor, np.ndarray]]]:
        """The session runs of one step on `batch`: (target, feeds), in order. One run, unless the
        step accumulates: then micro-batch k (rows [k*b, (k+1)*b)) in run k."""
        if self.accumulate_op is None:
            return [(self.train_op, self.feeds(batch))]
        parts = split_rows(batch, self.micro_batches, "micro-batches")
        feeds = [split_batch(part, self.inputs) for part in parts]
        return [(self.accumulate_op, f) for f in feeds[:-1]] + [(self.train_op, feeds[-1])]


@dataclass
class AsyncStep:
    """Asynchronous data parallelism: replica k runs `[losses[k], grads[k], version]` (and
    `side_updates[k]` when not None) with `inputs[k]` fed, then `[applied, apply]` with
    `grad_inputs` fed with those gradients."""

    graph: Graph
    placement: dict[str, str]
    losses: list[Tensor]
    grads: list[list[Tensor]]  # per replica, one per variable in `variables`
    inputs: list[dict[str, Tensor]]
    side_updates: list[Tensor | None]  # per replica: a Group of its batch-norm moving-average updates
    variables: list[Tensor]  # the variables that get gradients, in `grads` order
    grad_inputs: list[Tensor]  # placeholders the update reads, one per variable
    version: Tensor  # int64 Variable: updates applied so far
    applied: Tensor  # the counter's value after this update (fetching it runs the update)
    apply: Tensor
    copies: list[dict[str, str]] = field(default_factory=list)


def split_rows(batch: Mapping[str, np.ndarray], k: int, what: str = "copies") -> list[dict[str, np.ndarray]]:
    """`batch` cut into k parts: part j holds rows [j*b, (j+1)*b) of every array, b = rows / k."""
    parts: list[dict[str, np.ndarray]] = [{} for _ in range(k)]
    for name, arr in batch.items():
        rows = len(arr)
        if rows % k:
            raise ExecutionError(f"a batch of {rows} examples of '{name}' does not split evenly into {k} "
                                 f"{what} ({rows} / {k} = {rows / k:.2f})")
        b = rows // k
        for j, part in enumerate(parts):
            part[name] = arr[j * b:(j + 1) * b]
    return parts


def split_batch(batch: Mapping[str, np.ndarray], inputs: Sequence[Mapping[str, Tensor]]) -> dict[Tensor, np.ndarray]:
    """Feeds for `len(inputs)` copies: copy k gets rows [k*b, (k+1)*b) of every input, b = batch/copies."""
    for name in batch:
        if name not in inputs[0]:
            raise ExecutionError(f"the batch holds '{name}', which is not a model input "
                                 f"(inputs: {', '.join(inputs[0])})")
    out: dict[Tensor, np.ndarray] = {}
    for part, ins in zip(split_rows(batch, len(inputs)), inputs):
        for name, arr in part.items():
            out[ins[name]] = arr
    return out


# ---------------------------------------------------------------------------- graph surgery
def forward_nodes(graph: Graph, roots: Sequence[Tensor | str]) -> list[str]:
    """Every node the roots depend on through data or control edges, except Variables (state is
    shared by the copies, §7), in graph order."""
    seen: set[str] = set()
    stack = [r.node if isinstance(r, Tensor) else parse_ref(r)[0] for r in roots]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        node = graph.nodes[name]
        if node.op == "Variable":
            continue
        seen.add(name)
        stack.extend(parse_ref(r)[0] for r in node.inputs)
        stack.extend(node.control_inputs)
    return [n for n in graph.nodes if n in seen]


def replicate(graph: Graph, nodes: Sequence[str], count: int, scope: str = "replica_{k}") -> list[dict[str, str]]:
    """Copy `nodes` `count` times, copy k under the name scope `scope.format(k=k)`; edges between
    copied nodes are rewired to the copy, edges to other nodes (the Variables) kept. Returns, per
    copy, original node -> copy's name. Shapes are re-inferred as each copy is added."""
    order = graph.topo_order(nodes, earliest_first=True)  # the originals' build order: a layer's chain stays together (executor)
    maps: list[dict[str, str]] = []
    for k in range(count):
        prefix = scope.format(k=k)
        m: dict[str, str] = {}
        for name in order:
            n = graph.nodes[name]
            new = f"{prefix}/{name}"
            if new in graph.nodes:
                raise GraphError(f"cannot copy '{name}' to '{new}': the graph already has a node by that name")
            with graph.absolute_scope():
                copy = graph.add_node(n.op, [_remap(r, m) for r in n.inputs], dict(n.attrs), name=new,
                                      control_inputs=[m.get(c, c) for c in n.control_inputs], device=n.device)
            copy.colocate_with = [m.get(c, c) for c in n.colocate_with]
            copy.source = n.source
            copy.follows = m.get(n.follows, n.follows)
            m[name] = new
        maps.append(m)
    return maps


def _remap(ref: str, m: Mapping[str, str]) -> str:
    src, port = parse_ref(ref)
    return make_ref(m.get(src, src), port)


def _copy(graph: Graph, m: Mapping[str, str], t: Tensor) -> Tensor:
    return Tensor(graph, m.get(t.node, t.node), t.port)


def complete_placement(graph: Graph, fixed: Mapping[str, str], default: str) -> dict[str, str]:
    """A device for every node: `fixed` as given; a node reading a Variable by reference (Assign,
    AssignSub, ...) on its Variable's device (§4.3, the partitioner cannot cut a reference edge);
    otherwise the device of the node it is colocated with (optimizer slots and updates), else of
    the forward node it follows (gradient nodes, §4.1), else `default`."""
    out = {n: canonical(d) for n, d in fixed.items() if n in graph.nodes}
    default = canonical(default)

    def ref_var(name: str) -> str | None:
        node = graph.nodes[name]
        for i in node.opdef.ref_inputs:
            if i < len(node.inputs):
                return parse_ref(node.inputs[i])[0]
        return None

    def resolve(name: str) -> str:
        chain: list[str] = []
        cur: str | None = name
        dev = default
        while cur is not None:
            if cur in out:
                dev = out[cur]
                break
            if cur in chain:  # hints in a circle: nothing fixes them
                break
            chain.append(cur)
            node = graph.nodes[cur]
            hint = ref_var(cur) or next((c for c in node.colocate_with if c in graph.nodes), None)
            if hint is None and node.follows in graph.nodes:
                hint = node.follows
            cur = hint
        for c in chain:
            out[c] = dev
        return dev

    for name in graph.nodes:
        resolve(name)
    for name in graph.nodes:
        var = ref_var(name)
        if var is not None and out[name] != out[var]:
            raise PlacementError(f"node '{name}' ({graph.nodes[name].op}) updates Variable '{var}' by reference, "
                                 f"so it must share its device, but it is assigned {out[name]} and the "
                                 f"Variable {out[var]}; assign both to one device")
    return out


def assign_layers(layer_nodes: Mapping[str, Sequence[str]],
                  groups: Sequence[tuple[Sequence[str], str]]) -> dict[str, str]:
    """node -> device for `groups` of (globs over layer names, device): every node a matched layer
    made goes to the group's device. A layer matched by groups on two devices is an error."""
    out: dict[str, str] = {}
    owner: dict[str, tuple[int, str]] = {}
    for i, (patterns, device) in enumerate(groups):
        dev = canonical(device)
        for pat in patterns:
            hits = [layer for layer in layer_nodes if fnmatch.fnmatchcase(layer, pat)]
            if not hits:
                raise PlacementError(f"group {i}: pattern '{pat}' matches no layer (layers: "
                                     f"{', '.join(list(layer_nodes)[:12])})")
            for layer in hits:
                prev = owner.get(layer)
                if prev is not None and prev[1] != dev:
                    raise PlacementError(f"layer '{layer}' is in group {prev[0]} ({prev[1]}) and group {i} "
                                         f"({dev}); a layer runs on one device")
                owner[layer] = (i, dev)
                for n in layer_nodes[layer]:
                    out[n] = dev
    return out


# ---------------------------------------------------------------------------- shared pieces
def _update(graph: Graph, optimizer: Optimizer, grads: list[Tensor | None], variables: Sequence[Tensor],
            process: GradientProcess | None, updates: Sequence[Tensor], name: str = "train_step") -> Tensor:
    with graph.as_default(), graph.absolute_scope():
        if process is not None:
            grads = list(process(grads))
        apply = optimizer.apply_gradients(list(zip(grads, variables)))
        return group([apply] + list(updates), name=name, graph=graph)


def _average(graph: Graph, per_copy: list[list[Tensor | None]], variables: Sequence[Tensor],
             scope: str) -> list[Tensor | None]:
    """Per variable: AddN of the copies' gradients, times 1/N, colocated with the variable (on the
    parameter device, Figure 7 top). AddN sums left to right, copy 0 first."""
    n = len(per_copy)
    out: list[Tensor | None] = []
    with graph.as_default(), graph.absolute_scope(scope):
        for i, v in enumerate(variables):
            gs = [g[i] for g in per_copy]
            if any(g is None for g in gs):
                out.append(None)
                continue
            assert all(g is not None for g in gs)
            with graph.colocate_with(v), graph.name_scope(v.node):
                total = add_n([g for g in gs if g is not None], name="sum") if n > 1 else gs[0]
                assert total is not None
                out.append(total * np.asarray(1.0 / n, dtype=np.dtype(v.dtype)) if n > 1 else total)
    return out


def _mean_loss(graph: Graph, losses: list[Tensor], scope: str) -> Tensor:
    with graph.as_default(), graph.absolute_scope(scope):
        if len(losses) == 1:
            return losses[0]
        return add_n(losses, name="loss_sum") * np.asarray(1.0 / len(losses), dtype=np.dtype(losses[0].dtype))


def _copies(graph: Graph, loss: Tensor, inputs: Mapping[str, Tensor], updates: Sequence[Tensor], count: int,
            scope: str) -> tuple[list[dict[str, str]], list[Tensor], list[dict[str, Tensor]], list[list[Tensor]]]:
    if loss.shape != ():
        raise GraphError(f"the loss '{loss.name}' must be a scalar (a mean over the batch), got shape {loss.shape}")
    nodes = forward_nodes(graph, [loss, *updates])
    missing = [name for name, t in inputs.items() if t.node not in nodes]
    if missing:
        raise GraphError(f"the loss does not depend on input(s) {missing}")
    maps = replicate(graph, nodes, count, scope)
    losses = [_copy(graph, m, loss) for m in maps]
    ins = [{name: _copy(graph, m, t) for name, t in inputs.items()} for m in maps]
    ups = [[_copy(graph, m, u) for u in updates] for m in maps]
    return maps, losses, ins, ups


def _no_ref(graph: Graph, name: str) -> bool:
    return not graph.nodes[name].opdef.ref_inputs


# ---------------------------------------------------------------------------- strategies
def single_step(graph: Graph, loss: Tensor, inputs: Mapping[str, Tensor], variables: Sequence[Tensor],
                optimizer: Optimizer, *, updates: Sequence[Tensor] = (), process: GradientProcess | None = None
                ) -> TrainStep:
    """One replica: gradients of `loss`, `process`, one update, grouped with `updates`."""
    gv = optimizer.compute_gradients(loss, variables)
    train_op = _update(graph, optimizer, [g for g, _ in gv], [v for _, v in gv], process, updates)
    return TrainStep(graph, loss, train_op, [dict(inputs)], None)


def accumulated_step(graph: Graph, loss: Tensor, inputs: Mapping[str, Tensor], variables: Sequence[Tensor],
                     optimizer: Optimizer, k: int, *, updates: Sequence[Tensor] = (),
                     process: GradientProcess | None = None) -> TrainStep:
    """Gradient accumulation over `k` micro-batches with one forward/backward graph, run k times
    (not k copies, as `pipeline` makes: the memory is one micro-batch's). Per trainable variable an
    accumulator Variable `<var>/accumulated` (zeros, colocated with it). Runs 1..k-1 run
    `accumulate_op`: accumulated += g (and the side updates). Run k runs `train_op`: the update
    with (accumulated + g) * (1/k) -- processed (clipped) as one gradient -- then accumulated <- 0.
    For a loss that is a mean over the micro-batch's examples this is one step on the whole batch
    (the pipeline's rule, w <- update(w, (1/K) sum_k grad L_k(w))), up to float32 rounding. The
    accumulators are zero between steps, where the trainer checkpoints, so a resume is exact."""
    if k < 1:
        raise GraphError(f"accumulate needs k >= 1 micro-batches, got {k}")
    if k == 1:
        return single_step(graph, loss, inputs, variables, optimizer, updates=updates, process=process)
    gv = optimizer.compute_gradients(loss, variables)
    live = [(g, v) for g, v in gv if g is not None]
    adds: list[Tensor] = []
    totals: dict[str, Tensor] = {}
    with graph.as_default(), graph.absolute_scope():
        accs: dict[str, Tensor] = {}
        for g, v in live:
            with graph.colocate_with(v):
                accs[v.node] = variable(np.zeros(v.shape, dtype=np.dtype(v.dtype)), name=f"{v.node}/accumulated",
                                        trainable=False)
        with graph.name_scope("accumulate"):
            for g, v in live:
                with graph.colocate_with(v), graph.name_scope(v.node):
                    adds.append(assign_add(accs[v.node], g, name="add"))
                    totals[v.node] = (accs[v.node] + g) * np.asarray(1.0 / k, dtype=np.dtype(v.dtype))
        accumulate_op = group(adds + list(updates), name="accumulate_step", graph=graph)
    grads = [totals.get(v.node) if g is not None else None for g, v in gv]
    apply = _update(graph, optimizer, grads, [v for _, v in gv], process, updates, name="apply_step")
    with graph.as_default(), graph.absolute_scope(), graph.control_dependencies([apply]):
        # The accumulators' reads fed the update; emptied after it, ready for the next step.
        with graph.name_scope("accumulate"):
            resets = []
            for _, v in live:
                with graph.colocate_with(v), graph.name_scope(v.node):
                    resets.append(assign(accs[v.node], zeros_like(accs[v.node]), name="reset"))
        train_op = group([apply] + resets, name="train_step", graph=graph)
    return TrainStep(graph, loss, train_op, [dict(inputs)], None, accumulate_op=accumulate_op, micro_batches=k)


def model_parallel(graph: Graph, loss: Tensor, inputs: Mapping[str, Tensor], variables: Sequence[Tensor],
                   optimizer: Optimizer, assignment: Mapping[str, str], default: str, *,
                   updates: Sequence[Tensor] = (), process: GradientProcess | None = None) -> TrainStep:
    """Figure 8: the single step's graph, placed by `assignment` (node -> device, e.g. from
    `assign_layers`) completed by `complete_placement`. The graph is exactly `single_step`'s, so the
    numbers are too."""
    step = single_step(graph, loss, inputs, variables, optimizer, updates=updates, process=process)
    step.placement = complete_placement(graph, assignment, default)
    return step


def _replicas(graph: Graph, loss: Tensor, inputs: Mapping[str, Tensor], variables: Sequence[Tensor],
              updates: Sequence[Tensor], devices: Sequence[str], strategy: str, optimizer: Optimizer
              ) -> tuple[list[dict[str, str]], list[Tensor], list[dict[str, Tensor]], list[list[Tensor]],
                         list[list[Tensor | None]]]:
    """Figure 7's replicas: the forward graph copied under `replica_<k>/` (sharing the Variables),
    and each copy's gradients with respect to the shared Variables."""
    n = len(devices)
    if n < 1:
        raise PlacementError(f"{strategy} needs at least one device")
    maps, losses, ins, ups = _copies(graph, loss, inputs, updates, n, "replica_{k}")
    with graph.absolute_scope():
        per = [optimizer.gradients_of(losses[k], variables, name=f"replica_{k}/gradients") for k in range(n)]
    return maps, losses, ins, ups, per


REDUCES = ("parameter_device", "allreduce")


def sync_data_parallel(graph: Graph, loss: Tensor, inputs: Mapping[str, Tensor], variables: Sequence[Tensor],
                       optimizer: Optimizer, devices: Sequence[str], *, param_device: str | None = None,
                       updates: Sequence[Tensor] = (), process: GradientProcess | None = None,
                       reduce: str = "parameter_device", bucket_bytes: int | None = None,
                       collective: bool | None = None) -> TrainStep:
    """Figure 7 top: replica k (forward and gradients, every node under `replica_<k>/`) on
    devices[k]; Variables, the gradient average, the optimizer and the update on `param_device`
    (default devices[0]). Replica 0's side updates (batch-norm moving averages) run with the step.
    `reduce="allreduce"`: every replica holds its own copy of the variables and the gradients are
    ring-all-reduced between the replicas instead (allreduce.py; `param_device` unused), or reduced
    by CollectiveAllReduce nodes where `collective` (default: `allreduce.use_collective`)."""
    if reduce not in REDUCES:
        raise GraphError(f"unknown gradient reduction {reduce!r}; known: {', '.join(REDUCES)}")
    if reduce == "allreduce":
        return _allreduce_data_parallel(graph, loss, inputs, variables, optimizer, devices, updates, process,
                                        bucket_bytes, collective)
    n = len(devices)
    maps, losses, ins, ups, per = _replicas(graph, loss, inputs, variables, updates, devices, "sync_data_parallel",
                                          optimizer)
    grads = _average(graph, per, variables, "sync_average")
    mean = _mean_loss(graph, losses, "sync_loss")
    train_op = _update(graph, optimizer, grads, variables, process, ups[0])
    fixed = {name: devices[k] for k in range(n) for name in graph.nodes
             if name.startswith(f"replica_{k}/") and _no_ref(graph, name)}
    placement = complete_placement(graph, fixed, param_device or devices[0])
    return TrainStep(graph, mean, train_op, ins, placement, maps)


def _allreduce_data_parallel(graph: Graph, loss: Tensor, inputs: Mapping[str, Tensor], variables: Sequence[Tensor],
                             optimizer: Optimizer, devices: Sequence[str], updates: Sequence[Tensor],
                             process: GradientProcess | None, bucket_bytes: int | None,
                             collective: bool | None = None) -> TrainStep:
    from flowctl.engine import allreduce as ar

    n = len(devices)
    if n < 1:
        raise PlacementError("sync_data_parallel needs at least one device")
    maps, losses, ins, ups = _copies(graph, loss, inputs, updates, n, "replica_{k}")
    mirrors = ar.mirror_state(graph, maps)
    with graph.as_default(), graph.absolute_scope():
        # Each replica differentiates its loss / N, so the all-reduce is a plain sum: the 1/N rides
        # on the backward pass's first product instead of costing a pass over every gradient.
        shares = [ar.share(graph, losses[k], n, f"replica_{k}/loss_share") for k in range(n)]
        per = [optimizer.gradients_of(shares[k], [_own(graph, mirrors[k], v) for v in variables],
                                      name=f"replica_{k}/gradients") for k in range(n)]
    placement: dict[str, str] = {}
    grads = ar.ring_allreduce(graph, per, devices, placement, bucket_bytes or ar.BUCKET_BYTES,
                              collective=collective)
    train_op = ar.replica_updates(graph, optimizer, grads, variables, mirrors, devices, placement, process, ups[0])
    mean = _mean_loss(graph, losses, "sync_loss")
    fixed = {name: devices[k] for k in range(n) for name in graph.nodes
             if name.startswith(f"replica_{k}/") and _no_ref(graph, name)}
    fixed.update(placement)
    return TrainStep(graph, mean, train_op, ins, complete_placement(graph, fixed, devices[0]), maps)


def _own(graph: Graph, mirrors: Mapping[str, str], v: Tensor) -> Tensor:
    return Tensor(graph, mirrors.get(v.node, v.node), v.port)


def pipeline(graph: Graph, loss: Tensor, inputs: Mapping[str, Tensor], variables: Sequence[Tensor],
             optimizer: Optimizer, micro_batches: int, assignment: Mapping[str, str], default: str, *,
             updates: Sequence[Tensor] = (), process: GradientProcess | None = None) -> TrainStep:
    """Figure 9: `micro_batches` copies of the forward graph under `micro_<k>/`, each node of each
    copy on the device `assignment` (completed) gives the node it copies; gradients follow their
    forward node; the K gradients are averaged on each variable's device and applied once.
    Micro-batch 0's side updates run with the step."""
    if micro_batches < 1:
        raise GraphError(f"pipeline needs at least 1 micro-batch, got {micro_batches}")
    base = complete_placement(graph, assignment, default)
    maps, losses, ins, ups = _copies(graph, loss, inputs, updates, micro_batches, "micro_{k}")
    with graph.absolute_scope():
        per = [optimizer.gradients_of(losses[k], variables, name=f"micro_{k}/gradients")
               for k in range(micro_batches)]
    grads = _average(graph, per, variables, "accumulate")
    mean = _mean_loss(graph, losses, "pipeline_loss")
    train_op = _update(graph, optimizer, grads, variables, process, ups[0])
    fixed = dict(base)
    for m in maps:
        fixed.update({copy: base[orig] for orig, copy in m.items() if _no_ref(graph, copy)})
    placement = complete_placement(graph, fixed, default)
    backward = [[n for n in graph.nodes if n.startswith(f"micro_{k}/gradients/")] for k in range(micro_batches)]
    forward = [list(m.values()) for m in maps]
    _order_micro_batches(graph, [forward, backward], placement)
    _limit_in_flight(graph, forward, backward, placement)
    return TrainStep(graph, mean, train_op, ins, placement, maps)


def _exits(graph: Graph, members: Sequence[str]) -> list[str]:
    """The nodes of `members` that no other member reads, sources (placeholders, constants) left
    out: waiting on a fed placeholder would run it, and a source's being done says nothing about
    the stage's work."""
    used = {parse_ref(r)[0] for n in members for r in graph.nodes[n].inputs} | \
        {c for n in members for c in graph.nodes[n].control_inputs}
    return [n for n in members if n not in used and (graph.nodes[n].inputs or graph.nodes[n].control_inputs)]


def _wait(graph: Graph, placement: dict[str, str], dev: str, exits: list[str], name: str, nodes: Sequence[str]) -> None:
    """A NoOp barrier on `dev` after `exits`, made a control input of every non-source node of
    `nodes` placed on `dev`."""
    with graph.absolute_scope():
        barrier = graph.add_node("NoOp", [], {}, control_inputs=exits, name=name)
    placement[barrier.name] = dev
    for n in nodes:
        node = graph.nodes[n]
        if placement[n] == dev and (node.inputs or node.control_inputs):
            node.control_inputs.append(barrier.name)


def _by_device(placement: Mapping[str, str], names: Sequence[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(placement[n], []).append(n)
    return out


def _limit_in_flight(graph: Graph, forward: list[list[str]], backward: list[list[str]],
                     placement: dict[str, str]) -> None:
    """The 1F1B schedule (PipeDream-Flush; Megatron-LM's and DeepSpeed's default): on stage s of S
    (stages ordered as micro-batch 0's forward first reaches their devices), micro-batch k's forward
    waits for micro-batch k - (S - s)'s backward there, so a stage holds at most S - s
    micro-batches' activations, the last stage one, instead of all K. The executors run the
    forwards first where both are ready (they were built first), so after its S - s warm-up
    forwards a stage alternates one forward and one backward; the flush at the step's end and so
    its idle time are GPipe's. No cycle: a forward only waits for an earlier micro-batch's
    backward, which needs nothing of a later micro-batch. Only the order changes, not the
    arithmetic."""
    k_all = len(forward)
    first: dict[str, int] = {}
    for i, n in enumerate(forward[0]):
        node = graph.nodes[n]
        if node.inputs or node.control_inputs:
            first.setdefault(placement[n], i)
    stages = sorted(first, key=first.__getitem__)
    devices = sorted(set(placement.values()))
    backward_on = [_by_device(placement, names) for names in backward]
    for s, dev in enumerate(stages):
        ahead = len(stages) - s
        for k in range(ahead, k_all):
            exits = _exits(graph, backward_on[k - ahead].get(dev, []))
            if exits:
                _wait(graph, placement, dev, exits, f"pipeline_order/in_flight/micro_{k}/device_{devices.index(dev)}",
                      forward[k])


def _order_micro_batches(graph: Graph, phases: list[list[list[str]]], placement: dict[str, str]) -> None:
    """For each phase (forward copies; their gradients), on each device, micro-batch k's nodes of
    that phase wait for micro-batch k-1's nodes of the phase there: a NoOp barrier on the device
    with the earlier nodes as control inputs, made a control input of every non-source node of k.

    Why: a device's executor runs ready nodes first in, first out (§3.1), so K copies that are all
    ready at once are interleaved breadth-first and every micro-batch leaves a device at about the
    same time, at the end: no overlap between devices at all. Ordered, the first device hands
    micro-batch 0 on as soon as it is done with it and goes on with micro-batch 1 while the next
    device works on 0 (Figure 9), and the same backwards for the gradients. (The executors now
    take ready nodes in build order, which keeps copies apart too; the chain still says the order
    outright, and `_limit_in_flight` interleaves the two phases.)
    Only the order changes, not the arithmetic, so the result is the same. The barriers cannot make
    a cycle: they only make copy k wait for copy k-1, and no node of copy k-1 reads copy k."""
    devices = sorted(set(placement.values()))
    for p, per_copy in enumerate(phases):
        for k in range(1, len(per_copy)):
            for dev, members in _by_device(placement, per_copy[k - 1]).items():
                exits = _exits(graph, members)
                if exits:
                    _wait(graph, placement, dev, exits, f"pipeline_order/phase_{p}/micro_{k}/device_{devices.index(dev)}",
                          per_copy[k])


def async_data_parallel(graph: Graph, loss: Tensor, inputs: Mapping[str, Tensor], variables: Sequence[Tensor],
                        optimizer: Optimizer, devices: Sequence[str], *, param_device: str | None = None,
                        updates: Sequence[Tensor] = (), process: GradientProcess | None = None) -> AsyncStep:
    """Figure 7 bottom: replica k's forward and gradients on devices[k]; the Variables, the update
    and an int64 update counter `async/updates` on `param_device` (default devices[0]).

    The update is one subgraph fed with a replica's gradients rather than one per replica, so the
    optimizer's slots (momentum, Adam's moments and step) are shared exactly as the parameters are,
    and an update runs as one partition on the parameter device's single execution thread: updates
    never interleave, and a replica's parameter read (one partition there too) sees whole updates.
    The counter is read in the same partition as the parameters, so staleness is exact."""
    n = len(devices)
    maps, losses, ins, ups, per = _replicas(graph, loss, inputs, variables, updates, devices, "async_data_parallel",
                                          optimizer)
    with graph.absolute_scope():
        side = [group(u, name=f"replica_{k}/side_updates", graph=graph) if u else None for k, u in enumerate(ups)]
    live = [i for i, g in enumerate(per[0]) if g is not None]
    if not live:
        raise GraphError(f"the loss '{loss.name}' depends on none of the variables")
    live_vars = [variables[i] for i in live]
    grads = [[g[i] for i in live] for g in per]
    with graph.as_default(), graph.absolute_scope("async"):
        version = variable(np.asarray(0, np.int64), name="updates", trainable=False)
        feeds = [placeholder(v.dtype, v.shape, name=f"grad/{v.node}") for v in live_vars]
    apply = _update(graph, optimizer, list(feeds), live_vars, process, (), name="async/apply")
    with graph.as_default(), graph.absolute_scope("async"), graph.control_dependencies([apply]):
        applied = assign_add(version, np.asarray(1, np.int64), name="count")
    fixed = {name: devices[k] for k in range(n) for name in graph.nodes
             if name.startswith(f"replica_{k}/") and _no_ref(graph, name)}
    placement = complete_placement(graph, fixed, param_device or devices[0])
    return AsyncStep(graph, placement, losses, [[g for g in gs if g is not None] for gs in grads], ins, side,
                     live_vars, feeds, version, applied, apply, maps)
