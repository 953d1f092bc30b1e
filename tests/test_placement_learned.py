"""The learned placer: the policy's REINFORCE estimator, reproducibility, resume, warm start, and
the placer through `place` and the CLI."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.engine.cluster import Cluster
from flowctl.engine.errors import CheckpointError
from flowctl.engine.placement import StaticCostModel, place, prepare
from flowctl.engine.placement.grouping import MAX_DEVICES, build_units
from flowctl.engine.placement.learned import LearnedOptions, Trainer, _sample
from flowctl.engine.placement.placers import heuristic_seed
from flowctl.engine.placement.placers import place_single
from flowctl.engine.placement.policy import Policy
from tests.test_placement import towers

ROOT = Path(__file__).resolve().parents[1]


def _feeds(policy: Policy, units: int, devices: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    mask = np.where(np.arange(MAX_DEVICES) < devices, 0.0, -1e9)[None].repeat(units, 0)
    return policy.feeds(rng.random((units, 32)), rng.random((units, 8)), np.eye(units), mask)


def test_reinforce_moves_the_policy_toward_a_known_optimum() -> None:
    # Reward: the share of units on device 2 of 3; the optimum puts every unit there. REINFORCE
    # with a moving-average baseline must raise p(device 2) for every unit from about 1/3.
    U = 5
    pol = Policy(U, seed=3, lr=0.01)
    feeds = _feeds(pol, U, 3)
    rng = np.random.default_rng(0)
    before = pol.distribution(feeds)
    assert np.allclose(before.sum(axis=1), 1.0) and np.all(before[:, 3:] == 0.0)  # masked slots
    baseline = None
    for _ in range(40):
        probs = pol.distribution(feeds)
        samples = np.stack([_sample(rng, probs) for _ in range(8)])
        rewards = (samples == 2).mean(axis=1)
        base = rewards.mean() if baseline is None else baseline
        baseline = 0.9 * base + 0.1 * rewards.mean()
        w = np.zeros((U, MAX_DEVICES))
        for s, a in zip(samples, rewards - base):
            w[np.arange(U), s] += a / len(samples)
        pol.update(feeds, w)
    after = pol.distribution(feeds)
    assert np.all(before[:, 2] < 0.5)
    assert np.all(after[:, 2] > 0.9), after[:, 2]


def _problem(batch: int = 256, devices: str = "2xgpu:k40"):
    g, train = towers(width=512, depth=2)
    cl = Cluster.from_spec(devices)
    return prepare(g, cl, StaticCostModel(cl, batch=batch), targets=[train])


def test_the_trainer_finds_the_split_of_two_parallel_towers_from_a_single_device_start() -> None:
    pb = _problem()
    start = place_single(pb)  # both towers on one device: the policy has to find the split
    tr = Trainer(pb, LearnedOptions(seed=1, steps=60, imitation=2, max_units=6, lr=0.02), start)
    run = tr.train()
    best = np.asarray(run.best_units)
    units = tr.run.units
    ua = units.step_unit[pb.table.index["a/mm0"]]
    ub = units.step_unit[pb.table.index["b/mm0"]]
    assert best[ua] != best[ub]
    assert run.best_step < 0.8 * start.step_time


def _train(pb, steps: int, ckpt: Path | None = None, resume: bool = False, seed: int = 5) -> Trainer:
    opts = LearnedOptions(seed=seed, steps=steps, imitation=3, max_units=6, batch=4,
                          checkpoint=str(ckpt) if ckpt else None, resume=resume, checkpoint_every=2)
    tr = Trainer(pb, opts, heuristic_seed(pb, None, None)[0])
    if resume and ckpt is not None:
        tr.restore(str(ckpt))
    tr.train()
    return tr


def _same(a: Trainer, b: Trainer) -> None:
    assert a.run.history == b.run.history
    assert a.run.best_units == b.run.best_units and a.run.baseline == b.run.baseline
    sa, sb = a.policy.state(), b.policy.state()
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


def test_a_fixed_seed_reproduces_a_training_run_and_another_seed_differs() -> None:
    pb = _problem()
    a, b = _train(pb, 8), _train(pb, 8)
    _same(a, b)
    c = _train(pb, 8, seed=6)
    assert not np.array_equal(c.policy.state()["policy/out/w"], a.policy.state()["policy/out/w"])


def test_resuming_a_placer_training_continues_it_exactly(tmp_path: Path) -> None:
    pb = _problem()
    straight = _train(pb, 10)
    ckpt = tmp_path / "placer.npz"
    first = _train(pb, 6, ckpt)
    assert first.run.step == 6
    resumed = _train(pb, 10, ckpt, resume=True)
    assert resumed.run.step == 10
    _same(straight, resumed)


def test_a_checkpoint_of_another_problem_is_refused_for_resume_but_warm_starts(tmp_path: Path) -> None:
    ckpt = tmp_path / "placer.npz"
    _train(_problem(), 4, ckpt)
    other = _problem(batch=64, devices="4xgpu:k40")  # another batch size and cluster
    opts = LearnedOptions(seed=5, steps=4, imitation=3, max_units=6, batch=4)
    tr = Trainer(other, opts, heuristic_seed(other, None, None)[0])
    with pytest.raises(CheckpointError, match="another problem"):
        tr.restore(str(ckpt))
    warm = Trainer(other, LearnedOptions(seed=5, steps=4, imitation=3, max_units=6, batch=4,
                                         warm_start=str(ckpt)), heuristic_seed(other, None, None)[0])
    assert "policy/encoder/w" in warm.warm and not any("Adam" in k for k in warm.warm)
    saved = np.load(ckpt)
    np.testing.assert_array_equal(warm.policy.state()["policy/encoder/w"], saved["policy/encoder/w"])
    warm.train()
    with pytest.raises(CheckpointError, match="no such placer checkpoint"):
        Trainer(other, LearnedOptions(warm_start=str(tmp_path / "missing.npz")), heuristic_seed(other, None, None)[0])


def test_learned_through_place_is_never_slower_than_the_best_heuristic() -> None:
    g, train = towers(width=512, depth=2)
    cl = Cluster.from_spec("2xgpu:k40")
    cm = StaticCostModel(cl, batch=256)
    pl = place(g, cl, cm, "learned", targets=[train], learned=LearnedOptions(steps=6, batch=4, max_units=6))
    assert pl.algorithm == "learned" and pl.valid
    assert set(pl.assignment) == set(g.nodes)
    heuristics = [place(g, cl, cm, a, targets=[train]).step_time for a in ("single", "greedy", "heft")]
    assert pl.step_time <= min(heuristics) + 1e-12
    assert any(n.startswith("learned:") for n in pl.notes)
    assert isinstance(pl.alternatives["learned_curve"], list)


def test_units_never_mix_feasible_sets_and_express_the_seed_exactly() -> None:
    pb = _problem()
    seed = heuristic_seed(pb, None, None)[0]
    units = build_units(pb, None, 4, seed.device_index)
    for u in range(len(units)):
        nodes = [i for i in range(len(pb.step)) if units.step_unit[i] == u]
        assert len({pb.coarse.feasible_idx[pb.step_group[i]] for i in nodes}) == 1
        assert len({seed.device_index[i] for i in nodes}) == 1
    proj = units.project(pb, seed.device_index)
    assert units.node_devices(proj).tolist() == seed.device_index


def test_place_cli_learned_with_steps_seed_and_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "p.npz"
    args = ["place", str(ROOT / "specs" / "lstm_lm.yaml"), "-a", "learned", "--devices", "2xgpu:k40",
            "--steps", "3", "--seed", "2", "--checkpoint", str(ckpt), "--json"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert ckpt.exists()
    r2 = CliRunner().invoke(cli, args[:-1] + ["--resume", "--budget", "1m", "--json"])
    assert r2.exit_code == 0, r2.output
    bad = CliRunner().invoke(cli, args[:4] + ["--budget", "ten minutes"])
    assert bad.exit_code != 0 and "not a duration" in bad.output


@pytest.mark.slow
def test_on_the_default_placement_suite_learned_is_never_slower_than_the_best_other_placer() -> None:
    from flowctl.bench.placement import placement_suite

    r = placement_suite(learned_budget=5.0)
    for row in r["rows"]:
        learned = row["results"]["learned"]
        if row["best_other"] is None:
            assert "error" in learned, row["model"]  # nothing fits: learned fails too, with the reason
            continue
        assert learned["step_ms"] <= row["best_other"] + 1e-9, (row["model"], row["devices"])


@pytest.mark.slow
def test_learned_beats_the_expert_on_unconstrained_nmt_over_4_k40_by_10_percent() -> None:
    # The target: NMT without constraints over 4 x K40, the expert (one LSTM layer per
    # GPU) at 209.2 ms (208.1 now). Seed 0 with 100 updates and the local search after them:
    # 168.4 ms, 0.81 x (the policy alone took 655 updates to get below 0.9 x).
    from flowctl.bench.placement import _variant
    from flowctl.spec.model import build_model
    from flowctl.training.program import build_step, cluster_for, step_config

    loaded = _variant("nmt.yaml", "nmt_free", 4)
    sg = build_step(build_model(loaded), step_config(loaded))
    cl = cluster_for(step_config(loaded), "4xgpu:k40")
    cm = StaticCostModel(cl, batch=64)
    args = dict(targets=[sg.targets[0]], rules=step_config(loaded).expert_rules(), layers=sg.model.layer_of())
    expert = place(sg.graph, cl, cm, "expert", **args)
    pl = place(sg.graph, cl, cm, "learned", learned=LearnedOptions(seed=0, steps=100), **args)
    assert pl.step_time <= 0.9 * expert.step_time, (pl.step_time, expert.step_time)


def _demo_on_two_cpus():
    from flowctl.spec.loader import load_spec
    from flowctl.spec.model import build_model
    from flowctl.training.program import build_step, cluster_for, step_config

    loaded = load_spec(str(ROOT / "specs" / "demo.yaml"), ("devices=[cpu:0, cpu:1]",))
    config = step_config(loaded)
    step = build_step(build_model(loaded, training=True), config)
    return loaded, config, step, cluster_for(config)


def test_the_measured_reward_runs_each_distinct_placement_once_on_two_virtual_cpus() -> None:
    from flowctl.training.measure import StepMeter
    from flowctl.training.program import place_step

    loaded, config, step, cluster = _demo_on_two_cpus()
    meter = StepMeter(step, loaded, cluster, steps=1)
    measured: list[float] = []

    def measure(assignment: dict[str, str]) -> float:
        assert set(assignment) == set(step.graph.nodes)  # every node placed, on the cluster's devices
        assert set(assignment.values()) <= set(cluster.names)
        measured.append(meter(assignment))
        return measured[-1]

    # Two units over two devices: four placements, so the 13 evaluations must repeat some.
    opts = LearnedOptions(steps=4, imitation=1, batch=4, max_units=2, reward="measured", measure=measure)
    cost = StaticCostModel(cluster, batch=step.batch)
    pb = prepare(step.graph, cluster, cost, step.targets)
    seed, _ = heuristic_seed(pb, None, step.model.layer_of())
    tr = Trainer(pb, opts, seed, step.model.layer_of())
    run = tr.train()
    assert len(run.units) <= 2
    assert meter.calls == run.measured == len(measured) == 1 + len(tr.cache)  # the seed, then each distinct one
    assert len(tr.cache) <= 4 < 1 + 3 * opts.batch
    assert run.best_step in tr.cache.values() or run.best_step == tr.seed_measured

    measured.clear()
    pl = place_step(step, config, cluster, cost, "learned", learned=opts).chosen
    assert pl.valid and set(pl.assignment.values()) <= set(cluster.names)
    assert pl.measured_step is not None and pl.measured_step in measured
    assert any("rewards measured" in n for n in pl.notes)


def test_place_cli_measured_reward_on_virtual_cpus_and_refused_where_the_devices_are_not_here() -> None:
    import json

    from flowctl.kernels.registry import gpu_count

    spec = str(ROOT / "specs" / "demo.yaml")
    r = CliRunner().invoke(cli, ["place", spec, "--algorithm", "learned", "--reward", "measured", "--devices",
                                 "cpu:0,cpu:1", "--steps", "2", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["valid"] and out["measured_step"] > 0
    bad = CliRunner().invoke(cli, ["place", spec, "--reward", "measured", "--devices", "cpu:0,cpu:1"])
    assert bad.exit_code != 0 and "--algorithm learned" in bad.output and "Traceback" not in bad.output
    if gpu_count() >= 4:
        pytest.skip("this machine has the GPUs: the refusal needs a cluster that is not here")
    bad = CliRunner().invoke(cli, ["place", spec, "--algorithm", "learned", "--reward", "measured", "--devices",
                                   "4xgpu:k40", "--steps", "1"])
    assert bad.exit_code != 0 and (bad.exception is None or isinstance(bad.exception, SystemExit))
    lines = [x for x in bad.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "not on this machine" in lines[0], bad.output
