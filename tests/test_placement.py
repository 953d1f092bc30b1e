"""Placement: feasible sets and colocation (§4.3) with their exact error texts, coarsening, the
placers (single, expert, greedy §3.2.1, heft, mincut, auto), memory validity, the measured cost
model and the explanation data."""
from __future__ import annotations

import json

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.cluster import Cluster, Device, DeviceProfile, Link
from flowctl.engine.devices import canonical
from flowctl.engine.graph import Graph, Node
from flowctl.engine.opdef import OPS, register_op
from flowctl.engine.optimizers import SGD
from flowctl.engine.placement import (
    MeasuredCostModel,
    StaticCostModel,
    evaluate,
    feasible_sets,
    place,
    prepare,
)
from flowctl.engine.placement.profiler import profile
from fixed_costs import FixedCosts
from flowctl.kernels.registry import kernel

CPU0, CPU1, GPU0, GPU1 = (canonical(d) for d in ("cpu:0", "cpu:1", "gpu:0", "gpu:1"))
ALL4 = f"{CPU0}, {CPU1}, {GPU0}, {GPU1}"

try:  # the mincut placer's partitioner; optional, so its tests skip cleanly without it
    import pymetis  # noqa: F401

    HAVE_METIS = True
except ImportError:
    HAVE_METIS = False
needs_metis = pytest.mark.skipif(not HAVE_METIS, reason="the mincut placer needs pymetis")
WITH_MINCUT = ("mincut",) if HAVE_METIS else ()

# A test op with a CPU kernel only, to see kernels narrow a feasible set.
if "PlacementTestCpuOnly" not in OPS:
    register_op("PlacementTestCpuOnly", lambda ins, a: [ins[0]], num_inputs=1)
    kernel("PlacementTestCpuOnly", device_types=("cpu",))(lambda xp, attrs: (lambda x: x))


def mixed() -> Cluster:
    return Cluster.from_spec("2xcpu+2xgpu:k40")


def cpus(n: int = 2, memory: int = 1 << 30, link: Link | None = None) -> Cluster:
    prof = DeviceProfile("test", "cpu", 1e9, 1e9, memory, 0.0)
    return Cluster([Device(canonical(f"cpu:{i}"), prof) for i in range(n)], default_link=link or Link(1e12, 1e-6))


# ---------------------------------------------------------------------------- feasibility
def test_partial_constraints_select_devices_by_type_index_and_job() -> None:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (4,), name="x")
        with g.device("gpu"):
            fc.relu(x, name="any_gpu")
        with g.device("gpu:1"):
            fc.relu(x, name="gpu1")
        with g.device("/job:localhost"):
            fc.relu(x, name="local_job")
        with g.device("cpu"):
            fc.relu(x, name="any_cpu")
        g.add_node("PlacementTestCpuOnly", [x], name="cpu_kernel_only")
    f = feasible_sets(g, mixed())
    assert f.node_feasible("x") == [CPU0, CPU1, GPU0, GPU1]
    assert f.node_feasible("any_gpu") == [GPU0, GPU1]
    assert f.node_feasible("gpu1") == [GPU1]
    assert f.node_feasible("local_job") == [CPU0, CPU1, GPU0, GPU1]
    assert f.node_feasible("any_cpu") == [CPU0, CPU1]
    assert f.node_feasible("cpu_kernel_only") == [CPU0, CPU1]
    assert f.narrowed_by("gpu1") == ["constraint device='gpu:1'"]
    assert f.narrowed_by("cpu_kernel_only") == ["kernels: PlacementTestCpuOnly runs on cpu"]


