"""`flowctl graph SPEC --out page.html`: the page of a placed training step, checked as data and in
a real browser (tests/browser.py: Playwright's Chromium or one on the PATH; one launch for the
module) through the DOM's bounding boxes, on the shipped specs/lstm_lm.yaml and
specs/inception_v3.yaml at a 1600x1000 window after the page's own fit to the window:

- the forward pass runs top-down: every edge between boxes points down, the input above the loss;
- each edge ends in an arrowhead (an SVG marker);
- no two boxes overlap, and every top-level layer and block is inside the window and the graph's
  pane; the side panel lies beside them and its op column inside it;
- every box shows its whole name inside it;
- a block opens on a click into its layers (no overlaps, inside its frame) and closes again."""
from __future__ import annotations

import json
import re
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.spec.loader import load_spec
from browser import chromium
from tiny_specs import LM_TWO_DEVICES

ROOT = Path(__file__).resolve().parents[1]
SPECS = {"lstm_lm": ROOT / "specs" / "lstm_lm.yaml", "inception_v3": ROOT / "specs" / "inception_v3.yaml"}
WINDOW = {"width": 1600, "height": 1000}

NESTED = """\
version: 1
name: nested
model:
  blocks:
    inner:
      params: {f: null}
      layers:
        - {name: c, type: conv2d, filters: "${f}", kernel: 1}
        - {name: d, type: conv2d, filters: "${f}", kernel: 1}
    outer:
      params: {f: 2}
      layers:
        - {name: first, block: inner, params: {f: "${f}"}}
        - {name: side, type: conv2d, filters: 1, kernel: 1, inputs: [$input]}
        - {name: join, type: concat, inputs: [first, side]}
  layers:
    - {name: image, type: input, shape: [8, 8, 3]}
    - {name: stack, block: outer, repeat: 2, names: [s1, s2], params: {f: 4}}
    - {name: flat, type: flatten}
    - {name: logits, type: dense, units: 10}
    - {name: label, type: input, shape: [], dtype: int32, classes: 10}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, label]}
training: {optimizer: {type: sgd}, learning_rate: 0.1, batch_size: 4, steps: 2}
"""

GEOMETRY = """() => {
  const box = e => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; };
  return {
    boxes: [...document.querySelectorAll('g.node')].map(g => ({
      name: g.dataset.name, kind: g.dataset.kind, box: box(g.querySelector('rect')),
      label: g.querySelector('text.name:not(.icon)').textContent,
      text: box(g.querySelector('text.name:not(.icon)'))})),
    edges: [...document.querySelectorAll('path.edge')].map(p => ({
      from: p.dataset.from, to: p.dataset.to, marker: p.getAttribute('marker-end')})),
    arrow: !!document.querySelector('svg defs marker#arrow path'),
    frames: Object.fromEntries([...document.querySelectorAll('rect.frame')].map(f => [f.dataset.name, box(f)])),
    side: box(document.getElementById('side')), graph: box(document.getElementById('graph')),
  };
}"""


