"""All-reduce data parallelism (issue 33, engine/allreduce.py): replicas own their variables, the
gradients meet in a bucketed ring over Send/Recv, every replica applies the same update. The
parameter device's numbers bit for bit with two replicas, float rounding with more; replicas stay
identical; checkpoints hold the primaries only; the transfers overlap the backward pass; the spec
chooses the reduction."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine import allreduce as ar
from flowctl.engine import checkpoint as ckpt
from flowctl.engine import strategies as st
from flowctl.engine.cluster import Cluster
from flowctl.engine.container import ContainerStore
from flowctl.engine.errors import CheckpointError
from flowctl.engine.optimizers import SGD, Adam, Momentum
from flowctl.engine.runtime import DistributedSession
from flowctl.engine.errors import SpecError
from flowctl.spec.loader import load_text
from flowctl.training.program import build_model, build_step, step_config

CPUS = [f"cpu:{i}" for i in range(4)]


def mlp(seed: int = 1, widths: tuple[int, ...] = (8, 16, 16, 3)):
    g = fc.Graph(seed=seed)
    with g.as_default():
        x = fc.placeholder("float32", (None, widths[0]), name="x")
        y = fc.placeholder("int32", (None,), name="y")
        h, variables = x, []
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            w = fc.variable(fc.truncated_normal((a, b), stddev=0.3), name=f"w{i}")
            c = fc.variable(fc.zeros((b,)), name=f"b{i}")
            h = fc.bias_add(fc.matmul(h, w), c)
            if i < len(widths) - 2:
                h = fc.tanh(h)
            variables += [w, c]
        loss = fc.reduce_mean(fc.sparse_softmax_cross_entropy(h, y), name="loss")
    return g, x, y, loss, variables


def batch(n: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)


def trained(reduce: str, replicas: int, opt: str = "adam", steps: int = 4, bucket: int | None = None):
    g, x, y, loss, variables = mlp()
    optimizer = {"adam": Adam(0.01), "sgd": SGD(0.1), "momentum": Momentum(0.05)}[opt]
    with g.as_default():
        step = st.sync_data_parallel(g, loss, {"x": x, "y": y}, variables, optimizer, CPUS[:replicas],
                                     reduce=reduce, bucket_bytes=bucket)
        init = fc.global_variables_initializer(g)
    placement = st.complete_placement(g, step.placement, CPUS[0])
    s = DistributedSession(g, Cluster.local(replicas), placement, store=ContainerStore())
    s.run(init)
    X, Y = batch()
    losses = [float(s.run([step.loss, step.train_op], step.feeds({"x": X, "y": Y}))[0]) for _ in range(steps)]
    return s, step, losses


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
def test_two_replicas_give_the_parameter_devices_numbers_bit_for_bit(opt):
    ps, _, ps_losses = trained("parameter_device", 2, opt)
    s, _, losses = trained("allreduce", 2, opt, bucket=200)  # several buckets
    assert losses == ps_losses and losses[-1] < losses[0]
    saved, _ = ckpt.capture(s)
    ref, _ = ckpt.capture(ps)
    assert sorted(saved) == sorted(ref)  # the primaries only: a checkpoint like the parameter device's
    for k, v in ref.items():
        np.testing.assert_array_equal(saved[k], v, err_msg=k)


def test_more_replicas_agree_to_float_rounding_and_stay_identical():
    _, _, ps_losses = trained("parameter_device", 3)
    s, step, losses = trained("allreduce", 3, bucket=300)
    np.testing.assert_allclose(losses, ps_losses, rtol=1e-6)
    values = s.variable_values()
    mirrors = ckpt.mirrors(step.graph)
    assert {m for m in mirrors if m.startswith("replica_2/")} >= {"replica_2/w0", "replica_2/w0/Adam/m",
                                                                    "replica_2/Adam/t"}
    for m, p in mirrors.items():
        np.testing.assert_array_equal(values[m], values[p], err_msg=m)


def embedded(reduce: str, replicas: int, opt: str, steps: int = 3):
    """An embedding table (20 x 6) read by 4 ids per example, under a small classifier; the ids
    repeat within and across the replicas' halves of the batch."""
    g = fc.Graph(seed=3)
    with g.as_default():
        ids = fc.placeholder("int32", (None, 4), name="ids")
        y = fc.placeholder("int32", (None,), name="y")
        table = fc.variable(fc.truncated_normal((20, 6), stddev=0.5), name="table")
        w = fc.variable(fc.truncated_normal((6, 3), stddev=0.5), name="w")
        h = fc.reduce_mean(fc.gather(table, ids), axis=1)
        loss = fc.reduce_mean(fc.sparse_softmax_cross_entropy(fc.matmul(h, w), y), name="loss")
        optimizer = {"adam": Adam(0.05), "sgd": SGD(0.5), "momentum": Momentum(0.2)}[opt]
        step = st.sync_data_parallel(g, loss, {"ids": ids, "y": y}, [table, w], optimizer, CPUS[:replicas],
                                     reduce=reduce)
        init = fc.global_variables_initializer(g)
    placement = st.complete_placement(g, step.placement, CPUS[0])
    s = DistributedSession(g, Cluster.local(replicas), placement, store=ContainerStore())
    s.run(init)
    rng = np.random.default_rng(4)
    X, Y = rng.integers(0, 12, (12, 4)).astype(np.int32), rng.integers(0, 3, 12).astype(np.int32)
    losses = [float(s.run([step.loss, step.train_op], step.feeds({"ids": X, "y": Y}))[0]) for _ in range(steps)]
    return s, step, losses


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
def test_an_embedding_tables_rows_travel_sparse_with_the_parameter_devices_bits(opt):
    ps, _, ps_losses = embedded("parameter_device", 2, opt)
    s, step, losses = embedded("allreduce", 2, opt)
    assert losses == ps_losses and losses[-1] < losses[0]
    saved, _ = ckpt.capture(s)
    for k, v in ckpt.capture(ps)[0].items():
        np.testing.assert_array_equal(saved[k], v, err_msg=k)
    # Nothing of the table's dense shape crosses between the replicas: its rows do.
    feeds = step.feeds({"ids": np.zeros((12, 4), np.int32), "y": np.zeros(12, np.int32)})
    parts = s.step_plan([step.loss, step.train_op], feeds).partitions.values()
    sends = [(part, n) for part in parts for n in part.nodes.values() if n.op == "Send"]
    shapes = {part.tensor(n.inputs[0]).shape for part, n in sends}
    assert (20, 6) not in shapes
    assert any(part.nodes[n.inputs[0].split(":")[0]].op == "GatherGradRows" for part, n in sends)
    if opt == "sgd":  # the update itself stays sparse
        assert any(n.op == "SparseApplyGradientDescent" for n in step.graph.nodes.values())