def test_task_constraints_on_a_multi_task_cluster() -> None:
    prof = DeviceProfile("test", "cpu", 1e9, 1e9, 1 << 30)
    names = ["/job:worker/task:0/device:cpu:0", "/job:worker/task:1/device:cpu:0", "/job:ps/task:0/device:cpu:0"]
    cl = Cluster([Device(n, prof) for n in names])
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (4,), name="x")
        with g.device("/job:worker/task:1"):
            fc.relu(x, name="t1")
        with g.device("/job:worker"):
            fc.relu(x, name="workers")
        with g.device("ps/cpu"):
            fc.relu(x, name="ps")
    f = feasible_sets(g, cl)
    assert f.node_feasible("t1") == [names[1]]
    assert f.node_feasible("workers") == names[:2]
    assert f.node_feasible("ps") == [names[2]]


def test_colocation_intersects_and_variable_updates_join_their_variable() -> None:
    g = fc.Graph()
    with g.as_default():
        with g.device("cpu"):
            w = fc.variable(np.zeros(3, np.float32), name="w")
        with g.device("cpu:1"):
            fc.assign_add(w, np.ones(3, np.float32), name="bump")  # ref input: must run with w
        with g.colocate_with(w):
            fc.relu(w, name="near_w")
    f = feasible_sets(g, mixed())
    for n in ("w", "w/init", "bump", "near_w"):
        assert f.node_feasible(n) == [CPU1], n
    assert f.narrowed_by("near_w") == ["colocation group with 'w', 'w/init', 'bump' (narrowed by 'w', 'w/init', 'bump')"]


def test_conflicting_constraints_in_a_colocation_group_name_node_members_and_devices() -> None:
    g = fc.Graph()
    with g.as_default():
        with g.device("cpu:0"):
            w = fc.variable(np.zeros(3, np.float32), name="w")
        with g.device("gpu"):
            fc.assign_add(w, np.ones(3, np.float32), name="bump")
    with pytest.raises(fc.PlacementError) as e:
        feasible_sets(g, mixed())
    assert str(e.value) == (
        f"cannot place node 'bump' (AssignAdd): no device satisfies its colocation group "
        f"['w', 'w/init', 'bump']: 'bump' (AssignAdd, device='gpu') can run on {GPU0}, {GPU1}, but "
        f"'w' (Variable, device='cpu:0') can run on {CPU0} and 'w/init' (Assign, device='cpu:0') can run on "
        f"{CPU0}; colocated because 'w/init' (Assign) updates 'w' by reference; 'bump' (AssignAdd) updates "
        f"'w' by reference; devices available: {ALL4}")


def test_colocate_with_against_a_kernel_restriction() -> None:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (4,), name="x")
        with g.device("gpu:0"):
            y = fc.relu(x, name="y")
        with g.colocate_with(y):
            g.add_node("PlacementTestCpuOnly", [y], name="z")
    with pytest.raises(fc.PlacementError) as e:
        feasible_sets(g, mixed())
    assert str(e.value) == (
        f"cannot place node 'z' (PlacementTestCpuOnly): no device satisfies its colocation group ['y', 'z']: "
        f"'z' (PlacementTestCpuOnly, no device constraint) can run on {CPU0}, {CPU1}, but 'y' (Relu, "
        f"device='gpu:0') can run on {GPU0}; colocated because 'z' colocate_with 'y'; devices available: {ALL4}")


def test_a_constraint_no_device_matches_and_a_missing_kernel() -> None:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (4,), name="x")
        with g.device("gpu:3"):
            fc.relu(x, name="y")
    with pytest.raises(fc.PlacementError) as e:
        feasible_sets(g, mixed())
    assert str(e.value) == (f"cannot place node 'y' (Relu): its device constraint 'gpu:3' matches no device; "
                            f"devices available: {ALL4}")
    g2 = fc.Graph()
    with g2.as_default():
        x = fc.placeholder("float32", (4,), name="x")
        with g2.device("gpu"):
            g2.add_node("PlacementTestCpuOnly", [x], name="z")
    with pytest.raises(fc.PlacementError) as e:
        feasible_sets(g2, mixed())
    assert str(e.value) == (f"cannot place node 'z' (PlacementTestCpuOnly): its device constraint 'gpu' allows "
                            f"{GPU0}, {GPU1}, but PlacementTestCpuOnly has kernels only for cpu; devices available: "
                            f"{ALL4}")


