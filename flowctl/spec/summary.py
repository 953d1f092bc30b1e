"""What `flowctl inspect` reports: per-layer shapes and parameters, node counts, FLOPs per training
step and an activation-memory estimate, all read off the graph actually built.

FLOPs come from each op's own cost function (OpDef.estimate, whitepaper §3.2.1's cost model) over
the concrete shapes `place`'s cost model uses (`concrete_shapes`: the sources' unknown (batch)
dimensions set to the per-replica batch and every shape function re-run, so a dimension derived
from the batch -- attention's [batch, heads, time, depth] after a reshape with -1 -- gets its real
size, not the batch's). Activation bytes are every forward op's
outputs once; a view (a Reshape, a Split part: its input's buffer, OpDef.view) adds none. A training step is the forward pass, the
backward pass (`fc.gradients` of the loss w.r.t. every trainable variable) and the batch-norm
moving-average updates; the optimizer's update ops belong to the training stage and are not counted.
"""
from __future__ import annotations

import math
from typing import Any

import flowctl as fc
from flowctl.engine.frames import run_counts
from flowctl.engine.dtypes import itemsize
from flowctl.engine.executor import needed_nodes
from flowctl.engine.graph import Graph, parse_ref
from flowctl.engine.opdef import SOURCE, STATE
from flowctl.engine.placement.cost import concrete_shapes, views_of
from flowctl.engine.shapes import TensorSpec
from flowctl.spec.check import LoadedSpec
from flowctl.spec.model import BuiltModel, build_model


def ancestors(graph: Graph, targets: list[str]) -> set[str]:
    """Every node one run of the targets executes (the executor's own pruning, §4.2)."""
    return needed_nodes(graph, targets, set())


def _cost(graph: Graph, name: str, batch: int, shapes: dict[str, list[tuple[int, ...]]]) -> tuple[float, float]:
    node = graph.nodes[name]
    ins = []
    for ref in node.inputs:
        src, port = parse_ref(ref)
        ins.append(TensorSpec(shapes[src][port], graph.nodes[src].outputs[port].dtype))
    outs = [TensorSpec(shape, spec.dtype) for shape, spec in zip(shapes[name], node.outputs)]
    return node.opdef.estimate(ins, outs, node.attrs, batch=batch)


def _bytes(graph: Graph, name: str, shapes: dict[str, list[tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) * itemsize(s.dtype) for shape, s in zip(shapes[name], graph.nodes[name].outputs))


def summarize(loaded: LoadedSpec, model: BuiltModel | None = None) -> dict[str, Any]:
    model = model or build_model(loaded, training=True)
    g = model.graph
    batch = loaded.per_replica_batch
    forward_targets = [t.node for t in model.outputs.values()]
    forward = ancestors(g, forward_targets)
    model_nodes = len(g)  # before gradient nodes are added
    step_targets = list(forward_targets) + [u.node for u in model.updates]
    if model.loss is not None:
        grads = fc.gradients(model.loss, model.trainable_variables())
        step_targets += [t.node for t in grads if t is not None]
    step = ancestors(g, step_targets)
    free = {n for n in step if g.nodes[n].opdef.group in (SOURCE, STATE) and g.nodes[n].op != "Placeholder"}
    layer_of = model.layer_of()

    per_layer: dict[str, dict[str, float]] = {n: {"forward_flops": 0.0, "step_flops": 0.0, "activation_bytes": 0}
                                              for n in loaded.layers}
    total_fwd = total_step = 0.0
    activations = 0
    runs = run_counts(g)  # §4.4: an op in a loop counts once per expected iteration
    order = g.topo_order()
    shapes = concrete_shapes(g, batch)
    views = views_of(g, order, {n: i for i, n in enumerate(order)}, shapes)
    is_view = {n for n, v in zip(order, views) if v is not None} if views else set()
    for n in step:
        if n in free:
            continue
        flops, _ = _cost(g, n, batch, shapes)
        flops *= runs.get(n, 1.0)
        node = g.nodes[n]
        owner = layer_of.get(n) or layer_of.get(node.follows)
        total_step += flops
        if owner is not None:
            per_layer[owner]["step_flops"] += flops
        if n in forward:
            total_fwd += flops
            b = 0 if n in is_view else int(_bytes(g, n, shapes) * runs.get(n, 1.0))  # a view holds its input's buffer
            activations += b
            if owner is not None:
                per_layer[owner]["forward_flops"] += flops
                per_layer[owner]["activation_bytes"] += b
    trainable, frozen = model.params()
    param_bytes = sum(math.prod(v.shape) * itemsize(v.dtype) for v in model.all_variables())

    layers = []
    for name, info in loaded.layers.items():
        t, nt = info.params
        layers.append({
            "name": name, "type": info.layer.type, "inputs": info.inputs,
            "output_shape": list(info.output.shape), "dtype": info.output.dtype,
            "params": t + nt, "trainable_params": t,
            "nodes": len(model.layer_nodes[name]),
            "forward_flops": per_layer[name]["forward_flops"], "step_flops": per_layer[name]["step_flops"],
            "activation_bytes": per_layer[name]["activation_bytes"],
            "source": str(info.mark) if info.mark else "",
        })
    blocks = []
    for inst in loaded.instances:
        out = loaded.layers.get(inst.output)
        members = [loaded.layers[n] for n in inst.layers if n in loaded.layers]
        blocks.append({
            "name": inst.name, "block": inst.block, "output": inst.output,
            "output_shape": list(out.output.shape) if out else None,
            "params": sum(sum(m.params) for m in members),
            "trainable_params": sum(m.params[0] for m in members),
        })
    spec = loaded.spec
    return {
        "name": spec.name or spec.model.name,
        "batch_size": batch, "global_batch_size": loaded.global_batch,
        "replicas": spec.parallelism.replicas, "strategy": spec.parallelism.strategy,
        "params": {"total": trainable + frozen, "trainable": trainable, "non_trainable": frozen},
        "layers": layers, "blocks": blocks, "loss": loaded.loss,
        "nodes": {"model": model_nodes, "forward": len(forward), "training_step": len(step)},
        "flops": {"forward": total_fwd, "training_step": total_step},
        "memory": {"activation_bytes": activations, "parameter_bytes": param_bytes},
    }


__all__ = ["ancestors", "summarize"]
