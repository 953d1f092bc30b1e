"""`flowctl bench scaling` (issue 33): the data-parallel step model's limits, its calibration and the CLI."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from click.testing import CliRunner

from flowctl.bench import scaling as sc
from flowctl.cli.main import cli
from flowctl.engine.cluster import LINKS, Link
from flowctl.engine.errors import FlowctlError
from flowctl.spec.loader import load_spec
from flowctl.spec.model import build_model
from flowctl.training.program import build_step, place_step, step_config

FREE = Link(math.inf, 0.0)


@pytest.fixture(scope="module")
def profiles() -> dict[str, sc.StepProfile]:
    return {m.name: sc.step_profile(load_spec(str(m.spec)), sc.GPU, m.name) for m in sc.MODELS}


def synthetic(rng: np.random.Generator, variables: int = 12) -> sc.StepProfile:
    f, b, u = rng.uniform(0.001, 0.1, 3)
    made = np.sort(rng.uniform(0, b, variables))
    made[-1] = b
    sizes = rng.integers(1, 40 * sc.MiB, variables)
    return sc.StepProfile("synthetic", "x", int(rng.integers(1, 64)), float(f), float(b), float(u),
                          tuple(sc.Gradient(f"v{i}", int(n), float(t)) for i, (n, t) in enumerate(zip(sizes, made))))


def test_one_worker_is_the_simulated_single_step(profiles):
    for m in sc.MODELS:
        loaded = load_spec(str(m.spec))
        config = step_config(loaded)
        step = build_step(build_model(loaded, training=True), config)
        cluster = sc.one_worker(sc.GPU)
        single = place_step(step, config, cluster, sc.StaticCostModel(cluster, batch=step.batch), "single").chosen
        p = profiles[m.name]
        assert p.compute_s == pytest.approx(single.step_time, rel=1e-9)
        for scheme, fn in sc.SCHEMES.items():
            assert fn(p, 1, LINKS["ethernet10g"], overhead_s=1.0) == p.compute_s, scheme
        # Every trainable variable's gradient found (through clipping's product by the scale), with the
        # variable's bytes, each made inside the backward pass.
        variables = step.model.trainable_variables()
        assert sorted(g.variable for g in p.gradients) == sorted(v.node for v in variables)
        assert p.param_bytes == sum(int(np.prod(v.shape)) * 4 for v in variables)
        assert all(0 < g.made_s <= p.backward_s * (1 + 1e-12) for g in p.gradients)
        assert p.forward_s > 0 and p.backward_s > p.forward_s and p.update_s > 0


def test_gradients_come_in_the_order_the_backward_pass_makes_them(profiles):
    made = {g.variable: g.made_s for g in profiles["lstm_lm"].gradients}
    assert made["softmax/kernel"] < made["lstm_2/kernel"] < made["lstm_1/kernel"] < made["embedding/table"]
    made = {g.variable: g.made_s for g in profiles["inception_v3"].gradients}
    assert made["logits/kernel"] < made["mixed_6b/branch1x1/kernel"] < made["conv_1a_3x3/kernel"]


def ring(arrays: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """A ring all-reduce done step by step (reduce-scatter, then all-gather), counting the bytes
    each worker sends."""
    n = len(arrays)
    chunks = [list(np.array_split(a.copy(), n)) for a in arrays]
    sent = [0] * n
    for phase in ("reduce", "gather"):
        for s in range(n - 1):
            moves = []
            for w in range(n):
                c = (w - s) % n if phase == "reduce" else (w + 1 - s) % n
                moves.append((w, (w + 1) % n, c, chunks[w][c].copy()))
            for src, dst, c, data in moves:
                sent[src] += data.nbytes
                chunks[dst][c] = chunks[dst][c] + data if phase == "reduce" else data
    return [np.concatenate(c) for c in chunks], sent


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_ring_sends_2_n_minus_1_over_n_of_the_bytes_per_worker(n):
    rng = np.random.default_rng(n)
    arrays = [rng.standard_normal(96 * 5).astype(np.float32) for _ in range(n)]
    out, sent = ring(arrays)
    for o in out:
        np.testing.assert_allclose(o, np.sum(arrays, axis=0), rtol=1e-5, atol=1e-5)
    nbytes = arrays[0].nbytes
    assert sent == [sc.ring_bytes_per_worker(nbytes, n)] * n
    link = Link(1e9, 0.0)
    assert sc.ring_allreduce_s(nbytes, n, link) == pytest.approx(sent[0] / 1e9)
    assert sc.ring_allreduce_s(nbytes, 1, link) == 0.0


def test_buckets_keep_the_order_and_close_at_the_cap():
    rng = np.random.default_rng(0)
    p = synthetic(rng, 40)
    cap = 25 * sc.MiB
    bs = sc.buckets(p.gradients, cap)
    assert sum(b.nbytes for b in bs) == p.param_bytes and sum(b.gradients for b in bs) == len(p.gradients)
    k = 0
    for i, b in enumerate(bs):
        members = p.gradients[k:k + b.gradients]
        k += b.gradients
        assert b.ready_s == members[-1].made_s and b.nbytes == sum(g.nbytes for g in members)
        if i < len(bs) - 1:
            assert b.nbytes >= cap and b.nbytes - members[-1].nbytes < cap


def test_an_infinitely_fast_link_scales_both_schemes_linearly(profiles):
    for p in (*profiles.values(), synthetic(np.random.default_rng(1))):
        for scheme, fn in sc.SCHEMES.items():
            one = sc.examples_per_s(p, 1, fn(p, 1, FREE))
            for n in sc.WORKERS:
                assert sc.examples_per_s(p, n, fn(p, n, FREE)) == pytest.approx(n * one, rel=1e-12), (scheme, n)


def test_the_parameter_device_grows_linearly_in_n_while_the_ring_stays_bounded(profiles):
    p = profiles["inception_v3"]
    link = LINKS["ethernet10g"]
    pd = {n: sc.parameter_device_step_s(p, n, link) for n in sc.WORKERS}
    assert (pd[64] - pd[32]) / (pd[32] - pd[16]) == pytest.approx(2.0, rel=0.02)
    assert pd[64] > 10 * pd[4]
    # Without latency the ring's step never exceeds compute plus 2P over the bandwidth, whatever N.
    flat = Link(link.bandwidth, 0.0)
    bound = p.compute_s + 2 * p.param_bytes / flat.bandwidth
    ring_steps = [sc.allreduce_step_s(p, n, flat) for n in sc.WORKERS[1:]]
    assert all(t <= bound for t in ring_steps) and ring_steps[-1] < 2 * ring_steps[0]
    # With latency it grows by 2(N-1) latencies per bucket, no more.
    buckets = len(sc.buckets(p.gradients))
    assert sc.allreduce_step_s(p, 64, link) <= bound + buckets * 2 * 63 * link.latency


def test_overlap_never_makes_a_step_shorter_than_its_compute_or_its_transfers():
    rng = np.random.default_rng(2)
    for _ in range(50):
        p = synthetic(rng)
        link = Link(10 ** rng.uniform(7, 11), rng.uniform(0, 1e-3))
        for n in sc.WORKERS[1:]:
            ar = sc.allreduce_step_s(p, n, link)
            rings = sum(sc.ring_allreduce_s(b.nbytes, n, link) for b in sc.buckets(p.gradients))
            assert ar >= p.compute_s and ar >= p.forward_s + rings + p.update_s - 1e-12
            pd = sc.parameter_device_step_s(p, n, link)
            pull = (n - 1) * (len(p.gradients) * link.latency + p.param_bytes / link.bandwidth)
            assert pd >= pull + p.compute_s - 1e-12
            assert pd >= pull + p.forward_s + (n - 1) * p.param_bytes / link.bandwidth + p.update_s - 1e-12


def test_buckets_overlap_the_backward_pass(profiles):
    p = profiles["inception_v3"]
    link = LINKS["ethernet100g"]
    after = sc.allreduce_step_s(p, 8, link, bucket_bytes=p.param_bytes)  # one bucket, once the backward is done
    assert sc.allreduce_step_s(p, 8, link) < after
    assert after == pytest.approx(p.compute_s + sc.ring_allreduce_s(p.param_bytes, 8, link))


def measured_file(tmp_path, p: sc.StepProfile, k: float, links: dict[str, Link], overhead: float,
                  with_links: bool) -> tuple[object, sc.StepProfile]:
    """A measurement made by the model itself: the compute k times the simulator's, the links, an overhead."""
    truth = p.scaled(k)
    d = {"model": "lstm_lm", "batch": p.batch, "threads": 1,
         "one_process": {"examples_per_s": p.batch / truth.compute_s},
         "two_workers": {s: {"examples_per_s": 2 * p.batch / fn(truth, 2, links[s], overhead)}
                         for s, fn in sc.SCHEMES.items()}}
    if with_links:
        d["links"] = {s: {"bandwidth_Bps": k_.bandwidth, "latency_s": k_.latency} for s, k_ in links.items()}
    path = tmp_path / "dataparallel-cpu.json"
    path.write_text(json.dumps(d))
    return path, truth