def test_three_replicas_sum_the_tables_rows_and_stay_identical():
    _, _, ps_losses = embedded("parameter_device", 3, "adam")
    s, step, losses = embedded("allreduce", 3, "adam")
    np.testing.assert_allclose(losses, ps_losses, rtol=1e-6)
    values = s.variable_values()
    for m, p in ckpt.mirrors(step.graph).items():
        np.testing.assert_array_equal(values[m], values[p], err_msg=m)


def test_buckets_follow_the_backward_order_and_close_at_their_size():
    g, x, y, loss, variables = mlp(widths=(8, 16, 16, 3))
    grads = fc.gradients(loss, variables)
    sizes = {v.node: int(np.prod(v.shape)) * 4 for v in variables}
    one_each = ar.buckets(g, grads, 1)
    assert all(len(b) == 1 for b in one_each)
    order = [variables[b[0]].node for b in one_each]
    layer = [int(name[1:]) for name in order]
    assert layer == sorted(layer, reverse=True)  # the last layer's gradients first, the first layer's last
    last_layer = sizes["w2"] + sizes["b2"]
    two = ar.buckets(g, grads, last_layer)
    assert {variables[i].node for i in two[0]} == {"w2", "b2"}  # the last layer's gradients come first
    assert sorted(i for b in ar.buckets(g, grads, 1 << 30) for i in b) == list(range(len(variables)))
    assert len(ar.buckets(g, grads, 1 << 30)) == 1


def test_a_buckets_transfers_start_while_the_backward_pass_goes_on():
    g, x, y, loss, variables = mlp(widths=(8, 256, 256, 256, 3))
    with g.as_default():
        step = st.sync_data_parallel(g, loss, {"x": x, "y": y}, variables, SGD(0.1), CPUS[:2], reduce="allreduce",
                                     bucket_bytes=1)  # a bucket per gradient
        init = fc.global_variables_initializer(g)
    placement = st.complete_placement(g, step.placement, CPUS[0])
    s = DistributedSession(g, Cluster.local(2), placement, store=ContainerStore())
    s.run(init)
    X, Y = batch(64)
    feeds = step.feeds({"x": np.repeat(X, 6, 0)[:64], "y": np.repeat(Y, 6)[:64]})
    s.run([step.loss, step.train_op], feeds)
    stats = fc.RunStats()
    s.run([step.loss, step.train_op], feeds, stats=stats)
    started = {name: t for name, t, _ in stats.runs()}
    finished = {name: t for name, _, t in stats.runs()}
    first_reduce = min(t for n, t in started.items() if n.startswith("allreduce/bucket_0/"))
    backward_end = max(t for n, t in finished.items() if n.startswith("replica_0/gradients/"))
    assert first_reduce < backward_end  # the first bucket is on its way before the backward is done


