"""Partitioning (whitepaper §3.2.2, §5.2, §5.5): Send/Recv on exactly the cross-device edges, one Recv
per (tensor, destination device), control edges carried by a dummy tensor, fed tensors never sent,
lossy compression bit-exact against an independent reference, and ALAP control edges that change
when a Recv starts but not what is computed."""
from __future__ import annotations

import struct

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.cluster import Cluster
from flowctl.engine.devices import canonical
from flowctl.engine.graph import parse_ref
from flowctl.engine.partition import feed_node_name, partition
from flowctl.engine.runtime import DistributedSession
from flowctl.kernels.communication import narrow, widen

C0, C1, C2 = canonical("cpu:0"), canonical("cpu:1"), canonical("cpu:2")


def _nodes(parts, op):
    return [(d, n) for d, g in parts.items() for n in g.nodes.values() if n.op == op]


def _fan_out_graph():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (None, 4), name="x")
        s = fc.tanh(x, name="s")
        a = fc.exp(s, name="a")
        b = fc.square(s, name="b")
        c = fc.relu(s, name="c")
        d = fc.add(a, b, name="d")
        fc.add(d, c, name="out")
    return g


def test_one_recv_per_tensor_and_destination_device():
    g = _fan_out_graph()
    pl = {"x": C0, "s": C0, "a": C1, "b": C1, "d": C1, "c": C2, "out": C2}
    parts = partition(g, pl)
    recvs = _nodes(parts, "Recv")
    keys = [(n.attrs["tensor_name"], d) for d, n in recvs]
    assert len(keys) == len(set(keys))  # never two Recvs of one tensor on one device
    # s:0 goes to cpu:1 (read by a and b: one Recv) and cpu:2 (c); d:0 goes to cpu:2.
    assert sorted(keys) == sorted([("s:0", C1), ("s:0", C2), ("d:0", C2)])
    recv_s1 = next(n.name for d, n in recvs if d == C1)
    assert parts[C1].nodes["a"].inputs == [f"{recv_s1}:0"]
    assert parts[C1].nodes["b"].inputs == [f"{recv_s1}:0"]
    sends = _nodes(parts, "Send")
    assert sorted((n.attrs["tensor_name"], n.attrs["recv_device"]) for _, n in sends) == sorted(keys)
    for d, n in sends:  # each Send sits with its producer and names its peer Recv's device
        assert d == pl[parse_ref(n.inputs[0])[0]] == n.attrs["send_device"]


def test_no_send_or_recv_inside_a_device():
    g = _fan_out_graph()
    one = partition(g, {n: C0 for n in g.nodes})
    assert list(one) == [C0]
    assert not _nodes(one, "Send") and not _nodes(one, "Recv")
    assert set(one[C0].nodes) == set(g.nodes)
    pl = {"x": C0, "s": C0, "a": C0, "b": C1, "d": C1, "c": C1, "out": C1}
    parts = partition(g, pl)
    # Exactly the cut edges, counted independently from the original graph: s->b, s->c (one Recv), a->d.
    cut = {(r, pl[n.name]) for n in g.nodes.values() for r in n.inputs if pl[parse_ref(r)[0]] != pl[n.name]}
    assert cut == {("s:0", C1), ("a:0", C1)}
    assert {(n.attrs["tensor_name"], d) for d, n in _nodes(parts, "Recv")} == cut
    for d, pg in parts.items():
        for n in pg.nodes.values():  # same-device edges stay direct
            for r in n.inputs:
                src = parse_ref(r)[0]
                assert src in pg.nodes
                if pg.nodes[src].op == "Recv":
                    assert pg.nodes[src].attrs["send_device"] != d


def test_every_partition_passes_check_and_keeps_names():
    g = _fan_out_graph()
    pl = {n: [C0, C1, C2][i % 3] for i, n in enumerate(g.nodes)}
    parts = partition(g, pl)
    for d, pg in parts.items():
        pg.check()
        for n in pg.nodes.values():
            assert n.assigned_device == d
    user = {n for pg in parts.values() for n in pg.nodes if not n.startswith("_")}
    assert user == set(g.nodes)