def test_colocating_with_a_missing_node_is_an_error() -> None:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (4,), name="x")
        with g.colocate_with("nowhere"):
            fc.relu(x, name="y")
    with pytest.raises(fc.PlacementError, match="node 'y' \\(Relu\\) asks to be colocated with 'nowhere', "
                                                "which is not in the graph"):
        feasible_sets(g, mixed())


# ---------------------------------------------------------------------------- graphs for the placers
def towers(width: int = 1024, depth: int = 3, train: bool = True) -> tuple[Graph, str]:
    """Two independent matmul towers joined by an Add: compute-heavy and parallel."""
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (None, width), name="x")
        outs = []
        for t in ("a", "b"):
            h = x
            with g.name_scope(t):
                for i in range(depth):
                    w = fc.variable(np.zeros((width, width), np.float32), name=f"w{i}")
                    h = fc.relu(fc.matmul(h, w, name=f"mm{i}"), name=f"relu{i}")
            outs.append(h)
        loss = fc.reduce_mean(fc.add(outs[0], outs[1], name="join"), name="loss")
        target = SGD(0.1).minimize(loss, name="train") if train else loss
    return g, target.node


def test_coarsening_keeps_parallel_towers_apart_and_gradients_with_their_layer() -> None:
    g, train = towers()
    cl = Cluster.from_spec("2xgpu:k40")
    pb = prepare(g, cl, StaticCostModel(cl, batch=256), targets=[train])
    co = pb.coarse
    a, b = co.group("a/mm0"), co.group("b/mm0")
    assert a.id != b.id
    assert co.group("a/mm2").id == a.id and co.group("a/w1").id == a.id  # the chain and its weights
    grads = [n for n in g.nodes.values() if n.follows == "a/mm1"]
    assert grads and all(co.group(n.name).id == a.id for n in grads)
    assert co.group("join").id not in (a.id, b.id)
    assert len({co.group(n).id for n in pb.step}) < len(pb.step) / 4


def test_greedy_spreads_heavy_parallel_towers_and_keeps_a_tiny_chain_on_one_device() -> None:
    g, train = towers()
    cl = Cluster.from_spec("2xgpu:k40")
    cm = StaticCostModel(cl, batch=256)
    single = place(g, cl, cm, "single", targets=[train])
    greedy = place(g, cl, cm, "greedy", targets=[train])
    assert greedy["a/mm0"] != greedy["b/mm0"]
    assert greedy.step_time < 0.75 * single.step_time
    assert all(d.busy > 0 for d in greedy.devices)

    c = fc.Graph()
    with c.as_default():
        h = fc.placeholder("float32", (4,), name="x")
        for i in range(10):
            h = fc.relu(h, name=f"r{i}")
    tiny = place(c, cl, StaticCostModel(cl, batch=1), "greedy")
    assert len(set(tiny.assignment.values())) == 1


def test_a_cheap_cpu_only_consumer_does_not_pull_a_heavy_op_off_the_gpu() -> None:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (256, 1024), name="x")
        y = fc.matmul(x, fc.constant(np.ones((1024, 1024), np.float32), name="w"), name="mm")
        g.add_node("PlacementTestCpuOnly", [y], name="z")
    cl = Cluster.from_spec("cpu+gpu:k40")
    cpu0, gpu0 = cl.names
    pb = prepare(g, cl, StaticCostModel(cl, batch=1))
    assert pb.coarse.group("mm").feasible == [cpu0, gpu0]
    pl = place(g, cl, StaticCostModel(cl, batch=1), "greedy")
    assert pl["mm"] == gpu0 and pl["z"] == cpu0