def _write(spec: Path, out: Path) -> str:
    r = CliRunner().invoke(cli, ["graph", str(spec), "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out.read_text()


def _data(text: str) -> dict[str, Any]:
    return json.loads(re.search(r"const DATA = (.*);\n", text).group(1))


def _top_level(spec: Path) -> tuple[dict[str, str], set[tuple[str, str]]]:
    """From the spec itself: each layer's top-level box (its outermost block instance, or itself)
    and the edges the forward pass draws between those boxes."""
    loaded = load_spec(str(spec), ())
    outer = sorted((i.name for i in loaded.instances), key=len)
    unit = {name: next((b for b in outer if name.startswith(b + "/")), name) for name in loaded.layers}
    edges = {(unit[i], unit[name]) for name, info in loaded.layers.items() for i in info.inputs
             if unit[i] != unit[name]}
    return unit, edges


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _inside(inner: list[float], outer: list[float]) -> bool:
    return outer[0] <= inner[0] and inner[2] <= outer[2] and outer[1] <= inner[1] and inner[3] <= outer[3]


def _centre_y(box: list[float]) -> float:
    return (box[1] + box[3]) / 2


def _check_drawing(geo: dict[str, Any], labels: dict[str, str]) -> dict[str, list[float]]:
    """What holds at any moment: no overlaps, whole names inside their boxes, arrowheads, every edge
    pointing down, the side panel clear of the boxes. Returns name -> box."""
    boxes = {b["name"]: b["box"] for b in geo["boxes"]}
    assert len(boxes) == len(geo["boxes"])
    for a, b in combinations(geo["boxes"], 2):
        assert not _overlap(a["box"], b["box"]), (a["name"], b["name"])
    for b in geo["boxes"]:
        assert b["label"] == labels[b["name"]], b
        assert b["box"][0] <= b["text"][0] and b["text"][2] <= b["box"][2], b  # the name fits its box
        assert not _overlap(b["box"], geo["side"]), b
    assert geo["arrow"] and geo["edges"]
    for e in geo["edges"]:
        assert e["marker"] == "url(#arrow)", e
        assert _centre_y(boxes[e["from"]]) < _centre_y(boxes[e["to"]]), e  # the forward pass runs down
    return boxes


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("graph")
    out = {}
    for name, spec in SPECS.items():
        out[name] = d / f"{name}.html"
        _write(spec, out[name])
    return out


@pytest.fixture
def open_page(browser):
    """Open a page with the network cut: every request other than the file itself is recorded and
    refused, and the page's script errors are collected."""
    context = browser.new_context(viewport=WINDOW)
    page = context.new_page()
    seen: dict[str, list[str]] = {"requests": [], "errors": []}
    page.on("pageerror", lambda e: seen["errors"].append(str(e)))

    def refuse(route):
        seen["requests"].append(route.request.url)
        route.abort()

    page.route(re.compile(r"^(?!file:).*"), refuse)

    def go(path: Path):
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready]")
        return page

    yield go, seen
    context.close()
    assert seen == {"requests": [], "errors": []}


def test_the_page_data_is_the_spec_forward_pass_with_every_node_in_one_place(tmp_path):
    spec = tmp_path / "lstm2.yaml"
    spec.write_text(LM_TWO_DEVICES)
    text = _write(spec, tmp_path / "g.html")
    data = _data(text)
    layers = {l["name"]: l for l in data["layers"]}
    assert list(layers) == ["tokens", "embedding", "lstm_1", "lstm_2", "softmax", "targets", "loss"]
    assert layers["loss"]["inputs"] == ["softmax", "targets"] and layers["lstm_2"]["inputs"] == ["lstm_1"]
    assert layers["embedding"]["device"].endswith("cpu:0") and layers["lstm_2"]["device"].endswith("cpu:1")
    assert any(n[0].startswith("gradients/lstm_2/") for n in layers["lstm_2"]["nodes"])  # backward with its layer
    listed = [n[0] for l in data["layers"] for n in l["nodes"]] + [n[0] for o in data["other"] for n in o["nodes"]]
    assert len(listed) == len(set(listed)) == data["nodes"]
    # Self-contained: no fetched script, style or font (the SVG namespace is a name, not a request).
    assert set(re.findall(r"https?://[^\s\"'<>)]+", text)) <= {"http://www.w3.org/2000/svg"}
    assert "<link" not in text and "<script src" not in text
    # Each replica's copy of a layer, and its gradients, count as that layer's nodes.
    dp = tmp_path / "dp.html"
    r = CliRunner().invoke(cli, ["graph", str(ROOT / "specs" / "demo.yaml"), "--devices", "cpu:0,cpu:1",
                                 "--set", "parallelism={strategy: sync_data_parallel}", "--out", str(dp)])
    assert r.exit_code == 0, r.output
    data = _data(dp.read_text())
    assert not [o["name"] for o in data["other"] if o["name"].startswith("replica_")]
    hidden = next(l for l in data["layers"] if l["name"] == "hidden_1")
    assert {n[0].split("/")[0] for n in hidden["nodes"]} >= {"hidden_1", "replica_0", "replica_1"}


def test_inception_blocks_and_optimizer_slots_belong_to_their_layers(pages):
    data = _data(pages["inception_v3"].read_text())
    blocks = {b["name"]: b for b in data["blocks"]}
    assert list(blocks)[:3] == ["mixed_5b", "mixed_5c", "mixed_5d"] and len(blocks) == 11
    assert blocks["mixed_6b"]["block"] == "inception_c" and blocks["mixed_6b"]["parent"] is None
    layers = {l["name"]: l for l in data["layers"]}
    assert layers["mixed_5b/branch1x1"]["block"] == "mixed_5b" and layers["mixed_5b/branch1x1"]["label"] == "branch1x1"
    assert layers["conv_1a_3x3"]["block"] is None
    # Momentum's slots are scoped under the layer's name: they are the layer's nodes, not a group of
    # their own named after the block.
    assert any("/Momentum" in n[0] for n in layers["mixed_5b/branch1x1"]["nodes"])
    assert not {o["name"] for o in data["other"]} & set(blocks)


@pytest.mark.parametrize("name", ["lstm_lm", "inception_v3"])
def test_the_forward_pass_fits_the_window_top_down_with_arrowheads(open_page, pages, name):
    go, _ = open_page
    page = go(pages[name])
    unit, edges = _top_level(SPECS[name])
    tops = set(unit.values())
    geo = page.evaluate(GEOMETRY)
    boxes = _check_drawing(geo, {u: u for u in tops})
    assert set(boxes) == tops  # blocks start closed: one box each
    window = [0, 0, WINDOW["width"], WINDOW["height"]]
    for n, b in boxes.items():
        assert _inside(b, window) and _inside(b, geo["graph"]), (n, b, geo["graph"])
    assert {(e["from"], e["to"]) for e in geo["edges"]} == edges
    first, loss = ("embedding", "loss") if name == "lstm_lm" else ("image", "loss")
    assert boxes[first][3] < boxes[loss][1]
    assert geo["side"][0] >= geo["graph"][2] - 1  # the panel is beside the graph, not over it


def test_a_layer_lists_its_nodes_in_the_panel_with_the_op_column_whole(open_page, pages):
    go, _ = open_page
    page = go(pages["lstm_lm"])
    page.locator('g.node[data-name="lstm_2"]').click()
    assert page.locator("#side h3").inner_text() == "lstm_2"
    assert page.locator("#side td.op").count() > 10
    got = page.evaluate("""() => {
      const side = document.getElementById('side'), r = side.getBoundingClientRect();
      const ops = [...side.querySelectorAll('td.op, td.device')].map(td => td.getBoundingClientRect());
      return {inside: ops.every(b => b.left >= r.left && b.right <= r.right),
              wide: side.scrollWidth > side.clientWidth,
              ops: [...side.querySelectorAll('td.op')].map(td => td.textContent)}; }""")
    assert got["inside"] and not got["wide"]
    assert {"MatMul", "LSTMBlockCell"} <= set(got["ops"])
    _check_drawing(page.evaluate(GEOMETRY), {u: u for u in _top_level(SPECS["lstm_lm"])[0].values()})


def test_a_block_opens_on_a_click_into_its_layers_and_closes(open_page, pages):
    go, _ = open_page
    page = go(pages["inception_v3"])
    unit, _ = _top_level(SPECS["inception_v3"])
    labels = {u: u for u in unit.values()} | {n: n.split("/", 1)[1] for n in unit if "/" in n}
    for block in ("mixed_5b", "mixed_7b"):  # a 35x35 module, and an 8x8 one with branches of branches
        page.locator(f'g.node[data-name="{block}"]').click()
        geo = page.evaluate(GEOMETRY)
        boxes = _check_drawing(geo, labels)
        inner = {n for n, u in unit.items() if u == block}
        assert block not in boxes and inner <= set(boxes)
        for n in inner:
            assert _inside(boxes[n], geo["frames"][block]), n
        drawn = {(e["from"], e["to"]) for e in geo["edges"]}
        assert (f"{block}/branch1x1", f"{block}/concat") in drawn
        assert "block " + "inception" in page.locator("#side").inner_text()
    page.locator("text.head", has_text="mixed_5b").click()
    geo = page.evaluate(GEOMETRY)
    boxes = _check_drawing(geo, labels)
    assert "mixed_5b" in boxes and "mixed_5b/concat" not in boxes and "mixed_7b/concat" in boxes
    page.locator("#expand-all").click()
    boxes = _check_drawing(page.evaluate(GEOMETRY), labels)
    assert set(boxes) == set(unit)  # every layer of every block, none on another


def test_a_block_inside_a_block_opens_inside_its_frame(open_page, tmp_path):
    spec = tmp_path / "nested.yaml"
    spec.write_text(NESTED)
    _write(spec, tmp_path / "nested.html")
    go, _ = open_page
    page = go(tmp_path / "nested.html")
    labels = {"image": "image", "flat": "flat", "logits": "logits", "label": "label", "loss": "loss",
              "s1": "s1", "s2": "s2", "s1/first": "first", "s1/side": "side", "s1/join": "join",
              "s1/first/c": "c", "s1/first/d": "d"}
    assert set(_check_drawing(page.evaluate(GEOMETRY), labels)) == {"image", "s1", "s2", "flat", "logits", "label",
                                                                    "loss"}
    page.locator('g.node[data-name="s1"]').click()
    page.locator('g.node[data-name="s1/first"]').click()
    geo = page.evaluate(GEOMETRY)
    boxes = _check_drawing(geo, labels)
    assert {"s1/first/c", "s1/first/d", "s1/side", "s1/join", "s2"} <= set(boxes) and "s1/first" not in boxes
    assert _inside(geo["frames"]["s1/first"], geo["frames"]["s1"])
    for n in ("s1/first/c", "s1/first/d"):
        assert _inside(boxes[n], geo["frames"]["s1/first"])
    assert {("image", "s1/first/c"), ("image", "s1/side"), ("s1/first/d", "s1/join"), ("s1/join", "s2")} <= \
        {(e["from"], e["to"]) for e in geo["edges"]}