def test_cross_device_control_edge_becomes_a_dummy_transfer():
    g = fc.Graph()
    with g.as_default():
        a = fc.constant(np.ones(3, np.float32), name="a")
        first = fc.exp(a, name="first")
        with g.control_dependencies([first]):
            second = fc.tanh(a, name="second")
            third = fc.relu(a, name="third")
    pl = {"a": C1, "first": C0, "second": C1, "third": C1}
    parts = partition(g, pl)
    recv = [n for d, n in _nodes(parts, "Recv") if n.attrs["tensor_name"] == "^first"]
    assert len(recv) == 1 and recv[0].attrs["shape"] == (0,)  # one shared, empty dummy
    for name in ("second", "third"):
        assert parts[C1].nodes[name].control_inputs == [recv[0].name]
    send = [n for d, n in _nodes(parts, "Send") if n.attrs["tensor_name"] == "^first"]
    dummy = parts[C0].nodes[parse_ref(send[0].inputs[0])[0]]
    assert dummy.op == "Const" and dummy.control_inputs == ["first"]
    assert not any(n.attrs["tensor_name"] == "first:0" for _, n in _nodes(parts, "Send"))


def test_group_across_devices_waits_without_moving_data():
    g = fc.Graph()
    with g.as_default():
        v = fc.variable(np.zeros((64, 64), np.float32), name="v")
        fc.group([fc.assign_add(v, np.ones((64, 64), np.float32), name="upd")], name="train")
    pl = {n: C0 for n in g.nodes}
    pl["train"] = C1
    parts = partition(g, pl)
    (recv,) = [n for _, n in _nodes(parts, "Recv")]
    assert recv.attrs["tensor_name"] == "^upd" and recv.attrs["shape"] == (0,)
    assert parts[C1].nodes["train"].inputs == [] and parts[C1].nodes["train"].control_inputs == [recv.name]


def test_fed_tensor_is_fed_to_each_consuming_device_not_sent():
    g = _fan_out_graph()
    pl = {"x": C2, "s": C0, "a": C1, "b": C1, "d": C1, "c": C2, "out": C2}
    parts = partition(g, pl, nodes=["s", "a", "b", "c", "d", "out"], feeds=["x:0", "s:0"])
    assert "x" not in parts[C2].nodes
    for d in (C0,):
        assert parts[d].nodes["s"].inputs == [f"{feed_node_name('x:0')}:0"]
    for d in (C1, C2):  # s:0 is fed, so neither device receives it
        assert feed_node_name("s:0") in parts[d].nodes
    assert {n.attrs["tensor_name"] for _, n in _nodes(parts, "Recv")} == {"d:0"}


def test_reference_edge_across_devices_is_a_placement_error():
    g = fc.Graph()
    with g.as_default():
        v = fc.variable(np.zeros(3, np.float32), name="v")
    pl = {"v": C0, "v/initial_value": C0, "v/init": C1}  # zeros: a Fill, not a Const
    with pytest.raises(fc.PlacementError, match=r"node 'v/init' \(Assign\) on .*cpu:1 updates variable 'v'"):
        partition(g, pl)


def test_missing_or_contradicted_placement_is_an_error():
    g = _fan_out_graph()
    with pytest.raises(fc.PlacementError, match="no device for node"):
        partition(g, {"x": C0})
    g.nodes["a"].device = "cpu:0"
    pl = {n: C1 for n in g.nodes}
    with pytest.raises(fc.PlacementError, match="node 'a' \\(Exp\\) asks for device 'cpu:0'"):
        partition(g, pl)


def _reference_bf16(values: np.ndarray) -> np.ndarray:
    """Independent reference: the float32 bit pattern via struct, low 16 bits cleared."""
    out = []
    for v in values.ravel().tolist():
        bits = struct.unpack("<I", struct.pack("<f", v))[0] & 0xFFFF0000
        out.append(struct.unpack("<f", struct.pack("<I", bits))[0])
    return np.array(out, np.float32).reshape(values.shape)


