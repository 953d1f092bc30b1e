"""The step simulator on graphs whose answers can be worked out by hand.

Op times come from a fixed table (a cost model written for the test) so every expected number
below is arithmetic on the test's own constants, not a re-run of the simulator's formulas.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.cluster import Cluster, Device, DeviceProfile, Link
from flowctl.engine.devices import canonical
from flowctl.engine.graph import Graph, Node
from flowctl.engine.placement import StaticCostModel, simulate, step_nodes
from flowctl.engine.placement.cost import CostTable
from fixed_costs import FixedCosts

D0, D1 = canonical("cpu:0"), canonical("cpu:1")
LAT, BW = 1e-3, 1e6  # a slow link: 1 ms + 1 µs per byte, so transfers are easy to see


def fixed(times: dict[str, float], default: float = 0.0) -> FixedCosts:
    """Op times from `times`; transfers over the slow link of `cluster()`, whatever the cluster."""
    return FixedCosts(cluster(), times, default)


def cluster(n: int = 2, memory: int = 1 << 30) -> Cluster:
    prof = DeviceProfile("test", "cpu", 1e9, 1e9, memory, 0.0)
    return Cluster([Device(canonical(f"cpu:{i}"), prof) for i in range(n)], default_link=Link(BW, LAT))


def on(graph: Graph, device: str, **overrides: str) -> dict[str, str]:
    return {n: overrides.get(n, device) for n in graph.nodes}


def chain(n: int = 4, size: int = 1000) -> Graph:
    g = fc.Graph()
    with g.as_default():
        h = fc.placeholder("float32", (size,), name="x")
        for i in range(n):
            h = fc.relu(h, name=f"r{i}")
    return g


def test_chain_on_one_device_takes_the_sum_of_its_op_times() -> None:
    g = chain(4)
    times = {"x": 0.5e-3, "r0": 1e-3, "r1": 2e-3, "r2": 3e-3, "r3": 4e-3}
    r = simulate(g, on(g, D0), cluster(), fixed(times))
    assert r.step_time == pytest.approx(10.5e-3)
    assert r.device(D0).busy == pytest.approx(10.5e-3)
    assert r.device(D1).busy == 0.0 and r.device(D1).ops == 0
    assert not r.links
    # Each op starts when its predecessor finishes.
    assert r.start["r2"] == pytest.approx(3.5e-3) and r.finish["r2"] == pytest.approx(6.5e-3)


def two_branches() -> Graph:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (10,), name="x")  # 40 bytes
        a = fc.relu(fc.relu(x, name="a0"), name="a1")
        b = fc.relu(fc.relu(x, name="b0"), name="b1")
        fc.group([a, b], name="done")
    return g


def test_independent_branches_on_two_devices_overlap() -> None:
    g = two_branches()
    times = {"a0": 5e-3, "a1": 5e-3, "b0": 5e-3, "b1": 5e-3}
    costs = fixed(times)
    one = simulate(g, on(g, D0), cluster(), costs)
    assert one.step_time == pytest.approx(20e-3)
    two = simulate(g, on(g, D0, b0=D1, b1=D1), cluster(), costs)
    xfer = LAT + 40 / BW  # x goes to cpu:1 once
    # cpu:1 finishes b1 at xfer + 10 ms; the Group `done` on cpu:0 only waits for b1, so what
    # crosses back is a 0-byte token: one more latency, no bytes.
    assert two.finish["b1"] == pytest.approx(xfer + 10e-3)
    assert two.step_time == pytest.approx(xfer + 10e-3 + LAT)
    assert [(lk.src, lk.dst, lk.bytes) for lk in two.links] == [(D0, D1, 40), (D1, D0, 0)]
    assert two.step_time < one.step_time
    assert two.device(D0).busy == pytest.approx(10e-3) and two.device(D1).busy == pytest.approx(10e-3)


def test_a_cross_device_edge_adds_latency_plus_bytes_over_bandwidth() -> None:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (250,), name="x")  # 1000 bytes
        fc.relu(fc.relu(x, name="a"), name="b")
    times = {"a": 2e-3, "b": 3e-3}
    r = simulate(g, on(g, D0, b=D1), cluster(), fixed(times))
    assert r.step_time == pytest.approx(2e-3 + (LAT + 1000 / BW) + 3e-3)
    assert r.start["b"] == pytest.approx(2e-3 + LAT + 1000 / BW)
    (link,) = r.links
    assert (link.src, link.dst, link.bytes, link.transfers) == (D0, D1, 1000, 1)
    assert r.device(D0).bytes_out == 1000 and r.device(D1).bytes_in == 1000


def test_a_tensor_read_by_three_consumers_on_another_device_crosses_once() -> None:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (100,), name="x")
        a = fc.relu(x, name="a")
        outs = [fc.square(a, name=f"c{i}") for i in range(3)]
        fc.group(outs, name="done")
    placement = on(g, D1, x=D0, a=D0)
    r = simulate(g, placement, cluster(), fixed({"a": 1e-3, "c0": 1e-3, "c1": 1e-3, "c2": 1e-3}))
    (link,) = r.links
    assert link.transfers == 1 and link.bytes == 400
    # The three consumers share the one arrival and then queue on cpu:1.
    arrival = 1e-3 + LAT + 400 / BW
    assert sorted(r.start[f"c{i}"] for i in range(3)) == pytest.approx([arrival, arrival + 1e-3, arrival + 2e-3])


def test_cross_device_control_edge_costs_the_link_latency() -> None:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (4,), name="x")
        a = fc.relu(x, name="a")
        with g.control_dependencies([a]):
            fc.no_op(name="after")
    r = simulate(g, on(g, D0, after=D1), cluster(), fixed({"a": 1e-3}))
    assert r.start["after"] == pytest.approx(1e-3 + LAT)
    assert r.links[0].bytes == 0


def test_memory_peak_of_a_chain_counts_resident_input_and_two_live_tensors() -> None:
    # x (resident, 4000 B) -> r0 -> r1 -> r2 -> r3, ReLUs of 4000 B each. r0 makes a buffer (x is
    # fed: never written); each later ReLU, its input's last reader, takes that buffer (buffer
    # forwarding), so one lives at a time. r3's output has no consumer.
    g = chain(4, size=1000)
    r = simulate(g, on(g, D0), cluster(), fixed({}, default=1e-3))
    assert r.device(D0).resident == 4000
    assert r.device(D0).peak_memory == 4000 + 4000
    # A fetched output stays and is never written over: r2 makes its own buffer beside r1.
    kept = simulate(g, on(g, D0), cluster(), fixed({}, default=1e-3), keep=["r1:0"])
    assert kept.device(D0).peak_memory == 4000 + 2 * 4000
    # Without forwarding, while r_i runs its input and its output are both live; the input is
    # freed when r_i finishes, and keeping r1 adds it on top while r2 and r3 run.
    from dataclasses import replace

    from flowctl.engine.placement.simulator import simulate_table

    t = replace(CostTable.build(g, cluster(), fixed({}, default=1e-3), step_nodes(g)), forward=[])
    assert simulate_table(t, [0] * len(t.names), cluster()).device(D0).peak_memory == 4000 + 2 * 4000
    kept = simulate_table(t, [0] * len(t.names), cluster(), keep=["r1:0"])
    assert kept.device(D0).peak_memory == 4000 + 3 * 4000


def test_a_received_tensor_is_counted_on_the_receiving_device() -> None:
    g = chain(2, size=1000)  # x -> r0 -> r1
    r = simulate(g, on(g, D0, r1=D1), cluster(), fixed({}, default=1e-3))
    assert r.device(D1).peak_memory == 4000 + 4000  # the received r0 and r1's own output
    assert r.device(D0).peak_memory == 4000 + 4000  # x resident, r0 until its transfer is done


def test_variables_are_resident_and_an_overflow_makes_the_placement_invalid() -> None:
    g = fc.Graph()
    with g.as_default():
        w = fc.variable(np.zeros((1000,), np.float32), name="w")  # 4000 B
        x = fc.placeholder("float32", (1000,), name="x")
        fc.add(w, x, name="y")
    small = cluster(memory=10_000)
    over = simulate(g, on(g, D0), small, fixed({}, default=1e-3), targets=["y"])
    assert over.device(D0).resident == 8000  # w and the fed x
    assert over.device(D0).peak_memory == 12000  # w + x + y
    assert not over.valid
    assert over.problems == [f"device {D0} needs 11.72 KiB at peak (7.81 KiB resident) but holds 9.77 KiB"]
    with pytest.raises(fc.PlacementError, match="placement is invalid: device .*cpu:0 needs 11.72 KiB"):
        over.check()
    roomy = simulate(g, on(g, D0), cluster(memory=12_000), fixed({}, default=1e-3), targets=["y"])
    assert roomy.valid


def test_targets_restrict_the_step_to_what_they_need() -> None:
    g = fc.Graph()
    with g.as_default():
        w = fc.variable(np.zeros((3,), np.float32), name="w")
        y = fc.square(w, name="y")
    r = simulate(g, on(g, D0), cluster(), fixed({}, default=1e-3), targets=[y.node])
    # The initializer (w/init and its Const) is not part of the step.
    assert set(r.start) == {"w", "y"}
    assert r.step_time == pytest.approx(2e-3)


def test_static_cost_model_is_a_roofline_over_the_profile() -> None:
    g = fc.Graph()
    with g.as_default():
        a = fc.placeholder("float32", (None, 64), name="a")
        b = fc.placeholder("float32", (64, 32), name="b")
        fc.matmul(a, b, name="mm")
    prof = DeviceProfile("p", "gpu", peak_flops=1e12, mem_bandwidth=1e11, memory=1 << 30, op_overhead=7e-6)
    cl = Cluster([Device(canonical("gpu:0"), prof), Device(canonical("gpu:1"), prof)],
                 default_link=Link(1e10, 5e-6))
    cm = StaticCostModel(cl, batch=128)
    flops = 2 * 128 * 64 * 32
    nbytes = 4 * (128 * 64 + 64 * 32 + 128 * 32)
    assert cm.op_time(g, g.nodes["mm"], "gpu:0") == pytest.approx(7e-6 + max(flops / 1e12, nbytes / 1e11))
    assert cm.tensor_bytes(g, "a:0") == 128 * 64 * 4
    assert cm.transfer_time(1_000_000, canonical("gpu:0"), canonical("gpu:1")) == pytest.approx(5e-6 + 1e-4)
    table = CostTable.build(g, cl, cm, ["a", "b", "mm"])
    assert table.inputs[2] == [(0, 0), (1, 0)] and table.resident == [True, True, False]


def test_concrete_shapes_follow_the_batch_through_reshapes() -> None:
    # [batch, 35, 8] folded to [batch * 35, 8]: the static shape is (None, 8); the cost model
    # must see 35 * batch rows, not batch rows.
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (None, 35, 8), name="x")
        flat = fc.reshape(x, (-1, 8), name="flat")
        fc.matmul(flat, fc.constant(np.ones((8, 4), np.float32)), name="mm")
    assert g.nodes["flat"].outputs[0].shape == (None, 8)
    cm = StaticCostModel(cluster(), batch=3)
    assert cm.tensor_bytes(g, "flat:0") == 3 * 35 * 8 * 4
    assert cm.tensor_bytes(g, "mm:0") == 3 * 35 * 4 * 4
    assert cm.estimate(g, g.nodes["mm"])[0] == 2 * (3 * 35) * 8 * 4


def test_result_to_dict_is_json() -> None:
    g = two_branches()
    r = simulate(g, on(g, D0, b0=D1, b1=D1), cluster(), fixed({}, default=1e-3))
    d = json.loads(json.dumps(r.to_dict(nodes=True)))
    assert d["valid"] and d["nodes"]["b1"]["device"] == D1 and len(d["devices"]) == 2


def test_devices_of_one_process_take_turns_at_the_interpreter():
    """Two independent chains on two devices of one process: kernels overlap, but each op's
    dispatch share (the measured model's host_time) is serialised on the process's lane."""
    from flowctl.engine.cluster import Cluster
    from flowctl.engine.placement import MeasuredCostModel, simulate

    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (4,), name="x")
        a = fc.tanh(fc.exp(x, name="a1"), name="a2")
        b = fc.tanh(fc.exp(x, name="b1"), name="b2")
    cluster = Cluster.local(2, threads=2)
    cost = MeasuredCostModel(cluster, batch=1)
    for n in ("a1", "a2", "b1", "b2"):
        cost.records[cost.key_for(g, g.nodes[n], cluster.names[0])] = 0.010  # 10 ms kernels, both profiles
    place = {"x": cluster.names[0], "a1": cluster.names[0], "a2": cluster.names[0],
             "b1": cluster.names[1], "b2": cluster.names[1]}
    free = simulate(g, place, cluster, cost, targets=[a.node, b.node])
    assert free.step_time == pytest.approx(0.020, abs=1e-4)  # no dispatch share: the chains overlap fully
    cost.dispatch = 0.004  # 4 ms of each 14 ms op holds the interpreter
    shared = simulate(g, place, cluster, cost, targets=[a.node, b.node])
    # a1 and b1 cannot both dispatch at t=0: b1 waits 4 ms, and so on down the chains.
    assert shared.step_time == pytest.approx(0.032, abs=1e-4)
    one = simulate(g, {n: cluster.names[0] for n in place}, cluster, cost, targets=[a.node, b.node])
    assert one.step_time == pytest.approx(0.056, abs=1e-4)  # one device: 4 ops of 14 ms


# ----------------------------------------------------------------------------- asynchronous devices
G0 = canonical("gpu:0")


class StreamCosts(FixedCosts):
    """A GPU as the measured model describes one: each op's launch holds the device's thread for
    `issue` seconds, its kernel holds the stream for `kernel` seconds; a CPU is synchronous."""

    def __init__(self, issue: float, kernel: float, cpu: float = 0.0) -> None:
        super().__init__(cluster(), {}, 0.0)
        self.issue, self.kernel, self.cpu = issue, kernel, cpu

    def op_time(self, graph: Graph, node: Node, device: str) -> float:
        if node.op == "Placeholder":
            return 0.0
        return self.issue if "gpu" in device else self.cpu

    def stream_time(self, graph: Graph, node: Node, device: str) -> float | None:
        return None if "gpu" in device and node.op == "Placeholder" else (
            self.kernel if "gpu" in device else None)


def gpu_and_cpu() -> Cluster:
    gpu = DeviceProfile("gpu_test", "gpu", 1e12, 1e11, 1 << 30, 0.0)
    cpu = DeviceProfile("test", "cpu", 1e9, 1e9, 1 << 30, 0.0)
    return Cluster([Device(G0, gpu), Device(D0, cpu)], default_link=Link(BW, LAT))


@pytest.mark.parametrize("issue, kernel, expect", [
    (1e-3, 5e-3, 1e-3 + 3 * 5e-3),   # kernel-bound: the host runs ahead, the stream is the step
    (5e-3, 1e-3, 3 * 5e-3 + 1e-3),   # launch-bound: the stream waits on the host, then one kernel
    (2e-3, 2e-3, 2e-3 + 3 * 2e-3),   # even: launches overlap kernels; synchronously it is 12 ms
])
def test_a_gpu_overlaps_its_launches_with_its_kernels(issue, kernel, expect):
    g = chain(3)
    r = simulate(g, on(g, G0), gpu_and_cpu(), StreamCosts(issue, kernel))
    assert r.step_time == pytest.approx(expect)
    assert r.step_time < 3 * (issue + kernel)
    assert r.device(G0).busy == pytest.approx(3 * kernel)  # the stream's time, not the launches'
    # r1 launches as soon as r0 is launched (the stream orders them), and is done when its kernel is.
    assert r.start["r1"] == pytest.approx(issue)
    assert r.finish["r2"] == pytest.approx(expect)


def test_a_transfer_off_a_gpu_waits_for_the_kernel_not_the_launch():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (250,), name="x")  # 1000 bytes
        fc.relu(fc.relu(x, name="a"), name="b")
    r = simulate(g, on(g, G0, x=D0, b=D0), gpu_and_cpu(), StreamCosts(1e-3, 10e-3, cpu=2e-3))
    xfer = LAT + 1000 / BW
    assert r.finish["a"] == pytest.approx(xfer + 1e-3 + 10e-3)  # x arrives, a launches, a's kernel runs
    assert r.start["b"] == pytest.approx(r.finish["a"] + xfer)
    assert r.step_time == pytest.approx(r.start["b"] + 2e-3)


def test_placers_see_an_async_op_cost_as_the_larger_of_launch_and_kernel():
    from flowctl.engine.placement import step_nodes

    g = chain(2)
    table = CostTable.build(g, gpu_and_cpu(), StreamCosts(1e-3, 4e-3, cpu=3e-3), step_nodes(g))
    i = table.index["r0"]
    assert table.is_async == [True, False]
    assert table.issue[i] == [1e-3, 3e-3] and table.stream[i] == [4e-3, 0.0]
    assert table.times[i] == [4e-3, 3e-3]
    sync = CostTable.build(g, cluster(), fixed({}, 1e-3), step_nodes(g))
    assert sync.is_async == [] and sync.issue == [] and sync.stream == []


def test_calibrating_dispatch_on_a_gpu_solves_the_overlapped_step():
    """Profiled launches of 10 µs and kernels of 30 µs over 3 nodes take 90 µs at no dispatch; a
    measured 150 µs step means each node's launch plus dispatch is 50 µs: dispatch 40 µs."""
    from flowctl.engine.placement import MeasuredCostModel

    g = chain(3)
    cl = gpu_and_cpu()
    cost = MeasuredCostModel(cl, batch=1)
    for n in ("r0", "r1", "r2"):
        key = cost.key_for(g, g.nodes[n], G0)
        cost.records[key], cost.records[key + "|stream"] = 10e-6, 30e-6
    nodes = ["r0", "r1", "r2"]
    # Faster than the kernels profiled (90 µs): no dispatch to find; the profile scales to 60 µs.
    assert cost.calibrate(60e-6, g, nodes, G0) == 0.0
    assert cost.scale_by[cl.device(G0).profile.name] == pytest.approx(2 / 3)
    assert cost.op_time(g, g.nodes["r0"], G0) == pytest.approx(10e-6 * 2 / 3)
    assert cost.stream_time(g, g.nodes["r0"], G0) == pytest.approx(20e-6)
    # The simulated step: the first launch, then the three kernels back to back on the stream.
    sim = simulate(g, {n: G0 for n in g.nodes}, cl, cost, targets=nodes)
    assert sim.step_time == pytest.approx(10e-6 * 2 / 3 + 60e-6)
    assert cost.calibrate(150e-6, g, nodes, G0) == pytest.approx(40e-6, rel=1e-6)
    assert cost.scale_by[cl.device(G0).profile.name] == 1.0  # a later calibration starts afresh
    assert cost.op_time(g, g.nodes["r0"], G0) == pytest.approx(50e-6)
    assert cost.stream_time(g, g.nodes["r0"], G0) == pytest.approx(30e-6)
    assert cost.stream_time(g, g.nodes["x"], G0) is None
    # A synchronous device: the step is the plain sum of kernel + dispatch, as before.
    c2 = MeasuredCostModel(cluster(), batch=1)
    for n in nodes:
        c2.records[c2.key_for(g, g.nodes[n], D0)] = 10e-6
    assert c2.calibrate(60e-6, g, nodes, D0) == pytest.approx(10e-6, rel=1e-6)
    assert c2.calibrate(15e-6, g, nodes, D0) == 0.0
    assert c2.op_time(g, g.nodes["r1"], D0) == pytest.approx(5e-6)


def test_gpu_launches_and_cpu_dispatch_take_turns_at_the_interpreter():
    """Launching is Python end to end, so a GPU's launches hold the process's lane as a CPU op's
    dispatch does: two 3-op chains of 1 ms each side, on a GPU and a CPU of one process, cannot
    overlap at all, however short the GPU's kernels."""
    class Shared(StreamCosts):
        def host_time(self, node: Node) -> float:
            return 0.0 if node.op == "Placeholder" else 1e-3

    g = two_branches()
    place = on(g, D0, a0=G0, a1=G0)
    r = simulate(g, place, gpu_and_cpu(), Shared(1e-3, 0.1e-3, cpu=1e-3), targets=["a1", "b1"])
    # x crosses to the GPU (1.04 ms) while the CPU dispatches b0, b1 (0-2 ms); the GPU's launches
    # wait for the lane (2-4 ms), then the last kernel (0.1 ms).
    assert r.step_time == pytest.approx(4.1e-3)
    alone = simulate(g, place, gpu_and_cpu(), StreamCosts(1e-3, 0.1e-3, cpu=1e-3), targets=["a1", "b1"])
    assert alone.step_time == pytest.approx(LAT + 40 / BW + 2e-3 + 0.1e-3)  # no lane: launches at once


@pytest.mark.parametrize("props, expect", [
    (None, None),  # no such GPU
    ({"name": "NVIDIA H100 80GB HBM3", "memory": 85 << 30, "multiprocessors": 132, "capability": (9, 0),
      "clock_khz": 1_980_000, "memory_clock_khz": 2_619_000, "bus_bits": 5120},
     ("nvidia_h100_80gb_hbm3", 132 * 128 * 2 * 1.98e9, 2 * 2.619e9 * 640, 85 << 30)),
    ({"name": "Tesla V100-SXM2-16GB", "memory": 16 << 30, "multiprocessors": 80, "capability": (7, 0),
      "clock_khz": 0, "memory_clock_khz": 0, "bus_bits": 0},  # no clocks: the published figures
     ("tesla_v100_sxm2_16gb", 15.7e12, 900e9, 16 << 30)),
    ({"name": "Mystery GPU", "memory": 1 << 30, "multiprocessors": 8, "capability": (9, 9),
      "clock_khz": 0, "memory_clock_khz": 0, "bus_bits": 0}, None),  # nothing to go on
])
def test_a_detected_gpu_profile_comes_from_the_driver(monkeypatch, props, expect):
    from flowctl.engine.cluster import detected_gpu_profile
    from flowctl.kernels import registry as backend

    monkeypatch.setattr(backend, "gpu_properties", lambda index: props)
    p = detected_gpu_profile(0)
    if expect is None:
        assert p is None
        return
    assert (p.name, p.type, p.memory) == (expect[0], "gpu", expect[3])
    assert p.peak_flops == pytest.approx(expect[1]) and p.mem_bandwidth == pytest.approx(expect[2])
    assert p.bus == ("pcie5" if "h100" in p.name else "pcie3")  # a known model's host interface


def test_gpus_talk_over_their_own_pcie_generation_unless_a_link_is_named():
    from flowctl.engine.cluster import LINKS

    def bw(text: str) -> float:
        return Cluster.from_spec(text).link("gpu:0", "gpu:1").bandwidth

    assert bw("2xgpu:k40") == bw("2xgpu:v100") == LINKS["pcie3"].bandwidth
    assert bw("2xgpu:h100") == LINKS["pcie5"].bandwidth > bw("2xgpu:a100") == LINKS["pcie4"].bandwidth
    assert bw("2xgpu:h100:2GiB") == LINKS["pcie5"].bandwidth  # a memory cap keeps the bus
    assert bw("gpu:k40+gpu:h100") == LINKS["pcie3"].bandwidth  # the slower end sets the pace
    assert bw("2xgpu:h100@nvlink") == LINKS["nvlink"].bandwidth < bw("2xgpu:h100@nvlink4")
    with pytest.raises(fc.PlacementError, match="did you mean 'nvlink4'"):
        Cluster.from_spec("2xgpu:h100@nvlnk4")


def test_devices_of_one_process_slow_each_other_while_both_run():
    """Contention 1.2 (processor sharing): a 10 ms op on cpu:0 and a 5 ms op on cpu:1 start
    together. While both run each does 1/1.2 of its work per second, so the short one ends at
    6 ms, having slowed the long one to 5 ms of work done; the long one finishes its last 5 ms
    alone at full speed: 11 ms. A chain alone on one device is not slowed."""
    g = fc.Graph()
    with g.as_default():
        fc.constant(np.ones(4, np.float32), name="long")
        fc.constant(np.ones(4, np.float32), name="short")
    cost = fixed({"long": 10e-3, "short": 5e-3})
    placement = on(g, D0, short=D1)
    assert simulate(g, placement, cluster(), cost).step_time == pytest.approx(10e-3)
    cost.contention = 1.2
    r = simulate(g, placement, cluster(), cost)
    assert r.finish["short"] == pytest.approx(6e-3)
    assert r.finish["long"] == r.step_time == pytest.approx(11e-3)
    assert r.device(D1).busy == pytest.approx(6e-3) and r.device(D0).busy == pytest.approx(11e-3)
    alone = simulate(g, on(g, D0), cluster(), cost)  # one device: nothing to share with
    assert alone.step_time == pytest.approx(15e-3)
    # Two chains of 3 x 2 ms, one per device, overlap the whole way: 6 ms x 1.2.
    g2 = fc.Graph()
    with g2.as_default():
        for side in ("a", "b"):
            h = fc.constant(np.ones(4, np.float32), name=f"{side}0")
            for k in range(1, 3):
                h = fc.tanh(h, name=f"{side}{k}")
    cost2 = fixed({}, 2e-3)
    cost2.contention = 1.2
    both = simulate(g2, {n: D0 if n.startswith("a") else D1 for n in g2.nodes}, cluster(), cost2)
    assert both.step_time == pytest.approx(7.2e-3)


def test_contention_is_solved_from_the_step_run_twice_at_once():
    """A 3 x 2 ms chain run on cpu:0 and cpu:1 at once, each on its own state, overlaps the whole
    way, so a measured 1.25x its time alone means each device ran at 1/1.25. A measurement the
    simulator already explains (<= 1x) is no contention."""
    from flowctl.engine.placement.cost import CostTable
    from flowctl.engine.placement.calibration import contention_for

    g = chain(3)
    cl = cluster()
    table = CostTable.build(g, cl, fixed({}, 2e-3), step_nodes(g))
    assert contention_for(table, 0, 1, 1.25, cl) == pytest.approx(1.25, rel=1e-6)
    assert contention_for(table, 0, 1, 0.95, cl) == 1.0
    assert table.contention == 1.0  # the table asked about is left as it was


# ---------------------------------------------------------------------------- jitter
def test_a_chain_on_one_device_takes_its_exact_time_in_expectation():
    """Every op's time is multiplied by a factor of mean 1, so a chain (a sum) keeps its mean:
    400 samples of 5 ops at jitter 0.2 put the mean within 3% (about 6 standard errors)."""
    from flowctl.engine.placement.simulator import expected_step_time

    g = chain(4)
    cost = fixed({"x": 0.5e-3, "r0": 1e-3, "r1": 2e-3, "r2": 3e-3, "r3": 4e-3})
    cost.jitter = 0.2
    cl = cluster()
    table = CostTable.build(g, cl, cost, step_nodes(g))
    assert table.jitter == 0.2
    e = expected_step_time(table, [0] * len(table.names), cl, samples=400)
    assert e.mean == pytest.approx(10.5e-3, rel=0.03)
    assert e.low < 10.5e-3 < e.high and e.samples == 400 and e.jitter == 0.2
    # The same seed draws the same runs; no jitter is the exact schedule.
    assert expected_step_time(table, [0] * len(table.names), cl, samples=400) == e
    exact = expected_step_time(table, [0] * len(table.names), cl, jitter=0.0)
    assert exact.mean == exact.low == exact.high == pytest.approx(10.5e-3) and exact.samples == 0


def knife_edge() -> tuple[Graph, dict[str, str]]:
    """Two 10 ms ops on cpu:0 and cpu:2 send cpu:1 its inputs at the same instant: `c` (10 ms,
    on the path a -> c -> d back on cpu:0) and `b` (30 ms, off it). The exact schedule breaks the
    tie by topological order, c first; a real step breaks it by whichever op ran faster."""
    g = fc.Graph()
    with g.as_default():
        a = fc.relu(fc.constant(np.ones(1, np.float32), name="ka"), name="a")
        c = fc.relu(a, name="c")
        d = fc.relu(c, name="d")
        q = fc.relu(fc.constant(np.ones(1, np.float32), name="kq"), name="q")
        b = fc.relu(q, name="b")
        fc.group([d, b], name="done")
    d2 = canonical("cpu:2")
    return g, on(g, D0, kq=d2, q=d2, c=D1, b=D1)


def test_a_schedule_that_rests_on_a_tie_between_devices_loses_it_in_expectation():
    from flowctl.engine.placement import expect

    g, placement = knife_edge()
    cost = fixed({"a": 10e-3, "q": 10e-3, "c": 10e-3, "d": 10e-3, "b": 30e-3})
    cl = cluster(3)
    tr = LAT + 4 / BW  # a 4-byte tensor across
    # c first: c ends at 20 ms + tr, b runs from there to 50 ms + tr; the Group waits for b's token.
    fast = 50e-3 + tr + LAT
    # b first: b ends at 40 ms + tr, then c, then d back on cpu:0 after one more crossing.
    slow = 60e-3 + 2 * tr
    exact = simulate(g, placement, cl, cost)
    assert exact.start["c"] == pytest.approx(10e-3 + tr) and exact.step_time == pytest.approx(fast)
    cost.jitter = 0.01  # a 1% wobble decides the tie either way, about half the time each
    e = expect(g, placement, cl, cost, samples=64)
    assert fast + 2e-3 < e.mean < slow - 2e-3
    assert e.low == pytest.approx(fast, rel=0.02) and e.high == pytest.approx(slow, rel=0.02)
    # A schedule without the tie keeps its time: b's input one link later than c's is no tie.
    cost.times["q"] = 12e-3
    assert expect(g, placement, cl, cost, samples=64).mean == pytest.approx(fast, rel=0.01)


def test_the_profiles_jitter_is_the_spread_of_nodes_that_share_a_key():
    from math import e as E

    from flowctl.engine.placement.cost import STREAM, log_spread

    # log times 0,0,0,1,1,1: standard deviation 0.5; 1,1,1,1,1,1: 0. Median of the two: 0.25.
    assert log_spread({"cell": [1, 1, 1, E, E, E], "gate": [2.0] * 6}) == pytest.approx(0.25)
    # Keys of fewer than five nodes and GPU stream times do not count; none left: None.
    assert log_spread({"cell": [1, E, 1, E], "k" + STREAM: [1, E, 1, E, 1]}) is None
    assert log_spread({"cell": [1, 1, 1, E, E, E], "one": [1.0, E]}) == pytest.approx(0.5)