def test_a_drifted_replica_is_refused_at_the_checkpoint_and_restore_fills_the_mirrors():
    s, step, _ = trained("allreduce", 2, steps=2)
    saved, state = ckpt.capture(s)
    s.load_variables({"replica_1/w0": s.variable_values()["replica_1/w0"] + 1.0})
    with pytest.raises(CheckpointError, match="replica_1/w0.*drifted"):
        ckpt.capture(s)
    ckpt.apply(s, saved, state)  # strict: the checkpoint needs no mirror, and fills them
    values = s.variable_values()
    np.testing.assert_array_equal(values["replica_1/w0"], saved["w0"])
    np.testing.assert_array_equal(values["replica_1/w0/Adam/v"], saved["w0/Adam/v"])


SPEC = """\
version: 1
name: dp
model:
  layers:
    - {{name: x, type: input, shape: [16]}}
    - {{name: h, type: dense, units: 32, activation: relu}}
    - {{name: logits, type: dense, units: 4}}
    - {{name: y, type: input, shape: [], dtype: int32, classes: 4}}
    - {{name: loss, type: softmax_cross_entropy, inputs: [logits, y]}}
data: {{source: synthetic, task: learnable, seed: 0}}
devices: {devices}
parallelism: {parallelism}
training: {{optimizer: {{type: adam}}, learning_rate: 0.01, batch_size: 16, steps: 4{training}}}
"""


def spec(parallelism: str = "{strategy: sync_data_parallel}", devices: str = "[cpu:0, cpu:1]",
         training: str = "") -> str:
    return SPEC.format(parallelism=parallelism, devices=devices, training=training)


def test_the_spec_defaults_to_allreduce_where_the_replicas_hold_the_model():
    loaded = load_text(spec(), "dp.yaml")
    config = step_config(loaded)
    assert config.reduce == "allreduce"
    step = build_step(build_model(loaded, training=True), config)
    assert step.describe().startswith("sync_data_parallel (allreduce), 2 replicas")
    assert ckpt.mirrors(step.graph)
    # A device too small for a copy of the variables and Adam's slots: the parameter device.
    small = "[{name: cpu:0, profile: {memory: 4KiB}}, {name: cpu:1, profile: {memory: 4KiB}}]"
    assert step_config(load_text(spec(devices=small), "dp.yaml")).reduce == "parameter_device"
    explicit = spec("{strategy: sync_data_parallel, reduce: parameter_device}")
    assert step_config(load_text(explicit, "dp.yaml")).reduce == "parameter_device"


@pytest.mark.parametrize("parallelism, training, message", [
    ("{strategy: model_parallel, reduce: allreduce, groups: [{layers: [h], device: cpu:1}]}", "",
     "reduce: allreduce is for strategy sync_data_parallel, not model_parallel"),
    ("{strategy: sync_data_parallel, reduce: allreduce}", ", precision: fp16",
     "fp16's loss scaling is built for one update"),
    ("{strategy: sync_data_parallel, reduce: ring}", "", "reduce"),
])
def test_a_reduce_the_strategy_cannot_use_is_a_located_spec_error(parallelism, training, message):
    with pytest.raises(SpecError) as e:
        load_text(spec(parallelism, training=training), "dp.yaml")
    assert message in str(e.value) and "dp.yaml:" in str(e.value)


def test_place_and_the_simulator_see_each_replicas_state_and_the_rings_transfers(tmp_path: Path):
    from flowctl.engine.cluster import Cluster as C
    from flowctl.engine.placement.cost import StaticCostModel
    from flowctl.training.program import place_step

    out = {}
    four = "[cpu:0, cpu:1, cpu:2, cpu:3]"
    for reduce in ("parameter_device", "allreduce"):
        loaded = load_text(spec(f"{{strategy: sync_data_parallel, reduce: {reduce}}}", devices=four), "dp.yaml")
        config = step_config(loaded)
        step = build_step(build_model(loaded, training=True), config)
        cluster = C.local(4)
        placed = place_step(step, config, cluster, StaticCostModel(cluster))
        out[reduce] = placed.chosen.simulation
    ps, allr = out["parameter_device"], out["allreduce"]
    params = (16 * 32 + 32 + 32 * 4 + 4) * 4
    # Every replica holds the parameters and Adam's slots: replica 1's resident memory grows by them.
    assert allr.device("cpu:1").resident >= ps.device("cpu:1").resident + 3 * params
    # The parameter device takes in every other replica's gradients (3P) and sends them the
    # parameters (3P); in the ring every replica moves 2(N-1)/N P = 1.5P each way. (The losses
    # reach replica 0 too: 4 bytes each.)
    assert 3 * params <= ps.device("cpu:0").bytes_in <= 3 * params + 64
    assert 3 * params <= ps.device("cpu:0").bytes_out <= 3 * params + 64
    for d in CPUS:
        assert 1.5 * params - 16 <= allr.device(d).bytes_in <= 1.5 * params + 64, d
        assert 1.5 * params - 16 <= allr.device(d).bytes_out <= 1.5 * params + 64, d
    assert allr.step_time > 0 and ps.step_time > 0