def test_every_placer_respects_constraints_and_colocation() -> None:
    g, train = towers(width=64)
    g.nodes["b/mm1"].device = "gpu:1"
    g.nodes["a/w0"].device = "gpu:0"
    cl = Cluster.from_spec("2xgpu:k40")
    cm = StaticCostModel(cl, batch=32)
    for alg in ("single", "greedy", "heft", *WITH_MINCUT, "auto"):
        pl = place(g, cl, cm, alg, targets=[train])
        assert pl["b/mm1"] == GPU1 and pl["a/w0"] == GPU0, alg
        # a Variable, its initializer and its update run together
        assert pl["a/w0/init"] == pl["a/w0"], alg
        updates = [n for n in g.nodes.values() if n.opdef.ref_inputs and n.inputs[0] == "a/w0:0" and n.op != "Assign"]
        assert updates and all(pl[u.name] == GPU0 for u in updates), alg
        assert set(pl.assignment) == set(g.nodes), alg


def test_placement_is_deterministic() -> None:
    cl = Cluster.from_spec("4xgpu:k40")
    cm = StaticCostModel(cl, batch=64)
    results = {}
    for _ in range(2):
        g, train = towers(width=256)
        for alg in ("greedy", "heft", *WITH_MINCUT, "auto"):
            results.setdefault(alg, []).append(place(g, cl, cm, alg, targets=[train]).assignment)
    for alg, (a, b) in results.items():
        assert a == b, alg


def test_heft_beats_greedy_when_short_work_would_delay_the_critical_path() -> None:
    # s feeds six 4 ms tasks (made first, so they come first in topological order) and a chain of
    # four 10 ms ops. Greedy takes ready nodes in ready-time order: the short tasks fill both
    # devices before the chain starts (12 ms + 40 ms). HEFT takes the chain first (highest
    # upward rank), so the chain runs on one device while the short tasks share the other.
    g = fc.Graph()
    with g.as_default():
        s = fc.placeholder("float32", (4,), name="s")
        shorts = [fc.relu(s, name=f"short{i}") for i in range(6)]
        h = s
        for i in range(4):
            h = fc.square(h, name=f"chain{i}")
        fc.group(shorts + [h], name="done")
    cl = cpus(2)
    times = {f"short{i}": 4e-3 for i in range(6)} | {f"chain{i}": 10e-3 for i in range(4)}
    cm = FixedCosts(cl, times)
    greedy = place(g, cl, cm, "greedy")
    heft = place(g, cl, cm, "heft")
    assert greedy.step_time == pytest.approx(52e-3, rel=1e-3)
    assert heft.step_time == pytest.approx(40e-3, rel=1e-3)
    assert len({heft[f"chain{i}"] for i in range(4)}) == 1
    auto = place(g, cl, cm, "auto")
    assert auto.algorithm == "auto:heft" and auto.step_time == heft.step_time


# ---------------------------------------------------------------------------- memory
def two_big_variables() -> tuple[Graph, list[str]]:
    g = fc.Graph()
    with g.as_default():
        outs = []
        for k in range(2):
            w = fc.variable(np.zeros(1500, np.float32), name=f"w{k}")  # 6000 bytes each
            outs.append(fc.reduce_sum(w, name=f"sum{k}"))  # 4 bytes
        done = fc.group(outs, name="done")
    return g, [done.node]


def test_a_placement_that_overflows_memory_is_rejected() -> None:
    g, targets = two_big_variables()
    cl = cpus(2, memory=10_000)
    cm = FixedCosts(cl, {})
    everything_on_one = evaluate(g, {n: CPU0 for n in g.nodes}, cl, cm, targets=targets)
    assert not everything_on_one.valid
    # w0 and w1 resident (12000 B) plus one 4-byte sum at a time (the Group only waits for them).
    assert everything_on_one.devices[0].peak_memory == 12004
    assert everything_on_one.simulation.problems == [
        f"device {CPU0} needs 11.72 KiB at peak (11.72 KiB resident) but holds 9.77 KiB"]
    with pytest.raises(fc.PlacementError, match="given placement is invalid: device .*cpu:0 needs 11.72 KiB"):
        everything_on_one.check()
    spread = place(g, cl, cm, "single", targets=targets)  # no device holds both: spread, not fail
    assert spread.valid and spread["w0"] != spread["w1"]
    assert any("no single device holds the step" in n for n in spread.notes)
    with pytest.raises(fc.PlacementError, match="no single device can hold this graph: device .*cpu:0 needs"):
        place(g, cpus(2, memory=5_000), FixedCosts(cpus(2, memory=5_000), {}), "single", targets=targets)
    for alg in ("greedy", "heft", "auto"):
        pl = place(g, cl, cm, alg, targets=targets)
        assert pl.valid and pl["w0"] != pl["w1"], alg
        assert max(d.peak_memory for d in pl.devices) <= 10_000


