"""Wide tables at 80 columns: `place`, `place --explain` (by node and by layer), `inspect`, `bench`
and `evaluate` keep every node and layer name whole on one line, and no line is wider than the
terminal; other columns wrap, and a table that cannot keep its names whole becomes records."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.cells import cell_len
from rich.console import Console

from flowctl.cli.main import cli
from flowctl.cli.tables import Col, abbreviate, fit
from flowctl.spec.loader import load_spec
from flowctl.spec.summary import summarize
from flowctl.training.program import plan
from test_place_cli import TWO_TOWERS

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
NARROW = {"COLUMNS": "80"}
# test_place_cli's two towers, without placement rules.
TOWERS = TWO_TOWERS[:TWO_TOWERS.index("placement:")] + "training: {batch_size: 16, steps: 5}\n"


def _run(*args: str) -> str:
    r = CliRunner(env=NARROW).invoke(cli, list(args))
    assert r.exit_code == 0, r.output
    return r.output


def _whole(name: str, text: str) -> bool:
    """`name` on one line with a space, a rule or the line's end either side (not a cut piece)."""
    return re.search(rf"(^|[\s│]){re.escape(name)}($|[\s│])", text, re.M) is not None


def _assert_fits(text: str, width: int = 80, tables_only: bool = False) -> None:
    """No line wider than the terminal (`tables_only`: no table line; the command's sentences are
    printed unwrapped for the terminal to wrap)."""
    wide = [line for line in text.splitlines()
            if cell_len(line) > width and (not tables_only or re.search("[│┃┏┗└┌]", line))]
    assert not wide, wide[:3]


def test_place_explain_by_node_keeps_every_node_name_whole():
    """lstm_lm's gradient names run to 46 characters: seven columns cannot hold them at 80, so
    the nodes are listed as records, each name whole on a line of its own."""
    out = _run("place", str(SPECS / "lstm_lm.yaml"), "--devices", "cpu:0,cpu:1", "--explain", "--limit", "0")
    _assert_fits(out)
    placed = plan(load_spec(SPECS / "lstm_lm.yaml", ("devices=[cpu:0, cpu:1]",)), compare=())
    names = [r.name for r in placed.chosen.node_reports()]
    assert max(map(len, names)) > 40
    missing = [n for n in names if not _whole(n, out)]
    assert not missing, missing[:5]
    assert "…" not in out
    for device in ("cpu:0", "cpu:1"):  # the per-device table: its names and numbers whole too
        assert _whole(device, out)
    assert _whole("greedy (chosen)", out) and "parallelism.groups)" in out


def test_place_explain_by_layer_keeps_inceptions_layer_names_whole():
    out = _run("place", str(SPECS / "inception_v3.yaml"), "--explain", "--by", "layer", "--limit", "0")
    _assert_fits(out)
    layers = [layer["name"] for layer in summarize(load_spec(SPECS / "inception_v3.yaml"))["layers"]]
    assert max(map(len, layers)) >= 24
    assert "┃ layer" in out  # still a table: the names fit beside the other columns
    missing = [n for n in layers if not _whole(n, out)]
    assert not missing, missing[:5]


def test_inspect_keeps_layer_and_block_names_whole():
    for spec in ("inception_v3.yaml", "nmt.yaml"):
        out = _run("inspect", str(SPECS / spec))
        _assert_fits(out, tables_only=True)
        report = summarize(load_spec(SPECS / spec))
        names = [x["name"] for x in report["layers"]] + [x["name"] for x in report["blocks"]]
        missing = [n for n in names if not _whole(n, out)]
        assert not missing, (spec, missing[:5])
        assert "…" not in out


def test_bench_tables_keep_their_names_whole(tmp_path):
    spec = tmp_path / "towers.yaml"
    spec.write_text(TOWERS)
    out = _run("bench", str(spec), "--algorithms", "single,greedy", "--steps", "1", "--rounds", "1",
               "--out", str(tmp_path / "b.json"))
    _assert_fits(out)
    for name in ("1 device, 2 threads", "single", "greedy"):
        assert _whole(name, out), name
    out = _run("bench", "prefetch", "--quick")
    _assert_fits(out)
    for name in ("steps_per_s_plain", "steps_per_s_prefetch", "ideal_speedup"):
        assert _whole(name, out), name