def test_compression_truncates_to_the_upper_16_bits(rng):
    x = (rng.standard_normal((7, 5)) * 10.0 ** rng.integers(-3, 4, (7, 5))).astype(np.float32)
    wire = narrow(np, x)
    assert wire.dtype == np.uint16 and wire.nbytes == x.nbytes // 2
    back = widen(np, wire)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, _reference_bf16(x))
    # bfloat16 keeps 8 significant bits: truncation error below 2**-7 relative, never above.
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0 ** -7)
    assert np.all(np.abs(back) <= np.abs(x))
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    got = widen(np, narrow(np, special))
    assert np.isposinf(got[0]) and np.isneginf(got[1]) and np.isnan(got[2]) and got[3] == 0
    nan_low = np.array([0x7F800001], np.uint32).view(np.float32)  # NaN payload in the dropped bits
    assert np.isnan(widen(np, narrow(np, nan_low))[0])


def test_compress_applies_to_float32_edges_only():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (2, 3), name="x")
        i = fc.placeholder("int32", (2,), name="i")
        fc.add(fc.tanh(x, name="t"), fc.cast(fc.reshape(fc.cast(i, "float32"), (2, 1)), "float32"), name="y")
        fc.identity(i, name="ii")
    pl = {n: C0 for n in g.nodes}
    pl.update({"y": C1, "ii": C1})
    parts = partition(g, pl, compress=True)
    by_tensor = {n.attrs["tensor_name"]: n for _, n in _nodes(parts, "Recv")}
    assert by_tensor["t:0"].attrs["compress"] is True
    assert by_tensor["i:0"].attrs["compress"] is False


def _alap_graph():
    """cpu:0 makes `r` at once; cpu:1 runs a chain of six ops before the first consumer of r."""
    g = fc.Graph()
    with g.as_default():
        r = fc.exp(fc.constant(np.linspace(-1, 1, 6, dtype=np.float32), name="src"), name="r")
        h = fc.constant(np.arange(6, dtype=np.float32), name="h0")
        for k in range(6):
            h = fc.tanh(h * 0.5, name=f"chain{k}")
        fc.add(h, r, name="out")
    pl = {n: C1 for n in g.nodes}
    pl.update({"src": C0, "r": C0})
    return g, pl


def test_alap_delays_the_recv_until_its_consumer_is_near():
    g, pl = _alap_graph()
    asap = partition(g, pl)
    alap = partition(g, pl, recv_schedule="alap")
    (r_asap,) = [n for _, n in _nodes(asap, "Recv")]
    (r_alap,) = [n for _, n in _nodes(alap, "Recv")]
    assert r_asap.control_inputs == []
    assert r_alap.control_inputs == ["chain5"]  # the last node finishing before `out` could start
    # A second consumer that needs r early: the shared Recv must not wait for the whole chain.
    g2, pl2 = _alap_graph()
    with g2.as_default():
        fc.mul(g2.tensor("chain1:0"), g2.tensor("r:0"), name="early")
    pl2["early"] = C1
    early = partition(g2, pl2, recv_schedule="alap")  # one Recv of r, shared by `early` and `out`
    (r_early,) = [n for _, n in _nodes(early, "Recv")]
    assert r_early.control_inputs == ["chain1"]


def test_alap_changes_when_receives_start_not_what_is_computed():
    g, pl = _alap_graph()
    cluster = Cluster.local(2)
    results, positions = {}, {}
    for schedule in ("asap", "alap"):
        with DistributedSession(g, cluster, pl, store=fc.ContainerStore(), recv_schedule=schedule) as s:
            st = fc.RunStats()
            results[schedule] = s.run("out:0", stats=st)
            order = [name for name, _ in st.devices[C1].starts]
            recv = next(n for n in order if n.startswith("_recv/"))
            positions[schedule] = (order.index(recv), order.index("chain5"), order.index("out"))
    np.testing.assert_array_equal(results["asap"], results["alap"])
    recv_at, chain_at, out_at = positions["asap"]
    assert recv_at < chain_at  # ASAP: the Recv is started before the chain runs
    recv_at, chain_at, out_at = positions["alap"]
    assert chain_at < recv_at < out_at  # ALAP: only after the chain, just before its consumer