# ---------------------------------------------------------------------------- expert
def two_layers() -> tuple[Graph, str]:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (8, 16), name="x")
        h = x
        for layer in ("l1", "l2"):
            with g.name_scope(layer):
                w = fc.variable(np.zeros((16, 16), np.float32), name="w")
                h = fc.tanh(fc.matmul(h, w, name="mm"), name="act")
        train = SGD(0.1).minimize(fc.reduce_sum(h, name="loss"), name="train")
    return g, train.node


def test_expert_rules_place_layers_and_gradients_follow_them() -> None:
    g, train = two_layers()
    cl = cpus(2)
    pl = place(g, cl, StaticCostModel(cl, batch=8), "expert", targets=[train],
               rules=[("l1", "cpu:0"), ("l2/*", "cpu:1")])
    for n in g.nodes:
        if n.startswith(("l1/", "gradients/l1/")):
            assert pl[n] == CPU0, n
        if n.startswith(("l2/", "gradients/l2/")):
            assert pl[n] == CPU1, n
    assert pl["x"] == CPU0  # unmatched: follows its consumer
    layers = {n: ("second" if n.startswith("l2/") else "first") for n in g.nodes if n[:3] in ("l1/", "l2/")}
    by_layer = place(g, cl, StaticCostModel(cl, batch=8), "expert", targets=[train],
                     rules=[("first", "cpu:1"), ("sec*", "cpu:0")], layers=layers)
    assert by_layer["l1/mm"] == CPU1 and by_layer["l2/mm"] == CPU0 and by_layer["gradients/l2/mm/matmul_grad"] == CPU0
    # With one rule, the unmatched first layer follows its consumers to the rule's device.
    one = place(g, cl, StaticCostModel(cl, batch=8), "expert", targets=[train], rules=[("l2", "cpu:1")])
    assert set(one.assignment.values()) == {CPU1}
    assert next(d for d in one.decisions if d.first == "l1/w").reason.startswith("follows ")


def test_expert_rule_errors() -> None:
    g, train = two_layers()
    cl = cpus(2)
    cm = StaticCostModel(cl, batch=8)
    with pytest.raises(fc.PlacementError) as e:
        place(g, cl, cm, "expert", targets=[train], rules=[("l1", "gpu:0")])
    assert str(e.value) == f"expert rule 'l1' -> 'gpu:0' matches no device; devices available: {CPU0}, {CPU1}"
    g.nodes["l1/mm"].device = "cpu:1"
    with pytest.raises(fc.PlacementError) as e:
        place(g, cl, cm, "expert", targets=[train], rules=[("l1", "cpu:0")])
    assert str(e.value) == (f"expert rule 'l1' -> 'cpu:0' sends node 'l1/mm' (MatMul) where it cannot run: it can "
                            f"run only on {CPU1} (constraint device='cpu:1')")
    with pytest.raises(fc.PlacementError, match="unknown placement algorithm 'gredy'; did you mean 'greedy'"):
        place(g, cl, cm, "gredy")


# ---------------------------------------------------------------------------- mincut
@needs_metis
def test_mincut_splits_the_towers_along_the_cheap_cut() -> None:
    g, train = towers(width=512)
    cl = Cluster.from_spec("2xgpu:k40")
    pl = place(g, cl, StaticCostModel(cl, batch=64), "mincut", targets=[train])
    assert pl["a/mm0"] == pl["a/mm2"] and pl["b/mm0"] == pl["b/mm2"]
    assert pl["a/mm0"] != pl["b/mm0"]