@pytest.fixture(scope="module")
def cpu_profile() -> sc.StepProfile:
    return sc.step_profile(load_spec(str(sc.MODELS[0].spec)), sc.CPU, "lstm_lm")


def test_calibration_recovers_the_links_of_a_known_machine(tmp_path, cpu_profile):
    links = {"parameter_device": Link(0.7e9, 1e-3), "allreduce": Link(5e9, 1e-3)}
    path, truth = measured_file(tmp_path, cpu_profile, 0.6, links, 0.0, with_links=False)
    scaled, cal = sc.calibrate(cpu_profile, sc.read_measured(path))
    assert cal.compute_scale == pytest.approx(0.6) and scaled.compute_s == pytest.approx(truth.compute_s)
    assert cal.overhead_s == 0.0 and set(cal.fitted) == {"parameter_device link", "allreduce link"}
    for s, k in links.items():
        assert cal.links[s].bandwidth == pytest.approx(k.bandwidth, rel=1e-3)


def test_calibration_recovers_the_overhead_where_the_links_were_measured(tmp_path, cpu_profile):
    links = {"parameter_device": Link(0.7e9, 1e-3), "allreduce": Link(5e9, 2e-4)}
    path, _ = measured_file(tmp_path, cpu_profile, 1.3, links, 0.025, with_links=True)
    _, cal = sc.calibrate(cpu_profile, sc.read_measured(path))
    assert cal.overhead_s == pytest.approx(0.025, rel=1e-6) and cal.fitted == ("overhead",)
    report = sc.calibration_report(path)
    assert report["status"] == "calibrated"
    for point in report["points"]:
        assert point["ratio"] == pytest.approx(1.0, rel=1e-6), point


