"""The explanation tells the truth: candidates and choice agree, "only feasible device" means one,
a failed placement names what ran out of memory, a conflict is short with the rest in details."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import flowctl as fc
from flowctl.cli.main import cli
from flowctl.engine.placement import evaluate, place
from flowctl.spec.loader import load_spec
from flowctl.training.program import plan
from tests.test_placement import CPU0, FixedCosts, cpus, two_big_variables

ROOT = Path(__file__).resolve().parents[1]


def _check_decisions(pl: fc.PlacementError | object) -> int:
    checked = 0
    for dec in pl.decisions:  # type: ignore[attr-defined]
        if dec.reason == "only feasible device":
            assert len(dec.feasible) == 1, dec
        if not dec.candidates:
            continue
        eligible = [c for c in dec.candidates if not c.note]
        if eligible:
            best = min(eligible, key=lambda c: c.score)
            chosen = next(c for c in dec.candidates if c.device == dec.choice)
            assert chosen.score == best.score, (dec.first, dec.choice, [(c.device, c.score) for c in eligible])
            assert not chosen.note
            checked += 1
        if len(dec.feasible) > 1:
            assert dec.reason != "only feasible device"
    return checked


@pytest.mark.parametrize("algorithm", ["greedy", "heft"])
def test_every_decision_chose_the_least_compared_candidate_on_lstm4(algorithm: str) -> None:
    p = plan(load_spec(str(ROOT / "specs" / "lstm4.yaml")), algorithm, "4xgpu:k40", compare=(), batch=20)
    assert _check_decisions(p.chosen) > 10


@pytest.mark.slow
def test_every_decision_chose_the_least_compared_candidate_on_nmt() -> None:
    p = plan(load_spec(str(ROOT / "specs" / "nmt.yaml")), "greedy", "4xgpu:k40", compare=())
    assert _check_decisions(p.chosen) > 10
    # "attention" (the case the issue reported): its decision's choice is its least candidate
    att = [d for d in p.chosen.decisions if d.first.startswith("attention") and d.candidates]
    assert all(min((c for c in d.candidates if not c.note), key=lambda c: c.score).device == d.choice
               for d in att)


def test_the_explanation_table_marks_the_choice_among_the_compared_numbers() -> None:
    r = CliRunner().invoke(cli, ["place", str(ROOT / "specs" / "lstm4.yaml"), "--devices", "4xgpu:k40",
                                 "-a", "heft", "--explain"])
    assert r.exit_code == 0, r.output
    assert "the least wins" in r.output and "*" in r.output


def test_a_placement_out_of_memory_names_the_devices_and_the_nodes_holding_it() -> None:
    g, targets = two_big_variables()
    cl = cpus(2, memory=10_000)
    cm = FixedCosts(cl, {})
    pl = evaluate(g, {n: CPU0 for n in g.nodes}, cl, cm, targets=targets)
    with pytest.raises(fc.PlacementError) as e:
        pl.check()
    msg = str(e.value)
    assert "needs 11.72 KiB" in msg and ("at the peak: 'w0'" in msg or "at the peak: 'w1'" in msg)
    report = e.value.details["devices"]
    assert [r["device"] for r in report] == [CPU0]
    assert {x["node"] for x in report[0]["largest"]} >= {"w0", "w1"}
    # What it lists is what the device holds at its peak: the bytes add up to the peak.
    assert sum(x["bytes"] for x in report[0]["largest"]) == report[0]["peak"]
    assert report[0]["over"] == report[0]["peak"] - report[0]["capacity"] > 0
    small = cpus(2, memory=5_000)  # not even one variable fits a device
    with pytest.raises(fc.PlacementError) as e2:
        place(g, small, FixedCosts(small, {}), "single", targets=targets)
    assert "largest there" in str(e2.value) and e2.value.details["kind"] == "out_of_memory"


def test_a_large_colocation_conflict_is_a_short_message_with_every_member_under_json(tmp_path: Path) -> None:
    d = yaml.safe_load((ROOT / "specs" / "lstm4.yaml").read_text())
    d["devices"] = ["cpu:0", "gpu:0", "gpu:1"]
    d["placement"] = {"constraints": [{"match": "lstm_1", "device": "gpu:0"}, {"match": "lstm_2", "device": "gpu:1"}],
                      "colocate": [["lstm_1", "lstm_2"]]}  # two layers pinned to two GPUs, colocated
    spec = tmp_path / "conflict.yaml"
    spec.write_text(yaml.safe_dump(d, sort_keys=False))
    r = CliRunner().invoke(cli, ["place", str(spec)])
    assert r.exit_code == 4
    msg = r.output.strip()
    assert len(msg) < 1200, len(msg)
    assert "device='gpu:1'" in msg and "device='gpu:0'" in msg and "more" in msg
    j = CliRunner().invoke(cli, ["place", str(spec), "--json"])
    assert j.exit_code == 4
    out = json.loads(j.stdout.strip().splitlines()[0])
    det = out["details"]
    assert det["kind"] == "colocation_conflict" and len(det["members"]) > 40
    assert sum(f"'{m}'" in msg for m in det["members"]) < len(det["members"]) // 4  # a few named, all in the JSON
    assert any(m.startswith("lstm_1") for m in det["members"])
    assert any(m.startswith("lstm_2") for m in det["members"])


def test_a_node_grouped_with_a_pinned_one_says_so_not_only_feasible_device() -> None:
    """NMT's inputs may run anywhere; the coarsening groups each with its embedding's lookup, which
    a rule pins to a GPU: that is why they are there, and the explanation says it (it said "only
    feasible device" beside three feasible devices and "narrowed by: -")."""
    p = plan(load_spec(str(ROOT / "specs" / "nmt.yaml")), compare=())
    decisions = {d.first: d for d in p.chosen.decisions}
    reports = {r.name: r for r in p.chosen.node_reports()}
    for node, pinned, device in (("source", "encoder/", "gpu:0"), ("target_in", "decoder/", "gpu:1")):
        assert len(reports[node].feasible) > 1 and not reports[node].narrowed_by  # free on its own
        why = decisions[node].reason
        assert why.startswith(f"grouped with '{pinned}") and f"constraint device='{device}'" in why, why
    # A node its own rule pins keeps the short reason.
    assert decisions["encoder/embedding/table"].reason == "only feasible device"
    assert len(reports["encoder/embedding/table"].feasible) == 1
