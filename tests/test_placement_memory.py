"""Placement that fits memory: capped devices make placers spread work, not fail; `inspect` and
`place` agree on what a step holds."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from flowctl.bench.placement import CAP, _variant, single_device_need
from flowctl.cli.main import cli
from flowctl.engine.cluster import Cluster
from flowctl.engine.placement.explain import Placement
from flowctl.engine.errors import PlacementError
from flowctl.engine.placement import StaticCostModel, place, prepare
from flowctl.engine.placement.grouping import climb
from flowctl.engine.placement.learned import LearnedOptions
from flowctl.spec.model import build_model
from flowctl.training.program import build_step, cluster_for, step_config

ROOT = Path(__file__).resolve().parents[1]


def _nmt_cap_mib(optimizer: str | None = None) -> int:
    """60% of what NMT without constraints needs on one GPU (bench placement's capped rows)."""
    return int(0.6 * single_device_need(_variant("nmt.yaml", "own", 4, free=True, optimizer=optimizer),
                                        "4xgpu:k40", 64)) >> 20


def _nmt_free_steps(gpus: int, profile: str, alg: str, link: str = "", optimizer: str | None = None,
                    cap: int | None = None) -> tuple[list[float], Placement, Cluster]:
    """NMT without constraints placed by `alg` on `gpus` GPUs of `profile` (over `link`, e.g.
    "@pcie3"), uncapped and capped at `cap` MiB (default 60% of the one-device need): both step
    times, the capped placement and its cluster. `optimizer`: another than NMT's Adam; with
    "sgd" (no slots) activations, not state, fill the devices."""
    loaded = _variant("nmt.yaml", "nmt_free", gpus, optimizer=optimizer)
    sg = build_step(build_model(loaded), step_config(loaded))
    rules, layers = step_config(loaded).expert_rules(), sg.model.layer_of()
    cap = cap or _nmt_cap_mib(optimizer)
    steps = []
    for devices in (f"{gpus}xgpu:{profile}{link}", f"{gpus}xgpu:{profile}:{cap}MiB{link}"):
        c = cluster_for(step_config(loaded), devices)
        pl = place(sg.graph, c, StaticCostModel(c, batch=64), alg, targets=[sg.targets[0]], rules=rules,
                   layers=layers)
        steps.append(pl.step_time)
    return steps, pl, c


def test_a_memory_cap_in_the_devices_syntax() -> None:
    c = Cluster.from_spec("2xgpu:k40:2GiB+cpu:512MiB")
    assert [d.profile.memory for d in c.devices] == [2 << 30, 2 << 30, 512 << 20]
    assert c.devices[0].profile.peak_flops == Cluster.from_spec("gpu:k40").devices[0].profile.peak_flops
    with pytest.raises(PlacementError, match="4xgpu:k40:2GiB"):
        Cluster.from_spec("4xgpu:k40:2TB")


@pytest.mark.slow  # 35-39 s on a 2-core host: run with -m slow
def test_every_placer_fits_a_4_layer_lstm_capped_at_60_percent_of_its_one_device_need() -> None:
    loaded = _variant("lstm4.yaml", "lstm4", 4)
    need = single_device_need(_variant("lstm4.yaml", "lstm4", 4, free=True), "4xgpu:k40", 20)
    sg = build_step(build_model(loaded), step_config(loaded))
    targets, rules, layers = [sg.targets[0]], step_config(loaded).expert_rules(), sg.model.layer_of()
    free = cluster_for(step_config(loaded), "4xgpu:k40")
    cap = int(need * CAP)
    capped = cluster_for(step_config(loaded), f"4xgpu:k40:{cap >> 20}MiB")
    pb_free = prepare(sg.graph, free, StaticCostModel(free, batch=20), targets)
    pb_cap = prepare(sg.graph, capped, StaticCostModel(capped, batch=20), targets)
    for alg in ("single", "greedy", "heft", "expert", "learned"):
        kw = {"rules": rules, "layers": layers,
              "learned": LearnedOptions(steps=3, batch=2, max_units=8)}
        uncapped = place(sg.graph, free, pb_free.cost_model, alg, targets=targets, problem=pb_free, **kw)
        pl = place(sg.graph, capped, pb_cap.cost_model, alg, targets=targets, problem=pb_cap, **kw)
        assert pl.valid, alg
        assert max(d.peak_memory for d in pl.devices) <= (cap >> 20) << 20, alg
        assert pl.step_time <= 1.10 * uncapped.step_time, (alg, pl.step_time, uncapped.step_time)
    one = place(sg.graph, capped, pb_cap.cost_model, "single", targets=targets, problem=pb_cap)
    assert len({d for d in one.assignment.values()}) > 1  # spread, as the note says
    assert any("no single device holds the step" in n for n in one.notes)


def test_inspect_and_place_agree_on_what_a_step_holds() -> None:
    spec = str(ROOT / "specs" / "lstm4.yaml")
    r = CliRunner().invoke(cli, ["inspect", spec, "--json"])
    assert r.exit_code == 0, r.output
    mem = json.loads(r.stdout)["memory"]
    p = CliRunner().invoke(cli, ["place", spec, "-a", "single", "--json"])
    assert p.exit_code == 0, p.output
    devices = json.loads(p.stdout)["devices"]
    peak = {d["device"]: d["peak_memory"] for d in devices}
    assert peak[mem["device"]] == mem["step_peak_bytes"]
    resident = {d["device"]: d["resident"] for d in devices}
    assert resident[mem["device"]] == mem["step_resident_bytes"]
    assert mem["step_peak_bytes"] > mem["step_resident_bytes"] >= mem["parameter_bytes"]


def test_coarsening_keeps_each_lstm_layer_with_its_weights_gradients_and_updates() -> None:
    # An unrolled LSTM's cells are each cheaper to run than to send their state; merged one by
    # one into their consumer, they once snowballed all four layers into one 447-node group.
    loaded = _variant("lstm4.yaml", "lstm4", 4)
    sg = build_step(build_model(loaded), step_config(loaded))
    cl = cluster_for(step_config(loaded), "4xgpu:k40")
    pb = prepare(sg.graph, cl, StaticCostModel(cl, batch=20), [sg.targets[0]])
    co = pb.coarse
    kernels = [co.group(f"lstm_{k}/kernel").id for k in range(1, 5)]
    assert len(set(kernels)) == 4
    for k, g in zip(range(1, 5), kernels):
        update = f"lstm_{k}/kernel/SGD/update"
        grads = [n for n in sg.graph.nodes.values() if n.follows == f"lstm_{k}/kernel_rows"]
        assert co.group(update).id == g and grads and all(co.group(n.name).id == g for n in grads)
    sizes = [len(grp.members) for grp in co.groups.values()]
    assert max(sizes) < 100, max(sizes)


def test_bench_placement_rows_select_models_and_single_rows() -> None:
    from flowctl.bench.placement import DEFAULT_ROWS, select_rows
    from flowctl.engine.errors import FlowctlError

    assert select_rows(DEFAULT_ROWS, "lstm4") == [("lstm4", 4, "k40")]
    assert select_rows(DEFAULT_ROWS, "lstm4/2xk40, nmt") == [("lstm4", 2, "k40"), ("nmt", 4, "k40")]
    with pytest.raises(FlowctlError, match="known"):
        select_rows(DEFAULT_ROWS, "lstm5")
    with pytest.raises(FlowctlError, match="NxPROFILE"):
        select_rows(DEFAULT_ROWS, "lstm4/2xp100")
    r = CliRunner().invoke(cli, ["bench", "placement", "--rows", "lstm9"])
    assert r.exit_code != 0 and "no placement benchmark 'lstm9'" in r.output


def test_the_expert_under_a_cap_moves_only_what_no_rule_placed() -> None:
    # NMT's own rules pin the encoder to gpu:0 and the decoder to gpu:1; attention and the
    # projection follow the decoder and overflow gpu:1 at 60% of the one-device need.
    loaded = _variant("nmt.yaml", "own", 4)
    sg = build_step(build_model(loaded), step_config(loaded))
    targets, rules, layers = [sg.targets[0]], step_config(loaded).expert_rules(), sg.model.layer_of()
    # 60% of what NMT without constraints needs on one K40 (bench placement's single_device_need)
    cap = int(0.6 * single_device_need(_variant("nmt.yaml", "own", 4, free=True), "4xgpu:k40", 64))
    capped = cluster_for(step_config(loaded), f"4xgpu:k40:{cap >> 20}MiB")
    free = cluster_for(step_config(loaded), "4xgpu:k40")
    uncapped = place(sg.graph, free, StaticCostModel(free, batch=64), "expert", targets=targets, rules=rules,
                     layers=layers)
    pl = place(sg.graph, capped, StaticCostModel(capped, batch=64), "expert", targets=targets, rules=rules,
               layers=layers)
    assert max(d.peak_memory for d in uncapped.devices) > cap  # the rules' own placement overflows
    assert pl.valid and pl.step_time <= 1.10 * uncapped.step_time
    gpu0, gpu1 = capped.names[0], capped.names[1]
    for name, node in sg.graph.nodes.items():
        if name.startswith("encoder/"):
            assert pl[name] == gpu0, name
        elif name.startswith("decoder/"):
            assert pl[name] == gpu1, name
    assert pl["projection/kernel"] != uncapped["projection/kernel"]
    assert any("what no rule placed was moved" in n for n in pl.notes)


@pytest.mark.slow  # 35-39 s on a 2-core host: run with -m slow
def test_nmt_on_two_capped_k40s_does_not_fit_by_its_rules_and_every_placer_says_so() -> None:
    # NMT's rules pin the encoder to gpu:0 and the decoder to gpu:1; attention + projection (one
    # colocation group) must join one of them, and either way that device is over 60% of the
    # one-device need, although the two devices' memory in all would hold the step.
    from flowctl.bench.placement import _row, verdict

    loaded = _variant("nmt.yaml", "own", 2)
    cap = _nmt_cap_mib()
    results = _row(loaded, f"2xgpu:k40:{cap}MiB", 64, ("single", "expert", "greedy", "heft"), 1.0, 0, lambda _m: None)
    assert verdict(results) == "does not fit (rules)", {a: r.get("error", "")[:200] for a, r in results.items()}
    for alg, r in results.items():
        e = r["error"]
        assert e.startswith(f"{alg}: does not fit under the placement rules"), e
        assert "constraint device='gpu:0' pins" in e and "encoder/lstm_1" in e, e
        assert "constraint device='gpu:1' pins" in e and "decoder/lstm_1" in e, e
        assert "(attention, projection)" in e and "MiB over its" in e, e
        assert "the rules, not the memory, keep it from fitting" in e, e
        assert not re.search(r"on (\S+), \1 needs", e), e  # a device named once, not "on gpu:0, gpu:0"
    sg = build_step(build_model(loaded), step_config(loaded))
    cluster = cluster_for(step_config(loaded), f"2xgpu:k40:{cap}MiB")
    with pytest.raises(PlacementError) as info:
        place(sg.graph, cluster, StaticCostModel(cluster, batch=64), "greedy", targets=[sg.targets[0]])
    d = info.value.details
    assert d["kind"] == "rules_overflow" and d["total_capacity"] >= d["one_device_need"]
    # Both choices for the free group overflow, and by what the message says.
    assert len({o["devices"][0] for o in d["options"]}) == 2 and all(o["over"] > 0 for o in d["options"])
    assert [p["device"] for p in d["pins"]] == list(cluster.names[:2])


def test_a_placer_that_merely_fails_is_not_called_a_rules_verdict() -> None:
    from flowctl.bench.placement import verdict

    assert verdict({"single": {"step_ms": 1.0}, "greedy": {"error": "x", "kind": "out_of_memory"}}) == "placer failed"
    assert verdict({"single": {"step_ms": 1.0}, "expert": {"error": "no expert rules for this model"}}) == "fits"


def _lstm_lm_learned(devices: str) -> float:
    loaded = _variant("lstm_lm.yaml", "own", 2)
    sg = build_step(build_model(loaded), step_config(loaded))
    c = cluster_for(step_config(loaded), devices)
    pl = place(sg.graph, c, StaticCostModel(c, batch=20), "learned", targets=[sg.targets[0]],
               layers=sg.model.layer_of(), learned=LearnedOptions(steps=150))
    assert pl.valid
    return pl.step_time


@pytest.mark.slow  # 35-39 s on a 2-core host: run with -m slow
def test_learned_on_lstm_lm_over_two_k40s_capped_at_60_percent_stays_within_10_percent_of_uncapped() -> None:
    # bench placement's lstm_lm/2xk40 row (112 MiB: 60% of the one-device need). The policy alone
    # collapses early under the cap on the few valid placements it found (+11% over uncapped); the
    # local search after training, over units twice as fine, from every placer's placement, takes it
    # the rest of the way (the policy alone
    # and no local search: 17.79 vs 15.98 ms; now 17.50 vs 15.97).
    uncapped = _lstm_lm_learned("2xgpu:k40")
    capped = _lstm_lm_learned("2xgpu:k40:112MiB")
    assert capped <= 1.10 * uncapped, (capped, uncapped)


@pytest.mark.parametrize("model, spec, variant, batch, cap", [("lstm_lm", "lstm_lm.yaml", "own", 20, "112MiB"),
                                                               ("lstm4", "lstm4.yaml", "lstm4", 20, "23MiB")])
def test_list_schedulers_on_two_capped_h100s_fit_within_10_percent_of_uncapped(model: str, spec: str, variant: str,
                                                                                 batch: int, cap: str) -> None:
    # bench placement's 2xh100 capped rows when H100s talked at PCIe 3.0 rates (the harder case,
    # kept): heft's walks with lowered budgets, repaired, gave 6.33 ms on lstm_lm (4.0 uncapped)
    # and no fit at all on lstm4; the walk without budgets, repaired, is the placer's own choice
    # moved only as far as memory demands.
    loaded = _variant(spec, variant, 2)
    sg = build_step(build_model(loaded), step_config(loaded))
    for alg in ("greedy", "heft"):
        steps = []
        for devices in ("2xgpu:h100@pcie3", f"2xgpu:h100:{cap}@pcie3"):
            c = cluster_for(step_config(loaded), devices)
            pl = place(sg.graph, c, StaticCostModel(c, batch=batch), alg, targets=[sg.targets[0]])
            steps.append(pl.step_time)
        assert steps[1] <= 1.10 * steps[0], (model, alg, steps)


def test_the_expert_moves_ruled_stages_too_where_moving_the_rest_cannot_fit() -> None:
    # NMT's layer-per-GPU stages wrapped over two H100s capped at 60% of the one-device need
    # at PCIe 3.0 rates (bench placement's nmt_free/2xh100 row before H100s talked over PCIe 5.0;
    # the harder case, kept), with SGD: counted since, Adam's moments make the one-device need
    # mostly state, and at 60% of it the expert's own stages fit. Moving only what no rule placed
    # leaves a GPU over, so the ruled stages move too and the placement fits; the local search
    # after the moves makes it faster, to within 10% of the uncapped 19.28 ms.
    steps, pl, c = _nmt_free_steps(2, "h100", "expert", "@pcie3", optimizer="sgd")
    assert pl.valid and all(d.peak_memory <= c.devices[0].profile.memory for d in pl.devices)
    assert any("ruled groups moved too" in n for n in pl.notes)
    search = [n for n in pl.notes if "local search" in n]
    assert search, pl.notes
    before, after = (float(x) for x in re.findall(r"\(([\d.]+) ms -> ([\d.]+) ms", search[0])[0])
    assert after < before and steps[1] <= (after + 0.005) * 1e-3, (search, steps)  # the note rounds to 0.01 ms
    assert steps[1] <= 1.10 * steps[0], steps


@pytest.mark.slow  # 31 s on 2 cores
def test_the_search_under_a_cap_moves_whole_layers_where_the_model_has_them() -> None:
    # nmt_free with SGD on two K40s capped at 720 MiB (57% of its one-device need, 1,252 MiB;
    # activations, not Adam's moments, fill the devices): the search over runs of groups cut
    # anywhere gets little past the moves' fit, 222.7 -> 221.9 ms; over the model's layers too
    # (place() gives the Problem a spec-built model's layers) it reaches 187.9, under greedy's own
    # uncapped 204.8. (At 740 MiB, since the simulator takes the executor's turns, the moves' fit
    # is within 1% of the uncapped step and no search runs.)
    loaded = _variant("nmt.yaml", "nmt_free", 2, optimizer="sgd")
    sg = build_step(build_model(loaded), step_config(loaded))
    c = cluster_for(step_config(loaded), "2xgpu:k40:720MiB")
    runs, layers = (place(sg.graph, c, StaticCostModel(c, batch=64), "greedy", targets=[sg.targets[0]], layers=lay)
                    for lay in (None, sg.model.layer_of()))
    assert runs.valid and layers.valid
    assert not any("by layers" in n for n in runs.notes)
    assert any("local search" in n and "by layers" in n for n in layers.notes), layers.notes
    assert layers.step_time <= 0.95 * runs.step_time, (layers.step_time, runs.step_time)


def test_climb_exchanges_two_units_where_no_single_move_fits() -> None:
    # Two devices holding 2 each; units of 2 (on device 0) and 1 (on device 1) are faster the
    # other way round. Either alone moved overflows the device it reaches; exchanged, both fit.
    units = SimpleNamespace(feasible=[frozenset({0, 1})] * 2)
    size = [2, 1]

    def score(u: np.ndarray) -> tuple[float, float]:
        held = [sum(s for s, d in zip(size, u) if d == x) for x in (0, 1)]
        return float(sum(max(0, h - 2) for h in held)), (0.0 if list(u) == [1, 0] else 1.0)

    start = np.array([0, 1])
    cur, key, used = climb(units, start, score(start), score, 100)  # type: ignore[arg-type]
    assert list(cur) == [0, 1] and key == (0.0, 1.0) and used == 2
    cur, key, _ = climb(units, start, score(start), score, 100, swaps=True)  # type: ignore[arg-type]
    assert list(cur) == [1, 0] and key == (0.0, 0.0)
    cur, key, _ = climb(units, start, score(start), score, 100, swaps=True, frozen=frozenset({1}))  # type: ignore[arg-type]
    assert list(cur) == [0, 1]


@pytest.mark.slow  # 16-22 s on 2 cores; every placer's capped fit stays in the default set (the 4-layer LSTM's)
def test_nmt_without_constraints_under_a_cap_spreads_from_every_placers_own_choice() -> None:
    # bench placement's nmt_free rows at 60% of the one-device need: on two K40s the single
    # device's placement is spread by the moves; on four H100s at PCIe 3.0 rates (the harder case)
    # heft's placement fitted by the moves was 26.5 ms against its own 18.8 (30.5 before Adam's
    # moments were counted). The local search fits both, heft within 10% of its uncapped step.
    _, one, _ = _nmt_free_steps(2, "k40", "single")
    assert one.valid and len(set(one.device_index)) == 2
    steps, pl, _ = _nmt_free_steps(4, "h100", "heft", "@pcie3")
    assert pl.valid and steps[1] <= 1.10 * steps[0], steps


@pytest.mark.slow  # 35-39 s on a 2-core host: run with -m slow
def test_heft_over_a_little_moves_the_one_group_that_costs_least() -> None:
    # nmt_free on 4 H100s (at PCIe 3.0 rates) with each GPU 3% short of what heft's own placement puts on its fullest
    # one: moving the fewest groups moved a 2 GiB group and lost 9.5% (with the step's memory
    # before the fused Adam update); moving the one group whose absence costs least keeps heft
    # within 10%.
    loaded = _variant("nmt.yaml", "nmt_free", 4)
    sg = build_step(build_model(loaded), step_config(loaded))
    free = cluster_for(step_config(loaded), "4xgpu:h100@pcie3")
    own = place(sg.graph, free, StaticCostModel(free, batch=64), "heft", targets=[sg.targets[0]])
    cap = int(0.97 * max(d.peak_memory for d in own.devices)) >> 20
    c = cluster_for(step_config(loaded), f"4xgpu:h100:{cap}MiB@pcie3")
    capped = place(sg.graph, c, StaticCostModel(c, batch=64), "heft", targets=[sg.targets[0]])
    assert capped.valid and capped.step_time <= 1.10 * own.step_time, (capped.step_time, own.step_time)

def test_a_device_a_little_over_moves_a_small_group_when_no_large_one_fits_elsewhere() -> None:
    # The expert's layer-per-GPU stages of NMT over two K40s, each capped 5 MiB under what the
    # expert's own placement puts on its fullest GPU (Adam's moments counted, 60% of the
    # one-device need no longer binds them): gpu:1 is a little over and its largest groups (117
    # MiB tables and their moments) overflow gpu:0 wherever they go; a small group holding the
    # difference fits, moved one at a time.
    loaded = _variant("nmt.yaml", "nmt_free", 2)
    sg = build_step(build_model(loaded), step_config(loaded))
    free = cluster_for(step_config(loaded), "2xgpu:k40")
    own = place(sg.graph, free, StaticCostModel(free, batch=64), "expert", targets=[sg.targets[0]],
                rules=step_config(loaded).expert_rules(), layers=sg.model.layer_of())
    cap = (max(d.peak_memory for d in own.devices) >> 20) - 5
    steps, pl, _ = _nmt_free_steps(2, "k40", "expert", cap=cap)
    assert pl.valid and steps[1] <= 1.10 * steps[0], steps
    assert any("moved one at a time" in n for n in pl.notes), pl.notes


def test_bench_placement_with_learned_steps_gives_the_same_figures_twice() -> None:
    # A budget in seconds ends wherever the machine's load lets it; in updates the row repeats.
    from flowctl.bench.placement import placement_suite

    def once() -> dict:
        return placement_suite(placers=("heft", "learned"), rows="lstm4/2xk40", capped=False, learned_steps=2)

    a, b = once(), once()
    assert a["learned_steps"] == 2 and a["learned_budget_s"] is None
    row_a, row_b = a["rows"][0]["results"], b["rows"][0]["results"]
    assert row_a["learned"]["step_ms"] == row_b["learned"]["step_ms"]
    assert row_a["learned"]["curve"] == row_b["learned"]["curve"]
    assert row_a["learned"]["step_ms"] <= row_a["heft"]["step_ms"]