def test_bench_scaling_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "scaling.json"
    r = CliRunner().invoke(cli, ["bench", "scaling", "--out", str(out), "--calibration", str(tmp_path / "none.json")])
    assert r.exit_code == 0, r.output
    assert "allreduce" in r.output and "param device" in r.output and "inception_v3" in r.output
    assert "uncalibrated" in r.output
    data = json.loads(out.read_text())
    assert data["suite"] == "scaling" and data["calibration"]["status"] == "uncalibrated"
    assert len(data["rows"]) == len(sc.MODELS) * len(sc.TABLE_LINKS) * len(sc.SCHEMES) * len(sc.WORKERS)
    assert all(row["efficiency"] == pytest.approx(row["speedup"] / row["workers"]) for row in data["rows"])
    assert all(p["measured_examples_per_s"] is None for p in data["calibration"]["points"])
    r = CliRunner().invoke(cli, ["bench", "scaling", "--json", "--rows", "lstm_lm", "--devices", "gpu:a100",
                                 "--calibration", str(tmp_path / "none.json")])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout[r.stdout.index("{"):r.stdout.rindex("}") + 1])
    assert {row["model"] for row in data["rows"]} == {"lstm_lm"} and data["models"]["lstm_lm"]["device"] == "a100"


def test_a_calibrated_run_prints_the_measured_points(tmp_path, cpu_profile):
    links = {"parameter_device": Link(0.7e9, 1e-3), "allreduce": Link(5e9, 1e-3)}
    path, _ = measured_file(tmp_path, cpu_profile, 0.8, links, 0.0, with_links=False)
    r = CliRunner().invoke(cli, ["bench", "scaling", "--rows", "lstm_lm", "--calibration", str(path)])
    assert r.exit_code == 0, r.output
    assert "calibrated on" in r.output and "uncalibrated" not in r.output and "measured" in r.output


@pytest.mark.parametrize("text, message", [
    ("{not json", "cannot read the measured scaling points"),
    ('{"model": "lstm_lm", "batch": 20, "threads": 1}', "missing key 'one_process'"),
    ('{"model": "nmt", "batch": 20, "threads": 1, "one_process": {"examples_per_s": 5}}', "lstm_lm's, not 'nmt'"),
    ('{"model": "lstm_lm", "batch": 20, "threads": 1, "one_process": {"examples_per_s": 5}, '
     '"two_workers": {"ring": {"examples_per_s": 9}}}', "unknown scheme(s) ring"),
])
def test_a_bad_calibration_file_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(FlowctlError, match=re.escape(message)):
        sc.read_measured(path)
    r = CliRunner().invoke(cli, ["bench", "scaling", "--rows", "lstm_lm", "--calibration", str(path)])
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output


def test_unknown_models_and_multi_device_workers_are_one_clear_error():
    r = CliRunner().invoke(cli, ["bench", "scaling", "--rows", "transformer_xl"])
    assert r.exit_code != 0 and "no scaling model transformer_xl" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli, ["bench", "scaling", "--devices", "2xgpu:h100"])
    assert r.exit_code != 0 and "one device" in r.output and "Traceback" not in r.output


def test_gpt2_small_is_a_row_of_the_table():
    r = CliRunner().invoke(cli, ["bench", "scaling", "--rows", "transformer_lm", "--json"])
    assert r.exit_code == 0, r.output
    result, _ = json.JSONDecoder().raw_decode(r.output[r.output.index("{"):])  # the table follows, on stderr
    rows = [x for x in result["rows"] if x["model"] == "transformer_lm"]
    assert {x["workers"] for x in rows} >= {1, 2, 64}
