"""Issue 5's equivalence: one model, the same losses and variables on 1 device and placed across 2
and 4 virtual CPU devices by every placer (float32; the kernels are deterministic, so bitwise)."""
from __future__ import annotations

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.cluster import Cluster
from flowctl.engine.placement import ALGORITHMS, StaticCostModel, place
from flowctl.spec.loader import load_text
from flowctl.bench.spec import _feeds
from flowctl.spec.model import build_model
from flowctl.training.program import build_step, step_config


def step_graph(loaded):
    return build_step(build_model(loaded), step_config(loaded))


def expert_rules(loaded):
    return step_config(loaded).expert_rules()

SPEC = """\
version: 1
name: placed
model:
  layers:
    - {name: x, type: input, shape: [12]}
    - {name: a, type: dense, units: 32, activation: relu, inputs: [x]}
    - {name: b, type: dense, units: 32, activation: tanh, inputs: [x]}
    - {name: ab, type: concat, inputs: [a, b]}
    - {name: c, type: dense, units: 16, activation: relu}
    - {name: logits, type: dense, units: 3}
    - {name: y, type: input, shape: [], dtype: int32, classes: 3}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
devices: [cpu:0, cpu:1, cpu:2, cpu:3]
parallelism:
  groups:
    - {layers: [a], device: cpu:0}
    - {layers: [b], device: cpu:1}
    - {layers: [c], device: cpu:2}
    - {layers: [logits, loss], device: cpu:3}
training: {optimizer: {type: momentum}, learning_rate: 0.1, batch_size: 8, seed: 4}
"""


def losses_for(assign: dict | None, n_devices: int, steps: int = 3) -> tuple[list[float], dict]:
    loaded = load_text(SPEC)
    st = step_graph(loaded)
    g = st.graph
    store = fc.ContainerStore()
    fc.Session(g, store=store).run(st.init.node)
    feeds = _feeds(st, loaded)
    feeds[st.lr] = np.float32(0.1)
    if assign is None:
        sess = fc.Session(g, store=store)
    else:
        sess = fc.DistributedSession(g, Cluster.local(n_devices, threads=n_devices), assign(g, st, loaded),
                                     store=store)
    out = [float(sess.run([st.train.loss, st.train.train_op], feeds)[0]) for _ in range(steps)]
    if assign is not None:
        sess.close()
    return out, sess.variable_values()


def placer(alg: str, n: int):
    def assign(g, st, loaded):
        cluster = Cluster.local(n, threads=n)
        rules = [(p, d) for p, d in expert_rules(loaded) if int(d[-1]) < n] or None
        pl = place(g, cluster, StaticCostModel(cluster, batch=8), alg, targets=st.targets, rules=rules,
                   layers=st.model.layer_of())
        return pl.assignment
    return assign


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("alg", ALGORITHMS)
def test_every_placer_gives_the_single_device_losses(alg, n):
    if alg == "mincut":
        pytest.importorskip("pymetis")
    ref_losses, ref_vars = losses_for(None, 1)
    got_losses, got_vars = losses_for(placer(alg, n), n)
    assert got_losses == ref_losses
    for k in ref_vars:
        np.testing.assert_array_equal(got_vars[k], ref_vars[k], err_msg=k)


def test_expert_placement_really_spans_four_devices():
    loaded = load_text(SPEC)
    st = step_graph(loaded)
    cluster = Cluster.local(4, threads=4)
    pl = place(st.graph, cluster, StaticCostModel(cluster, batch=8), "expert", targets=st.targets,
               rules=expert_rules(loaded), layers=st.model.layer_of())
    used = {pl.assignment[n] for n in pl.simulation.start}
    assert len(used) == 4


TWO_DEVICES = """\
version: 1
name: twodev
model:
  layers:
    - {name: x, type: input, shape: [16]}
    - {name: left, type: dense, units: 32, activation: relu, inputs: [x]}
    - {name: right, type: dense, units: 32, activation: relu, inputs: [x]}
    - {name: join, type: concat, inputs: [left, right]}
    - {name: drop, type: dropout, rate: 0.2}
    - {name: logits, type: dense, units: 4}
    - {name: y, type: input, shape: [], dtype: int32, classes: 4}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: synthetic, task: learnable}
devices: [cpu:0, cpu:1]
placement:
  algorithm: expert
  constraints:
    - {match: "left*", device: cpu:0}
    - {match: "right*", device: cpu:1}
training: {optimizer: {type: adam}, batch_size: 16, steps: 12}
"""


def test_train_places_the_step_on_the_specs_devices_and_resumes_exactly(tmp_path):
    import json

    from click.testing import CliRunner

    from flowctl.cli.main import cli

    spec = tmp_path / "twodev.yaml"
    spec.write_text(TWO_DEVICES)
    run = CliRunner()
    assert run.invoke(cli, ["train", str(spec), "--run-dir", str(tmp_path / "full")]).exit_code == 0
    assert run.invoke(cli, ["train", str(spec), "--run-dir", str(tmp_path / "split"), "--steps", "5"]).exit_code == 0
    r = run.invoke(cli, ["resume", str(tmp_path / "split")])
    assert r.exit_code == 0, r.output
    placement = json.loads((tmp_path / "full" / "placement.json").read_text())["assignment"]
    assert {d[-5:] for d in placement.values()} == {"cpu:0", "cpu:1"}
    assert placement["right/kernel"].endswith("cpu:1")

    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]

    assert losses(tmp_path / "split") == losses(tmp_path / "full") and len(losses(tmp_path / "full")) == 12


def _train_losses(tmp_path, name: str, *sets: str) -> list[float]:
    import json

    from click.testing import CliRunner

    from flowctl.cli.main import cli

    spec = tmp_path / "placed.yaml"
    spec.write_text(SPEC + "placement: {algorithm: expert}\n")
    args = [a for s in sets for a in ("--set", s)]
    r = CliRunner().invoke(cli, ["train", str(spec), "--steps", "4", "--run-dir", str(tmp_path / name), *args])
    assert r.exit_code == 0, r.output
    return [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_the_spec_sets_the_papers_transfer_options(tmp_path, monkeypatch):
    """placement.transfers: receiving as late as possible (§5.2) changes when, not what: the same
    losses bitwise; bf16 on the wire (§5.5) is lossy: close, not equal."""
    monkeypatch.chdir(tmp_path)
    plain = _train_losses(tmp_path, "plain")
    alap = _train_losses(tmp_path, "alap", "placement.transfers.receive=alap")
    bf16 = _train_losses(tmp_path, "bf16", "placement.transfers={compress: bf16, receive: alap}")
    assert alap == plain
    assert bf16 != plain
    np.testing.assert_allclose(bf16, plain, rtol=0.02)