def test_evaluate_names_its_metrics_whole(tmp_path):
    run = tmp_path / "run"
    _run("train", str(SPECS / "demo.yaml"), "--run-dir", str(run), "--set", "training.steps=20",
         "--set", "training.eval_every_steps=20")
    out = _run("evaluate", str(run))
    _assert_fits(out)
    metrics = [k for k in json.loads(_run("evaluate", str(run), "--json").splitlines()[-1]) if k.startswith("val/")]
    assert metrics and all(_whole(m, out) for m in metrics)


def _render(renderable, width: int) -> str:
    con = Console(width=width, record=True, file=io.StringIO())
    con.print(renderable)
    return con.export_text()


def test_fit_gives_the_other_columns_width_and_keeps_numbers_whole():
    rows = [["encoder/attention/projection_weights", "MatMul", "123,456,789", "a note " * 6]]
    cols = [Col("name"), Col("op"), Col("FLOPs", "right", True), Col("why")]
    text = _render(fit("t", cols, rows, 80), 80)
    _assert_fits(text)
    assert _whole(rows[0][0], text) and _whole("123,456,789", text) and "┃ name" in text
    assert text.count("a note") == 6  # wrapped, not cut


def test_fit_falls_back_to_records_and_abbreviates_only_a_name_longer_than_the_line():
    name = "gradients/" + "/".join(f"scope_{i}" for i in range(12))
    rows = [[name, "Op", "cpu:0"], ["short/name", "Op", "cpu:1"]]
    text = _render(fit("t", [Col("node"), Col("op"), Col("device")], rows, 60), 60)
    _assert_fits(text, 60)
    assert _whole("short/name", text) and "op: Op; device: cpu:1" in text
    shown = abbreviate(name, 60)
    assert len(name) > 60 and len(shown) == 60 and _whole(shown, text)
    assert shown.startswith("gradients/scope_0") and shown.endswith("scope_11") and "…" in shown
    assert abbreviate("short", 60) == "short"


@pytest.mark.parametrize("width", [40, 80, 120])
def test_fit_never_overflows(width):
    rows = [[f"layer_{i}/" + "x" * (i * 3), str(10 ** i), "text " * i] for i in range(12)]
    text = _render(fit("t", [Col("layer"), Col("n", "right", True), Col("note")], rows, width), width)
    _assert_fits(text, width)
    for r in rows:
        assert _whole(abbreviate(r[0], width), text)


def test_place_per_device_sizes_keep_their_units_at_80_columns() -> None:
    # One profile for every device: named once in the title, and each size with its unit on its line.
    out = _run("place", str(SPECS / "nmt.yaml"), "--devices", "2xgpu:h100", "-a", "greedy")
    assert "per device (all h100)" in out
    rows = [line for line in out.splitlines() if re.match(r"│\s+gpu:\d", line)]
    assert len(rows) == 2
    for line in rows:
        cells = [c.strip() for c in line.strip("│").split("│")]
        assert all(re.fullmatch(r"[\d.,]+ (B|KiB|MiB|GiB)", c) for c in cells[3:6]), line


@pytest.mark.parametrize("columns", ["80", "120"])
def test_place_explain_keeps_the_tensor_names_held_at_peak_whole(columns: str) -> None:
    """NMT's largest tensors at each device's peak: each name whole on one line (at 80 columns a
    46-character gradient was folded after 44), as a table where it fits, else as records. With
    the optimizer's slots resident, Adam's moments of the embedding tables (30 characters) lead."""
    r = CliRunner(env={"COLUMNS": columns}).invoke(cli, ["place", str(SPECS / "nmt.yaml"), "--explain",
                                                         "--limit", "1"])
    assert r.exit_code == 0, r.output
    out = r.stdout
    _assert_fits(out, int(columns), tables_only=True)
    placed = plan(load_spec(SPECS / "nmt.yaml"), compare=())
    held = [h["node"] for hs in placed.chosen.held_at_peak(limit=3).values() for h in hs]
    assert max(map(len, held)) >= 30
    missing = [n for n in held if not _whole(n, out)]
    assert not missing, missing
    assert "resident" in out and not re.search(r"│ nt +│", out)  # the kind, one word, not folded either