# ---------------------------------------------------------------------------- explanation
def test_explanation_is_json_and_tells_why() -> None:
    g, train = towers(width=128)
    g.nodes["a/mm0"].device = "gpu"
    cl = Cluster.from_spec("cpu+2xgpu:k40")
    pl = place(g, cl, StaticCostModel(cl, batch=32), "greedy", targets=[train])
    d = json.loads(json.dumps(pl.to_dict()))
    assert d["algorithm"] == "greedy" and d["valid"] and d["step_time"] == pl.step_time > 0
    dec = next(x for x in d["groups"] if x["trigger"] == "a/mm0")
    assert dec["feasible"] == [GPU0, GPU1] and "constraint device='gpu' on 'a/mm0'" in dec["narrowed_by"]
    assert [c["device"] for c in dec["candidates"]] == [GPU0, GPU1]
    assert all(c["finish"] > 0 for c in dec["candidates"]) and dec["choice"] in (GPU0, GPU1)
    node = next(x for x in d["nodes"] if x["name"] == "a/mm0")
    assert node["device"] == dec["choice"] and node["finish"] > node["start"] >= 0 and node["flops"] > 0
    dev = {x["device"]: x for x in d["devices"]}
    assert sum(x["ops"] for x in dev.values()) == len(pl.simulation.start)
    assert sum(x["flops"] for x in dev.values()) > 0
    assert all(k in dev[GPU0] for k in ("busy", "peak_memory", "bytes_in", "bytes_out"))


# ---------------------------------------------------------------------------- measured costs
def test_measured_cost_model_profiles_saves_loads_and_reports_fallbacks(tmp_path) -> None:
    g = fc.Graph()
    with g.as_default():
        a = fc.placeholder("float32", (None, 64), name="a")
        w = fc.constant(np.ones((64, 64), np.float32), name="w")
        y = fc.matmul(a, w, name="mm")
        fc.matmul(fc.placeholder("float32", (None, 32), name="b"), fc.constant(np.ones((32, 8), np.float32)),
                  name="unprofiled")
    cl = Cluster.local(1)
    m = MeasuredCostModel(cl, batch=16)
    s = fc.Session(g, store=fc.ContainerStore())
    added = profile(m, s, y, {a: np.ones((16, 64), np.float32)}, repeat=2)
    assert added == 2  # the Const w and mm (a is fed: no node runs for it)
    path = tmp_path / "costs.json"
    m.save(path)
    loaded = MeasuredCostModel.load(path, cl)
    assert loaded.batch == 16 and loaded.records == m.records
    t = loaded.op_time(g, g.nodes["mm"], CPU0)
    assert t == m.records[loaded.key_for(g, g.nodes["mm"], CPU0)] and 0 < t < 1
    assert loaded.fallbacks() == []
    # A calibration (dispatch, or the profile's scale when the step ran faster) survives the cache.
    mm_time = m.records[m.key_for(g, g.nodes["mm"], CPU0)]
    prof = cl.devices[0].profile.name
    m.dispatch_by, m.scale_by, m.jitter = {prof: 2e-6}, {prof: 0.5}, 0.21
    m.save(path)
    again = MeasuredCostModel.load(path, cl)
    assert again.dispatch_by == m.dispatch_by and again.scale_by == m.scale_by and again.jitter == 0.21
    assert again.op_time(g, g.nodes["mm"], CPU0) == pytest.approx(mm_time * 0.5 + 2e-6)
    loaded.op_time(g, g.nodes["unprofiled"], CPU0)
    assert loaded.fallbacks() == ["unprofiled"]
    pl = place(g, cl, loaded, "single")
    assert "unprofiled" in pl.fallbacks and pl.cost_model == "measured"
    with pytest.raises(fc.PlacementError, match="cannot read measured costs"):
        MeasuredCostModel.load(tmp_path / "missing.json", cl)
